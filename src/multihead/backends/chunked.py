"""The ``chunked`` backend: online softmax over tiles (FlashAttention's algorithm) in plain PyTorch.

The (Lq, Lk) scores are never held at once. Queries are cut into blocks of ``block_q`` and,
for each, the keys it can see into blocks of ``block_k``; one tile of scores exists at a time::

    for each query block Q_i:                     # rows of q
        acc = 0                                   # (rows, Dv + 1): Σ p V and, last column, Σ p
        for each key block K_j, V_j it can see:   # blocks a causal/window mask hides are skipped
            s = Q_i K_jᵀ · scale (+ bias tile, -inf where the keep tile is False)
            first tile: shift = rowmax(s)         # a row with no visible key: shift 0
            p = exp(s - shift)
            acc += p [V_j, 1]
        out_i = acc[:, :Dv] / acc[:, Dv]  (0 where the sum is 0: no visible key)
        lse_i = shift + log(acc[:, Dv])

This is FlashAttention's online softmax with the rescaling made lazy: later tiles reuse the
first tile's shift, which is exact in any precision as long as exp(s - shift) stays finite, so
no row-max pass is needed per tile. A tile whose row sums would pass sqrt(largest float) is
redone with shift = max(shift, its row max), rescaling acc by exp(old - new) (rare: scores
rising ~44 above the first tile's in float32). The shift is subtracted inside the matrix product
(the query tile carries -shift in an extra column against a column of ones in K), and the row
sums come out of it too (a column of ones in V), so each tile costs two products and one exp.

The backward pass recomputes each tile from the saved (q, k, v, out, lse), so training memory
is O(L) as well: p = exp(s - lse), dV += pᵀ dO, dP = dO Vᵀ, dS = p ⊙ (dP - rowsum(dO ⊙ out)),
dQ += dS K · scale, dK += dSᵀ Q · scale, and a bias tensor gets dS.

Grouped-query attention reads K/V once per kv head: q is viewed as (B·Hkv, Lq·G, D) with the G
query heads of one kv head side by side, so no repeated K/V is built. float16/bfloat16 inputs
are computed in float32 and cast back. Dropout is not supported (see :func:`_refuses`).

Legend: B batch, H query heads, Hkv key/value heads, G = H // Hkv, Lq/Lk query/key lengths,
D head dim, Dv value head dim.
"""

from __future__ import annotations

import math
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

import torch

from .. import trace as _trace
from .._checks import check_positive_int, check_qkv, check_scale
from ..masks import Mask, as_mask, split_additive
from . import Backend, Call, register
from .reference import compute_dtype

__all__ = ["chunked_attention", "selected_weights", "BLOCK_ROWS", "BLOCK_K", "AUTO_MIN_SCORES", "BLOCKS_COMPUTED"]

#: default rows (queries x query heads per kv head) of a query block
BLOCK_ROWS = 512
#: default keys per key block
BLOCK_K = 512
#: ``backend="auto"`` declines the chunked backend when Lq·Lk is below this: SDPA's fused
#: kernel is faster there and the dense mask it may need is small.
AUTO_MIN_SCORES = 2048 * 2048

#: share the query blocks of the forward pass among torch.get_num_threads() Python threads (CPU)
PARALLEL = True

#: test hook: tiles computed, counted under "forward" and "backward", and forward tiles redone
#: with an exact shift under "redone" (reset it with ``.clear()``)
BLOCKS_COMPUTED: Counter = Counter()

_NEG_INF = float("-inf")


