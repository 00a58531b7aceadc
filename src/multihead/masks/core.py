"""The mask algebra and what kernels read from it.

`Mask` (a leaf kind, or an `AllOf` made with ``&``), what a plain tensor means (`keep`, `bias`,
`as_mask`), the one build path (`Mask.block`; `Mask.materialize` is the block over the whole
call), the tile states (`Mask.tile_state`, `BlockPlan`), and the two helpers every kernel uses
on a mask's tensors: `as_4d` and `tile_of`. The kinds live beside their constructors in
`structural`, `tensors`, `programmable` and `scores`; each declares its `Mask.role`.

Longer than ~500 lines because `Mask` is one class: the methods kernels call (``block``,
``tile_state``, ``key_span``, ``row_intervals``, ``apply_block``) and the hooks a kind
fills in (``_intervals`` or ``_build_block``, ``_check``, ``_probe``) read together.

Legend: B batch, H query heads, Lq/Lk query/key lengths, bq/bk a tile's query/key counts.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Callable, ClassVar, Optional, Sequence, Union, cast, overload

import torch

from .geometry import (
    _EMPTY,
    _FULL,
    _PARTIAL,
    TILE_STATES,
    _AnyRows,
    _DocumentRows,
    _from_ends,
    _Intervals,
    _interval_keep,
    _intervals,
    _Rows,
    interval_cover,
)

#: what `Mask.role` answers
ROLES = ("select", "add", "modify", "denominator")

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

def _documents_of(parts: Sequence["Mask"]) -> Optional[_DocumentRows]:
    """The part that says where each row's document lies (a documents part), if any."""
    for p in parts:
        if p.places_rows:
            return cast(_DocumentRows, p)
    return None


