"""Rows, diagonals and key intervals: the arithmetic every structural kind and kernel shares.

A query row i has a diagonal key d_i (``align``: bottom-right puts the last query on the last
key, top-left the first on the first; per document with a documents part). A structural kind
says which keys a row may see as a union of intervals ``[lo, hi)`` of key indices; this file
combines them (``&`` is the intersection), reads them per tile (`interval_cover`, `_from_ends`)
and turns them into a keep tensor (`_interval_keep`). No mask class lives here.

Legend: B batch, Lq/Lk query/key lengths, n a tile's query rows, bk its keys.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence, Union

import torch

ALIGNMENTS = ("bottom_right", "top_left")
#: what `Mask.tile_state` answers
TILE_STATES = ("empty", "partial", "full")
#: the states as numbers, in that order (a `BlockPlan`'s ``states`` holds them)
_EMPTY, _PARTIAL, _FULL = 0, 1, 2

#: an interval end: (B|1, n) int64 for the rows of a tile, or an int for one row
_End = Any
#: per-query key intervals [lo, hi): the union of them is what a row may see
_Intervals = list[tuple[_End, _End]]

#: a count of keys at or past this is more than any call holds: window sides this long mean
#: unlimited (``sys.maxsize`` is a common way to say so), and chunks and sink counts are held
#: to it, so that the int64 arithmetic of the intervals (d_i + right + 1, ...) cannot wrap
UNLIMITED = 2**62


def _check_align(align: object) -> str:
    if align not in ALIGNMENTS:
        raise ValueError(f"align must be one of {ALIGNMENTS}, got {align!r}")
    return str(align)


class _DocumentRows(Protocol):
    """What the rows read from a documents part (`structural.Documents`)."""

    q_ids: torch.Tensor

    def geometry(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def rows_at(self, i: int, j: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]: ...


class _Structural(Protocol):
    """A part that selects by key intervals (``is_structural``)."""

    @property
    def is_structural(self) -> bool: ...

    def _intervals(self, rows: "_AnyRows") -> _Intervals: ...

class _Rows:
    """Query rows q0 .. q1-1 of a call and where their documents lie (the whole sequence
    without a documents part): ``qs``/``qe`` the document's first and end query, ``ks``/``ke``
    its first and end key, each (B|1, n) int64; ``i`` the rows' indices (1, n). On the host
    without documents, else on the documents' device."""

    def __init__(self, doc: Optional[_DocumentRows], q0: int, q1: int, lq: int, lk: int):
        self.lk = lk
        if doc is None:  # known on the host: the tile's decisions read no device memory
            self.i = torch.arange(q0, q1).unsqueeze(0)
            zero = torch.zeros(1, 1, dtype=torch.int64)
            self.qs, self.qe, self.ks, self.ke = zero, zero + lq, zero, zero + lk
        else:
            self.i = torch.arange(q0, q1, device=doc.q_ids.device).unsqueeze(0)
            self.qs, self.qe, self.ks, self.ke = (t[:, q0:q1] for t in doc.geometry())

    def diagonal(self, align: str) -> torch.Tensor:
        """The key each row's diagonal sits on (B|1, n), per document."""
        if align == "bottom_right":
            return self.i + (self.ke - self.qe)
        return self.i + (self.ks - self.qs)


class _Row:
    """One query row ``i`` as plain ints, with the attributes of `_Rows`: the structural parts'
    intervals are written once, with operators that work on both."""

    def __init__(self, i: int, qs: int, qe: int, ks: int, ke: int, lk: int):
        self.i, self.qs, self.qe, self.ks, self.ke, self.lk = i, qs, qe, ks, ke, lk

    def diagonal(self, align: str) -> int:
        return self.i + (self.ke - self.qe) if align == "bottom_right" else self.i + (self.ks - self.qs)


def minimum(a: _End, b: _End) -> _End:
    """The smaller interval end, elementwise: for one row's ints or a tile's (B|1, n) tensors."""
    return torch.minimum(a, b) if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) else min(a, b)


def maximum(a: _End, b: _End) -> _End:
    """The larger interval end, elementwise: for one row's ints or a tile's (B|1, n) tensors."""
    return torch.maximum(a, b) if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) else max(a, b)


_AnyRows = Union[_Rows, _Row]


