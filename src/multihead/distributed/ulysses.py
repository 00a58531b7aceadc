"""All-to-all (Ulysses) context parallelism: every mask kind, on a sequence sharded across ranks.

The ring (`multihead.distributed.ring_attention`) keeps each rank's queries and passes the
key/value blocks round; only masks that can travel with the blocks (causal, key padding,
documents) work there. Ulysses (DeepSpeed's) trades the sequence axis for the head axis
instead: one all-to-all turns each rank's (B, H, L/P, D) shard into all L tokens of H/P heads,
every rank runs ordinary attention on its heads over the whole sequence, with any mask, and a
second all-to-all turns the result back into the rank's (B, H, L/P, Dv) shard::

    rank r: q (B, H, L/P, D) --all-to-all--> (B, H/P, L, D) --attention(mask)--> (B, H/P, L, Dv)
            --all-to-all--> out (B, H, L/P, Dv)

So a mask describes the whole sequence (global positions), as for `multihead.attention`:
causal, window (with sinks), chunked_local, ALiBi (the rank applies its heads' slopes), softcap,
score and mask mods, sink logits (its heads'), and documents and key padding, given as this
rank's shards (``masks.documents(ids_shard)``, ``masks.key_padding(keep_shard)``, as for the
ring: they are all-gathered). Shards may have different lengths (contiguous layout, no
padding needed); the zigzag layout is undone before attention and redone after.

Needs P to divide H and Hkv (each rank takes whole heads; with fewer kv heads than ranks use
the ring). Autograd runs through both all-to-alls (their backward is the reverse all-to-all).
Before any transfer the ranks compare their calls (shapes, dtype, scale, layout, and the mask's
kinds and parameters) in two small all_gathers and all raise the same ValueError if they differ.

**Hybrid** (yunchang's USP), for more ranks than heads: `hybrid_groups(G)` splits the P ranks
into P/G all-to-all groups of G consecutive ranks and G rings across them; `hybrid_attention`
turns each rank's shard into its group's G·L/P tokens of H/G heads (all-to-all inside the
group), runs `multihead.distributed.ring_attention` across the groups on them (the masks the
ring carries), and turns the result back. G must divide H and Hkv; the shards are contiguous.

Legend: B batch, H query heads, Hkv key/value heads, L sequence length, P ranks, D head dim,
Dv value head dim.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from .. import masks as _masks
from .agreement import _agree, _agree_on, _announce_rejection, _describe, mask_signature
from .layouts import _check_layout, shard_sequence, unshard_sequence
from .ring import _Spec, ring_attention
from .transport import _check_timeout, _Ring
from .._checks import check_qkv, check_scale
from ..functional import attention

__all__ = ["ulysses_attention", "hybrid_groups", "hybrid_attention"]


def _heads_of(part: _masks.Mask, h0: int, h1: int) -> _masks.Mask:
    """``part`` for query heads h0 .. h1-1 (per-head parameters sliced)."""
    if isinstance(part, _masks.ALiBi):
        return _masks.alibi(part.slopes[..., h0:h1], align=part.align)
    if isinstance(part, _masks.Sink):
        return _masks.sink(part.logits[h0:h1])
    return part


def _local_mask(mask: Optional[_masks.Mask], h0: int, h1: int, keep: Optional[torch.Tensor],
                ids: Optional[torch.Tensor]) -> Optional[_masks.Mask]:
    """The whole-sequence mask of heads h0 .. h1-1, with the gathered keep (B, L) and ids (B|1, L)."""
    if mask is None:
        return None
    out: Optional[_masks.Mask] = None
    for p in mask.parts:
        if isinstance(p, _masks.KeyPadding):
            assert keep is not None
            q: _masks.Mask = _masks.key_padding(keep)
        elif isinstance(p, _masks.Documents):
            assert ids is not None
            q = _masks.documents(ids)
        else:
            q = _heads_of(p, h0, h1)
        out = q if out is None else out & q
    return out


def _check_mask(mask: object, shape: tuple[int, int, int, int], device: torch.device) -> tuple[
        Optional[_masks.Mask], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(mask, this rank's keep shard (B, n) or None, ids shard (B|1, n) or None)."""
    m = _masks.as_mask(mask, "mask")
    if m is None:
        return None, None, None
    keep = ids = None
    B, _, n, _ = shape
    for p in m.parts:
        if isinstance(p, _masks.KeyPadding):
            if tuple(p.tensor.shape) != (B, n):
                raise ValueError(f"mask's key_padding must be this rank's (B, n) = {(B, n)} shard of keep, got "
                                 f"{tuple(p.tensor.shape)}")
            keep = p.tensor if keep is None else keep & p.tensor
        elif isinstance(p, _masks.Documents):
            if p.kv_ids is not p.q_ids or p.q_ids.shape[-1] != n or p.q_ids.shape[0] not in (1, B):
                raise ValueError(f"mask's documents must be masks.documents(ids) with ids (B|1, n={n}), this rank's "
                                 f"shard of the sequence's ids; got {p!r}")
            ids = p.q_ids
        elif isinstance(p, (_masks.Keep, _masks.Bias)):
            raise ValueError(f"ulysses_attention takes masks that describe the whole sequence (causal, window, "
                             f"chunked_local, alibi, softcap, sink, score_mod, mask_mod) and the shards of key "
                             f"padding and document ids; a dense tensor part ({p!r}) cannot be cut by heads here")
    return m, keep, ids


