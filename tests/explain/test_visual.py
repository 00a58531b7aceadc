"""``multihead explain --format html|png``: the page is self-contained, complete and exact; the PNG
grid has one panel per head; user mistakes exit 2 with one line."""

from __future__ import annotations

import html
import importlib.util
import io
import json
import re
import sys

import pytest
import torch

from multihead import Trace
from multihead.cli import main, parse_options
from multihead.explain import visual
from multihead.explain.visual import HeadMaps, head_maps_from_trace, render_html, step_kind
from multihead.explain.example import trace_example
from multihead import steps
from multihead.explain.i18n import LANGS, check_name, describe_step, note_text, step_title, trace_sizes
from multihead.explain.visual_svg import axis_sizes, parse_pattern, step_svg

CONFIGS = {
    "default": [],
    "gqa-cross": ["--heads", "4", "--kv-heads", "2", "--d-out", "16", "--tokens", "4", "--keys", "6", "--causal"],
    "no-causal-dropout": ["--no-causal", "--dropout", "0.3", "--batch", "3"],
}


def _args(extra, fmt="html", out="x"):
    return parse_options(["--format", fmt, "--out", str(out), *extra])


def _trace(extra, fmt="html"):
    """The trace the CLI draws for these options: the walkthrough's example."""
    return trace_example(_args(extra, fmt).example)


def _json_block(page: str) -> dict:
    blocks = re.findall(r'<script type="application/json" id="mh-data">(.*?)</script>', page, re.S)
    assert len(blocks) == 1
    return json.loads(blocks[0])


