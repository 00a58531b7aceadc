"""The programmable and built-in kinds of issue 13: mask_mod, score_mod, softcap, sink, alibi,
chunked_local and window sink tokens; block plans; the kernel-facing methods (block,
tile_state, key_span, apply_block) against the dense materialisation; bad input.

Every value is compared with tests/ref64.py's float64 definitions (loops or full index
grids, FlexAttention's, flash-attn's and gpt-oss's semantics), forward and gradients, on the
reference and sdpa backends (sdpa where it accepts the kind: it refuses score mods and sinks).
The chunked kernel's side is tests/test_masks_chunked.py.

Legend: B batch, H query heads, Hkv key/value heads, Lq/Lk lengths, D head dim.
"""

import math

import pytest
import torch

import multihead
from multihead import masks
from ref64 import (alibi_bias64, attention64, attention64_mods, chunked_keep, grid_keep, mpt_alibi_slopes,
                   random_qkv, window_sinks_keep, causal_keep)

CPU = torch.device("cpu")


def _grads(out, inputs, seed=5):
    g = torch.Generator().manual_seed(seed)
    grad_out = torch.randn(out.shape, generator=g, dtype=out.dtype)
    return torch.autograd.grad(out, inputs, grad_out)


def _agree(backend, mask, inputs, ref_fn, *, extra=()):
    """Output and gradients (q, k, v and ``extra`` tensors) of ``backend`` vs the float64 ``ref_fn``."""
    q, k, v = inputs
    out = multihead.attention(q, k, v, mask=mask, backend=backend)
    want = ref_fn(q, k, v)
    assert (out - want).abs().max() <= 1e-12
    leaves = (q, k, v, *extra)
    for got, exp in zip(_grads(out, leaves), _grads(want, leaves)):
        assert (got - exp).abs().max() <= 1e-12


# ---------------------------------------------------------------------- mask_mod
def _diagonal_band(b, h, q_idx, kv_idx):
    return ((q_idx - kv_idx).abs() <= 2) | ((kv_idx + h + b) % 3 == 0)


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
@pytest.mark.parametrize("lq,lk", [(7, 7), (4, 9), (9, 4)])
def test_mask_mod_matches_flex_semantics(backend, lq, lk):
    inputs = random_qkv(B=2, H=4, Hkv=2, Lq=lq, Lk=lk, D=8, grad=True)
    keep = grid_keep(_diagonal_band, 2, 4, lq, lk)
    _agree(backend, masks.mask_mod(_diagonal_band), inputs, lambda q, k, v: attention64(q, k, v, keep=keep)[0])


def test_mask_mod_sees_only_tile_indices():
    """block() hands fn the tile's own index tensors: never an (Lq, Lk) grid."""
    seen = []

    def fn(b, h, q_idx, kv_idx):
        seen.append((q_idx.shape, kv_idx.shape))
        return kv_idx <= q_idx

    m = masks.mask_mod(fn)
    m.block(64, 96, 32, 64, (1, 1, 256, 256), device=CPU, dtype=torch.float32)
    assert seen == [(torch.Size([1, 1, 32, 1]), torch.Size([1, 1, 1, 32]))]


def test_mask_mod_composes_with_other_masks():
    m = masks.mask_mod(lambda b, h, q, kv: kv % 2 == 0) & masks.causal() & masks.key_padding(torch.tensor([[True] * 5 + [False]]))
    got = m.materialize((1, 1, 6, 6), device=CPU, dtype=torch.float32).keep
    want = (torch.arange(6) % 2 == 0) & causal_keep(6, 6) & torch.tensor([True] * 5 + [False])
    assert torch.equal(got.expand(1, 1, 6, 6)[0, 0], want)


@pytest.mark.parametrize("fn,match,error", [
    (lambda b, h, q, kv: (q - kv).float(), "must return a bool tensor", TypeError),
    (lambda b, h, q, kv: True, "must return a bool tensor", TypeError),
    (lambda b, h, q, kv: torch.ones(5, 5, dtype=torch.bool), "does not broadcast", ValueError),
    (lambda b, h, q, kv: (kv <= q).transpose(-1, -2), "does not broadcast", ValueError),
])
def test_bad_mask_mod_is_refused_before_any_work(fn, match, error):
    q, k, v = random_qkv(B=1, H=2, Lq=6, D=4)
    for backend in ("reference", "sdpa", "chunked"):
        with pytest.raises(error, match=match):
            multihead.attention(q, k, v, mask=masks.mask_mod(fn), backend=backend)


