"""The ring with uneven contiguous shards, no padding (issue 27 item 3): 2 gloo processes over a
FileStore in tmp_path holding 5 and 11 tokens of a 16-token sequence, against single-process
``multihead.attention`` at float64 (outputs and the gradients of q, k, v: 1e-12, the same
products merged in another order); zigzag shards of different lengths are still refused on
every rank, naming the field."""

from __future__ import annotations

import traceback

import pytest
import torch
from spawned import spawn_ranks
import torch.distributed as dist

import multihead as mh
from multihead import masks
from multihead.distributed import ring_attention

P = 2
L = 16
LENGTHS = [5, 11]
F64 = 1e-12
SLOPES = masks.alibi_slopes(4)
IDS = torch.tensor([[0] * 3 + [1] * 7 + [2] * 6])
CASES = {
    "causal": lambda kp, ids: masks.causal(),
    "no_mask": lambda kp, ids: None,
    "causal_window_sinks_padding": lambda kp, ids: masks.causal() & masks.window(3, sinks=2) & masks.key_padding(kp),
    "alibi_softcap": lambda kp, ids: masks.alibi(SLOPES) & masks.softcap(2.0),
    "documents_causal": lambda kp, ids: masks.documents(ids) & masks.causal(),
}


def tensors(name):
    g = torch.Generator().manual_seed(len(name))
    q = torch.randn(2, 4, L, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, L, 8, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(2, 4, L, 8, generator=g, dtype=torch.float64)
    keep = torch.rand(2, L, generator=g) > 0.3
    keep[:, 0] = True
    return q, k, v, dout, keep


def mine(x, rank, dim=-2):
    return x.narrow(dim, sum(LENGTHS[:rank]), LENGTHS[rank])


def _worker(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, P), rank=rank, world_size=P)
    res: dict = {}
    try:
        for name, build in CASES.items():
            q, k, v, dout, keep = tensors(name)
            qs, ks, vs = (mine(t, rank).requires_grad_() for t in (q, k, v))
            o = ring_attention(qs, ks, vs, build(mine(keep, rank, -1), mine(IDS, rank, -1)), layout="contiguous")
            o.backward(mine(dout, rank))
            res[name] = (o.detach(), qs.grad, ks.grad, vs.grad)
        x = torch.randn(1, 2, 4 + 2 * rank, 8)
        try:
            ring_attention(x, x, x, causal=True, layout="zigzag", timeout=30)
            res["zigzag"] = "no error"
        except ValueError as e:
            res["zigzag"] = str(e)
    except Exception:  # noqa: BLE001 - reported to the parent
        res["error"] = traceback.format_exc()
    torch.save(res, f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_worker, P, tmp_path_factory.mktemp("ring_uneven"))


@pytest.mark.parametrize("name", CASES)
def test_uneven_contiguous_shards_equal_one_process(ranks, name):
    q, k, v, dout, keep = tensors(name)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    want = mh.attention(q, k, v, CASES[name](keep, IDS))
    want.backward(dout)
    for i, ref in enumerate((want.detach(), q.grad, k.grad, v.grad)):
        assert [ranks[r][name][i].shape[-2] for r in range(P)] == LENGTHS
        got = torch.cat([ranks[r][name][i] for r in range(P)], dim=-2)
        torch.testing.assert_close(got, ref, rtol=0, atol=F64)


def test_uneven_zigzag_shards_are_refused_on_every_rank(ranks):
    for r in range(P):
        assert "key/value shard length Lk: " in ranks[r]["zigzag"], ranks[r]["zigzag"]
        assert "contiguous shards may be uneven" in ranks[r]["zigzag"]