def _cli(argv):
    out, err = io.StringIO(), io.StringIO()
    rc = main(argv, stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    """name -> (page text, trace of the same configuration)."""
    result = {}
    for name, extra in CONFIGS.items():
        path = tmp_path_factory.mktemp(name) / "walkthrough.html"
        rc, out, err = _cli(["explain", "--format", "html", "--out", str(path), *extra])
        assert (rc, err) == (0, "")
        assert str(path) in out
        result[name] = (path.read_text(encoding="utf-8"), _trace(extra))
    return result


# ---------------------------------------------------------------------------- the page
@pytest.mark.parametrize("name", CONFIGS)
def test_html_is_self_contained(pages, name):
    page, _ = pages[name]
    assert page.startswith("<!DOCTYPE html>")
    assert not re.search(r"(?i)\b(https?:)?//[a-z0-9.-]+\.[a-z]", page), "a URL would need the network"
    assert not re.search(r"(?i)<link\b|<iframe\b|<img\b|@import|url\(", page)
    scripts = re.findall(r"(?i)<script\b([^>]*)>", page)
    assert scripts == [' type="application/json" id="mh-data"', ""], "only the data block and one inline script"


@pytest.mark.parametrize("name", CONFIGS)
def test_html_has_every_step_with_its_shape_and_kind(pages, name):
    page, trace = pages[name]
    sections = re.findall(r'<li class="step (\w+)" id="step-(\d+)" data-step="([^"]*)">', page)
    assert len(sections) == len(trace.steps)
    for (kind, index, label), step in zip(sections, trace.steps):
        assert html.unescape(label) == step.label
        assert kind == step_kind(step)
    for step in trace.steps:
        if step.pattern:
            assert html.escape(step.pattern) in page
    assert page.count('<div class="figure" role="img"') == len(trace.steps)
    assert f'<code id="backend">{trace.config["backend"]}</code>' in page
    for check, ok in trace.checks.items():
        assert f'<span class="mark">{"✓" if ok else "✗"}</span> <span data-l="en" lang="en">{html.escape(check)}</span>' in page
    for step in trace.steps:  # every check also in Chinese, after its English text
        for name, ok in step.checks.items():
            zh = f"{step_title(step, 'zh')}: {check_name(name, 'zh')}"
            assert f'{html.escape(step.label)}: {html.escape(name)}</span><span data-l="zh" lang="zh">{html.escape(zh)}</span></li>' in page


@pytest.mark.parametrize("name", CONFIGS)
def test_json_block_holds_exactly_the_traced_tensors(pages, name):
    page, trace = pages[name]
    data = _json_block(page)
    weights = trace.step("softmax").tensor
    scores = trace.step("scale").tensor
    assert len(data["maps"]) == weights.shape[0]
    assert [s["name"] for s in data["steps"]] == [s.label for s in trace.steps]
    for b, m in enumerate(data["maps"]):
        assert torch.equal(torch.tensor(m["weights"], dtype=torch.float32), weights[b])
        assert torch.equal(torch.tensor(m["scores"], dtype=torch.float32), scores[b])


@pytest.mark.parametrize("name", CONFIGS)
def test_json_weights_are_the_softmax_of_the_json_scores_under_the_json_mask(pages, name):
    """An independent float64 recomputation from what the page shows."""
    data = _json_block(pages[name][0])
    for m in data["maps"]:
        scores = torch.tensor(m["scores"], dtype=torch.float64)
        keep = torch.tensor(m["keep"], dtype=torch.bool)
        expected = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
        got = torch.tensor(m["weights"], dtype=torch.float64)
        # float32 softmax of float32 scores vs float64: a few float32 ulps of values <= 1
        assert (got - expected).abs().max().item() <= 8 * torch.finfo(torch.float32).eps


def test_mask_in_page_is_the_bottom_right_causal_mask(pages):
    data = _json_block(pages["gqa-cross"][0])
    lq, lk = 4, 6
    causal = torch.ones(lq, lk, dtype=torch.int64).tril(diagonal=lk - lq)
    for m in data["maps"]:
        keep = torch.tensor(m["keep"])
        assert keep.shape == (4, lq, lk)
        assert torch.equal(keep, causal.expand(4, lq, lk))
    no_mask = _json_block(pages["no-causal-dropout"][0])
    assert all(v == 1 for m in no_mask["maps"] for h in m["keep"] for row in h for v in row)


def test_gqa_page_shows_one_map_per_query_head_and_the_repeat_is_a_copy(pages):
    page, trace = pages["gqa-cross"]
    data = _json_block(page)
    assert len(data["maps"][0]["weights"]) == 4
    assert page.count('<option value="') == 2 + 4  # batch elements + heads
    repeat = trace.step("repeat kv heads K")
    assert step_kind(repeat) == "copy"


def test_every_step_has_a_meaning_in_both_languages(pages):
    for page, trace in pages.values():
        sizes = trace_sizes(trace)
        for step, shown in zip(trace.steps, _json_block(page)["steps"]):
            for lang in LANGS:
                meaning = describe_step(step, lang, sizes)
                assert meaning and shown["meaning"][lang] == meaning, (step.label, lang)
                assert shown["title"][lang] == step_title(step, lang)
                assert html.escape(meaning) in page
    assert steps.MASK.meaning({"kinds": ("padding", "causal")}, "zh")  # any combination of mask kinds


def test_page_and_text_walkthrough_tell_the_same_pass_in_the_same_words(pages):
    """Same seed draw order, same step texts: the JSON walkthrough and the page agree."""
    page, _ = pages["gqa-cross"]
    rc, out, err = _cli(["explain", "--format", "json", "--lang", "zh", *CONFIGS["gqa-cross"]])
    assert (rc, err) == (0, "")
    text = json.loads(out)
    data = _json_block(page)
    for got, want in zip(data["steps"], text["steps"]):
        assert got["title"]["zh"] == want["title"]
        assert want["meaning"].startswith(got["meaning"]["zh"])  # the text adds the stacked-weights note once
    softmax = next(s for s in text["steps"] if s["name"] == "softmax")
    shown_in_text = torch.tensor(softmax["values"][0]["matrix"], dtype=torch.float32)  # batch 0, head 0
    assert torch.equal(shown_in_text, torch.tensor(data["maps"][0]["weights"][0], dtype=torch.float32))


def test_notes_are_localised_and_the_code_ones_kept(pages):
    page, trace = pages["no-causal-dropout"]
    scale, dropout = trace.step("scale"), trace.step("dropout")
    for step in (scale, dropout):
        zh = note_text(step, "zh")
        assert zh and zh != step.note
        assert f'<p class="note"><span data-l="en" lang="en">{html.escape(step.note)}</span><span data-l="zh" lang="zh">{html.escape(zh)}</span></p>' in page
    assert "D = 4 时即 1/√D" in note_text(scale, "zh")
    gqa_page, gqa = pages["gqa-cross"]
    mask = gqa.step("causal mask")  # a mask's repr is code: the same in both languages
    assert note_text(mask, "zh") == mask.note == mask.params["code"]
    assert f'<span data-l="zh" lang="zh">{html.escape(mask.note)}</span></p>' in gqa_page


def test_lang_sets_the_initial_language_and_both_texts_are_present(tmp_path):
    path = tmp_path / "zh.html"
    assert _cli(["explain", "--format", "html", "--lang", "zh", "--out", str(path)])[0] == 0
    page = path.read_text(encoding="utf-8")
    assert '<html lang="zh" data-lang="zh">' in page
    assert "<title>多头注意力，逐步拆解</title>" in page
    assert '<span data-l="en" lang="en">Multi-head attention, step by step</span>' in page
    assert _json_block(page)["lang"] == "zh"


def test_tokens_with_markup_are_escaped_everywhere():
    tokens = ["</script><script>alert(1)</script>", "a & b", '"quoted"', "<b>bold</b>"]
    weights = torch.softmax(torch.randn(2, 4, 4), dim=-1)
    maps = [HeadMaps(weights, q_tokens=tokens, k_tokens=tokens, title="<i>title</i> & more")]
    page = render_html(None, maps)
    assert "<script>alert(1)" not in page
    assert "<b>bold</b>" not in page and "<i>title</i>" not in page
    assert page.count("</script>") == 2  # the data block and the page script, nothing else closes one
    assert "&lt;i&gt;title&lt;/i&gt; &amp; more" in page
    data = _json_block(page)
    assert data["maps"][0]["q_tokens"] == tokens and data["maps"][0]["k_tokens"] == tokens
    assert data["maps"][0]["title"] == "<i>title</i> & more"
    assert data["maps"][0]["scores"] is None and data["maps"][0]["keep"] is None
    assert 'id="steps"' not in page  # no trace, no pipeline section


# ---------------------------------------------------------------------------- the tensor blocks
def test_parse_pattern_reads_groups_and_operands():
    assert parse_pattern("b t (h d) -> b t h d") == ([[("b",), ("t",), ("h", "d")]], [("b",), ("t",), ("h",), ("d",)])
    ops, out = parse_pattern("b h q d, b h k d -> b h q k")
    assert ops == [[("b",), ("h",), ("q",), ("d",)], [("b",), ("h",), ("k",), ("d",)]]
    assert out == [("b",), ("h",), ("q",), ("k",)]


def test_step_drawings_carry_axis_names_and_sizes_and_mark_views(pages):
    trace = pages["gqa-cross"][1]
    split_k = trace.step("split heads K")  # (2, 6, 2, 4) from (2, 6, 8): t is the key length here
    svg = step_svg(split_k, axis_sizes(trace, split_k))
    for label in ("(h d) = 2·4", "d = 4", "t = 6", "h = 2", "b = 2 ×"):
        assert f">{html.escape(label)}</text>" in svg, label
    assert '<svg class="arrow view"' in svg and "stroke-dasharray" in svg
    repeat = trace.step("repeat kv heads K")
    svg = step_svg(repeat, axis_sizes(trace, repeat))
    assert ">hkv = 2</text>" in svg and ">(hkv g) = 2·2</text>" in svg
    assert '<svg class="arrow copy"' in svg and "stroke-dasharray" not in svg
    scores = trace.step("scores QKᵀ")
    svg = step_svg(scores, axis_sizes(trace, scores))
    for label in ("q = 4", "k = 6", "d = 4", "h = 4"):
        assert f">{label}</text>" in svg, label
    assert '<svg class="arrow compute"' in svg


def test_step_kinds():
    trace = _trace([])
    kinds = {s.label: step_kind(s) for s in trace.steps}
    assert kinds["split heads Q"] == kinds["move heads forward K"] == kinds["move heads back"] == "view"
    assert kinds["merge heads"] == "copy"
    assert kinds["scores QKᵀ"] == kinds["softmax"] == kinds["project Q"] == "compute"


# ---------------------------------------------------------------------------- HeadMaps
def test_head_maps_validate_their_inputs():
    w = torch.rand(2, 3, 4)
    with pytest.raises(ValueError, match="k_tokens has 3 tokens"):
        HeadMaps(w, k_tokens=["a", "b", "c"])
    with pytest.raises(ValueError, match="scores has shape"):
        HeadMaps(w, scores=torch.rand(2, 3, 3))
    with pytest.raises(ValueError, match=r"\(H, Lq, Lk\)"):
        HeadMaps(torch.rand(3, 4))
    with pytest.raises(ValueError, match=r"head_labels\['zh'\] has 1 labels but the weights have 2 heads"):
        HeadMaps(w, head_labels={"en": ["a", "b"], "zh": ["甲"]})
    with pytest.raises(ValueError, match="head_labels must map 'en'"):
        HeadMaps(w, head_labels={"zh": ["甲", "乙"]})
    labelled = HeadMaps(w, head_labels={"en": ["a", "b"]})
    assert (labelled.head_label(1), labelled.head_label(1, "zh"), HeadMaps(w).head_label(0)) == ("b", "b", "")


def test_head_maps_need_a_reference_trace_with_values():
    from multihead import MultiHeadAttention

    mha = MultiHeadAttention(4, 2, backend="sdpa")
    with Trace(keep_values=True) as tr:
        mha(torch.randn(1, 3, 4))
    with pytest.raises(ValueError, match="reference backend"):
        head_maps_from_trace(tr)
    mha = MultiHeadAttention(4, 2, backend="reference")
    with Trace(keep_values=False) as tr:
        mha(torch.randn(1, 3, 4))
    with pytest.raises(ValueError, match="keep_values=True"):
        head_maps_from_trace(tr)


# ---------------------------------------------------------------------------- PNG
needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="matplotlib missing: pip install -e '.[test]' (it is in the test extra)"
)