# ---------------------------------------------------------------------- score_mod
@pytest.mark.parametrize("lq,lk", [(6, 6), (3, 8)])
def test_score_mod_and_its_captured_table_train_like_flex(lq, lk):
    """score + table[h, q - kv]: gradients flow into q, k, v and into the captured table."""
    table = torch.randn(4, 2 * 8, dtype=torch.float64, requires_grad=True)

    def relative(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + 8]

    m = masks.score_mod(relative) & masks.causal()
    assert m.tensors == (table,)
    inputs = random_qkv(B=2, H=4, Hkv=2, Lq=lq, Lk=lk, D=8, grad=True)
    keep = causal_keep(lq, lk)
    _agree("reference", m, inputs,
           lambda q, k, v: attention64_mods(q, k, v, keep=keep, score_fn=relative)[0], extra=(table,))


def test_score_mod_runs_after_the_biases_and_before_the_selection():
    """A score mod sees the bias already added (relu clips it) and never revives a blocked key."""
    bias = torch.tensor([[-3.0, 1.0, 0.5]], dtype=torch.float64)
    keep = torch.tensor([[True, True, False]])
    m = masks.bias(bias) & masks.score_mod(lambda s, b, h, q, kv: torch.relu(s)) & masks.keep(keep)
    q = torch.zeros(1, 1, 1, 2, dtype=torch.float64)
    k = torch.zeros(1, 1, 3, 2, dtype=torch.float64)
    w = multihead.attention_weights(q, k, m)
    e = math.exp(1.0)
    assert torch.allclose(w[0, 0, 0], torch.tensor([1 / (1 + e), e / (1 + e), 0.0], dtype=torch.float64), atol=1e-15)


def test_score_mods_apply_in_written_order():
    s = torch.full((1, 1, 1, 1), 3.0, dtype=torch.float64)
    double = masks.score_mod(lambda x, b, h, q, kv: x * 2)
    plus = masks.score_mod(lambda x, b, h, q, kv: x + 1)
    assert (double & plus).apply_block(s, 0, 1, 0, 1, (1, 1, 1, 1)).item() == 7.0
    assert (plus & double).apply_block(s, 0, 1, 0, 1, (1, 1, 1, 1)).item() == 8.0
    assert [p.kind for p in (masks.causal() & plus & masks.softcap(5.0)).score_mods] == ["score_mod", "softcap"]


@pytest.mark.parametrize("fn,match,error", [
    (lambda s, b, h, q, kv: s.sum(-1), "changed the scores' shape", ValueError),
    (lambda s, b, h, q, kv: s.float() if s.dtype == torch.float64 else s.double(), "changed the scores' dtype", TypeError),
    (lambda s, b, h, q, kv: 1.0, "must return a tensor", TypeError),
])
def test_bad_score_mod_is_refused_before_any_work(fn, match, error):
    q, k, v = random_qkv(B=1, H=2, Lq=4, D=4)
    with pytest.raises(error, match=match):
        multihead.attention(q, k, v, mask=masks.score_mod(fn), backend="reference")


def test_score_mod_probe_uses_the_call_dtype():
    """A float64 table is fine for float64 inputs (the probe runs in the call's dtype)."""
    table = torch.ones(3, dtype=torch.float64)
    m = masks.score_mod(lambda s, b, h, q, kv: s + table[kv])
    q, k, v = random_qkv(B=1, H=1, Lq=3, D=4)
    multihead.attention(q, k, v, mask=m, backend="reference")
    with pytest.raises(TypeError, match="from torch.float32 to torch.float64"):
        multihead.attention(q.float(), k.float(), v.float(), mask=m, backend="reference")


