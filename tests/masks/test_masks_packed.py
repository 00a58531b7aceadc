"""Packed sequences: masks.documents / from_seqlens / from_cu_seqlens, alone and with causal,
window, chunked_local, alibi and key padding.

The oracle of a packed call is each document run alone (flash-attn varlen's definition):
outputs and gradients must equal it to 1e-12 in float64, on every backend that accepts the
mask. The keep tensors are compared with tests/ref64.py's loops.

Legend: B batch, H query heads, Hkv key/value heads, L packed length, D head dim.
"""

import pytest
import torch

import multihead
from multihead import masks
from multihead.backends import chunked
from ref64 import documents_keep, random_qkv

BACKENDS = ["reference", "sdpa", "chunked"]
CPU = torch.device("cpu")


def _runs(ids_row):
    """[(id, start, end)] of one row of ids."""
    out, start = [], 0
    for i in range(1, len(ids_row) + 1):
        if i == len(ids_row) or ids_row[i] != ids_row[i - 1]:
            out.append((ids_row[start], start, i))
            start = i
    return out


def _alone(q, k, v, q_ids, kv_ids, extra, backend):
    """Output of every document run alone, written into its rows; padding rows stay 0."""
    B, H, Lq, _ = q.shape
    out = torch.zeros(B, H, Lq, v.shape[-1], dtype=q.dtype)
    for b in range(B):
        qrow = q_ids[b % q_ids.shape[0]].tolist()
        krow = kv_ids[b % kv_ids.shape[0]].tolist()
        kspans = {d: (s, e) for d, s, e in _runs(krow)}
        for d, s, e in _runs(qrow):
            if d < 0 or d not in kspans:
                continue
            ks, ke = kspans[d]
            out[b:b + 1, :, s:e] = multihead.attention(
                q[b:b + 1, :, s:e], k[b:b + 1, :, ks:ke], v[b:b + 1, :, ks:ke], mask=extra(), backend=backend
            )
    return out


def _packed_vs_alone(q_ids, kv_ids, extra, backend, *, lq=None, lk=None, B=None, H=4, Hkv=2, seed=0):
    q_ids = q_ids.view(-1, q_ids.shape[-1])
    kv_ids = q_ids if kv_ids is None else kv_ids.view(-1, kv_ids.shape[-1])
    B = B or max(q_ids.shape[0], kv_ids.shape[0])
    q, k, v = random_qkv(B=B, H=H, Hkv=Hkv, Lq=q_ids.shape[1], Lk=kv_ids.shape[1], D=8, seed=seed, grad=True)
    doc = masks.documents(q_ids) if kv_ids is q_ids else masks.documents(q_ids, kv_ids)
    mask = doc if extra() is None else doc & extra()
    g = torch.Generator().manual_seed(seed + 1)
    grad_out = torch.randn(B, H, q.shape[2], v.shape[-1], generator=g, dtype=torch.float64)

    packed = multihead.attention(q, k, v, mask=mask, backend=backend)
    grads = torch.autograd.grad(packed, (q, k, v), grad_out)
    alone = _alone(q, k, v, q_ids, kv_ids, extra, "reference")
    want = torch.autograd.grad(alone, (q, k, v), grad_out)
    assert (packed - alone).abs().max() <= 1e-12
    for got, exp, name in zip(grads, want, "qkv"):
        assert (got - exp).abs().max() <= 1e-12, f"grad {name}"
    return packed


