"""The tests that compare numbers, on every device this machine has: the CPU always, CUDA when
``torch.cuda.is_available()`` (the CUDA parameters are absent elsewhere, so nothing here skips).

Per device, each path is held to the float64 oracle's rule (:mod:`oracle`: at most 2x the error
of the naive attention in the same precision, plus a few ulps). The oracle and the naive
references run on the CPU; a device's results are moved to the CPU to be judged.

* every backend (reference, sdpa, chunked, auto) on four mask families, forward and gradients;
* ``multihead.attention`` with every backend under autocast, forward and gradients;
* the module (self-attention, cross-attention with padding, GQA with a window, RoPE + GQA +
  causal) on every backend, forward and gradients;
* cached decoding (prefill, then one token at a time) against the full causal forward;
* the module under autocast (CPU: bfloat16; CUDA: float16 and bfloat16), forward and gradients;
* ``torch.compile(fullgraph=True)`` of the module (CPU: aot_eager, to stay fast; CUDA: inductor),
  training and inference, repeated calls: no graph break, no recompile, values judged each time
  (with RoPE too: a compiled graph computes its cos/sin instead of filling RoPE's table cache);
* the plumbing of ``python -m benchmarks.gpu`` (the benchmark's table, on the CPU, tiny sizes).

dtypes: float32 and bfloat16 on the CPU; float32, bfloat16 and float16 on CUDA. The chunked
backend runs with 16-row, 16-key tiles, so that these few dozen tokens split into many tiles.
``python -m benchmarks.gpu`` (``make gpu-check``) runs this file, then a short benchmark.

Legend: B batch, H query heads, Hkv key/value heads, Lq/Lk lengths, D head dim.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import multihead
from multihead.backends import chunked
from fixed_cases import MASK_KINDS, fixed_case
from oracle import MaskPart, combine, dense, judge, naive_attention, one_thread
from test_properties import (Case, ModuleCase, Oracle, assert_agrees, forward_backward, module_oracle,
                             oracle_run, refused)

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ("reference", "sdpa", "chunked", "auto")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
#: the dtypes each device is tested in (float16 matmuls on the CPU are slow and rarely used)
DTYPES = {"cpu": (torch.float32, torch.bfloat16), "cuda": (torch.float32, torch.bfloat16, torch.float16)}
#: autocast's lower-precision dtypes each device is tested in
AUTOCAST = {"cpu": (torch.bfloat16,), "cuda": (torch.float16, torch.bfloat16)}
#: torch.compile's backend per device: aot_eager traces what inductor does (dynamo and
#: AOTAutograd) without generating C++ on the CPU, which takes many seconds per graph
COMPILERS = {"cpu": "aot_eager", "cuda": "inductor"}
SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _per_device(table: dict) -> list:
    return [pytest.param(d, dt, id=f"{d}-{SHORT[dt]}") for d in DEVICES for dt in table[d]]


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """16 x 16 tiles for the chunked backend, and ``auto`` free to pick it at these sizes."""
    monkeypatch.setattr(chunked, "BLOCK_ROWS", 16)
    monkeypatch.setattr(chunked, "BLOCK_K", 16)
    monkeypatch.setattr(chunked, "AUTO_MIN_SCORES", 0)


def _cpu(out: torch.Tensor, grads: dict) -> tuple:
    return out.cpu(), {n: g.cpu() for n, g in grads.items()}


# --------------------------------------------------------------------------- functional
def _case_on(case: Case, device: str) -> Case:
    """The same call with every tensor on ``device``."""
    parts = [p if p.tensor is None else replace(p, tensor=p.tensor.to(device)) for p in case.parts]
    parts = [p if p.ids is None else replace(p, ids=tuple(t.to(device) for t in p.ids)) for p in parts]
    return replace(case, q=case.q.to(device), k=case.k.to(device), v=case.v.to(device),
                   grad_out=case.grad_out.to(device), parts=parts)


@functools.lru_cache(maxsize=None)
def _oracle(kind: str, dtype: torch.dtype) -> Oracle:
    """The float64 oracle of ``fixed_case(kind, dtype)`` (on the CPU), shared by every backend and device."""
    case = fixed_case(kind, dtype)
    return Oracle(lambda dt, sizes=None: oracle_run(case, dt, sizes), head_dim=case.D)


def _attention(case: Case, backend: str, autocast=None):
    """out and gradients of ``multihead.attention`` on ``case`` (optionally under autocast to
    ``autocast``; the backward runs after the autocast region, as torch recommends)."""
    def fn(leaves):
        q, k, v, parts = case.assemble(leaves)
        with torch.autocast(case.q.device.type, dtype=autocast) if autocast else contextlib.nullcontext():
            return multihead.attention(q, k, v, combine(parts), backend=backend)

    return _cpu(*forward_backward(fn, case.leaves(), case.grad_out))


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("device,dtype", _per_device(DTYPES))
def test_backend_matches_float64_oracle(device, dtype, backend, kind):
    case = _case_on(fixed_case(kind, dtype), device)
    if refused(backend, case):
        return
    out, grads = _attention(case, backend)
    assert out.dtype == dtype
    assert_agrees(f"{backend} on {device}, {kind}", out, grads, _oracle(kind, dtype), dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("device,dtype", _per_device(AUTOCAST))
def test_attention_under_autocast_matches_float64_oracle(device, dtype, backend):
    """float32 inputs inside autocast compute in autocast's dtype: judged as a ``dtype`` computation;
    the gradients come back in float32 (the inputs' dtype), the float32 bias's included."""
    case = _case_on(fixed_case("padding_bias", torch.float32), device)
    out, grads = _attention(case, backend, autocast=dtype)
    assert out.dtype == dtype
    assert all(g.dtype == torch.float32 for g in grads.values())
    oracle = _oracle("padding_bias", torch.float32)
    assert_agrees(f"{backend} under autocast {dtype} on {device}", out, grads, oracle, dtype)


# --------------------------------------------------------------------------- module
#: name -> ModuleCase fields and whether the module rotates q and k (RoPE, base 10000)
VARIANTS = {
    "self_causal": (dict(Hkv=4, cross="self", causal=True), False),
    "cross_padding": (dict(Hkv=4, cross="kvv", causal=False, kdim=20, vdim=12, Lk=29), False),
    "gqa_window": (dict(Hkv=2, cross="self", causal=False), False),
    "rope_gqa_causal": (dict(Hkv=2, cross="self", causal=True), True),
}


def _module_case(variant: str, dtype: torch.dtype) -> ModuleCase:
    fields, _ = VARIANTS[variant]
    fields = {"kdim": 24, "vdim": 24, "Lk": 37, **fields}
    seed = sum(map(ord, variant))
    gen = torch.Generator().manual_seed(seed + 1)
    parts = {
        "cross_padding": [MaskPart("key_padding", tensor=torch.rand(2, fields["Lk"], generator=gen) < 0.7)],
        "gqa_window": [MaskPart("window", left=8, right=3)],
    }.get(variant, [])
    return ModuleCase(d_in=24, H=4, head_dim=6, bias=True, B=2, Lq=37, dtype=dtype, seed=seed, parts=parts, **fields)


def _build(variant: str, dtype: torch.dtype, backend: str = "auto", device: str = "cpu"):
    """The module of ``variant`` with the float32-representable weights of ModuleCase.build."""
    case = _module_case(variant, dtype)
    built = case.build(backend)
    if not VARIANTS[variant][1]:
        return built.to(device)
    c = built.config
    mha = multihead.MultiHeadAttention(c.d_in, c.num_heads, c.d_out, num_kv_heads=c.num_kv_heads, bias=c.bias,
                                       causal=c.causal, backend=backend, rope=True, dtype=dtype)
    mha.load_state_dict(built.state_dict())
    return mha.to(device)


def _rotate(x: torch.Tensor, sizes: bool) -> torch.Tensor:
    """x (B, H, L, D) rotated for positions 0 .. L-1 in x's dtype (rotate-half layout, base 10000,
    the angles in float64). ``sizes``: x is non-negative and the result bounds the sizes of the
    terms, x |cos| + swap_halves(x) |sin|."""
    L, D = x.shape[-2:]
    inv_freq = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    angles = torch.outer(torch.arange(L, dtype=torch.float64), inv_freq).repeat(1, 2)  # (L, D)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    if sizes:
        return x * cos.abs() + torch.cat((x2, x1), -1) * sin.abs()
    return x * cos + torch.cat((-x2, x1), -1) * sin


def rope_module_oracle(case: ModuleCase, params: dict, dtype: torch.dtype, sizes=None):
    """test_properties.module_oracle for self-attention with rotary embeddings: q and k rotated
    between the head split and the attention, everything in ``dtype``."""
    leaves, grad_out = case.inputs(dtype)
    leaves.update({n: p.detach().to(dtype).requires_grad_(True) for n, p in params.items()})
    parts = ([MaskPart("causal")] if case.causal else []) + list(case.parts)

    def fn(lv):
        x = lv["query"]

        def proj(name, heads):  # 'b t (h d) -> b h t d'
            out = F.linear(x, lv[f"{name}.weight"], lv.get(f"{name}.bias"))
            return out.reshape(case.B, case.Lq, heads, case.head_dim).transpose(1, 2)

        q, k, v = proj("q_proj", case.H), proj("k_proj", case.Hkv), proj("v_proj", case.Hkv)
        q, k = _rotate(q, sizes is not None), _rotate(k, sizes is not None)
        keep, bias = dense(parts, case.B, case.H, case.Lq, case.Lk, dtype=dtype)
        o = naive_attention(q, k, v, keep, bias, case.head_dim ** -0.5, dtype, term_sizes=sizes)
        o = o.transpose(1, 2).reshape(case.B, case.Lq, case.d_out)
        return F.linear(o, lv["out_proj.weight"], lv.get("out_proj.bias"))

    return forward_backward(fn, leaves, grad_out, absolute=sizes is not None)


@functools.lru_cache(maxsize=None)
def _module_oracle(variant: str, dtype: torch.dtype) -> Oracle:
    """The float64 oracle of the module of ``variant`` (on the CPU), shared by backends and devices."""
    case = _module_case(variant, dtype)
    params = {n: p.detach() for n, p in _build(variant, dtype).named_parameters()}
    run = rope_module_oracle if VARIANTS[variant][1] else module_oracle
    return Oracle(lambda dt, sizes=None: run(case, params, dt, sizes), head_dim=case.head_dim + case.d_in + case.kdim)


def _module_run(variant: str, dtype: torch.dtype, device: str, mha, autocast=None, call=None):
    """out and gradients (inputs and ``mha``'s parameters) of ``call`` (default ``mha``, else e.g.
    its compiled form) on the variant's inputs, on ``device``."""
    call = mha if call is None else call
    case = _module_case(variant, dtype)
    leaves, grad_out = case.inputs(dtype)
    leaves = {n: t.detach().to(device).requires_grad_(True) for n, t in leaves.items()}
    mask = combine([p if p.tensor is None else replace(p, tensor=p.tensor.to(device)) for p in case.parts])

    def fn(lv):
        with torch.autocast(device, dtype=autocast) if autocast else contextlib.nullcontext():
            return call(*case.args(lv), mask=mask)

    return _cpu(*forward_backward(fn, {**leaves, **dict(mha.named_parameters())}, grad_out.to(device)))


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("device,dtype", _per_device(DTYPES))
def test_module_matches_float64_oracle(device, dtype, backend, variant):
    out, grads = _module_run(variant, dtype, device, _build(variant, dtype, backend, device))
    assert out.dtype == dtype
    assert_agrees(f"module {variant} {backend} on {device}", out, grads, _module_oracle(variant, dtype), dtype)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("device,dtype", _per_device(AUTOCAST))