@needs_matplotlib
@pytest.mark.parametrize("heads, rows, cols", [(2, 1, 2), (4, 1, 4), (5, 2, 4)])
def test_png_figure_has_one_panel_per_head_with_the_weights(heads, rows, cols):
    from multihead.explain.visual_png import heads_figure

    trace = _trace(["--heads", str(heads), "--d-out", str(2 * heads)])
    tokens = ["the", "$cat", "sat"]
    maps = head_maps_from_trace(trace, q_tokens=tokens, k_tokens=tokens)[0]
    fig = heads_figure(maps)
    panels = [ax for ax in fig.axes if ax.images and ax.get_title().startswith("head ")]
    assert [ax.get_title() for ax in panels] == [f"head {h}" for h in range(heads)]
    assert {(ax.get_subplotspec().rowspan.start, ax.get_subplotspec().colspan.start) for ax in panels} == {
        divmod(h, cols) for h in range(heads)
    }
    assert max(ax.get_subplotspec().rowspan.start for ax in panels) == rows - 1
    for h, ax in enumerate(panels):
        assert torch.equal(torch.as_tensor(ax.images[0].get_array().data), maps.weights[h])
        assert [t.get_text() for t in ax.get_xticklabels()] == ["the", r"\$cat", "sat"]
        assert [t.get_text() for t in ax.get_yticklabels()] == ["the", r"\$cat", "sat"]
        cells = [t.get_text() for t in ax.texts]  # 3x3 values printed, blocked cells as ×
        keep = maps.keep[h].flatten().tolist()
        expected = [f"{v:.2f}" if k else "×" for v, k in zip(maps.weights[h].flatten().tolist(), keep)]
        assert cells == expected