def default_block_q(groups: int) -> int:
    """Queries per block: :data:`BLOCK_ROWS` rows shared by the ``groups`` query heads of a kv head."""
    return max(1, BLOCK_ROWS // groups)


class _Problem:
    """One attention call, laid out for tiles; shared by the forward and the backward pass.

    q is held grouped and pre-scaled, (B·Hkv, Lq·G, D), row ``i·G + g`` being query i of head
    ``kvhead·G + g``; all in the compute dtype. k and v carry one extra column of ones,
    ``ka`` (B·Hkv, Lk, D+1) and ``va`` (B·Hkv, Lk, Dv+1), so that the matrix products do two
    row-wise jobs for free: a query tile with ``-shift`` in its extra column gives scores already
    shifted by ``shift`` (no subtraction pass), and ``p @ va`` gives the row sums of p in its last
    column (no summation pass).
    ``positions`` optionally maps local query rows to the absolute positions the mask sees
    (for :func:`multihead.attention_weights` on selected rows); ``mask_heads`` picks the query
    heads of the mask's head axis (for selected heads).
    """

    def __init__(self, q, k, v, rest: Optional[Mask], biases, *, scale, block_q, block_k,
                 mask_shape, positions=None, mask_heads=None):
        B, H, Lq, D = q.shape
        self.B, self.H, self.Lq, self.D = B, H, Lq, D
        self.Hkv, self.Lk, self.Dv = k.shape[1], k.shape[2], v.shape[-1]
        self.G = H // self.Hkv
        self.N = B * self.Hkv
        self.cdt = compute_dtype(q.dtype)
        self.scale = scale
        self.rest, self.biases = rest, biases
        self.mask_shape = tuple(mask_shape)
        self.mask_heads = mask_heads
        self.q = self.group_rows(q.to(self.cdt) * scale)
        self.ka = _with_ones_column(k.to(self.cdt).reshape(self.N, self.Lk, D))
        self.va = _with_ones_column(v.to(self.cdt).reshape(self.N, self.Lk, self.Dv))
        self.plan = _plan(Lq, self.Lk, rest, block_q, block_k, positions, self.mask_shape)
        # a tile whose row sums pass this is redone with an exact shift (exp would overflow soon)
        self.limit = math.exp(math.log(torch.finfo(self.cdt).max) / 2)

    # -- layout: (B, H, Lq, X) <-> (B·Hkv, Lq·G, X)
    def group_rows(self, t: torch.Tensor) -> torch.Tensor:
        B, H, L, X = t.shape
        return t.reshape(B, self.Hkv, self.G, L, X).transpose(2, 3).reshape(self.N, L * self.G, X)

    def ungroup_rows(self, t: torch.Tensor) -> torch.Tensor:
        X = t.shape[-1]
        return t.reshape(self.B, self.Hkv, self.Lq, self.G, X).transpose(2, 3).reshape(self.B, self.H, self.Lq, X)

    def _grouped_tile(self, t: torch.Tensor, *, select_heads: bool = False) -> torch.Tensor:
        """A (b, h, bq, bk) mask tile as (b, Hkv|1, bq, G|1, bk), matching the grouped scores;
        ``select_heads`` first picks :attr:`mask_heads` from a tile of the mask's own heads."""
        if select_heads and self.mask_heads is not None and t.shape[1] != 1:
            t = t[:, self.mask_heads]
        if t.shape[1] == 1:
            return t.unsqueeze(3)
        b, _, bq, bk = t.shape
        return t.reshape(b, self.Hkv, self.G, bq, bk).transpose(2, 3)

    def scores(self, qa, r0, r1, a0, k0, k1) -> torch.Tensor:
        """Masked scores of the query tile ``qa`` (N, (r1-r0)·G, D+1), its rows being local queries
        r0..r1-1 at absolute positions a0.., x keys k0..k1-1, shifted by ``-qa[..., D]``: (N, rows, bk)."""
        s = torch.bmm(qa, self.ka[:, k0:k1].transpose(1, 2))
        bias_tiles = [_tile4(b, a0, a0 + r1 - r0, k0, k1) for b in self.biases]
        keep = None
        if self.rest is not None:
            keep = self.rest.block(a0, a0 + r1 - r0, k0, k1, self.mask_shape, device=s.device, dtype=self.cdt).keep
        if bias_tiles or keep is not None:
            s5 = s.view(self.B, self.Hkv, r1 - r0, self.G, k1 - k0)
            for bt in bias_tiles:
                s5.add_(self._grouped_tile(bt.to(self.cdt)))
            if keep is not None:
                s5.masked_fill_(~self._grouped_tile(keep, select_heads=True), _NEG_INF)
        return s

    # -- passes
    def forward(self):
        """``(out, lse)``: out (N, Lq·G, Dv) and lse (N, Lq·G) in the compute dtype.

        Each query block keeps a per-row ``shift`` (set exactly from its first tile's row max)
        and accumulates ``acc = Σ exp(s - shift) @ [v, 1]``. A later tile is shifted by the same
        value, without a max pass; only if its row sums pass :attr:`limit` (scores far above the
        first tile's) is it redone with the exact running max and ``acc`` rescaled.
        """
        G, Dv = self.G, self.Dv
        out = torch.zeros(self.N, self.Lq * G, Dv, dtype=self.cdt, device=self.q.device)
        lse = torch.full((self.N, self.Lq * G), _NEG_INF, dtype=self.cdt, device=self.q.device)
        blocks = [b for b in self.plan if b[3]]
        _run_parallel(blocks, lambda b: self._forward_block(out, lse, *b), self.q.device)
        BLOCKS_COMPUTED["forward"] += sum(len(b[3]) for b in blocks)
        return out, lse

    def _forward_block(self, out, lse, r0, r1, a0, kblocks) -> None:
        """One query block: writes its rows of ``out`` and ``lse``."""
        G, D, Dv = self.G, self.D, self.Dv
        rows = slice(r0 * G, r1 * G)
        qa = _with_ones_column(self.q[:, rows], 0.0)  # last column: -shift
        acc = None
        for k0, k1 in kblocks:
            s = self.scores(qa, r0, r1, a0, k0, k1)
            if acc is None:
                qa[..., D:] = -_finite_row_max(s)
                s.add_(qa[..., D:])
            part = torch.bmm(s.exp_(), self.va[:, k0:k1])
            if acc is not None and bool((part[..., Dv] > self.limit).any()):
                part = self._exact_tile(qa, acc, r0, r1, a0, k0, k1)
                BLOCKS_COMPUTED["redone"] += 1
            acc = part if acc is None else acc.add_(part)
        total = acc[..., Dv:]
        out[:, rows] = acc[..., :Dv] / total.masked_fill(total == 0, 1.0)
        lse[:, rows] = (total.log() - qa[..., D:]).squeeze(-1)

    def _exact_tile(self, qa, acc, r0, r1, a0, k0, k1) -> torch.Tensor:
        """Redo one tile with shift = max(old shift, the tile's row max); rescales ``acc`` to it."""
        D = self.D
        old = -qa[..., D:].clone()
        qa[..., D:] = 0.0
        tile_max = _finite_row_max(self.scores(qa, r0, r1, a0, k0, k1))
        new = torch.maximum(old, tile_max)
        acc.mul_((old - new).exp_())
        qa[..., D:] = -new
        return torch.bmm(self.scores(qa, r0, r1, a0, k0, k1).exp_(), self.va[:, k0:k1])

    def backward(self, out, lse, g_out, g_lse):
        """``(dq, dk, dv, dbiases)`` for out/lse from :meth:`forward` and their gradients.

        Per tile: p = exp(s - lse) (the query tile carries -lse in its extra column), dV += pᵀ dO,
        dS = p ⊙ (dO Vᵀ - shift) (dO carries -shift in an extra column against v's ones),
        dQ += dS K, dK += dSᵀ Q.
        """
        D, Dv = self.D, self.Dv
        dq = torch.zeros_like(self.q)
        dk = torch.zeros(self.N, self.Lk, D, dtype=self.cdt, device=self.q.device)
        dv = torch.zeros(self.N, self.Lk, Dv, dtype=self.cdt, device=self.q.device)
        dbiases = [torch.zeros(b.shape, dtype=self.cdt, device=b.device) if b.requires_grad else None
                   for b in self.biases]
        # dS = p ⊙ (dP - delta + g_lse): delta = rowsum(dO ⊙ out) is the softmax's own term
        shift = (g_out * out).sum(dim=-1, keepdim=True)
        if g_lse is not None:
            shift = shift - g_lse.unsqueeze(-1)
        qa = torch.cat([self.q, -lse.masked_fill(lse == _NEG_INF, 0.0).unsqueeze(-1)], dim=-1)
        ga = torch.cat([g_out, -shift], dim=-1)
        blocks = [b for b in self.plan if b[3]]
        if any(db is not None for db in dbiases):  # one bias gradient, filled in order
            for b in blocks:
                self._backward_block(qa, ga, g_out, dq, dk, dv, dbiases, *b)
        else:  # query blocks in parallel: each worker sums into its own dk, dv
            partial = {}

            def work(share):
                own = partial.setdefault(id(share), (torch.zeros_like(dk), torch.zeros_like(dv)))
                for b in share:
                    self._backward_block(qa, ga, g_out, dq, own[0], own[1], dbiases, *b)

            _run_parallel(blocks, work, self.q.device, per_share=True)
            for pdk, pdv in partial.values():
                dk.add_(pdk)
                dv.add_(pdv)
        BLOCKS_COMPUTED["backward"] += sum(len(b[3]) for b in blocks)
        return dq.mul_(self.scale), dk, dv, dbiases

    def _backward_block(self, qa, ga, g, dq, dk, dv, dbiases, r0, r1, a0, kblocks) -> None:
        G, D = self.G, self.D
        k, q = self.ka[..., :D], self.q
        rows = slice(r0 * G, r1 * G)
        for k0, k1 in kblocks:
            p = self.scores(qa[:, rows], r0, r1, a0, k0, k1).exp_()
            dv[:, k0:k1].baddbmm_(p.transpose(1, 2), g[:, rows])
            ds = p.mul_(torch.bmm(ga[:, rows], self.va[:, k0:k1].transpose(1, 2)))
            dq[:, rows].baddbmm_(ds, k[:, k0:k1])
            dk[:, k0:k1].baddbmm_(ds.transpose(1, 2), q[:, rows])
            for db in dbiases:
                if db is not None:
                    _add_bias_grad(db, self._ungrouped_tile(ds, r1 - r0), a0, a0 + r1 - r0, k0, k1)

    def _ungrouped_tile(self, ds: torch.Tensor, nq: int) -> torch.Tensor:
        """(N, nq·G, bk) -> (B, H, nq, bk)."""
        bk = ds.shape[-1]
        return ds.view(self.B, self.Hkv, nq, self.G, bk).transpose(2, 3).reshape(self.B, self.H, nq, bk)


def _run_parallel(blocks, work, device, *, per_share: bool = False) -> None:
    """Run ``work(block)`` for each query block: on CPU with :data:`PARALLEL` and more than one
    torch thread, the blocks are shared among that many Python threads, each running torch
    single-threaded (query blocks write disjoint rows). One parallel region per worker instead
    of one per operation: the small per-tile products scale better, above all on a busy machine.
    The intra-op thread count is restored afterwards. With ``per_share``, ``work`` receives each
    worker's whole list of blocks (sequentially: one list of all of them)."""
    threads = torch.get_num_threads()
    if not PARALLEL or device.type != "cpu" or threads < 2 or len(blocks) < 2:
        if per_share:
            work(blocks)
        else:
            for b in blocks:
                work(b)
        return
    workers = min(threads, len(blocks))
    grad = torch.is_grad_enabled()

    def run(share):
        torch.set_num_threads(1)
        with torch.set_grad_enabled(grad):
            if per_share:
                work(share)
            else:
                for b in share:
                    work(b)

    try:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(run, [blocks[i::workers] for i in range(workers)]))
    finally:
        torch.set_num_threads(threads)


