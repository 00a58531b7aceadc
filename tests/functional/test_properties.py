"""Property tests: every backend, the module and its other paths agree with a float64 oracle.

Hypothesis draws B, H, Hkv | H, Lq, Lk (1 to 70: lengths that are multiples of no block size
are the common case), D, Dv, the dtype (float64, float32, bfloat16, float16), self or cross
attention, and up to three masks of every kind joined with ``&`` (the score mods and sinks
excepted: they are not a keep or a bias, and tests/masks/test_masks_kinds.py holds them to float64
definitions). Each path's output and
gradients are held to the rule of :mod:`oracle` (at most 2x the error of the naive attention
computed in the same precision, plus a few ulps). Backends come from
``multihead.backends.names()`` at run time, so a newly registered backend is covered as is.

Run deeper with ``pytest tests/functional/test_properties.py --hypothesis-profile=long``.

Legend: B batch, H query heads, Hkv key/value heads, Lq/Lk lengths, D head dim, Dv value dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, note
from hypothesis import strategies as st

import multihead
from multihead import backends
from oracle import (FLOAT_DTYPES, LOW_PRECISION, MaskPart, combine, declined, dense, judge, naive_attention, naive_weights,
                    one_thread, row_sum_bound, score_dtype, score_size)

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

MAX_LEN = 70


# --------------------------------------------------------------------------- strategies
def _values(gen: torch.Generator, shape, dtype=torch.float32) -> torch.Tensor:
    """Standard normal values, representable in float32 (so float64 tests can estimate their naive error)."""
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)


def _broadcast_shape(draw, B, H, Lq, Lk):
    return draw(st.sampled_from([(Lq, Lk), (B, 1, Lq, Lk), (B, H, Lq, Lk), (1, H, 1, Lk), (Lk,), (B, 1, 1, Lk), ()]))


def _stripes(b, h, q_idx, kv_idx):
    return (q_idx + 2 * kv_idx + h + b) % 3 != 0


def _near(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).abs() <= 3


def _prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) | (kv_idx < 5)


MASK_MODS = [_stripes, _near, _prefix_lm]


@st.composite
def document_ids(draw, B, Lq, Lk):
    """(q_ids (B|1, Lq), kv_ids (B|1, Lk)): each row a packing of the same documents' queries and
    keys (lengths may be 0), some of them padding (id -1); kv_ids is q_ids itself when Lq == Lk
    and the draw says so (self-attention on packed sequences)."""
    rows = draw(st.sampled_from([1, B]))
    shared = Lq == Lk and draw(st.booleans())

    def packing(total, n):
        cuts = sorted(draw(st.lists(st.integers(0, total), min_size=n - 1, max_size=n - 1)))
        return [b - a for a, b in zip([0, *cuts], [*cuts, total])]

    q_rows, k_rows = [], []
    for _ in range(rows):
        n = draw(st.integers(1, 4))
        names = [d if draw(st.integers(0, 5)) else -1 for d in range(n)]
        qlen = packing(Lq, n)
        klen = qlen if shared else packing(Lk, n)
        q_rows.append([d for d, m in zip(names, qlen) for _ in range(m)])
        k_rows.append([d for d, m in zip(names, klen) for _ in range(m)])
    q_ids = torch.tensor(q_rows)
    return (q_ids, q_ids) if shared else (q_ids, torch.tensor(k_rows))


@st.composite
def mask_parts(draw, B, H, Lq, Lk, dtype, gen):
    """Up to three mask parts of random kinds for (B, H, Lq, Lk)."""
    parts = []
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["causal", "window", "key_padding", "keep", "bias", "torch",
                                     "documents", "chunked_local", "alibi", "mask_mod"]))
        align = draw(st.sampled_from(["bottom_right", "top_left"]))
        if kind == "causal":
            parts.append(MaskPart("causal", align=align))
        elif kind == "window":
            side = st.one_of(st.none(), st.integers(0, MAX_LEN))
            sinks = draw(st.sampled_from([0, 0, 1, 4]))
            parts.append(MaskPart("window", align=align, left=draw(side), right=draw(side), sinks=sinks))
        elif kind == "documents":
            if any(p.kind == "documents" for p in parts):
                continue  # a mask has one documents part
            parts.append(MaskPart("documents", ids=draw(document_ids(B, Lq, Lk))))
        elif kind == "chunked_local":
            parts.append(MaskPart("chunked_local", align=align, chunk=draw(st.integers(1, 24))))
        elif kind == "alibi":
            slopes = multihead.masks.alibi_slopes(H) if draw(st.booleans()) else torch.rand(H, generator=gen, dtype=torch.float64)
            parts.append(MaskPart("alibi", align=align, tensor=slopes))
        elif kind == "mask_mod":
            parts.append(MaskPart("mask_mod", fn=draw(st.sampled_from(MASK_MODS))))
        elif kind == "key_padding":
            density = draw(st.sampled_from([0.0, 0.5, 0.9, 1.0]))
            parts.append(MaskPart("key_padding", tensor=torch.rand(B, Lk, generator=gen) < density))
        elif kind == "keep":
            density = draw(st.sampled_from([0.1, 0.5, 0.9, 1.0]))
            shape = _broadcast_shape(draw, B, H, Lq, Lk)
            parts.append(MaskPart("keep", tensor=torch.rand(shape, generator=gen) < density, raw=draw(st.booleans())))
        elif kind == "bias":
            shape = _broadcast_shape(draw, B, H, Lq, Lk)
            bias_dtype = draw(st.sampled_from([dtype, torch.float32]))
            t = _values(gen, shape) * draw(st.sampled_from([0.5, 3.0]))
            # sometimes far from 0, as ALiBi's slope x position is: rounded to float16/bfloat16
            # such a bias would move each score by up to half an ulp of 700 (issue 11, defect 6)
            t = t + draw(st.sampled_from([0.0, 700.0]))
            if draw(st.booleans()):  # some -inf entries: they block keys like a False keep
                t = t.masked_fill(torch.rand(shape, generator=gen) < 0.3, -math.inf)
            parts.append(MaskPart("bias", tensor=t.to(bias_dtype), raw=draw(st.booleans())))
        else:  # nn.MultiheadAttention's masks, True = blocked, converted by masks.from_torch
            attn = draw(st.sampled_from([None, "bool2d", "bool3d", "float2d"]))
            t = None
            if attn == "bool2d":
                t = torch.rand(Lq, Lk, generator=gen) < 0.3
            elif attn == "bool3d":
                t = torch.rand(B * H, Lq, Lk, generator=gen) < 0.3
            elif attn == "float2d":
                t = _values(gen, (Lq, Lk), dtype)
            pad = torch.rand(B, Lk, generator=gen) < 0.3 if draw(st.booleans()) or t is None else None
            parts.append(MaskPart("torch", tensor=t, padding=pad))
    return parts


@dataclass
class Case:
    """One functional attention call. ``self_attn``: k is a view of q's first Hkv heads (and
    v is k when Dv == D), so gradients from the aliases add up in q."""

    B: int
    H: int
    Hkv: int
    Lq: int
    Lk: int
    D: int
    Dv: int
    dtype: torch.dtype
    self_attn: bool
    scale: object
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    grad_out: torch.Tensor
    parts: list = field(default_factory=list)

    def leaves(self, dtype=None):
        """Fresh leaf tensors (requiring grad) in ``dtype``: q, k, v and every bias tensor.
        Bias leaves keep their own dtype unless ``dtype`` is given and is not a half type (the
        naive reference adds a bias at its own precision, see :mod:`oracle`)."""
        def leaf(t, dt):
            return t.detach().to(dt).requires_grad_(True)

        dt = self.dtype if dtype is None else dtype
        out = {"q": leaf(self.q, dt)}
        if not self.self_attn:
            out["k"] = leaf(self.k, dt)
        if not self.self_attn or self.Dv != self.D:
            out["v"] = leaf(self.v, dt)
        for i, p in enumerate(self.parts):
            if p.kind == "bias":
                own = dtype is None or dtype in LOW_PRECISION
                out[f"bias{i}"] = leaf(p.tensor, p.tensor.dtype if own else dt)
        return out

    def assemble(self, leaves):
        """(q, k, v, parts) built from ``leaves``."""
        q = leaves["q"]
        if self.self_attn:
            k = q[:, : self.Hkv]
            v = leaves.get("v", k)
        else:
            k, v = leaves["k"], leaves["v"]
        parts = [replace(p, tensor=leaves[f"bias{i}"]) if p.kind == "bias" else p for i, p in enumerate(self.parts)]
        return q, k, v, parts

    @property
    def scale_value(self) -> float:
        return 1 / math.sqrt(self.D) if self.scale is None else self.scale


@st.composite
def attention_cases(draw, dtypes=FLOAT_DTYPES):
    dtype = draw(st.sampled_from(dtypes))
    Hkv = draw(st.integers(1, 3))
    H = Hkv * draw(st.integers(1, 3))
    B = draw(st.integers(1, 2))
    self_attn = draw(st.booleans())
    Lq = draw(st.integers(1, MAX_LEN))
    Lk = Lq if self_attn else draw(st.integers(1, MAX_LEN))
    D = draw(st.integers(1, 40))
    Dv = draw(st.one_of(st.just(D), st.integers(1, 24)))
    scale = draw(st.one_of(st.none(), st.sampled_from([0.05, 0.5, 1.0, 2.0])))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    q = _values(gen, (B, H, Lq, D), dtype)
    k = _values(gen, (B, Hkv, Lk, D), dtype)
    v = _values(gen, (B, Hkv, Lk, Dv), dtype)
    grad_out = _values(gen, (B, H, Lq, Dv), dtype)
    parts = draw(mask_parts(B, H, Lq, Lk, dtype, gen))
    return Case(B, H, Hkv, Lq, Lk, D, Dv, dtype, self_attn, scale, q, k, v, grad_out, parts)


# --------------------------------------------------------------------------- helpers
def forward_backward(fn, leaves, grad_out, *, absolute=False):
    """out and {leaf name: grad} for ``out = fn(leaves)``, backpropagating ``grad_out``.

    ``absolute``: use the absolute values of grad_out and of every leaf but the additive biases
    (the size of the terms, see :func:`oracle.judge`)."""
    if absolute:
        leaves = {n: t if n.startswith("bias") else t.detach().abs().requires_grad_(True) for n, t in leaves.items()}
        grad_out = grad_out.abs()
    out = fn(leaves)
    names = list(leaves)
    grads = torch.autograd.grad(out, [leaves[n] for n in names], grad_out.to(out.dtype), allow_unused=True)
    return out.detach(), {n: (torch.zeros_like(leaves[n]) if g is None else g) for n, g in zip(names, grads)}


def oracle_run(case: Case, dtype: torch.dtype, sizes=None):
    """The naive attention and its gradients with every leaf and op in ``dtype``."""
    def fn(leaves):
        q, k, v, parts = case.assemble(leaves)
        keep, bias = dense(parts, case.B, case.H, case.Lq, case.Lk, dtype=dtype)
        return naive_attention(q, k, v, keep, bias, case.scale_value, dtype, term_sizes=sizes)

    return forward_backward(fn, case.leaves(dtype), case.grad_out, absolute=sizes is not None)


class Oracle:
    """float64 results, the size of their terms, and the naive results in any dtype (each computed once).

    ``run(dtype)`` returns (out, {name: grad}); ``run(dtype, sizes={})`` the sizes of their terms
    and, in ``sizes["score"]``, the size of the scores' terms (see :func:`oracle.judge`).
    ``head_dim``: the length of the longest sum that forms a score.
    """

    def __init__(self, run, head_dim: int):
        self._run, self._cache = run, {}
        self.out, self.grads = self.at(torch.float64)
        sizes: dict = {}
        self.terms_out, self.terms_grads = run(torch.float64, sizes=sizes)
        self.score_size, self.head_dim = sizes.get("score", 0.0), head_dim

    def at(self, dtype):
        if dtype not in self._cache:
            self._cache[dtype] = self._run(dtype)
        return self._cache[dtype]


def assert_agrees(what, out, grads, oracle: Oracle, dtype, **details):
    sizes = dict(score_size=oracle.score_size, head_dim=oracle.head_dim)
    verdicts = [judge(f"{what} output", out, oracle.out, lambda dt: oracle.at(dt)[0], dtype,
                      terms=oracle.terms_out, **sizes, **details)]
    for name, g in grads.items():
        # a leaf in another dtype (a float32 bias beside float64 q) has its gradient rounded to that dtype
        leaf_dtype = max((dtype, g.dtype), key=lambda dt: torch.finfo(dt).eps)
        verdicts.append(judge(f"{what} grad {name}", g, oracle.grads[name], lambda dt, n=name: oracle.at(dt)[1][n],
                              leaf_dtype, terms=oracle.terms_grads[name], **sizes, **details))
    failed = [str(v) for v in verdicts if not v.ok]
    assert not failed, "\n".join(failed)


def describe(case: Case) -> str:
    return (f"B={case.B} H={case.H} Hkv={case.Hkv} Lq={case.Lq} Lk={case.Lk} D={case.D} Dv={case.Dv} "
            f"{case.dtype} self={case.self_attn} scale={case.scale} masks={[p.kind for p in case.parts]}")


# --------------------------------------------------------------------------- functional
def refused(name: str, case: "Case") -> bool:
    """Whether backend ``name`` declines this call (a backend may, by the registry's contract);
    if so, asking for it by name must raise a ValueError that says so."""
    q, k, v, parts = case.assemble(case.leaves())
    mask = combine(parts)
    if declined(name, q, k, v, mask) is None:
        return False
    with pytest.raises(ValueError, match=f"backend '{name}' cannot run this call"):
        multihead.attention(q, k, v, mask, scale=case.scale, backend=name)
    return True


@given(case=attention_cases())
def test_every_backend_matches_float64_oracle(case):
    """Output and gradients (q, k, v, bias masks) of each backend vs the float64 oracle."""
    note(describe(case))
    oracle = Oracle(lambda dt, sizes=None: oracle_run(case, dt, sizes), head_dim=case.D)
    for name in backends.names():
        if refused(name, case):
            continue
        def fn(leaves, name=name):
            q, k, v, parts = case.assemble(leaves)
            return multihead.attention(q, k, v, combine(parts), scale=case.scale, backend=name)

        out, grads = forward_backward(fn, case.leaves(), case.grad_out)
        assert out.dtype == case.dtype
        assert_agrees(f"backend {name!r}", out, grads, oracle, case.dtype, case=describe(case))


@given(case=attention_cases())
def test_attention_weights_match_float64_oracle(case):
    """attention_weights equals the oracle's softmax; visible rows sum to 1, blind rows are 0."""
    note(describe(case))
    q, k, _, parts = case.assemble(case.leaves())
    got = multihead.attention_weights(q.detach(), k.detach(), combine(parts), scale=case.scale)

    def naive(dt):
        keep, bias = dense(parts, case.B, case.H, case.Lq, case.Lk, dtype=dt)
        return naive_weights(q.detach().to(dt), k.detach().to(dt), keep, bias, case.scale_value, dt)

    ref = naive(torch.float64)
    keep, bias = dense(parts, case.B, case.H, case.Lq, case.Lk)
    verdict = judge("attention_weights", got, ref, naive, case.dtype, head_dim=case.D,
                    score_size=score_size(q, k, keep, bias, case.scale_value))
    assert verdict.ok, str(verdict)
    visible = ref.sum(-1) > 0
    sums = got.double().sum(-1)
    bound = row_sum_bound(case.dtype, case.Lk)
    assert ((sums - 1).abs()[visible] <= bound).all(), (sums - 1).abs()[visible].max()
    assert (got[~visible] == 0).all()


@given(case=attention_cases(dtypes=(torch.float32,)))
def test_auto_runs_the_backend_explain_dispatch_names(case):
    """backend="auto" gives bit for bit what the backend named by explain_dispatch gives."""
    q, k, v, parts = case.assemble(case.leaves())
    mask = combine(parts)
    chosen = multihead.explain_dispatch(q, k, v, mask).backend
    with torch.no_grad():
        auto = multihead.attention(q, k, v, mask, scale=case.scale)
        named = multihead.attention(q, k, v, mask, scale=case.scale, backend=chosen)
    assert torch.equal(auto, named)


# --------------------------------------------------------------------------- module
@dataclass
class ModuleCase:
    d_in: int
    H: int
    Hkv: int
    head_dim: int
    kdim: int
    vdim: int
    bias: bool
    causal: bool
    B: int
    Lq: int
    Lk: int
    cross: str  # "self", "kv" (one key/value input) or "kvv" (separate value input)
    dtype: torch.dtype
    seed: int
    parts: list

    @property
    def d_out(self):
        return self.H * self.head_dim

    def inputs(self, dtype):
        gen = torch.Generator().manual_seed(self.seed)
        x = _values(gen, (self.B, self.Lq, self.d_in))
        y = _values(gen, (self.B, self.Lk, self.kdim))
        z = _values(gen, (self.B, self.Lk, self.vdim))
        leaves = {"query": x.to(dtype).requires_grad_(True)}
        if self.cross != "self":
            leaves["key"] = y.to(dtype).requires_grad_(True)
        if self.cross == "kvv":
            leaves["value"] = z.to(dtype).requires_grad_(True)
        grad_out = _values(gen, (self.B, self.Lq, self.d_out), dtype)
        return leaves, grad_out

    def args(self, leaves):
        x = leaves["query"]
        if self.cross == "self":
            return (x,)
        return (x, leaves["key"]) if self.cross == "kv" else (x, leaves["key"], leaves["value"])

    def build(self, backend="auto") -> multihead.MultiHeadAttention:
        torch.manual_seed(self.seed)
        mha = multihead.MultiHeadAttention(
            self.d_in, self.H, self.d_out, num_kv_heads=self.Hkv, kdim=self.kdim, vdim=self.vdim,
            bias=self.bias, causal=self.causal, backend=backend, dtype=torch.float64,
        )
        with torch.no_grad():  # float32-representable weights, as for the inputs
            for p in mha.parameters():
                p.copy_(p.float())
        return mha.to(self.dtype)


@st.composite
def module_cases(draw):
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    Hkv = draw(st.integers(1, 3))
    H = Hkv * draw(st.integers(1, 3))
    head_dim = draw(st.integers(1, 12))
    d_in = draw(st.integers(1, 24))
    cross = draw(st.sampled_from(["self", "kv", "kvv"]))
    kdim = d_in if cross == "self" else draw(st.integers(1, 24))
    vdim = kdim if cross != "kvv" else draw(st.integers(1, 24))
    B = draw(st.integers(1, 2))
    Lq = draw(st.integers(1, MAX_LEN))
    Lk = Lq if cross == "self" else draw(st.integers(1, MAX_LEN))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed + 1)
    parts = draw(mask_parts(B, H, Lq, Lk, dtype, gen))
    return ModuleCase(d_in, H, Hkv, head_dim, kdim, vdim, draw(st.booleans()), draw(st.booleans()),
                      B, Lq, Lk, cross, dtype, seed, parts)


