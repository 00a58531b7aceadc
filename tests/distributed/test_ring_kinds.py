"""The ring carries window (with sinks), chunked_local, ALiBi and softcap (each block pair
applies them at its global positions, per document with packed documents: the whole
sequence's row intervals and diagonals, sliced at the pair's rows and key offset) and sink logits (once per row, after the ring; their
gradient summed over the ranks). 2 gloo processes over a FileStore (no port) against
single-process ``multihead.attention`` at float64, outputs and the gradients of q, k, v
(1e-12: the same products, merged in another order); and ranks passing different windows all
raise a named ValueError."""

from __future__ import annotations

import traceback

import pytest
import torch
from spawned import spawn_ranks
import torch.distributed as dist

import multihead as mh
from multihead import masks
from multihead.distributed import DocumentLayout, ring_attention, shard_sequence, unshard_sequence

P = 2
F64 = 1e-12
SLOPES = masks.alibi_slopes(4)
DOCS = [6, 4, 6]  # packed documents of the 16 tokens (multiples of P for the balanced layout)
#: per batch row: row 0 packs DOCS, row 1 other documents (the zigzag and contiguous cases)
IDS = torch.stack([torch.repeat_interleave(torch.arange(3), torch.tensor(DOCS)),
                   torch.repeat_interleave(torch.arange(3), torch.tensor([3, 9, 4]))])
BALANCED = DocumentLayout(DOCS)
# each case: (the mask from the shards of keep and of the documents' ids, layout, ids)
CASES = {
    "window_sinks_causal": (lambda kp, ids: masks.causal() & masks.window(3, sinks=2), "zigzag", IDS),
    "chunked_causal_padding": (lambda kp, ids: masks.causal() & masks.chunked_local(4) & masks.key_padding(kp), "zigzag", IDS),
    "alibi_softcap": (lambda kp, ids: masks.alibi(SLOPES) & masks.softcap(2.0), "contiguous", IDS),
    # ALiBi adds before the softcap modifies, whatever the written order (as in one process)
    "softcap_then_alibi": (lambda kp, ids: masks.softcap(2.0) & masks.alibi(SLOPES), "contiguous", IDS),
    "window_both_sides_padding": (lambda kp, ids: masks.window(2, 3) & masks.key_padding(kp), "contiguous", IDS),
    # inside packed documents: sinks, chunks and ALiBi's diagonal start again at each document
    "documents_causal_window_sinks_zigzag": (
        lambda kp, ids: masks.documents(ids) & masks.causal() & masks.window(2, sinks=2), "zigzag", IDS),
    "documents_causal_window_sinks_balanced": (
        lambda kp, ids: masks.documents(ids) & masks.causal() & masks.window(2, sinks=2), BALANCED, IDS[:1]),
    "documents_alibi_padding": (
        lambda kp, ids: masks.documents(ids) & masks.alibi(SLOPES) & masks.key_padding(kp), "contiguous", IDS),
    "documents_causal_alibi_balanced": (
        lambda kp, ids: masks.documents(ids) & masks.causal() & masks.alibi(SLOPES), BALANCED, IDS[:1]),
    "documents_causal_chunked_balanced": (
        lambda kp, ids: masks.causal() & masks.chunked_local(4) & masks.documents(ids), BALANCED, IDS[:1]),
    "documents_chunked_zigzag": (lambda kp, ids: masks.documents(ids) & masks.chunked_local(3), "zigzag", IDS),
}


UNEVEN = 5  # rank 0's tokens in the uneven case (the ranks gather the ids of shards of different lengths)


def uneven_mask(ids):
    return masks.documents(ids) & masks.causal() & masks.window(2, sinks=2) & masks.alibi(SLOPES)


LOGITS = torch.tensor([0.3, -1.0, 2.0, 0.0], dtype=torch.float64)