def _with_ones_column(t: torch.Tensor, value: float = 1.0) -> torch.Tensor:
    """(N, L, X) -> (N, L, X+1), a new contiguous tensor whose last column is ``value``."""
    out = torch.empty(*t.shape[:-1], t.shape[-1] + 1, dtype=t.dtype, device=t.device)
    out[..., :-1] = t
    out[..., -1] = value
    return out


def _finite_row_max(s: torch.Tensor) -> torch.Tensor:
    """Row max (N, rows, 1), 0 for a row with no visible key (so that exp(s - max) is 0, not NaN)."""
    m = s.amax(dim=-1, keepdim=True)
    return m.masked_fill_(m == _NEG_INF, 0.0)


def _tile4(t: torch.Tensor, q0, q1, k0, k1) -> torch.Tensor:
    """A 4-D broadcastable tensor restricted to one tile (size-1 axes stay)."""
    rows = slice(None) if t.shape[-2] == 1 else slice(q0, q1)
    cols = slice(None) if t.shape[-1] == 1 else slice(k0, k1)
    return t[:, :, rows, cols]


def _add_bias_grad(db: torch.Tensor, ds: torch.Tensor, q0, q1, k0, k1) -> None:
    """Add the (B, H, bq, bk) tile gradient ``ds`` into ``db`` (the bias's 4-D broadcast shape)."""
    dims = [i for i in range(4) if db.shape[i] == 1 and ds.shape[i] != 1]
    if dims:
        ds = ds.sum(dim=dims, keepdim=True)
    _tile4(db, q0, q1, k0, k1).add_(ds)


