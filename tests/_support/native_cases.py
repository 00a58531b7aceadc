"""The native kernel's test cases: every mask kind it reads, on grouped heads (tests/backends/
test_native.py, test_native_amx.py).

Legend: B batch, H query heads, Hkv kv heads, Lq/Lk lengths, D head dim, Dv value dim.
"""

from __future__ import annotations

import torch

from multihead import masks

B, H, HKV, D, DV = 2, 4, 2, 16, 8


def ids(lengths, total):
    """(B, total) document ids: documents of ``lengths``, then -1 (padding) to ``total``."""
    owner = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    return torch.cat([owner, torch.full((total - len(owner),), -1)])[None].expand(B, total).clone()


def build_mask(kind: str, lq: int, lk: int, g: torch.Generator):
    """A mask of ``kind`` for (B, H, lq, lk) (the float tensors in float32, drawn from ``g``)."""
    slopes = masks.alibi_slopes(H)
    pad = torch.ones(B, lk, dtype=torch.bool)
    pad[0, :3] = False
    pad[1, lk - 5:] = False
    cases = {
        "none": lambda: None,
        "causal": lambda: masks.causal(),
        "causal_top_left": lambda: masks.causal("top_left"),
        "window_sinks": lambda: masks.window(5, 0, sinks=2),
        "window_two_sided": lambda: masks.window(4, 3, align="top_left"),
        "documents": lambda: masks.documents(ids([7, 1, lq - 12], lq), ids([9, 3, lk - 15], lk)) & masks.causal(),
        "chunked_local": lambda: masks.causal() & masks.chunked_local(6),
        "padding": lambda: masks.key_padding(pad) & masks.causal(),
        "alibi_documents": lambda: masks.alibi(slopes) & masks.documents(ids([10, lq - 10], lq), ids([12, lk - 12], lk)),
        "softcap": lambda: masks.causal() & masks.softcap(2.0),
        "sink": lambda: masks.causal() & masks.sink(torch.randn(H, generator=g)),
        "bias_full": lambda: masks.bias(torch.randn(B, H, lq, lk, generator=g)) & masks.window(6),
        "bias_broadcast": lambda: masks.bias(torch.randn(1, H, 1, lk, generator=g)) & masks.causal() & masks.softcap(3.0),
        "everything": lambda: (masks.key_padding(pad) & masks.window(7, sinks=1) & masks.alibi(slopes)
                               & masks.bias(torch.randn(B, 1, lq, 1, generator=g)) & masks.softcap(4.0)),
    }
    return cases[kind]()


KINDS = ["none", "causal", "causal_top_left", "window_sinks", "window_two_sided", "documents", "chunked_local",
         "padding", "alibi_documents", "softcap", "sink", "bias_full", "bias_broadcast", "everything"]


def inputs(dtype, lq, lk, seed=0, scale=1.0, d=None, dv=None):
    """q (B, H, lq, d), k (B, Hkv, lk, d), v (B, Hkv, lk, dv) of ``dtype`` (q and k times
    ``scale``; d and dv default to D and DV), and the generator that drew them."""
    d, dv = d or D, dv or DV
    g = torch.Generator().manual_seed(seed)
    q = (scale * torch.randn(B, H, lq, d, generator=g)).to(dtype)
    k = (scale * torch.randn(B, HKV, lk, d, generator=g)).to(dtype)
    v = torch.randn(B, HKV, lk, dv, generator=g).to(dtype)
    return q, k, v, g