def interval_cover(intervals: Sequence[tuple[torch.Tensor, torch.Tensor]], k0: Union[int, torch.Tensor],
                   k1: Union[int, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(seen, covered)`` of the key block ``[k0, k1)`` by rows' key ``intervals`` (a union, from
    `Mask.row_intervals`, at least one): seen, some key of the block is in it; covered, every
    key is in one interval (a block two intervals cover together counts as not covered: a
    partial tile, which costs a keep mask, never a wrong full one). ``k0``, ``k1``: ints, or
    tensors that broadcast against the ends (e.g. (nk,) against ends with a trailing axis, for
    nk blocks at once)."""
    lo_k, hi_k = torch.as_tensor(k0), torch.as_tensor(k1)
    seen: Optional[torch.Tensor] = None
    covered: Optional[torch.Tensor] = None
    for lo, hi in intervals:
        s = torch.minimum(hi, hi_k) > torch.maximum(lo, lo_k)
        c = (lo <= lo_k) & (hi >= hi_k)
        seen = s if seen is None else seen | s
        covered = c if covered is None else covered | c
    if seen is None or covered is None:
        raise ValueError("interval_cover needs at least one interval")
    return seen, covered

def _intervals(parts: Sequence[_Structural], rows: "_AnyRows") -> Optional[_Intervals]:
    """What the selecting structural parts leave each row (a `_Rows`, or one `_Row`), as a union
    of key intervals (ends may lie outside [0, Lk)), or None when there is no such part."""
    got: Optional[_Intervals] = None
    for p in parts:
        if not p.is_structural:
            continue
        mine = p._intervals(rows)
        if got is None:
            got = mine
        else:
            got = [(maximum(a, c), minimum(b, d)) for a, b in got for c, d in mine]
    return got  # not clamped to [0, Lk): what is compared with keys in [0, Lk) is the same


def _from_ends(parts: Sequence[_Structural], doc: Optional[_DocumentRows], q0: int, q1: int, k0: int, k1: int,
               lq: int, lk: int) -> Optional[tuple[int, int, int]]:
    """``(state, lo, hi)`` of the structural parts for queries q0 .. q1-1 x keys k0 .. k1-1, read
    from the first and the last row alone: _EMPTY or _FULL only when true, else _PARTIAL, and
    a hull [lo, hi) of the keys the rows may see. None when a batch row's queries cross into
    another document (the rows' geometry then jumps; the per-row tensors answer).

    Why the ends suffice: inside one document every part's interval ends are non-decreasing in
    the row (d_i = i + a constant, and so are d_i - left, d_i + right + 1, the chunk start, the
    first sink keys' end), and so are their max and min; hence every row's lo lies between the
    first row's and the last row's, and so does its hi.
    """
    ends = doc.rows_at(q0, q1 - 1) if doc is not None else [((0, lq, 0, lk), (0, lq, 0, lk))]
    full, empty, lo_all, hi_all = True, True, lk, 0
    for first, last in ends:
        if first[0] != last[0]:  # another run of ids starts inside the rows
            return None
        a = _intervals(parts, _Row(q0, first[0], first[1], first[2], first[3], lk))
        z = _intervals(parts, _Row(q1 - 1, last[0], last[1], last[2], last[3], lk))
        assert a is not None and z is not None
        full = full and any(zl <= k0 and ah >= k1 for (_, ah), (zl, _) in zip(a, z))
        empty = empty and all(zh <= k0 or al >= k1 for (al, _), (_, zh) in zip(a, z))
        lo_all = min(lo_all, min(al for al, _ in a))
        hi_all = max(hi_all, max(zh for _, zh in z))
    return (_FULL if full else _EMPTY if empty else _PARTIAL), max(lo_all, 0), min(hi_all, lk)


def _interval_keep(ivs: _Intervals, k0: int, k1: int, device: torch.device) -> torch.Tensor:
    """(B|1, 1, n, k1-k0) keep of one tile."""
    j = torch.arange(k0, k1, device=device)
    keep_t: Optional[torch.Tensor] = None
    for lo, hi in ivs:
        k: torch.Tensor = (j >= lo.unsqueeze(-1).to(device)) & (j < hi.unsqueeze(-1).to(device))
        keep_t = k if keep_t is None else keep_t | k
    assert keep_t is not None
    return keep_t.unsqueeze(1)
