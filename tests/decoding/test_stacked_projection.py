"""The stacked [W_q; W_k; W_v] block behind a decode step's one projection (issue 12 item 1).

The q/k/v parameters are rows of one storage, so a one-row self-attention call (a decode step)
projects with one product over it, and no copy of the weights exists to go stale. These tests
hold that path to the module's own steps written out in float64 from the current weights, and
to a module whose parameters were re-bound (``p.data = clone``: no block, three products), after
every kind of weight change, in every grad mode and under torch.compile; and check that
checkpoints of both layouts (ours and nn.MultiheadAttention's ``in_proj_weight``) load both ways,
that conversions stack the parameters again, and that hooks, parametrizations and autograd still
see the projections as their own calls.

Legend: B batch, L tokens, d features, H heads.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import pickle

import pytest
import torch
import torch.nn as nn
from torch.nn.utils import parametrize

import multihead as mh
from multihead import decoding
from oracle import judge, one_thread
from ref64 import attention64

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

D, H = 8, 2
MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode, "autograd": contextlib.nullcontext}


def build(seed: int = 0, dtype=torch.float64, **kw) -> mh.MultiHeadAttention:
    torch.manual_seed(seed)
    return mh.MultiHeadAttention(D, H, causal=True, dtype=dtype, **kw).eval()


def unstacked(m: mh.MultiHeadAttention) -> mh.MultiHeadAttention:
    """A copy of ``m`` whose q/k/v parameters are separate tensors (re-bound, as FSDP or
    ``load_state_dict(assign=True)`` would): it projects with three products."""
    twin = copy.deepcopy(m)
    for name in ("q_proj", "k_proj", "v_proj"):
        for p in getattr(twin, name).parameters():
            p.data = p.data.clone()
    assert twin.stacked_qkv() is None
    return twin


def step_by_hand(m: mh.MultiHeadAttention, prompt: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The decode step of ``x`` (B, 1, d) after ``prompt`` (B, L, d), written out in float64 from
    the module's current weights: each projection its own product, attention over every token."""
    with torch.no_grad():
        seq = torch.cat([prompt, x], 1).double()
        w = {n: (getattr(m, n).weight.double(), getattr(m, n).bias.double()) for n in ("q_proj", "k_proj", "v_proj", "out_proj")}
        B, L = seq.shape[:2]

        def heads(t):
            return t.view(B, -1, H, D // H).transpose(1, 2)

        q = heads(x.double() @ w["q_proj"][0].T + w["q_proj"][1])
        k = heads(seq @ w["k_proj"][0].T + w["k_proj"][1])
        v = heads(seq @ w["v_proj"][0].T + w["v_proj"][1])
        o, _ = attention64(q, k, v)
        return o.transpose(1, 2).reshape(B, 1, D) @ w["out_proj"][0].T + w["out_proj"][1]


def decode(m: mh.MultiHeadAttention, prompt: torch.Tensor, x: torch.Tensor, mode: str = "no_grad") -> torch.Tensor:
    """The step of ``x`` after ``prompt`` with a KVCache, in ``mode``. With autograd on the
    weights are frozen (a cache is for inference): then nothing requires grad."""
    if mode == "autograd":
        m.requires_grad_(False)
    cache = mh.KVCache(prompt.shape[1] + 1)
    with torch.no_grad():
        m(prompt, cache=cache)
    with MODES[mode]():
        return m(x, cache=cache)


def data(B: int = 1, L: int = 4, seed: int = 1, dtype=torch.float64) -> tuple:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, L, D, generator=g, dtype=dtype), torch.randn(B, 1, D, generator=g, dtype=dtype)


# ------------------------------------------------------------------------------ the layout
def test_qkv_parameters_are_rows_of_one_block_and_keep_their_names():
    m = build()
    block, bias, _ = m.stacked_qkv()
    assert torch.equal(block, torch.cat([m.q_proj.weight, m.k_proj.weight, m.v_proj.weight]))
    assert torch.equal(bias, torch.cat([m.q_proj.bias, m.k_proj.bias, m.v_proj.bias]))
    assert m.k_proj.weight.data_ptr() == block.data_ptr() + D * D * block.element_size()
    assert all(type(p) is nn.Parameter for p in m.parameters())
    assert list(m.state_dict()) == list(m.config.weight_shapes())
    assert len(list(m.parameters())) == 8  # nothing registered besides the four projections


def test_init_values_are_those_of_separate_linears():
    """Stacking copies the values nn.Linear initialised: the same seed gives the same weights as ever."""
    m = build(seed=3)
    torch.manual_seed(3)
    lins = [nn.Linear(D, D, dtype=torch.float64) for _ in range(4)]
    for lin, name in zip(lins, ("q_proj", "k_proj", "v_proj", "out_proj")):
        assert torch.equal(lin.weight, getattr(m, name).weight) and torch.equal(lin.bias, getattr(m, name).bias)