def _plan(lq, lk, rest: Optional[Mask], block_q, block_k, positions, mask_shape):
    """``[(r0, r1, a0, [(k0, k1), ...]), ...]``: local query rows r0..r1-1 at absolute positions
    a0.., and the key blocks they can see; runs of consecutive positions are never split across
    a gap, and key blocks outside the structural mask's span are left out (never computed)."""
    mlq, mlk = mask_shape[-2:]
    runs = _runs(positions) if positions is not None else [(0, lq, 0)]
    plan = []
    for start, stop, abs0 in runs:
        for r0 in range(start, stop, block_q):
            r1 = min(stop, r0 + block_q)
            a0 = abs0 + (r0 - start)
            lo, hi = (0, lk) if rest is None else rest.key_span(a0, a0 + r1 - r0, mlq, mlk)
            plan.append((r0, r1, a0, [(k0, min(hi, k0 + block_k)) for k0 in range(max(lo, 0), hi, block_k)]))
    return plan


def _runs(positions: Sequence[int]):
    """Maximal runs of consecutive positions: ``[(local_start, local_stop, absolute_start), ...]``."""
    runs = []
    start = 0
    for i in range(1, len(positions) + 1):
        if i == len(positions) or positions[i] != positions[i - 1] + 1:
            runs.append((start, i, positions[start]))
            start = i
    return runs


