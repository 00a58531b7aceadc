"""The structural kinds: which keys each query row may see, as key intervals per row.

Each kind sits beside its constructor: `causal`, `window` (with StreamingLLM's sink tokens),
`chunked_local`, and `documents` (with `from_seqlens` and `from_cu_seqlens`, its constructors
from lengths). A structural kind has the role "select", sets ``is_structural`` and writes one
method, ``_intervals(rows)``: the rows' key intervals from their diagonal (`geometry`); kernels
read whole tiles, row spans and flex's lookups from that alone.

Legend: B batch, L tokens, Lq/Lk query/key lengths.
"""

from __future__ import annotations

import itertools
import numbers
from typing import ClassVar, Optional, Sequence, Union

import torch

from .core import Mask, Shape, _check_count
from .geometry import UNLIMITED, _AnyRows, _check_align, _Intervals, minimum

#: the most tokens one packed row may describe (`from_seqlens`, `from_cu_seqlens`): beyond any
#: call that fits in memory
MAX_TOKENS = 2**31

class Causal(Mask):
    """Query i sees key j when ``j <= d_i``, d_i its diagonal key (see the module docstring)."""

    kind: ClassVar[str] = "causal"
    is_structural: ClassVar[bool] = True

    def __init__(self, align: str = "bottom_right"):
        self.align = _check_align(align)

    def _intervals(self, rows: "_AnyRows") -> _Intervals:
        d = rows.diagonal(self.align)
        return [(d * 0, d + 1)]

    def __repr__(self) -> str:
        return f"causal(align={self.align!r})"

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

class Window(Mask):
    """Query i sees keys ``d_i-left ... d_i+right`` inclusive (local attention), and with
    ``sinks=n`` also the first n keys of its document up to ``d_i+right``."""

    kind: ClassVar[str] = "window"
    is_structural: ClassVar[bool] = True

    def __init__(self, left: Optional[int], right: Optional[int] = 0, align: str = "bottom_right", sinks: int = 0):
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
        count = _check_count(sinks, "window sinks", minimum=0)  # the first keys kept visible
        self.align: str = _check_align(align)
        self.left: Optional[int] = None if left is None or int(left) >= UNLIMITED else int(left)
        self.right: Optional[int] = None if right is None or int(right) >= UNLIMITED else int(right)
        self.sinks: int = min(count or 0, UNLIMITED)

    def _intervals(self, rows: "_AnyRows") -> _Intervals:
        d = rows.diagonal(self.align)
        lo = d * 0 if self.left is None else d - self.left
        hi = d * 0 + rows.lk if self.right is None else d + self.right + 1
        out = [(lo, hi)]
        if self.sinks:
            start = rows.ks + d * 0
            out.append((start, minimum(start + self.sinks, hi)))
        return out

    def __repr__(self) -> str:
        sinks = f", sinks={self.sinks}" if self.sinks else ""
        return f"window(left={self.left}, right={self.right}, align={self.align!r}{sinks})"

def window(left: Optional[int], right: Optional[int] = 0, *, align: str = "bottom_right", sinks: int = 0) -> Mask:
    """Local attention: query i sees keys i-left ... i+right (aligned like `causal`).

    ``window(w)`` is a causal sliding window of w past keys plus the query's own position;
    ``None`` on a side means unlimited, and so does any count from `UNLIMITED` (2**62) on, such
    as ``sys.maxsize``. ``sinks=n`` keeps the first n keys (of the sequence, or
    of the document) visible too, up to i+right (StreamingLLM's attention sinks).

    >>> import torch
    >>> from multihead import masks
    >>> t = masks.window(1).materialize((1, 1, 4, 4), device=torch.device("cpu"), dtype=torch.float32)
    >>> t.keep.int().tolist()                          # each query: its previous key and itself
    [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    >>> s = masks.window(1, sinks=1).materialize((1, 1, 4, 4), device=torch.device("cpu"), dtype=torch.float32)
    >>> s.keep.int().tolist()                          # and key 0, the sink token
    [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 1, 1]]
    """
    return Window(left, right, align, sinks)

class ChunkedLocal(Mask):
    """Query i sees the keys of its chunk: ``chunk`` keys from the start of the document (or the
    sequence), the chunk that holds d_i. Not causal by itself: Llama 4's chunked attention is
    ``causal() & chunked_local(chunk)``."""

    kind: ClassVar[str] = "chunked_local"
    is_structural: ClassVar[bool] = True

    def __init__(self, chunk: int, align: str = "bottom_right"):
        c = _check_count(chunk, "chunked_local chunk", minimum=1)
        assert c is not None
        self.chunk = min(c, UNLIMITED)  # a chunk past any length: the whole sequence (or document)
        self.align = _check_align(align)

    def _intervals(self, rows: "_AnyRows") -> _Intervals:
        d = rows.diagonal(self.align)
        start = rows.ks + (d - rows.ks) // self.chunk * self.chunk  # floor division, also for tensors
        return [(start, start + self.chunk)]

    def __repr__(self) -> str:
        return f"chunked_local({self.chunk}, align={self.align!r})"

