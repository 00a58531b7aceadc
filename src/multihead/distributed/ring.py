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

The shards are cut as `multihead.distributed.layouts` says (contiguous, zigzag, per document). Before the
ring (forward and backward), the ranks exchange a fixed-size descriptor of their call in one
all_gather and all raise the same ValueError if they disagree (`multihead.distributed.agreement`):
mismatched shards would otherwise abort a process inside the transport or give wrong results
silently.

Why not ``torch.distributed.tensor.experimental.context_parallel``: in torch 2.13 it only
handles the CUDA SDPA kernels (flash, efficient, cuDNN); on CPU, SDPA's
``_scaled_dot_product_flash_attention_for_cpu`` has no sharding rule (NotImplementedError), and
it takes no attention mask (no key padding). This module needs only point-to-point sends, which
every torch.distributed backend has.

Legend: B batch, H query heads, Hkv key/value heads, g = H // Hkv, L sequence length, P ranks
in the group, Lq/Lk local (per-rank) query/key lengths, D head dim, Dv value head dim.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from .. import masks as _masks
from .._checks import check_qkv, check_scale
from .._numerics import compute_dtype
from .agreement import _LK, _agree, _agree_on, _announce_rejection, _describe, mask_signature
from .blocks import _attend_block, _attend_block_backward, _block, _unblock
from .layouts import _check_layout, unshard_sequence
from .plan import _owner, _pieces, _plan_segments
from .ring_masks import _Placed, _place, _split_mask
from .transport import _check_timeout, _Ring

__all__ = ["ring_attention"]

_NEG_INF = float("-inf")

_TAG_KV = 0  # k, v, keep
_TAG_GRAD = 8  # dk, dv travelling home


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
            (``multihead.distributed.ulysses_attention`` takes every kind).
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
