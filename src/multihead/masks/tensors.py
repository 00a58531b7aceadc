"""The key-padding kind: a bool (B, Lk) tensor, True for real tokens.

`keep` and `bias`, what a plain bool or float tensor passed as ``mask`` means, are in `core`
(``&`` and `as_mask` make them); nn.MultiheadAttention's tensors come in through `convert`.

Legend: B batch, H query heads, Lq/Lk query/key lengths.
"""

from __future__ import annotations

from typing import ClassVar, Optional

import torch

from .core import Mask, Shape, _Built, _state_of, tile_of
from .geometry import _Rows

class KeyPadding(Mask):
    """A bool (B, Lk) tensor, True for real tokens, False for padding keys."""

    kind: ClassVar[str] = "padding"

    def __init__(self, keep_t: torch.Tensor):
        if not isinstance(keep_t, torch.Tensor):
            raise TypeError(
                f"key_padding() takes a bool torch.Tensor (B, Lk), got {type(keep_t).__name__}; "
                "use torch.as_tensor"
            )
        if keep_t.dtype != torch.bool:
            raise TypeError(
                f"key_padding() takes a bool (B, Lk) tensor with True for real tokens, got {keep_t.dtype}; "
                "for nn.MultiheadAttention's key_padding_mask (True = padding) use masks.from_torch"
            )
        if keep_t.dim() != 2:
            raise ValueError(
                f"key_padding() takes a (B, Lk) tensor, got shape {tuple(keep_t.shape)}"
            )
        self.tensor = keep_t

    def _build_block(
        self, q0: int, q1: int, k0: int, k1: int, shape: Shape, *, device: torch.device, dtype: torch.dtype,
        rows: Optional[_Rows] = None,
    ) -> _Built:
        return tile_of(self.tensor[:, None, None, :], q0, q1, k0, k1), None

    def _dense_shape(self, shape: Shape) -> tuple[int, ...]:
        return (self.tensor.shape[0], 1, 1, self.tensor.shape[1])

    def _tile_state(self, q0: int, q1: int, k0: int, k1: int, shape: Shape, device: torch.device) -> int:
        return _state_of(self.tensor[:, k0:k1])

    def _check(self, shape: Shape, device: torch.device, name: str) -> None:
        t = self.tensor
        batch, _, _, lk = shape
        if t.device != device:
            raise ValueError(
                f"{name} (key padding) is on {t.device} but the query is on {device}; "
                f"move it with .to({str(device)!r})"
            )
        if tuple(t.shape) != (batch, lk):
            raise ValueError(
                f"{name} (key padding) has shape {tuple(t.shape)} but must be (B, Lk) = {(batch, lk)}"
            )

    def __repr__(self) -> str:
        return f"key_padding(shape={tuple(self.tensor.shape)})"

def key_padding(keep_t: torch.Tensor) -> Mask:
    """Bool (B, Lk), True for real tokens: padded keys get no attention.

    >>> import torch, multihead
    >>> real = torch.tensor([[True, True, False]])     # (B, Lk): the last key is padding
    >>> q = k = v = torch.randn(1, 2, 3, 4)
    >>> w = multihead.attention_weights(q, k, multihead.masks.key_padding(real) & multihead.masks.causal())
    >>> w[0, 0, :, 2].tolist()                         # no query attends to the padding key
    [0.0, 0.0, 0.0]
    """
    return KeyPadding(keep_t)