class Mask:
    """Base class. A leaf kind builds its tensors for one tile in `_build_block`, or describes the
    keys each query may see as intervals (`_intervals`: causal, window, documents, chunked_local).
    docs/masks.md ("Adding a mask kind") shows a new kind written out."""

    #: what a leaf is, for messages ("causal", "window", "keep", "bias", "padding", "torch",
    #: "documents", "chunked_local", "mask_mod", "alibi", "score_mod", "softcap", "sink")
    kind: ClassVar[str]
    #: what the part does to the scores, one of `ROLES`: "select" hides keys (causal, window,
    #: documents, chunked_local, keep, key_padding, mask_mod, a bool torch mask), "add" adds a
    #: float tensor (bias, alibi, a float torch mask), "modify" rewrites them (score_mod,
    #: softcap), "denominator" adds a term to the softmax's denominator (sink). Consumers read
    #: the role, never a list of kinds.
    role: str = "select"
    #: whether the part selects by key intervals per query (`_intervals`)
    is_structural: ClassVar[bool] = False
    #: whether `_build_block` reads the rows' geometry (``rows=``)
    needs_rows: ClassVar[bool] = False
    #: whether the part says where each row's document lies (documents): the rows' geometry
    #: (`geometry._Rows`) is read from it
    places_rows: ClassVar[bool] = False
    #: for a kind a mask may hold once (documents, sink): how to merge two of them, said when
    #: ``&`` meets a second one; None: any number
    one_per_mask: ClassVar[Optional[str]] = None

    #: the parts this mask is made of (a leaf is its own only part)
    @property
    def parts(self) -> tuple["Mask", ...]:
        return (self,)

    #: a block plan attached with `with_plan` (None: tile states are derived from the parts)
    plan: Optional["BlockPlan"] = None

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

    # -- what kernels read
    @property
    def score_mods(self) -> tuple["Mask", ...]:
        """The parts whose role is "modify" (score_mod, softcap), in written order; empty for most masks."""
        return tuple(p for p in self.parts if p.role == "modify")

    @property
    def sink_logits(self) -> Optional[torch.Tensor]:
        """(H,) float: the sink part's logits (one per query head), or None without a sink."""
        for p in self.parts:
            if p.role == "denominator":
                logits: torch.Tensor = getattr(p, "logits")
                return logits
        return None

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The float tensors the score mods read that may need gradients (empty for most masks)."""
        out: list[torch.Tensor] = []
        for p in self.score_mods:
            out.extend(p._own_tensors())
        return tuple(out)

    def _own_tensors(self) -> tuple[torch.Tensor, ...]:
        return ()

    def apply_block(self, s: torch.Tensor, q0: int, q1: int, k0: int, k1: int, shape: Shape,
                    heads: Optional[Sequence[int]] = None) -> torch.Tensor:
        """Scores ``s`` (B, H, q1-q0, k1-k0) of the tile queries q0.. x keys k0.. (absolute
        indices, ``shape`` = (B, H, Lq, Lk)) after every score-mod part, in written order.
        ``heads``: the heads of ``shape`` that the head axis of ``s`` holds, in that order
        (None: all H; a score_mod then sees those head indices as ``h``).

        Same shape and dtype back; differentiable by torch autograd (also into `tensors`).
        Without score-mod parts ``s`` itself comes back.
        """
        for p in self.score_mods:
            s = p._apply(s, q0, q1, k0, k1, tuple(shape), heads)
        return s

    def _apply(self, s: torch.Tensor, q0: int, q1: int, k0: int, k1: int, shape: Shape,
               heads: Optional[Sequence[int]] = None) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def with_plan(self, plan: "BlockPlan") -> "Mask":
        """This mask with ``plan`` (from `block_plan`): `tile_state` and `block` answer from it
        for calls of the plan's shape. Share the result between layers to plan once."""
        if not isinstance(plan, BlockPlan):
            raise TypeError(f"with_plan takes a masks.BlockPlan (from masks.block_plan), got {type(plan).__name__}")
        return AllOf(self.parts, plan=plan)

    # -- tensors
    def materialize(self, shape: Shape, *, device: torch.device, dtype: torch.dtype) -> MaskTensors:
        """Build the dense tensors for ``shape`` = (B, H, Lq, Lk); bias is cast to ``dtype``.

        The `block` of the whole call, with a keep wherever a part selects (also where it
        allows every key), each tensor with as many axes as the widest part's own (a causal
        or window part alone: (Lq, Lk); documents that differ across the batch: (B, 1, Lq, Lk)).
        """
        shape = tuple(shape)
        lq, lk = shape[-2:]
        built = self._tiles(0, lq, 0, lk, shape, device=device, dtype=dtype, dense=True)
        dims = {"select": 0, "add": 0}  # a plain loop: torch.compile traces it
        for p in self.parts:
            if p.role in dims:
                dims[p.role] = max(dims[p.role], p._dense_dims(shape))

        def narrowed(t: Optional[torch.Tensor], n: int) -> Optional[torch.Tensor]:
            return None if t is None else t.reshape(t.shape[4 - n:])

        return MaskTensors(narrowed(built.keep, dims["select"]), narrowed(built.bias, dims["add"]))

    def row_intervals(self, shape: Shape) -> Optional[list[tuple[torch.Tensor, torch.Tensor]]]:
        """The keys the structural parts (causal, window, documents, chunked_local) leave each
        query row of ``shape`` = (B, H, Lq, Lk), as a union of intervals ``[lo, hi)``: a list of
        (lo, hi), each (B|1, Lq) int64 (ends may lie outside [0, Lk)); None without such a part.
        `interval_cover` reads them per key block."""
        lq, lk = tuple(shape)[-2:]
        return _intervals(self.parts, _Rows(_documents_of(self.parts), 0, lq, lq, lk))

    def row_diagonals(self, shape: Shape, align: str) -> torch.Tensor:
        """The key each query row of ``shape`` = (B, H, Lq, Lk) has on its diagonal, (B|1, Lq)
        int64, per document (the whole sequence without a documents part); ``align``
        "bottom_right" or "top_left", as causal's."""
        lq, lk = tuple(shape)[-2:]
        return _Rows(_documents_of(self.parts), 0, lq, lq, lk).diagonal(align)

    def key_span(self, q0: int, q1: int, lq: int, lk: int) -> tuple[int, int]:
        """Keys ``[lo, hi)`` that queries ``q0 .. q1-1`` may see at most (``lo >= hi``: none).

        The hull of what causal, window, documents and chunked_local leave the rows (and a block
        plan given with `with_plan`, for its lengths); a tensor part or a mask_mod may hide more
        keys inside it, which `tile_state` and `block` tell.
        """
        lo, hi = 0, lk
        if q1 <= q0:
            return 0, 0
        parts = self.parts
        doc = _documents_of(parts)
        ends = _from_ends(parts, doc, q0, q1, 0, lk, lq, lk) if any(p.is_structural for p in parts) else None
        ivs = None if ends is not None else _intervals(parts, _Rows(doc, q0, q1, lq, lk))
        if ends is not None:
            lo, hi = ends[1], ends[2]
        elif ivs is not None:
            big = lk + 1
            los = [torch.where(h > l, l, big).min() for l, h in ivs]
            his = [torch.where(h > l, h, -1).max() for l, h in ivs]
            lo, hi = max(int(torch.stack(los).min()), 0), min(int(torch.stack(his).max()), lk)
            if hi <= 0:
                return 0, 0
        plan = self.plan
        if plan is not None and plan.shape[-2:] == (lq, lk):  # `check` holds B and H to the plan's
            plo, phi = plan.key_span(q0, q1)
            lo, hi = max(lo, plo), min(hi, phi)
        return (lo, hi) if lo < hi else (0, 0)

    def tile_state(
        self, q0: int, q1: int, k0: int, k1: int, shape: Shape, *, device: Optional[torch.device] = None
    ) -> str:
        """``"empty"`` (no query of the tile sees any of its keys, in any batch row or head),
        ``"full"`` (every one sees every one) or ``"partial"``, for the selecting parts only:
        biases and score mods still apply to a full tile (through `block` and `apply_block`).

        The tile is queries q0 .. q1-1 x keys k0 .. k1-1 of ``shape`` = (B, H, Lq, Lk). A mask
        with a plan of this shape answers from it (exactly for tiles on its grid, else as the
        blocks the tile meets allow); otherwise structural parts answer exactly per row, tensor
        parts from their tile, a mask_mod from its own plan.
        """
        shape = tuple(shape)
        if q1 <= q0 or k1 <= k0:
            return "empty"
        plan = self.plan
        if plan is not None and plan.shape == shape:
            return plan.tile_state(q0, q1, k0, k1)
        lq, lk = shape[-2:]
        parts = self.parts
        doc = _documents_of(parts)
        dev = doc.q_ids.device if doc is not None else (device or torch.device("cpu"))
        full = True
        ivs = None
        if any(p.is_structural for p in parts):
            ends = _from_ends(parts, doc, q0, q1, k0, k1, lq, lk)
            if ends is not None and ends[0] == _EMPTY:
                return "empty"
            if ends is None or ends[0] == _PARTIAL:  # exact, row by row
                ivs = _intervals(parts, _Rows(doc, q0, q1, lq, lk))
        if ivs is not None:
            seen, covered = interval_cover(ivs, k0, k1)
            if not bool(seen.any()):
                return "empty"
            full = bool(covered.all())
        for part in parts:
            if part.is_structural:
                continue
            state = part._tile_state(q0, q1, k0, k1, shape, dev)
            if state == _EMPTY:
                return "empty"
            full = full and state == _FULL
        return "full" if full else "partial"

    def block(
        self, q0: int, q1: int, k0: int, k1: int, shape: Shape, *, device: torch.device, dtype: torch.dtype,
        whole: bool = False,
    ) -> MaskTensors:
        """The mask of the tile queries ``q0 .. q1-1`` x keys ``k0 .. k1-1`` of ``shape`` = (B, H, Lq, Lk).

        ``keep`` and ``bias`` are 4-D, broadcastable to (B, H, q1-q0, k1-k0), or None when no
        part restricts the tile (structural parts that allow all of it build nothing, nor does
        anything selecting on a tile a plan says is full). Tensor parts are sliced, not copied;
        only the tile's own grids are built (a mask_mod is evaluated on the tile's indices).
        ``whole=True``: the caller knows the selecting parts show the whole tile (`tile_state`
        said "full"), so no part whose role is "select" is evaluated and ``keep`` is None; the
        parts that add still see the rows' documents (ALiBi aligns per document).
        """
        shape = tuple(shape)
        plan = self.plan
        full = whole or (plan is not None and plan.shape == shape and plan.tile_state(q0, q1, k0, k1) == "full")
        return self._tiles(q0, q1, k0, k1, shape, device=device, dtype=dtype, full=full)

    def _tiles(
        self, q0: int, q1: int, k0: int, k1: int, shape: tuple[int, ...], *, device: torch.device,
        dtype: torch.dtype, full: bool = False, dense: bool = False,
    ) -> MaskTensors:
        """The one build path: every part's tensors of one tile, 4-D. ``full``: the selecting
        parts are known to show the whole tile (none is evaluated); ``dense``: the structural
        parts build their keep even where it allows every key (`materialize`)."""
        lq, lk = shape[-2:]
        parts = self.parts
        doc = _documents_of(parts)
        rows: Optional[_Rows] = None
        keep_t: Optional[torch.Tensor] = None
        bias_t: Optional[torch.Tensor] = None
        if not full and any(p.is_structural for p in parts):
            ends = None if dense else _from_ends(parts, doc, q0, q1, k0, k1, lq, lk)
            if ends is not None and ends[0] == _EMPTY:
                keep_t = torch.zeros(1, 1, q1 - q0, k1 - k0, dtype=torch.bool, device=device)
            elif ends is None or ends[0] == _PARTIAL:
                rows = _Rows(doc, q0, q1, lq, lk)
                ivs = _intervals(parts, rows)
                assert ivs is not None
                keep_t = _interval_keep(ivs, k0, k1, device)
        for part in parts:
            if part.is_structural:
                continue
            if full and part.role == "select":
                continue
            if rows is None and part.needs_rows:
                rows = _Rows(doc, q0, q1, lq, lk)
            k, b = part._build_block(q0, q1, k0, k1, shape, device=device, dtype=dtype, rows=rows)
            if k is not None and not full:
                keep_t = k if keep_t is None else keep_t & k
            if b is not None:
                bias_t = b if bias_t is None else bias_t + b
        return MaskTensors(keep_t, bias_t)

    def dense_shape(self, shape: Shape) -> tuple[int, ...]:
        """Shape of the tensor `materialize` would build for ``shape`` = (B, H, Lq, Lk),
        computed without building it: a causal or window part alone is (Lq, Lk)."""
        shape = tuple(shape)
        shapes = [part._dense_shape(shape) for part in self.parts]
        return tuple(torch.broadcast_shapes(*shapes))  # type: ignore[no-untyped-call]  # torch leaves it unannotated

    def check(self, shape: Shape, device: torch.device, name: str = "mask", *, dtype: Optional[torch.dtype] = None) -> None:
        """Raise ValueError/TypeError when this mask cannot apply to ``shape`` = (B, H, Lq, Lk)
        on ``device`` with inputs of ``dtype`` (mask_mod and score_mod functions are tried once
        on a small tile; float32 scores when ``dtype`` is not given)."""
        shape = tuple(shape)
        for part in self.parts:
            part._check(shape, device, name)
        probe = torch.float32 if dtype is None else (torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype)
        for part in self.parts:
            part._probe(shape, device, probe, name)
        plan = self.plan
        if plan is not None and plan.shape != shape:
            raise ValueError(
                f"{name} carries a block plan made for (B, H, Lq, Lk) = {plan.shape}, but the call is {shape}; "
                "make one for this shape with masks.block_plan(mask, shape) or drop it"
            )

    # -- for leaves
    def _intervals(self, rows: "_AnyRows") -> _Intervals:  # pragma: no cover - structural parts only
        """For structural parts: the key intervals each row (a `_Rows`, or one `_Row`) may see."""
        raise NotImplementedError

    def _check(self, shape: Shape, device: torch.device, name: str) -> None:
        return None

    def _probe(self, shape: Shape, device: torch.device, dtype: torch.dtype, name: str) -> None:
        """For function parts: try the function once on a small tile (after every `_check`)."""
        return None

    def _tile_state(self, q0: int, q1: int, k0: int, k1: int, shape: Shape, device: torch.device) -> int:
        """For non-structural parts: _EMPTY, _PARTIAL or _FULL for the selection of one tile."""
        return _FULL

    def _dense_shape(self, shape: Shape) -> tuple[int, ...]:
        tensor = getattr(self, "tensor", None)
        return tuple(shape[-2:]) if tensor is None else tuple(tensor.shape)

    def flex_mod(
        self, mask: "Mask", shape: tuple[int, int, int, int], *, device: torch.device, dtype: torch.dtype
    ) -> Optional[tuple[Callable[..., torch.Tensor], str]]:
        """This part as a FlexAttention function for its role, a ``mask_mod(b, h, q_idx, kv_idx)``
        for "select" or a ``score_mod(score, b, h, q_idx, kv_idx)`` for "add", and the words
        flex's translation says of it; ``mask``: the whole mask (its documents place the rows),
        ``dtype``: the compute dtype. None (the default): flex looks the part's tensor up, and
        a structural part's intervals are looked up for all of them at once."""
        return None

    def _dense_dims(self, shape: Shape) -> int:
        """How many axes this part's own dense tensor has (`materialize` gives that many)."""
        return len(self._dense_shape(shape))

    def _additive_tensor(self, shape: Shape) -> Optional[torch.Tensor]:
        """For a part added to the scores: its float tensor as 4-D (B|1, H|1, Lq|1, Lk|1), else None."""
        return None

    def _build_block(
        self, q0: int, q1: int, k0: int, k1: int, shape: Shape, *, device: torch.device, dtype: torch.dtype,
        rows: Optional[_Rows] = None,
    ) -> _Built:  # pragma: no cover - abstract
        """For non-structural parts: (keep, bias) of the tile queries q0.. x keys k0.., each 4-D
        (broadcastable to (B, H, q1-q0, k1-k0)) or None; ``rows``: the tile's rows (given when
        the kind sets ``needs_rows``)."""
        raise NotImplementedError

