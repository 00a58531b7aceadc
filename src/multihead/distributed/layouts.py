"""How one sequence is cut across the P ranks of a context-parallel group: the layouts.

Layouts (the sequence axis is dim -2; P = 2 ranks, L = 8 tokens)::

    contiguous  rank 0: 0 1 2 3          rank 1: 4 5 6 7
    zigzag      rank 0: 0 1 | 6 7        rank 1: 2 3 | 4 5

With a causal mask, contiguous shards give rank 0 one block of work and rank P-1 P blocks;
zigzag (the sequence cut in 2P chunks, rank r holding chunks r and 2P-1-r) gives every rank the
same work, so it is the default when ``causal=True``. :func:`shard_sequence` and
:func:`unshard_sequence` produce and invert both layouts; :func:`shard_positions` gives the
global token positions of a shard (for rotary embeddings).

A `DocumentLayout` cuts packed documents zigzag inside each document instead (causal work
balanced per document).

Legend: B batch, H query heads, Hkv key/value heads, g = H // Hkv, L sequence length, P ranks
in the group, Lq/Lk local (per-rank) query/key lengths, D head dim, Dv value head dim.
"""

from __future__ import annotations

import numbers
import zlib
from typing import Sequence

import torch

__all__ = ["LAYOUTS", "DocumentLayout", "shard_sequence", "unshard_sequence", "shard_positions"]

LAYOUTS = ("contiguous", "zigzag")


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
