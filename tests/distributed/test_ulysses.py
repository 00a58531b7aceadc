"""All-to-all (Ulysses) context parallelism across 2 real processes (gloo, a FileStore in
tmp_path: no port), every mask kind, against single-process ``multihead.attention`` on the whole
sequence at float64 (outputs and the gradients of q, k, v: 1e-12, the same products in another
order). The reference is independent of the all-to-all: one process, no sharding.

One spawn runs every case (each process costs a torch import); a second one checks that the
ranks' disagreements and rejected arguments raise a named ValueError on every rank."""

from __future__ import annotations

import traceback

import pytest
import torch
from spawned import spawn_ranks
import torch.distributed as dist

import multihead as mh
from multihead import masks
from multihead.distributed import shard_sequence, unshard_sequence
from multihead.distributed import ulysses_attention

P = 2
B, H, HKV, D = 2, 4, 2, 8
F64 = 1e-12


def case(name: str):
    """(q, k, v, dout, mask builder(keep, ids) of the whole sequence or of shards, layout, lengths)."""
    g = torch.Generator().manual_seed(len(name) * 7919)
    L = 12
    lengths = [5, 7] if name == "uneven" else [L // P] * P
    q = torch.randn(B, H, L, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, HKV, L, D, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(B, H, L, D, generator=g, dtype=torch.float64)
    keep = torch.rand(B, L, generator=g) > 0.3
    keep[:, 0] = True
    ids = torch.tensor([[0] * 4 + [1] * 5 + [2] * 3])
    logits = torch.randn(H, generator=g, dtype=torch.float64)
    slopes = mh.masks.alibi_slopes(H)
    build = {
        "window_sinks": lambda kp, di: masks.causal() & masks.window(3, sinks=2),
        "chunked_local": lambda kp, di: masks.causal() & masks.chunked_local(4),
        "alibi_softcap": lambda kp, di: masks.alibi(slopes) & masks.softcap(2.0) & masks.causal(),
        "sink_padding": lambda kp, di: masks.sink(logits) & masks.key_padding(kp),
        "documents_zigzag": lambda kp, di: masks.documents(di) & masks.causal() & masks.alibi(slopes),
        "uneven": lambda kp, di: masks.causal() & masks.window(4) & masks.key_padding(kp),
    }[name]
    layout = "zigzag" if name == "documents_zigzag" else "contiguous"
    return q, k, v, dout, keep, ids, build, layout, lengths


CASES = ["window_sinks", "chunked_local", "alibi_softcap", "sink_padding", "documents_zigzag", "uneven"]


def shard(x, rank, layout, lengths, dim=-2):
    if layout == "zigzag" or len(set(lengths)) == 1:
        return shard_sequence(x, rank, P, layout, dim=dim)
    start = sum(lengths[:rank])
    return x.narrow(dim, start, lengths[rank])


def _worker(rank: int, store_path: str, out_path: str, mode: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, P), rank=rank, world_size=P)
    results = {}
    try:
        if mode == "cases":
            for name in CASES:
                q, k, v, dout, keep, ids, build, layout, lengths = case(name)
                qs, ks, vs = (shard(t, rank, layout, lengths).requires_grad_() for t in (q, k, v))
                mask = build(shard(keep, rank, layout, lengths, dim=-1), shard(ids, rank, layout, lengths, dim=-1))
                out = ulysses_attention(qs, ks, vs, mask, layout=layout)
                out.backward(shard(dout, rank, layout, lengths))
                results[name] = (out.detach(), qs.grad, ks.grad, vs.grad)
        else:
            x = torch.randn(1, 4, 6, 8)
            for name, mask, heads in (("window", masks.causal() & masks.window(3 + rank), 4),
                                      ("alibi", masks.alibi(torch.tensor([0.5, 0.25, 0.1, 0.05 * (rank + 1)])), 4),
                                      ("heads", None, 3)):
                try:
                    ulysses_attention(x[:, :heads], x[:, :heads], x[:, :heads], mask, timeout=30)
                    results[name] = "no error"
                except ValueError as e:
                    results[name] = str(e)
    except Exception:  # noqa: BLE001 - reported to the parent
        results["error"] = traceback.format_exc()
    torch.save(results, f"{out_path}.{rank}")
    dist.destroy_process_group()


def _run(tmp_path, mode):
    return spawn_ranks(_worker, P, tmp_path, mode)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("ulysses"), "cases")


@pytest.mark.parametrize("name", CASES)
def test_every_mask_kind_equals_one_process(ranks, name):
    q, k, v, dout, keep, ids, build, layout, lengths = case(name)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    want = mh.attention(q, k, v, build(keep, ids))
    want.backward(dout)
    for i, ref in enumerate((want.detach(), q.grad, k.grad, v.grad)):
        parts = [ranks[r][name][i] for r in range(P)]
        got = unshard_sequence(parts, layout) if layout == "zigzag" else torch.cat(parts, dim=-2)
        torch.testing.assert_close(got, ref, rtol=0, atol=F64)


def test_disagreements_and_rejections_raise_on_every_rank(tmp_path):
    got = _run(tmp_path, "disagree")
    for r in range(P):
        assert "disagree on the mask kinds and parameters" in got[r]["window"]
        assert "disagree on the mask kinds and parameters" in got[r]["alibi"]
        assert "P must divide H=3" in got[r]["heads"]