class AllOf(Mask):
    """Conjunction of masks built with ``&`` (and a mask given a block plan)."""

    kind: ClassVar[str] = "all"

    def __init__(self, parts: Sequence[Mask], plan: Optional["BlockPlan"] = None):
        self._parts = tuple(parts)
        for kind, fix in dict.fromkeys((p.kind, p.one_per_mask) for p in self._parts if p.one_per_mask):
            found = [p for p in self._parts if p.kind == kind]
            if len(found) > 1:
                raise ValueError(
                    f"a mask may have one {kind} part, got {len(found)}: {' & '.join(map(repr, found))}; {fix}"
                )
        self.plan = plan

    @property
    def parts(self) -> tuple[Mask, ...]:
        return self._parts

    def __repr__(self) -> str:
        text = " & ".join(repr(p) for p in self._parts)
        return text if self.plan is None else f"({text}).with_plan({self.plan!r})"

MaskLike = Union[Mask, torch.Tensor, None]
"""What ``mask=`` takes everywhere (the type of that argument): a mask of this module, a bool
tensor (True = may attend, as `keep`), a float tensor (added to the scores, as `bias`), or None."""

def as_4d(t: torch.Tensor) -> torch.Tensor:
    """``t`` (broadcastable to (B, H, Lq, Lk)) as a 4-D view: leading size-1 axes added (a view
    whatever its strides, so that writing into it writes into ``t``).

    >>> as_4d(torch.ones(3, 5)).shape
    torch.Size([1, 1, 3, 5])
    """
    return t if t.dim() == 4 else t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))


