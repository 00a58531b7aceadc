"""Hybrid context parallelism (all-to-all inside groups of G ranks, ring across them) for more
ranks than heads: P = 4 gloo processes over a FileStore (no port), H = Hkv = 2, G = 2, against
single-process ``multihead.attention`` at float64, outputs and the gradients of q, k, v (1e-12),
with causal, window, ALiBi and key padding; a rank with another mask makes every rank raise."""

from __future__ import annotations

import traceback

import torch
from spawned import spawn_ranks
import torch.distributed as dist

import multihead as mh
from multihead import masks
from multihead.distributed import hybrid_attention, hybrid_groups

P, G = 4, 2
F64 = 1e-12
SLOPES = torch.tensor([0.5, 0.125], dtype=torch.float64)


def build(keep):
    return masks.causal() & masks.window(5) & masks.alibi(SLOPES) & masks.key_padding(keep)


def tensors():
    g = torch.Generator().manual_seed(5)
    L = 16
    q, k, v, dout = (torch.randn(2, 2, L, 8, generator=g, dtype=torch.float64) for _ in range(4))
    keep = torch.rand(2, L, generator=g) > 0.3
    keep[:, 0] = True
    return q, k, v, dout, keep


def _worker(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, P), rank=rank, world_size=P)
    res: dict = {}
    try:
        groups = hybrid_groups(G)
        q, k, v, dout, keep = tensors()
        n = q.shape[2] // P
        cut = slice(rank * n, rank * n + n)
        qs, ks, vs = (t[:, :, cut].clone().requires_grad_() for t in (q, k, v))
        o = hybrid_attention(qs, ks, vs, build(keep[:, cut]), groups=groups)
        o.backward(dout[:, :, cut])
        res["case"] = (o.detach(), qs.grad, ks.grad, vs.grad)
        x = torch.randn(1, 2, 4, 8)
        try:
            hybrid_attention(x, x, x, masks.window(2 + (rank == 3)), groups=groups, timeout=30)
            res["disagree"] = "no error"
        except ValueError as e:
            res["disagree"] = str(e)
    except Exception:  # noqa: BLE001 - reported to the parent
        res["error"] = traceback.format_exc()
    torch.save(res, f"{out}.{rank}")
    dist.destroy_process_group()


def test_hybrid_equals_one_process_and_disagreements_raise_everywhere(tmp_path):
    got = spawn_ranks(_worker, P, tmp_path)
    q, k, v, dout, keep = tensors()
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    want = mh.attention(q, k, v, build(keep))
    want.backward(dout)
    for i, ref in enumerate((want.detach(), q.grad, k.grad, v.grad)):
        torch.testing.assert_close(torch.cat([got[r]["case"][i] for r in range(P)], dim=2), ref, rtol=0, atol=F64)
    for r in range(P):
        assert "disagree on the mask kinds and parameters" in got[r]["disagree"], got[r]["disagree"]
