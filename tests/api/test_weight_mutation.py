"""Weight-mutation fuzz: every way users change a module's weights, followed by inference calls.

After each change the module must compute with its current weights, exactly as a freshly built
module holding the same weights does (same dtype, same mode, same ops: bitwise equal). The
changes: in place (``mul_``, ``copy_`` under no_grad), ``.data`` writes, ``.data =``
reassignment twice (the freed address is often reused by the second tensor), numpy views,
optimiser steps (SGD, Adam), ``load_state_dict``, parametrizations (weight_norm and a LoRA-style
``parametrize``), ``.to(float64)`` and back, ``.half()`` then ``.float()``. The calls: under
``no_grad``, under ``inference_mode``, and in eval mode with autograd on. Each for
self-attention, cross-attention with one memory as key and value, and kdim != vdim.

Regression for issue 11, defect 1: the module cached the concatenated [W_q; W_k; W_v] keyed on
data pointers and version counters, which these changes slip past.

Legend: B batch, L tokens, d features.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

import multihead as mh
from oracle import one_thread

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

D_IN, HEADS = 8, 2
#: constructor arguments and inputs: (B, Lq, d_in) query, then key/value feature sizes
KINDS = {
    "self": dict(kw=dict(causal=True), key=None, value=None),
    "cross_shared_memory": dict(kw=dict(kdim=6), key=6, value="key"),
    "kdim_ne_vdim": dict(kw=dict(kdim=6, vdim=5), key=6, value=5),
}
MODES = {
    "no_grad": torch.no_grad,
    "inference_mode": torch.inference_mode,
    "eval_with_autograd": contextlib.nullcontext,
}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj")


def build(kind: str, dtype=torch.float64, seed: int = 0) -> mh.MultiHeadAttention:
    torch.manual_seed(seed)
    return mh.MultiHeadAttention(D_IN, HEADS, **KINDS[kind]["kw"], dtype=dtype).eval()


def inputs(kind: str, dtype=torch.float64) -> tuple:
    g = torch.Generator().manual_seed(1)
    spec = KINDS[kind]
    x = torch.randn(2, 5, D_IN, generator=g, dtype=dtype)
    if spec["key"] is None:
        return (x,)
    key = torch.randn(2, 7, spec["key"], generator=g, dtype=dtype)
    if spec["value"] == "key":
        return (x, key)
    return (x, key, torch.randn(2, 7, spec["value"], generator=g, dtype=dtype))


def current_weights(m: mh.MultiHeadAttention) -> dict:
    """The weights the projections use now, as plain-module state_dict entries (a
    parametrization's weight is evaluated)."""
    with torch.no_grad():
        return {f"{n}.{t}": getattr(getattr(m, n), t).detach().clone() for n in PROJECTIONS for t in ("weight", "bias")}


def fresh_output(m: mh.MultiHeadAttention, kind: str, mode: str, args: tuple) -> torch.Tensor:
    """A newly built module with ``m``'s current weights, called in the same mode."""
    dtype = m.q_proj.weight.dtype
    f = build(kind, dtype)
    f.load_state_dict(current_weights(m))
    with MODES[mode]():
        return f(*args)


def call(m, mode: str, args: tuple) -> torch.Tensor:
    with MODES[mode]():
        return m(*args)


# ------------------------------------------------------------------------------ the changes
def _randn_like(t: torch.Tensor, seed: int) -> torch.Tensor:
    return torch.randn(t.shape, generator=torch.Generator().manual_seed(seed), dtype=t.dtype)


def in_place_mul(m):
    with torch.no_grad():
        for n in ("q_proj", "k_proj", "v_proj"):
            getattr(m, n).weight.mul_(2.0)


def in_place_copy(m):
    with torch.no_grad():
        for i, n in enumerate(("q_proj", "k_proj", "v_proj")):
            w = getattr(m, n).weight
            w.copy_(_randn_like(w, 10 + i))


def data_mul(m):
    for n in ("q_proj", "k_proj", "v_proj"):
        getattr(m, n).weight.data.mul_(2.0)


def data_slice_write(m):
    for i, n in enumerate(("q_proj", "k_proj", "v_proj")):
        w = getattr(m, n).weight
        w.data[:] = _randn_like(w, 20 + i)
        getattr(m, n).bias.data[0] = 3.0


def data_reassigned_twice(m):
    for _ in range(2):  # the second new tensor may land where the freed first one was
        for n in ("q_proj", "k_proj", "v_proj"):
            p = getattr(m, n).weight
            p.data = p.data * 2


def data_reassigned_to_a_reused_address(m):
    """``.data =`` twice, the second tensor at the address of the weight of before (certain
    here, by refilling the old storage; with freed storage, the allocator often does the same)."""
    for i, n in enumerate(("q_proj", "k_proj", "v_proj")):
        p = getattr(m, n).weight
        old = p.data
        p.data = _randn_like(p, 30 + i)
        old.copy_(p.data)
        p.data = old


def numpy_view(m):
    for i, n in enumerate(("q_proj", "k_proj", "v_proj")):
        w = getattr(m, n).weight
        w.detach().numpy()[:] = _randn_like(w, 40 + i).numpy()


def _train_step(m, opt, args):
    m.train()
    m(*args).square().mean().backward()
    opt.step()
    opt.zero_grad()
    m.eval()


def sgd_step(m, args):
    _train_step(m, torch.optim.SGD(m.parameters(), lr=0.5), args)


def adam_step(m, args):
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    for _ in range(2):
        _train_step(m, opt, args)


def load_other_state(m, kind):
    m.load_state_dict(build(kind, m.q_proj.weight.dtype, seed=7).state_dict())


def weight_norm_then_change(m):
    for n in ("q_proj", "k_proj", "v_proj"):
        weight_norm(getattr(m, n))
    return lambda: [getattr(m, n).parametrizations.weight.original0.data.mul_(1.5) for n in ("q_proj", "k_proj", "v_proj")]


class LoRA(nn.Module):
    """W + B @ A, the low-rank update of LoRA, as a parametrization of a Linear's weight."""

    def __init__(self, out_features: int, in_features: int, rank: int = 2, dtype=torch.float64):
        super().__init__()
        self.A = nn.Parameter(torch.randn(rank, in_features, dtype=dtype))
        self.B = nn.Parameter(torch.zeros(out_features, rank, dtype=dtype))  # starts as the identity map

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w + self.B @ self.A


def lora_then_train(m):
    loras = []
    for n in ("q_proj", "v_proj"):
        lin = getattr(m, n)
        lora = LoRA(*lin.weight.shape, dtype=lin.weight.dtype)
        parametrize.register_parametrization(lin, "weight", lora)
        loras.append(lora)

    def change():
        with torch.no_grad():
            for i, lora in enumerate(loras):
                lora.B.copy_(_randn_like(lora.B, 50 + i))
    return change


def to_float64_and_back(m):
    m.double()
    with torch.no_grad():
        m.k_proj.weight.mul_(-1.0)
    m.float()


def half_then_float(m):
    m.half()
    with torch.no_grad():
        m.q_proj.weight.mul_(0.5)
    m.float()


SIMPLE = {
    "mul_": in_place_mul,
    "copy_": in_place_copy,
    "data.mul_": data_mul,
    "data[:]=": data_slice_write,
    "data=_twice": data_reassigned_twice,
    "data=_reused_address": data_reassigned_to_a_reused_address,
    "numpy_view": numpy_view,
}
# these run on a float32 module (the round trips convert it)
ROUND_TRIPS = {"to_float64_and_back": to_float64_and_back, "half_then_float": half_then_float}


def _check(m, kind, mode, args, before):
    after = call(m, mode, args)
    assert not torch.equal(after, before), "the change must change the output (else the test checks nothing)"
    again = call(m, mode, args)
    expect = fresh_output(m, kind, mode, args)
    assert torch.equal(after, expect) and torch.equal(again, expect)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("change", list(SIMPLE))
def test_inference_after_a_weight_change_uses_the_new_weights(change, kind, mode):
    m, args = build(kind), inputs(kind)
    before = call(m, mode, args)
    call(m, mode, args)  # a second call: anything kept between calls would be warm now
    SIMPLE[change](m)
    _check(m, kind, mode, args, before)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("optimiser", ["sgd", "adam"])
def test_inference_after_optimiser_steps_uses_the_new_weights(optimiser, kind, mode):
    m, args = build(kind), inputs(kind)
    before = call(m, mode, args)
    call(m, mode, args)
    (sgd_step if optimiser == "sgd" else adam_step)(m, args)
    _check(m, kind, mode, args, before)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", list(KINDS))
def test_inference_after_load_state_dict_uses_the_new_weights(kind, mode):
    m, args = build(kind), inputs(kind)
    before = call(m, mode, args)
    call(m, mode, args)
    load_other_state(m, kind)
    _check(m, kind, mode, args, before)
    other = build(kind, seed=7)
    assert torch.equal(call(m, mode, args), call(other, mode, args))


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("param", ["weight_norm", "lora"])
def test_parametrized_projections_follow_their_parameters(param, kind, mode):
    m, args = build(kind), inputs(kind)
    change = (weight_norm_then_change if param == "weight_norm" else lora_then_train)(m)
    before = call(m, mode, args)
    assert torch.equal(before, fresh_output(m, kind, mode, args))
    call(m, mode, args)
    change()
    _check(m, kind, mode, args, before)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("trip", list(ROUND_TRIPS))
def test_dtype_round_trips_use_the_new_weights(trip, kind, mode):
    m, args = build(kind, torch.float32), inputs(kind, torch.float32)
    before = call(m, mode, args)
    call(m, mode, args)
    if trip == "half_then_float":  # the half module runs too, on half inputs
        m.half()
        half_args = tuple(a.half() for a in args)
        out = call(m, mode, half_args)
        assert out.dtype == torch.float16 and torch.equal(out, fresh_output(m, kind, mode, half_args))
        m.float()
    ROUND_TRIPS[trip](m)
    _check(m, kind, mode, args, before)


@pytest.mark.parametrize("kind", list(KINDS))
def test_module_built_under_inference_mode_runs_under_it(kind):
    """Its parameters are inference tensors (no version counter): it used to raise "Inference
    tensors do not track version counter" on its first call."""
    with torch.inference_mode():
        m = build(kind)
        args = inputs(kind)
        out = m(*args)
        assert out.is_inference()
    plain = build(kind)  # same seed: the same weights
    with torch.no_grad():
        assert torch.equal(out, plain(*args))
        assert torch.equal(m(*args), out)  # and it still runs outside inference_mode


# ------------------------------------------------------- every cache vs a change of its inputs
# Issue 21: the block plan a mask_mod makes for itself was kept per shape and never made again,
# so after ``t.copy_(new)`` the chunked backend followed the old tensor and the reference the new
# one. Each cache of the library is changed under here in every way the weights are above.
TENSOR_CHANGES = {
    "copy_": lambda t, new: t.copy_(new),
    "data_write": lambda t, new: t.data.copy_(new),
    "index_write": lambda t, new: t.__setitem__(slice(None), new),
    "numpy_view": lambda t, new: t.numpy().__setitem__(slice(None), new.numpy()),
}


@pytest.mark.parametrize("change", list(TENSOR_CHANGES))
def test_a_mask_mods_block_plan_follows_the_tensor_it_reads(change):
    """GQA 8/2, a mask_mod reading a (Lk,) keep tensor: every tile is full at first, then half
    the keys are hidden in place; chunked must follow as the reference does (float64, 1e-12)."""
    from multihead import masks
    from ref64 import random_qkv

    L = 300
    allowed = torch.ones(L, dtype=torch.bool)
    m = masks.mask_mod(lambda b, h, q_idx, kv_idx: allowed[kv_idx] | (q_idx == kv_idx))
    q, k, v = random_qkv(B=1, H=8, Hkv=2, Lq=L, Lk=L, D=8, seed=5)
    for step in range(2):
        ref = mh.attention(q, k, v, m, backend="reference")
        got = mh.attention(q, k, v, m, backend="chunked")
        assert (got - ref).abs().max() <= 1e-12, f"call {step}"
        new = torch.arange(L) % 3 != 0 if step == 0 else torch.arange(L) % 2 == 0
        TENSOR_CHANGES[change](allowed, new)
    assert not torch.equal(mh.attention(q, k, v, m, backend="reference"), ref)  # the change mattered


def test_documents_keep_the_ids_they_were_built_with():
    """A documents mask is a value: an in-place change of the caller's ids changes no backend's
    result (before, ``mask.q_ids`` followed the caller while the geometry did not)."""
    from multihead import masks
    from ref64 import random_qkv

    ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    m = masks.documents(ids) & masks.causal()
    q, k, v = random_qkv(B=1, H=2, Lq=8, Lk=8, D=4, seed=6)
    before = {b: mh.attention(q, k, v, m, backend=b) for b in ("reference", "chunked")}
    ids.copy_(torch.tensor([0, 1, 1, 1, 1, 1, 1, 2]))
    assert torch.equal(m.parts[0].q_ids, torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]]))
    for b, out in before.items():
        assert torch.equal(mh.attention(q, k, v, m, backend=b), out), b


@pytest.mark.parametrize("change", list(TENSOR_CHANGES) + ["reassigned"])
def test_rope_tables_follow_their_frequencies(change):
    """RoPE keeps cos/sin tables per (device, dtype); a change of ``inv_freq`` makes them again."""
    rope = mh.RoPE(8)
    x = torch.randn(1, 1, 5, 8, dtype=torch.float64)
    rope(x)
    new = rope.inv_freq * 0.25
    if change == "reassigned":
        rope.inv_freq = new
    else:
        TENSOR_CHANGES[change](rope.inv_freq, new)
    fresh = mh.RoPE(8)
    fresh.inv_freq = new.clone()
    assert torch.equal(rope(x), fresh(x))