def tensors(name):
    g = torch.Generator().manual_seed(len(name))
    L = 16
    q = torch.randn(2, 4, L, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, L, 8, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(2, 4, L, 8, generator=g, dtype=torch.float64)
    keep = torch.rand(2, L, generator=g) > 0.3
    keep[:, 0] = True
    return q, k, v, dout, keep


def _worker(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, P), rank=rank, world_size=P)
    res: dict = {}
    try:
        for name, (build, layout, ids) in CASES.items():
            q, k, v, dout, keep = tensors(name)
            qs, ks, vs = (shard_sequence(t, rank, P, layout).requires_grad_() for t in (q, k, v))
            o = ring_attention(qs, ks, vs, build(shard_sequence(keep, rank, P, layout, dim=-1),
                                                 shard_sequence(ids, rank, P, layout, dim=-1)), layout=layout)
            o.backward(shard_sequence(dout, rank, P, layout))
            res[name] = (o.detach(), qs.grad, ks.grad, vs.grad)
        q, k, v, dout, keep = tensors("uneven")
        part = slice(0, UNEVEN) if rank == 0 else slice(UNEVEN, None)  # contiguous shards of 5 and 11 tokens
        qs, ks, vs = (t[..., part, :].clone().requires_grad_() for t in (q, k, v))
        o = ring_attention(qs, ks, vs, uneven_mask(IDS[:, part]), layout="contiguous")
        o.backward(dout[..., part, :])
        res["uneven"] = (o.detach(), qs.grad, ks.grad, vs.grad)
        q, k, v, dout, keep = tensors("sink")
        qs, ks, vs = (shard_sequence(t, rank, P, "zigzag").requires_grad_() for t in (q, k, v))
        logits = LOGITS.clone().requires_grad_()
        o = ring_attention(qs, ks, vs, masks.causal() & masks.sink(logits) & masks.key_padding(
            shard_sequence(keep, rank, P, "zigzag", dim=-1)), layout="zigzag")
        o.backward(shard_sequence(dout, rank, P, "zigzag"))
        res["sink"] = (o.detach(), qs.grad, ks.grad, vs.grad, logits.grad)
        x = torch.randn(1, 2, 4, 8)
        try:
            ring_attention(x, x, x, masks.window(2 + rank), timeout=30)
            res["disagree"] = "no error"
        except ValueError as e:
            res["disagree"] = str(e)
    except Exception:  # noqa: BLE001 - reported to the parent
        res["error"] = traceback.format_exc()
    torch.save(res, f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_worker, P, tmp_path_factory.mktemp("ring_kinds"))


@pytest.mark.parametrize("name", CASES)
def test_ring_carries_the_kind_and_equals_one_process(ranks, name):
    build, layout, ids = CASES[name]
    q, k, v, dout, keep = tensors(name)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    want = mh.attention(q, k, v, build(keep, ids))
    want.backward(dout)
    for i, ref in enumerate((want.detach(), q.grad, k.grad, v.grad)):
        torch.testing.assert_close(unshard_sequence([ranks[r][name][i] for r in range(P)], layout), ref,
                                   rtol=0, atol=F64)


def test_uneven_contiguous_shards_gather_the_ids_and_equal_one_process(ranks):
    q, k, v, dout, _ = tensors("uneven")
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    want = mh.attention(q, k, v, uneven_mask(IDS))
    want.backward(dout)
    for i, ref in enumerate((want.detach(), q.grad, k.grad, v.grad)):
        torch.testing.assert_close(torch.cat([ranks[r]["uneven"][i] for r in range(P)], -2), ref, rtol=0, atol=F64)


def test_sink_logits_travel_once_per_row_with_their_gradient(ranks):
    q, k, v, dout, keep = tensors("sink")
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    logits = LOGITS.clone().requires_grad_()
    want = mh.attention(q, k, v, masks.causal() & masks.sink(logits) & masks.key_padding(keep))
    want.backward(dout)
    for i, ref in enumerate((want.detach(), q.grad, k.grad, v.grad)):
        torch.testing.assert_close(unshard_sequence([ranks[r]["sink"][i] for r in range(P)], "zigzag"), ref,
                                   rtol=0, atol=F64)
    torch.testing.assert_close(sum(ranks[r]["sink"][4] for r in range(P)), logits.grad, rtol=0, atol=F64)


def test_ranks_with_different_windows_all_raise(ranks):
    for r in range(P):
        assert "disagree on the mask kinds and parameters" in ranks[r]["disagree"]


def test_kinds_the_ring_cannot_place_are_refused_by_name():
    x = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="ulysses_attention takes every mask kind"):
        ring_attention(x, x, x, masks.bias(torch.zeros(4, 4)))
    with pytest.raises(ValueError, match="q and k cut alike, got Lq=4 and Lk=6"):
        y = torch.randn(1, 2, 6, 8)
        ring_attention(x, y, y, masks.window(2))
