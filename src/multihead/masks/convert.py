"""Foreign mask conventions in: nn.MultiheadAttention's (`from_torch`) and Hugging Face's (`from_hf`).

multihead's convention is SDPA's: True = this query may attend to this key, a float mask is
added to the scores. nn.MultiheadAttention's bool masks mean the opposite (True = blocked), and
transformers passes either a bool mask (True = may attend) or a float mask whose very negative
entries block. Each is converted here, once, into the kinds of this package.

Legend: B batch, H query heads, Lq/Lk query/key lengths.
"""

from __future__ import annotations

from typing import ClassVar, Optional

import torch

from .core import Bias, Keep, Mask, Shape, _Built, _state_of, tile_of
from .geometry import _FULL, _Rows
from .programmable import score_mod
from .scores import softcap as _softcap
from .structural import causal
from .tensors import KeyPadding

def from_torch(attn_mask: Optional[torch.Tensor] = None, key_padding_mask: Optional[torch.Tensor] = None) -> Optional[Mask]:
    """Convert nn.MultiheadAttention's masks (True = blocked) to this module's convention.

    attn_mask: bool (Lq, Lk) or (B*H, Lq, Lk) with True = blocked, or float (added); for the
    3-D form the batch and head axes are unflattened when the mask is used.
    key_padding_mask: bool (B, Lk) with True = padding, or float (added).
    """
    out: Optional[Mask] = None
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(
                f"attn_mask must be a torch.Tensor, got {type(attn_mask).__name__}; "
                "wrap it with torch.as_tensor(attn_mask)"
            )
        if attn_mask.dim() == 3:
            out = _TorchHeadsMask.wrap(attn_mask)
        elif attn_mask.dtype == torch.bool:
            out = Keep(~attn_mask)
        elif attn_mask.is_floating_point():
            out = Bias(attn_mask)
        else:
            raise TypeError(f"attn_mask must be bool or float, got {attn_mask.dtype}")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor):
            raise TypeError(
                f"key_padding_mask must be a torch.Tensor, got {type(key_padding_mask).__name__}; "
                "wrap it with torch.as_tensor(key_padding_mask)"
            )
        if key_padding_mask.dim() != 2:
            raise ValueError(
                f"key_padding_mask must be (B, Lk), got shape {tuple(key_padding_mask.shape)}"
            )
        if key_padding_mask.dtype == torch.bool:
            kp: Mask = KeyPadding(~key_padding_mask)
        elif key_padding_mask.is_floating_point():
            kp = Bias(key_padding_mask[:, None, None, :])
        else:
            raise TypeError(f"key_padding_mask must be bool or float, got {key_padding_mask.dtype}")
        out = kp if out is None else out & kp
    return out


