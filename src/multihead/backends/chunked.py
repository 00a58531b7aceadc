"""The ``chunked`` backend: online softmax over tiles (FlashAttention's algorithm) in plain PyTorch.

The (Lq, Lk) scores are never held at once. Queries are cut into blocks of ``block_q`` and keys
into blocks of ``block_k``; a *tile* is one query block x one key block, and the tiles a causal
or window mask hides entirely are never computed. Key blocks are the outer loop; the tiles
computed together (one tile, or in the calling thread the tiles of consecutive query blocks in
one key block, a *panel* of at most :data:`PANEL_SCORES` scores) go through::

    shift = unset, acc = 0                          # per query row; acc (Dv + 1): Σ p V and Σ p
    for each key block K_j, V_j, left to right:
        for each panel Q_p of the query rows that see K_j:
            s = Q_p K_jᵀ · scale (+ bias, -inf where the keep mask is False) - shift
            rows that see a key here for the first time: shift = rowmax(s), s -= shift
            acc += exp(s) [V_j, 1]
            a row sum above sqrt(largest float): redo the panel with shift = max(shift, rowmax)
    out = acc[:, :Dv] / acc[:, Dv]  (0 where the sum is 0: no visible key)
    lse = shift + log(acc[:, Dv])

This is FlashAttention's online softmax with the running max made lazy. A row's shift is the
row max of the first tile in which it sees a key, so its sum holds a term exp(0) = 1: later
scores far below the shift add terms below rounding (their underflow to 0 changes nothing), and
scores far above it (~44 in float32) make the row sum pass sqrt(largest float), which redoes the
panel with the exact running max, rescaling acc by exp(old - new). A row whose first tiles show
it nothing (key padding over the first keys, a window that starts later) keeps its shift unset
until one does; its acc is 0 until then, so nothing needs rescaling. The result is therefore
exact for every score range and every tile order, and the common case pays one row-max pass per
row (in its first tile) and none after. After a row's first tile its shift is subtracted inside
the matrix product (the query rows carry -shift in an extra column against a column of ones in
K), and the row sums come out of the second product (a column of ones in V), so a tile costs two
products and one exp.

The backward pass recomputes each panel from the saved (q, k, v, out, lse), so training memory
is O(L) as well: p = exp(s - lse), dV += pᵀ dO, dP = dO Vᵀ, dS = p ⊙ (dP - rowsum(dO ⊙ out)),
dQ += dS K · scale, dK += dSᵀ Q · scale, and a bias tensor gets dS. It is not differentiable
itself: a double backward raises a clear error (use ``backend="reference"``).

Threads: on CPU the query blocks are shared among ``torch.get_num_threads()`` threads, block i
to thread i mod n, each running torch single-threaded (one parallel region per thread, not one
per op: on a busy machine that is twice as fast as torch's intra-op threads on these ops). A
thread is made single-threaded with the per-thread calls of OpenMP and MKL, not with
``torch.set_num_threads``, which is process-wide (see :func:`_runtime_setters`); where that is
not possible, or where a Python dispatch mode or a tensor subclass is in play, everything runs
in the calling thread, panel after panel (:data:`THREADS` = False forces it). Either way the
order of every sum is fixed (the backward adds the threads' dK, dV in thread order), so results
are bit-identical from run to run at a given thread count, the caller's ``no_grad`` and
``inference_mode`` hold, and no other thread's settings change.
Under ``torch.autocast`` the inputs are cast as autocast casts them for SDPA (float64 stays);
the tiles themselves are always computed in the compute dtype. Grouped-query attention reads
K/V once per kv head: q is viewed as (B·Hkv, Lq·G, D) with the G query heads of one kv head
side by side, so no repeated K/V is built. float16/bfloat16 inputs are computed in float32
and cast back. On the ``meta`` device the data-dependent branches (redo, unset rows) are
skipped: they change values, never shapes. Dropout is not supported (see :func:`_refuses`).

Legend: B batch, H query heads, Hkv key/value heads, G = H // Hkv, Lq/Lk query/key lengths,
D head dim, Dv value head dim.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

import torch

from .. import steps as _steps
from .. import trace as _trace
from .._checks import check_positive_int, check_qkv, check_scale
from .._numerics import autocast_inputs, outside_autocast
from ..masks import Mask, as_mask, split_additive
from . import Backend, Call, register
from .reference import compute_dtype

__all__ = ["chunked_attention", "selected_weights", "BLOCK_ROWS", "BLOCK_K", "PANEL_SCORES", "THREADS",
           "AUTO_MIN_SCORES", "BLOCKS_COMPUTED"]

#: default rows (queries x query heads per kv head) of a query block
BLOCK_ROWS = 512
#: default keys per key block
BLOCK_K = 512
#: most scores (B·Hkv x rows x keys) one panel of tiles computes at once (8 MiB in float32):
#: each op is big enough for torch's intra-op threads, its scores still fit in a CPU cache,
#: and a call's extra memory stays bounded
PANEL_SCORES = 2 ** 21
#: share the query blocks among torch.get_num_threads() threads (CPU); False: all in the
#: calling thread, each op using torch's intra-op threads
THREADS = True
#: ``backend="auto"`` declines the chunked backend when Lq·Lk is below this: SDPA's fused
#: kernel is faster there and the dense mask it may need is small.
AUTO_MIN_SCORES = 2048 * 2048

#: test hook: tiles computed, counted under "forward" and "backward", and forward panels redone
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
        self.block_q, self.block_k = block_q, block_k
        self.blocks = _query_blocks(Lq, block_q, positions)
        # a panel whose row sums pass this is redone with an exact shift (exp would overflow soon)
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
        """Masked scores of the query rows ``qa`` (N, (r1-r0)·G, D+1), being local queries
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

    def plans(self, workers: int) -> list:
        """One list of panels per worker (see :func:`_plan`): query block i goes to worker
        i mod ``workers``, a fixed rule, so every sum is formed in the same order on every run.
        One worker (the calling thread) merges consecutive blocks into panels of up to
        :data:`PANEL_SCORES` scores, for torch's intra-op threads; several workers, each
        single-threaded, compute tile by tile."""
        if workers == 1:
            panel_queries = PANEL_SCORES // max(1, self.N * self.G * self.block_k) // self.block_q * self.block_q
        else:
            panel_queries = self.block_q
        return [_plan(self.blocks[w::workers], self.Lk, self.rest, self.block_k, self.mask_shape,
                      max(self.block_q, panel_queries)) for w in range(workers)]

    # -- passes
    def forward(self):
        """``(out, lse)``: out (N, Lq·G, Dv) and lse (N, Lq·G) in the compute dtype.

        ``qa`` carries each row's ``-shift`` in its last column; ``unset`` marks the rows that
        have seen no key yet (their shift is still to be chosen, their acc is 0). See the
        module docstring for why this is exact.
        """
        G, D, Dv = self.G, self.D, self.Dv
        qa = _with_ones_column(self.q, 0.0)
        acc = torch.zeros(self.N, self.Lq * G, Dv + 1, dtype=self.cdt, device=self.q.device)
        unset = torch.ones(self.N, self.Lq * G, 1, dtype=torch.bool, device=self.q.device)
        plans = self.plans(_workers(len(self.blocks), self.q, self.ka, self.va, *self.biases))

        def work(w):  # query blocks are disjoint rows: workers never write the same row
            return sum(self._forward_panel(qa, acc, unset, k0, k1, r0, r1, a0) for k0, k1, r0, r1, a0, _ in plans[w])

        redone = sum(_share(work, len(plans)))
        if redone:
            BLOCKS_COMPUTED["redone"] += redone
        BLOCKS_COMPUTED["forward"] += sum(p[-1] for plan in plans for p in plan)
        total = acc[..., Dv:]
        out = acc[..., :Dv] / total.masked_fill(total == 0, 1.0)
        return out, (total.log() - qa[..., D:]).squeeze(-1)

    def _forward_panel(self, qa, acc, unset, k0, k1, r0, r1, a0) -> bool:
        """One panel into ``acc``; whether it had to be redone."""
        G, D, Dv = self.G, self.D, self.Dv
        rows = slice(r0 * G, r1 * G)
        s = self.scores(qa[:, rows], r0, r1, a0, k0, k1)
        fresh = unset[:, rows]
        if _any(fresh):  # rows that may see their first key here: shift them by its row max
            top = s.amax(dim=-1, keepdim=True)
            seen = top > _NEG_INF
            shift = torch.where(fresh & seen, top, 0.0)
            s.sub_(shift)
            qa[:, rows, D:].sub_(shift)
            fresh.logical_and_(~seen)
        part = torch.bmm(s.exp_(), self.va[:, k0:k1])
        redo = _any(part[..., Dv:] > self.limit)
        if redo:
            part = self._redo(qa, acc, r0, r1, a0, k0, k1)
        acc[:, rows].add_(part)
        return redo

    def _redo(self, qa, acc, r0, r1, a0, k0, k1) -> torch.Tensor:
        """Redo one panel with shift = max(old shift, its row max); rescales the rows' ``acc`` to it.
        A row with no visible key in the panel keeps its shift (max with -inf). The scores are
        formed again with the new shift inside the product, as every later panel forms them."""
        rows = slice(r0 * self.G, r1 * self.G)
        column = qa[:, rows, self.D:]
        old = -column
        column.zero_()
        new = torch.maximum(old, self.scores(qa[:, rows], r0, r1, a0, k0, k1).amax(dim=-1, keepdim=True))
        acc[:, rows].mul_((old - new).exp_())
        column.copy_(-new)
        return torch.bmm(self.scores(qa[:, rows], r0, r1, a0, k0, k1).exp_(), self.va[:, k0:k1])

    def backward(self, out, lse, g_out, g_lse):
        """``(dq, dk, dv, dbiases)`` for out/lse from :meth:`forward` and their gradients.

        Per panel: p = exp(s - lse) (the query rows carry -lse in their extra column), dV += pᵀ dO,
        dS = p ⊙ (dO Vᵀ - shift) (dO carries -shift in an extra column against v's ones),
        dQ += dS K, dK += dSᵀ Q. The panels run in a fixed order, so every sum is too.
        """
        D, Dv, G = self.D, self.Dv, self.G
        k, q = self.ka[..., :D], self.q
        dq = torch.zeros_like(q)
        dk = torch.zeros(self.N, self.Lk, D, dtype=self.cdt, device=q.device)
        dv = torch.zeros(self.N, self.Lk, Dv, dtype=self.cdt, device=q.device)
        dbiases = [torch.zeros(b.shape, dtype=self.cdt, device=b.device) if b.requires_grad else None
                   for b in self.biases]
        # dS = p ⊙ (dP - delta + g_lse): delta = rowsum(dO ⊙ out) is the softmax's own term
        shift = (g_out * out).sum(dim=-1, keepdim=True)
        if g_lse is not None:
            shift = shift - g_lse.unsqueeze(-1)
        qa = torch.cat([q, -lse.masked_fill(lse == _NEG_INF, 0.0).unsqueeze(-1)], dim=-1)
        ga = torch.cat([g_out, -shift], dim=-1)
        # a bias gradient may be shared by all query blocks (a broadcast bias): one worker
        workers = 1 if any(db is not None for db in dbiases) else _workers(len(self.blocks), q, self.ka, g_out)
        plans = self.plans(workers)
        partials = [(dk, dv)] + [(torch.zeros_like(dk), torch.zeros_like(dv)) for _ in plans[1:]]

        def work(w):  # dq: disjoint rows; dk, dv: the worker's own partial sums
            pdk, pdv = partials[w]
            for k0, k1, r0, r1, a0, _ in plans[w]:
                rows = slice(r0 * G, r1 * G)
                p = self.scores(qa[:, rows], r0, r1, a0, k0, k1).exp_()
                # products into new tensors, then added: a slice as the output of baddbmm_ would
                # make torch run one matrix product per batch item instead of one batched product
                pdv[:, k0:k1].add_(torch.bmm(p.transpose(1, 2), g_out[:, rows]))
                ds = p.mul_(torch.bmm(ga[:, rows], self.va[:, k0:k1].transpose(1, 2)))
                dq[:, rows].add_(torch.bmm(ds, k[:, k0:k1]))
                pdk[:, k0:k1].add_(torch.bmm(ds.transpose(1, 2), q[:, rows]))
                for db in dbiases:
                    if db is not None:
                        _add_bias_grad(db, self._ungrouped_tile(ds, r1 - r0), a0, a0 + r1 - r0, k0, k1)

        _share(work, len(plans))
        for pdk, pdv in partials[1:]:  # in worker order, whichever finished first
            dk.add_(pdk)
            dv.add_(pdv)
        BLOCKS_COMPUTED["backward"] += sum(p[-1] for plan in plans for p in plan)
        return dq.mul_(self.scale), dk, dv, dbiases

    def _ungrouped_tile(self, ds: torch.Tensor, nq: int) -> torch.Tensor:
        """(N, nq·G, bk) -> (B, H, nq, bk)."""
        bk = ds.shape[-1]
        return ds.view(self.B, self.Hkv, nq, self.G, bk).transpose(2, 3).reshape(self.B, self.H, nq, bk)