def chunked_local(chunk: int, *, align: str = "bottom_right") -> Mask:
    """Each query sees the keys of its own chunk of ``chunk`` positions (counted from the start of
    the document, or the sequence). Llama 4's ``attention_chunk`` layers are
    ``causal() & chunked_local(chunk)``.

    >>> import torch
    >>> from multihead import masks
    >>> m = masks.causal() & masks.chunked_local(2)
    >>> m.materialize((1, 1, 4, 4), device=torch.device("cpu"), dtype=torch.float32).keep.int().tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    """
    return ChunkedLocal(chunk, align)

def _check_ids(t: object, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(
            f"{name} must be an integer torch.Tensor of document ids, (B, L) or (L,), got {type(t).__name__}; "
            "use torch.tensor(ids)"
        )
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(
            f"{name} must hold integer document ids, got {t.dtype}; use ids.long() "
            "(or masks.from_seqlens(lengths) to build them from sequence lengths)"
        )
    if t.dim() not in (1, 2):
        raise ValueError(f"{name} must be (B, L) or (L,), got shape {tuple(t.shape)}")
    t = t.long()
    return t.unsqueeze(0) if t.dim() == 1 else t


def _runs(ids: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Start and end (B, L) of the run of equal ids each token is in; ValueError when one
    document (id >= 0) is split into several runs."""
    B, L = ids.shape
    pos = torch.arange(L, device=ids.device).expand(B, L)
    first = torch.ones(B, L, dtype=torch.bool, device=ids.device)
    last = torch.ones(B, L, dtype=torch.bool, device=ids.device)
    if L > 1:
        first[:, 1:] = ids[:, 1:] != ids[:, :-1]
        last[:, :-1] = first[:, 1:]
    start = torch.where(first, pos, 0).cummax(dim=1).values
    end = torch.where(last, pos + 1, L).flip(1).cummin(dim=1).values.flip(1)
    if L:
        runs = (first & (ids >= 0)).sum(dim=1)
        ordered = ids.sort(dim=1).values
        distinct = (ordered[:, :1] >= 0).sum(dim=1) + ((ordered[:, 1:] != ordered[:, :-1]) & (ordered[:, 1:] >= 0)).sum(dim=1)
        bad = (runs != distinct).nonzero()
        if bad.numel():
            b = int(bad[0, 0])
            raise ValueError(
                f"{name}: each document's tokens must be one contiguous run, but row {b} splits a document "
                f"into several ({int(runs[b])} runs of {int(distinct[b])} ids); give each run its own id "
                "(padding tokens: any id < 0)"
            )
    return start, end


class Documents(Mask):
    """Packed sequences: query i sees key j only when both are in the same document (the same id
    >= 0). See the module docstring for ids, padding and per-document alignment."""

    kind: ClassVar[str] = "documents"
    is_structural: ClassVar[bool] = True
    places_rows: ClassVar[bool] = True
    one_per_mask: ClassVar[Optional[str]] = "give every token one id in a single masks.documents(...)"

    def __init__(self, q_ids: torch.Tensor, kv_ids: Optional[torch.Tensor] = None, *, source: str = "ids",
                 lengths: Optional[tuple[tuple[int, ...], tuple[int, ...]]] = None):
        # the mask keeps its own copy of the ids: its geometry is computed from them once, and every
        # backend reads that, so a later in-place change of the caller's ids changes nothing here
        self.q_ids = _check_ids(q_ids, "documents q_ids" if kv_ids is not None else "documents ids").clone()
        self.kv_ids = self.q_ids if kv_ids is None else _check_ids(kv_ids, "documents kv_ids").clone()
        if self.kv_ids.device != self.q_ids.device:
            raise ValueError(f"documents kv_ids are on {self.kv_ids.device} but q_ids on {self.q_ids.device}; move them together")
        bq, bk = self.q_ids.shape[0], self.kv_ids.shape[0]
        if bq != bk and 1 not in (bq, bk):
            raise ValueError(f"documents q_ids have batch {bq} and kv_ids batch {bk}; they must match or be 1")
        self.source = source
        self.lengths = lengths
        self._qs, self._qe = _runs(self.q_ids, "documents q_ids" if kv_ids is not None else "documents ids")
        if kv_ids is None:
            valid = self.q_ids >= 0
            self._ks, self._ke = self._qs, self._qe
        else:
            _runs(self.kv_ids, "documents kv_ids")
            B, lk = max(bq, bk), self.kv_ids.shape[1]
            qi = self.q_ids.expand(B, -1).contiguous()
            ordered, perm = self.kv_ids.expand(B, -1).sort(dim=1, stable=True)
            left = torch.searchsorted(ordered, qi, right=False)
            count = torch.searchsorted(ordered, qi, right=True) - left
            valid = (count > 0) & (qi >= 0)
            start = perm.gather(1, left.clamp(max=max(lk - 1, 0))) if lk else torch.zeros_like(qi)
            self._ks, self._ke = start, start + count
            self._qs, self._qe = self._qs.expand(B, -1), self._qe.expand(B, -1)
        zero = torch.zeros_like(self._ks)
        self._ks = torch.where(valid, self._ks, zero)
        self._ke = torch.where(valid, self._ke, zero)
        self._table: Optional[list[list[tuple[int, ...]]]] = None

    @property
    def device(self) -> torch.device:
        return self.q_ids.device

    def geometry(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per query token (B|1, Lq): its document's first and end query, first and end key."""
        return self._qs, self._qe, self._ks, self._ke

    def _intervals(self, rows: "_AnyRows") -> _Intervals:
        return [(rows.ks, rows.ke)]

    def rows_at(self, i: int, j: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Per batch row: the (qs, qe, ks, ke) of query rows i and j, as ints (a host copy of
        `geometry`, made on first use)."""
        if self._table is None:
            both = torch.stack(torch.broadcast_tensors(*self.geometry()), dim=-1)  # type: ignore[no-untyped-call]
            self._table = [[tuple(x) for x in row] for row in both.tolist()]
        return [(row[i], row[j]) for row in self._table]

    def _dense_shape(self, shape: Shape) -> tuple[int, ...]:
        b = self._ks.shape[0]
        return tuple(shape[-2:]) if b == 1 else (b, 1, shape[-2], shape[-1])

    def _check(self, shape: Shape, device: torch.device, name: str) -> None:
        batch, _, lq, lk = shape
        if self.q_ids.device != device:
            raise ValueError(
                f"{name} (documents) is on {self.q_ids.device} but the query is on {device}; "
                f"build it from ids on {str(device)!r} (from_seqlens/from_cu_seqlens: device={str(device)!r})"
            )
        for ids, length, side in ((self.q_ids, lq, "Lq"), (self.kv_ids, lk, "Lk")):
            if ids.shape[0] not in (1, batch):
                raise ValueError(
                    f"{name} (documents) has ids for batch {ids.shape[0]} but the call has B={batch}; "
                    "give (B, L) ids or (L,) ids shared by the batch"
                )
            if ids.shape[1] != length:
                if self.lengths is not None:
                    got = sum(self.lengths[0] if side == "Lq" else self.lengths[1])
                    raise ValueError(
                        f"{name} ({self.source}) lengths sum to {got} but the call has {side}={length} tokens; "
                        f"the lengths of the packed documents must sum to {side}"
                    )
                raise ValueError(
                    f"{name} (documents) has {ids.shape[1]} ids per row but the call has {side}={length}; "
                    "give one id per token"
                )

    def __repr__(self) -> str:
        if self.lengths is not None:
            q, k = self.lengths
            if self.source == "seqlens":
                return "from_seqlens(" + str(list(q)) + ("" if k == q else f", kv_lengths={list(k)}") + ")"
            cu_q, cu_k = ([0, *itertools.accumulate(x)] for x in (q, k))
            return "from_cu_seqlens(" + str(cu_q) + ("" if k == q else f", cu_seqlens_k={cu_k}") + ")"
        shapes = f"q_ids {tuple(self.q_ids.shape)}" + ("" if self.kv_ids is self.q_ids else f", kv_ids {tuple(self.kv_ids.shape)}")
        return f"documents({shapes})"

def documents(ids: torch.Tensor, kv_ids: Optional[torch.Tensor] = None) -> Mask:
    """Packed sequences: a query sees only keys of its own document. ``ids`` (B, L) or (L,)
    integer document ids, one per token, each document one contiguous run (ids < 0: padding);
    ``kv_ids`` the keys' ids when they differ from the queries' (a cache, cross attention).

    Causal, window, chunked_local and alibi parts align per document (module docstring).

    >>> import torch
    >>> from multihead import masks
    >>> m = masks.documents(torch.tensor([0, 0, 1, 1, 1])) & masks.causal()
    >>> m.materialize((1, 1, 5, 5), device=torch.device("cpu"), dtype=torch.float32).keep.int().tolist()
    [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]
    """
    return Documents(ids, kv_ids)

def _check_lengths(lengths: object, name: str) -> tuple[int, ...]:
    if isinstance(lengths, torch.Tensor):
        if lengths.is_floating_point() or lengths.dtype == torch.bool or lengths.dim() != 1:
            raise TypeError(f"{name} must be a 1-D integer tensor or a sequence of ints, got {lengths.dtype} of shape {tuple(lengths.shape)}")
        values = [int(x) for x in lengths.tolist()]
    elif isinstance(lengths, Sequence) and not isinstance(lengths, (str, bytes)):
        for x in lengths:
            if isinstance(x, bool) or not isinstance(x, numbers.Integral):
                raise TypeError(f"{name} must hold ints, got {type(x).__name__}")
        values = [int(x) for x in lengths]
    else:
        raise TypeError(f"{name} must be a sequence of ints or a 1-D integer tensor, got {type(lengths).__name__}")
    if any(x < 0 for x in values):
        raise ValueError(f"{name} must be >= 0, got {values}")
    total = max(values, default=0) if "cu_seqlens" in name else sum(values)  # running sums end at the total
    if total > MAX_TOKENS:
        raise ValueError(f"{name} describe more than {MAX_TOKENS} tokens in one packed row (got {values}); "
                         "no call holds that many: give the documents' real lengths")
    return tuple(values)


def _ids_from_lengths(lengths: tuple[int, ...], device: Optional[torch.device]) -> torch.Tensor:
    counts = torch.tensor(lengths, dtype=torch.int64, device=device)
    return torch.repeat_interleave(torch.arange(len(lengths), device=device), counts)


def from_seqlens(
    lengths: Union[Sequence[int], torch.Tensor], kv_lengths: Union[Sequence[int], torch.Tensor, None] = None,
    *, device: Optional[torch.device] = None,
) -> Mask:
    """Packed sequences from their lengths (xFormers' ``BlockDiagonalMask.from_seqlens``): the
    documents of ``lengths`` tokens one after the other, summing to L (and ``kv_lengths`` for the
    keys, summing to Lk, when they differ). The same mask as `documents` of the ids
    0, 0, ..., 1, 1, ... on ``device`` (default: the lengths' device, or cpu).

    >>> from multihead import masks
    >>> masks.from_seqlens([2, 3])
    from_seqlens([2, 3])
    """
    q = _check_lengths(lengths, "from_seqlens lengths")
    k = q if kv_lengths is None else _check_lengths(kv_lengths, "from_seqlens kv_lengths")
    if len(k) != len(q):
        raise ValueError(f"from_seqlens kv_lengths has {len(k)} documents but lengths has {len(q)}; give one length per document")
    dev = device if device is not None else (lengths.device if isinstance(lengths, torch.Tensor) else None)
    q_ids = _ids_from_lengths(q, dev)
    return Documents(q_ids, None if kv_lengths is None else _ids_from_lengths(k, dev), source="seqlens", lengths=(q, k))


def _lengths_from_cu(cu: object, name: str) -> tuple[int, ...]:
    values = _check_lengths(cu, name)
    if not values or values[0] != 0:
        raise ValueError(f"{name} must start at 0 (flash-attn's cu_seqlens: 0, then the running sums), got {list(values)}")
    diffs = tuple(b - a for a, b in zip(values, values[1:]))
    if any(d < 0 for d in diffs):
        raise ValueError(f"{name} must not decrease, got {list(values)}")
    return diffs


def from_cu_seqlens(
    cu_seqlens: Union[Sequence[int], torch.Tensor], cu_seqlens_k: Union[Sequence[int], torch.Tensor, None] = None,
    *, device: Optional[torch.device] = None,
) -> Mask:
    """Packed sequences from flash-attn's varlen ``cu_seqlens`` (0, then the running sums of the
    lengths; ``cu_seqlens_k`` for the keys). The same mask as `from_seqlens` of the differences.

    >>> from multihead import masks
    >>> masks.from_cu_seqlens([0, 2, 5])
    from_cu_seqlens([0, 2, 5])
    """
    q = _lengths_from_cu(cu_seqlens, "from_cu_seqlens cu_seqlens")
    k = q if cu_seqlens_k is None else _lengths_from_cu(cu_seqlens_k, "from_cu_seqlens cu_seqlens_k")
    if len(k) != len(q):
        raise ValueError(f"from_cu_seqlens cu_seqlens_k has {len(k)} documents but cu_seqlens has {len(q)}")
    dev = device if device is not None else (cu_seqlens.device if isinstance(cu_seqlens, torch.Tensor) else None)
    q_ids = _ids_from_lengths(q, dev)
    return Documents(q_ids, None if cu_seqlens_k is None else _ids_from_lengths(k, dev), source="cu_seqlens", lengths=(q, k))
