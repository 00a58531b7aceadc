"""Attention masks, with one convention everywhere: ``True`` = this query may attend to this key.

=======================  ================================  ==============================
who                      boolean mask means                float mask means
=======================  ================================  ==============================
multihead (this module)  True = may attend                 added to the scores
torch SDPA               True = may attend                 added to the scores
nn.MultiheadAttention    True = **blocked** (opposite)     added to the scores
=======================  ================================  ==============================

Convert nn.MultiheadAttention's masks once, with `from_torch`.

Every mask here is a small object that knows how to build its tensors for given lengths, so
structure (causal, a window) is kept until a backend decides how to use it. Masks compose
with ``&``:

* keep & keep  -> a key is visible only where both allow it;
* bias & keep  -> the bias where allowed, no attention elsewhere;
* bias & bias  -> the sum of the biases.

A plain bool tensor passed as ``mask`` means `keep`; a float tensor means `bias`.

Alignment when Lq != Lk (example Lq=2, Lk=5; rows are queries, columns keys)::

    causal(align="bottom_right")      causal(align="top_left")
        1 1 1 1 0                         1 0 0 0 0
        1 1 1 1 1                         1 1 0 0 0

Bottom-right puts the last query on the last key: it is what a decode step over a KV cache
needs (the new tokens come after the cached ones). Top-left is SDPA's ``is_causal`` rule.
Query i (0-based) sees key j when ``j <= i + offset``, with offset ``Lk - Lq`` (bottom-right)
or 0 (top-left). When Lq > Lk bottom-right leaves the first ``Lq - Lk`` queries with no key:
those rows give output 0 and weights 0.

A row that no key is left to attend to gives output 0 and weights 0 in every backend.

Block-wise use (the ``chunked`` backend): `Mask.key_span` says which keys a run of queries
can see at all (from the structural parts, causal and window), so whole blocks outside it are
never computed; `Mask.block` builds the tensors of one (query block, key block) tile only,
never the full (Lq, Lk) mask, and nothing at all for a structural part that allows the whole tile.

Legend: B batch, H query heads, Lq/Lk query/key lengths.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import ClassVar, Optional, Sequence, Union, overload

import torch

__all__ = [
    "Mask",
    "MaskLike",
    "MaskTensors",
    "causal",
    "window",
    "key_padding",
    "keep",
    "bias",
    "as_mask",
    "from_torch",
    "split_additive",
    "ALIGNMENTS",
]

ALIGNMENTS = ("bottom_right", "top_left")

#: (B, H, Lq, Lk), or any sequence of ints a mask is asked to apply to
Shape = Sequence[int]
#: what a leaf builds: its (keep, bias) tensors, either None
_Built = tuple[Optional[torch.Tensor], Optional[torch.Tensor]]


@dataclass(frozen=True)
class MaskTensors:
    """The materialised mask: ``keep`` (bool) and ``bias`` (float), each broadcastable to
    (B, H, Lq, Lk), either of them ``None`` when the mask has no such part."""

    keep: Optional[torch.Tensor]
    bias: Optional[torch.Tensor]


def diagonal_offset(align: str, lq: int, lk: int) -> int:
    """Key index that query 0's diagonal sits on: ``Lk - Lq`` bottom-right, 0 top-left."""
    return lk - lq if align == "bottom_right" else 0