@overload
def tile_of(t: torch.Tensor, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor: ...
@overload
def tile_of(t: None, q0: int, q1: int, k0: int, k1: int) -> None: ...


def tile_of(t: Optional[torch.Tensor], q0: int, q1: int, k0: int, k1: int) -> Optional[torch.Tensor]:
    """4-D view of ``t`` (broadcastable to (B, H, Lq, Lk)) restricted to the tile of queries
    q0 .. q1-1 x keys k0 .. k1-1: a size-1 (broadcast) query or key axis stays size 1, a
    full-size axis is sliced. A view, no copy; None stays None.

    >>> tile_of(torch.arange(12).view(3, 4), 1, 3, 2, 4).tolist()
    [[[[6, 7], [10, 11]]]]
    """
    if t is None:
        return None
    t = as_4d(t)
    rows = slice(None) if t.shape[-2] == 1 else slice(q0, q1)
    cols = slice(None) if t.shape[-1] == 1 else slice(k0, k1)
    return t[:, :, rows, cols]

def _check_in_range(largest: float, dtype: torch.dtype, what: str) -> None:
    """ValueError when a part's largest finite magnitude overflows the scores' ``dtype`` (it would
    turn into inf there, and inf times a distance of 0 into NaN)."""
    if largest > torch.finfo(dtype).max:
        raise ValueError(
            f"{what} reach {largest:g}, past the largest {dtype} ({torch.finfo(dtype).max:g}) the scores are "
            "computed in; give smaller values"
        )

def _check_count(value: object, name: str, *, minimum: int, allow_none: bool = False) -> Optional[int]:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int{' or None' if allow_none else ''}, got {type(value).__name__}")
    if int(value) < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)

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


