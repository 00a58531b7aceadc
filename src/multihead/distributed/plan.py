"""Who computes what: the ring's plan (the (query segment, key segment) pairs each rank attends at
each step) and each rank's causal work under a layout (the balance the layouts trade).
"""

from __future__ import annotations

import numbers
from typing import Optional

import torch

from .. import masks as _masks
from .layouts import DocumentLayout, _check_layout, _chunks_per_rank, _pieces_of, _segments
from .ring_masks import _split_mask

__all__ = ["rank_work", "ring_plan"]


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


def _pieces(q_segs, k_segs, causal, q, k, v, keep, q_ids=None, k_ids=None):
    """(query rows, q, k, v, keep, diagonal, key rows, (q ids, k ids) or None, (q global start,
    k global start)) of each pair of :func:`_block_pairs`."""
    for (ql, qg, qn), (kl, kg, kn), diagonal in _block_pairs(q_segs, k_segs, causal):
        yield (
            slice(ql, ql + qn), q[..., ql:ql + qn, :], k[..., kl:kl + kn, :], v[..., kl:kl + kn, :],
            None if keep is None else keep[:, kl:kl + kn], diagonal, slice(kl, kl + kn),
            None if q_ids is None else (q_ids[:, ql:ql + qn], k_ids[:, kl:kl + kn]), (qg, kg),
        )


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