class Mask:
    """Base class. Subclasses build their tensors in `materialize`."""

    #: what a leaf is, for messages ("causal", "window", "keep", "bias", "padding", "torch")
    kind: ClassVar[str]

    #: the parts this mask is made of (a leaf is its own only part)
    @property
    def parts(self) -> tuple["Mask", ...]:
        return (self,)

    def __and__(self, other: MaskLike) -> "Mask":
        right = as_mask(other, name="the right operand of &")
        if right is None:
            return self
        return AllOf(self.parts + right.parts)

    def __rand__(self, other: MaskLike) -> "Mask":
        left = as_mask(other, name="the left operand of &")
        if left is None:
            return self
        return AllOf(left.parts + self.parts)

    def materialize(self, shape: Shape, *, device: torch.device, dtype: torch.dtype) -> MaskTensors:
        """Build the tensors for ``shape`` = (B, H, Lq, Lk); bias is cast to ``dtype``."""
        keep_t: Optional[torch.Tensor] = None
        bias_t: Optional[torch.Tensor] = None
        for part in self.parts:
            k, b = part._build(shape, device=device, dtype=dtype)
            if k is not None:
                keep_t = k if keep_t is None else keep_t & k
            if b is not None:
                bias_t = b if bias_t is None else bias_t + b
        return MaskTensors(keep_t, bias_t)

    def key_span(self, q0: int, q1: int, lq: int, lk: int) -> tuple[int, int]:
        """Keys ``[lo, hi)`` that queries ``q0 .. q1-1`` may see at most (``lo >= hi``: none).

        Only the structural parts (causal, window) narrow the span; a tensor part may hide more
        keys inside it, which `block` then masks.
        """
        lo, hi = 0, lk
        for part in self.parts:
            plo, phi = part._key_span(q0, q1, lq, lk)
            lo, hi = max(lo, plo), min(hi, phi)
        return lo, hi

    def block(
        self, q0: int, q1: int, k0: int, k1: int, shape: Shape, *, device: torch.device, dtype: torch.dtype
    ) -> MaskTensors:
        """The mask of the tile queries ``q0 .. q1-1`` x keys ``k0 .. k1-1`` of ``shape`` = (B, H, Lq, Lk).

        ``keep`` and ``bias`` are 4-D, broadcastable to (B, H, q1-q0, k1-k0), or None when no
        part restricts the tile (a causal or window part that allows all of it builds nothing).
        Tensor parts are sliced, not copied; only the tile's own causal/window grid is built.
        """
        keep_t: Optional[torch.Tensor] = None
        bias_t: Optional[torch.Tensor] = None
        for part in self.parts:
            k, b = part._build_block(q0, q1, k0, k1, tuple(shape), device=device, dtype=dtype)
            if k is not None:
                keep_t = k if keep_t is None else keep_t & k
            if b is not None:
                bias_t = b if bias_t is None else bias_t + b
        return MaskTensors(keep_t, bias_t)

    def dense_shape(self, shape: Shape) -> tuple[int, ...]:
        """Shape of the tensor `materialize` would build for ``shape`` = (B, H, Lq, Lk),
        computed without building it: a causal or window part alone is (Lq, Lk)."""
        shapes = (part._dense_shape(tuple(shape)) for part in self.parts)
        return tuple(torch.broadcast_shapes(*shapes))  # type: ignore[no-untyped-call]  # torch leaves it unannotated

    def check(self, shape: Shape, device: torch.device, name: str = "mask") -> None:
        """Raise ValueError when this mask cannot apply to ``shape`` = (B, H, Lq, Lk) on ``device``."""
        for part in self.parts:
            part._check(tuple(shape), device, name)

    # -- for leaves
    def _build(self, shape: Shape, *, device: torch.device, dtype: torch.dtype) -> _Built:  # pragma: no cover - abstract
        raise NotImplementedError

    def _check(self, shape: Shape, device: torch.device, name: str) -> None:
        return None

    def _key_span(self, q0: int, q1: int, lq: int, lk: int) -> tuple[int, int]:
        return 0, lk

    def _dense_shape(self, shape: Shape) -> tuple[int, ...]:
        tensor = getattr(self, "tensor", None)
        return tuple(shape[-2:]) if tensor is None else tuple(tensor.shape)

    def _additive_tensor(self, shape: Shape) -> Optional[torch.Tensor]:
        """For a part added to the scores: its float tensor as 4-D (B|1, H|1, Lq|1, Lk|1), else None."""
        return None

    def _build_block(
        self, q0: int, q1: int, k0: int, k1: int, shape: Shape, *, device: torch.device, dtype: torch.dtype
    ) -> _Built:
        """Default for tensor leaves: slice what `_build` returns (a view, no copy)."""
        keep_t, bias_t = self._build(shape, device=device, dtype=dtype)
        return _tile(keep_t, q0, q1, k0, k1), _tile(bias_t, q0, q1, k0, k1)


class AllOf(Mask):
    """Conjunction of masks built with ``&``."""

    def __init__(self, parts: Sequence[Mask]):
        self._parts = tuple(parts)

    @property
    def parts(self) -> tuple[Mask, ...]:
        return self._parts

    def __repr__(self) -> str:
        return " & ".join(repr(p) for p in self._parts)


MaskLike = Union[Mask, torch.Tensor, None]
"""What ``mask=`` takes everywhere (the type of that argument): a mask of this module, a bool
tensor (True = may attend, as `keep`), a float tensor (added to the scores, as `bias`), or None."""


@overload
def _tile(t: torch.Tensor, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor: ...
@overload
def _tile(t: None, q0: int, q1: int, k0: int, k1: int) -> None: ...


def _tile(t: Optional[torch.Tensor], q0: int, q1: int, k0: int, k1: int) -> Optional[torch.Tensor]:
    """4-D view of ``t`` (broadcastable to (B, H, Lq, Lk)) restricted to one tile.

    A size-1 (broadcast) query or key axis stays size 1; a full-size axis is sliced.
    """
    if t is None:
        return None
    t = t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))
    rows = slice(None) if t.shape[-2] == 1 else slice(q0, q1)
    cols = slice(None) if t.shape[-1] == 1 else slice(k0, k1)
    return t[:, :, rows, cols]


