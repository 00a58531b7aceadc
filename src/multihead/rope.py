"""Rotary position embeddings (RoPE), in the rotate-half layout of Hugging Face Llama models.

RoPE encodes a token's position p by rotating its query and key vectors: the head dim D is cut
into D/2 pairs, and pair i of a vector at position p turns by the angle ``p * theta_i`` with
``theta_i = base ** (-2i / D)``. A rotation keeps lengths, and the dot product of a query rotated
by ``p`` with a key rotated by ``s`` depends on ``p - s`` only: attention scores see relative
positions, while nothing is added to the token features.

Which two coordinates form pair i is a layout choice. Hugging Face Llama (and GPT-NeoX) pair
coordinate i with coordinate i + D/2 ("rotate half")::

    x1, x2 = x[..., :D/2], x[..., D/2:]
    rotate_half(x) = cat(-x2, x1)
    rope(x, p) = x * cos(p * theta) + rotate_half(x) * sin(p * theta)   # theta repeated twice

so weights trained with that layout load here unchanged. (The RoFormer paper pairs neighbours
2i and 2i+1 instead; the two layouts differ by a fixed permutation of the projection rows.)

Legend: B batch, H heads, L tokens, D head dim (even).
"""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch

from ._checks import check_positive_int, check_tensor

__all__ = ["RoPE", "rotate_half"]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(..., D) -> (..., D): ``cat(-x[..., D/2:], x[..., :D/2])``, the 90° turn of every pair."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def check_rope_base(base) -> float:
    if isinstance(base, bool) or not isinstance(base, numbers.Real):
        raise TypeError(f"rope_base must be a number, got {type(base).__name__}; the usual value is 10000.0")
    base = float(base)
    if not (base > 1.0 and math.isfinite(base)):
        raise ValueError(f"rope_base must be finite and > 1, got {base}; the usual value is 10000.0")
    return base


def _check_positions(positions, length: int) -> None:
    if not isinstance(positions, torch.Tensor) or positions.is_floating_point() or positions.dtype == torch.bool:
        raise TypeError(f"positions must be an integer torch.Tensor, got {getattr(positions, 'dtype', type(positions).__name__)}")
    if tuple(positions.shape) != (length,):
        raise ValueError(f"positions must have shape (L,) = ({length},), one per token, got {tuple(positions.shape)}")
    if length and int(positions.min()) < 0:
        raise ValueError(f"positions must be >= 0, got {int(positions.min())}")


class RoPE:
    """Rotary position embedding for head dim ``head_dim`` (even) with frequency ``base``.

    ``rope(x, offset)`` rotates x (B, H, L, D) as if its tokens sat at positions
    ``offset ... offset + L - 1`` (a decode step over a KV cache passes the cache length).

    The cos/sin tables are computed in float64 and cached per (device, dtype); they grow on demand
    (doubling), so a sequence of any length works and the table is not rebuilt on every step.
    """

    def __init__(self, head_dim: int, base: float = 10000.0):
        check_positive_int(head_dim, "head_dim")
        if head_dim % 2:
            raise ValueError(
                f"RoPE needs an even head dim (it rotates pairs of coordinates), got head_dim={head_dim}; "
                "choose d_out / num_heads even"
            )
        self.head_dim = int(head_dim)
        self.base = check_rope_base(base)
        # theta_i = base^(-2i/D), i = 0 .. D/2-1
        self.inv_freq = self.base ** (-torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim)
        self._tables: dict = {}

    def __repr__(self) -> str:
        return f"RoPE(head_dim={self.head_dim}, base={self.base:g})"

    def cos_sin(self, length: int, *, offset: int = 0, device=None, dtype=torch.float32):
        """cos and sin tables (length, D) for positions ``offset ... offset + length - 1``."""
        end = offset + length
        key = (torch.device(device) if device is not None else torch.device("cpu"), dtype)
        cached = self._tables.get(key)
        if cached is None or cached[0].shape[0] < end:
            size = max(end, 2 * cached[0].shape[0] if cached is not None else 256)
            angles = torch.outer(torch.arange(size, dtype=torch.float64), self.inv_freq)  # (size, D/2)
            angles = torch.cat((angles, angles), dim=-1)  # (size, D): theta repeated for both halves
            cached = (angles.cos().to(device=key[0], dtype=dtype), angles.sin().to(device=key[0], dtype=dtype))
            self._tables[key] = cached
        return cached[0][offset:end], cached[1][offset:end]

    def __call__(self, x: torch.Tensor, offset: int = 0, *, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x (B, H, L, D) rotated for positions ``offset ... offset + L - 1``, or for ``positions``,
        an (L,) integer tensor of any positions (e.g. a context-parallel shard's, from
        :func:`multihead.distributed.shard_positions`); same shape and dtype."""
        check_tensor(x, "x")
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"x has head dim {x.shape[-1]} but this RoPE was built for head_dim={self.head_dim}")
        if positions is None:
            cos, sin = self.cos_sin(x.shape[-2], offset=offset, device=x.device, dtype=x.dtype)
        else:
            _check_positions(positions, x.shape[-2])
            end = int(positions.max()) + 1 if positions.numel() else 0
            cos, sin = self.cos_sin(end, device=x.device, dtype=x.dtype)
            index = positions.to(x.device)
            cos, sin = cos[index], sin[index]
        return x * cos + rotate_half(x) * sin