def _gather_seq(x: torch.Tensor, ring: _Ring, lengths: list[int], layout: str) -> torch.Tensor:
    """Every rank's (B|1, n_r) shard of a per-token tensor (no autograd), in sequence order (B|1, L)."""
    most = max(lengths)  # gloo gathers equal sizes: pad to the longest shard, then cut
    wide = torch.zeros(x.shape[0], most, dtype=torch.int64, device=x.device)  # (bool does not travel everywhere)
    wide[:, : x.shape[1]] = x
    parts = [torch.empty_like(wide) for _ in lengths]
    dist.all_gather(parts, wide, group=ring.group)
    return unshard_sequence([t[:, :n] for t, n in zip(parts, lengths)], layout, dim=-1).to(x.dtype)


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all`` of equal-shaped pieces, differentiable: the backward is the reverse
    all-to-all of the gradients. (torch.distributed.nn's version scatters from global ranks,
    which fails on a subgroup over gloo.)"""

    @staticmethod
    def forward(ctx: Any, group: dist.ProcessGroup, *pieces: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        outs = [torch.empty_like(p) for p in pieces]
        dist.all_to_all(outs, [p.contiguous() for p in pieces], group=group)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        outs = [torch.empty_like(g) for g in grads]
        dist.all_to_all(outs, [g.contiguous() for g in grads], group=ctx.group)
        return (None, *outs)


def _to_heads(x: torch.Tensor, ring: _Ring, lengths: list[int], layout: str) -> torch.Tensor:
    """(B, Hx, n, D) sequence shard -> (B, Hx/P, L, D), all tokens of this rank's heads."""
    P = ring.size
    most = max(lengths)  # equal pieces both ways (gloo's all-to-all, and its backward): pad, then cut
    padded = torch.nn.functional.pad(x, (0, 0, 0, most - x.shape[2]))
    sends = [c.contiguous() for c in padded.chunk(P, dim=1)]
    got = _AllToAll.apply(ring.group, *sends)  # type: ignore[no-untyped-call]
    return unshard_sequence([t[:, :, :n] for t, n in zip(got, lengths)], layout)


