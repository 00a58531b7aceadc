"""Fixed attention calls of each mask family, shared by the context matrix (test_contexts.py)
and the device matrix (test_devices.py): one definition, so both files test the same calls.

Each call is several default tiles long in each direction when the chunked backend runs with
small blocks, has grouped-query heads (H=4, Hkv=2) and Lq != Lk where the kind allows it.
"""

from __future__ import annotations

import torch

from oracle import MaskPart
from test_properties import Case, _values

#: the mask families: none, causal cross-attention (Lq < Lk), key padding with a large
#: negative bias, a sliding window with keys on both sides, packed documents (per-row layouts,
#: longer keys: a decode over packed caches, padding ids), Llama 4's chunks with a window that
#: keeps 3 sink tokens
MASK_KINDS = ("none", "causal_cross", "padding_bias", "window", "packed", "chunked_sinks")


def fixed_case(kind: str, dtype: torch.dtype = torch.float32) -> Case:
    """The call of mask family ``kind`` (one of MASK_KINDS) on the CPU, values of ``dtype``."""
    gen = torch.Generator().manual_seed(sum(map(ord, kind)))
    B, H, Hkv, D, Dv = 2, 4, 2, 8, 8
    Lq, Lk = {"causal_cross": (33, 47), "window": (40, 40)}.get(kind, (37, 41))
    if kind == "none":
        parts = []
    elif kind == "causal_cross":
        parts = [MaskPart("causal")]
    elif kind == "padding_bias":  # row 1's first 20 keys are padding; a float32 bias far below 0
        real = torch.arange(Lk).expand(B, Lk) >= 20 * torch.arange(B)[:, None]
        parts = [MaskPart("key_padding", tensor=real), MaskPart("bias", tensor=_values(gen, (B, H, Lq, Lk)) * 3 - 90)]
    elif kind == "window":
        parts = [MaskPart("window", left=5, right=2)]
    elif kind == "packed":
        q_ids = torch.tensor([[0] * 10 + [1] * 20 + [2] * 7, [3] * 30 + [-1] * 7])
        kv_ids = torch.tensor([[0] * 12 + [1] * 22 + [2] * 7, [3] * 34 + [-1] * 7])
        parts = [MaskPart("documents", ids=(q_ids, kv_ids)), MaskPart("causal")]
    elif kind == "chunked_sinks":
        parts = [MaskPart("causal"), MaskPart("chunked_local", chunk=12), MaskPart("window", left=6, sinks=3)]
    else:
        raise AssertionError(kind)
    q = _values(gen, (B, H, Lq, D), dtype)
    k = _values(gen, (B, Hkv, Lk, D), dtype)
    v = _values(gen, (B, Hkv, Lk, Dv), dtype)
    grad_out = _values(gen, (B, H, Lq, Dv), dtype)
    return Case(B, H, Hkv, Lq, Lk, D, Dv, dtype, False, None, q, k, v, grad_out, parts)