def _state_of(t: torch.Tensor) -> int:
    """The selection state of a bool tile."""
    if not bool(t.any()):
        return _EMPTY
    return _FULL if bool(t.all()) else _PARTIAL

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

    def _build_block(
        self, q0: int, q1: int, k0: int, k1: int, shape: Shape, *, device: torch.device, dtype: torch.dtype,
        rows: Optional[_Rows] = None,
    ) -> _Built:
        return tile_of(self.tensor, q0, q1, k0, k1), None

    def _check(self, shape: Shape, device: torch.device, name: str) -> None:
        _check_broadcast(self.tensor, shape, device, name, "keep mask")

    def _tile_state(self, q0: int, q1: int, k0: int, k1: int, shape: Shape, device: torch.device) -> int:
        return _state_of(tile_of(self.tensor, q0, q1, k0, k1))

    def __repr__(self) -> str:
        return f"keep(shape={tuple(self.tensor.shape)})"


class Bias(Mask):
    """A float tensor broadcastable to (B, H, Lq, Lk), added to the scaled scores.

    A ``-inf`` entry blocks that key like a False in a keep mask.
    """

    kind: ClassVar[str] = "bias"
    role = "add"

    def __init__(self, t: torch.Tensor):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"bias() takes a float torch.Tensor, got {type(t).__name__}; use torch.as_tensor")
        if not t.is_floating_point():
            raise TypeError(
                f"bias() takes a floating tensor added to the scores, got {t.dtype}; "
                "use masks.keep() for a boolean mask"
            )
        self.tensor = t

    def _build_block(
        self, q0: int, q1: int, k0: int, k1: int, shape: Shape, *, device: torch.device, dtype: torch.dtype,
        rows: Optional[_Rows] = None,
    ) -> _Built:
        return None, tile_of(self.tensor, q0, q1, k0, k1).to(dtype)

    def _additive_tensor(self, shape: Shape) -> Optional[torch.Tensor]:
        return as_4d(self.tensor)

    def _check(self, shape: Shape, device: torch.device, name: str) -> None:
        _check_broadcast(self.tensor, shape, device, name, "bias")

    def __repr__(self) -> str:
        return f"bias(shape={tuple(self.tensor.shape)})"

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

