"""The CLI meets people where they are: a positional sentence, --quiet, plurals of one, and the
space markers of BPE/SentencePiece tokens drawn as a visible space. Tiny random models only."""

from __future__ import annotations

import io

import pytest

from multihead import steps
from multihead.cli import main

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from tiny_hf import SENTENCE, save_tiny  # noqa: E402


def run_cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    rc = main(["explain", *argv], stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module")
def byte_level_dir(tmp_path_factory):
    """The tiny Llama with a byte-level BPE tokenizer (GPT-2's space marker Ġ), no merges: one
    token per character, the space included."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    path = save_tiny("llama", tmp_path_factory.mktemp("tiny") / "bytes")
    vocab = {c: i for i, c in enumerate("theĠca")}   # within the model's 13 ids
    tok = Tokenizer(models.BPE(vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    return path


def test_a_positional_sentence_is_the_text(llama_dir):
    expect = run_cli("--model", llama_dir, "--text", SENTENCE)
    assert expect[0] == 0
    assert run_cli("--model", llama_dir, SENTENCE) == expect              # quoted
    assert run_cli("--model", llama_dir, *SENTENCE.split()) == expect     # or not


@pytest.mark.parametrize("argv, message", [
    (["the", "cat"], 'unrecognized arguments: the cat; a sentence goes with a pretrained model: '
                     'multihead explain --model minilm "the cat"'),
    (["--model", "DIR", "--text", "a b", "the cat"], "the sentence is given twice (--text 'a b' and 'the cat'); give one"),
])
def test_a_sentence_without_a_model_or_twice_is_one_line(argv, message, llama_dir):
    rc, out, err = run_cli(*[llama_dir if a == "DIR" else a for a in argv])
    assert (rc, out) == (2, "") and err == f"multihead: error: {message}\n"


def test_quiet_silences_progress_where_a_bar_would_show(llama_dir, monkeypatch, capsys):
    from multihead.explain import models

    monkeypatch.setenv("MULTIHEAD_PROGRESS", "1")   # as in a terminal (the pty: test_progress.py)
    for quiet in (False, True):
        models._load_directory.cache_clear()
        rc, _, _ = run_cli("--model", llama_dir, SENTENCE, *(["--quiet"] if quiet else []))
        assert rc == 0
        assert ("loading llama: done in" in capsys.readouterr().err) is not quiet   # progress: sys.stderr


def test_space_markers_are_drawn_as_a_visible_space(byte_level_dir):
    rc, out, err = run_cli("--model", byte_level_dir, "the cat", "--neuron", "--token", "4")
    assert rc == 0, err
    assert "Ġ" not in out and "␣" in out
    assert "query token 4 'c'" in out and " 3 ␣ " in out


@pytest.mark.parametrize("text, expect", [
    ("The input: 1 sequences of 1 tokens", "The input: 1 sequence of 1 token"),
    ("cross-attention to 1 key tokens, 1 key/value heads, 1 queries", "cross-attention to 1 key token, 1 key/value head, 1 query"),
    ("11 tokens, 0.1 tokens, 2 heads, 1 numbers", "11 tokens, 0.1 tokens, 2 heads, 1 number"),
])
def test_counts_of_one_are_singular(text, expect):
    assert steps.singular_ones(text) == expect


def test_the_walkthrough_of_one_sequence_says_so():
    rc, out, _ = run_cli("--batch", "1", "--tokens", "1", "--keys", "1")
    assert rc == 0
    assert "1 sequence of 1 token," in out and "cross-attention to 1 key token" in out and "batch 1, 1 token," in out
    assert "1 sequences" not in out and "1 tokens" not in out


@pytest.mark.parametrize("argv", [
    ["--batch", "1", "--tokens", "16", "--d-in", "64", "--d-out", "64", "--heads", "2"],
    ["--tokens", "40", "--d-in", "16", "--d-out", "32", "--batch", "1", "--per-head", "--cost"],
    ["--model", "DIR", SENTENCE],
    ["--model", "DIR", SENTENCE, "--token", "3", "--layer", "1"],
    ["--model", "DIR", SENTENCE, "--neuron", "--layer", "1", "--head", "3"],
], ids=["wide walkthrough", "long walkthrough", "model", "model token", "model neuron"])
def test_text_output_fits_100_columns(argv, llama_dir):
    rc, out, err = run_cli(*[llama_dir if a == "DIR" else a for a in argv])
    assert rc == 0, err
    from multihead.explain.real_model import display_width

    wide = [line for line in out.splitlines() if display_width(line) > 100]
    assert not wide, wide[:3]
