"""The built-in score kinds: `softcap` (role "modify"), `sink` (role "denominator") and
`alibi` (role "add", with BLOOM's and MPT's `alibi_slopes`), each beside its constructor.

Legend: B batch, H query heads, Lq/Lk query/key lengths, n a tile's query rows, bk its keys.
"""

from __future__ import annotations

import math
import numbers
from typing import Callable, ClassVar, Optional, Sequence, Union

import torch

from .core import Mask, Shape, _Built, _check_count, _check_in_range
from .geometry import _check_align, _Rows
from .programmable import ScoreMod, _BuildsNothing

#: the most heads `alibi_slopes` makes slopes for: beyond any model that fits in memory
MAX_HEADS = 2**16

class Softcap(ScoreMod):
    """``cap · tanh(s / cap)``: scores squashed into (-cap, cap) (Gemma 2's attn_logit_softcapping)."""

    kind: ClassVar[str] = "softcap"

    def __init__(self, cap: float):
        value: object = cap  # checked, not trusted
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"softcap cap must be a positive number, got {type(cap).__name__}")
        if not (math.isfinite(float(cap)) and float(cap) > 0):
            raise ValueError(f"softcap cap must be a finite number > 0, got {cap}; scores are squashed into (-cap, cap)")
        self.cap: float = float(cap)
        super().__init__(self._squash, tensors=())

    def _squash(self, s: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.tanh(s / self.cap) * self.cap
        return out

    def _probe(self, shape: Shape, device: torch.device, dtype: torch.dtype, name: str) -> None:
        held = float(torch.tensor(self.cap, dtype=dtype))  # the cap as the scores' dtype holds it
        if held == 0 or not math.isfinite(held):
            raise ValueError(
                f"{name} (softcap) has cap {self.cap:g}, which is {held:g} in the scores' dtype {dtype} "
                f"(every output would be NaN); give a cap between {torch.finfo(dtype).tiny:g} and "
                f"{torch.finfo(dtype).max:g}"
            )

    def __repr__(self) -> str:
        return f"softcap({self.cap:g})"

def softcap(cap: float) -> Mask:
    """Scores squashed to ``cap · tanh(s / cap)`` (Gemma 2's ``attn_logit_softcapping``); cap > 0.

    >>> import torch
    >>> from multihead import masks
    >>> s = torch.tensor([[[[0.0, 100.0]]]])
    >>> masks.softcap(50.0).apply_block(s, 0, 1, 0, 2, (1, 1, 1, 2)).tolist()
    [[[[0.0, 48.201377868652344]]]]
    """
    return Softcap(cap)

class Sink(_BuildsNothing):
    """A learned logit per query head in the softmax's denominator: ``w_ij = exp(s_ij) /
    (Σ_j exp(s_ij) + exp(sink_h))`` (gpt-oss's ``s_aux``); the weights of a row sum to less than 1."""

    kind: ClassVar[str] = "sink"
    role = "denominator"
    one_per_mask: ClassVar[Optional[str]] = "add the logits into one masks.sink(...) (logaddexp of them)"

    def __init__(self, logits: torch.Tensor):
        if not isinstance(logits, torch.Tensor):
            raise TypeError(f"sink takes a float torch.Tensor of logits (H,), got {type(logits).__name__}; use torch.tensor")
        if not logits.is_floating_point():
            raise TypeError(f"sink logits must be a floating tensor (H,), got {logits.dtype}; use logits.float()")
        if logits.dim() != 1:
            raise ValueError(f"sink logits must be (H,), one per query head, got shape {tuple(logits.shape)}")
        self.logits = logits
        #: the largest finite |logit| given, held to the compute dtype's range by `_probe`
        self._largest = 0.0
        if not torch.compiler.is_compiling():  # values are read on the host: not in a traced graph
            t = logits.detach()
            if bool(torch.isposinf(t).any()) or bool(torch.isnan(t).any()):
                raise ValueError(
                    f"sink logits must be finite or -inf (no sink for that head), got {t.tolist()}; "
                    "a +inf sink would take every row's whole weight"
                )
            finite = t[torch.isfinite(t)]
            self._largest = float(finite.abs().max()) if finite.numel() else 0.0

    def _check(self, shape: Shape, device: torch.device, name: str) -> None:
        if self.logits.shape[0] != shape[1]:
            raise ValueError(
                f"{name} (sink) has {self.logits.shape[0]} logits but the call has H={shape[1]} query heads; "
                "give one logit per query head"
            )
        if self.logits.device != device:
            raise ValueError(f"{name} (sink) is on {self.logits.device} but the query is on {device}; move it with .to()")

    def _probe(self, shape: Shape, device: torch.device, dtype: torch.dtype, name: str) -> None:
        _check_in_range(self._largest, dtype, f"{name} (sink) logits")

    def __repr__(self) -> str:
        grad = ", learned" if self.logits.requires_grad else ""
        return f"sink(H={self.logits.shape[0]}{grad})"

def sink(logits: torch.Tensor) -> Mask:
    """A learned logit per query head, (H,), added to each row's softmax denominator as
    ``exp(logit)`` (gpt-oss's ``s_aux``, "attention sinks"); a row may give less than all of its
    weight to the keys.

    >>> import torch, multihead
    >>> from multihead import masks
    >>> q = k = torch.zeros(1, 1, 1, 4)                         # one query, one key, score 0
    >>> multihead.attention_weights(q, k, masks.sink(torch.zeros(1))).item()  # e^0 / (e^0 + e^0)
    0.5
    """
    return Sink(logits)

class ALiBi(Mask):
    """Attention with linear biases: ``-slope_h · |j - d_i|`` added to the scores, d_i the
    query's diagonal key (per document with documents). Under a causal mask this is BLOOM's and
    MPT's ``slope_h · j`` up to a constant per row, which the softmax ignores; it is flash-attn's
    ``alibi_slopes`` rule."""

    kind: ClassVar[str] = "alibi"
    role = "add"
    needs_rows: ClassVar[bool] = True

    def __init__(self, slopes: Union[torch.Tensor, Sequence[float]], align: str = "bottom_right"):
        if not isinstance(slopes, torch.Tensor):
            try:
                slopes = torch.tensor([float(s) for s in slopes], dtype=torch.float64)
            except (TypeError, ValueError):
                raise TypeError(
                    f"alibi slopes must be a float tensor or a sequence of numbers (H,), got {type(slopes).__name__}; "
                    "use masks.alibi_slopes(H)"
                ) from None
        if not slopes.is_floating_point():
            raise TypeError(f"alibi slopes must be floating, got {slopes.dtype}; use masks.alibi_slopes(H)")
        if slopes.dim() not in (1, 2):
            raise ValueError(f"alibi slopes must be (H,), one per query head, or (B, H), one per sequence and head "
                             f"(flash-attn's alibi_slopes), got shape {tuple(slopes.shape)}")
        self.slopes = slopes
        #: the largest |slope|, held to the compute dtype's range by `_probe`
        self._largest = 0.0
        if not torch.compiler.is_compiling():  # values are read on the host: not in a traced graph
            if not bool(torch.isfinite(slopes.detach()).all()):
                raise ValueError(f"alibi slopes must be finite, got {slopes.detach().tolist()}; use masks.alibi_slopes(H)")
            self._largest = float(slopes.detach().abs().max()) if slopes.numel() else 0.0
        self.align = _check_align(align)

    def _rows_bias(self, rows: _Rows, k0: int, k1: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        d = rows.diagonal(self.align).to(device)  # (B|1, n)
        j = torch.arange(k0, k1, device=device)
        dist = (j - d.unsqueeze(-1)).abs().unsqueeze(1).to(dtype)  # (B|1, 1, n, bk)
        slopes = self.slopes.to(device=device, dtype=dtype)
        return -(slopes[:, :, None, None] if slopes.dim() == 2 else slopes.view(1, -1, 1, 1)) * dist  # (B|1, H, n, bk)

    def _build_block(self, q0: int, q1: int, k0: int, k1: int, shape: Shape, *, device: torch.device,
                     dtype: torch.dtype, rows: Optional[_Rows] = None) -> _Built:
        assert rows is not None
        return None, self._rows_bias(rows, k0, k1, device, dtype)

    def _dense_shape(self, shape: Shape) -> tuple[int, ...]:
        return (shape[0] if self.slopes.dim() == 2 else 1, shape[1], shape[2], shape[3])

    def flex_mod(
        self, mask: Mask, shape: tuple[int, int, int, int], *, device: torch.device, dtype: torch.dtype
    ) -> Optional[tuple[Callable[..., torch.Tensor], str]]:
        """``s - slope[h] |kv - d[b, q]|``, d the row's diagonal key (per document, from ``mask``)."""
        diagonal = mask.row_diagonals(shape, self.align).to(device)
        return alibi_score_mod(self.slopes.to(device=device, dtype=dtype), diagonal), \
            "alibi -> score_mod (slope x distance to the diagonal)"

    def _check(self, shape: Shape, device: torch.device, name: str) -> None:
        if self.slopes.shape[-1] != shape[1]:
            raise ValueError(
                f"{name} (alibi) has {self.slopes.shape[-1]} slopes but the call has H={shape[1]} query heads; "
                f"give one slope per query head, e.g. masks.alibi_slopes({shape[1]})"
            )
        if self.slopes.dim() == 2 and self.slopes.shape[0] != shape[0]:
            raise ValueError(
                f"{name} (alibi) has slopes for {self.slopes.shape[0]} sequences (B, H) but the call has B={shape[0]}; "
                "give one row of slopes per sequence, or (H,) slopes shared by the batch"
            )
        if self.slopes.device != device:
            raise ValueError(f"{name} (alibi) slopes are on {self.slopes.device} but the query is on {device}; move them with .to()")

    def _probe(self, shape: Shape, device: torch.device, dtype: torch.dtype, name: str) -> None:
        _check_in_range(self._largest, dtype, f"{name} (alibi) slopes")

    def __repr__(self) -> str:
        shown = ", ".join(f"{s:.4g}" for s in self.slopes.detach().cpu().flatten().tolist()[:4])
        more = ", ..." if self.slopes.numel() > 4 else ""
        rows = f"B={self.slopes.shape[0]}, " if self.slopes.dim() == 2 else ""
        return f"alibi({rows}H={self.slopes.shape[-1]}, slopes=[{shown}{more}], align={self.align!r})"

def alibi_score_mod(slopes: torch.Tensor, diagonal: torch.Tensor) -> Callable[..., torch.Tensor]:
    """ALiBi as a score_mod: ``s - slope[h] |kv - d[b, q]|``.

    slopes: (H,) or (B, H); diagonal: (B | 1, Lq) the key each row's distances count from (its
    diagonal, per document: :meth:`Mask.row_diagonals`). Read by the flex translation and by the
    ring, which places the diagonals of its own block pairs."""
    per_batch = diagonal.shape[0] > 1

    def alibi(s: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        d = diagonal[b if per_batch else 0, q]
        return s - (slopes[b, h] if slopes.dim() == 2 else slopes[h]) * (kv - d).abs().to(s.dtype)

    return alibi


def alibi(slopes: Union[torch.Tensor, Sequence[float]], *, align: str = "bottom_right") -> Mask:
    """ALiBi: ``-slope_h · |j - d_i|`` added to the scores, ``slopes`` (H,) one per query head
    (`alibi_slopes` gives BLOOM's and MPT's) or (B, H) one per sequence and head (flash-attn's
    ``alibi_slopes`` of shape (batch, nheads)), d_i the query's diagonal key (per document).

    >>> import torch
    >>> from multihead import masks
    >>> t = masks.alibi([0.5]).materialize((1, 1, 3, 3), device=torch.device("cpu"), dtype=torch.float32)
    >>> t.bias[0, 0].tolist()
    [[-0.0, -0.5, -1.0], [-0.5, -0.0, -0.5], [-1.0, -0.5, -0.0]]
    """
    return ALiBi(slopes, align)


def alibi_slopes(heads: int) -> torch.Tensor:
    """BLOOM's and MPT's ALiBi slopes for ``heads`` heads, (H,) float64: for n = the largest power
    of 2 <= H, ``2^(-8k/n)`` for k = 1 .. n, then for the H - n others ``2^(-4k/n)`` for the odd
    k = 1, 3, 5, ... (the slopes of 2n heads that the first n did not take).

    >>> from multihead import masks
    >>> masks.alibi_slopes(4).tolist()
    [0.25, 0.0625, 0.015625, 0.00390625]
    """
    h = _check_count(heads, "alibi_slopes heads", minimum=1)
    if h is not None and h > MAX_HEADS:
        raise ValueError(f"alibi_slopes heads must be <= {MAX_HEADS}, got {heads}; give the model's number of query heads")
    assert h is not None
    n = 2 ** int(math.floor(math.log2(h)))
    slopes = [2.0 ** (-8.0 * k / n) for k in range(1, n + 1)]
    slopes += [2.0 ** (-4.0 * k / n) for k in range(1, 2 * (h - n), 2)]
    return torch.tensor(slopes, dtype=torch.float64)