def _tile_grid(
    q0: int, q1: int, k0: int, k1: int, offset: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Query positions (shifted by ``offset``) as a column and key positions as a row, for one tile."""
    i = torch.arange(q0, q1, device=device).unsqueeze(-1) + offset
    j = torch.arange(k0, k1, device=device).unsqueeze(0)
    return i, j


def _index_grid(lq: int, lk: int, offset: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    i = torch.arange(lq, device=device).unsqueeze(-1) + offset
    j = torch.arange(lk, device=device).unsqueeze(0)
    return i, j


class Causal(Mask):
    """Query i sees key j when ``j <= i + offset`` (see the module docstring's pictures)."""

    kind: ClassVar[str] = "causal"

    def __init__(self, align: str = "bottom_right"):
        if align not in ALIGNMENTS:
            raise ValueError(f"align must be one of {ALIGNMENTS}, got {align!r}")
        self.align = align

    def _build(self, shape: Shape, *, device: torch.device, dtype: torch.dtype) -> _Built:
        lq, lk = shape[-2:]
        i, j = _index_grid(lq, lk, diagonal_offset(self.align, lq, lk), device)
        return j <= i, None

    def _key_span(self, q0: int, q1: int, lq: int, lk: int) -> tuple[int, int]:
        return 0, min(lk, q1 + diagonal_offset(self.align, lq, lk))

    def _build_block(
        self, q0: int, q1: int, k0: int, k1: int, shape: Shape, *, device: torch.device, dtype: torch.dtype
    ) -> _Built:
        lq, lk = shape[-2:]
        offset = diagonal_offset(self.align, lq, lk)
        if k1 - 1 <= q0 + offset:  # the whole tile is on or below the diagonal
            return None, None
        i, j = _tile_grid(q0, q1, k0, k1, offset, device)
        return (j <= i)[None, None], None

    def __repr__(self) -> str:
        return f"causal(align={self.align!r})"


class Window(Mask):
    """Query i sees keys ``i+offset-left ... i+offset+right`` inclusive (local attention)."""

    kind: ClassVar[str] = "window"

    def __init__(self, left: Optional[int], right: Optional[int] = 0, align: str = "bottom_right"):
        sides: tuple[tuple[object, str], ...] = ((left, "left"), (right, "right"))  # checked, not trusted
        for value, name in sides:
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"window {name} must be an int or None, got {type(value).__name__}")
            if int(value) < 0:
                raise ValueError(
                    f"window {name} must be >= 0, got {value}; it counts keys on that side "
                    "of the query (None = unlimited)"
                )
        if align not in ALIGNMENTS:
            raise ValueError(f"align must be one of {ALIGNMENTS}, got {align!r}")
        self.left = None if left is None else int(left)
        self.right = None if right is None else int(right)
        self.align = align

    def _build(self, shape: Shape, *, device: torch.device, dtype: torch.dtype) -> _Built:
        lq, lk = shape[-2:]
        i, j = _index_grid(lq, lk, diagonal_offset(self.align, lq, lk), device)
        ok = torch.ones(lq, lk, dtype=torch.bool, device=device)
        if self.left is not None:
            ok = ok & (j >= i - self.left)
        if self.right is not None:
            ok = ok & (j <= i + self.right)
        return ok, None

    def _key_span(self, q0: int, q1: int, lq: int, lk: int) -> tuple[int, int]:
        offset = diagonal_offset(self.align, lq, lk)
        lo = 0 if self.left is None else max(0, q0 + offset - self.left)
        hi = lk if self.right is None else min(lk, q1 - 1 + offset + self.right + 1)
        return lo, hi

    def _build_block(
        self, q0: int, q1: int, k0: int, k1: int, shape: Shape, *, device: torch.device, dtype: torch.dtype
    ) -> _Built:
        lq, lk = shape[-2:]
        offset = diagonal_offset(self.align, lq, lk)
        left_ok = self.left is None or k0 >= q1 - 1 + offset - self.left
        right_ok = self.right is None or k1 - 1 <= q0 + offset + self.right
        if left_ok and right_ok:  # every query of the tile sees every key of it
            return None, None
        i, j = _tile_grid(q0, q1, k0, k1, offset, device)
        ok = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool, device=device)
        if self.left is not None and not left_ok:
            ok = ok & (j >= i - self.left)
        if self.right is not None and not right_ok:
            ok = ok & (j <= i + self.right)
        return ok[None, None], None

    def __repr__(self) -> str:
        return f"window(left={self.left}, right={self.right}, align={self.align!r})"


