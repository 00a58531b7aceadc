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
structure (causal, a window, documents) is kept until a backend decides how to use it. Masks
compose with ``&``:

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

What one attention call computes with a mask (the parts in the order written with ``&``)::

    s = scale · q kᵀ                                          (B, H, Lq, Lk)
    s = s + (sum of the additive parts: bias tensors, alibi)
    s = mod(s) for each score-mod part in written order       (score_mod, softcap)
    s = -inf wherever a selecting part says False             (causal, window, keep, key_padding,
                                                               documents, chunked_local, mask_mod)
    w_ij = exp(s_ij) / (Σ_j exp(s_ij) + exp(sink_h))          (the sink term only with a sink part)
    out = w v                                                 (a row with no visible key: 0)

The kinds:

=========================  ================  ================================================
constructor                what it does      defined as
=========================  ================  ================================================
`causal`, `window`         selects           ``j <= d_i`` / ``d_i - left <= j <= d_i + right``
                                             with ``d_i`` query i's diagonal key (above)
``window(.., sinks=n)``    selects           the window, plus the first n keys (of the
                                             document) up to ``d_i + right``: StreamingLLM's
                                             sink tokens
`documents`,               selects           same document id (packed sequences; ids < 0 are
`from_seqlens`,                              padding, in no document); causal, window,
`from_cu_seqlens`                            chunked_local and alibi align *per document*
`chunked_local`            selects           keys in the same chunk of ``chunk`` keys as d_i
                                             (Llama 4's ``attention_chunk`` is
                                             ``causal() & chunked_local(chunk)``)
`mask_mod`                 selects           ``fn(b, h, q_idx, kv_idx) -> bool`` (FlexAttention)
`keep`, `key_padding`      selects           bool tensors
`bias`, `alibi`            adds              a float tensor; ``-slope_h · |j - d_i|``
`score_mod`, `softcap`     modifies scores   ``fn(score, b, h, q_idx, kv_idx)``;
                                             ``cap · tanh(s / cap)`` (Gemma 2)
`sink`                     adds to the       a learned logit per head (gpt-oss's ``s_aux``)
                           denominator
=========================  ================  ================================================

Packed sequences. ``documents(ids)`` takes per-token document ids, (B, L) or (L,) integers;
each document's tokens form one contiguous run (any order of runs, any id values; ids below 0
are padding tokens, which see nothing and are seen by no one). ``documents(q_ids, kv_ids)``
gives the queries' and the keys' ids apart (a decode step over a cache of packed documents,
or cross attention). The mask keeps a copy of the ids: changing the given tensor afterwards
changes no mask built from it (build a new one). Within each document, causal/window/chunked_local/alibi place the
diagonal as they do for a whole sequence: bottom-right aligns the document's last query with
its last key (as flash-attn's varlen kernels do per sequence), top-left its first with its first.
When queries and keys are the same tokens this is plain causal attention inside each document,
and the output of every document equals running that document alone.

Programmable masks and scores (FlexAttention's signatures). The index arguments are int64
tensors that broadcast as b (B, 1, 1, 1), h (1, H, 1, 1), q_idx (1, 1, bq, 1), kv_idx
(1, 1, 1, bk): absolute positions in the call, whatever the documents. They are evaluated one
tile at a time (`Mask.block`, `Mask.apply_block`); no (Lq, Lk) tensor is built except by the
backends that materialise the scores anyway (reference, sdpa). Both functions are tried once on
a 2 x 3 tile in `Mask.check` (at the public edge, before any work): a mask_mod must return a
bool tensor broadcastable to (B, H, bq, bk), a score_mod a tensor of the score's shape and
dtype. ``score_mod(fn)`` finds the tensors ``fn`` reads (its closure, defaults and the globals
it names, and the parameters of a module) as `Mask.tensors`, so a kernel can differentiate
into them; pass ``tensors=`` to name them yourself.

Block-wise use (the ``chunked`` backend): `Mask.key_span` says which keys a run of queries
can see at all (the hull of what causal, window, documents, chunked_local and a given plan leave),
so whole blocks outside it are never computed; `Mask.tile_state` says whether one tile is
"empty", "full" or "partial" for the selecting parts (a kernel skips empty tiles and needs no
keep tensor for full ones); `Mask.block` builds the keep and bias tensors of one tile only,
never the full (Lq, Lk) mask, and no keep at all where the selecting parts allow the whole tile.
A mask_mod's tile states come from a `BlockPlan` (like FlexAttention's ``BlockMask``), computed
once per shape from the function and kept on the object, so a mask shared by several layers
plans once; it is made again when a tensor the function reads has changed (compared by value); `block_plan` makes one for any mask and `Mask.with_plan` attaches it.

Details Contract A leaves open, as decided here: index tensors are int64; `Mask.apply_block`
and `Mask.tensors` exist on every mask (all its score mods in written order; nothing without
any); `Mask.tile_state` takes an optional ``device=`` (where a mask_mod plans, default its
captured tensors' device or the CPU) and `Mask.check` an optional ``dtype=`` (the dtype the
score mods are probed in); sink tokens are ``window(left, sinks=n)``; ``chunked_local`` is not
causal by itself; a mask has at most one documents part and one sink part.

Legend: B batch, H query heads, Lq/Lk query/key lengths, bq/bk a tile's query/key counts.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterator, Optional, Sequence, Union, overload

import torch

__all__ = [
    "Mask",
    "MaskLike",
    "MaskTensors",
    "BlockPlan",
    "causal",
    "window",
    "key_padding",
    "keep",
    "bias",
    "documents",
    "from_seqlens",
    "from_cu_seqlens",
    "chunked_local",
    "mask_mod",
    "score_mod",
    "softcap",
    "sink",
    "alibi",
    "alibi_slopes",
    "block_plan",
    "as_mask",
    "from_torch",
    "split_additive",
    "ALIGNMENTS",
    "ROLES",
    "TILE_STATES",
    "UNLIMITED",
]

ALIGNMENTS = ("bottom_right", "top_left")
#: what `Mask.role` answers
ROLES = ("select", "add", "modify", "denominator")
#: what `Mask.tile_state` answers
TILE_STATES = ("empty", "partial", "full")

#: (B, H, Lq, Lk), or any sequence of ints a mask is asked to apply to
Shape = Sequence[int]
#: what a leaf builds: its (keep, bias) tensors, either None
_Built = tuple[Optional[torch.Tensor], Optional[torch.Tensor]]
#: an interval end: (B|1, n) int64 for the rows of a tile, or an int for one row
_End = Any
#: per-query key intervals [lo, hi): the union of them is what a row may see
_Intervals = list[tuple[_End, _End]]

_EMPTY, _PARTIAL, _FULL = 0, 1, 2

#: a count of keys at or past this is more than any call holds: window sides this long mean
#: unlimited (``sys.maxsize`` is a common way to say so), and chunks and sink counts are held
#: to it, so that the int64 arithmetic of the intervals (d_i + right + 1, ...) cannot wrap
UNLIMITED = 2**62
#: the most tokens one packed row may describe (`from_seqlens`, `from_cu_seqlens`), and the most
#: heads `alibi_slopes` makes slopes for: beyond any call that fits in memory
MAX_TOKENS = 2**31
MAX_HEADS = 2**16


@dataclass(frozen=True)
class MaskTensors:
    """The materialised mask: ``keep`` (bool) and ``bias`` (float), each broadcastable to
    (B, H, Lq, Lk), either of them ``None`` when the mask has no such part."""

    keep: Optional[torch.Tensor]
    bias: Optional[torch.Tensor]


def diagonal_offset(align: str, lq: int, lk: int) -> int:
    """Key index that query 0's diagonal sits on: ``Lk - Lq`` bottom-right, 0 top-left."""
    return lk - lq if align == "bottom_right" else 0


class _Rows:
    """Query rows q0 .. q1-1 of a call and where their documents lie (the whole sequence
    without a documents part): ``qs``/``qe`` the document's first and end query, ``ks``/``ke``
    its first and end key, each (B|1, n) int64; ``i`` the rows' indices (1, n). On the host
    without documents, else on the documents' device."""

    def __init__(self, doc: Optional["Documents"], q0: int, q1: int, lq: int, lk: int):
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


def _min(a: _End, b: _End) -> _End:
    return torch.minimum(a, b) if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) else min(a, b)