class _ChunkedAttention(torch.autograd.Function):
    """out, lse = f(q, k, v, *biases); the backward recomputes tiles (nothing (Lq, Lk) is saved)."""

    @staticmethod
    def forward(ctx, q, k, v, rest, options, *biases):
        problem = _Problem(q, k, v, rest, biases, **options)
        out, lse = problem.forward()
        ctx.save_for_backward(q, k, v, out, lse, *biases)
        ctx.rest, ctx.options = rest, options
        return problem.ungroup_rows(out).to(q.dtype), _ungroup_lse(problem, lse)

    @staticmethod
    def backward(ctx, g_out, g_lse):
        q, k, v, out, lse, *biases = ctx.saved_tensors
        problem = _Problem(q, k, v, ctx.rest, tuple(biases), **ctx.options)
        g_out = problem.group_rows(g_out.to(problem.cdt))
        if g_lse is not None:
            g_lse = problem.group_rows(g_lse.to(problem.cdt).unsqueeze(-1)).squeeze(-1)
        dq, dk, dv, dbiases = problem.backward(out, lse, g_out, g_lse)
        dq = problem.ungroup_rows(dq).to(q.dtype)
        dk = dk.view(k.shape).to(k.dtype)
        dv = dv.view(v.shape).to(v.dtype)
        dbiases = [None if db is None else db.to(b.dtype) for b, db in zip(biases, dbiases)]
        return (dq, dk, dv, None, None, *dbiases)