def module_oracle(case: ModuleCase, params: dict, dtype: torch.dtype, sizes=None):
    """The module written out with F.linear, reshapes and the naive attention, all in ``dtype``."""
    leaves, grad_out = case.inputs(dtype)
    leaves.update({n: p.detach().to(dtype).requires_grad_(True) for n, p in params.items()})
    parts = [replace(p, tensor=p.tensor.to(score_dtype(dtype))) if p.kind == "bias" else p for p in case.parts]
    if case.causal:
        parts = [MaskPart("causal", align="bottom_right")] + parts

    def fn(lv):
        x = lv["query"]
        y = lv.get("key", x)
        z = lv.get("value", y)

        def proj(t, name, heads):  # 'b t (h d) -> b h t d'
            out = F.linear(t, lv[f"{name}.weight"], lv.get(f"{name}.bias"))
            return out.reshape(t.shape[0], t.shape[1], heads, case.head_dim).transpose(1, 2)

        q, k, v = proj(x, "q_proj", case.H), proj(y, "k_proj", case.Hkv), proj(z, "v_proj", case.Hkv)
        keep, bias = dense(parts, case.B, case.H, case.Lq, case.Lk, dtype=dtype)
        o = naive_attention(q, k, v, keep, bias, case.head_dim ** -0.5, dtype, term_sizes=sizes)
        o = o.transpose(1, 2).reshape(case.B, case.Lq, case.d_out)
        return F.linear(o, lv["out_proj.weight"], lv.get("out_proj.bias"))

    return forward_backward(fn, leaves, grad_out, absolute=sizes is not None)