class _TorchHeadsMask(Mask):
    """nn.MultiheadAttention's 3-D attn_mask (B*H, Lq, Lk), reshaped once B and H are known."""

    kind: ClassVar[str] = "torch"

    def __init__(self, t: torch.Tensor):
        self.tensor = t
        self.role = "select" if t.dtype == torch.bool else "add"

    @classmethod
    def wrap(cls, t: torch.Tensor) -> Mask:
        if t.dtype != torch.bool and not t.is_floating_point():
            raise TypeError(f"attn_mask must be bool or float, got {t.dtype}")
        return cls(t)

    def _unflatten(self, heads: int) -> torch.Tensor:
        t = self.tensor
        return t.reshape(t.shape[0] // heads, heads, *t.shape[1:])

    def _build_block(
        self, q0: int, q1: int, k0: int, k1: int, shape: Shape, *, device: torch.device, dtype: torch.dtype,
        rows: Optional[_Rows] = None,
    ) -> _Built:
        t = tile_of(self._unflatten(shape[1]), q0, q1, k0, k1)
        if t.dtype == torch.bool:
            return ~t, None
        return None, t.to(dtype)

    def _additive_tensor(self, shape: Shape) -> Optional[torch.Tensor]:
        return None if self.tensor.dtype == torch.bool else self._unflatten(shape[1])

    def _tile_state(self, q0: int, q1: int, k0: int, k1: int, shape: Shape, device: torch.device) -> int:
        if self.tensor.dtype != torch.bool:  # a float mask adds, it selects nothing
            return _FULL
        return _state_of(~tile_of(self._unflatten(shape[1]), q0, q1, k0, k1))  # True = masked out

    def _dense_shape(self, shape: Shape) -> tuple[int, ...]:
        return tuple(shape)

    def _check(self, shape: Shape, device: torch.device, name: str) -> None:
        t = self.tensor
        batch, heads, lq, lk = shape
        if tuple(t.shape) != (batch * heads, lq, lk):
            raise ValueError(
                f"{name} (nn.MultiheadAttention 3-D attn_mask) has shape {tuple(t.shape)}, "
                f"expected (B*H, Lq, Lk) = {(batch * heads, lq, lk)}"
            )
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but the query is on {device}")

    def __repr__(self) -> str:
        return f"from_torch(attn_mask of shape {tuple(self.tensor.shape)})"


def from_hf(attention_mask: Optional[torch.Tensor], lq: int, lk: int, *, is_causal: bool,
            softcap: Optional[float] = None) -> Optional[Mask]:
    """A mask from the ``attention_mask`` transformers passes to an attention function.

    ``attention_mask``: None (``is_causal`` and Lq > 1: top-left causal, transformers' rule),
    bool (B or 1, 1 or H, Lq, Lk') with True = may attend, or float of that shape, added to
    the scores, whose entries at or below half the dtype's lowest value block. Lk' >= Lk (a
    static cache's mask may be longer than the keys; it is cut to the first Lk columns).
    ``softcap`` (Gemma 2's ``attn_logit_softcapping``) squashes the scores before the mask is
    added, as eager does: a float mask's bias is added after the cap (a score mod after
    `softcap`), its blocked entries select. A flex-attention ``BlockMask`` is translated by
    `multihead.integrations.transformers.to_mask` (through the flex backend).

    >>> import torch
    >>> from multihead.masks.convert import from_hf
    >>> from_hf(None, 3, 3, is_causal=True)
    causal(align='top_left')
    >>> m = from_hf(torch.tensor([[[[0.0, -3.4e38]]]]), 1, 2, is_causal=True)
    >>> m.materialize((1, 1, 1, 2), device=torch.device("cpu"), dtype=torch.float32).keep.tolist()
    [[[[True, False]]]]
    """
    mask = _hf_tensor(attention_mask, lq, lk, is_causal=is_causal, softcap=softcap)
    if softcap is None:
        return mask
    capped = _softcap(softcap)
    return capped if mask is None else capped & mask


def _hf_tensor(attention_mask: object, lq: int, lk: int, *, is_causal: bool,
               softcap: Optional[float]) -> Optional[Mask]:
    if attention_mask is None:
        return causal(align="top_left") if is_causal and lq > 1 else None
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(
            f"attention_mask must be a torch.Tensor, a flex-attention BlockMask or None, got "
            f"{type(attention_mask).__name__}"
        )
    if attention_mask.dim() != 4:
        raise ValueError(
            f"attention_mask must be 4-D (B, 1 or H, Lq, Lk), got shape {tuple(attention_mask.shape)}"
        )
    if attention_mask.shape[-1] > lk:
        attention_mask = attention_mask[..., :lk]
    if attention_mask.dtype == torch.bool:
        return Keep(attention_mask)
    if not attention_mask.is_floating_point():
        raise TypeError(f"attention_mask must be bool or float, got {attention_mask.dtype}")
    blocked = attention_mask <= torch.finfo(attention_mask.dtype).min / 2
    mask: Mask = Keep(~blocked)
    rest = attention_mask.masked_fill(blocked, 0)
    if bool(rest.ne(0).any()):
        mask = mask & (Bias(rest) if softcap is None else _added_after_the_cap(rest))
    return mask


def _added_after_the_cap(bias: torch.Tensor) -> Mask:
    """A (B|1, H|1, Lq, Lk) bias as a score mod, so that it comes after the softcap (eager's order)."""
    whole_batch, whole_heads = bias.shape[0] > 1, bias.shape[1] > 1

    def add_mask_bias(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                      kv_idx: torch.Tensor) -> torch.Tensor:
        tile = bias[b if whole_batch else 0, h if whole_heads else 0, q_idx, kv_idx]
        return score + tile.to(score.dtype)

    return score_mod(add_mask_bias, tensors=(bias,))