@needs_matplotlib
def test_png_cli_writes_the_figure(tmp_path):
    from matplotlib.image import imread

    from multihead.explain.visual_png import heads_figure

    path = tmp_path / "heads.png"
    rc, out, err = _cli(["explain", "--format", "png", "--heads", "4", "--out", str(path)])
    assert (rc, err) == (0, "")
    image = imread(path)
    fig = heads_figure(head_maps_from_trace(_trace(["--heads", "4"], "png"))[0])
    width, height = (fig.get_size_inches() * fig.dpi).round().astype(int)
    assert image.shape[:2] == (height, width)
    assert image[..., :3].std() > 0.05  # not a blank canvas


# ---------------------------------------------------------------------------- mistakes
@pytest.mark.parametrize("fmt", ["html", "png"])
def test_visual_formats_need_out(fmt):
    rc, out, err = _cli(["explain", "--format", fmt])
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and "--out" in err


def test_out_must_be_a_file_in_an_existing_directory(tmp_path):
    rc, _, err = _cli(["explain", "--format", "html", "--out", str(tmp_path)])
    assert rc == 2 and "is a directory" in err and err.count("\n") == 1
    rc, _, err = _cli(["explain", "--format", "html", "--out", str(tmp_path / "missing" / "w.html")])
    assert rc == 2 and "does not exist" in err and err.count("\n") == 1


