"""Context-parallel (ring) attention: one sequence sharded across the ranks of a process group.

Each rank holds its shard of the sequence, (B, H, L/P, D) for the queries and (B, Hkv, L/P, D)
for the keys and values. The key/value blocks travel round the ring (rank r sends to r+1 and
receives from r-1) while every rank attends its queries to the block it holds and merges the
partial results with the log-sum-exp rule::

    lse  = logaddexp(lse_a, lse_b)
    out  = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

so after P steps each rank has exactly softmax(q kᵀ · scale) v over the whole sequence, having
held at most two key/value blocks at a time. The backward pass sends the blocks round the ring
again; the gradients dk/dv of a block are summed by every rank it visits and travel with it
back to its owner, while dq stays local. Transport is torch.distributed point-to-point
(``batch_isend_irecv``): gloo on CPUs, NCCL on GPUs, processes launched with ``torchrun``.

Layouts (the sequence axis is dim -2; P = 2 ranks, L = 8 tokens)::

    contiguous  rank 0: 0 1 2 3          rank 1: 4 5 6 7
    zigzag      rank 0: 0 1 | 6 7        rank 1: 2 3 | 4 5

With a causal mask, contiguous shards give rank 0 one block of work and rank P-1 P blocks;
zigzag (the sequence cut in 2P chunks, rank r holding chunks r and 2P-1-r) gives every rank the
same work, so it is the default when ``causal=True``. :func:`shard_sequence` and
:func:`unshard_sequence` produce and invert both layouts; :func:`shard_positions` gives the
global token positions of a shard (for rotary embeddings).

Before the ring (forward and backward), the ranks exchange a fixed-size descriptor of their
call in one all_gather and all raise the same ValueError if they disagree (see the agreement
section below): mismatched shards would otherwise abort a process inside the transport or give
wrong results silently.

Why not ``torch.distributed.tensor.experimental.context_parallel``: in torch 2.13 it only
handles the CUDA SDPA kernels (flash, efficient, cuDNN); on CPU, SDPA's
``_scaled_dot_product_flash_attention_for_cpu`` has no sharding rule (NotImplementedError), and
it takes no attention mask (no key padding). This module needs only point-to-point sends, which
every torch.distributed backend has.

Legend: B batch, H query heads, Hkv key/value heads, g = H // Hkv, L sequence length, P ranks
in the group, Lq/Lk local (per-rank) query/key lengths, D head dim, Dv value head dim.
"""

from __future__ import annotations

import datetime
import numbers
import struct
import zlib
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd.function import once_differentiable

from .. import masks as _masks
from .._checks import check_qkv, check_scale
from .._numerics import compute_dtype, default_scale
from ..backends import _tiles
from ..backends import chunked as _chunked
from ..backends import flex as _flex

__all__ = [
    "LAYOUTS",
    "DocumentLayout",
    "rank_work",
    "ring_plan",
    "RingError",
    "mask_signature",
    "ring_attention",
    "shard_sequence",
    "unshard_sequence",
    "shard_positions",
    "ContextParallel",
    "context_parallel",
]

LAYOUTS = ("contiguous", "zigzag")

_NEG_INF = float("-inf")

class RingError(RuntimeError):
    """A send or receive of the ring, or its agreement check, failed: a peer rank died, left, or
    did not answer in time."""


