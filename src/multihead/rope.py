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

Other layouts and inputs (the peers' variants), all on `RoPE`:

* ``interleaved=True``: GPT-J's layout (and RoFormer's, flash-attn's ``rotary_interleaved``):
  coordinate 2i is paired with 2i+1, ``rotate_every_two(x) = (-x1, x0, -x3, x2, ...)``;
* ``rotary_dim=r`` (r < D, even): only the first r coordinates are rotated, the rest pass
  through (GPT-NeoX's ``rotary_pct``, Phi's ``partial_rotary_factor``); theta_i = base^(-2i/r);
* ``tables=(cos, sin)``: the model's own tables, each (Lmax, r/2) (one angle per pair, as
  flash-attn's ``rotary_cos``/``rotary_sin``), instead of base and scaling;
* positions (L,) or (B, L): each batch row its own positions (a padded or ragged batch).

A model stretched to a longer context than it was trained on rescales the frequencies
(`RoPEScaling`): "linear" divides every theta_i by a factor (position p turns as p / factor
did), "llama3" (Llama 3.1) divides only the slow pairs and blends the middle band. Both keep
the rotation itself, so the rotated vectors keep their lengths; scalings that also rescale
cos/sin (an attention factor, as YaRN and LongRoPE do) are not implemented here.

Legend: B batch, H heads, L tokens, D head dim (even).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional

import torch
from torch.types import Device

from ._checks import check_positive_int, check_tensor

__all__ = ["RoPE", "RoPEScaling", "rotate_half", "rotate_every_two", "ROPE_TYPES"]

#: The frequency rules RoPE implements, named as Hugging Face configs name them (``rope_type``):
#: "default" is no `RoPEScaling`; the others are its ``kind``.
ROPE_TYPES = ("default", "linear", "llama3")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(..., D) -> (..., D): ``cat(-x[..., D/2:], x[..., :D/2])``, the 90° turn of every pair."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    """(..., D) -> (..., D): ``(-x1, x0, -x3, x2, ...)``, the 90° turn of every neighbour pair
    (the interleaved layout of GPT-J)."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def check_rope_base(base: object) -> float:
    if isinstance(base, bool) or not isinstance(base, numbers.Real):
        raise TypeError(f"rope_base must be a number, got {type(base).__name__}; the usual value is 10000.0")
    value = float(base)
    if not (value > 1.0 and math.isfinite(value)):
        raise ValueError(f"rope_base must be finite and > 1, got {value}; the usual value is 10000.0")
    return value


def _check_positions(positions: object, length: int, batch: int) -> None:
    if not isinstance(positions, torch.Tensor) or positions.is_floating_point() or positions.dtype == torch.bool:
        raise TypeError(f"positions must be an integer torch.Tensor, got {getattr(positions, 'dtype', type(positions).__name__)}")
    if tuple(positions.shape) not in ((length,), (batch, length)):
        raise ValueError(f"positions must have shape (L,) = ({length},) or (B, L) = ({batch}, {length}), one per token, "
                         f"got {tuple(positions.shape)}")
    if length and int(positions.min()) < 0:
        raise ValueError(f"positions must be >= 0, got {int(positions.min())}")


def _check_factor(value: object, name: str, kind: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"RoPEScaling {kind!r} needs {name} as a number, got {type(value).__name__}")
    factor = float(value)
    if not (factor > 0 and math.isfinite(factor)):
        raise ValueError(f"RoPEScaling {kind!r} needs {name} > 0 and finite, got {factor}")
    return factor


@dataclass(frozen=True, repr=False)
class RoPEScaling:
    """A rule that rescales RoPE's frequencies theta_i, for a model stretched beyond the context
    it was first trained on. Both rules are Hugging Face's ``rope_scaling`` types of that name.

    ``RoPEScaling("linear", factor)``: theta_i / factor for every pair (position interpolation).

    ``RoPEScaling("llama3", factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)``
    (Llama 3.1), by each pair's wavelength lambda_i = 2 pi / theta_i, with L0 the original context::

        lambda_i < L0 / high_freq_factor   theta_i             (fast pairs: unchanged)
        lambda_i > L0 / low_freq_factor    theta_i / factor    (slow pairs: as "linear")
        otherwise                          (1 - s) theta_i / factor + s theta_i,
                                           s = (L0 / lambda_i - low_freq_factor) / (high_freq_factor - low_freq_factor)

    Example::

        rope = RoPE(128, 500000.0, scaling=RoPEScaling("llama3", 8.0, 1.0, 4.0, 8192))
    """

    kind: str
    factor: float
    low_freq_factor: Optional[float] = None
    high_freq_factor: Optional[float] = None
    original_max_position_embeddings: Optional[int] = None

    def __post_init__(self) -> None:
        kinds = ROPE_TYPES[1:]
        if self.kind not in kinds:
            raise ValueError(
                f"RoPEScaling kind must be one of {list(kinds)}, got {self.kind!r}; for no scaling pass scaling=None"
            )
        set_ = object.__setattr__
        set_(self, "factor", _check_factor(self.factor, "factor", self.kind))
        llama3 = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        if self.kind == "linear":
            given = [n for n in llama3 if getattr(self, n) is not None]
            if given:
                raise ValueError(f"RoPEScaling 'linear' takes only factor; {', '.join(given)} belong to 'llama3'")
            return
        low = _check_factor(self.low_freq_factor, "low_freq_factor", "llama3")
        high = _check_factor(self.high_freq_factor, "high_freq_factor", "llama3")
        set_(self, "low_freq_factor", low)
        set_(self, "high_freq_factor", high)
        if high <= low:
            raise ValueError(
                f"RoPEScaling 'llama3' needs high_freq_factor > low_freq_factor, got {high} "
                f"and {low} (Llama 3.1 uses 4.0 and 1.0)"
            )
        if self.original_max_position_embeddings is None:
            raise TypeError("RoPEScaling 'llama3' needs original_max_position_embeddings (Llama 3.1: 8192)")
        set_(self, "original_max_position_embeddings",
             check_positive_int(self.original_max_position_embeddings, "original_max_position_embeddings"))

    def __repr__(self) -> str:
        if self.kind == "linear":
            return f"RoPEScaling('linear', factor={self.factor:g})"
        return (f"RoPEScaling('llama3', factor={self.factor:g}, low_freq_factor={self.low_freq_factor:g}, "
                f"high_freq_factor={self.high_freq_factor:g}, "
                f"original_max_position_embeddings={self.original_max_position_embeddings})")

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """The rescaled frequencies: (D/2,) -> (D/2,), same dtype."""
        if self.kind == "linear":
            return inv_freq / self.factor
        low, high, context_len = self.low_freq_factor, self.high_freq_factor, self.original_max_position_embeddings
        if low is None or high is None or context_len is None:  # __post_init__ requires all three for llama3
            raise ValueError(f"{self!r} lacks a llama3 setting")
        context = float(context_len)
        wavelength = 2 * math.pi / inv_freq
        s = (context / wavelength - low) / (high - low)
        blended = (1 - s) * inv_freq / self.factor + s * inv_freq
        out = torch.where(wavelength > context / low, inv_freq / self.factor, blended)
        return torch.where(wavelength < context / high, inv_freq, out)


def _cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, device: Device, dtype: torch.dtype, interleaved: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (L, r) of the angles position * theta_i, computed in float64 (each theta
    repeated for both coordinates of its pair), then cast to ``dtype`` on ``device``."""
    angles = torch.outer(positions, inv_freq)  # (L, r/2)
    return _spread(angles.cos(), interleaved).to(device=device, dtype=dtype), \
        _spread(angles.sin(), interleaved).to(device=device, dtype=dtype)


def _spread(half: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """(L, r/2) -> (L, r): one value per pair, repeated for both of its coordinates."""
    return half.repeat_interleave(2, dim=-1) if interleaved else torch.cat((half, half), dim=-1)


def _check_tables(tables: object, rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(tables, tuple) and len(tables) == 2 and all(isinstance(t, torch.Tensor) for t in tables)):
        raise TypeError("tables must be a pair of tensors (cos, sin), each (Lmax, rotary_dim / 2)")
    cos, sin = tables
    for t, name in ((cos, "cos"), (sin, "sin")):
        if not t.is_floating_point():
            raise TypeError(f"tables' {name} must be floating point, got {t.dtype}")
        if t.dim() != 2 or t.shape[1] != rotary_dim // 2 or t.shape[0] == 0:
            raise ValueError(f"tables' {name} must be (Lmax, rotary_dim / 2) = (Lmax, {rotary_dim // 2}), one angle per "
                             f"pair, got {tuple(t.shape)}")
    if cos.shape != sin.shape:
        raise ValueError(f"tables' cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have one shape")
    return cos.detach().double().cpu(), sin.detach().double().cpu()


class RoPE:
    """Rotary position embedding for head dim ``head_dim`` (even) with frequency ``base``.

    ``rope(x, offset)`` rotates x (B, H, L, D) as if its tokens sat at positions
    ``offset ... offset + L - 1`` (a decode step over a KV cache passes the cache length).
    ``scaling`` (a `RoPEScaling`, default none) rescales the frequencies.

    The frequencies and the cos/sin tables are computed in float64; the tables are cached per
    (device, dtype) and grow on demand (doubling), so a sequence of any length works and the table
    is not rebuilt on every step. They are made again when ``inv_freq`` changes (in place or
    reassigned).
    """

    def __init__(self, head_dim: int, base: float = 10000.0, *, scaling: Optional[RoPEScaling] = None,
                 interleaved: bool = False, rotary_dim: Optional[int] = None,
                 tables: Optional[tuple[torch.Tensor, torch.Tensor]] = None):
        check_positive_int(head_dim, "head_dim")
        if head_dim % 2:
            raise ValueError(
                f"RoPE needs an even head dim (it rotates pairs of coordinates), got head_dim={head_dim}; "
                "choose d_out / num_heads even"
            )
        if scaling is not None and not isinstance(scaling, RoPEScaling):
            raise TypeError(
                f"scaling must be a RoPEScaling or None, got {type(scaling).__name__}; "
                "e.g. RoPEScaling('linear', 4.0)"
            )
        if not isinstance(interleaved, bool):
            raise TypeError(f"interleaved must be True or False, got {interleaved!r}")
        rd = head_dim if rotary_dim is None else check_positive_int(rotary_dim, "rotary_dim")
        if rd % 2 or rd > head_dim:
            raise ValueError(f"rotary_dim must be even and <= head_dim={head_dim} (the first rotary_dim coordinates "
                             f"are rotated in pairs), got {rd}")
        self.head_dim = int(head_dim)
        self.rotary_dim = int(rd)
        self.interleaved = interleaved
        self.base = check_rope_base(base)
        self.scaling = scaling
        # theta_i = base^(-2i/r), i = 0 .. r/2-1, then the scaling rule
        inv_freq = self.base ** (-torch.arange(0, self.rotary_dim, 2, dtype=torch.float64) / self.rotary_dim)
        self.inv_freq = inv_freq if scaling is None else scaling.apply(inv_freq)
        self.given = None if tables is None else _check_tables(tables, self.rotary_dim)
        if self.given is not None and scaling is not None:
            raise ValueError("tables= are the model's own cos/sin: pass scaling=None (the tables hold it)")
        #: (device, dtype) -> cos, sin, and the frequencies they were made from (the tensor and a
        #: copy of its values: a change of either makes the tables again)
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, ...]] = {}

    def __repr__(self) -> str:
        scaling = "" if self.scaling is None else f", scaling={self.scaling}"
        extra = ("" if not self.interleaved else ", interleaved=True") + \
            ("" if self.rotary_dim == self.head_dim else f", rotary_dim={self.rotary_dim}") + \
            ("" if self.given is None else f", tables=({self.given[0].shape[0]} positions)")
        return f"RoPE(head_dim={self.head_dim}, base={self.base:g}{scaling}{extra})"

    def cos_sin(
        self, length: int, *, offset: int = 0, device: Device = None, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin tables (length, r) for positions ``offset ... offset + length - 1``, in this
        RoPE's layout (r = rotary_dim)."""
        end = offset + length
        key = (torch.device(device) if device is not None else torch.device("cpu"), dtype)
        if self.given is not None:
            lmax = self.given[0].shape[0]
            if end > lmax:
                raise ValueError(f"positions up to {end - 1} need rows the given tables lack: they hold {lmax} positions "
                                 f"(0 .. {lmax - 1}); give longer tables")
            cached = self._tables.get(key)
            if cached is None:
                cached = tuple(_spread(t, self.interleaved).to(device=key[0], dtype=dtype) for t in self.given)
                self._tables[key] = cached
            assert cached is not None
            return cached[0][offset:end], cached[1][offset:end]
        if torch.compiler.is_compiling():
            # no table cache in a compiled graph: a dict that the first call fills would make
            # dynamo's guards fail on the second call (a recompile); the same float64 angles
            return _cos_sin(torch.arange(offset, end, dtype=torch.float64), self.inv_freq, key[0], dtype, self.interleaved)
        held = self._tables.get(key)
        if held is not None and not (held[2] is self.inv_freq and torch.equal(held[3], self.inv_freq)):
            held = None  # the frequencies changed (in place or reassigned) since the tables were made
        if held is None or held[0].shape[0] < end:
            size = max(end, 2 * held[0].shape[0] if held is not None else 256)
            cos, sin = _cos_sin(torch.arange(size, dtype=torch.float64), self.inv_freq, key[0], dtype, self.interleaved)
            held = (cos, sin, self.inv_freq, self.inv_freq.clone())
            self._tables[key] = held
        return held[0][offset:end], held[1][offset:end]

    def cos_sin_at(self, positions: torch.Tensor, *, device: Device = None,
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (..., r) for an integer tensor of ``positions`` (...), without reading a
        position on the host (for a compiled graph): the float64 angles of the positions
        themselves, the same values as the rows of `cos_sin`'s tables, or rows of the given tables."""
        dev = positions.device if device is None else torch.device(device)
        if self.given is not None:
            rows = [t.to(positions.device)[positions] for t in self.given]
            return (_spread(rows[0], self.interleaved).to(device=dev, dtype=dtype),
                    _spread(rows[1], self.interleaved).to(device=dev, dtype=dtype))
        angles = positions.to(torch.float64).unsqueeze(-1) * self.inv_freq.to(positions.device)
        return (_spread(angles.cos(), self.interleaved).to(device=dev, dtype=dtype),
                _spread(angles.sin(), self.interleaved).to(device=dev, dtype=dtype))

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (..., D) turned by the tables' angles, cos/sin broadcastable to (..., r): the first
        r coordinates rotated in this RoPE's layout, the rest passed through."""
        r = self.rotary_dim
        turn = rotate_every_two if self.interleaved else rotate_half
        if r == x.shape[-1]:
            return x * cos + turn(x) * sin
        head, tail = x[..., :r], x[..., r:]
        return torch.cat((head * cos + turn(head) * sin, tail), dim=-1)

    def __call__(self, x: torch.Tensor, offset: int = 0, *, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x (B, H, L, D) rotated for positions ``offset ... offset + L - 1``, or for ``positions``,
        an (L,) or (B, L) integer tensor of any positions (a context-parallel shard's, from
        `multihead.distributed.shard_positions`; each row's own in a padded or ragged batch);
        same shape and dtype."""
        check_tensor(x, "x")
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"x has head dim {x.shape[-1]} but this RoPE was built for head_dim={self.head_dim}")
        if positions is None:
            cos, sin = self.cos_sin(x.shape[-2], offset=offset, device=x.device, dtype=x.dtype)
        else:
            _check_positions(positions, x.shape[-2], x.shape[0])
            end = int(positions.max()) + 1 if positions.numel() else 0
            cos, sin = self.cos_sin(end, device=x.device, dtype=x.dtype)
            index = positions.to(x.device)
            cos, sin = cos[index], sin[index]  # (L, r) or (B, L, r)
            if index.dim() == 2:
                cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, L, r): broadcast over the heads
        return self.rotate(x, cos, sin)