EXTRAS = {
    "none": lambda: None,
    "causal": lambda: masks.causal(),
    "causal_top_left": lambda: masks.causal("top_left"),
    "window": lambda: masks.window(2),
    "window_sinks": lambda: masks.window(1, sinks=2),
    "chunked_causal": lambda: masks.causal() & masks.chunked_local(3),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("extra", list(EXTRAS))
def test_packed_equals_each_document_alone(backend, extra):
    ids = torch.tensor([[0] * 5 + [1] * 1 + [2] * 7 + [3] * 3,
                        [7] * 9 + [-1] * 2 + [4] * 5])           # row 1: another layout, padding inside
    _packed_vs_alone(ids, None, EXTRAS[extra], backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("extra", ["causal", "causal_top_left", "window", "chunked_causal"])
def test_queries_and_keys_of_different_lengths_align_per_document(backend, extra):
    """A decode step over a cache of packed documents: the queries are each document's last
    tokens; bottom-right puts each document's last query on its last key (flash-attn varlen)."""
    kv_ids = torch.tensor([0] * 6 + [1] * 4 + [2] * 5)
    q_ids = torch.tensor([0] * 2 + [1] * 1 + [2] * 3)
    _packed_vs_alone(q_ids, kv_ids, EXTRAS[extra], backend, B=2)


def test_packed_training_step_matches_documents_trained_alone():
    """One SGD step of a causal module on a packed batch with positions restarting per document
    gives the same weights as the step on the documents one by one (the loss summed)."""
    torch.manual_seed(0)
    lengths = [3, 5, 2]
    mha = multihead.MultiHeadAttention(16, 4, causal=True, rope=True, dtype=torch.float64)
    twin = multihead.MultiHeadAttention(16, 4, causal=True, rope=True, dtype=torch.float64)
    twin.load_state_dict(mha.state_dict())
    x = torch.randn(1, sum(lengths), 16, dtype=torch.float64)
    positions = torch.cat([torch.arange(n) for n in lengths])
    packed = mha(x, mask=masks.from_seqlens(lengths), positions=positions)
    packed.square().sum().backward()
    starts = [0, 3, 8]
    alone = torch.cat([twin(x[:, s:s + n]) for s, n in zip(starts, lengths)], dim=1)
    alone.square().sum().backward()
    assert (packed - alone).abs().max() <= 1e-12
    for (name, p), (_, t) in zip(mha.named_parameters(), twin.named_parameters()):
        assert (p.grad - t.grad).abs().max() <= 1e-12, name


def test_seqlens_cu_seqlens_and_ids_are_one_mask():
    shape = (1, 1, 9, 9)
    a = masks.from_seqlens([2, 0, 4, 3]) & masks.causal()
    b = masks.from_cu_seqlens([0, 2, 2, 6, 9]) & masks.causal()
    c = masks.documents(torch.tensor([0, 0, 2, 2, 2, 2, 3, 3, 3])) & masks.causal()
    want = documents_keep(torch.tensor([0, 0, 2, 2, 2, 2, 3, 3, 3]), causal="bottom_right")[0, 0]
    for m in (a, b, c):
        assert torch.equal(m.materialize(shape, device=CPU, dtype=torch.float64).keep, want)
    assert repr(a) == "from_seqlens([2, 0, 4, 3]) & causal(align='bottom_right')"
    assert repr(b).startswith("from_cu_seqlens([0, 2, 2, 6, 9])")


@pytest.mark.parametrize("extra", [
    dict(), dict(causal="bottom_right"), dict(causal="top_left"), dict(window=(1, 0, "bottom_right")),
    dict(window=(2, 1, "top_left")), dict(window=(0, 0, "bottom_right"), sinks=2),
    dict(chunk=(2, "bottom_right")), dict(chunk=(3, "top_left"), causal="top_left"),
])
def test_documents_keep_matches_the_definition(extra):
    kv_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 5, 5, -1], [2, 2, 2, 2, 2, 2, 3, 3, 3, 3]])
    q_ids = torch.tensor([[0, 0, 1, 1, 5, -1], [2, 2, 2, 3, 3, 3]])
    parts = []
    if "causal" in extra:
        parts.append(masks.causal(extra["causal"]))
    if "window" in extra:
        left, right, align = extra["window"]
        parts.append(masks.window(left, right, align=align, sinks=extra.get("sinks", 0)))
    if "chunk" in extra:
        parts.append(masks.chunked_local(extra["chunk"][0], align=extra["chunk"][1]))
    m = masks.documents(q_ids, kv_ids)
    for p in parts:
        m = m & p
    got = m.materialize((2, 3, 6, 10), device=CPU, dtype=torch.float32).keep
    assert torch.equal(got.expand(2, 1, 6, 10), documents_keep(q_ids, kv_ids, **extra))


def test_padding_ids_see_nothing_and_give_zero_rows():
    ids = torch.tensor([0, 0, -1, 1, 1, -3])
    q, k, v = random_qkv(B=1, H=2, Lq=6, D=4)
    for backend in BACKENDS:
        out = multihead.attention(q, k, v, mask=masks.documents(ids) & masks.causal(), backend=backend)
        assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))
        assert torch.equal(out[:, :, 5], torch.zeros_like(out[:, :, 5]))
    w = multihead.attention_weights(q, k, masks.documents(ids))
    assert torch.equal(w[..., 2], torch.zeros_like(w[..., 2]))


