"""Validation helpers for the public edge.

Every public function checks its arguments here, before any tensor work, so that a user
mistake surfaces as a ``ValueError`` or ``TypeError`` naming the argument, the sizes seen and
the fix -- never as an error from three calls deep inside torch.

Legend: B batch, H query heads, Hkv key/value heads, Lq/Lk query/key lengths, D head dim,
Dv value head dim.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch

from ._numerics import AUTOCAST_ELIGIBLE, autocast_dtype, default_scale

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_tensor(x, name: str) -> torch.Tensor:
    """``x`` must be a floating-point ``torch.Tensor``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor, got {type(x).__name__}; "
            f"wrap it with torch.as_tensor({name}, dtype=torch.float32)"
        )
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"{name} must have a floating dtype (float16, bfloat16, float32, float64), "
            f"got {x.dtype}; convert it with {name}.float()"
        )
    return x


def check_rank(x: torch.Tensor, name: str, rank: int, layout: str, hint: str = "") -> None:
    if x.dim() != rank:
        extra = f"; {hint}" if hint else ""
        raise ValueError(
            f"{name} must have {rank} dimensions {layout}, got shape {tuple(x.shape)}{extra}"
        )


def check_same_dtype_device(ref: torch.Tensor, ref_name: str, **others: torch.Tensor) -> None:
    for name, t in others.items():
        if t.device != ref.device:
            raise ValueError(
                f"{name} is on {t.device} but {ref_name} is on {ref.device}; "
                f"move them to one device, e.g. {name}.to({ref_name}.device)"
            )
        if t.dtype != ref.dtype:
            raise TypeError(
                f"{name} has dtype {t.dtype} but {ref_name} has {ref.dtype}; "
                f"use one dtype, e.g. {name}.to({ref_name}.dtype)"
            )


def _broadcast_hint(B: int, Bx: int, name: str) -> str:
    """The fix for a batch of 1 beside a batch of B, which SDPA and FlexAttention broadcast in 4-D."""
    if Bx == 1:
        return f" (4-D inputs do not broadcast a batch of 1 here: pass {name}.expand({B}, -1, -1, -1), a view)"
    if B == 1:
        return f" (4-D inputs do not broadcast a batch of 1 here: pass q.expand({Bx}, -1, -1, -1), a view)"
    return ""


def check_qkv(q, k, v=None) -> None:
    """q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), H a multiple of Hkv.

    ``v=None`` checks q and k alone (for attention weights).
    """
    named = [(q, "q"), (k, "k")] + ([] if v is None else [(v, "v")])
    for t, name in named:
        check_tensor(t, name)
    check_rank(q, "q", 4, "(B, H, Lq, D)")
    check_rank(k, "k", 4, "(B, Hkv, Lk, D)")
    if v is not None:
        check_rank(v, "v", 4, "(B, Hkv, Lk, Dv)")
    check_same_dtype_device(q, "q", **{name: t for t, name in named[1:]})
    B, H, _, D = q.shape
    Bk, Hkv, Lk, Dk = k.shape
    if Bk != B:
        raise ValueError(
            f"batch sizes differ: q has B={B}, k has B={Bk}; q, k and v must share the batch axis (dim 0)"
            + _broadcast_hint(B, Bk, "k")
        )
    if Dk != D:
        raise ValueError(
            f"head dims differ: q has D={D}, k has D={Dk}; q and k must share the last axis"
        )
    check_heads(H, Hkv)
    if v is None:
        return
    Bv, Hv, Lv, _ = v.shape
    if Bv != B:
        raise ValueError(
            f"batch sizes differ: q has B={B}, v has B={Bv}; q, k and v must share the batch axis (dim 0)"
            + _broadcast_hint(B, Bv, "v")
        )
    if Hv != Hkv:
        raise ValueError(f"k has Hkv={Hkv} heads but v has {Hv}; k and v must have the same heads")
    if Lv != Lk:
        raise ValueError(f"k has Lk={Lk} keys but v has {Lv}; k and v must have the same length")


def check_heads(H: int, Hkv: int, h_name: str = "Hq", kv_name: str = "Hkv") -> None:
    if Hkv < 1 or H % Hkv:
        raise ValueError(
            f"got {h_name}={H}, {kv_name}={Hkv}: {h_name} must be a multiple of {kv_name} "
            f"(grouped-query attention: query head i reads key/value head i // ({h_name} // {kv_name}))"
        )


#: the largest ``scale`` every backend takes: the square root of float32's largest value. The
#: scores are formed in float32 (or float64), so up to it scale·q·kᵀ stays finite while
#: |q·k| < 2**64; above it ordinary q and k overflow the scores to inf and the softmax to NaN.
MAX_SCALE = 2.0 ** 64


def check_scale(scale, head_dim: int) -> float:
    """``None`` gives 1/sqrt(D); otherwise a number in (0, :data:`MAX_SCALE`]."""
    if scale is None:
        return default_scale(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a positive number or None, got {type(scale).__name__}")
    scale = float(scale)
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"scale must be positive and finite, got {scale}; leave it None for 1/sqrt(D)")
    if scale > MAX_SCALE:
        raise ValueError(
            f"scale must be at most 2**64 (about 1.8e19), got {scale:g}: the scores scale·q·kᵀ are "
            "formed in float32, where a larger scale overflows them to inf and the softmax to NaN; "
            "use 0 < scale <= 2**64 (a scale that large already gives each query's hard maximum)"
        )
    return scale