def _workers(blocks: int, *tensors: torch.Tensor) -> int:
    """How many threads share ``blocks`` query blocks: ``torch.get_num_threads()`` of them (at
    most one per block) on CPU when :data:`THREADS` allows it and each thread can run torch
    single-threaded without touching the others (:func:`_one_thread_here`); otherwise 1, the
    calling thread. Also 1 where thread-local state would not reach other threads: tensor
    subclasses, and Python dispatch or function modes (e.g. FakeTensorMode, FlopCounterMode)."""
    threads = torch.get_num_threads()
    if not THREADS or threads < 2 or blocks < 2 or tensors[0].device.type != "cpu":
        return 1
    if any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in tensors) or _python_modes_active():
        return 1
    return min(threads, blocks) if _thread_local_threads_work() else 1


def _python_modes_active() -> bool:
    """Whether a Python dispatch or function mode is active (True when this torch cannot tell)."""
    try:
        return bool(torch._C._len_torch_dispatch_stack() or torch._C._len_torch_function_stack())
    except AttributeError:
        return True


def _share(work, n: int) -> list:
    """``[work(w) for w in range(n)]``: in the calling thread for n = 1, else each in its own
    thread, running torch single-threaded, in the caller's inference mode and without autograd
    (the passes need none). The caller's torch.get_num_threads() and every other thread's are
    left alone."""
    if n == 1:
        return [work(0)]
    inference = torch.is_inference_mode_enabled()

    def run(w):
        _one_thread_here()
        with torch.inference_mode(inference), torch.no_grad():
            return work(w)

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(run, range(n)))