@pytest.mark.parametrize("kw", [dict(kdim=6), dict(num_kv_heads=1), dict(bias=False)])
def test_other_layouts(kw):
    """Cross-attention sizes have no block; GQA and bias-free modules have one."""
    m = build(**kw)
    assert (m.stacked_qkv() is None) == ("kdim" in kw)


# ------------------------------------------------------------------------------ values
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("B", [1, 3])
def test_decode_step_with_and_without_the_block_equals_the_steps_by_hand(mode, B):
    m = build()
    prompt, x = data(B)
    want = step_by_hand(m, prompt, x)
    for mod in (m, unstacked(m)):
        got = decode(mod, prompt, x, mode)
        assert (got - want).abs().max() < 1e-12


def test_the_one_row_step_uses_the_block_and_other_calls_do_not():
    m, x = build(), torch.randn(1, 1, D, dtype=torch.float64)
    with torch.no_grad():
        assert decoding.block_for(m, x)[0].data_ptr() == m.q_proj.weight.data_ptr()
        assert decoding.block_for(m, torch.randn(1, 2, D, dtype=torch.float64)) is None  # prefill: three products
        assert decoding.block_for(m, torch.randn(2, 1, D, dtype=torch.float64)) is None
    assert decoding.block_for(m, x) is None  # autograd would record the weights
    m.requires_grad_(False)
    assert decoding.block_for(m, x) is not None  # nothing requires grad


def test_grads_equal_those_of_separate_parameters():
    m = build().train()
    twin = unstacked(m)
    prompt, _ = data(2, 5)
    for mod in (m, twin):
        mod(prompt).square().sum().backward()
    for (name, p), (_, p2) in zip(m.named_parameters(), twin.named_parameters()):
        assert torch.equal(p.grad, p2.grad), name


# ------------------------------------------------------------------------------ weight changes
def _rebind(m):
    for p in m.q_proj.parameters():
        p.data = p.data * 2


def _assign_load(m):
    m.load_state_dict(build(seed=5).state_dict(), assign=True)


def _sgd(m):
    m.requires_grad_(True).train()
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    m(data(1, 3)[0]).square().mean().backward()
    opt.step()
    m.eval()