def test_documents_compose_with_key_padding_and_alibi():
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1]])
    real = torch.tensor([[True, True, False, True, True, True, False]])
    slopes = masks.alibi_slopes(2)
    m = masks.documents(ids) & masks.causal() & masks.key_padding(real) & masks.alibi(slopes)
    t = m.materialize((1, 2, 7, 7), device=CPU, dtype=torch.float64)
    want = documents_keep(ids, causal="bottom_right") & real.view(1, 1, 1, 7)
    assert torch.equal(t.keep.expand(1, 1, 7, 7), want)
    # alibi per document: the distance to the query's own diagonal inside its document
    i = torch.arange(7).view(7, 1)
    j = torch.arange(7).view(1, 7)
    assert torch.equal(t.bias, (-slopes.view(1, 2, 1, 1) * (j - i).abs()).to(t.bias.dtype))


def test_key_span_is_the_hull_of_the_visible_keys():
    kv_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2], [3] * 12])
    m = masks.documents(kv_ids) & masks.window(2)
    keep = m.materialize((2, 1, 12, 12), device=CPU, dtype=torch.float32).keep.expand(2, 1, 12, 12)
    for q0 in range(12):
        for q1 in range(q0 + 1, 13):
            seen = keep[:, 0, q0:q1].any(0).any(0).nonzero().flatten()
            lo, hi = m.key_span(q0, q1, 12, 12)
            assert (int(seen.min()), int(seen.max()) + 1) == (lo, hi)


@pytest.mark.parametrize("bad,match,error", [
    (torch.tensor([0.0, 1.0]), "integer document ids", TypeError),
    (torch.tensor([True, False]), "integer document ids", TypeError),
    (torch.zeros(1, 2, 3, dtype=torch.long), r"\(B, L\) or \(L,\)", ValueError),
    ([0, 0, 1], "torch.Tensor of document ids", TypeError),
    (torch.tensor([0, 0, 1, 0]), "one contiguous run", ValueError),
])
def test_bad_document_ids(bad, match, error):
    with pytest.raises(error, match=match):
        masks.documents(bad)


def test_documents_checked_against_the_call_before_any_work():
    q, k, v = random_qkv(B=2, H=2, Lq=5, D=4)
    with pytest.raises(ValueError, match=r"lengths sum to 4 but the call has Lq=5"):
        multihead.attention(q, k, v, mask=masks.from_seqlens([1, 3]))
    with pytest.raises(ValueError, match=r"has 4 ids per row but the call has Lq=5"):
        multihead.attention(q, k, v, mask=masks.documents(torch.tensor([0, 0, 1, 1])))
    with pytest.raises(ValueError, match=r"ids for batch 3 but the call has B=2"):
        multihead.attention(q, k, v, mask=masks.documents(torch.zeros(3, 5, dtype=torch.long)))
    with pytest.raises(ValueError, match="must start at 0"):
        masks.from_cu_seqlens([1, 3])
    with pytest.raises(ValueError, match="must not decrease"):
        masks.from_cu_seqlens([0, 3, 2])
    with pytest.raises(ValueError, match="must be >= 0"):
        masks.from_seqlens([2, -1])
    with pytest.raises(TypeError, match="must hold ints"):
        masks.from_seqlens([2.0, 3])
    with pytest.raises(ValueError, match="one documents part"):
        masks.from_seqlens([2, 3]) & masks.from_seqlens([5])


def test_module_positions_restart_per_document_with_rope():
    torch.manual_seed(1)
    mha = multihead.MultiHeadAttention(8, 2, causal=True, rope=True, dtype=torch.float64)
    x = torch.randn(2, 7, 8, dtype=torch.float64)
    ids = torch.tensor([[0, 0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1]])
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2], [0, 1, 0, 1, 2, 3, 4]])
    out = mha(x, mask=masks.documents(ids), positions=positions)
    assert (out[0:1, 4:] - mha(x[0:1, 4:])).abs().max() <= 1e-12
    assert (out[1:2, 2:] - mha(x[1:2, 2:])).abs().max() <= 1e-12


def test_module_positions_rotate_each_row_at_its_own_positions():
    """positions= (B, L) with gaps: the module equals its projections rotated row by row by
    RoPE at those positions (RoPE's own (L,) path), then causal attention and the output projection."""
    torch.manual_seed(3)
    mha = multihead.MultiHeadAttention(8, 2, causal=True, rope=True, dtype=torch.float64)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    positions = torch.tensor([[0, 1, 2, 10, 11], [7, 3, 0, 4, 9]])
    out = mha(x, positions=positions)
    rows = []
    for b in range(2):
        def heads(t):
            return t.view(1, 5, 2, 4).transpose(1, 2)
        q = mha.rope(heads(mha.q_proj(x[b:b + 1])), positions=positions[b])
        k = mha.rope(heads(mha.k_proj(x[b:b + 1])), positions=positions[b])
        o = multihead.attention(q, k, heads(mha.v_proj(x[b:b + 1])), mask=masks.causal(), backend="reference")
        rows.append(mha.out_proj(o.transpose(1, 2).reshape(1, 5, 8)))
    assert (out - torch.cat(rows)).abs().max() <= 1e-12