def _to_sequence(x: torch.Tensor, ring: _Ring, lengths: list[int], layout: str) -> torch.Tensor:
    """(B, H/P, L, Dv) of this rank's heads -> (B, H, n, Dv), this rank's sequence shard."""
    P, r = ring.size, ring.rank
    if layout == "contiguous":
        sends = [c.contiguous() for c in x.split_with_sizes(lengths, dim=2)]
    else:
        sends = [shard_sequence(x, j, P, layout).contiguous() for j in range(P)]
    most = max(lengths)  # (gloo's all-to-all takes equal pieces: pad, then cut)
    sends = [torch.nn.functional.pad(t, (0, 0, 0, most - t.shape[2])) for t in sends]
    got = _AllToAll.apply(ring.group, *sends)  # type: ignore[no-untyped-call]
    return torch.cat([t[:, :, : lengths[r]] for t in got], dim=1)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: _masks.MaskLike = None,
    *,
    scale: Optional[float] = None,
    group: Optional[dist.ProcessGroup] = None,
    layout: str = "contiguous",
    timeout: Optional[float] = None,
) -> torch.Tensor:
    """Attention over a sequence sharded across ``group`` by all-to-all; call it on every rank.

    Example (on every rank of a gloo or NCCL group of P processes)::

        q, k, v = (shard_sequence(t, rank, P) for t in (q_full, k_full, v_full))
        out = ulysses_attention(q, k, v, masks.window(64, sinks=4) & masks.alibi(slopes))

    Args:
        q: (B, H, n, D), this rank's tokens (n may differ between ranks with the contiguous layout).
        k: (B, Hkv, n, D), the same tokens' keys.
        v: (B, Hkv, n, Dv), their values.
        mask: a `multihead.masks` mask of the whole sequence (see the module docstring); key
            padding and document ids as this rank's (B, n) / (B|1, n) shards.
        scale: multiplies q·kᵀ; default 1/√D.
        group: the process group whose ranks hold the shards, in sequence order.
        layout: ``"contiguous"`` or ``"zigzag"``, how the shards were cut (`shard_sequence`).
        timeout: seconds to wait for the agreement check.

    Returns:
        (B, H, n, Dv): this rank's rows of ``multihead.attention(q_full, k_full, v_full, mask)``.
    """
    try:
        check_qkv(q, k, v)
        scale = check_scale(scale, q.shape[-1])
        layout = _check_layout(layout)
        _check_timeout(timeout)
        if q.shape[2] != k.shape[2]:
            raise ValueError(f"ulysses_attention needs q and k cut from one sequence: got {q.shape[2]} queries and "
                             f"{k.shape[2]} keys on this rank")
        m, keep, ids = _check_mask(mask, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), q.device)
        ring = _Ring(group, timeout)
        P = ring.size
        if q.shape[1] % P or k.shape[1] % P:
            raise ValueError(f"ulysses_attention gives each of the P={P} ranks whole heads, so P must divide H="
                             f"{q.shape[1]} and Hkv={k.shape[1]}; use ring_attention (or fewer ranks) otherwise")
        if layout == "zigzag" and q.shape[2] % 2:
            raise ValueError(f"a zigzag shard holds two equal chunks, so its length must be even, got {q.shape[2]}")
    except (TypeError, ValueError):
        _announce_rejection(group, timeout)
        raise
    records = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    spec = _Spec(ring, False, layout, scale, ids)
    descriptor = _describe(spec, q, k, v, keep, "forward", records)
    descriptor[5] = 0  # shard lengths may differ (compared below, for the zigzag layout)
    _agree(ring, descriptor)
    _agree_on(ring, "mask kinds and parameters", mask_signature(m),
              "pass the same mask on every rank (only the key padding and document ids are per-rank shards)",
              head="ulysses_attention")
    lengths = [row[0] for row in ring.all_gather([q.shape[2]], what="exchanging shard lengths")]
    if layout == "zigzag" and len(set(lengths)) > 1:
        raise ValueError(f"ulysses_attention, rank {ring.rank}: zigzag shards must have one length, got {lengths} "
                         "by rank; use the contiguous layout for shards of different lengths")
    h0 = ring.rank * (q.shape[1] // P)
    h1 = h0 + q.shape[1] // P
    full_keep = None if keep is None else _gather_seq(keep, ring, lengths, layout)
    full_ids = None if ids is None else _gather_seq(ids.expand(q.shape[0], -1) if ids.shape[0] != 1 else ids,
                                                    ring, lengths, layout)
    qh, kh, vh = (_to_heads(t, ring, lengths, layout) for t in (q, k, v))
    o = attention(qh, kh, vh, _local_mask(m, h0, h1, full_keep, full_ids), scale=scale)
    return _to_sequence(o, ring, lengths, layout)


def hybrid_groups(ulysses_size: int, group: Optional[dist.ProcessGroup] = None) -> tuple[
        dist.ProcessGroup, dist.ProcessGroup]:
    """(all-to-all group, ring group) of this rank for `hybrid_attention`: rank r = j·G + i is
    member i of all-to-all group j (ranks j·G .. j·G+G-1) and of ring i (ranks i, G+i, 2G+i, ...).
    Call it on every rank (it creates every group, in one order, as torch.distributed requires)."""
    world = dist.get_world_size(group)
    if isinstance(ulysses_size, bool) or not isinstance(ulysses_size, int) or ulysses_size < 1 or world % ulysses_size:
        raise ValueError(f"ulysses_size must be an int dividing the P={world} ranks, got {ulysses_size!r}")
    ranks = [dist.get_global_rank(group, r) for r in range(world)] if group is not None else list(range(world))
    me = dist.get_rank(group)
    G = ulysses_size
    mine: dict[str, dist.ProcessGroup] = {}
    for j in range(world // G):
        made = dist.new_group([ranks[j * G + i] for i in range(G)])
        if me // G == j:
            mine["ulysses"] = made
    for i in range(G):
        made = dist.new_group([ranks[j * G + i] for j in range(world // G)])
        if me % G == i:
            mine["ring"] = made
    return mine["ulysses"], mine["ring"]


def hybrid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: _masks.MaskLike = None,
    *,
    groups: tuple[dist.ProcessGroup, dist.ProcessGroup],
    scale: Optional[float] = None,
    group: Optional[dist.ProcessGroup] = None,
    timeout: Optional[float] = None,
) -> torch.Tensor:
    """All-to-all inside groups of G ranks, ring across them (see the module docstring).

    Args:
        q: (B, H, n, D), this rank's contiguous shard (rank r holds tokens r·n .. r·n+n-1).
        k: (B, Hkv, n, D), its keys.
        v: (B, Hkv, n, Dv), its values.
        mask: what `multihead.distributed.ring_attention` carries (causal, key padding and
            document ids as this rank's shards, window, chunked_local, alibi, softcap),
            described on the whole sequence.
        groups: ``hybrid_groups(G)`` of this rank.
        scale: multiplies q·kᵀ; default 1/√D.
        group: the process group of all P ranks (default: the world), where the ranks first
            compare their calls and masks.
        timeout: seconds to wait for the agreement and the ring.

    Returns:
        (B, H, n, Dv): this rank's rows of attention over the whole sequence.
    """
    uly_group, ring_group = groups
    try:
        check_qkv(q, k, v)
        scale = check_scale(scale, q.shape[-1])
        _check_timeout(timeout)
        m, keep, ids = _check_mask(mask, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), q.device)
        G = dist.get_world_size(uly_group)
        if q.shape[1] % G or k.shape[1] % G:
            raise ValueError(f"hybrid_attention gives each of the G={G} ranks of an all-to-all group whole heads, so G "
                             f"must divide H={q.shape[1]} and Hkv={k.shape[1]}; pick ulysses_size for hybrid_groups so")
    except (TypeError, ValueError):
        _announce_rejection(group, timeout)
        raise
    everyone = _Ring(group, timeout)
    records = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    descriptor = _describe(_Spec(everyone, False, "contiguous", scale, ids), q, k, v, keep, "forward", records)
    _agree(everyone, descriptor)
    _agree_on(everyone, "mask kinds and parameters", mask_signature(m),
              "pass the same mask on every rank (only the key padding and document ids are per-rank shards)",
              head="hybrid_attention")
    uly = _Ring(uly_group, timeout)
    lengths = [q.shape[2]] * G
    h0 = uly.rank * (q.shape[1] // G)
    h1 = h0 + q.shape[1] // G
    group_keep = None if keep is None else _gather_seq(keep, uly, lengths, "contiguous")
    group_ids = None if ids is None else _gather_seq(ids.expand(q.shape[0], -1) if ids.shape[0] != 1 else ids,
                                                     uly, lengths, "contiguous")
    qh, kh, vh = (_to_heads(t, uly, lengths, "contiguous") for t in (q, k, v))  # (B, H/G, G·n, D)
    o = ring_attention(qh, kh, vh, _local_mask(m, h0, h1, group_keep, group_ids), scale=scale, group=ring_group,
                       layout="contiguous", timeout=timeout)
    return _to_sequence(o, uly, lengths, "contiguous")