@given(case=module_cases())
def test_module_and_its_paths_match_float64_oracle(case):
    """MultiHeadAttention on every backend, return_weights=True, and its per-head twin vs the oracle."""
    note(str(case))
    reference = case.build()
    params = dict(reference.named_parameters())
    # a score sums head_dim products of projections that each summed d_in or kdim products
    oracle = Oracle(lambda dt, sizes=None: module_oracle(case, params, dt, sizes),
                    head_dim=case.head_dim + case.d_in + case.kdim)
    mask = combine(case.parts)

    def check(what, module, **kwargs):
        leaves, grad_out = case.inputs(case.dtype)
        named = dict(module.named_parameters())

        def fn(lv):
            out = module(*case.args(lv), mask=mask, **kwargs)
            return out[0] if kwargs.get("return_weights") else out

        out, grads = forward_backward(fn, {**leaves, **named}, grad_out)
        if what == "per-head":  # compare its parameter gradients after fusing them back like the weights
            grads = {n: g for n, g in grads.items() if n in leaves}
        assert_agrees(what, out, grads, oracle, case.dtype)

    for name in backends.names():
        mha = case.build(backend=name)
        try:
            check(f"module backend {name!r}", mha)
        except ValueError as e:  # a backend may decline a call, saying so (see refused())
            assert f"backend '{name}' cannot run this call" in str(e), e
    check("module return_weights", case.build(), return_weights=True)
    check("per-head", case.build().to_per_head())


