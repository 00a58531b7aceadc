"""The masks a ring carries: split out of the caller's mask (causal, key padding and document
ids that travel with the keys, the kinds placed by position, softcap and sinks), and the
position-dependent kinds computed once for the whole sequence and read by each block pair.

Legend: B batch, H query heads, L sequence length, Lq/Lk local (per-rank) query/key lengths.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import masks as _masks
from ..backends import flex_masks as _flex_masks
from ..masks.scores import alibi_score_mod


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
                "mask or bias cannot travel with the key blocks; multihead.distributed.ulysses_attention takes "
                "every mask kind (sink logits, score and mask mods, ...)"
            )
    placed = [p for p in kinds if not isinstance(p, (_masks.Softcap, _masks.Sink))]
    if placed and shape[2] != shape[3]:
        raise ValueError(
            f"ring_attention places {placed[0]!r} at the whole sequence's positions (per document with "
            f"documents), for self-attention of one sequence: q and k cut alike, got Lq={shape[2]} and "
            f"Lk={shape[3]} on this rank; shard q, k and v with the same shard_sequence call, or use "
            "multihead.distributed.ulysses_attention")
    return causal, keep, ids, tuple(kinds)


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
            select = _masks.mask_mod(_flex_masks.intervals_mod([(lo[:, rows] - kg, hi[:, rows] - kg)
                                                           for lo, hi in self.intervals]))
        adds = [_masks.score_mod(alibi_score_mod(slopes.to(dtype), d[:, rows] - kg), tensors=(slopes,))
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
