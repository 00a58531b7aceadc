"""``multihead explain --mask``: the example's packed documents and score mods, shown in every
format and language (issue 13 item 8).

The shown keep grid is compared with `masks` and with the definition written out (a query sees
the keys of its own document up to itself); the shown scores after softcap with cap·tanh(s/cap)
of the shown scores before, in float64; bad specs are one line naming --mask, exit 2."""

from __future__ import annotations

import html
import io
import json
import re

import pytest
import torch

import multihead
from multihead import masks, steps
from multihead.cli import main, parse_options
from multihead.explain import walkthrough
from multihead.explain.example import ExampleConfig
from multihead.explain.mask_spec import parse_mask

_WORDS = re.compile(r"[A-Za-z]{2,}(?:[ '-]+[A-Za-z]{2,})+")


def run_cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    rc = main(["explain", *argv], stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


def _packed_causal_keep(lengths: list[int]) -> torch.Tensor:
    """(L, L) bool from the definition: the same document, and the key not after the query."""
    doc = [d for d, n in enumerate(lengths) for _ in range(n)]
    L = len(doc)
    return torch.tensor([[doc[i] == doc[j] and j <= i for j in range(L)] for i in range(L)])


def _json(*argv):
    rc, out, err = run_cli("--format", "json", *argv)
    assert (rc, err) == (0, ""), err
    return json.loads(out)


def _step(data, kind):
    found = [s for s in data["steps"] if s["kind"] == kind]
    assert len(found) == 1, [s["kind"] for s in data["steps"]]
    return found[0]


# ------------------------------------------------------------------------------ the packed mask
@pytest.mark.parametrize("lengths", [[3, 2], [1, 4, 2], [6]])
def test_the_shown_documents_mask_is_the_packed_causal_mask(lengths):
    spec = "documents:" + ",".join(map(str, lengths))
    L = sum(lengths)
    data = _json("--tokens", str(L), "--mask", spec)
    mask_step = _step(data, "mask")
    shown = torch.tensor(mask_step["values"][0]["matrix"], dtype=torch.bool)
    expected = _packed_causal_keep(lengths)
    assert torch.equal(shown, expected)
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    lib = (masks.causal() & masks.documents(ids)).materialize((1, 1, L, L), device=torch.device("cpu"), dtype=torch.float32)
    assert torch.equal(shown, lib.keep.expand(1, 1, L, L)[0, 0])
    assert mask_step["params"]["parts"] == [{"kind": "causal", "align": "bottom_right"}, {"kind": "documents", "lengths": lengths}]
    assert data["example"]["mask"] == [spec] and data["all_checks_hold"]


def test_without_causal_the_documents_mask_is_block_diagonal():
    data = _json("--tokens", "5", "--no-causal", "--mask", "documents:3,2")
    shown = torch.tensor(_step(data, "mask")["values"][0]["matrix"], dtype=torch.bool)
    ids = torch.tensor([0, 0, 0, 1, 1])
    assert torch.equal(shown, ids[:, None] == ids[None, :])
    assert _step(data, "mask")["title"] == "documents mask"


def test_the_text_prints_the_keep_grid_and_says_the_lengths():
    rc, out, err = run_cli("--tokens", "5", "--mask", "documents:3,2")
    assert (rc, err) == (0, "")
    grid = out.split("mask, 1 = may attend:\n")[1].splitlines()[:5]
    shown = torch.tensor([[int(x) for x in line.split()[1:]] for line in grid], dtype=torch.bool)
    assert torch.equal(shown, _packed_causal_keep([3, 2]))
    assert "causal & documents mask" in out and "Documents of 3, 2 tokens are packed in one row" in out
    code = json.loads(run_cli("--tokens", "5", "--mask", "documents:3,2", "--format", "json")[1])["code"]
    assert code.endswith("y = mha(x, mask=from_seqlens([3, 2]))")


# ------------------------------------------------------------------------------ the score_mod step
@pytest.mark.parametrize("cap", [0.5, 1.0, 5.0])
def test_the_shown_scores_after_softcap_are_cap_tanh_of_the_scores_before(cap):
    data = _json("--tokens", "4", "--mask", f"softcap:{cap:g}")
    names = [s["kind"] for s in data["steps"]]
    assert names.index("scale") + 1 == names.index("score_mod") == names.index("mask") - 1
    before = torch.tensor(_step(data, "scale")["values"][0]["matrix"], dtype=torch.float64)
    after = torch.tensor(_step(data, "score_mod")["values"][0]["matrix"], dtype=torch.float64)
    ref = cap * torch.tanh(before / cap)  # float64, from the definition
    # the walkthrough computes in float32: twice the float32 formula's own error, plus 4 eps of the largest value
    b32 = before.float()
    plain = (torch.tanh(b32 / cap) * cap).double()
    tol = 2 * (plain - ref).abs().max().item() + 4 * torch.finfo(torch.float32).eps * ref.abs().max().item()
    assert (after - ref).abs().max().item() <= tol
    assert after.abs().max().item() < cap
    step = _step(data, "score_mod")
    assert step["params"] == {"kinds": ["softcap"], "parts": [{"kind": "softcap", "cap": cap}]}
    assert f"{cap:g}·tanh(s / {cap:g})" in step["meaning"]
    assert "softcap on the scores: equals cap·tanh(s / cap) in float64" in [c["text"] for c in data["checks"]]
    assert data["all_checks_hold"]


def test_softcap_squashes_large_scores_and_keeps_small_ones():
    data = _json("--tokens", "4", "--mask", "softcap:0.25")
    before = torch.tensor(_step(data, "scale")["values"][0]["matrix"], dtype=torch.float64)
    after = torch.tensor(_step(data, "score_mod")["values"][0]["matrix"], dtype=torch.float64)
    assert (before.abs() > 0.25).any() and (after.abs() < 0.25).all()
    assert ((after.abs() <= before.abs() + 1e-7) & (after.sign() == before.sign())).all()


@pytest.mark.parametrize("specs", [
    ["documents:2,3", "softcap:2"], ["documents:2,3&alibi&softcap:2"], ["window:1:1"], ["chunked_local:2"],
    ["alibi"], ["sink:0.5"], ["documents:2,3", "sink:-1", "chunked_local:2"],
])
def test_every_combination_runs_and_its_checks_hold(specs):
    argv = ["--tokens", "5"] + [a for s in specs for a in ("--mask", s)]
    data = _json(*argv)
    assert data["all_checks_hold"], [c for c in data["checks"] if not c["ok"]]
    config = parse_options(argv).example
    mask = config.build_mask()
    assert mask is not None and data["steps"][-1]["kind"] == "output_projection"
    if mask.sink_logits is not None:
        weights = torch.tensor(_step(data, "softmax")["values"][0]["matrix"], dtype=torch.float64)
        assert (weights.sum(-1) < 1).all()


def test_the_example_config_takes_the_specs_and_builds_the_mask():
    c = ExampleConfig(tokens=5, mask=("documents:3,2 & softcap:5",))
    assert c.mask == ("documents:3,2", "softcap:5")
    assert repr(c.build_mask()) == "from_seqlens([3, 2]) & softcap(5)"
    assert ExampleConfig().build_mask() is None
    with pytest.raises(ValueError, match=r"^mask 'documents:3,3': the lengths sum to 6 but --tokens is 5"):
        ExampleConfig(tokens=5, mask=("documents:3,3",))
    with pytest.raises(TypeError, match="^mask must be a tuple of spec strings"):
        ExampleConfig(mask="softcap:5")  # type: ignore[arg-type]
    assert parse_mask((), tokens=3, keys=3, heads=2) is None


@pytest.mark.parametrize("mask", [
    masks.softcap(0.5), masks.sink(torch.tensor([0.3, -1.0])),
    masks.score_mod(lambda s, b, h, q, kv: s * (1.0 + h) - 0.1 * (q - kv)),
    masks.alibi(masks.alibi_slopes(2)) & masks.from_seqlens([3, 2]) & masks.softcap(2.0),
], ids=["softcap", "sink", "score_mod-reading-h", "alibi-documents-softcap"])
def test_the_per_head_reference_applies_score_mods_and_sinks_per_head(mask):
    """--per-head compares with the per-head module: it must see each head's h, sink and bias."""
    torch.manual_seed(0)
    mha = multihead.MultiHeadAttention(8, 2, causal=True, backend="reference").double().eval()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    with torch.no_grad():
        fused, separate = mha(x, mask=mask), mha.to_per_head()(x, mask=mask)
        plain = mha(x, mask=masks.causal()) if not mask.score_mods else None
    assert (fused - separate).abs().max().item() <= 1e-12
    if plain is not None:
        assert (fused - plain).abs().max().item() > 1e-6  # the mask changed the output


# ------------------------------------------------------------------------------ bad specs
@pytest.mark.parametrize("argv, message", [
    (["--tokens", "5", "--mask", "documents:3,3"],
     "--mask 'documents:3,3': the lengths sum to 6 but --tokens is 5; make them sum to 5"),
    (["--mask", "softcap:0"], "--mask 'softcap:0': the cap must be > 0 (scores are squashed into (-cap, cap)), got 0"),
    (["--mask", "softcap:-2"], "--mask 'softcap:-2': the cap must be > 0 (scores are squashed into (-cap, cap)), got -2"),
    (["--mask", "softcap:inf"], "--mask 'softcap:inf': the cap must be finite, got 'inf'"),
    (["--mask", "softcap"], "--mask 'softcap': softcap needs a value; write softcap:5 (the cap, > 0)"),
    (["--mask", "causal"], "--mask 'causal': unknown kind 'causal'; the kinds are documents, window, chunked_local, "
                           "alibi, softcap, sink (e.g. documents:3,2 or softcap:5)"),
    (["--mask", "documents:a,b"], "--mask 'documents:a,b': the document lengths must be integers separated by commas, got 'a,b'"),
    (["--mask", "documents:3,0"], "--mask 'documents:3,0': every document length must be >= 1, got [3, 0]"),
    (["--keys", "4", "--mask", "documents:2,1"],
     "--mask 'documents:2,1': documents pack self-attention; drop --keys (got 4 keys for 3 tokens)"),
    (["--mask", "alibi:2"], "--mask 'alibi:2': alibi takes no value; write alibi"),
    (["--mask", "chunked_local:0"], "--mask 'chunked_local:0': the chunk must be one integer >= 1, got '0'"),
    (["--mask", "window:1:2:3"], "--mask 'window:1:2:3': write window:LEFT or window:LEFT:SINKS with integers >= 0"),
    (["--model", "minilm", "--mask", "alibi"], "--mask belongs to the step-by-step walkthrough, not to --model; drop it"),
])
def test_a_bad_spec_is_one_line_naming_mask_and_exit_2(argv, message):
    rc, out, err = run_cli(*argv)
    assert (rc, out, err) == (2, "", f"multihead: error: {message}\n")


def test_help_lists_the_mask_kinds(capsys):
    rc, _, _ = run_cli("--help")
    text = " ".join(capsys.readouterr().out.split())
    assert rc == 0 and "--mask SPEC" in text and "documents:3,2 (lengths summing to --tokens)" in text
    assert "softcap:CAP (> 0)" in text and "join parts with &" in text


# ------------------------------------------------------------------------------ every format, both languages
def _english(text: str, code: list[str]) -> list[str]:
    for c in sorted(code, key=len, reverse=True):
        text = text.replace(c, " ")
    return _WORDS.findall(re.sub(r"-?\b(inf|nan)\b", " ", text))


SPECS = [["documents:3,2"], ["documents:3,2", "softcap:2"], ["alibi", "window:1:1", "sink:0"], ["chunked_local:2", "softcap:1"]]


@pytest.mark.parametrize("lang", ["en", "zh"])
@pytest.mark.parametrize("specs", SPECS, ids=["&".join(s) for s in SPECS])
def test_every_format_and_language_shows_the_mask_and_score_mods(specs, lang, tmp_path):
    argv = ["--tokens", "5", "--lang", lang] + [a for s in specs for a in ("--mask", s)]
    options = parse_options(argv)
    tr = walkthrough.example_walkthrough(options.example).trace
    shown = [s for s in tr.steps if s.kind in (steps.MASK, steps.SCORE_MOD)]
    assert shown
    code = ["multihead explain", options.example.module_call()] + [s.pattern or "" for s in tr.steps]
    code += [str(v) for s in tr.steps for v in s.params.values()]
    for fmt in ("text", "markdown"):
        rc, out, err = run_cli(*argv, "--format", fmt, "--per-head", "--cost")
        assert (rc, err) == (0, "")
        for s in shown:
            assert s.title(lang) in out
        assert ("mask, 1 = may attend:" if lang == "en" else "掩码，1 = 可以关注：") in out
        if lang == "zh":
            assert _english(out, code) == [], fmt
    data = _json(*argv, "--cost")
    assert data["all_checks_hold"]
    if lang == "zh":
        texts = [s[k] for s in data["steps"] for k in ("title", "meaning")] + [c["text"] for c in data["checks"]]
        assert _english(" ".join(texts), code) == []
    page = tmp_path / "w.html"
    rc, _, err = run_cli(*argv, "--format", "html", "--out", str(page))
    assert (rc, err) == (0, "")
    text = page.read_text(encoding="utf-8")
    for s in shown:
        assert html.escape(s.title(lang)) in text
    if lang == "zh":
        spans = re.findall(r'<span data-l="zh" lang="zh">(.*?)</span>', text)
        assert spans and _english(html.unescape(" ".join(spans)), code) == []