def _ungroup_lse(problem: _Problem, lse: torch.Tensor) -> torch.Tensor:
    """(N, Lq·G) -> (B, H, Lq)."""
    return problem.ungroup_rows(lse.unsqueeze(-1)).squeeze(-1)


def chunked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask=None,
    *,
    scale: Optional[float] = None,
    block_q: Optional[int] = None,
    block_k: Optional[int] = None,
    return_lse: bool = False,
    positions: Optional[Sequence[int]] = None,
    mask_shape=None,
    mask_heads: Optional[Sequence[int]] = None,
):
    """Attention by tiles with O(Lq + Lk) memory, optionally with its log-sum-exp.

    Args:
        q: (B, H, Lq, D); k: (B, Hkv, Lk, D); v: (B, Hkv, Lk, Dv).
        mask: as for :func:`multihead.attention` (None, a mask, a bool or float tensor).
        scale: default 1/√D.
        block_q: queries per block (default :data:`BLOCK_ROWS` // G); block_k: keys per block
            (default :data:`BLOCK_K`).
        return_lse: also return lse (B, H, Lq), the log-sum-exp over keys of the scaled, masked
            scores (``-inf`` for a row with no visible key); differentiable.

    The last three arguments serve :func:`multihead.attention_weights`: ``positions`` (Lq ints)
    are the absolute query positions the mask is evaluated at, ``mask_shape`` the (B, H, Lq, Lk)
    the mask is written for, ``mask_heads`` the mask's heads that q's heads are.

    Returns:
        out (B, H, Lq, Dv), or ``(out, lse)``. A row with no visible key gives out 0.
    """
    check_qkv(q, k, v)
    scale = check_scale(scale, q.shape[-1])
    groups = q.shape[1] // k.shape[1]
    block_q = default_block_q(groups) if block_q is None else check_positive_int(block_q, "block_q")
    block_k = BLOCK_K if block_k is None else check_positive_int(block_k, "block_k")
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2]) if mask_shape is None else tuple(mask_shape)
    m = as_mask(mask)
    if m is not None:
        m.check(shape, q.device)
    rest, biases = split_additive(m, shape)
    if mask_heads is not None:
        biases = tuple(b if b.shape[1] == 1 else b[:, list(mask_heads)] for b in biases)
    options = dict(scale=scale, block_q=block_q, block_k=block_k, mask_shape=shape,
                   positions=None if positions is None else [int(p) for p in positions],
                   mask_heads=None if mask_heads is None else list(mask_heads))
    out, lse = _ChunkedAttention.apply(q, k, v, rest, options, *biases)
    return (out, lse) if return_lse else out


