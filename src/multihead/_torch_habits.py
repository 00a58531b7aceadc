"""nn.MultiheadAttention's habits, answered at `multihead.MultiHeadAttention`'s edge.

Users of ``nn.MultiheadAttention`` bring its keyword arguments (``attn_mask=``,
``key_padding_mask=``, ``is_causal=``, ``need_weights=``) and its mask convention (True =
blocked, the opposite of multihead's True = may attend). `check_no_torch_arguments` answers the
arguments with a TypeError naming the multihead way to say each; `warn_if_inverted` warns, once
per process, about a bool mask that reads as torch's convention.

    >>> import pytest
    >>> with pytest.raises(TypeError, match="masks.from_torch"):
    ...     check_no_torch_arguments({"attn_mask": None})
"""

from __future__ import annotations

import os
import sys
import warnings
from types import FrameType
from typing import Optional

import torch
from torch.nn.modules import module as _nn_module

__all__ = ["check_no_torch_arguments", "warn_if_inverted"]


#: what nn.MultiheadAttention.forward takes that MultiHeadAttention.forward does not: the multihead way
_TORCH_HABITS = {
    "attn_mask": "mask=masks.from_torch(attn_mask=attn_mask) (nn.MultiheadAttention's True = blocked, "
                 "converted; multihead's mask= is True = may attend)",
    "key_padding_mask": "mask=masks.from_torch(key_padding_mask=pad) (True = padding, converted), or "
                        "mask=masks.key_padding(real) with True = a real token",
    "is_causal": "causal=True when building the module, or mask=masks.causal()",
    "need_weights": "return_weights=True (the weights per head, (B, H, Lq, Lk))",
    "average_attn_weights": "return_weights=True, then weights.mean(dim=1)",
}
_warned_inverted_mask = False
_checked_device_mask = False


def check_no_torch_arguments(extra: dict[str, object]) -> None:
    """TypeError for keyword arguments forward does not take, naming the multihead way for
    nn.MultiheadAttention's (``attn_mask=`` ...) and the drop-in that takes them as they are."""
    habits = [f"{name}= -> {_TORCH_HABITS[name]}" for name in extra if name in _TORCH_HABITS]
    other = [name for name in extra if name not in _TORCH_HABITS]
    parts = []
    if habits:
        parts.append("MultiHeadAttention.forward does not take nn.MultiheadAttention's arguments: "
                     + "; ".join(habits) + ". Or keep torch's signature with multihead.nn.MultiheadAttention, "
                     "the drop-in (multihead.nn.swap_in(model) replaces a model's nn.MultiheadAttention)")
    if other:
        parts.append(f"MultiHeadAttention.forward got unexpected keyword argument(s) {', '.join(other)}; "
                     "it takes query, key, value, mask=, return_weights=, cache=, positions=")
    raise TypeError("; ".join(parts))


def warn_if_inverted(mask: object, lq: int, lk: int) -> None:
    """One warning per process for a bool mask (.., L, L) that hides every query's own key, the
    mark of nn.MultiheadAttention's convention (True = blocked, e.g. ``ones(L, L).triu(1)``) passed
    as multihead's (True = may attend). CPU masks are checked until it warns (O(L), no sync);
    on another device only the first such mask of the process (reading it waits for the device)."""
    global _warned_inverted_mask, _checked_device_mask
    if _warned_inverted_mask or not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool \
            or mask.dim() < 2 or lq != lk or lq < 2 or mask.shape[-2:] != (lq, lk) \
            or torch.compiler.is_compiling():
        return
    if mask.device.type == "meta":   # no values to read
        return
    if mask.device.type != "cpu":
        if _checked_device_mask:
            return
        _checked_device_mask = True
    if bool(mask.diagonal(dim1=-2, dim2=-1).any()):
        return
    _warned_inverted_mask = True
    warnings.warn(
        "mask hides every query's own key (its diagonal is all False): multihead's bool masks are True = may "
        "attend, nn.MultiheadAttention's attn_mask is True = blocked. If this is torch's mask (e.g. "
        "torch.ones(L, L).triu(1).bool()), convert it: mask=multihead.masks.from_torch(attn_mask=m), or use "
        "mask=multihead.masks.causal() for a causal mask. Shown once per process.",
        UserWarning, stacklevel=_caller_level(),
    )


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside multihead and torch.nn's module machinery
    (hooks and ``nn.Module.__call__`` put a varying number of frames between the user and here)."""
    here = os.path.dirname(__file__)
    nn_dir = os.path.dirname(_nn_module.__file__)
    frame: Optional[FrameType] = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith((here, nn_dir)):
        frame, level = frame.f_back, level + 1
    return level