def _check_broadcast(t: torch.Tensor, target: Shape, device: torch.device, name: str, what: str) -> None:
    if t.device != device:
        raise ValueError(
            f"{name} ({what}) is on {t.device} but the query is on {device}; "
            f"move it with .to({str(device)!r})"
        )
    ok = t.dim() <= 4 and all(
        s == 1 or s == want for s, want in zip(reversed(t.shape), reversed(target))
    )
    if not ok:
        raise ValueError(
            f"{name} ({what}) has shape {tuple(t.shape)}, which does not broadcast to "
            f"(B, H, Lq, Lk) = {target}; give it shape (Lq, Lk), (B, 1, Lq, Lk) or "
            "(B, H, Lq, Lk), or use masks.key_padding for a (B, Lk) padding mask"
        )


class Keep(Mask):
    """A boolean tensor broadcastable to (B, H, Lq, Lk); True = may attend."""

    kind: ClassVar[str] = "keep"

    def __init__(self, t: torch.Tensor):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"keep() takes a bool torch.Tensor, got {type(t).__name__}; use torch.as_tensor")
        if t.dtype != torch.bool:
            raise TypeError(
                f"keep() takes a bool tensor (True = may attend), got {t.dtype}; "
                "use t.bool() for 0/1 masks, or masks.bias() for additive float masks"
            )
        self.tensor = t

    def _build(self, shape: Shape, *, device: torch.device, dtype: torch.dtype) -> _Built:
        return self.tensor, None

    def _check(self, shape: Shape, device: torch.device, name: str) -> None:
        _check_broadcast(self.tensor, shape, device, name, "keep mask")

    def __repr__(self) -> str:
        return f"keep(shape={tuple(self.tensor.shape)})"


class Bias(Mask):
    """A float tensor broadcastable to (B, H, Lq, Lk), added to the scaled scores.

    A ``-inf`` entry blocks that key like a False in a keep mask.
    """

    kind: ClassVar[str] = "bias"

    def __init__(self, t: torch.Tensor):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"bias() takes a float torch.Tensor, got {type(t).__name__}; use torch.as_tensor")
        if not t.is_floating_point():
            raise TypeError(
                f"bias() takes a floating tensor added to the scores, got {t.dtype}; "
                "use masks.keep() for a boolean mask"
            )
        self.tensor = t

    def _build(self, shape: Shape, *, device: torch.device, dtype: torch.dtype) -> _Built:
        return None, self.tensor.to(dtype)

    def _build_block(
        self, q0: int, q1: int, k0: int, k1: int, shape: Shape, *, device: torch.device, dtype: torch.dtype
    ) -> _Built:
        return None, _tile(self.tensor, q0, q1, k0, k1).to(dtype)

    def _additive_tensor(self, shape: Shape) -> Optional[torch.Tensor]:
        t = self.tensor
        return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))

    def _check(self, shape: Shape, device: torch.device, name: str) -> None:
        _check_broadcast(self.tensor, shape, device, name, "bias")

    def __repr__(self) -> str:
        return f"bias(shape={tuple(self.tensor.shape)})"


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

    def _build(self, shape: Shape, *, device: torch.device, dtype: torch.dtype) -> _Built:
        return self.tensor[:, None, None, :], None

    def _dense_shape(self, shape: Shape) -> tuple[int, ...]:
        return (self.tensor.shape[0], 1, 1, self.tensor.shape[1])

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


def split_additive(mask: Optional[Mask], shape: Shape) -> tuple[Optional[Mask], tuple[torch.Tensor, ...]]:
    """``(rest, biases)``: the mask without its parts added to the scores, and those parts'
    float tensors, each 4-D and broadcastable to ``shape`` = (B, H, Lq, Lk) (views, no copy).

    A backend that differentiates with respect to the biases takes them as separate inputs.
    """
    if mask is None:
        return None, ()
    rest: list[Mask] = []
    biases: list[torch.Tensor] = []
    for part in mask.parts:
        t = part._additive_tensor(tuple(shape))
        if t is None:
            rest.append(part)
        else:
            biases.append(t)
    if not rest:
        return None, tuple(biases)
    return (rest[0] if len(rest) == 1 else AllOf(rest)), tuple(biases)