@functools.lru_cache(maxsize=None)
def _runtime_setters():
    """The thread-local halves of ``torch.set_num_threads``, as ctypes functions of int, or None.

    torch.set_num_threads(n) is process-wide: besides the calling thread's OpenMP and MKL
    settings it stores n where every thread that starts later copies it from (ATen's
    ParallelOpenMP.cpp; torch 2.13 offers no per-thread variant), so a worker calling it would
    set the thread count of unrelated threads. OpenMP's ``omp_set_num_threads`` and MKL's
    ``MKL_Set_Num_Threads_Local`` set the calling thread's alone.
    """
    def find(name, libraries):
        for lib in libraries:
            try:
                f = getattr(ctypes.CDLL(lib), name)
            except (OSError, TypeError, AttributeError):
                continue
            f.argtypes, f.restype = [ctypes.c_int], ctypes.c_int
            return f
        return None

    here = os.path.join(os.path.dirname(torch.__file__), "lib")
    files = sorted(os.listdir(here)) if os.path.isdir(here) else []

    def ours(*prefixes):  # torch's own copies first, then whatever the process has loaded
        return [os.path.join(here, f) for f in files if f.startswith(prefixes)] + [None]

    omp = find("omp_set_num_threads", ours("libgomp", "libiomp", "libomp", "libtorch_cpu.")) \
        if torch.backends.openmp.is_available() else None
    mkl = find("MKL_Set_Num_Threads_Local", ours("libtorch_cpu.", "torch_cpu.", "libmkl")) \
        if torch.backends.mkl.is_available() else None
    return omp, mkl


