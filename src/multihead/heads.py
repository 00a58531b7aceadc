"""Moving between one wide feature axis and per-head axes.

Each reshape has a name and an einops-style pattern, which the trace prints. Axis letters:
b batch, t tokens, h heads, d head dim, g query heads per key/value head (GQA).

``split_heads`` is the tutorials' ``view`` followed by ``transpose(1, 2)``: the data does not
move, only how it is indexed. ``merge_heads`` is the inverse; it copies, because after the
transpose the head axis is no longer next to the feature axis in memory.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import steps as _steps
from . import trace as _trace


def split_heads(x: torch.Tensor, num_heads: int, *, role: str = "") -> torch.Tensor:
    """(B, L, H*D) -> (B, H, L, D), as a view: ``'b t (h d) -> b h t d'``."""
    return split_heads_traced(x, num_heads, _trace.current(), role)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, H, L, D) -> (B, L, H*D): ``'b h t d -> b t (h d)'``."""
    return merge_heads_traced(x, _trace.current())


def split_heads_traced(x: torch.Tensor, num_heads: int, tr: Optional[_trace.Trace], role: str = "") -> torch.Tensor:
    """:func:`split_heads`, recording into ``tr`` (the caller's :func:`multihead.trace.current`, or None)."""
    B, L, F = x.shape
    y = x.view(B, L, num_heads, F // num_heads)
    if tr is not None:
        tr.record(_steps.SPLIT_HEADS, y, source=x, role=role)
    z = y.transpose(1, 2)
    if tr is not None:
        tr.record(_steps.MOVE_HEADS_FORWARD, z, source=y, role=role)
    return z


def merge_heads_traced(x: torch.Tensor, tr: Optional[_trace.Trace]) -> torch.Tensor:
    """:func:`merge_heads`, recording into ``tr`` (the caller's :func:`multihead.trace.current`, or None)."""
    B, H, L, D = x.shape
    y = x.transpose(1, 2)
    if tr is not None:
        tr.record(_steps.MOVE_HEADS_BACK, y, source=x)
    z = y.reshape(B, L, H * D)
    if tr is not None:
        tr.record(_steps.MERGE_HEADS, z, source=y)
    return z


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, Hkv, L, D) -> (B, Hkv*g, L, D): query head i reads key/value head i // g."""
    if groups == 1:
        return x
    return x.repeat_interleave(groups, dim=1)