@dataclass(frozen=True, eq=False)
class BlockPlan:
    """Which tiles of a grid of ``block_q`` x ``block_k`` a mask leaves empty, full or partial,
    for calls of ``shape`` = (B, H, Lq, Lk): ``states`` (B|1, H|1, nq, nk) uint8, 0 empty,
    1 partial, 2 full (FlexAttention's ``BlockMask`` keeps the same facts as index lists).
    Make one with `block_plan`; give it to a mask with `Mask.with_plan`."""

    shape: tuple[int, int, int, int]
    block_q: int
    block_k: int
    states: torch.Tensor

    def tile_state(self, q0: int, q1: int, k0: int, k1: int) -> str:
        """The state of any tile, from the grid blocks it meets: empty or full when all of them
        are, else partial (exact for tiles on the grid)."""
        qa, qb = q0 // self.block_q, -(-q1 // self.block_q)
        ka, kb = k0 // self.block_k, -(-k1 // self.block_k)
        sub = self.states[..., qa:qb, ka:kb]
        if sub.numel() == 0 or bool((sub == _EMPTY).all()):
            return "empty"
        return "full" if bool((sub == _FULL).all()) else "partial"

    def key_span(self, q0: int, q1: int) -> tuple[int, int]:
        """The keys of the grid blocks some query of q0 .. q1-1 may see: ``[lo, hi)``, (0, 0) when none."""
        qa, qb = q0 // self.block_q, -(-q1 // self.block_q)
        seen = (self.states[..., qa:qb, :] != _EMPTY).flatten(0, -2).any(dim=0).nonzero()
        if seen.numel() == 0:
            return 0, 0
        return int(seen[0, 0]) * self.block_k, min(self.shape[3], (int(seen[-1, 0]) + 1) * self.block_k)

    def counts(self) -> dict[str, int]:
        """How many (batch row, head, tile) entries are empty, partial and full."""
        return {name: int((self.states == i).sum()) for i, name in enumerate(TILE_STATES)}

    def __repr__(self) -> str:
        c = self.counts()
        return (f"BlockPlan(shape={self.shape}, blocks={self.block_q}x{self.block_k}, "
                f"{c['empty']} empty, {c['partial']} partial, {c['full']} full)")