def _one_thread_here() -> bool:
    """Make torch's intra-op work single-threaded in the calling thread alone; whether it did."""
    omp, mkl = _runtime_setters()
    if omp is None or (mkl is None and torch.backends.mkl.is_available()):
        return False
    torch.get_num_threads()  # torch's own setup of a new thread first: it would undo ours later
    omp(1)
    if mkl is not None:
        mkl(1)
    return torch.get_num_threads() == 1  # it was the OpenMP runtime torch itself uses


@functools.lru_cache(maxsize=None)
def _thread_local_threads_work() -> bool:
    """Whether :func:`_one_thread_here` works in this process (tried once, in a thread of its own)."""
    result = []
    probe = threading.Thread(target=lambda: result.append(_one_thread_here()))
    probe.start()
    probe.join()
    return result == [True]


def _any(t: torch.Tensor) -> bool:
    """``bool(t.any())``; False on the meta device, which has no data (the branches it guards
    change values, never shapes)."""
    return t.device.type != "meta" and bool(t.any())


def _with_ones_column(t: torch.Tensor, value: float = 1.0) -> torch.Tensor:
    """(N, L, X) -> (N, L, X+1), a new contiguous tensor whose last column is ``value``."""
    out = torch.empty(*t.shape[:-1], t.shape[-1] + 1, dtype=t.dtype, device=t.device)
    out[..., :-1] = t
    out[..., -1] = value
    return out


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


