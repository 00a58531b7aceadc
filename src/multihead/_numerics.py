"""Numbers every backend shares: the default scale, the compute dtype, the finite row max, and
the dtype autocast dictates.

One copy of each, so that two paths cannot differ in the last bit (``D ** -0.5`` and
``1 / math.sqrt(D)`` do for 218 head dims D <= 1024).
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch

__all__ = ["AUTOCAST_ELIGIBLE", "default_scale", "is_default_scale", "compute_dtype", "finite_row_max", "device_type", "autocast_dtype", "autocast_inputs", "outside_autocast"]

#: dtypes autocast may cast (float64 is never cast, as in torch's own autocast)
AUTOCAST_ELIGIBLE = (torch.float32, torch.float16, torch.bfloat16)


def default_scale(head_dim: int) -> float:
    """1/√D, the scale of the scores when none is given (1 for D = 0)."""
    return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0


def is_default_scale(scale: float, head_dim: int) -> bool:
    """Whether ``scale`` is 1/√D as one library or another writes it (``1 / math.sqrt(D)``,
    ``D ** -0.5`` as transformers does, ``1 / D ** 0.5``: they differ in the last bit for some D,
    8, 32 and 128 among them): within 4 units in the last place of :func:`default_scale`."""
    d = default_scale(head_dim)
    return abs(float(scale) - d) <= 4 * math.ulp(d)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype scores, softmax and sums are computed in: float32 for the half types, the dtype
    itself otherwise."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def finite_row_max(scores: torch.Tensor) -> torch.Tensor:
    """The max over the last axis (kept as size 1), with -inf (a row with no visible key) read
    as 0, so that ``exp(scores - max)`` is 0 there and never NaN. Not differentiated (a shift
    changes no softmax)."""
    if scores.shape[-1] == 0:  # no keys at all: every row is one with no visible key
        return scores.new_zeros(*scores.shape[:-1], 1)
    top = scores.amax(dim=-1, keepdim=True).detach()
    return top.masked_fill(top == float("-inf"), 0.0)


def device_type(t: torch.Tensor) -> str:
    """``t.device.type``, without building a ``torch.device`` for CPU and CUDA tensors (the
    attention path asks on every call, and the object and its type string cost time there)."""
    if t.is_cpu:
        return "cpu"
    if t.is_cuda:
        return "cuda"
    return t.device.type


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The lower-precision dtype autocast casts attention inputs to on ``device_type``, or None
    when autocast is off there."""
    if device_type not in ("cpu", "cuda", "xpu", "mps", "hpu"):
        return None
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def autocast_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors as autocast would pass them to ``scaled_dot_product_attention``: inside an
    autocast region, float32/16 tensors become the autocast dtype (differentiably); float64
    and non-float tensors are left alone. Outside autocast, the tensors themselves."""
    ref = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
    dt = None if ref is None else autocast_dtype(device_type(ref))
    if dt is None:
        return tensors
    return tuple(t.to(dt) if isinstance(t, torch.Tensor) and t.dtype in AUTOCAST_ELIGIBLE else t for t in tensors)


def outside_autocast(device_type: str) -> contextlib.AbstractContextManager[object]:
    """A context in which autocast is off on ``device_type`` (a no-op context when it already is):
    backends run in it so that they compute as they document, inside autocast regions too."""
    if autocast_dtype(device_type) is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)