def _max(a: _End, b: _End) -> _End:
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


def _documents_of(parts: Sequence["Mask"]) -> Optional["Documents"]:
    for p in parts:
        if isinstance(p, Documents):
            return p
    return None


def _intervals(parts: Sequence["Mask"], rows: "_AnyRows") -> Optional[_Intervals]:
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
            got = [(_max(a, c), _min(b, d)) for a, b in got for c, d in mine]
    return got  # not clamped to [0, Lk): what is compared with keys in [0, Lk) is the same


def _from_ends(parts: Sequence["Mask"], doc: Optional["Documents"], q0: int, q1: int, k0: int, k1: int,
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


class Mask:
    """Base class. Leaves build their tensors in `_build` / `_build_block`, or describe the keys
    each query may see as intervals (`_intervals`: causal, window, documents, chunked_local)."""

    #: what a leaf is, for messages ("causal", "window", "keep", "bias", "padding", "torch",
    #: "documents", "chunked_local", "mask_mod", "alibi", "score_mod", "softcap", "sink")
    kind: ClassVar[str]
    #: what the part does to the scores, one of `ROLES`: "select" hides keys (causal, window,
    #: documents, chunked_local, keep, key_padding, mask_mod, a bool torch mask), "add" adds a
    #: float tensor (bias, alibi, a float torch mask), "modify" rewrites them (score_mod,
    #: softcap), "denominator" adds a term to the softmax's denominator (sink). Consumers read
    #: the role, never a list of kinds.
    role: str = "select"
    #: whether the part modifies scores (`apply_block`)
    is_score_mod: ClassVar[bool] = False
    #: whether the part selects by key intervals per query (`_intervals`)
    is_structural: ClassVar[bool] = False
    #: whether `_build_block` reads the rows' geometry (``rows=``)
    needs_rows: ClassVar[bool] = False

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
        """The score-mod parts (score_mod, softcap) in written order; empty for most masks."""
        return tuple(p for p in self.parts if p.is_score_mod)

    @property
    def sink_logits(self) -> Optional[torch.Tensor]:
        """(H,) float: the sink part's logits (one per query head), or None without a sink."""
        for p in self.parts:
            if isinstance(p, Sink):
                return p.logits
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

        The selecting structural parts (causal, window, documents, chunked_local) build one
        (Lq, Lk) keep together, (B, 1, Lq, Lk) when documents differ across the batch.
        """
        shape = tuple(shape)
        lq, lk = shape[-2:]
        parts = self.parts
        keep_t: Optional[torch.Tensor] = None
        bias_t: Optional[torch.Tensor] = None
        rows = _Rows(_documents_of(parts), 0, lq, lq, lk)
        ivs = _intervals(parts, rows)
        if ivs is not None:
            j = torch.arange(lk, device=device)
            seen: Optional[torch.Tensor] = None
            for lo, hi in ivs:
                inside = (j >= lo.unsqueeze(-1).to(device)) & (j < hi.unsqueeze(-1).to(device))
                seen = inside if seen is None else seen | inside
            assert seen is not None
            keep_t = seen[0] if seen.shape[0] == 1 else seen.unsqueeze(1)
        for part in parts:
            if part.is_structural:
                continue
            k, b = part._build(shape, device=device, dtype=dtype, rows=rows)
            if k is not None:
                keep_t = k if keep_t is None else keep_t & k
            if b is not None:
                bias_t = b if bias_t is None else bias_t + b
        return MaskTensors(keep_t, bias_t)

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
        for part in parts:
            plo, phi = part._key_span(q0, q1, lq, lk)
            lo, hi = max(lo, plo), min(hi, phi)
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
        lq, lk = shape[-2:]
        parts = self.parts
        plan = self.plan
        full = whole or (plan is not None and plan.shape == shape and plan.tile_state(q0, q1, k0, k1) == "full")
        doc = _documents_of(parts)
        rows: Optional[_Rows] = None
        keep_t: Optional[torch.Tensor] = None
        bias_t: Optional[torch.Tensor] = None
        if not full and any(p.is_structural for p in parts):
            ends = _from_ends(parts, doc, q0, q1, k0, k1, lq, lk)
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
    def _build(
        self, shape: Shape, *, device: torch.device, dtype: torch.dtype, rows: Optional[_Rows] = None
    ) -> _Built:  # pragma: no cover - abstract
        raise NotImplementedError

    def _intervals(self, rows: "_AnyRows") -> _Intervals:  # pragma: no cover - structural parts only
        """For structural parts: the key intervals each row (a `_Rows`, or one `_Row`) may see."""
        raise NotImplementedError

    def _check(self, shape: Shape, device: torch.device, name: str) -> None:
        return None

    def _probe(self, shape: Shape, device: torch.device, dtype: torch.dtype, name: str) -> None:
        """For function parts: try the function once on a small tile (after every `_check`)."""
        return None

    def _key_span(self, q0: int, q1: int, lq: int, lk: int) -> tuple[int, int]:
        return 0, lk

    def _tile_state(self, q0: int, q1: int, k0: int, k1: int, shape: Shape, device: torch.device) -> int:
        """For non-structural parts: _EMPTY, _PARTIAL or _FULL for the selection of one tile."""
        return _FULL

    def _dense_shape(self, shape: Shape) -> tuple[int, ...]:
        tensor = getattr(self, "tensor", None)
        return tuple(shape[-2:]) if tensor is None else tuple(tensor.shape)

    def _additive_tensor(self, shape: Shape) -> Optional[torch.Tensor]:
        """For a part added to the scores: its float tensor as 4-D (B|1, H|1, Lq|1, Lk|1), else None."""
        return None

    def _build_block(
        self, q0: int, q1: int, k0: int, k1: int, shape: Shape, *, device: torch.device, dtype: torch.dtype,
        rows: Optional[_Rows] = None,
    ) -> _Built:
        """Default for tensor leaves: slice what `_build` returns (a view, no copy)."""
        keep_t, bias_t = self._build(shape, device=device, dtype=dtype)
        return _tile(keep_t, q0, q1, k0, k1), _tile(bias_t, q0, q1, k0, k1)


class AllOf(Mask):
    """Conjunction of masks built with ``&`` (and a mask given a block plan)."""

    kind: ClassVar[str] = "all"

    def __init__(self, parts: Sequence[Mask], plan: Optional["BlockPlan"] = None):
        self._parts = tuple(parts)
        for what in (Documents, Sink):
            found = [p for p in self._parts if isinstance(p, what)]
            if len(found) > 1:
                raise ValueError(
                    f"a mask may have one {what.kind} part, got {len(found)}: {' & '.join(map(repr, found))}; "
                    + ("give every token one id in a single masks.documents(...)" if what is Documents
                       else "add the logits into one masks.sink(...) (logaddexp of them)")
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


def _check_in_range(largest: float, dtype: torch.dtype, what: str) -> None:
    """ValueError when a part's largest finite magnitude overflows the scores' ``dtype`` (it would
    turn into inf there, and inf times a distance of 0 into NaN)."""
    if largest > torch.finfo(dtype).max:
        raise ValueError(
            f"{what} reach {largest:g}, past the largest {dtype} ({torch.finfo(dtype).max:g}) the scores are "
            "computed in; give smaller values"
        )


def _check_align(align: object) -> str:
    if align not in ALIGNMENTS:
        raise ValueError(f"align must be one of {ALIGNMENTS}, got {align!r}")
    return str(align)


def _check_count(value: object, name: str, *, minimum: int, allow_none: bool = False) -> Optional[int]:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int{' or None' if allow_none else ''}, got {type(value).__name__}")
    if int(value) < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


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
            out.append((start, _min(start + self.sinks, hi)))
        return out

    def __repr__(self) -> str:
        sinks = f", sinks={self.sinks}" if self.sinks else ""
        return f"window(left={self.left}, right={self.right}, align={self.align!r}{sinks})"


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

    def _build(self, shape: Shape, *, device: torch.device, dtype: torch.dtype, rows: Optional[_Rows] = None) -> _Built:
        return self.tensor, None

    def _check(self, shape: Shape, device: torch.device, name: str) -> None:
        _check_broadcast(self.tensor, shape, device, name, "keep mask")

    def _tile_state(self, q0: int, q1: int, k0: int, k1: int, shape: Shape, device: torch.device) -> int:
        return _state_of(_tile(self.tensor, q0, q1, k0, k1))

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

    def _build(self, shape: Shape, *, device: torch.device, dtype: torch.dtype, rows: Optional[_Rows] = None) -> _Built:
        return None, self.tensor.to(dtype)

    def _build_block(
        self, q0: int, q1: int, k0: int, k1: int, shape: Shape, *, device: torch.device, dtype: torch.dtype,
        rows: Optional[_Rows] = None,
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

    def _build(self, shape: Shape, *, device: torch.device, dtype: torch.dtype, rows: Optional[_Rows] = None) -> _Built:
        return self.tensor[:, None, None, :], None

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
        self.role = "select" if t.dtype == torch.bool else "add"

    @classmethod
    def wrap(cls, t: torch.Tensor) -> Mask:
        if t.dtype != torch.bool and not t.is_floating_point():
            raise TypeError(f"attn_mask must be bool or float, got {t.dtype}")
        return cls(t)

    def _unflatten(self, heads: int) -> torch.Tensor:
        t = self.tensor
        return t.reshape(t.shape[0] // heads, heads, *t.shape[1:])

    def _build(self, shape: Shape, *, device: torch.device, dtype: torch.dtype, rows: Optional[_Rows] = None) -> _Built:
        t = self._unflatten(shape[1])
        if t.dtype == torch.bool:
            return ~t, None
        return None, t.to(dtype)

    def _build_block(
        self, q0: int, q1: int, k0: int, k1: int, shape: Shape, *, device: torch.device, dtype: torch.dtype,
        rows: Optional[_Rows] = None,
    ) -> _Built:
        t = _tile(self._unflatten(shape[1]), q0, q1, k0, k1)
        if t.dtype == torch.bool:
            return ~t, None
        return None, t.to(dtype)

    def _additive_tensor(self, shape: Shape) -> Optional[torch.Tensor]:
        return None if self.tensor.dtype == torch.bool else self._unflatten(shape[1])

    def _tile_state(self, q0: int, q1: int, k0: int, k1: int, shape: Shape, device: torch.device) -> int:
        if self.tensor.dtype != torch.bool:  # a float mask adds, it selects nothing
            return _FULL
        return _state_of(~_tile(self._unflatten(shape[1]), q0, q1, k0, k1))  # True = masked out

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


def _index_args(
    q0: int, q1: int, k0: int, k1: int, batch: int, heads: Union[int, Sequence[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlexAttention's index arguments for one tile: b (B,1,1,1), h (1,H,1,1), q_idx (1,1,bq,1),
    kv_idx (1,1,1,bk); ``heads``: H (h is 0..H-1) or the head indices themselves."""
    b = torch.arange(batch, device=device).view(batch, 1, 1, 1)
    h = (torch.arange(heads, device=device) if isinstance(heads, int)
         else torch.tensor(list(heads), dtype=torch.int64, device=device)).view(1, -1, 1, 1)
    q = torch.arange(q0, q1, device=device).view(1, 1, q1 - q0, 1)
    kv = torch.arange(k0, k1, device=device).view(1, 1, 1, k1 - k0)
    return b, h, q, kv


def _vmapped(fn: Callable[..., torch.Tensor], with_score: bool) -> Callable[..., torch.Tensor]:
    """``fn`` evaluated element by element, as FlexAttention evaluates mods: vmapped over kv_idx,
    q_idx, h and b in turn (innermost first), each index a 0-d tensor inside, and the score with
    them; called with 1-D index tensors (and the (B, H, bq, bk) score), it returns (B, H, bq, bk)."""
    levels = [(None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)]
    f = fn
    for dims in levels:
        f = torch.vmap(f, in_dims=((0,) + dims) if with_score else dims, out_dims=0)
    return f


def _call_indexed(part: Any, s: Optional[torch.Tensor], q0: int, q1: int, k0: int, k1: int, batch: int,
                  heads: Union[int, Sequence[int]], device: torch.device) -> torch.Tensor:
    """``part.fn`` on one tile: with broadcasting index tensors (b (B,1,1,1), h (1,H,1,1),
    q_idx (1,1,bq,1), kv_idx (1,1,1,bk)), or, for a function written per element (e.g.
    ``bias[b][q_idx]``, which broadcasting indices cannot evaluate), element by element through
    `_vmapped`, as FlexAttention does. The first call decides which (``part._per_element``):
    broadcasting when it runs (what it returns is then judged by the caller), per element when
    broadcasting raises and the element-wise evaluation runs."""
    b, h, q, kv = _index_args(q0, q1, k0, k1, batch, heads, device)
    head = () if s is None else (s,)
    if part._per_element is None:
        try:
            out = part.fn(*head, b, h, q, kv)
        except (RuntimeError, IndexError, TypeError, ValueError) as first:
            try:
                out = _vmapped(part.fn, s is not None)(*head, b.flatten(), h.flatten(), q.flatten(), kv.flatten())
            except Exception as e:  # noqa: BLE001 - any failure of the user's function under vmap is reported by name
                raise TypeError(
                    f"{part.kind} {_fn_name(part.fn)} could not be evaluated on a tile: with broadcasting index "
                    f"tensors it raised {type(first).__name__}: {str(first).splitlines()[0][:160]}; element by "
                    f"element (torch.vmap, as FlexAttention) it raised {type(e).__name__}: "
                    f"{str(e).splitlines()[0][:160]}. Write it with tensor operations of its index arguments, "
                    "without Python if/for on their values (e.g. torch.where(q_idx >= kv_idx, ...))"
                ) from None
            part._per_element = True
            return out
        part._per_element = False  # it ran: its result's shape and dtype are judged by the caller
        return out  # type: ignore[no-any-return]
    if part._per_element:
        return _vmapped(part.fn, s is not None)(*head, b.flatten(), h.flatten(), q.flatten(), kv.flatten())
    return part.fn(*head, b, h, q, kv)  # type: ignore[no-any-return]


def _fn_name(fn: Callable[..., object]) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


#: the probe tile `Mask.check` tries a function on: queries 0..1 x keys 0..2 (when that long)
_PROBE = (2, 3)

#: the default block size of the plan a mask_mod makes for itself
PLAN_BLOCK = 128


class MaskMod(Mask):
    """``fn(b, h, q_idx, kv_idx) -> bool`` (True = may attend), FlexAttention's mask_mod,
    evaluated on one tile's index tensors at a time."""

    kind: ClassVar[str] = "mask_mod"

    def __init__(self, fn: Callable[..., torch.Tensor]):
        if not callable(fn):
            raise TypeError(f"mask_mod takes a function fn(b, h, q_idx, kv_idx) -> bool tensor, got {type(fn).__name__}")
        self.fn = fn
        #: whether fn is evaluated element by element (see `_call_indexed`; None: not yet known)
        self._per_element: Optional[bool] = None
        #: (shape, device) -> the plan and what it was made from: each tensor the function read
        #: with a copy of its values then
        self._plans: dict[tuple[tuple[int, ...], str], tuple[BlockPlan, list[tuple[torch.Tensor, torch.Tensor]]]] = {}

    def _evaluate(self, q0: int, q1: int, k0: int, k1: int, shape: Shape, device: torch.device) -> torch.Tensor:
        batch, heads = shape[0], shape[1]
        out = _call_indexed(self, None, q0, q1, k0, k1, batch, heads, device)
        want = (batch, heads, q1 - q0, k1 - k0)
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
            got = type(out).__name__ if not isinstance(out, torch.Tensor) else f"a {out.dtype} tensor"
            raise TypeError(
                f"mask_mod {_fn_name(self.fn)} must return a bool tensor (True = may attend), got {got}; "
                "return a comparison of the index arguments, e.g. q_idx >= kv_idx (for 0/1 values: .bool())"
            )
        try:
            fits = tuple(torch.broadcast_shapes(out.shape, want)) == want  # type: ignore[no-untyped-call]
        except RuntimeError:
            fits = False
        if not fits or out.dim() > 4:
            raise ValueError(
                f"mask_mod {_fn_name(self.fn)} returned shape {tuple(out.shape)} for a tile of (B, H, bq, bk) = {want}, "
                "which does not broadcast to it; build the result from the index arguments, which broadcast as "
                "b (B,1,1,1), h (1,H,1,1), q_idx (1,1,bq,1), kv_idx (1,1,1,bk)"
            )
        return out.reshape((1,) * (4 - out.dim()) + tuple(out.shape))

    def _build(self, shape: Shape, *, device: torch.device, dtype: torch.dtype, rows: Optional[_Rows] = None) -> _Built:
        return self._evaluate(0, shape[-2], 0, shape[-1], shape, device), None

    def _build_block(self, q0: int, q1: int, k0: int, k1: int, shape: Shape, *, device: torch.device,
                     dtype: torch.dtype, rows: Optional[_Rows] = None) -> _Built:
        return self._evaluate(q0, q1, k0, k1, shape, device), None

    def _probe(self, shape: Shape, device: torch.device, dtype: torch.dtype, name: str) -> None:
        lq, lk = shape[-2:]
        self._evaluate(0, min(lq, _PROBE[0]), 0, min(lk, _PROBE[1]), shape, device)

    def _dense_shape(self, shape: Shape) -> tuple[int, ...]:
        batch, heads, lq, lk = shape
        out = self._evaluate(0, min(lq, _PROBE[0]), 0, min(lk, _PROBE[1]), shape, _captured_device(self.fn))
        return (out.shape[0] if batch > 1 else 1, out.shape[1] if heads > 1 else 1, lq, lk)

    def own_plan(self, shape: Shape, device: Optional[torch.device] = None) -> "BlockPlan":
        """The block plan of this function alone for ``shape``: made once, and made again when a
        tensor the function reads (`_captured`) is another tensor or holds other values than
        when the plan was made. The values are compared with a copy kept beside the plan, so
        every way of changing them counts (in-place ops, ``.data`` writes, numpy views), at the
        cost of one comparison of those tensors per call."""
        dev = device if device is not None else _captured_device(self.fn)
        key = (tuple(shape), str(dev))
        captured = _captured(self.fn)
        held = self._plans.get(key)
        if held is not None and _unchanged(held[1], captured):
            return held[0]
        plan = block_plan(self, shape, device=dev)
        self._plans[key] = (plan, [(t, t.detach().clone()) for t in captured])
        return plan

    def _tile_state(self, q0: int, q1: int, k0: int, k1: int, shape: Shape, device: torch.device) -> int:
        return TILE_STATES.index(self.own_plan(shape).tile_state(q0, q1, k0, k1))

    def __repr__(self) -> str:
        return f"mask_mod({_fn_name(self.fn)})"


def _captured(fn: Callable[..., object]) -> list[torch.Tensor]:
    """The tensors ``fn`` reads from outside: closure cells, defaults, globals it names, and the
    parameters and buffers of a module (``fn`` itself, or one it holds)."""
    found: list[object] = []
    target = getattr(fn, "__func__", fn)
    owner = getattr(fn, "__self__", None)
    if owner is not None:
        found.append(owner)
    if isinstance(fn, torch.nn.Module):
        found.append(fn)
    for cell in getattr(target, "__closure__", None) or ():
        try:
            found.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    found.extend(getattr(target, "__defaults__", None) or ())
    code = getattr(target, "__code__", None)
    glob = getattr(target, "__globals__", {})
    if code is not None:
        found.extend(glob[n] for n in code.co_names if n in glob)
    out: dict[int, torch.Tensor] = {}
    for obj in found:
        if isinstance(obj, torch.nn.Module):
            for t in list(obj.parameters()) + list(obj.buffers()):
                out.setdefault(id(t), t)
        elif isinstance(obj, torch.Tensor):
            out.setdefault(id(obj), obj)
    return list(out.values())


def _unchanged(held: list[tuple[torch.Tensor, torch.Tensor]], now: list[torch.Tensor]) -> bool:
    """Whether ``now`` (from `_captured`) are the tensors ``held`` pairs with copies of their
    values, with the same values."""
    return len(held) == len(now) and all(
        t is n and t.shape == c.shape and t.dtype == c.dtype and bool(torch.equal(t.detach(), c))
        for (t, c), n in zip(held, now)
    )


def _holds(cell: Any, swap: dict[int, torch.Tensor]) -> bool:
    try:
        return id(cell.cell_contents) in swap
    except ValueError:  # an empty cell
        return False


def _captured_device(fn: Callable[..., object]) -> torch.device:
    ts = _captured(fn)
    return ts[0].device if ts else torch.device("cpu")


class _BuildsNothing(Mask):
    """A part that neither selects keys nor adds a tensor (a score mod, a sink): the backends
    read it through `Mask.score_mods` / `Mask.sink_logits`, so its keep/bias tiles are empty."""

    def _build(self, shape: Shape, *, device: torch.device, dtype: torch.dtype, rows: Optional[_Rows] = None) -> _Built:
        return None, None

    def _build_block(self, q0: int, q1: int, k0: int, k1: int, shape: Shape, *, device: torch.device,
                     dtype: torch.dtype, rows: Optional[_Rows] = None) -> _Built:
        return None, None

    def _dense_shape(self, shape: Shape) -> tuple[int, ...]:
        return ()


class ScoreMod(_BuildsNothing):
    """``fn(score, b, h, q_idx, kv_idx) -> score``, FlexAttention's score_mod, applied to each
    tile's scores (after the biases, before the selection)."""

    kind: ClassVar[str] = "score_mod"
    role = "modify"
    is_score_mod: ClassVar[bool] = True

    def __init__(self, fn: Callable[..., torch.Tensor], tensors: Optional[Sequence[torch.Tensor]] = None):
        if not callable(fn):
            raise TypeError(f"score_mod takes a function fn(score, b, h, q_idx, kv_idx) -> score, got {type(fn).__name__}")
        if tensors is not None:
            tensors = tuple(tensors)
            bad = [type(t).__name__ for t in tensors if not isinstance(t, torch.Tensor)]
            if bad:
                raise TypeError(f"score_mod tensors= must be torch.Tensors, got {', '.join(bad)}")
        self.fn = fn
        #: whether fn is evaluated element by element (see `_call_indexed`; None: not yet known)
        self._per_element: Optional[bool] = None
        self._tensors = tuple(tensors) if tensors is not None else tuple(
            t for t in _captured(fn) if t.is_floating_point() or t.is_complex()
        )

    def _own_tensors(self) -> tuple[torch.Tensor, ...]:
        return self._tensors

    @contextlib.contextmanager
    def reading(self, swap: dict[int, torch.Tensor]) -> Iterator[list[int]]:
        """While open, the function reads ``swap[id(t)]`` where it read the tensor ``t`` from its
        closure, its defaults or the globals it names (a kernel's float32 twin of a bfloat16
        table, so that the table's gradient is summed in float32 and rounded once). Yields the
        ids it swapped; a tensor it reaches otherwise (a module's parameters) is read as it is."""
        target = getattr(self.fn, "__func__", self.fn)
        cells = [c for c in (getattr(target, "__closure__", None) or ()) if _holds(c, swap)]
        old_cells = [c.cell_contents for c in cells]
        old_defaults = getattr(target, "__defaults__", None)
        code, glob = getattr(target, "__code__", None), getattr(target, "__globals__", {})
        names = [n for n in (code.co_names if code is not None else ()) if id(glob.get(n)) in swap]
        old_globals = {n: glob[n] for n in names}
        swapped = {id(t) for t in old_cells} | {id(t) for t in old_globals.values()}
        try:
            for c in cells:
                c.cell_contents = swap[id(c.cell_contents)]
            for n, t in old_globals.items():
                glob[n] = swap[id(t)]
            if old_defaults:
                target.__defaults__ = tuple(swap.get(id(d), d) if isinstance(d, torch.Tensor) else d
                                            for d in old_defaults)
                swapped |= {id(d) for d in old_defaults if isinstance(d, torch.Tensor) and id(d) in swap}
            yield sorted(swapped)
        finally:
            for c, old in zip(cells, old_cells):
                c.cell_contents = old
            glob.update(old_globals)
            if old_defaults:
                target.__defaults__ = old_defaults

    def _apply(self, s: torch.Tensor, q0: int, q1: int, k0: int, k1: int, shape: Shape,
               heads: Optional[Sequence[int]] = None) -> torch.Tensor:
        out = _call_indexed(self, s, q0, q1, k0, k1, s.shape[0], s.shape[1] if heads is None else heads, s.device)
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"score_mod {_fn_name(self.fn)} must return a tensor of the score's shape, got {type(out).__name__}; "
                "return an expression of score, e.g. score + bias_table[h, q_idx - kv_idx]"
            )
        if tuple(out.shape) != tuple(s.shape):
            raise ValueError(
                f"score_mod {_fn_name(self.fn)} changed the scores' shape from {tuple(s.shape)} to {tuple(out.shape)}; "
                "it must return one score per (b, h, q_idx, kv_idx): combine score with the index arguments "
                "(b (B,1,1,1), h (1,H,1,1), q_idx (1,1,bq,1), kv_idx (1,1,1,bk)) by broadcasting"
            )
        if out.dtype != s.dtype:
            raise TypeError(
                f"score_mod {_fn_name(self.fn)} changed the scores' dtype from {s.dtype} to {out.dtype}; "
                "cast what it adds, e.g. score + table[h, q_idx].to(score.dtype)"
            )
        return out

    def _probe(self, shape: Shape, device: torch.device, dtype: torch.dtype, name: str) -> None:
        batch, heads, lq, lk = shape
        bq, bk = min(lq, _PROBE[0]), min(lk, _PROBE[1])
        with torch.no_grad():
            self._apply(torch.zeros(batch, heads, bq, bk, dtype=dtype, device=device), 0, bq, 0, bk, shape)

    def __repr__(self) -> str:
        extra = f", tensors={[tuple(t.shape) for t in self._tensors]}" if self._tensors else ""
        return f"score_mod({_fn_name(self.fn)}{extra})"


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