def _query_blocks(lq, block_q, positions):
    """``[(r0, r1, a0), ...]``: local query rows r0..r1-1 at absolute positions a0.. (``positions``,
    or the rows themselves); a block never spans a gap in the positions."""
    runs = _runs(positions) if positions is not None else [(0, lq, 0)]
    return [(r0, min(stop, r0 + block_q), abs0 + (r0 - start))
            for start, stop, abs0 in runs for r0 in range(start, stop, block_q)]


def _plan(blocks, lk, rest: Optional[Mask], block_k, mask_shape, panel_queries):
    """The panels of the query ``blocks`` in the order they are computed:
    ``[(k0, k1, r0, r1, a0, tiles), ...]``, keys k0..k1-1 (one key block) x local query rows
    r0..r1-1 at absolute positions a0.. (``tiles`` query blocks of them), key blocks left to right.

    Key blocks lie on a grid of ``block_k``; a query block visits those that meet the keys the
    structural mask lets it see (:meth:`Mask.key_span`), so hidden tiles are never computed.
    The query blocks of one key block are merged into panels of at most ``panel_queries``
    queries while they are consecutive (rows and positions) and alike: tiles the structural
    mask shows entirely are not merged with tiles it cuts, so a tall panel needs no keep mask."""
    mlq, mlk = mask_shape[-2:]
    columns: dict = {}  # k0 -> [[r0, r1, a0, whole, tiles], ...]
    for r0, r1, a0 in blocks:
        a1 = a0 + (r1 - r0)
        lo, hi, last_lo, first_hi = 0, lk, 0, lk
        if rest is not None:  # spans move forward with the query: the block's first and last
            lo, hi = rest.key_span(a0, a1, mlq, mlk)  # rows bound the keys all its rows see
            last_lo, first_hi = rest.key_span(a1 - 1, a1, mlq, mlk)[0], rest.key_span(a0, a0 + 1, mlq, mlk)[1]
        for k0 in range(max(lo, 0) // block_k * block_k, hi if lo < hi else 0, block_k):
            k1 = min(lk, k0 + block_k)
            whole = last_lo <= k0 and k1 <= first_hi
            panels = columns.setdefault(k0, [])
            p = panels[-1] if panels else None
            if p and p[1] == r0 and p[2] + (r0 - p[0]) == a0 and p[3] == whole and r1 - p[0] <= panel_queries:
                p[1], p[4] = r1, p[4] + 1
            else:
                panels.append([r0, r1, a0, whole, 1])
    return [(k0, min(lk, k0 + block_k), r0, r1, a0, tiles)
            for k0 in sorted(columns) for r0, r1, a0, _, tiles in columns[k0]]


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
        with outside_autocast(q.device.type):
            problem = _Problem(q, k, v, rest, biases, **options)
            out, lse = problem.forward()
        ctx.save_for_backward(q, k, v, out, lse, *biases)
        ctx.rest, ctx.options = rest, options
        return problem.ungroup_rows(out).to(q.dtype), _ungroup_lse(problem, lse)

    @staticmethod
    def backward(ctx, g_out, g_lse):
        create_graph = torch.is_grad_enabled()
        q, k, v, out, lse, *biases = ctx.saved_tensors
        with torch.no_grad(), outside_autocast(q.device.type):
            problem = _Problem(q, k, v, ctx.rest, tuple(biases), **ctx.options)
            g_out = problem.group_rows(g_out.to(problem.cdt))
            if g_lse is not None:
                g_lse = problem.group_rows(g_lse.to(problem.cdt).unsqueeze(-1)).squeeze(-1)
            dq, dk, dv, dbiases = problem.backward(out, lse, g_out, g_lse)
            grads = [problem.ungroup_rows(dq).to(q.dtype), dk.view(k.shape).to(k.dtype), dv.view(v.shape).to(v.dtype)]
            grads += [None if db is None else db.to(b.dtype) for b, db in zip(biases, dbiases)]
        if create_graph:  # backward(create_graph=True): these gradients must not be differentiated
            grads = _NotTwice.wrap(grads, (q, k, v, *biases))
        return (grads[0], grads[1], grads[2], None, None, *grads[3:])


class _NotTwice(torch.autograd.Function):
    """Passes gradients through; differentiating them again raises a clear error (the chunked
    backward pass computes its tiles in place and is not itself differentiable)."""

    @staticmethod
    def wrap(grads, inputs):
        """``grads`` (tensors or None) as outputs that depend on ``inputs`` (those of the attention)."""
        present = [g for g in grads if g is not None]
        wrapped = iter(_NotTwice.apply(len(present), *present, *inputs))
        return [None if g is None else next(wrapped) for g in grads]

    @staticmethod
    def forward(ctx, n, *tensors):
        return tuple(t.clone() for t in tensors[:n])

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(
            "double backward is not supported by the chunked attention backend: its backward pass "
            "is not differentiable (create_graph=True, e.g. for gradient penalties or Hessian-vector "
            "products); use backend='reference' for higher-order gradients"
        )


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

    Inside ``torch.autocast``, q, k and v are cast as autocast casts SDPA's inputs (float64
    stays), so the output has the dtype SDPA's would; a float mask keeps its own precision.

    Returns:
        out (B, H, Lq, Dv), or ``(out, lse)``. A row with no visible key gives out 0.
    """
    q, k, v = autocast_inputs(q, k, v)
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
    size (H, Lq, Lk) is built. Differentiable (the lse is). Computed in the compute dtype, also
    inside ``torch.autocast``.
    """
    with outside_autocast(q.device.type):
        return _selected_weights(q, k, mask, scale=scale, heads=heads, rows=rows)