@torch.no_grad()
def test_module_positions_with_a_cache_are_the_new_tokens_positions():
    """positions= in a decode loop: each step's tokens are rotated at the given positions; a
    document that starts mid-stream restarts at 0 and, with documents(q_ids, kv_ids), sees only
    itself, so its outputs equal running it alone."""
    torch.manual_seed(2)
    mha = multihead.MultiHeadAttention(8, 2, causal=True, rope=True, dtype=torch.float64)
    x = torch.randn(1, 6, 8, dtype=torch.float64)
    ids = torch.tensor([0, 0, 0, 1, 1, 1])
    cache = multihead.KVCache(max_len=6)
    outs = []
    for t in range(6):
        kv = ids[: t + 1]
        outs.append(mha(x[:, t:t + 1], cache=cache, positions=torch.tensor([t if t < 3 else t - 3]),
                        mask=masks.documents(ids[t:t + 1], kv)))
    stepped = torch.cat(outs, dim=1)
    assert (stepped[:, :3] - mha(x[:, :3])).abs().max() <= 1e-12
    assert (stepped[:, 3:] - mha(x[:, 3:])).abs().max() <= 1e-12


@pytest.mark.parametrize("bad,match,error", [
    (torch.tensor([0.0, 1.0, 2.0]), "integer torch.Tensor", TypeError),
    (torch.tensor([0, 1]), r"\(B, Lq\) = \(1, 3\) or \(Lq,\) = \(3,\)", ValueError),
    (torch.tensor([0, -1, 2]), "must be >= 0", ValueError),
])
def test_module_positions_bad_input(bad, match, error):
    mha = multihead.MultiHeadAttention(8, 2, causal=True, rope=True)
    with pytest.raises(error, match=match):
        mha(torch.randn(1, 3, 8), positions=bad)


def test_module_positions_need_rope():
    mha = multihead.MultiHeadAttention(8, 2, causal=True)
    with pytest.raises(ValueError, match="rope=False; build it with rope=True"):
        mha(torch.randn(1, 3, 8), positions=torch.arange(3))


@pytest.mark.parametrize("extra", ["alibi", "causal_alibi", "window_alibi"])
def test_alibi_aligns_per_document_on_tiles_the_mask_shows_whole(extra):
    """Issue 21, defect 1: on a tile the selecting parts show whole, the chunked kernel built
    the ALiBi part without the documents it aligns to, so ALiBi sat on the whole call's
    diagonal (1.2 off at default tiles when queries and keys have different lengths). Small
    tiles make whole tiles at small lengths; every document is checked against running it alone."""
    parts = {"alibi": lambda: masks.alibi(masks.alibi_slopes(4)),
             "causal_alibi": lambda: masks.causal() & masks.alibi(masks.alibi_slopes(4)),
             "window_alibi": lambda: masks.window(6) & masks.alibi(masks.alibi_slopes(4))}[extra]
    q_ids = torch.tensor([0] * 9 + [1] * 13 + [2] * 6)
    kv_ids = torch.tensor([0] * 12 + [1] * 17 + [2] * 10)
    q, k, v = random_qkv(B=1, H=4, Hkv=2, Lq=28, Lk=39, D=8, seed=3, grad=True)
    m = masks.documents(q_ids, kv_ids) & parts()
    alone = _alone(q, k, v, q_ids.view(1, -1), kv_ids.view(1, -1), parts, "reference")
    got = chunked.chunked_attention(q, k, v, m, block_q=2, block_k=3)
    assert (got - alone).abs().max() <= 1e-12
    g = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(alone, (q, k, v), g)):
        assert (a - b).abs().max() <= 1e-12
    # the issue's own call: default tiles through multihead.attention, and selected weights
    qd, kd, vd = random_qkv(B=1, H=4, Lq=1000, Lk=1300, D=8, seed=4)
    md = masks.from_seqlens([300, 500, 200], [400, 600, 300]) & masks.alibi(masks.alibi_slopes(4))
    ref = multihead.attention(qd, kd, vd, md, backend="reference")
    assert (multihead.attention(qd, kd, vd, md, backend="chunked") - ref).abs().max() <= 1e-12
    rows = list(range(0, 1000, 37))
    w = multihead.attention_weights(qd, kd, md, heads=[1, 3], rows=rows)
    full = multihead.attention_weights(qd, kd, md)[:, [1, 3]][:, :, rows]
    assert (w - full).abs().max() <= 1e-12