def causal(align: str = "bottom_right") -> Mask:
    """Causal mask; ``align`` is ``"bottom_right"`` (default) or ``"top_left"`` when Lq != Lk.

    >>> import torch
    >>> from multihead import masks
    >>> m = masks.causal()
    >>> m.materialize((1, 1, 2, 4), device=torch.device("cpu"), dtype=torch.float32).keep.int().tolist()
    [[1, 1, 1, 0], [1, 1, 1, 1]]
    >>> masks.causal("top_left").materialize((1, 1, 2, 4), device=torch.device("cpu"),
    ...                                      dtype=torch.float32).keep.int().tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0]]
    """
    return Causal(align)


def window(left: Optional[int], right: Optional[int] = 0, *, align: str = "bottom_right") -> Mask:
    """Local attention: query i sees keys i-left ... i+right (aligned like `causal`).

    ``window(w)`` is a causal sliding window of w past keys plus the query's own position;
    ``None`` on a side means unlimited.

    >>> import torch
    >>> from multihead import masks
    >>> t = masks.window(1).materialize((1, 1, 4, 4), device=torch.device("cpu"), dtype=torch.float32)
    >>> t.keep.int().tolist()                          # each query: its previous key and itself
    [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    """
    return Window(left, right, align)


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


def keep(t: torch.Tensor) -> Mask:
    """Bool tensor broadcastable to (B, H, Lq, Lk): True = may attend.

    >>> import torch, multihead
    >>> q = k = v = torch.randn(1, 1, 2, 4)
    >>> allowed = torch.tensor([[True, False], [True, True]])          # (Lq, Lk)
    >>> torch.equal(multihead.attention(q, k, v, mask=multihead.masks.keep(allowed)),
    ...             multihead.attention(q, k, v, mask=allowed))      # a bool tensor means keep()
    True
    """
    return Keep(t)


def bias(t: torch.Tensor) -> Mask:
    """Float tensor broadcastable to (B, H, Lq, Lk), added to the scaled scores.

    >>> import torch, multihead
    >>> q = k = torch.zeros(1, 1, 2, 4)                # equal scores: the bias alone decides
    >>> b = torch.tensor([[0.0, float("-inf")], [0.0, 0.0]])
    >>> multihead.attention_weights(q, k, multihead.masks.bias(b))[0, 0].tolist()
    [[1.0, 0.0], [0.5, 0.5]]
    """
    return Bias(t)


_CONVENTION = (
    "multihead masks say True = this query may attend to this key (SDPA's convention); "
    "a float tensor is a bias added to the scores. nn.MultiheadAttention's bool masks mean the "
    "opposite (True = blocked): convert them with multihead.masks.from_torch(attn_mask=..., "
    "key_padding_mask=...) or pass ~mask."
)


def as_mask(mask: object, name: str = "mask") -> Optional[Mask]:
    """Normalise what users pass as ``mask``: None, a Mask, a bool tensor (keep) or a float tensor (bias)."""
    if mask is None or isinstance(mask, Mask):
        return mask
    if isinstance(mask, torch.Tensor):
        if mask.dtype == torch.bool:
            return Keep(mask)
        if mask.is_floating_point():
            return Bias(mask)
        raise TypeError(f"{name} has dtype {mask.dtype}, which is neither bool nor float. " + _CONVENTION)
    raise TypeError(
        f"{name} must be None, a multihead.masks mask, or a torch.Tensor, got {type(mask).__name__}; "
        "for array-likes use torch.as_tensor(mask, dtype=torch.bool)"
    )


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

    @classmethod
    def wrap(cls, t: torch.Tensor) -> Mask:
        if t.dtype != torch.bool and not t.is_floating_point():
            raise TypeError(f"attn_mask must be bool or float, got {t.dtype}")
        return cls(t)

    def _unflatten(self, heads: int) -> torch.Tensor:
        t = self.tensor
        return t.reshape(t.shape[0] // heads, heads, *t.shape[1:])

    def _build(self, shape: Shape, *, device: torch.device, dtype: torch.dtype) -> _Built:
        t = self._unflatten(shape[1])
        if t.dtype == torch.bool:
            return ~t, None
        return None, t.to(dtype)

    def _build_block(
        self, q0: int, q1: int, k0: int, k1: int, shape: Shape, *, device: torch.device, dtype: torch.dtype
    ) -> _Built:
        t = _tile(self._unflatten(shape[1]), q0, q1, k0, k1)
        if t.dtype == torch.bool:
            return ~t, None
        return None, t.to(dtype)

    def _additive_tensor(self, shape: Shape) -> Optional[torch.Tensor]:
        return None if self.tensor.dtype == torch.bool else self._unflatten(shape[1])

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