def _selected_weights(q, k, mask: Optional[Mask], *, scale: float, heads: Sequence[int], rows: Sequence[int]):
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
        tr.record(_steps.FUSED_ATTENTION, out, params={
            "backend": "chunked", "block_q": bq, "block_k": bk,
            "tiles_computed": BLOCKS_COMPUTED["forward"] - before, "tiles_total": total,
            "lk": k.shape[2], "head_dim": q.shape[-1],
        })
    return out


def _refuses(call: Call) -> Optional[str]:
    if call.dropout_p > 0:
        return ("dropout is not supported: the backward pass recomputes tiles and would need the "
                "forward's random mask again; use 'sdpa' or 'reference'")
    if call.need_weights:
        return "it does not return the attention weights (only 'reference' does)"
    if call.under_compile:
        return ("inside torch.compile its tiles branch on the data (shifts redone, rows without a "
                "visible key) and run on Python threads, which dynamo cannot trace; 'auto' runs sdpa "
                "or reference there")
    if call.mask is not None:
        tiled = [repr(p) for p in call.mask.parts if p.is_score_mod or p.kind in ("sink", "alibi")]
        if tiled:
            return (f"its tiles do not apply {' & '.join(tiled)} yet (score mods, sinks and alibi); "
                    "use backend='reference'")
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