# ---------------------------------------------------------------------- softcap
@pytest.mark.parametrize("cap", [0.5, 2.0, 50.0])
def test_softcap_matches_gemma2(cap):
    inputs = random_qkv(B=2, H=2, Lq=5, D=8, grad=True)
    inputs = tuple((t.detach() * 3).requires_grad_(True) for t in inputs)  # scores beyond the cap
    keep = causal_keep(5, 5)

    def squash(s, b, h, q, kv):
        return cap * torch.tanh(s / cap)

    _agree("reference", masks.softcap(cap) & masks.causal(), inputs,
           lambda q, k, v: attention64_mods(q, k, v, keep=keep, score_fn=squash)[0])


@pytest.mark.parametrize("cap,error", [(0.0, ValueError), (-1.0, ValueError), (math.inf, ValueError),
                                       (math.nan, ValueError), ("30", TypeError), (True, TypeError)])
def test_bad_softcap(cap, error):
    with pytest.raises(error, match="softcap cap must be"):
        masks.softcap(cap)


# ---------------------------------------------------------------------- sink
@pytest.mark.parametrize("mask_extra", ["causal", "window", "none"])
def test_sink_matches_gpt_oss_and_trains_the_logits(mask_extra):
    logits = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64, requires_grad=True)
    extra = {"causal": masks.causal(), "window": masks.window(1), "none": None}[mask_extra]
    keep = {"causal": causal_keep(6, 6), "window": None, "none": None}[mask_extra]
    if mask_extra == "window":
        keep = masks.window(1).materialize((1, 1, 6, 6), device=CPU, dtype=torch.float32).keep
    m = masks.sink(logits) if extra is None else masks.sink(logits) & extra
    assert m.sink_logits is logits
    inputs = random_qkv(B=2, H=4, Hkv=2, Lq=6, D=8, grad=True)
    _agree("reference", m, inputs, lambda q, k, v: attention64_mods(q, k, v, keep=keep, sink=logits)[0],
           extra=(logits,))


def test_sink_row_with_no_visible_key_gives_zero():
    q, k, v = random_qkv(B=1, H=1, Lq=2, Lk=3, D=4)
    m = masks.sink(torch.zeros(1, dtype=torch.float64)) & masks.keep(torch.tensor([[False] * 3, [True] * 3]))
    out = multihead.attention(q, k, v, mask=m, backend="reference")
    assert torch.equal(out[0, 0, 0], torch.zeros(4, dtype=torch.float64))


def test_bad_sink():
    with pytest.raises(TypeError, match="floating tensor"):
        masks.sink(torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"must be \(H,\)"):
        masks.sink(torch.zeros(2, 2))
    q, k, v = random_qkv(B=1, H=2, Lq=3, D=4)
    with pytest.raises(ValueError, match="3 logits but the call has H=2"):
        multihead.attention(q, k, v, mask=masks.sink(torch.zeros(3, dtype=torch.float64)))
    with pytest.raises(ValueError, match="one sink part"):
        masks.sink(torch.zeros(2)) & masks.sink(torch.zeros(2))


# ---------------------------------------------------------------------- alibi
@pytest.mark.parametrize("heads", list(range(1, 17)) + [24, 40])
def test_alibi_slopes_are_bloom_and_mpt_slopes(heads):
    got = masks.alibi_slopes(heads)
    assert got.shape == (heads,) and got.dtype == torch.float64
    assert (got - mpt_alibi_slopes(heads)).abs().max() <= 1e-15  # two float64 roundings of one formula


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
@pytest.mark.parametrize("lq,lk,align", [(6, 6, "bottom_right"), (3, 7, "bottom_right"), (3, 7, "top_left")])
def test_alibi_matches_flash_attn_rule(backend, lq, lk, align):
    slopes = masks.alibi_slopes(4)
    inputs = random_qkv(B=2, H=4, Hkv=2, Lq=lq, Lk=lk, D=8, grad=True)
    bias = alibi_bias64(slopes, lq, lk, align)
    keep = causal_keep(lq, lk, align)
    _agree(backend, masks.alibi(slopes, align=align) & masks.causal(align), inputs,
           lambda q, k, v: attention64(q, k, v, keep=keep, bias=bias)[0])