def test_png_without_matplotlib_says_install_viz(tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    path = tmp_path / "heads.png"
    rc, out, err = _cli(["explain", "--format", "png", "--out", str(path)])
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and "install multihead[viz]" in err
    assert not path.exists()


def test_non_finite_scores_become_null_and_finite_ones_stay_exact():
    scores = torch.randn(2, 3, 3)
    blocked = torch.ones(3, 3, dtype=torch.bool).triu(diagonal=1)
    scores = scores.masked_fill(blocked, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    data = visual.page_data(None, [HeadMaps(weights, scores=scores)])
    shown = data["maps"][0]["scores"]
    for h in range(2):
        for i in range(3):
            for j in range(3):
                if blocked[i, j]:
                    assert shown[h][i][j] is None
                else:
                    assert torch.tensor(shown[h][i][j], dtype=torch.float32) == scores[h, i, j]
    json.loads(visual._script_json(data))  # valid JSON: no -Infinity


def test_page_data_rejects_unknown_language_and_empty_maps():
    weights = torch.softmax(torch.randn(1, 2, 2), dim=-1)
    with pytest.raises(ValueError, match="lang must be one of"):
        visual.page_data(None, [HeadMaps(weights)], lang="fr")
    with pytest.raises(ValueError, match="maps is empty"):
        visual.page_data(None, [])
    with pytest.raises(ValueError, match="group must be one of"):
        visual.page_data(None, [HeadMaps(weights)], group="head")
    with pytest.raises(ValueError, match=r"start must index maps \(0 to 0\), got 1"):
        visual.page_data(None, [HeadMaps(weights)], start=1)
    with pytest.raises(ValueError, match="head must be 0 to 0, got 1"):
        visual.page_data(None, [HeadMaps(weights)], head=1)


def test_keep_follows_a_user_mask_and_a_minus_infinity_bias():
    from multihead import MultiHeadAttention, masks

    torch.manual_seed(0)
    mha = MultiHeadAttention(4, 2, backend="reference")
    x = torch.randn(2, 3, 4)
    padding = torch.tensor([[True, True, False], [True, True, True]])
    bias = torch.zeros(3, 3)
    bias[0, 1] = float("-inf")
    with Trace(keep_values=True) as tr:
        mha(x, mask=masks.key_padding(padding) & masks.bias(bias))
    maps = head_maps_from_trace(tr)
    expected = padding[:, None, :] & (bias != float("-inf"))  # (B, Lq, Lk)
    for b, m in enumerate(maps):
        assert torch.equal(m.keep, expected[b].expand(2, 3, 3))
        assert torch.equal(m.weights[~m.keep], torch.zeros(int((~m.keep).sum())))


def test_head_maps_check_the_operands_of_the_worked_score():
    w = torch.rand(4, 3, 5)
    q, k = torch.rand(4, 3, 2), torch.rand(2, 5, 2)
    HeadMaps(w, q=q, k=k, scale=0.5)                       # keys per kv head: 2 serve 4 query heads
    with pytest.raises(ValueError, match="q and k come together"):
        HeadMaps(w, q=q)
    with pytest.raises(ValueError, match=r"q must be \(H, Lq, D\) = \(4, 3, D\)"):
        HeadMaps(w, q=torch.rand(4, 2, 2), k=k)
    with pytest.raises(ValueError, match=r"k must be \(Hkv, Lk, D\) = \(a divisor of 4, 5, 2\)"):
        HeadMaps(w, q=q, k=torch.rand(3, 5, 2))
    with pytest.raises(ValueError, match="scale must be a finite number"):
        HeadMaps(w, q=q, k=k, scale=float("nan"))


def test_fragments_are_sections_of_the_page_after_the_heat_maps():
    w = torch.softmax(torch.rand(2, 3, 3), -1)
    neuron = visual.Fragment("neuron", {"en": "Neuron view", "zh": "神经元视图"}, "<p id='n'>q · k</p>",
                             script="document.getElementById('n').dataset.ran = '1';")
    page = render_html(None, [HeadMaps(w)], fragments=[neuron])
    assert page.index('<section id="attention">') < page.index('<section id="neuron">')
    assert '<span data-l="en" lang="en">Neuron view</span><span data-l="zh" lang="zh">神经元视图</span>' in page
    assert page.index("<script>document.getElementById('n')") > page.index('id="mh-data"')  # after the page's own
    with pytest.raises(ValueError, match="Fragment id must be"):
        visual.Fragment("attention", {"en": "a", "zh": "b"}, "")
    with pytest.raises(ValueError, match="Fragment title must map each of"):
        visual.Fragment("x", {"en": "a"}, "")
    with pytest.raises(ValueError, match="must not contain '</script'"):
        visual.Fragment("x", {"en": "a", "zh": "b"}, "", script="'</script>'")
    with pytest.raises(ValueError, match="distinct ids"):
        render_html(None, [HeadMaps(w)], fragments=[neuron, neuron])
    with pytest.raises(TypeError, match="visual.Fragment"):
        render_html(None, [HeadMaps(w)], fragments=["<p>"])