class Sink(_BuildsNothing):
    """A learned logit per query head in the softmax's denominator: ``w_ij = exp(s_ij) /
    (Σ_j exp(s_ij) + exp(sink_h))`` (gpt-oss's ``s_aux``); the weights of a row sum to less than 1."""

    kind: ClassVar[str] = "sink"
    role = "denominator"

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

    def _build(self, shape: Shape, *, device: torch.device, dtype: torch.dtype, rows: Optional[_Rows] = None) -> _Built:
        assert rows is not None
        return None, self._rows_bias(rows, 0, shape[-1], device, dtype)

    def _build_block(self, q0: int, q1: int, k0: int, k1: int, shape: Shape, *, device: torch.device,
                     dtype: torch.dtype, rows: Optional[_Rows] = None) -> _Built:
        assert rows is not None
        return None, self._rows_bias(rows, k0, k1, device, dtype)

    def _dense_shape(self, shape: Shape) -> tuple[int, ...]:
        return (shape[0] if self.slopes.dim() == 2 else 1, shape[1], shape[2], shape[3])

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


def block_plan(
    mask: MaskLike, shape: Shape, *, block_q: int = PLAN_BLOCK, block_k: int = PLAN_BLOCK,
    device: Optional[torch.device] = None,
) -> BlockPlan:
    """The `BlockPlan` of ``mask`` for ``shape`` = (B, H, Lq, Lk): its selection evaluated one row
    of tiles (block_q queries x all keys) at a time, never an (Lq, Lk) tensor.

    >>> import torch
    >>> from multihead import masks
    >>> m = masks.mask_mod(lambda b, h, q, kv: kv <= q)       # causal, written as a function
    >>> plan = masks.block_plan(m, (1, 1, 256, 256), block_q=128, block_k=128)
    >>> plan.states[0, 0].tolist()                          # 0 empty, 1 partial, 2 full
    [[1, 0], [2, 1]]
    >>> shared = m.with_plan(plan)                          # several layers can share it
    >>> shared.tile_state(0, 128, 128, 256, (1, 1, 256, 256))
    'empty'
    """
    m = as_mask(mask, name="block_plan mask")
    if m is None:
        raise TypeError("block_plan needs a mask, got None")
    bq = _check_count(block_q, "block_q", minimum=1)
    bk = _check_count(block_k, "block_k", minimum=1)
    assert bq is not None and bk is not None
    if len(tuple(shape)) != 4:
        raise ValueError(f"block_plan shape must be (B, H, Lq, Lk), got {tuple(shape)}")
    full_shape = (int(shape[0]), int(shape[1]), int(shape[2]), int(shape[3]))
    dev = torch.device("cpu") if device is None else torch.device(device)
    batch, heads, lq, lk = full_shape
    nq, nk = -(-lq // bq), -(-lk // bk)
    rows_out = []
    for qa in range(nq):
        q0, q1 = qa * bq, min(lq, (qa + 1) * bq)
        keep_t = m.block(q0, q1, 0, lk, full_shape, device=dev, dtype=torch.float32).keep
        if keep_t is None:
            rows_out.append(torch.full((1, 1, 1, nk), _FULL, dtype=torch.uint8, device=dev))
            continue
        keep_t = keep_t.reshape((1,) * (4 - keep_t.dim()) + tuple(keep_t.shape))
        cols = []
        for ka in range(nk):
            t = keep_t[..., :, ka * bk:min(lk, (ka + 1) * bk)] if keep_t.shape[-1] != 1 else keep_t
            t = t.expand(t.shape[0], t.shape[1], q1 - q0, t.shape[-1]) if t.shape[-2] == 1 else t
            anyv, allv = t.any(dim=-1).any(dim=-1), t.all(dim=-1).all(dim=-1)
            cols.append(torch.where(allv, _FULL, torch.where(anyv, _PARTIAL, _EMPTY)).to(torch.uint8))
        rows_out.append(torch.stack(torch.broadcast_tensors(*cols), dim=-1).unsqueeze(-2))  # type: ignore[no-untyped-call]
    if not rows_out:
        states = torch.zeros(1, 1, 0, nk, dtype=torch.uint8, device=dev)
    else:
        states = torch.cat(torch.broadcast_tensors(*rows_out), dim=-2)  # type: ignore[no-untyped-call]
    return BlockPlan(full_shape, bq, bk, states)


# -- constructors of the new kinds

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


def mask_mod(fn: Callable[..., torch.Tensor]) -> Mask:
    """A mask from a function ``fn(b, h, q_idx, kv_idx) -> bool tensor`` (FlexAttention's
    ``mask_mod``; True = may attend), evaluated per tile on broadcasting index tensors.

    >>> import torch, multihead
    >>> from multihead import masks
    >>> def even_keys(b, h, q_idx, kv_idx):
    ...     return kv_idx % 2 == 0
    >>> q = k = v = torch.randn(1, 2, 3, 4)
    >>> w = multihead.attention_weights(q, k, masks.mask_mod(even_keys))
    >>> (w[..., 1::2] == 0).all().item()
    True
    """
    return MaskMod(fn)


def score_mod(fn: Callable[..., torch.Tensor], *, tensors: Optional[Sequence[torch.Tensor]] = None) -> Mask:
    """Scores modified by ``fn(score, b, h, q_idx, kv_idx) -> score`` (FlexAttention's
    ``score_mod``), applied after the biases and before the selection. ``tensors``: the tensors
    ``fn`` reads that may need gradients (default: found in its closure, defaults and globals).

    >>> import torch, multihead
    >>> from multihead import masks
    >>> table = torch.zeros(2, 8, requires_grad=True)           # a learned bias per head and distance
    >>> def relative(score, b, h, q_idx, kv_idx):
    ...     return score + table[h, (q_idx - kv_idx).abs()]
    >>> m = masks.score_mod(relative) & masks.causal()
    >>> m.tensors[0] is table
    True
    >>> q = k = v = torch.randn(1, 2, 5, 4)
    >>> multihead.attention(q, k, v, mask=m, backend="reference").sum().backward()
    >>> table.grad.shape
    torch.Size([2, 8])
    """
    return ScoreMod(fn, tensors)


def softcap(cap: float) -> Mask:
    """Scores squashed to ``cap · tanh(s / cap)`` (Gemma 2's ``attn_logit_softcapping``); cap > 0.

    >>> import torch
    >>> from multihead import masks
    >>> s = torch.tensor([[[[0.0, 100.0]]]])
    >>> masks.softcap(50.0).apply_block(s, 0, 1, 0, 2, (1, 1, 1, 2)).tolist()
    [[[[0.0, 48.201377868652344]]]]
    """
    return Softcap(cap)


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