def test_alibi_under_causal_equals_bloom_key_position_bias():
    """BLOOM adds slope_h * j (the key's position); under a causal mask the softmax sees the
    same weights as with -slope_h * (i - j): the two differ by slope_h * i, constant in a row."""
    slopes = masks.alibi_slopes(8)
    q, k, v = random_qkv(B=1, H=8, Lq=6, D=4)
    bloom = (slopes.view(1, 8, 1, 1) * torch.arange(6).view(1, 1, 1, 6)).expand(1, 8, 6, 6)
    want = attention64(q, k, v, keep=causal_keep(6, 6), bias=bloom)[0]
    got = multihead.attention(q, k, v, mask=masks.alibi(slopes) & masks.causal(), backend="reference")
    assert (got - want).abs().max() <= 1e-12


def test_bad_alibi():
    with pytest.raises(ValueError, match=r"must be \(H,\)"):
        masks.alibi(torch.zeros(2, 2, 2))  # (H,) or (B, H): per-sequence slopes, tests/masks/test_alibi_per_sequence.py
    with pytest.raises(TypeError, match="must be floating"):
        masks.alibi(torch.zeros(2, dtype=torch.long))
    with pytest.raises(TypeError, match="sequence of numbers"):
        masks.alibi("ab")
    q, k, v = random_qkv(B=1, H=4, Lq=3, D=4)
    with pytest.raises(ValueError, match=r"3 slopes but the call has H=4.*alibi_slopes\(4\)"):
        multihead.attention(q, k, v, mask=masks.alibi(masks.alibi_slopes(3)))
    with pytest.raises(ValueError, match="alibi_slopes heads must be >= 1"):
        masks.alibi_slopes(0)


# ---------------------------------------------------------------------- chunked_local, window sinks
@pytest.mark.parametrize("backend", ["reference", "sdpa"])
@pytest.mark.parametrize("lq,lk,size", [(9, 9, 3), (9, 9, 4), (4, 10, 4), (10, 4, 3)])
def test_chunked_local_matches_llama4(backend, lq, lk, size):
    """Llama 4's chunked attention: causal and the same chunk of ``attention_chunk`` positions."""
    inputs = random_qkv(B=1, H=2, Lq=lq, Lk=lk, D=8, grad=True)
    keep = chunked_keep(lq, lk, size) & causal_keep(lq, lk)
    _agree(backend, masks.causal() & masks.chunked_local(size), inputs,
           lambda q, k, v: attention64(q, k, v, keep=keep)[0])


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
@pytest.mark.parametrize("left,right,sinks,lq,lk", [(2, 0, 1, 8, 8), (1, 0, 3, 8, 8), (3, 1, 2, 4, 9),
                                                     (0, None, 2, 6, 6), (None, 0, 2, 5, 5), (2, 0, 20, 6, 6)])
def test_window_sink_tokens_stay_visible(backend, left, right, sinks, lq, lk):
    inputs = random_qkv(B=1, H=2, Lq=lq, Lk=lk, D=8, grad=True)
    keep = window_sinks_keep(lq, lk, left, right, sinks)
    _agree(backend, masks.window(left, right, sinks=sinks), inputs, lambda q, k, v: attention64(q, k, v, keep=keep)[0])


def test_bad_chunk_and_sinks():
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        masks.chunked_local(0)
    with pytest.raises(TypeError, match="chunk must be an int"):
        masks.chunked_local(2.5)
    with pytest.raises(ValueError, match="sinks must be >= 0"):
        masks.window(2, sinks=-1)


# ---------------------------------------------------------------------- sdpa and auto
@pytest.mark.parametrize("mask", [masks.softcap(5.0), masks.score_mod(lambda s, b, h, q, kv: s),
                                  masks.sink(torch.zeros(2, dtype=torch.float64)) & masks.causal()])
def test_sdpa_refuses_score_mods_and_sinks_by_name(mask):
    q, k, v = random_qkv(B=1, H=2, Lq=3, D=4)
    with pytest.raises(ValueError, match=r"cannot apply .*(softcap|score_mod|sink).*use backend='chunked' or 'reference'"):
        multihead.attention(q, k, v, mask=mask, backend="sdpa")
    d = multihead.explain_dispatch(q, k, v, mask)
    assert "cannot apply" in d.refused["sdpa"]
    ref = multihead.attention(q, k, v, mask=mask, backend="reference")
    assert torch.equal(multihead.attention(q, k, v, mask=mask), ref)