def selected_weights(q, k, mask: Optional[Mask], *, scale: float, heads: Sequence[int], rows: Sequence[int]):
    """Attention weights of the query heads ``heads`` at the query positions ``rows`` only.

    q (B, H, Lq, D), k (B, Hkv, Lk, D), arguments already validated -> (B, len(heads), len(rows), Lk).
    The log-sum-exp of each selected row comes from :func:`chunked_attention` (O(Lk) memory per
    row block); each weight is then ``exp(score - lse)``, one row block at a time, so nothing of
    size (H, Lq, Lk) is built. Differentiable (the lse is).
    """
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    groups = H // k.shape[1]
    heads, rows = list(heads), list(rows)
    qs = q[:, heads][:, :, rows]
    ks = k[:, [h // groups for h in heads]]
    shape = (B, H, Lq, Lk)
    no_values = ks.new_zeros(B, len(heads), Lk, 0)
    _, lse = chunked_attention(qs, ks, no_values, mask, scale=scale, return_lse=True,
                               positions=rows, mask_shape=shape, mask_heads=heads)
    cdt = compute_dtype(q.dtype)
    lse = lse.masked_fill(lse == _NEG_INF, 0.0).to(cdt).unsqueeze(-1)
    qs, ks = qs.to(cdt) * scale, ks.to(cdt)
    pieces = []
    for start, stop, a_start in _runs(rows):
        for r0 in range(start, stop, BLOCK_ROWS):
            r1 = min(stop, r0 + BLOCK_ROWS)
            a0 = a_start + (r0 - start)
            s = qs[:, :, r0:r1] @ ks.transpose(-2, -1)
            if mask is not None:
                mt = mask.block(a0, a0 + r1 - r0, 0, Lk, shape, device=q.device, dtype=cdt)
                if mt.bias is not None:
                    s = s + (mt.bias if mt.bias.shape[1] == 1 else mt.bias[:, heads])
                if mt.keep is not None:
                    s = s.masked_fill(~(mt.keep if mt.keep.shape[1] == 1 else mt.keep[:, heads]), _NEG_INF)
            pieces.append(torch.exp(s - lse[:, :, r0:r1]))
    if not pieces:
        return q.new_zeros(B, len(heads), len(rows), Lk)
    return torch.cat(pieces, dim=2).to(q.dtype)


def _backend_fn(q, k, v, mask, *, scale, dropout_p):
    if dropout_p > 0:
        raise ValueError(f"the chunked backend does not do dropout (got dropout_p={dropout_p}); "
                         "use backend='sdpa' or 'reference' for dropout")
    before = BLOCKS_COMPUTED["forward"]
    out = chunked_attention(q, k, v, mask, scale=scale)
    tr = _trace.current()
    if tr is not None:
        groups = q.shape[1] // k.shape[1]
        bq, bk = default_block_q(groups), BLOCK_K
        total = math.ceil(q.shape[2] / bq) * math.ceil(k.shape[2] / bk)
        tr.record(
            "fused attention (scores, scale, mask, softmax, weights × V)", out,
            "b h q d, b h k d, b h k d -> b h q d", ("b", "h", "t", "d"),
            note=(f"multihead chunked online softmax, tiles of {bq} queries × {bk} keys: "
                  f"{BLOCKS_COMPUTED['forward'] - before} computed of about {total} "
                  "(tiles a causal/window mask hides are skipped)"),
        )
    return out


def _refuses(call: Call) -> Optional[str]:
    if call.dropout_p > 0:
        return ("dropout is not supported: the backward pass recomputes tiles and would need the "
                "forward's random mask again; use 'sdpa' or 'reference'")
    if call.need_weights:
        return "it does not return the attention weights (only 'reference' does)"
    return None


def _auto_declines(call: Call) -> Optional[str]:
    lq, lk = call.q.shape[2], call.k.shape[2]
    if lq * lk < AUTO_MIN_SCORES:
        return (f"Lq·Lk = {lq * lk} is below chunked.AUTO_MIN_SCORES = {AUTO_MIN_SCORES}: "
                "SDPA's fused kernel is faster at this size")
    return None


BACKEND = register(
    Backend(
        name="chunked",
        fn=_backend_fn,
        refuses=_refuses,
        summary="online softmax over tiles in PyTorch; skips masked-out tiles; O(L) memory in training too",
        auto_declines=_auto_declines,
    ),
    auto_rank=1,
)