def check_dropout(p, name: str = "dropout_p") -> float:
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise TypeError(f"{name} must be a number in [0, 1), got {type(p).__name__}")
    p = float(p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {p}; 0 disables dropout")
    return p


def check_positive_int(value, name: str, *, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    low = 0 if allow_zero else 1
    if value < low:
        bound = "non-negative" if allow_zero else "positive"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def check_indices(value, size: int, name: str, what: str) -> list:
    """None (all of ``range(size)``), or a list / 1-D integer tensor of indices in [0, size)."""
    if value is None:
        return list(range(size))
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.is_floating_point() or value.dtype == torch.bool:
            raise TypeError(f"{name} must be a 1-D integer tensor or a list of ints, got {value.dtype} of shape {tuple(value.shape)}")
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{name} must be a list of {what} indices, got {type(value).__name__}; e.g. {name}=[0, 3]")
    out = []
    for i in value:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise TypeError(f"{name} must hold ints, got {type(i).__name__}")
        index = int(i)
        if not 0 <= index < size:
            raise ValueError(f"{name} has {index}, but there are {size} {what}s: use indices 0 .. {size - 1}")
        out.append(index)
    return out


def _autocast_mixable(a: torch.dtype, b: torch.dtype) -> bool:
    """Inside autocast, tensors of these two dtypes meet in one product (autocast casts both)."""
    return a in AUTOCAST_ELIGIBLE and b in AUTOCAST_ELIGIBLE


def check_module_inputs(cfg, weight: torch.Tensor, query, key, value) -> None:
    """query (B, Lq, d_in), key (B, Lk, kdim), value (B, Lk, vdim) for a module with settings
    ``cfg`` (an AttentionConfig) whose weights are ``weight``'s dtype and device.

    Used by :class:`MultiHeadAttention` and :class:`PerHeadAttention`. Inside an autocast region
    the query may differ in dtype from the weights (``nn.Linear`` under autocast returns
    bfloat16 from float32 weights, and the projections autocast both), as with nn.Linear."""
    if not isinstance(query, torch.Tensor) or query.dtype not in _FLOAT_DTYPES:
        check_tensor(query, "query")  # raises, naming the problem
    if query.dim() == 2:
        raise ValueError(
            f"query has shape {tuple(query.shape)}: MultiHeadAttention is batch-first (B, L, d_in); "
            "add the batch axis with query.unsqueeze(0)"
        )
    if query.dim() != 3:
        raise ValueError(f"query must be (B, Lq, d_in), got shape {tuple(query.shape)}")
    if query.shape[-1] != cfg.d_in:
        raise ValueError(f"query has {query.shape[-1]} features but d_in={cfg.d_in}")
    q_dtype, q_device = query.dtype, query.device
    autocast: Optional[bool] = None  # asked only where dtypes differ
    if q_dtype != weight.dtype:
        autocast = autocast_dtype(q_device.type) is not None
    if q_dtype != weight.dtype and not (autocast and _autocast_mixable(q_dtype, weight.dtype)):
        raise TypeError(
            f"query is {query.dtype} but the module's weights are {weight.dtype}; "
            f"call mha.to({query.dtype}) or pass query.to({weight.dtype})"
        )
    if q_device != weight.device:
        raise ValueError(
            f"query is on {query.device} but the module is on {weight.device}; move one of them (mha.to(query.device))"
        )
    if key is query and value is query and cfg.kdim == cfg.d_in and cfg.vdim == cfg.d_in:
        return  # self-attention: the query's checks above cover key and value
    for t, name, dim, size in ((key, "key", "kdim", cfg.kdim), (value, "value", "vdim", cfg.vdim)):
        if t is query and size == cfg.d_in:
            continue  # self-attention: the query's checks above cover it
        check_tensor(t, name)
        if t.dim() != 3:
            raise ValueError(f"{name} must be (B, Lk, {dim}), got shape {tuple(t.shape)}")
        if t.shape[-1] != size:
            raise ValueError(f"{name} has {t.shape[-1]} features but {dim}={size}")
        if t.shape[0] != query.shape[0]:
            raise ValueError(
                f"{name} has batch {t.shape[0]} but query has {query.shape[0]}; they must match"
            )
        if t.dtype != q_dtype and autocast is None:
            autocast = autocast_dtype(q_device.type) is not None
        mixed = t.dtype != q_dtype and not (autocast and _autocast_mixable(t.dtype, q_dtype))
        if mixed or t.device != query.device:
            raise TypeError(
                f"{name} is {t.dtype} on {t.device} but query is {query.dtype} on {query.device}; "
                "use one dtype and device"
            )
    if key.shape[1] != value.shape[1]:
        raise ValueError(
            f"key has {key.shape[1]} tokens but value has {value.shape[1]}; they must match"
        )