# ---------------------------------------------------------------------- block, tile_state, key_span
KINDS = {
    "causal": lambda: masks.causal(),
    "window": lambda: masks.window(5, 2, align="top_left"),
    "window_sinks": lambda: masks.window(4, sinks=3),
    "chunked": lambda: masks.causal() & masks.chunked_local(7),
    "documents": lambda: masks.documents(torch.tensor([[0] * 9 + [1] * 14 + [2] * 7, [5] * 20 + [6] * 10])) & masks.causal(),
    "docs_cross": lambda: masks.documents(torch.tensor([0] * 12 + [1] * 18), torch.tensor([0] * 20 + [1] * 10)) & masks.window(6),
    "mask_mod": lambda: masks.mask_mod(lambda b, h, q, kv: ((q // 4 + kv // 5 + h) % 3 == 0) | (b == 1)),
    "padding": lambda: masks.key_padding(torch.arange(30).view(1, 30).expand(2, 30) < torch.tensor([[25], [12]])),
    "torch_3d": lambda: masks.from_torch(attn_mask=torch.rand(6, 30, 30, generator=torch.Generator().manual_seed(1)) < 0.5),
    "alibi_keep": lambda: masks.alibi(masks.alibi_slopes(3)) & masks.keep(torch.rand(30, 30, generator=torch.Generator().manual_seed(0)) < 0.7),
}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("bq,bk", [(8, 8), (7, 11), (30, 30)])
def test_tiles_agree_with_the_dense_mask(kind, bq, bk):
    """block's keep/bias equal the dense tensors' slice; tile_state is exact about empty and full
    tiles; key_span holds every visible key of a query run."""
    shape = (2, 3, 30, 30)
    m = KINDS[kind]()
    dense = m.materialize(shape, device=CPU, dtype=torch.float64)
    keep = torch.ones(shape, dtype=torch.bool) if dense.keep is None else dense.keep.expand(shape)
    bias = None if dense.bias is None else dense.bias.expand(shape)
    for q0 in range(0, 30, bq):
        q1 = min(30, q0 + bq)
        lo, hi = m.key_span(q0, q1, 30, 30)
        seen = keep[:, :, q0:q1].any(0).any(0).any(0).nonzero().flatten()
        if seen.numel():
            assert lo <= int(seen.min()) and int(seen.max()) < hi
        for k0 in range(0, 30, bk):
            k1 = min(30, k0 + bk)
            t = m.block(q0, q1, k0, k1, shape, device=CPU, dtype=torch.float64)
            want = keep[:, :, q0:q1, k0:k1]
            got = torch.ones_like(want) if t.keep is None else t.keep.expand_as(want)
            assert torch.equal(got, want), (q0, k0)
            if bias is not None:
                assert torch.equal(t.bias.expand_as(want), bias[:, :, q0:q1, k0:k1])
            state = m.tile_state(q0, q1, k0, k1, shape)
            if state == "empty":
                assert not want.any()
            elif state == "full":
                assert want.all()
            if kind in ("causal", "window", "chunked", "documents", "docs_cross", "padding", "torch_3d") or (bq, bk) == (8, 8):
                assert state == ("empty" if not want.any() else "full" if want.all() else "partial"), (q0, k0)


def test_block_plan_states_and_reuse_across_layers():
    calls = []

    def fn(b, h, q_idx, kv_idx):
        calls.append(1)
        return (kv_idx <= q_idx) & (q_idx - kv_idx < 70)

    m = masks.mask_mod(fn)
    shape = (1, 2, 128, 128)
    plan = masks.block_plan(m, shape, block_q=32, block_k=32)
    keep = grid_keep(lambda b, h, q, kv: (kv <= q) & (q - kv < 70), 1, 2, 128, 128)
    for a in range(4):
        for c in range(4):
            tile = keep[:, :, a * 32:(a + 1) * 32, c * 32:(c + 1) * 32]
            want = 0 if not tile.any() else 2 if tile.all() else 1
            assert int(plan.states[0, 0, a, c]) == want
    shared = m.with_plan(plan)
    assert "BlockPlan" in repr(shared) and "empty" in repr(plan)
    calls.clear()
    for _ in range(3):  # three layers: every tile state from the plan, no call of fn
        for a in range(4):
            for c in range(4):
                shared.tile_state(a * 32, (a + 1) * 32, c * 32, (c + 1) * 32, shape)
    assert calls == []
    # a full tile needs no keep tensor, and fn is not evaluated for it
    full = [(a, c) for a in range(4) for c in range(4) if int(plan.states[0, 0, a, c]) == 2]
    a, c = full[0]
    assert shared.block(a * 32, (a + 1) * 32, c * 32, (c + 1) * 32, shape, device=CPU, dtype=torch.float32).keep is None
    assert calls == []
    q, k, v = random_qkv(B=1, H=2, Lq=64, D=4)
    with pytest.raises(ValueError, match=r"block plan made for .* make one for this shape"):
        multihead.attention(q, k, v, mask=shared)


def test_mask_mod_plans_itself_once_per_shape():
    calls = []

    def fn(b, h, q_idx, kv_idx):
        calls.append(1)
        return kv_idx <= q_idx

    m = masks.mask_mod(fn)
    shape = (1, 1, 300, 300)
    assert m.tile_state(0, 128, 128, 256, shape) == "empty"
    n = len(calls)
    assert m.tile_state(128, 256, 0, 128, shape) == "full"
    assert len(calls) == n
    assert m.key_span(0, 100, 300, 300) == (0, 300)  # its own plans may be for other (B, H)
    planned = m.with_plan(masks.block_plan(m, shape))
    assert planned.key_span(0, 100, 300, 300) == (0, 128)  # a given plan narrows the span


def test_reprs_say_what_each_kind_is():
    table = torch.zeros(2, 3, requires_grad=True)

    def rel(s, b, h, q, kv):
        return s + table[h, 0]

    text = repr(masks.documents(torch.tensor([0, 0, 1])) & masks.causal() & masks.alibi([0.5, 0.25])
                & masks.softcap(30.0) & masks.sink(torch.zeros(2, requires_grad=True)) & masks.score_mod(rel)
                & masks.mask_mod(_diagonal_band) & masks.chunked_local(8) & masks.window(4, sinks=2))
    for part in ("documents(q_ids (1, 3))", "causal(", "alibi(H=2, slopes=[0.5, 0.25]", "softcap(30)",
                 "sink(H=2, learned)", "score_mod(rel, tensors=[(2, 3)])", "mask_mod(_diagonal_band)",
                 "chunked_local(8", "sinks=2"):
        assert part in text, part


# ---------------------------------------------------------------------- contexts
@pytest.mark.parametrize("context", ["no_grad", "inference_mode", "threads_1", "threads_8"])
def test_score_kinds_in_every_context(context):
    """softcap, a sink and a score_mod with a captured table give the float64 definition under
    no_grad, inference_mode and 1 or 8 threads (the score mods run in the call's own context)."""
    from oracle import torch_threads

    make = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
            "threads_1": lambda: torch_threads(1), "threads_8": lambda: torch_threads(8)}[context]
    table = torch.randn(4, 16, dtype=torch.float64)
    logits = torch.randn(4, dtype=torch.float64)

    def rel(s, b, h, q, kv):
        return s + table[h, q - kv + 8]

    def both(s, b, h, q, kv):
        return 1.5 * torch.tanh(rel(s, b, h, q, kv) / 1.5)

    m = masks.score_mod(rel) & masks.softcap(1.5) & masks.sink(logits) & masks.causal()
    q, k, v = random_qkv(B=2, H=4, Hkv=2, Lq=7, D=8)
    want = attention64_mods(q, k, v, keep=causal_keep(7, 7), score_fn=both, sink=logits)[0]
    with make():
        out = multihead.attention(q, k, v, mask=m)
    assert (out - want).abs().max() <= 1e-12


# Module level, as FlexAttention's examples write it: the score mod reads a global table.
_REL_TABLE = torch.zeros(1)


def _relative_1d_bias(score, b, h, q_idx, kv_idx):
    return score + _REL_TABLE[h, q_idx - kv_idx + _REL_TABLE.shape[1] // 2].to(score.dtype)


@pytest.mark.parametrize("where", ["global", "closure"])
def test_a_bf16_bias_tables_gradient_is_summed_in_float32_and_rounded_once(where):
    """Issue 21, defect 7: the tiles summed a bfloat16 table's gradient in bfloat16, within each
    tile (autograd's index backward) and across tiles (0.068 off at S=277, where the rule below
    allows ~0.02). The rule is flash-attn's: at most twice the error of a reference that takes the
    same bfloat16 inputs and keeps everything in float32, plus the gradient's one final rounding."""
    global _REL_TABLE
    S, H = 277, 4
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, S, 16, generator=g).bfloat16() for _ in range(3))
    table = (torch.randn(H, 2 * S - 1, generator=g) * 0.5).bfloat16().requires_grad_(True)
    grad_out = torch.randn(1, H, S, 16, generator=g)

    def table_grad(t, dtype, backend):
        global _REL_TABLE
        if where == "global":
            _REL_TABLE = t
            mod = masks.score_mod(_relative_1d_bias)
        else:
            mod = masks.score_mod(lambda s, b, h, qi, kv: s + t[h, qi - kv + S - 1].to(s.dtype))
        out = multihead.attention(q.to(dtype), k.to(dtype), v.to(dtype), mod, backend=backend)
        return torch.autograd.grad(out, t, grad_out.to(out.dtype))[0].double()

    exact = table_grad(table.detach().double().requires_grad_(True), torch.float64, "reference")
    upcast = table_grad(table.detach().float().requires_grad_(True), torch.float32, "reference")
    got = table_grad(table, torch.bfloat16, "chunked")
    bound = 2 * (upcast - exact).abs().max() + exact.abs().max() * 2.0 ** -8
    assert (got - exact).abs().max() <= bound
    assert table.grad is None and table.dtype == torch.bfloat16  # the twin's gradient came back as bf16
    _REL_TABLE = torch.zeros(1)


# Issue 21, defect 9: FlexAttention evaluates a mod element by element (vmap over b, h, q_idx,
# kv_idx), so peers write ``bias[b][q_idx]``; multihead's broadcasting index tensors raised torch's
# raw shape error on it. Such a function is now evaluated per element, as flex does.
def test_mods_written_per_element_are_evaluated_as_flex_evaluates_them():
    from torch.nn.attention.flex_attention import flex_attention

    g = torch.Generator().manual_seed(0)
    B, H, L, D = 2, 2, 37, 8
    q, k, v = (torch.randn(B, H, L, D, generator=g, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(B, L, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[0] * 20 + [1] * 17, [0] * 5 + [1] * 32])

    def per_element(score, b, h, q_idx, kv_idx):
        return score + bias[b][q_idx]

    def broadcast(score, b, h, q_idx, kv_idx):
        return score + bias[b, q_idx]

    def same_doc(b, h, q_idx, kv_idx):
        return ids[b][q_idx] == ids[b][kv_idx]

    want = multihead.attention(q, k, v, masks.score_mod(broadcast) & masks.keep(
        ids[:, None, :, None] == ids[:, None, None, :]), backend="reference")
    wb, = torch.autograd.grad(want.sum(), bias, retain_graph=True)
    for backend in ("reference", "chunked"):
        m = masks.score_mod(per_element) & masks.mask_mod(same_doc)
        got = multihead.attention(q, k, v, m, backend=backend)
        assert (got - want).abs().max() <= 1e-12, backend
        gb, = torch.autograd.grad(got.sum(), bias)
        assert (gb - wb).abs().max() <= 1e-12, backend
    # the peer's own definition: torch's FlexAttention (unfused on the CPU) with the same mods
    from torch.nn.attention.flex_attention import create_block_mask
    bm = create_block_mask(same_doc, B, None, L, L, device="cpu")
    peer = flex_attention(q, k, v, score_mod=per_element, block_mask=bm)
    assert (want - peer).abs().max() <= 1e-12


def test_mods_that_branch_on_index_values_are_refused_by_name():
    def branches(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx if bool(q_idx >= 0) else q_idx < 0

    q = torch.randn(1, 2, 5, 4)
    with pytest.raises(TypeError, match=r"mask_mod branches .*without Python if/for"):
        multihead.attention(q, q, q, masks.mask_mod(branches))