CHANGES = {
    "mul_": lambda m: [lin.weight.data.mul_(1.5) for lin in (m.q_proj, m.k_proj, m.v_proj)],
    "bias[:]=": lambda m: m.v_proj.bias.data.__setitem__(slice(None), 0.25),
    "numpy_view": lambda m: m.k_proj.weight.detach().numpy().__setitem__((0, 0), 9.0),
    "sgd": _sgd,
    "load_state_dict": lambda m: m.load_state_dict(build(seed=7).state_dict()),
    "data=": _rebind,
    "load_state_dict(assign=True)": _assign_load,
    "transposed_in_place_view": lambda m: setattr(m.q_proj.weight, "data", m.q_proj.weight.data.t()),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("change", list(CHANGES))
def test_weight_changes_between_steps_are_seen(change, mode):
    m = build()
    prompt, x = data()
    decode(m, prompt, x, mode)  # warm: anything kept between calls would be now
    before = step_by_hand(m, prompt, x)
    CHANGES[change](m)
    want = step_by_hand(m, prompt, x)
    assert (want - before).abs().max() > 1e-3  # the change changes the step
    got = decode(m, prompt, x, mode)
    assert (got - want).abs().max() < 1e-12
    rebound = change in ("data=", "load_state_dict(assign=True)", "transposed_in_place_view")
    if rebound:  # a re-bound parameter: the block is released, not kept alive
        assert m._stacked is None
    else:
        assert m.stacked_qkv() is not None


def test_weight_changes_between_compiled_steps_are_seen():
    """torch.compile (dynamo, fullgraph): the compiled step reads the parameters, never the block,
    and changes in place between calls are seen without graph breaks or recompiles."""
    from torch._dynamo.utils import counters

    m = build(dtype=torch.float32)
    prompt, x = (t.float() for t in data())
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(m, fullgraph=True, backend="eager")
    try:
        for i in range(3):
            cache = mh.StaticKVCache(8)
            with torch.no_grad():
                compiled(prompt, cache=cache)
                got = compiled(x, cache=cache)
            want = step_by_hand(m, prompt, x)
            # the oracle's rule: twice the error of the eager float32 step plus the derived floor
            verdict = judge(f"compiled step {i}", got.double(), want, lambda dt: decode(m, prompt, x).double(),
                            torch.float32, head_dim=D // H)
            assert verdict.ok, verdict
            with torch.no_grad():
                m.k_proj.weight.mul_(1.5)
        assert dict(counters["graph_break"]) == {}
        assert counters["stats"]["unique_graphs"] <= 2  # the prompt's shape and the step's
    finally:
        torch._dynamo.reset()


# ------------------------------------------------------------------------------ checkpoints
def test_checkpoints_load_both_ways():
    m = build()
    prompt, x = data()
    # ours into a module with the block, and into one without
    for target in (build(seed=9), unstacked(build(seed=9))):
        target.load_state_dict(m.state_dict())
        assert (decode(target, prompt, x) - step_by_hand(m, prompt, x)).abs().max() < 1e-12
    # nn.MultiheadAttention's in_proj_weight into ours: the block stays and holds its rows
    torch.manual_seed(4)
    t = nn.MultiheadAttention(D, H, batch_first=True, dtype=torch.float64)
    ours = build(seed=9)
    ours.load_state_dict(t.state_dict())
    assert ours.stacked_qkv() is not None
    assert torch.equal(ours.stacked_qkv()[0], t.in_proj_weight)
    with torch.no_grad():
        seq = torch.cat([prompt, x], 1)
        want = t(seq, seq, seq, attn_mask=nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.float64),
                 need_weights=False)[0][:, -1:]
    assert (decode(ours, prompt, x) - want).abs().max() < 1e-12
    # and back: ours as nn.MultiheadAttention
    plain = mh.MultiHeadAttention.from_config(dataclasses.replace(ours.config, causal=False), ours.state_dict())
    back = plain.to_torch()  # nn.MultiheadAttention takes causality per call
    assert torch.equal(back.in_proj_weight, t.in_proj_weight) and torch.equal(back.in_proj_bias, t.in_proj_bias)


def test_state_dict_saves_and_loads_through_torch_save_and_safetensors():
    m = build()
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    loaded = build(seed=2)
    loaded.load_state_dict(torch.load(buf))
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), m.state_dict().values()))
    st = pytest.importorskip("safetensors.torch")
    again = st.load(st.save(m.state_dict()))  # rows of one storage do not overlap: accepted
    assert all(torch.equal(again[k], v) for k, v in m.state_dict().items())


# ------------------------------------------------------------------------------ conversions
CONVERSIONS = {
    "float_then_double": lambda m: m.float().double(),
    "deepcopy": copy.deepcopy,
    "pickle": lambda m: pickle.loads(pickle.dumps(m)),
    "from_config": lambda m: mh.MultiHeadAttention.from_config(m.config, m.state_dict()).eval(),
    "meta_to_empty_load": lambda m: _meta_copy(m),
}


def _meta_copy(m):
    twin = mh.MultiHeadAttention(D, H, causal=True, device="meta", dtype=torch.float64)
    twin.to_empty(device="cpu")
    twin.load_state_dict(m.state_dict())
    return twin.eval()


@pytest.mark.parametrize("conversion", list(CONVERSIONS))
def test_conversions_stack_the_parameters_again(conversion):
    m = build()
    prompt, x = data()
    out = CONVERSIONS[conversion](m)
    assert out.stacked_qkv() is not None
    assert out.q_proj.weight.data_ptr() != m.q_proj.weight.data_ptr() or conversion == "float_then_double"
    assert (decode(out, prompt, x) - step_by_hand(m, prompt, x)).abs().max() < 1e-12


def test_reset_parameters_keeps_the_block():
    m = build()
    m.reset_parameters()
    assert m.stacked_qkv() is not None and m.q_proj.weight.abs().max() <= 1 / D ** 0.5


# ------------------------------------------------------------------------------ projections as their own calls
def test_a_hook_on_a_projection_sees_the_decode_step():
    m = build()
    prompt, x = data()
    seen = []
    m.k_proj.register_forward_hook(lambda mod, args, out: seen.append(out.shape[1]))
    got = decode(m, prompt, x)
    assert seen == [4, 1]  # the prompt, then the step: k_proj ran as its own call
    assert (got - step_by_hand(m, prompt, x)).abs().max() < 1e-12


class _Scale(nn.Module):
    def forward(self, w):
        return 2 * w


def test_a_parametrized_projection_is_evaluated_in_the_step():
    m = build()
    prompt, x = data()
    parametrize.register_parametrization(m.q_proj, "weight", _Scale())
    with torch.no_grad():
        assert decoding.block_for(m, x) is None
    got = decode(m, prompt, x)
    assert (got - step_by_hand(m, prompt, x)).abs().max() < 1e-12  # step_by_hand reads the doubled weight
