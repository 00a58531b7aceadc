"""``multihead.explain_module(module_or_trace, x, ...)``: the walkthrough of the user's own module.

Every configuration a user builds (self/cross attention, GQA, masks, rope, a cache, each
backend) is explained in every format and language; the steps shown carry the numbers of the
user's module (its own weights, bit for bit); a fused backend's single step is re-run on the
reference backend, said so, and held to the tolerance rule by a check that fails when the fused
output is wrong; nothing of the user's changes; bad input raises at the edge.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import multihead
from multihead import masks

ROOT = Path(__file__).resolve().parents[2]
FUSED = ("sdpa", "chunked")


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _module(seed=1, **kw):
    torch.manual_seed(seed)
    return multihead.MultiHeadAttention(**kw)


CONFIGS = {
    # name: (module kwargs, inputs builder, call kwargs builder)
    "self": (dict(d_in=8, num_heads=2), lambda: (_x(2, 3, 8),), lambda: {}),
    "causal-gqa": (dict(d_in=16, num_heads=4, num_kv_heads=2, causal=True), lambda: (_x(1, 5, 16),), lambda: {}),
    "cross": (dict(d_in=8, num_heads=2, kdim=6, vdim=6), lambda: (_x(1, 3, 8), _x(1, 5, 6, seed=1)), lambda: {}),
    "padding-mask": (dict(d_in=8, num_heads=2), lambda: (_x(2, 4, 8),),
                     lambda: {"mask": masks.key_padding(torch.tensor([[True] * 4, [True, True, False, False]]))}),
    "window-bias": (dict(d_in=8, num_heads=2, causal=True), lambda: (_x(1, 6, 8),),
                    lambda: {"mask": masks.window(2) & masks.bias(_x(6, 6, seed=3))}),
    "rope": (dict(d_in=16, num_heads=2, causal=True, rope=True), lambda: (_x(1, 4, 16),), lambda: {}),
}


def _cached(backend):
    """A module with rope and GQA, and a cache holding a 5-token prompt: explain the next 2."""
    mha = _module(d_in=16, num_heads=4, num_kv_heads=2, causal=True, rope=True, backend=backend).eval()
    cache = multihead.KVCache(16)
    with torch.no_grad():
        mha(_x(1, 5, 16, seed=4), cache=cache)
    return mha, (_x(1, 2, 16, seed=5),), {"cache": cache}


def _case(name, backend):
    if name == "cache":
        return _cached(backend)
    kw, inputs, call = CONFIGS[name]
    return _module(**kw, backend=backend).eval(), inputs(), call()


@pytest.mark.parametrize("backend", ("reference",) + FUSED)
@pytest.mark.parametrize("name", [*CONFIGS, "cache"])
def test_every_configuration_is_explained_with_the_modules_own_numbers(name, backend):
    mha, inputs, call = _case(name, backend)
    e = multihead.explain_module(mha, *inputs, **call)
    assert e.all_checks_hold, [c for c in e.checks if not c.ok]
    assert e.reopened == (backend != "reference")
    # the weights shown are the module's own (its return_weights runs the reference backend)
    mha2, inputs2, call2 = _case(name, backend)
    with torch.no_grad():
        expected_out = mha2(*inputs2, **call2)
    mha3, inputs3, call3 = _case(name, backend)
    with torch.no_grad():
        _, weights = mha3(*inputs3, return_weights=True, **call3)
    assert torch.equal(e.trace.step("softmax").tensor, weights)
    assert torch.equal(e.output, expected_out)    # the output of the user's call, on its own backend
    for lang in ("en", "zh"):
        text = e.text(lang=lang)
        assert f"{e.trace.step('softmax').tensor[0, 0, 0, 0].item():.4f}" in text
        assert e.markdown(lang=lang).startswith("#")
        json.loads(e.json(lang=lang))
        page = e.html(lang=lang)
        assert page.startswith("<!DOCTYPE html>") and "http://" not in page and "https://" not in page


@pytest.mark.parametrize("backend", FUSED)
def test_a_fused_call_is_opened_up_on_the_reference_backend_and_says_so(backend):
    mha = _module(d_in=8, num_heads=2, causal=True, backend=backend).eval()
    e = multihead.explain_module(mha, _x(1, 4, 8))
    assert [s.kind.id for s in e.fused_trace.steps].count("fused_attention") == 1
    assert e.trace.config["backend"] == "reference"
    assert e.agreement.backend == backend and e.agreement.ok
    assert e.agreement.error <= e.agreement.tolerance
    for lang, words in (("en", ("again on the reference backend", backend)), ("zh", ("重新运行", backend, "reference"))):
        text = e.text(lang=lang)
        assert all(w in text for w in words), text[:400]
        data = json.loads(e.json(lang=lang))
        assert data["reopened"]["backend"] == backend and data["reopened"]["ok"] is True
    names = [c.name for c in e.checks]
    assert "the fused backend's output equals the reference backend's within tolerance" in names


def test_the_agreement_check_fails_when_the_fused_output_is_wrong(monkeypatch):
    from multihead.backends import sdpa

    real = sdpa.F.scaled_dot_product_attention

    def off_by_a_little(*args, **kwargs):
        return real(*args, **kwargs) + 1e-3

    monkeypatch.setattr(sdpa.F, "scaled_dot_product_attention", off_by_a_little)
    mha = _module(d_in=8, num_heads=2, backend="sdpa").eval()
    e = multihead.explain_module(mha, _x(1, 4, 8))
    assert e.agreement is not None and not e.agreement.ok and e.agreement.max_diff > 5e-4
    assert not e.all_checks_hold


def test_nothing_of_the_users_changes():
    mha, inputs, call = _cached("sdpa")
    mha.train()
    weights = {k: v.clone() for k, v in mha.state_dict().items()}
    length = len(call["cache"])
    rng = torch.get_rng_state()
    multihead.explain_module(mha, *inputs, **call)
    assert len(call["cache"]) == length and mha.training
    assert all(torch.equal(v, mha.state_dict()[k]) for k, v in weights.items())
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_trace_the_user_recorded():
    mha = _module(d_in=8, num_heads=2, causal=True, backend="reference")
    with torch.no_grad(), multihead.trace() as tr:
        mha(_x(1, 3, 8))
    e = multihead.explain_module(tr)
    assert e.trace is tr and not e.reopened and e.all_checks_hold
    assert "softmax" in e.text() and json.loads(e.json())["steps"]


def test_bad_input_is_refused_at_the_edge():
    mha = _module(d_in=8, num_heads=2)
    with pytest.raises(TypeError, match="MultiHeadAttention .* or a multihead.Trace, got Linear"):
        multihead.explain_module(torch.nn.Linear(2, 2), _x(1, 2, 2))
    with pytest.raises(TypeError, match="needs the input x"):
        multihead.explain_module(mha)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        multihead.explain_module(mha, [[1.0]])
    with pytest.raises(ValueError, match=r"x must be \(B, Lq, d_in\), got shape \(3, 8\)"):
        multihead.explain_module(mha, _x(3, 8))
    with pytest.raises(ValueError, match="at most 256 tokens .* x\\[:, :16\\]"):
        multihead.explain_module(mha, _x(1, 300, 8))
    with pytest.raises(ValueError, match="d_in"):      # the module's own check, before any work
        multihead.explain_module(mha, _x(1, 3, 5))
    with multihead.trace() as tr:
        pass
    with pytest.raises(ValueError, match="recorded no steps"):
        multihead.explain_module(tr)
    with pytest.raises(TypeError, match="takes no inputs"):
        multihead.explain_module(tr, _x(1, 3, 8))
    e = multihead.explain_module(mha, _x(1, 3, 8))
    with pytest.raises(ValueError, match="lang must be 'en' or 'zh', got 'fr'"):
        e.text(lang="fr")
    dropping = _module(d_in=8, num_heads=2, dropout=0.5, backend="sdpa").train()
    with pytest.raises(ValueError, match=r"training mode with dropout=0.5 .* module.eval\(\)"):
        multihead.explain_module(dropping, _x(1, 3, 8))


def test_import_multihead_stays_light_and_explain_module_works_after_any_import():
    """``multihead.explain`` is the package (one meaning), whatever was imported first; the
    function is ``explain_module``."""
    code = (
        "import sys, types, multihead\n"
        "assert 'multihead.explain' not in sys.modules, 'import multihead loaded explain'\n"
        "e = multihead.explain_module(multihead.MultiHeadAttention(8, 2), __import__('torch').randn(1, 3, 8))\n"
        "import multihead.explain.visual\n"
        "import torch\n"
        "assert type(multihead.explain) is types.ModuleType and not callable(multihead.explain)\n"
        "from multihead import explain_module\n"
        "assert explain_module(multihead.MultiHeadAttention(8, 2), torch.randn(1, 2, 8)).all_checks_hold\n"
        "print(type(e).__name__)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "Explanation"


def test_one_layer_of_a_traced_stack():
    class Block(torch.nn.Module):
        def __init__(self, heads):
            super().__init__()
            self.attn = multihead.MultiHeadAttention(8, heads, causal=True, backend="reference")

        def forward(self, x):
            return x + self.attn(x)

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([Block(2), Block(4)])
    x = _x(1, 3, 8)
    with torch.no_grad(), multihead.trace(root=model) as tr:
        h = x
        for b in model.blocks:
            h = b(h)
    e = multihead.explain_module(tr, layer=1)
    assert {s.path for s in e.trace.steps} == {"blocks.1.attn"} and e.all_checks_hold
    # the trace knows the module (its root and path): every step is recomputed, as for a module
    names = [c.name for c in e.checks]
    assert "equals Q·Kᵀ in float64" in names and "equals merged × W_Oᵀ in float64" in names
    assert len(e.checks) > sum(len(s.checks) for s in e.trace.steps)
    assert e.trace.step("softmax").shape[1] == 4          # layer 1's 4 heads
    with torch.no_grad():
        _, w1 = model.blocks[1].attn(x + model.blocks[0].attn(x), return_weights=True)
    assert torch.equal(e.trace.step("softmax").tensor, w1)
    assert "(b=1, h=4, q=3, k=3)" in e.text()
    with pytest.raises(ValueError, match=r"layer must be one of the trace's layers \[0, 1\], got 2"):
        multihead.explain_module(tr, layer=2)
    with pytest.raises(TypeError, match="layer= selects a layer of a traced stack"):
        multihead.explain_module(model.blocks[0].attn, x, layer=0)


def test_a_call_too_long_for_the_page_is_refused_by_html_and_shown_as_text_in_a_notebook():
    mha = _module(d_in=8, num_heads=2, backend="reference")
    e = multihead.explain_module(mha, _x(1, 65, 8))
    with pytest.raises(ValueError, match=r"at most 64 tokens .* Lq=65, Lk=65: use .text\(\)"):
        e.html()
    assert e._repr_html_() is None and ".text()" in repr(e)   # Jupyter falls back to the repr
    assert "checks (" in e.text()
    assert multihead.explain_module(mha, _x(1, 64, 8))._repr_html_().startswith("<iframe")