@given(case=module_cases())
def test_module_weights_match_float64_oracle(case):
    """The weights returned by ``return_weights=True`` are the oracle's softmax probabilities."""
    mha = case.build()
    leaves, _ = case.inputs(case.dtype)
    with torch.no_grad():
        _, got = mha(*case.args(leaves), mask=combine(case.parts), return_weights=True)
    parts = ([MaskPart("causal")] if case.causal else []) + list(case.parts)

    def naive(dt):
        lv, _ = case.inputs(dt)
        x = lv["query"].detach()
        y = lv["key"].detach() if "key" in lv else x
        W = {n: p.detach().to(dt) for n, p in mha.named_parameters()}
        q = F.linear(x, W["q_proj.weight"], W.get("q_proj.bias")).reshape(case.B, case.Lq, case.H, -1).transpose(1, 2)
        k = F.linear(y, W["k_proj.weight"], W.get("k_proj.bias")).reshape(case.B, case.Lk, case.Hkv, -1).transpose(1, 2)
        keep, bias = dense([replace(p, tensor=p.tensor.to(score_dtype(dt))) if p.kind == "bias" else p for p in parts],
                           case.B, case.H, case.Lq, case.Lk, dtype=dt)
        return naive_weights(q, k, keep, bias, case.head_dim ** -0.5, dt)

    sizes: dict = {}
    module_oracle(case, dict(mha.named_parameters()), torch.float64, sizes)
    verdict = judge("module weights", got, naive(torch.float64), naive, case.dtype, score_size=sizes["score"],
                    head_dim=case.head_dim + case.d_in + case.kdim)
    assert verdict.ok, str(verdict)