# ---------------------------------------------------------------------------------- layouts
class DocumentLayout:
    """Packed documents split so that causal work is balanced: each document of n tokens (n a
    multiple of P) is cut into 2P chunks, and rank r holds chunks r and 2P-1-r of every document
    (zigzag inside each document), chunk sizes a = n/P // 2 (chunks 0 .. P-1) and n/P - a (the
    rest). Every rank holds n/P tokens of every document, and under a causal mask inside the
    documents (``masks.documents(ids) & masks.causal()``) each rank's queries see nearly the
    same number of keys (`rank_work`), where a contiguous split of the packed sequence gives the
    rank holding a long document's end most of the work.

    >>> from multihead.distributed import DocumentLayout, rank_work
    >>> layout = DocumentLayout([8, 4, 12])
    >>> layout.segments(0, 2)                   # (local start, global start, length)
    [(0, 0, 2), (2, 6, 2), (4, 8, 1), (5, 11, 1), (6, 12, 3), (9, 21, 3)]
    >>> rank_work(layout, 2), rank_work("contiguous", 2, seq_len=24, documents=[8, 4, 12])
    ([62, 62], [46, 78])

    Pass it as ``layout=`` to `shard_sequence`, `unshard_sequence`, `shard_positions` and
    `ring_attention` (with ``masks.documents(ids_shard)``; ids_shard = ``shard_sequence(ids,
    rank, P, layout, dim=-1)``).
    """

    def __init__(self, lengths: "Sequence[int]"):
        got = [int(n) for n in lengths]
        if not got or any(n < 1 for n in got):
            raise ValueError(f"DocumentLayout takes the packed documents' lengths (each >= 1), got {list(lengths)}")
        self.lengths = tuple(got)

    def __repr__(self) -> str:
        return f"DocumentLayout({list(self.lengths)})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DocumentLayout) and other.lengths == self.lengths

    def __hash__(self) -> int:
        return hash(self.lengths)

    def code(self) -> int:
        """A number that differs between layouts of different lengths (for the ranks' agreement)."""
        return 2 + zlib.crc32(repr(self.lengths).encode())

    def check(self, world_size: int) -> None:
        bad = [n for n in self.lengths if n % world_size]
        if bad:
            raise ValueError(f"DocumentLayout over P={world_size} ranks needs every document's length to be a multiple of "
                             f"P (each rank holds n/P tokens of each), got {bad}; pad the documents")

    def segments(self, rank: int, world_size: int) -> list[tuple[int, int, int]]:
        """Rank ``rank``'s pieces: ``(local start, global start, length)`` each."""
        self.check(world_size)
        out, local, start = [], 0, 0
        for n in self.lengths:
            a = n // world_size // 2
            sizes = [a] * world_size + [n // world_size - a] * world_size
            starts = [start + sum(sizes[:j]) for j in range(2 * world_size)]
            for j in (rank, 2 * world_size - 1 - rank):
                if sizes[j]:
                    out.append((local, starts[j], sizes[j]))
                    local += sizes[j]
            start += n
        return out


def rank_work(layout, world_size: int, *, seq_len: Optional[int] = None, documents=None) -> list[int]:
    """Visible (query, key) score pairs of each rank's queries under causal attention inside the
    documents (one document of ``seq_len`` tokens without ``documents``): query t of a document
    sees t + 1 keys. ``layout``: a `DocumentLayout`, or "contiguous"/"zigzag" of a packed
    sequence of ``seq_len`` tokens holding ``documents`` (lengths)."""
    if isinstance(layout, DocumentLayout):
        docs = list(layout.lengths)
        total = sum(docs)
    else:
        _check_layout(layout)
        if seq_len is None:
            raise ValueError("rank_work of a contiguous or zigzag layout needs seq_len")
        docs = [seq_len] if documents is None else [int(n) for n in documents]
        total = seq_len
    within = torch.cat([torch.arange(n) for n in docs]) + 1  # (L,): keys each query sees
    if within.numel() != total:
        raise ValueError(f"the documents' lengths sum to {within.numel()} but seq_len={total}")
    out = []
    for r in range(world_size):
        if isinstance(layout, DocumentLayout):
            segs = [(g, n) for _, g, n in layout.segments(r, world_size)]
        else:
            segs = [(g, n) for _, g, n in _segments(r, world_size, total // world_size, layout)]
        out.append(sum(int(within[g:g + n].sum()) for g, n in segs))
    return out


def _check_layout(layout, name: str = "layout"):
    if isinstance(layout, DocumentLayout):
        return layout
    if layout not in LAYOUTS:
        raise ValueError(f"{name} must be one of {LAYOUTS} or a DocumentLayout, got {layout!r}")
    return layout


def _pieces_of(layout, rank: int, world_size: int, local_len: int) -> list[tuple[int, int, int]]:
    """The segments of any layout."""
    if isinstance(layout, DocumentLayout):
        return layout.segments(rank, world_size)
    return _segments(rank, world_size, local_len, layout)


def _check_rank(rank, world_size) -> tuple[int, int]:
    for value, name in ((rank, "rank"), (world_size, "world_size")):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size) = [0, {world_size}), got {rank}")
    return int(rank), int(world_size)


def _chunks_per_rank(layout: str) -> int:
    return 1 if layout == "contiguous" else 2


def _segments(rank: int, world_size: int, local_len: int, layout: str) -> list[tuple[int, int, int]]:
    """The pieces of a rank's shard: ``(local start, global start, length)`` each."""
    if layout == "contiguous":
        return [(0, rank * local_len, local_len)]
    c = local_len // 2
    return [(0, rank * c, c), (c, (2 * world_size - 1 - rank) * c, c)]


def shard_sequence(x: torch.Tensor, rank: int, world_size: int, layout: str = "contiguous", *, dim: int = -2) -> torch.Tensor:
    """The shard of ``x`` that ``rank`` holds, cut along the sequence axis ``dim``.

    x: (..., L, D) with the default ``dim=-2`` (e.g. q (B, H, L, D)); pass ``dim=-1`` for a
    (B, L) key-padding tensor. L must be a multiple of P (contiguous) or 2P (zigzag).
    Returns (..., L/P, D): ``contiguous`` gives tokens ``r·L/P ... (r+1)·L/P - 1``; ``zigzag``
    gives chunks r and 2P-1-r of 2P equal chunks (see the module docstring).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    rank, world_size = _check_rank(rank, world_size)
    _check_layout(layout)
    n = x.shape[dim]
    if isinstance(layout, DocumentLayout):
        if n != sum(layout.lengths):
            raise ValueError(f"x has {n} tokens on dim {dim} but the layout's documents sum to {sum(layout.lengths)}")
        return torch.cat([x.narrow(dim, g, m) for _, g, m in layout.segments(rank, world_size)], dim)
    pieces = world_size * _chunks_per_rank(layout)
    if n % pieces:
        raise ValueError(
            f"x has {n} tokens on dim {dim}, which does not split into {pieces} equal chunks "
            f"({layout} layout over {world_size} ranks); pad the sequence to a multiple of {pieces} "
            "and mask the padding with masks.key_padding"
        )
    chunks = x.chunk(pieces, dim)
    if layout == "contiguous":
        return chunks[rank]
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim)


def unshard_sequence(shards, layout: str = "contiguous", *, dim: int = -2) -> torch.Tensor:
    """The full sequence from every rank's shard (list index = rank): inverts :func:`shard_sequence`."""
    _check_layout(layout)
    if not isinstance(shards, (list, tuple)) or not shards or not all(isinstance(s, torch.Tensor) for s in shards):
        raise TypeError("shards must be a non-empty list of tensors, one per rank in rank order")
    if layout == "contiguous":
        return torch.cat(list(shards), dim)
    if isinstance(layout, DocumentLayout):
        P = len(shards)
        placed = sorted((g, r, local, m) for r in range(P) for local, g, m in layout.segments(r, P))
        return torch.cat([shards[r].narrow(dim, local, m) for _, r, local, m in placed], dim)
    for r, s in enumerate(shards):
        if s.shape[dim] % 2:
            raise ValueError(
                f"shard {r} has {s.shape[dim]} tokens on dim {dim}; zigzag shards hold two equal chunks, "
                "so their length must be even"
            )
    halves = [s.chunk(2, dim) for s in shards]
    early = [h[0] for h in halves]
    late = [h[1] for h in reversed(halves)]
    return torch.cat(early + late, dim)


def shard_positions(rank: int, world_size: int, seq_len: int, layout: "str | DocumentLayout" = "contiguous", *, device=None) -> torch.Tensor:
    """Global positions (L/P,) of the tokens in ``rank``'s shard of a length-``seq_len`` sequence.

    ``shard_sequence(torch.arange(L)[:, None], rank, P, layout)[:, 0]`` is the same thing.
    """
    rank, world_size = _check_rank(rank, world_size)
    _check_layout(layout)
    if isinstance(layout, DocumentLayout):
        return torch.cat([torch.arange(g, g + n, device=device) for _, g, n in layout.segments(rank, world_size)])
    pieces = world_size * _chunks_per_rank(layout)
    given: object = seq_len  # checked as the user may pass anything
    if isinstance(given, bool) or not isinstance(given, numbers.Integral) or int(given) % pieces:
        raise ValueError(f"seq_len must be an int multiple of {pieces} for the {layout} layout, got {seq_len!r}")
    segs = _segments(rank, world_size, seq_len // world_size, layout)
    return torch.cat([torch.arange(g, g + n, device=device) for _, g, n in segs])


# ---------------------------------------------------------------------------------- transport
class _Pending:
    """Receives in flight; :meth:`wait` returns the received tensors."""

    def __init__(self, ring: "_Ring", works, sent, received, what: str, step: Optional[int]):
        self.ring, self.works, self.sent, self.received = ring, works, sent, received
        self.what, self.step = what, step

    def wait(self) -> list[torch.Tensor]:
        for w in self.works:
            try:
                if self.ring.timeout is None:
                    w.wait()
                else:
                    w.wait(self.ring.timeout)
            except RuntimeError as e:
                raise self.ring.error(self.what, self.step, e) from e
        return self.received


class _Ring:
    """The ring over a process group: rank r sends to r+1 and receives from r-1 (group ranks)."""

    def __init__(self, group, timeout: Optional[float]):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "ring_attention needs torch.distributed: call torch.distributed.init_process_group"
                "(backend='gloo' or 'nccl') first, e.g. in a script launched with torchrun"
            )
        chosen = dist.group.WORLD if group is None else group
        if chosen is None:  # initialised above, so the default group exists
            raise RuntimeError("torch.distributed has no default process group; pass group=")
        self.group = chosen
        self.rank = dist.get_rank(self.group)
        if self.rank < 0:
            raise ValueError("this process is not a member of the process group passed as group")
        self.size = dist.get_world_size(self.group)
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.size)
        self.timeout = None if timeout is None else datetime.timedelta(seconds=timeout)
        # for the agreement check: the device that all_gather_object uses on this group ("cpu"
        # for gloo, "cuda" for NCCL), the same on every rank whatever device its tensors are on
        pick = getattr(dist.distributed_c10d, "_get_object_coll_device", None)  # private in torch 2.13
        self.collective_device = pick(self.group) if pick else "cpu"

    def error(self, what: str, step: Optional[int], cause: Exception) -> RingError:
        """``step=None``: the agreement check before the ring, a collective over the group."""
        limit = "the process group's timeout" if self.timeout is None else f"timeout={self.timeout.total_seconds():g} s"
        if step is None:
            where = "failed (an all_gather over the group)"
        else:
            where = (
                f"at step {step + 1} of {self.size} failed (send to rank {(self.rank + 1) % self.size}, "
                f"receive from rank {(self.rank - 1) % self.size})"
            )
        return RingError(
            f"ring attention, rank {self.rank} of {self.size}: {what} {where}; "
            f"another rank probably failed, exited or hung (waits are bounded by {limit}): "
            f"check the other ranks' logs. Cause: {cause}"
        )

    def all_gather(self, values: list[int], *, what: str) -> list[list[int]]:
        """Every rank's ``values`` (equal-length int lists; list index = group rank), one collective."""
        mine = torch.tensor(values, dtype=torch.int64)
        return torch.stack(self.gather(mine, what=what)).tolist()

    def gather(self, tensor: torch.Tensor, *, what: str) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (one shape and dtype on every rank; list index = group rank), on
        the collective device, in one all_gather."""
        mine = tensor.to(self.collective_device).contiguous()
        if self.size == 1:
            return [mine]
        gathered = [torch.empty_like(mine) for _ in range(self.size)]
        try:
            work = dist.all_gather(gathered, mine, group=self.group, async_op=True)
        except RuntimeError as e:
            raise self.error(what, None, e) from e
        return _Pending(self, [work], [mine], gathered, what, None).wait()

    def shift(self, tensors, *, tag: int, what: str, step: int, length: Optional[int] = None) -> _Pending:
        """Send ``tensors`` to the next rank and receive same-shaped ones from the previous, asynchronously;
        ``length``: the received ones hold this many tokens on their sequence axis (dim -2 of 4-D
        tensors, -1 of (B, n) ones) instead of as many as the sent ones (uneven shards)."""
        sent = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) if length is None else t.new_empty(_with_length(t.shape, length)) for t in sent]
        ops = []
        for i, (s, r) in enumerate(zip(sent, received)):
            ops.append(dist.P2POp(dist.isend, s, self.next, self.group, tag + i))
            ops.append(dist.P2POp(dist.irecv, r, self.prev, self.group, tag + i))
        try:
            works = dist.batch_isend_irecv(ops)
        except RuntimeError as e:
            raise self.error(what, step, e) from e
        return _Pending(self, works, sent, received, what, step)


def _with_length(shape, length: int) -> list[int]:
    """``shape`` with its sequence axis (dim -2 of (B, H, n, D), -1 of (B, n)) set to ``length``."""
    out = list(shape)
    out[-2 if len(out) == 4 else -1] = length
    return out


_TAG_KV = 0  # k, v, keep
_TAG_GRAD = 8  # dk, dv travelling home


# ---------------------------------------------------------------------------------- agreement
# Before the ring runs (forward, and again before the backward ring), every rank sends the
# others a descriptor of its call, one all_gather of a fixed-size int64 tensor, which cannot
# fail on mismatched sizes the way the ring's sends do. If any field differs, every rank raises
# the same ValueError. Without the check, shards of different lengths or byte sizes abort a
# process inside gloo (SIGABRT) and leave its peers with garbage, and dtypes of one byte size
# (float16 vs bfloat16) or a different causal flag give wrong results on every rank, silently.
#
# The descriptor, one int64 per field of _FIELDS, in that order:
#   0 format     _FORMAT ("RING" and the format version), or _REJECTED from a rank whose own
#                argument checks failed (it raises its own error; the others raise this one)
#   1 pass       0 forward, 1 backward (a rank in backward must not meet one in forward)
#   2-7          B, H, Hkv, Lk, D, Dv of q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv)
#   8 dtype      index in _DTYPES
#   9 device     the device type's name (e.g. "cpu", "cuda"), ASCII, first 8 bytes, little-endian
#  10 padding    bit 0: a key padding tensor travels with the keys; bit 1: document ids do
#  11 causal     1 or 0
#  12 layout     index in LAYOUTS (a DocumentLayout's code) with causal masking or a kind placed
#                by position, -1 without (the layout is then unused)
#  13 scale      the float64 bits of the scale, as an int64 (compared bit for bit)
#  14 autograd   1 if this call records the graph for backward (grad mode on and q, k or v
#                requires grad), else 0; always 1 in the backward pass
# Lq is not compared: queries never travel, so without causal masking the ranks may hold
# different numbers of them (with it, Lq == Lk on every rank). Lk is compared unless every rank's
# layout is contiguous or unused: contiguous shards may be uneven, and the table gives each
# rank's length (its global start is the sum of the lengths before it).
_FORMAT = 0x52494E47_0001
_REJECTED = -_FORMAT
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_PASSES = ("forward", "backward")


def _pack_name(name: str) -> int:
    return int.from_bytes(name.encode("ascii", "replace")[:8], "little")


def _unpack_name(code: int) -> str:
    return code.to_bytes(8, "little").rstrip(b"\0").decode("ascii", "replace")


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _bits_float(code: int) -> float:
    return struct.unpack("<d", struct.pack("<q", code))[0]


_SAME_MODEL = "every rank must run the same attention (the same model and head split)"
#: (what the value is, how to show it, how to fix a disagreement), one per descriptor field
_FIELDS = (
    ("descriptor", hex, "every rank must run the same version of multihead and call ring_attention (and its backward) at the same point of the program"),
    ("pass", lambda c: _PASSES[c], "backward runs its own ring: every rank must call backward on its share of the output (the same loss), in the same order, before its next ring_attention call"),
    ("batch size B", str, "every rank must hold the same batch; shard the sequence axis, not the batch"),
    ("query heads H", str, _SAME_MODEL),
    ("key/value heads Hkv", str, _SAME_MODEL),
    ("key/value shard length Lk", str, "zigzag and DocumentLayout shards must have the same length on every rank: cut them with shard_sequence, padding the sequence to a multiple of 2P and masking the padding with masks.key_padding (contiguous shards may be uneven)"),
    ("head dim D", str, _SAME_MODEL),
    ("value head dim Dv", str, _SAME_MODEL),
    ("dtype", lambda c: str(_DTYPES[c]), "cast q, k and v to one dtype on every rank, e.g. .to(torch.bfloat16)"),
    ("device type", _unpack_name, "put every rank's q, k and v on the same kind of device (each rank its own GPU, or all on CPU)"),
    ("key padding", lambda c: ("no", "yes")[c & 1] + (" (and document ids)" if c & 2 else ""),
     "pass mask=masks.key_padding(keep) on every rank or on none (keep all True on a shard without padding), "
     "and masks.documents(ids) likewise"),
    ("causal", lambda c: str(bool(c)), "pass the same causal= on every rank (mask=masks.causal() counts as causal=True)"),
    ("layout", lambda c: "unused (not causal)" if c < 0 else repr(LAYOUTS[c]) if c < len(LAYOUTS) else f"DocumentLayout #{c:x}",
     "pass the layout the shards were cut with, the same on every rank (a DocumentLayout of the same lengths)"),
    ("scale", lambda c: repr(_bits_float(c)), "pass the same scale= on every rank (None gives 1/sqrt(D))"),
    ("autograd", lambda c: ("does not record the graph", "records the graph")[c], "backward is a ring too, so every rank or none must record the graph: run every rank in the same grad mode, with the same inputs requiring grad"),
)
_PASS, _LK, _CAUSAL, _LAYOUT = 1, 5, 11, 12


def _describe(spec: "_Spec", q, k, v, keep, phase: str, records_graph: bool) -> list[int]:
    """This call's descriptor (see the table above)."""
    B, H, _, D = q.shape
    return [
        _FORMAT, _PASSES.index(phase), B, H, k.shape[1], k.shape[2], D, v.shape[-1],
        _DTYPES.index(q.dtype), _pack_name(q.device.type), int(keep is not None) | (2 if spec.ids is not None else 0),
        spec.causal,
        (spec.layout.code() if isinstance(spec.layout, DocumentLayout) else LAYOUTS.index(spec.layout))
        if spec.causal or spec.kinds else -1, _float_bits(spec.scale), records_graph,
    ]


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _agree(ring: _Ring, descriptor: list[int]) -> Optional[list[list[int]]]:
    """Raise the same ValueError on every rank of the ring unless they all sent ``descriptor``'s
    values; the table of every rank's descriptor when they agree (None for one rank)."""
    if ring.size == 1:
        return None
    phase = _PASSES[descriptor[_PASS]]
    table = ring.all_gather(descriptor, what=f"the check that the ranks agree (before the {phase} ring)")
    if descriptor[0] == _REJECTED:
        return None  # this rank raises its own error
    head = f"ring_attention, rank {ring.rank} of {ring.size}: "
    rejected = [r for r, row in enumerate(table) if row[0] == _REJECTED]
    if rejected:
        raise ValueError(
            f"{head}{_ranks(rejected)} rejected its arguments, so the ring ran on no rank; "
            f"the error on {_ranks(rejected)} says what to fix there"
        )
    columns = list(zip(*table))
    differ = [i for i, column in enumerate(columns) if len(set(column)) > 1]
    if set(columns[_LAYOUT]) <= {-1, LAYOUTS.index("contiguous")} and _LK in differ:
        differ.remove(_LK)  # contiguous shards may be uneven
    if not differ:
        return table
    for first in (0, _PASS):  # another descriptor format, or forward meeting backward: the rest is noise
        if first in differ:
            differ = [first]
    if _CAUSAL in differ and _LAYOUT in differ:
        differ.remove(_LAYOUT)
    lines: list[str] = []
    odd: set[int] = set()
    for i in differ:
        column = columns[i]
        by_value: dict[int, list[int]] = {}
        for r, value in enumerate(column):
            by_value.setdefault(value, []).append(r)
        common = max(by_value, key=lambda value: (len(by_value[value]), -by_value[value][0]))
        others = [value for value in by_value if value != common]
        odd.update(r for value in others for r in by_value[value])
        name, show, fix = _FIELDS[i]
        has = "; ".join(f"{_ranks(by_value[value])} {'has' if len(by_value[value]) == 1 else 'have'} {show(value)}" for value in others + [common])
        lines.append(f"  {name}: {has}. Fix: {fix}.")
    raise ValueError(
        f"{head}the ranks disagree, so the ring did not run (it would abort a process or give wrong "
        f"results); {_ranks(sorted(odd))} differ{'s' if len(odd) == 1 else ''} from the others:\n" + "\n".join(lines)
    )


def _announce_rejection(group, timeout) -> None:
    """This rank's own argument checks failed: send the others a _REJECTED descriptor so that
    they raise too instead of waiting for it (best effort; the caller raises its own error)."""
    try:
        _check_timeout(timeout)
    except ValueError:
        timeout = None
    try:
        ring = _Ring(group, timeout)
    except Exception:  # noqa: BLE001 - no usable group (not initialised, not a member): nobody to tell
        return
    if ring.size > 1:
        try:
            ring.all_gather([_REJECTED] + [0] * (len(_FIELDS) - 1), what="telling the other ranks that this one rejected its arguments")
        except RingError:
            pass


# ---------------------------------------------------------------------------------- block work
# Each ring step is the tile kernel (multihead.backends._tiles) on one (query segment, key
# segment) pair, with the pair's mask in local coordinates: key padding from the keep tensor
# that travels with the keys, and causal on the diagonal pairs (equal global positions). The
# partial results are combined with the kernel's merge, the rule of the module docstring.
def _block_pairs(q_segs, k_segs, causal: bool):
    """(q segment, k segment, diagonal) for every pair of segments with a visible key.

    Without causal masking each rank's shard is one segment. With it, segments are chunks of
    one grid: a key segment wholly before the query segment is fully visible, one wholly after
    is skipped, and the one at the same global positions is the diagonal (triangular) pair.
    """
    for qs in q_segs:
        for ks in k_segs:
            (_, qg, qn), (_, kg, kn) = qs, ks
            if not causal or kg + kn - 1 <= qg:
                yield qs, ks, False
            elif kg <= qg + qn - 1:
                yield qs, ks, True


def _block(k, v, keep, ids) -> list[torch.Tensor]:
    """What travels round the ring: k, v, and the key padding and document ids when given."""
    return [k, v] + ([] if keep is None else [keep]) + ([] if ids is None else [ids])


def _unblock(block, has_keep: bool, has_ids: bool):
    """(keep, ids) of a received :func:`_block`, each None when not sent."""
    rest = iter(block[2:])
    return (next(rest) if has_keep else None), (next(rest) if has_ids else None)


def _pieces(q_segs, k_segs, causal, q, k, v, keep, q_ids=None, k_ids=None):
    """(query rows, q, k, v, keep, diagonal, key rows, (q ids, k ids) or None, (q global start,
    k global start)) of each pair of :func:`_block_pairs`."""
    for (ql, qg, qn), (kl, kg, kn), diagonal in _block_pairs(q_segs, k_segs, causal):
        yield (
            slice(ql, ql + qn), q[..., ql:ql + qn, :], k[..., kl:kl + kn, :], v[..., kl:kl + kn, :],
            None if keep is None else keep[:, kl:kl + kn], diagonal, slice(kl, kl + kn),
            None if q_ids is None else (q_ids[:, ql:ql + qn], k_ids[:, kl:kl + kn]), (qg, kg),
        )


class _Placed:
    """The position-dependent parts (window, chunked_local, alibi) of the whole sequence's mask:
    the rule is `Mask.row_intervals` / `Mask.row_diagonals` of the whole sequence (per document
    with documents), computed once per call, each (B|1, L) int64 in global positions (O(L) ints
    per rank); a block pair slices its global query rows and moves the keys to its segment's
    start, the tile kernel's local coordinates."""

    def __init__(self, intervals: Optional[list[tuple[torch.Tensor, torch.Tensor]]],
                 diagonals: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        #: (lo, hi) per interval of the selecting parts, or None without window / chunked_local
        self.intervals: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = intervals
        #: (slopes (H,), diagonal keys) per ALiBi part
        self.diagonals: list[tuple[torch.Tensor, torch.Tensor]] = diagonals

    def at(self, qg: int, qn: int, kg: int, dtype: torch.dtype) -> tuple[Optional[_masks.Mask], list[_masks.Mask]]:
        """(the selecting mask_mod or None, the ALiBi score mods in the scores' ``dtype``) of the
        block pair whose ``qn`` queries start at global position ``qg`` and keys at ``kg``."""
        rows = slice(qg, qg + qn)
        select = None
        if self.intervals is not None:
            select = _masks.mask_mod(_flex._intervals_mod([(lo[:, rows] - kg, hi[:, rows] - kg)
                                                           for lo, hi in self.intervals]))
        adds = [_masks.score_mod(_flex._alibi(slopes.to(dtype), d[:, rows] - kg), tensors=(slopes,))
                for slopes, d in self.diagonals]
        return select, adds


def _place(kinds, ids: Optional[torch.Tensor], shape, device: torch.device) -> Optional[_Placed]:
    """`_Placed` of a self-attention sequence of ``shape`` = (B, H, L, L) whose document ids
    (B|1, L) are ``ids`` (None: one document), with its tensors on ``device``; None without a
    window, chunked_local or alibi part among ``kinds``."""
    placed = [p for p in kinds if isinstance(p, (_masks.Window, _masks.ChunkedLocal, _masks.ALiBi))]
    if not placed:
        return None
    whole: _masks.Mask = _masks.documents(ids) if ids is not None else placed[0]
    for p in placed[0 if ids is not None else 1:]:
        whole = whole & p
    intervals = None
    if any(p.is_structural for p in placed):
        got = whole.row_intervals(shape)
        assert got is not None
        intervals = [(lo.to(device), hi.to(device)) for lo, hi in got]
    diagonals = [(p.slopes, whole.row_diagonals(shape, p.align).to(device)) for p in placed if isinstance(p, _masks.ALiBi)]
    return _Placed(intervals, diagonals)


def _block_tiles(q, k, v, keep, diagonal: bool, scale: float, ids=None, kinds=(),
                 placed: Optional[_Placed] = None, at=(0, 0)) -> _tiles.Tiles:
    """The tile kernel's problem for q (B, H, n, D) against one key segment k (B, Hkv, m, D),
    v (B, Hkv, m, Dv), with key padding ``keep`` (B, m) or None, document ids ``(q ids (B|1, n),
    k ids (B|1, m))`` or None, causal when ``diagonal`` (the segments hold the same positions,
    so causal per document is causal by position there), the softcap parts of ``kinds``, and
    the window, chunked_local and ALiBi of ``placed`` at the pair's global query and key starts
    ``at`` (ALiBi adds before the softcap modifies, as in ``multihead.attention``)."""
    mask = None if keep is None else _masks.key_padding(keep)
    if ids is not None:
        docs = _masks.documents(ids[0], ids[1])
        mask = docs if mask is None else docs & mask
    if diagonal:
        mask = _masks.causal() if mask is None else _masks.causal() & mask
    select, adds = (None, []) if placed is None else placed.at(at[0], q.shape[2], at[1], compute_dtype(q.dtype))
    if select is not None:
        mask = select if mask is None else mask & select
    mods = list(adds) + [part for part in kinds if isinstance(part, _masks.Softcap)]
    groups = q.shape[1] // k.shape[1]
    return _tiles.Tiles(q, k, v, mask, (), mods, scale=scale, block_q=_chunked.default_block_q(groups),
                        block_k=_chunked.BLOCK_K, mask_shape=(q.shape[0], q.shape[1], q.shape[2], k.shape[2]))


def _attend_block(q, k, v, keep, diagonal, scale, out, lse, ids=None, kinds=(), placed=None, at=(0, 0)):
    """Merge attention of q to one key segment into the running ``out`` and ``lse``, in place.

    q (B, H, n, D), k (B, Hkv, m, D), v (B, Hkv, m, Dv) as the caller has them; out
    (B, H, n, Dv) and lse (B, H, n) in the compute dtype accumulate over segments (lse = -inf:
    no visible key yet).
    """
    tiles = _block_tiles(q, k, v, keep, diagonal, scale, ids, kinds, placed, at)
    block_out, block_lse = tiles.forward()
    merged_out, merged_lse = _tiles.merge([out, tiles.ungroup_rows(block_out)], [lse, tiles.ungroup_lse(block_lse)])
    out.copy_(merged_out)
    lse.copy_(merged_lse)


def _attend_block_backward(q, k, v, keep, diagonal, scale, out, lse, dout, dq, dk, dv, ids=None, kinds=(),
                           placed=None, at=(0, 0)):
    """Add this key segment's share of the gradients into dq (B, H, n, D) (local) and dk
    (B, Hkv, m, D), dv (B, Hkv, m, Dv) (the segment's), in place; out, lse, dout are the
    whole sequence's (compute dtype), so p = exp(s - lse) are the final softmax weights."""
    tiles = _block_tiles(q, k, v, keep, diagonal, scale, ids, kinds, placed, at)
    dqs, dks, dvs, _, _ = tiles.backward(tiles.group_rows(out), tiles.group_lse(lse), tiles.group_rows(dout), None)
    dq += tiles.ungroup_rows(dqs)
    dk += dks.view(dk.shape)
    dv += dvs.view(dv.shape)


class _Spec:
    """What the ring needs besides the tensors: the group, layout and masking choices."""

    def __init__(self, ring: _Ring, causal: bool, layout: str, scale: float, ids: Optional[torch.Tensor] = None,
                 kinds: tuple = ()):
        self.ring, self.causal, self.layout, self.scale = ring, causal, layout, scale
        #: this rank's (B|1, L/P) document ids (masks.documents), or None; they travel with the keys
        self.ids = ids
        #: window, chunked_local, alibi and softcap parts (the first three placed by :attr:`placed`)
        self.kinds = kinds
        #: every rank's key/value shard length (from the agreement table), or None: all equal
        self.lengths: Optional[list[int]] = None
        #: window, chunked_local and alibi of the whole sequence (`_place`), or None
        self.placed: Optional[_Placed] = None

    def place(self, B: int, H: int, Lq: int, device: torch.device) -> None:
        """Compute :attr:`placed` once per call, after the ranks agree (the same kinds on every
        rank): with documents, the whole sequence's ids are gathered from every rank's shard."""
        lengths = self.lengths or [Lq] * self.ring.size
        ids = None
        if self.ids is not None and any(isinstance(p, (_masks.Window, _masks.ChunkedLocal, _masks.ALiBi))
                                        for p in self.kinds):
            mine = self.ids.expand(B, -1)
            padded = torch.nn.functional.pad(mine, (0, max(lengths) - mine.shape[-1]), value=-1)  # uneven shards
            shards = self.ring.gather(padded, what="gathering the document ids")
            ids = unshard_sequence([t[:, :n].to(self.ids.device) for t, n in zip(shards, lengths)], self.layout,
                                   dim=-1)
        L = sum(lengths)
        self.placed = _place(self.kinds, ids, (B, H, L, L), device)

    def length(self, owner: int, local_len: int) -> Optional[int]:
        """Tokens of rank ``owner``'s key/value block, None when every block has ``local_len``."""
        return None if self.lengths is None or len(set(self.lengths)) == 1 else self.lengths[owner]

    def segments(self, owner: int, local_len: int):
        return _plan_segments(self.layout, owner, self.ring.size, local_len, self.causal or bool(self.kinds),
                              self.lengths)


def _plan_segments(layout, owner: int, world_size: int, local_len: int, split: bool,
                   lengths: Optional[list[int]] = None) -> list[tuple[int, int, int]]:
    """The segments the ring pairs up for rank ``owner``'s shard: the layout's pieces when
    positions matter (``split``: causal, or a kind placed by position), else the whole shard.
    ``lengths``: every rank's shard length, for uneven contiguous shards."""
    if not split:
        return [(0, 0, local_len)]
    if layout == "contiguous" and lengths is not None:
        return [(0, sum(lengths[:owner]), lengths[owner])]
    return _pieces_of(layout, owner, world_size, local_len)


def _owner(rank: int, step: int, world_size: int) -> int:
    """Whose key/value block rank ``rank`` holds at ring step ``step`` (blocks move r -> r+1)."""
    return (rank - step) % world_size


_Segment = tuple[int, int, int]


def ring_plan(world_size: int, seq_len: int, *, layout: "str | DocumentLayout | None" = None,
              mask: Optional[_masks.Mask] = None, causal: bool = False,
              heads: int = 1) -> list[list[list[tuple[_Segment, _Segment, bool]]]]:
    """What the ring computes: ``plan[step][rank]`` lists the ``(q segment, k segment, diagonal)``
    pairs rank ``rank`` attends at step ``step`` (segments ``(local start, global start, length)``;
    ``diagonal``: the causal triangle), the key block held then being rank ``(rank - step) % P``'s.
    The same rule `ring_attention` follows, for a self-attention sequence of ``seq_len`` tokens
    with ``mask`` written for the whole sequence (documents' ids (L,) or (1, L)) and ``layout``
    as in `ring_attention` (default zigzag when causal, else contiguous).

    >>> from multihead.distributed import ring_plan
    >>> plan = ring_plan(2, 8, causal=True)          # zigzag: rank 0 holds tokens 0-1 and 6-7
    >>> step1 = plan[1]                              # step 1: rank r holds rank r-1's keys
    >>> step1[0]                                     # rank 0's chunk 6-7 sees all of rank 1's
    [((2, 6, 2), (0, 2, 2), False), ((2, 6, 2), (2, 4, 2), False)]
    """
    for given, name in ((world_size, "world_size (the ranks P)"), (seq_len, "seq_len")):
        value: object = given  # checked as the user may pass anything
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 1:
            raise ValueError(f"{name} must be a positive int, got {given!r}")
    m = _masks.as_mask(mask)
    mask_causal, _, _, kinds = _split_mask(m, (1, heads, seq_len, seq_len), torch.device("cpu"))
    causal = bool(causal) or mask_causal
    layout = ("zigzag" if causal else "contiguous") if layout is None else _check_layout(layout)
    if isinstance(layout, DocumentLayout):
        if sum(layout.lengths) != seq_len:
            raise ValueError(f"the DocumentLayout's lengths sum to {sum(layout.lengths)} but the sequence has {seq_len} tokens")
        layout.check(world_size)
    else:
        parts = world_size * _chunks_per_rank(layout)
        if seq_len % parts:
            raise ValueError(f"a {layout} ring over P={world_size} ranks cuts the sequence into {parts} equal chunks: "
                             f"{seq_len} tokens is not a multiple of {parts}; pad the sequence or choose another P")
    split = causal or bool(kinds)
    local = seq_len // world_size
    segs = [_plan_segments(layout, r, world_size, local, split) for r in range(world_size)]
    return [[list(_block_pairs(segs[r], segs[_owner(r, step, world_size)], causal)) for r in range(world_size)]
            for step in range(world_size)]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, keep, spec: _Spec, sink=None):
        ring = spec.ring
        B, H, Lq, _ = q.shape
        cdt = compute_dtype(q.dtype)
        out = q.new_zeros(B, H, Lq, v.shape[-1], dtype=cdt)
        lse = q.new_full((B, H, Lq), _NEG_INF, dtype=cdt)
        q_segs = spec.segments(ring.rank, Lq)
        block = _block(k, v, keep, spec.ids)
        for step in range(ring.size):
            owner = _owner(ring.rank, step, ring.size)
            pending = None
            if step < ring.size - 1:  # start passing the block on while computing with it
                pending = ring.shift(block, tag=_TAG_KV, what="passing key/value blocks", step=step,
                                     length=spec.length(_owner(ring.rank, step + 1, ring.size), k.shape[2]))
            kp, kids = _unblock(block, keep is not None, spec.ids is not None)
            for qsl, qb, kb, vb, kps, diagonal, _, ids, at in _pieces(q_segs, spec.segments(owner, block[0].shape[2]), spec.causal,
                                                                      q, block[0], block[1], kp, spec.ids, kids):
                _attend_block(qb, kb, vb, kps, diagonal, spec.scale, out[..., qsl, :], lse[..., qsl], ids, spec.kinds,
                              spec.placed, at)
            if pending is not None:
                block = pending.wait()
        if sink is not None:  # the sink's exp(logit_h) joins each row's denominator once, after every block
            merged = torch.logaddexp(lse, sink.to(cdt).view(1, -1, 1))
            out.mul_(torch.exp(lse - merged).nan_to_num_(0.0).unsqueeze(-1))
            lse = merged
        ctx.spec = spec
        ctx.save_for_backward(q, k, v, keep, out, lse, sink)
        return out.to(q.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, keep, out, lse, sink = ctx.saved_tensors
        spec = ctx.spec
        ring = spec.ring
        _agree(ring, _describe(spec, q, k, v, keep, "backward", True))
        Lq = q.shape[2]
        cdt = out.dtype
        dout = grad_out.to(cdt)
        dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
        q_segs = spec.segments(ring.rank, Lq)
        block = _block(k, v, keep, spec.ids)
        grads_out = None  # (dk, dv) of the block held in the previous step, summed so far
        for step in range(ring.size):
            owner = _owner(ring.rank, step, ring.size)
            pending_kv = pending_grad = None
            if step < ring.size - 1:
                pending_kv = ring.shift(block, tag=_TAG_KV, what="passing key/value blocks (backward)", step=step,
                                        length=spec.length(_owner(ring.rank, step + 1, ring.size), k.shape[2]))
            if grads_out is not None:  # the previous block's gradients move on with it
                pending_grad = ring.shift(grads_out, tag=_TAG_GRAD, what="passing dk/dv", step=step,
                                          length=spec.length(owner, k.shape[2]))  # this step's block's
            kp, kids = _unblock(block, keep is not None, spec.ids is not None)
            dk = torch.zeros(block[0].shape, dtype=cdt, device=q.device)
            dv = torch.zeros(block[1].shape, dtype=cdt, device=q.device)
            for qsl, qb, kb, vb, kps, diagonal, ksl, ids, at in _pieces(q_segs, spec.segments(owner, block[0].shape[2]), spec.causal,
                                                                        q, block[0], block[1], kp, spec.ids, kids):
                _attend_block_backward(qb, kb, vb, kps, diagonal, spec.scale, out[..., qsl, :], lse[..., qsl],
                                       dout[..., qsl, :], dq[..., qsl, :], dk[..., ksl, :], dv[..., ksl, :], ids,
                                       spec.kinds, spec.placed, at)
            if pending_grad is not None:
                dk_in, dv_in = pending_grad.wait()
                dk, dv = dk + dk_in, dv + dv_in
            grads_out = [dk, dv]
            if pending_kv is not None:
                block = pending_kv.wait()
        if ring.size > 1:  # the last block's gradients are complete: send them home
            grads_out = ring.shift(grads_out, tag=_TAG_GRAD, what="returning dk/dv to their owner", step=ring.size - 1,
                                   length=spec.length(ring.rank, k.shape[2])).wait()
        dk, dv = grads_out
        dsink = None
        if sink is not None and ctx.needs_input_grad[5]:  # d logit_h = -Σ_rows p_sink · (dout · out)
            p_sink = torch.exp(sink.to(cdt).view(1, -1, 1) - lse)
            dsink = -(p_sink * (dout * out).sum(-1)).sum(dim=(0, 2)).to(sink.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, dsink


# ---------------------------------------------------------------------------------- public
def _split_mask(mask, shape, device) -> tuple[bool, Optional[torch.Tensor], Optional[torch.Tensor], tuple]:
    """(has a causal part, the (B, Lk) keep tensor or None, the (B|1, Lk) document ids or None,
    the window / chunked_local / alibi / softcap parts in written order) of a mask the ring can carry."""
    m = _masks.as_mask(mask)
    if m is None:
        return False, None, None, ()
    causal, keep, ids, kinds = False, None, None, []
    for part in m.parts:
        if isinstance(part, _masks.Causal):
            causal = True
        elif isinstance(part, _masks.KeyPadding):
            part.check(shape, device)
            keep = part.tensor if keep is None else keep & part.tensor
        elif isinstance(part, _masks.Documents) and part.kv_ids is part.q_ids:
            if part.q_ids.shape[-1] != shape[3] or shape[2] != shape[3] or part.q_ids.shape[0] not in (1, shape[0]):
                raise ValueError(
                    f"ring_attention takes masks.documents(ids) with ids (B, L/P) this rank's shard of the "
                    f"sequence's ids (shard_sequence(ids, rank, P, layout, dim=-1)), for q and k cut from one "
                    f"sequence; got ids of shape {tuple(part.q_ids.shape)} for q {shape[2]} and k {shape[3]} tokens")
            part.check(shape, device)
            ids = part.q_ids
        elif isinstance(part, (_masks.Softcap, _masks.Sink)) or (
                isinstance(part, (_masks.Window, _masks.ChunkedLocal, _masks.ALiBi))
                and not (isinstance(part, _masks.ALiBi) and part.slopes.dim() != 1)):
            part.check(shape, device)
            kinds.append(part)
        else:
            raise ValueError(
                f"ring_attention takes mask=None, masks.key_padding(keep) with this rank's (B, Lk) "
                f"shard of keep, masks.documents(ids) with this rank's shard of the ids, masks.causal(), "
                f"window (with sinks), chunked_local, alibi ((H,) slopes) and softcap; got {part!r}. A dense "
                "mask or bias cannot travel with the key blocks; multihead.ulysses.ulysses_attention takes "
                "every mask kind (sink logits, score and mask mods, ...)"
            )
    placed = [p for p in kinds if not isinstance(p, (_masks.Softcap, _masks.Sink))]
    if placed and shape[2] != shape[3]:
        raise ValueError(
            f"ring_attention places {placed[0]!r} at the whole sequence's positions (per document with "
            f"documents), for self-attention of one sequence: q and k cut alike, got Lq={shape[2]} and "
            f"Lk={shape[3]} on this rank; shard q, k and v with the same shard_sequence call, or use "
            "multihead.ulysses.ulysses_attention")
    return causal, keep, ids, tuple(kinds)


def mask_signature(mask: Optional[_masks.Mask]) -> str:
    """The kinds and parameters of ``mask`` that every rank must share (the shards of key padding
    and document ids excepted): what the ranks compare before a ring or all-to-all call."""
    if mask is None:
        return "none"
    parts = []
    for p in mask.parts:
        if isinstance(p, (_masks.KeyPadding, _masks.Documents)):
            parts.append(p.kind)
            continue
        text = repr(p)
        for name in ("slopes", "logits"):
            t = getattr(p, name, None)
            if isinstance(t, torch.Tensor):
                text += f" {name}={zlib.crc32(t.detach().double().cpu().numpy().tobytes()):08x}"
        parts.append(text)
    return " & ".join(parts)


def _agree_on(ring: _Ring, name: str, mine: str, fix: str, *, head: str) -> None:
    """Every rank raises the same ValueError unless all sent the same ``mine`` (compared by crc32)."""
    if ring.size == 1:
        return
    table = [row[0] for row in ring.all_gather([zlib.crc32(mine.encode())], what=f"comparing {name}")]
    if len(set(table)) == 1:
        return
    groups: dict[int, list[int]] = {}
    for r, c in enumerate(table):
        groups.setdefault(c, []).append(r)
    shown = "; ".join(_ranks(rs) + " agree" for rs in groups.values())
    raise ValueError(f"{head}, rank {ring.rank} of {ring.size}: the ranks disagree on the {name} ({shown}; this "
                     f"rank has {mine}), so nothing ran. Fix: {fix}.")


def _check_timeout(timeout) -> None:
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or timeout <= 0):
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")


def _check_call(q, k, v, mask, causal, scale, layout, timeout):
    """(scale, causal, layout, keep, ids) of a ring_attention call, from this rank's arguments alone."""
    check_qkv(q, k, v)
    scale = check_scale(scale, q.shape[-1])
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    _check_timeout(timeout)
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    mask_causal, keep, ids, kinds = _split_mask(mask, (B, H, Lq, Lk), q.device)
    causal = causal or mask_causal
    layout = ("zigzag" if causal else "contiguous") if layout is None else _check_layout(layout)
    if causal and Lq != Lk:
        raise ValueError(
            f"causal ring attention needs q and k cut from one sequence: got Lq={Lq} queries and "
            f"Lk={Lk} keys on this rank; shard q, k and v with the same shard_sequence call"
        )
    if causal and layout == "zigzag" and Lq % 2:
        raise ValueError(
            f"a zigzag shard holds two equal chunks, so its length must be even, got {Lq}; "
            "pad the sequence to a multiple of 2P"
        )
    return scale, causal, layout, keep, ids, kinds


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask=None,
    *,
    causal: bool = False,
    scale: Optional[float] = None,
    group=None,
    layout: Optional[str] = None,
    timeout: Optional[float] = None,
) -> torch.Tensor:
    """Attention over a sequence sharded across the ranks of ``group``; call it on every rank.

    Args:
        q: (B, H, Lq, D), this rank's queries (Lq = L/P).
        k: (B, Hkv, Lk, D), this rank's keys; Hkv divides H (GQA: query head i reads kv head i // g).
        v: (B, Hkv, Lk, Dv), this rank's values.
        mask: None, or ``masks.key_padding(keep)`` with keep (B, Lk) this rank's shard of the
            padding (True = real token; it travels with the keys), and/or ``masks.documents(ids)``
            with ids (B|1, L/P) this rank's shard of packed documents' ids (they travel with the
            keys too; only tiles within a document are computed), optionally ``& masks.causal()``
            (per document); sink logits (``masks.sink``, added to each row's denominator once,
            after the ring; each rank's logits gradient is its rows' share); and window (with
            sinks), chunked_local, alibi ((H,) slopes) and softcap, with or without documents:
            every rank computes the whole sequence's row intervals and diagonals once
            (``Mask.row_intervals``, ``Mask.row_diagonals``; per document with documents, whose
            ids the ranks then gather, O(L) ints), and each block pair reads them at its global
            rows and key offset. Other masks raise ValueError
            (``multihead.ulysses.ulysses_attention`` takes every kind).
        causal: token i attends to tokens j <= i by global position (needs Lq == Lk).
        scale: multiplies q·kᵀ; default 1/√D.
        group: the process group whose ranks hold the shards (default: the whole world), in
            sequence order of their group ranks.
        layout: how the shards were cut, ``"contiguous"`` or ``"zigzag"`` (see
            :func:`shard_sequence`); default zigzag when causal, else contiguous. Without
            causal masking the layout does not change the result.
        timeout: seconds to wait for a block before raising :class:`RingError` (default: the
            process group's timeout).

    Returns:
        (B, H, Lq, Dv), this rank's rows of ``multihead.attention`` on the whole sequence
        (rows with no visible key give 0). Differentiable: gradients are those of the whole
        sequence, each rank receiving its shard's.

    Every rank must make the same call: keys and values of one shape, dtype and device type,
    the same heads, head dims, scale, causal flag and layout, key padding on every rank or on
    none, and the graph recorded for backward on every rank or on none (queries may differ in
    number without causal masking). One small all_gather checks this before the ring, and
    again before the backward ring; if any rank differs, every rank raises the same
    ValueError naming the ranks, the field, their values and the fix (and if one rank's own
    arguments are rejected, the others raise too). Zigzag and DocumentLayout shards have equal
    lengths (L a multiple of 2P); contiguous shards may differ in length (rank r's starts after
    the tokens of ranks 0 .. r-1), so a sequence need not be padded. Computation is in float32 for half inputs.

    Not checked: that the ranks pass the same group and hold shards of one sequence, cut the
    way ``layout`` says; and, in backward, that every rank runs the backward of the same call
    when two calls have equal descriptors. A rank that calls backward while another never
    does waits ``timeout`` seconds, then raises :class:`RingError`.
    """
    try:  # the checks of this rank's own arguments
        scale, causal, layout, keep, ids, kinds = _check_call(q, k, v, mask, causal, scale, layout, timeout)
        sink = next((p.logits for p in kinds if isinstance(p, _masks.Sink)), None)
        kinds = tuple(p for p in kinds if not isinstance(p, _masks.Sink))
    except (TypeError, ValueError):
        _announce_rejection(group, timeout)
        raise
    spec = _Spec(_Ring(group, timeout), causal, layout, scale, ids, kinds)
    records_graph = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    table = _agree(spec.ring, _describe(spec, q, k, v, keep, "forward", records_graph))
    spec.lengths = None if table is None else [row[_LK] for row in table]
    _agree_on(spec.ring, "mask kinds and parameters", mask_signature(_masks.as_mask(mask)),
              "pass the same mask on every rank (only the key padding and document ids are per-rank shards)",
              head="ring_attention")
    spec.place(q.shape[0], q.shape[1], q.shape[2], q.device)
    return _RingAttention.apply(q, k, v, keep, spec, sink)


class ContextParallel(nn.Module):
    """Runs a :class:`multihead.MultiHeadAttention` on a sequence sharded across ``group``.

    The module's own steps run on this rank's tokens (its projections and head split, RoPE at
    the shard's global positions from :func:`shard_positions`, the head merge and output
    projection); only its attention step becomes :func:`ring_attention`. The module's
    ``causal`` setting is honoured (zigzag layout by default). Parameters are shared with the
    wrapped module, not copied.

    Each rank's parameter gradients are its shard's share: sum them over the group
    (``torch.distributed.all_reduce(p.grad, group=group)``) to get the gradients of the whole
    sequence, as data parallelism does.

    Args:
        mha: the module; dropout must be 0 (or the module in eval mode).
        group: the process group holding the shards (default: the whole world).
        layout: see :func:`ring_attention`.
        timeout: see :func:`ring_attention`.
    """

    def __init__(self, mha: nn.Module, group=None, *, layout: Optional[str] = None, timeout: Optional[float] = None):
        super().__init__()
        from ..module import MultiHeadAttention

        if not isinstance(mha, MultiHeadAttention):
            raise TypeError(f"mha must be a multihead.MultiHeadAttention, got {type(mha).__name__}")
        self.mha = mha
        self.group = group
        self.layout = None if layout is None else _check_layout(layout)
        self.timeout = timeout

    def forward(self, query: torch.Tensor, key: Optional[torch.Tensor] = None, value: Optional[torch.Tensor] = None, *, mask=None) -> torch.Tensor:
        """query (B, Lq, d_in), key (B, Lk, kdim), value (B, Lk, vdim): this rank's shards
        (key/value default to query). mask: None or ``masks.key_padding`` of the (B, Lk) shard.
        Returns (B, Lq, d_out), this rank's rows of the module's output on the whole sequence."""
        mha, cfg = self.mha, self.mha.config
        key, value = mha._defaults(query, key, value)
        mha._check_inputs(query, key, value)
        if mha.training and cfg.dropout > 0:
            raise ValueError(
                f"the module has dropout={cfg.dropout}, which ring attention does not apply; "
                "call mha.eval() or build it with dropout=0"
            )
        layout = self.layout or ("zigzag" if cfg.causal else "contiguous")
        q, k, v = mha._project(query, key, value, None)
        if mha.rope is not None:  # self-attention (checked above): the queries' positions are the keys'
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(
                    "ContextParallel needs torch.distributed: call torch.distributed.init_process_group"
                    "(backend='gloo' or 'nccl') first, e.g. in a script launched with torchrun"
                )
            rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
            positions = shard_positions(rank, world, query.shape[1] * world, layout, device=query.device)
            q, k = mha._rotate(q, k, positions, None)
        o = ring_attention(
            q, k, v, mask, causal=cfg.causal, scale=default_scale(cfg.head_dim), group=self.group,
            layout=layout, timeout=self.timeout,
        )
        return mha._merge_output(o, None)


def context_parallel(mha: nn.Module, group=None, *, layout: Optional[str] = None, timeout: Optional[float] = None) -> ContextParallel:
    """``ContextParallel(mha, group, layout=..., timeout=...)``: the module on a sharded sequence."""
    return ContextParallel(mha, group, layout=layout, timeout=timeout)