def test_module_under_autocast_matches_float64_oracle(device, dtype, variant):
    """A float32 module on float32 inputs inside autocast computes in ``dtype`` (projections and
    attention) and is judged as a ``dtype`` computation; its gradients are float32."""
    mha = _build(variant, torch.float32, "auto", device)
    out, grads = _module_run(variant, torch.float32, device, mha, autocast=dtype)
    assert out.dtype == dtype
    assert all(g.dtype == torch.float32 for g in grads.values())
    assert_agrees(f"module {variant} under autocast {dtype} on {device}", out, grads,
                  _module_oracle(variant, torch.float32), dtype)


# --------------------------------------------------------------------------- cache
@pytest.mark.parametrize("variant", ["self_causal", "rope_gqa_causal"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("device,dtype", _per_device(DTYPES))
def test_cached_decoding_matches_full_forward_oracle(device, dtype, backend, variant):
    """Prefill 9 tokens, then decode the other 28 one at a time: the outputs are the full causal
    forward's (float64 oracle), RoPE positions continuing from the cache length."""
    case = _module_case(variant, dtype)
    mha = _build(variant, dtype, backend, device)
    x = case.inputs(dtype)[0]["query"].detach().to(device)
    cache = multihead.KVCache(max_len=case.Lq)
    with torch.no_grad():
        pieces = [mha(x[:, :9], cache=cache)] + [mha(x[:, i:i + 1], cache=cache) for i in range(9, case.Lq)]
    out = torch.cat(pieces, dim=1).cpu()
    oracle = _module_oracle(variant, dtype)
    verdict = judge(f"cached decode {variant} {backend} on {device}", out, oracle.out, lambda dt: oracle.at(dt)[0],
                    dtype, terms=oracle.terms_out, score_size=oracle.score_size, head_dim=oracle.head_dim)
    assert verdict.ok, str(verdict)


# --------------------------------------------------------------------------- torch.compile
@pytest.mark.parametrize("variant", ["gqa_window", "rope_gqa_causal"])
@pytest.mark.parametrize("device,dtype", [pytest.param(d, dt, id=f"{d}-{SHORT[dt]}-{COMPILERS[d]}") for d, dt in
                                          (("cpu", torch.float32), ("cuda", torch.bfloat16)) if d in DEVICES])
def test_compiled_module_matches_float64_oracle_without_breaks_or_recompiles(device, dtype, variant):
    """torch.compile(fullgraph=True) of the module: training (forward and backward) and inference
    calls, three of each, interleaved; one graph per grad mode, no graph break, no recompile."""
    mha = _build(variant, dtype, "auto", device)
    oracle = _module_oracle(variant, dtype)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(mha, fullgraph=True, backend=COMPILERS[device])
    case = _module_case(variant, dtype)
    x = case.inputs(dtype)[0]["query"].detach().to(device)
    mask = combine([p if p.tensor is None else replace(p, tensor=p.tensor.to(device)) for p in case.parts])
    graphs = []
    for _ in range(3):
        out, grads = _module_run(variant, dtype, device, mha, call=compiled)
        assert_agrees(f"compiled module {variant} on {device}, training", out, grads, oracle, dtype)
        with torch.no_grad():
            out = compiled(x, mask=mask).cpu()
        assert_agrees(f"compiled module {variant} on {device}, no_grad", out, {}, oracle, dtype)
        graphs.append(counters["stats"]["unique_graphs"])
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert graphs == [2, 2, 2], f"unique graphs after each round {graphs}: want one per grad mode, no recompile"


# --------------------------------------------------------------------------- the benchmark's plumbing
def test_gpu_check_plumbing(monkeypatch, capsys):
    """``python -m benchmarks.gpu --device cpu --quick --no-tests`` at tiny sizes prints the ratio
    table: every section's rows, each ratio and GFLOP/s figure finite and positive, the device
    and torch version in the header."""
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks import gpu

    assert gpu.main(["--device", "cpu", "--quick", "--no-tests"], plan=gpu.TINY) == 0
    text = capsys.readouterr().out
    assert f"torch {torch.__version__}" in text and "device: cpu" in text
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if re.match(r"\| (module|decode|chunked) \|", line)]
    assert len({(r[0], r[1]) for r in rows}) == len(rows), "a row twice"
    plan, dtypes = gpu.TINY, len(gpu.DTYPES["cpu"])
    want = {"module": len(plan.lengths) * dtypes * len(plan.causal) * 2,  # forward, forward + backward
            "decode": dtypes, "chunked": len(plan.chunked_lengths) * 2}
    assert {s: sum(r[0] == s for r in rows) for s in want} == want, rows
    for r in rows:
        ratio, base_gflops, gflops = float(r[6]), float(r[7]), float(r[8])
        assert all(math.isfinite(x) and x > 0 for x in (ratio, base_gflops, gflops)), r