# --------------------------------------------------------------------------- interop
@given(case=module_cases())
def test_from_torch_matches_nn_multihead_attention(case):
    """A module copied from nn.MultiheadAttention, given the same masks through masks.from_torch,
    agrees with the float64 oracle as nn.MultiheadAttention does, wherever a key is visible; on a
    row with no visible key it gives 0 where nn.MultiheadAttention gives NaN (upstream behaviour)."""
    case = replace(case, dtype=torch.float64, Hkv=case.H, d_in=case.d_out, causal=False, parts=[],
                   kdim=case.d_out if case.cross == "self" else case.kdim,
                   vdim=case.d_out if case.cross == "self" else case.vdim)
    torch.manual_seed(case.seed)
    theirs = torch.nn.MultiheadAttention(
        case.d_out, case.H, bias=case.bias, kdim=case.kdim, vdim=case.vdim, batch_first=True, dtype=torch.float64,
    ).eval()
    mha = multihead.MultiHeadAttention.from_torch(theirs)
    gen = torch.Generator().manual_seed(case.seed)
    attn_mask = torch.rand(case.Lq, case.Lk, generator=gen) < 0.3  # True = blocked
    padding = torch.rand(case.B, case.Lk, generator=gen) < 0.3  # True = padding
    case.parts = [MaskPart("torch", tensor=attn_mask, padding=padding)]
    oracle = Oracle(lambda dt, sizes=None: module_oracle(case, dict(mha.named_parameters()), dt, sizes),
                    head_dim=case.head_dim + case.d_in + case.kdim)

    leaves, _ = case.inputs(torch.float64)
    x, y, z = (list(case.args(leaves)) + [None, None])[:3]
    y = x if y is None else y
    z = y if z is None else z
    with torch.no_grad():
        ours = mha(*case.args(leaves), mask=combine(case.parts))
        want, _ = theirs(x, y, z, attn_mask=attn_mask, key_padding_mask=padding)  # need_weights=True, its default
    blind = (attn_mask[None] | padding[:, None]).all(-1)  # (B, Lq): no visible key
    assert (ours[blind] == 0).all()
    for what, got in (("multihead", ours), ("nn.MultiheadAttention", want)):
        verdict = judge(what, got[~blind], oracle.out[~blind], lambda dt: oracle.at(dt)[0][~blind], case.dtype,
                        terms=oracle.terms_out[~blind], score_size=oracle.score_size, head_dim=oracle.head_dim)
        assert verdict.ok, str(verdict)
    # upstream (torch 2.13): with need_weights=True nn.MultiheadAttention returns NaN on such rows
    assert torch.isnan(want[blind]).all()
