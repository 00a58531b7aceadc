"""The tile kernel: online softmax with its log-sum-exp over tiles, forward and backward.

One concept past 500 lines: one call of the tile kernel, forward and backward, in torch (the
readable algorithm, the oracle) and the hand-over of the same call to its native twin
(:attr:`Tiles.native_plan`, :meth:`Tiles.native_forward`, :meth:`Tiles.native_backward`), which
reads the very fields the torch algorithm reads.

One copy of the algorithm, used by the ``chunked`` backend (a whole call) and by the ring of
:mod:`multihead.distributed` (each ring step is one call of this kernel on the key block the
rank holds; the partial results are combined with :func:`merge`).

The (Lq, Lk) scores are never held at once. Queries are cut into blocks of ``block_q`` and keys
into blocks of ``block_k``; a *tile* is one query block x one key block, and the tiles the mask
hides entirely (``mask.tile_state(...) == "empty"``, or outside ``mask.key_span``) are never
computed. Key blocks are the outer loop; the tiles computed together (one tile, or where the
calling thread runs them all with several intra-op threads the tiles of consecutive query blocks
in one key block, a *panel* of at most :data:`PANEL_SCORES` scores) go through::

    shift = unset, acc = 0                          # per query row; acc (Dv + 1): Σ p V and Σ p
    for each key block K_j, V_j, left to right:
        for each panel Q_p of the query rows that see K_j:
            s = Q_p K_jᵀ · scale (+ the additive parts: bias tensors, ALiBi)
            s = mod(s) for each score-mod part, in written order (score_mod, softcap)
            s = -inf where a selecting part says False (not for tiles the mask shows whole)
            s -= shift
            rows that see a key here for the first time: shift = rowmax(s), s -= shift
            acc += exp(s) [V_j, 1]
    a row sum above sqrt(largest float): run again, redoing each panel whose row sums pass
        it with shift = max(shift, rowmax)
    out = acc[:, :Dv] / acc[:, Dv]  (0 where the sum is 0: no visible key)
    lse = shift + log(acc[:, Dv])
    with a sink logit z_h: out *= exp(lse - logaddexp(lse, z_h)), lse = logaddexp(lse, z_h)

This is FlashAttention's online softmax with the running max made lazy. A row's shift is the
row max of the first tile in which it sees a key, so its sum holds a term exp(0) = 1: later
scores far below the shift add terms below rounding (their underflow to 0 changes nothing), and
scores far above it (~44 in float32) make the row sum pass sqrt(largest float), and then the
forward runs again, checking each panel's row sums and redoing a panel that passes it with the
exact running max, rescaling acc by exp(old - new) (the first run checks nothing per panel: the
final row sums, sums of the panels' ones, show whether any passed it). A row whose first tiles show
it nothing (key padding over the first keys, a window that starts later) keeps its shift unset
until one does; its acc is 0 until then, so nothing needs rescaling. The result is therefore
exact for every score range and every tile order, and the common case pays one row-max pass per
row (in its first tile) and none after. A tile costs two matrix products (q kᵀ, p V), one
exponential, and a few passes over its scores (the shift, the row sums; a keep mask as an
added 0/-inf tile).

Base 2 (:attr:`Tiles.base2`): where no score mod reads the scores, q is scaled by
scale·log2(e) and the added parts (ALiBi, bias tensors) are added times log2(e), so that the
tiles hold the scores times log2(e), the shifts are in that unit and the exponential is exp2,
which torch computes faster than exp and at full speed on -inf, as FlashAttention-2 does on
GPUs; lse is returned in base e. Score mods are defined on the natural scores, so with them the
tiles stay in base e and use exp. Where something is added to the scores (an ALiBi bias can put
many finite scores below exp's range), arguments at or below -80 (in base e) are set to give
exactly 0 (:func:`_exp_`: torch's exp and exp2 are many times slower on lanes whose result is
subnormal or 0, and exp on -inf too; such terms are below rounding next to a row sum of at
least 1). The figures behind these choices are in docs/benchmarks.md.

The backward pass recomputes each panel from the saved (q, k, v, out, lse), so training memory
is O(L) as well: p = exp(s - lse), dV += pᵀ dO, dP = dO Vᵀ, dS = p ⊙ (dP - rowsum(dO ⊙ out)),
dQ += dS K · scale, dK += dSᵀ Q · scale, and a bias tensor gets dS (in base 2,
p = exp2(s·log2(e) - lse·log2(e)), and dK, formed from the log2(e)-scaled q, is multiplied by
ln 2 once). With score mods, each tile's mods are recomputed under autograd and dS is carried
back through them with ``torch.autograd.grad``, which also gives the gradients of the tensors
the mods read (``part.tensors``, inputs of the autograd function, e.g. a learned bias table a
score_mod indexes). The sink logits are differentiable through the lse. Where the native kernel's plan holds
(:attr:`Tiles.native_plan`) and no bias broadcast over both the queries and the keys needs a
gradient, the native kernel runs the backward (:meth:`Tiles.native_backward`: the same
recomputation in two passes that each own their sums). The kernel is not differentiable
itself: a double backward raises a clear error (use ``backend="reference"``).

Precision: the tiles compute in the compute dtype (float32 for float16/bfloat16 inputs, which
are cast once; the output is cast back once). The products are never taken in bfloat16: torch's
bfloat16 ``bmm`` on the CPU returns bfloat16, so q kᵀ would be rounded to 8 bits of mantissa
before the softmax (an error of about 1 at scores of a few units, where float32 scores give a few
thousandths), and CPU ``mm`` has no float32 output for bfloat16 operands. The native kernel
(:mod:`multihead.backends.native`) takes bfloat16 operands into float32 products instead.

Threads: on CPU the query blocks are shared among ``torch.get_num_threads()`` threads, dealt
out back and forth (0, 1, .., n-1, n-1, .., 0, ..: equal work under a causal mask), each running
torch single-threaded (:mod:`multihead.backends.cpu_threads`, the runtime apart from the
algorithm); where that is not possible everything runs in the calling thread, panel after panel
(so does a score mod with tensors to differentiate, in the backward). Either way the order of
every sum is fixed (the backward sums dK, dV in :data:`BACKWARD_LANES` lanes of query blocks, a
number that does not depend on the threads, and adds the lanes in order), so results are the same
bits from run to run and at every thread count, the caller's ``no_grad`` and ``inference_mode`` hold, and no other
thread's settings change. Grouped-query attention reads K/V once per kv head: q is viewed as
(B·Hkv, Lq·G, D) with the G query heads of one kv head side by side, so no repeated K/V is built.
On the ``meta`` device the data-dependent branches (redo, unset rows) are skipped: they change
values, never shapes.

Legend: B batch, H query heads, Hkv key/value heads, G = H // Hkv, N = B·Hkv, Lq/Lk query/key
lengths, D head dim, Dv value head dim, S parts merged.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections import Counter
from typing import Iterator, Optional, Sequence

import torch

from .._numerics import compute_dtype, finite_row_max, outside_autocast
from ..masks import ALiBi, KeyPadding, Mask, Softcap, split_additive, tile_of
from . import cpu_threads as _threads
from . import native as _native

__all__ = ["PANEL_SCORES", "counting", "TileCounts", "Tiles", "attend", "merge",
           "with_sink", "native_bf16", "cpu_features"]

#: most scores (B·Hkv x rows x keys) one panel of tiles computes at once (8 MiB in float32):
#: each op is big enough for torch's intra-op threads, its scores still fit in a CPU cache,
#: and a call's extra memory stays bounded
PANEL_SCORES = 2 ** 21

#: the backward's dK, dV are summed in this many lanes of query blocks (each its own partial sums,
#: added in lane order), whatever the thread count, so that they are the same bits at every thread
#: count; it bounds the threads of the torch tiles' backward and costs as many dK, dV partials
BACKWARD_LANES = 8
#: (queries, keys) per tile of the native backward under chunked's default blocks: smaller than the
#: forward's (its key pass holds a key block's dK, dV and a tile's p, dS transposed; a causal
#: diagonal wastes less), measured faster with bfloat16 and float32 at L=4096 (bench_chunked.py)
NATIVE_BACKWARD_BLOCKS = (64, 128)


class TileCounts(Counter):
    """The tile work of the calls inside one :func:`counting` block: tiles computed under
    "forward" and "backward", forward panels redone with an exact shift under "redone", tiles
    skipped as empty by ``tile_state`` under "skipped"; ``native``: forward calls the native
    kernel ran (its tiles are counted under "forward" too)."""

    native: int = 0


_counting = threading.local()  # .blocks: this thread's open TileCounts, innermost last


@contextlib.contextmanager
def counting() -> Iterator[TileCounts]:
    """Count the tile work this thread does inside the block (the backward of a CPU graph runs in
    the thread that calls ``.backward()``), for a trace's step or a test:

    >>> import torch
    >>> from multihead import masks
    >>> from multihead.backends import tiles as _tiles, chunked
    >>> q = torch.randn(1, 1, 64, 8)
    >>> with _tiles.counting() as counts:
    ...     _ = chunked.chunked_attention(q, q, q, masks.causal(), block_q=16, block_k=16)
    >>> counts["forward"]               # 4 x 4 tiles: the 6 above the diagonal are never computed
    10
    """
    counts = TileCounts()
    blocks = _counting.__dict__.setdefault("blocks", [])
    blocks.append(counts)
    try:
        yield counts
    finally:
        blocks.remove(counts)


def _count(key: str, n: int) -> None:
    for counts in getattr(_counting, "blocks", ()):
        if key == "native":
            counts.native += n
        else:
            counts[key] += n

_NEG_INF = float("-inf")
#: /proc/cpuinfo flags that mean native bfloat16 matrix products
_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


@functools.lru_cache(maxsize=None)
def cpu_features() -> str:
    """The CPU's vector features that matter here, as one line: torch's dispatch level
    (``torch.backends.cpu.get_cpu_capability()``, e.g. "AVX2", "AVX512") and the bfloat16 flags
    of /proc/cpuinfo that are present (amx_bf16, avx512_bf16), or "none"."""
    flags = _native.cpu_flags()
    bf16 = [f for f in _BF16_FLAGS if f in flags]
    return f"{torch.backends.cpu.get_cpu_capability()}; bf16 units: {', '.join(bf16) if bf16 else 'none'}"


@functools.lru_cache(maxsize=None)
def native_bf16() -> bool:
    """Whether this CPU has native bfloat16 matrix units (AMX-BF16 or AVX512-BF16)."""
    return any(f in _native.cpu_flags() for f in _BF16_FLAGS) or \
        torch.backends.cpu.get_cpu_capability() in ("AVX512_BF16", "AMX")


class Tiles:
    """One attention call, laid out for tiles; shared by the forward and the backward pass.

    q is held grouped and pre-scaled (by scale·log2(e) for base-2 scores, :attr:`base2`),
    (N, Lq·G, D), row ``i·G + g`` being query i of head ``kvhead·G + g``; k (N, Lk, D) and
    v (N, Lk, Dv). All in the compute dtype. The products take k and v transposed as views (a
    product with a transposed operand runs as fast as one with a copy laid out transposed, and
    the whole forward then skips that copy: docs/benchmarks.md).

    ``rest`` is the mask without its plain bias tensors, which come as ``biases`` (4-D,
    broadcastable to ``mask_shape``; differentiable inputs); ``mods`` its score-mod parts.
    ``positions`` optionally maps local query rows to the absolute positions the mask sees
    (for :func:`multihead.attention_weights` on selected rows); ``mask_heads`` picks the query
    heads of the mask's head axis (for selected heads).
    """

    def __init__(self, q, k, v, rest: Optional[Mask], biases, mods=(), *, scale, block_q, block_k,
                 mask_shape, positions=None, mask_heads=None, native_blocks=None, half_out=False):
        B, H, Lq, D = q.shape
        self.B, self.H, self.Lq, self.D = B, H, Lq, D
        self.Hkv, self.Lk, self.Dv = k.shape[1], k.shape[2], v.shape[-1]
        self.G = H // self.Hkv
        self.N = B * self.Hkv
        self.cdt = compute_dtype(q.dtype)
        self.scale = scale
        self.rest, self.biases, self.mods = rest, tuple(biases), tuple(mods)
        # on tiles the mask shows whole only the parts that add (ALiBi, float torch masks) are
        # built, through ``rest.block(..., whole=True)``: no selecting part (e.g. a mask_mod) is
        # evaluated there, and ALiBi still sees the documents it aligns to
        self.rest_adds = rest is not None and any(p.role == "add" for p in rest.parts)
        #: without score mods the scores are kept in base 2 (see the module docstring): q is
        #: scaled by scale·log2(e), added parts by log2(e), the exponential is exp2, shifts are in
        #: base 2 and lse is returned in base e
        self.base2 = not self.mods
        #: nothing is added to the scores: no finite score far below its row's max but the ones
        #: q·k itself gives, so exp2 runs without the floor (see :meth:`exp_`)
        self.plain = not self.biases and not self.rest_adds
        self.score_scale = scale * LOG2E if self.base2 else scale
        self.mask_shape = tuple(mask_shape)
        self.mask_heads = mask_heads
        #: the inputs as given (the native kernel reads them through their strides); the torch
        #: tiles' grouped, compute-dtype copies (:attr:`q`, :attr:`k`, :attr:`v`) are made on first use
        self.inputs = (q, k, v)
        self.positions = positions
        #: (queries, keys) per tile of the native kernel (one head's queries): the caller's, or the
        #: tiles' block_q and block_k
        self.native_blocks = native_blocks or (block_q, block_k)
        #: the native backward's tiles: :data:`NATIVE_BACKWARD_BLOCKS` where the caller left the
        #: blocks to chunked's defaults (``native_blocks`` given), else the caller's
        self.native_backward_blocks = NATIVE_BACKWARD_BLOCKS if native_blocks else self.native_blocks
        #: the native forward may return out in q's dtype (the rounding the caller's cast makes):
        #: for calls whose float32 out nothing reads (no gradient, no sink to fold in)
        self.half_out = half_out
        self.block_q, self.block_k = block_q, block_k
        self.blocks = _query_blocks(Lq, block_q, positions)
        # a panel whose row sums pass this is redone with an exact shift (exp would overflow soon)
        self.limit = math.exp(math.log(torch.finfo(self.cdt).max) / 2)

    @functools.cached_property
    def q(self) -> torch.Tensor:
        """(N, Lq·G, D): q grouped, in the compute dtype, times :attr:`score_scale`."""
        return self.group_rows(self.inputs[0].to(self.cdt) * self.score_scale)

    @functools.cached_property
    def k(self) -> torch.Tensor:
        """(N, Lk, D) in the compute dtype."""
        return self.inputs[1].to(self.cdt).reshape(self.N, self.Lk, self.D)

    @functools.cached_property
    def v(self) -> torch.Tensor:
        """(N, Lk, Dv) in the compute dtype."""
        return self.inputs[2].to(self.cdt).reshape(self.N, self.Lk, self.Dv)

    # -- the native kernel
    @functools.cached_property
    def native_plan(self) -> tuple[Optional[dict], str]:
        """``(arguments, why)``: the native kernel's arguments for this call (the mask as key
        intervals per row, key padding, float32 bias views, ALiBi slopes and diagonals, a softcap),
        or None and why the torch tiles run it (a Python mask_mod or score_mod, a dense keep
        tensor, selected rows or heads, float64, a tensor subclass or dispatch mode, ...)."""
        q, k, v = self.inputs
        why = _native.why_not(q.device, q.dtype)
        if why is not None:
            return None, why
        if self.positions is not None or self.mask_heads is not None:
            return None, "selected query rows or heads (attention_weights) run the torch tiles"
        tensors = (q, k, v, *self.biases)
        if any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in tensors) or _threads.python_modes_active():
            return None, "a tensor subclass or a Python dispatch mode is in play"
        keep: Optional[torch.Tensor] = None
        alibi: Optional[ALiBi] = None
        cap = 0.0
        for part in self.rest.parts if self.rest is not None else ():
            if part.is_structural or part.role == "denominator":  # the sink: read as mask.sink_logits
                continue
            if isinstance(part, KeyPadding):
                keep = part.tensor if keep is None else keep & part.tensor
            elif isinstance(part, ALiBi) and alibi is None and part.slopes.dim() == 1:
                alibi = part  # (B, H) slopes, one set per sequence, run the torch tiles
            elif isinstance(part, Softcap) and cap == 0.0:
                cap = float(part.cap)
            else:
                return None, f"a {part.kind} part runs the torch tiles (the native kernel reads structural kinds, " \
                             "key padding, bias tensors, ALiBi, softcap and sinks)"
        if cap and any(p.kind != "softcap" for p in self.mods):
            return None, "a score_mod runs the torch tiles"
        shape = self.mask_shape
        intervals = None
        if self.rest is not None:
            ivs = self.rest.row_intervals(shape)
            if ivs is not None:
                ends = [torch.as_tensor(e, dtype=torch.int64) for iv in ivs for e in iv]
                rows = max((e.shape[0] for e in ends if e.dim() == 2), default=1)
                intervals = torch.stack([torch.stack([lo.expand(rows, self.Lq), hi.expand(rows, self.Lq)], -1)
                                         for lo, hi in zip(ends[::2], ends[1::2])]).contiguous()
        slopes = diag = None
        if alibi is not None and self.rest is not None:
            slopes = alibi.slopes.detach().to(torch.float32).contiguous()
            diag = self.rest.row_diagonals(shape, alibi.align).to(torch.int64)
            diag = diag.reshape(-1, self.Lq).contiguous()
        biases = [b.detach().to(torch.float32).expand(shape) for b in self.biases]
        return dict(intervals=intervals, keep=keep, biases=biases, slopes=slopes, diag=diag, softcap=cap,
                    half=_native.half_products(q.dtype)), "native"

    def native_forward(self, args: dict):
        """``(out (B, H, Lq, Dv), lse (B, H, Lq))`` in float32 by the native kernel."""
        q, k, v = self.inputs
        out, lse, tiles, path = _native.module().forward(
            q.detach(), k.detach(), v.detach(), float(self.scale), args["intervals"], args["keep"], args["biases"],
            args["slopes"], args["diag"], args["softcap"], *self.native_blocks, args["half"], _native.amx_tiles(),
            self.half_out)
        _count("forward", int(tiles))
        _count("native", 1)
        _native.CALLS["forward"] += 1
        _native.CALLS["forward on AMX tiles"] += int(path)
        return out, lse

    def native_backward_why(self, wanted: Sequence[bool]) -> Optional[str]:
        """Why the native kernel cannot run this call's backward (None: it can), ``wanted`` saying
        which bias tensors need a gradient: the forward's reasons (:attr:`native_plan`), or a bias
        gradient broadcast over both the queries and the keys (no pass owns its sums)."""
        args, why = self.native_plan
        if args is None:
            return why
        for b, w in zip(self.biases, wanted):
            if w and b.dim() == 4 and b.shape[2] == 1 != self.Lq and b.shape[3] == 1 != self.Lk:
                return "a bias broadcast over the queries and the keys needs a gradient (the torch tiles form it)"
        return None

    def native_backward(self, args: dict, out, lse, g_out, g_lse, wanted: Sequence[bool]):
        """``(dq (B, H, Lq, D), dk, dv (B, Hkv, Lk, D|Dv), dbiases)`` in float32 by the native kernel
        from out (B, H, Lq, Dv) and lse (B, H, Lq) and their gradients (g_lse may be None);
        ``dbiases`` has a gradient per bias tensor that ``wanted`` one, None elsewhere."""
        q, k, v = self.inputs
        dbiases = [torch.zeros(b.shape, dtype=torch.float32) if w else torch.empty(0) for b, w in zip(self.biases, wanted)]
        dq, dk, dv, tiles = _native.module().backward(
            q.detach(), k.detach(), v.detach(), out.to(torch.float32), lse.to(torch.float32).contiguous(),
            g_out.to(torch.float32), None if g_lse is None else g_lse.to(torch.float32).contiguous(),
            float(self.scale), args["intervals"], args["keep"], args["biases"], dbiases, args["slopes"], args["diag"],
            args["softcap"], *self.native_backward_blocks, args["half"])
        _count("backward", int(tiles))
        _native.CALLS["backward"] += 1
        return dq, dk, dv, [d if w else None for d, w in zip(dbiases, wanted)]

    # -- layout: (B, H, Lq, X) <-> (N, Lq·G, X)
    def group_rows(self, t: torch.Tensor) -> torch.Tensor:
        B, H, L, X = t.shape
        return t.reshape(B, self.Hkv, self.G, L, X).transpose(2, 3).reshape(self.N, L * self.G, X)

    def ungroup_rows(self, t: torch.Tensor) -> torch.Tensor:
        X = t.shape[-1]
        return t.reshape(self.B, self.Hkv, self.Lq, self.G, X).transpose(2, 3).reshape(self.B, self.H, self.Lq, X)

    def group_lse(self, t: torch.Tensor) -> torch.Tensor:
        """(B, H, Lq) -> (N, Lq·G)."""
        return self.group_rows(t.unsqueeze(-1)).squeeze(-1)

    def ungroup_lse(self, t: torch.Tensor) -> torch.Tensor:
        """(N, Lq·G) -> (B, H, Lq)."""
        return self.ungroup_rows(t.unsqueeze(-1)).squeeze(-1)

    def _grouped_tile(self, t: torch.Tensor, *, select_heads: bool = False) -> torch.Tensor:
        """A (b, h, bq, bk) mask tile as (b, Hkv|1, bq, G|1, bk), matching the grouped scores;
        ``select_heads`` first picks :attr:`mask_heads` from a tile of the mask's own heads."""
        if select_heads and self.mask_heads is not None and t.shape[1] != 1:
            t = t[:, self.mask_heads]
        if t.shape[1] == 1:
            return t.unsqueeze(3)
        b, _, bq, bk = t.shape
        return t.reshape(b, self.Hkv, self.G, bq, bk).transpose(2, 3)

    def _products(self, r0, r1, k0, k1) -> torch.Tensor:
        """scale · q kᵀ of local queries r0..r1-1 x keys k0..k1-1: (N, (r1-r0)·G, bk), a new tensor."""
        rows = slice(r0 * self.G, r1 * self.G)
        return torch.bmm(self.q[:, rows], self.k[:, k0:k1].transpose(1, 2))

    def _additive(self, s, r0, r1, a0, k0, k1, whole) -> Optional[torch.Tensor]:
        """Add the bias tiles to ``s`` (N, rows, bk) in place; the tile's keep mask as a grouped
        (b, Hkv|1, bq, G|1, bk) tile of 0 and -inf to add, or None (no keep mask, or a tile the
        mask shows whole). Adding -inf is faster than ``masked_fill_`` here (docs/benchmarks.md)."""
        nq = r1 - r0
        tiles = [(tile_of(b, a0, a0 + nq, k0, k1), False) for b in self.biases]  # heads picked already
        keep = None
        if self.rest is not None and (self.rest_adds or not whole):
            mt = self.rest.block(a0, a0 + nq, k0, k1, self.mask_shape, device=s.device, dtype=self.cdt, whole=whole)
            keep = mt.keep
            if mt.bias is not None:
                tiles.append((mt.bias, True))
        if tiles:
            s5 = s.view(self.B, self.Hkv, nq, self.G, k1 - k0)
            for t, select in tiles:
                s5.add_(self._grouped_tile(t.to(self.cdt), select_heads=select), alpha=LOG2E if self.base2 else 1.0)
        if keep is None:
            return None
        hidden = torch.zeros(keep.shape, dtype=self.cdt, device=s.device).masked_fill_(~keep, _NEG_INF)
        return self._grouped_tile(hidden, select_heads=True)

    def _hide(self, s, hidden, nq, bk) -> None:
        """Add the 0/-inf tile ``hidden`` (from :meth:`_additive`) to the scores s (N, nq·G, bk)."""
        if hidden is not None:
            s.view(self.B, self.Hkv, nq, self.G, bk).add_(hidden)

    def apply_mods(self, s: torch.Tensor, a0: int, nq: int, k0: int, k1: int) -> torch.Tensor:
        """The score mods, in written order, on the grouped scores s (N, nq·G, bk) of queries
        a0.. x keys k0..k1-1; a new contiguous (N, nq·G, bk) tensor (differentiable)."""
        bk = k1 - k0
        s4 = s.view(self.B, self.Hkv, nq, self.G, bk).transpose(2, 3).reshape(self.B, self.H, nq, bk)
        for mod in self.mods:
            s4 = mod.apply_block(s4, a0, a0 + nq, k0, k1, self.mask_shape, self.mask_heads)
        return s4.reshape(self.B, self.Hkv, self.G, nq, bk).transpose(2, 3).reshape(self.N, nq * self.G, bk).contiguous()

    def scores(self, shift, r0, r1, a0, k0, k1, whole=False) -> torch.Tensor:
        """Final scores of local queries r0..r1-1 (at absolute positions a0..) x keys k0..k1-1,
        minus the rows' ``shift`` (N, (r1-r0)·G, 1) or None: (N, rows, bk), -inf where hidden.
        ``whole``: the mask shows the whole tile (no keep mask is applied)."""
        s = self._products(r0, r1, k0, k1)
        hidden = self._additive(s, r0, r1, a0, k0, k1, whole)
        if self.mods:
            s = self.apply_mods(s, a0, r1 - r0, k0, k1)
        self._hide(s, hidden, r1 - r0, k1 - k0)
        if shift is not None:
            s.sub_(shift)
        return s

    def plans(self, workers: int) -> list:
        """One list of panels per worker (see :func:`_plan`): query block i goes to worker
        :func:`.cpu_threads.worker_of` (i, ``workers``), a fixed rule, so every sum is formed in the same order
        on every run.
        One worker (the calling thread) with several intra-op threads (where the work cannot be
        shared out: tensor subclasses, Python modes) merges consecutive blocks into panels of up
        to :data:`PANEL_SCORES` scores, for those threads; one thread, or several workers, each
        single-threaded, compute tile by tile: every product then has a tile's rows whatever
        the thread count (a BLAS may round a row by where it falls in a taller product: MKL's
        AVX2 kernels do, so merged panels at one thread gave other bits than tiles at two)."""
        if workers == 1 and torch.get_num_threads() > 1:
            panel_queries = PANEL_SCORES // max(1, self.N * self.G * self.block_k) // self.block_q * self.block_q
        else:
            panel_queries = self.block_q
        return [_plan([b for i, b in enumerate(self.blocks) if _threads.worker_of(i, workers) == w], self.Lk, self.rest,
                      self.block_k, self.mask_shape,
                      max(self.block_q, panel_queries), self.q.device) for w in range(workers)]

    # -- passes
    def forward(self):
        """``(out, lse)``: out (N, Lq·G, Dv) and lse (N, Lq·G) in the compute dtype.

        The panels run once without looking at their row sums (no synchronising check per
        panel). A row sum past :attr:`limit` anywhere, which the final sums show (they are sums
        of the panels' row sums, all >= 0, and an overflow leaves them inf), means some panel
        needed the exact shift: then the forward runs again from the start, checking every
        panel and redoing those that need it (:meth:`_redo`). Only such inputs (a later score
        some 44 above the row's first-tile max in float32) pay the second run.
        """
        args, _ = self.native_plan
        if args is not None:
            out, lse = self.native_forward(args)
            return self.group_rows(out), self.group_lse(lse)
        plans = self.plans(_threads.workers_for(len(self.blocks), *self.inputs, *self.biases))
        run = self._forward_pass(plans, careful=False)
        if _any(run.total > self.limit):
            run = self._forward_pass(plans, careful=True)
        out = run.acc / run.total.masked_fill(run.total == 0, 1.0)
        shift = run.shift * LN2 if self.base2 else run.shift
        return out, (run.total.log() + shift).squeeze(-1)

    def _forward_pass(self, plans, careful: bool) -> "_Running":
        """All panels of ``plans`` (one list per worker) into a new :class:`_Running`."""
        run = _Running(self.N, self.Lq * self.G, self.Dv, self.cdt, self.q.device, careful)

        def work(w):  # query blocks are disjoint rows: workers never write the same row
            return sum(self._forward_panel(run, *p[:6]) for p in plans[w])

        redone = sum(_threads.share(work, len(plans)))
        if redone:
            _count("redone", redone)
        _count("forward", sum(p[-1] for plan in plans for p in plan))
        return run

    def _forward_panel(self, run: "_Running", k0, k1, r0, r1, a0, whole) -> bool:
        """One panel into ``run.acc`` and ``run.total``; whether it had to be redone."""
        rows = slice(r0 * self.G, r1 * self.G)
        row_shift = run.shift[:, rows]
        s = self.scores(row_shift, r0, r1, a0, k0, k1, whole)
        if not run.settled(r0, r1):
            fresh = run.unset[:, rows]
            if _any(fresh):  # rows that may see their first key here: shift them by its row max
                top = s.amax(dim=-1, keepdim=True)
                seen = top > _NEG_INF
                first = torch.where(fresh & seen, top, 0.0)
                s.sub_(first)
                row_shift.add_(first)
                fresh.logical_and_(~seen)
            if not _any(fresh):
                run.settle(r0, r1)
        p = self.exp_(s)
        part_sum = p.sum(dim=-1, keepdim=True)
        redo = run.careful and _any(part_sum > self.limit)
        if redo:
            p = self._redo(run, r0, r1, a0, k0, k1, whole, part_sum > self.limit)
            part_sum = p.sum(dim=-1, keepdim=True)
        run.acc[:, rows].add_(self._weighted(p, k0, k1))
        run.total[:, rows].add_(part_sum)
        return redo

    def _weighted(self, p, k0, k1) -> torch.Tensor:
        """p V (N, rows, Dv) for the probabilities p (N, rows, bk) of keys k0..k1-1."""
        return torch.bmm(p, self.v[:, k0:k1])

    def _redo(self, run: "_Running", r0, r1, a0, k0, k1, whole, passed) -> torch.Tensor:
        """The panel's exp(s - shift) again with shift = max(old shift, its row max) for the rows
        whose sums ``passed`` the limit (N, rows, 1) (the others keep theirs: which rows change
        never depends on how blocks were merged into panels, so neither do the bits); rescales
        the rows' ``acc`` and ``total`` to it. A row with no visible key in the panel keeps its
        shift (max with -inf)."""
        rows = slice(r0 * self.G, r1 * self.G)
        old = run.shift[:, rows]
        s = self.scores(None, r0, r1, a0, k0, k1, whole)
        new = torch.where(passed, torch.maximum(old, s.amax(dim=-1, keepdim=True)), old)
        factor = (old - new).exp2_() if self.base2 else (old - new).exp_()
        run.acc[:, rows].mul_(factor)
        run.total[:, rows].mul_(factor)
        old.copy_(new)
        return self.exp_(s.sub_(new))

    def exp_(self, s: torch.Tensor) -> torch.Tensor:
        """The exponential of scores minus a shift, in place: torch's exp2 for base-2 scores
        with nothing added (it keeps its fast path on -inf; terms it takes to 0 or subnormal
        are below rounding next to the row sum, as in `_exp_`), else `_exp_` (base 2 or e: an
        ALiBi bias or a bias tensor can put many finite scores below exp's range)."""
        if self.base2 and self.plain:
            return s.exp2_()
        return _exp_(s, self.base2)

    def backward(self, out, lse, g_out, g_lse, mod_inputs=()):
        """``(dq, dk, dv, dbiases, dmods)`` for out/lse from :meth:`forward` (grouped, compute
        dtype) and their gradients; ``mod_inputs`` are the score mods' tensors that need a
        gradient (``dmods`` has one entry per tensor, None where none flowed).

        Per panel: p = exp(s - lse), dV += pᵀ dO, dS = p ⊙ (dO Vᵀ - delta) with
        delta = rowsum(dO ⊙ out) - g_lse, then back through the score mods, dQ += dS K,
        dK += dSᵀ Q. The panels run in a fixed order, so every sum is too.
        """
        D, Dv, G = self.D, self.Dv, self.G
        q, k = self.q, self.k
        dq = torch.zeros_like(q)
        dk = torch.zeros(self.N, self.Lk, D, dtype=self.cdt, device=q.device)
        dv = torch.zeros(self.N, self.Lk, Dv, dtype=self.cdt, device=q.device)
        dbiases = [torch.zeros(b.shape, dtype=self.cdt, device=b.device) if b.requires_grad else None
                   for b in self.biases]
        dmods: list = [None] * len(mod_inputs)
        # dS = p ⊙ (dP - delta): delta = rowsum(dO ⊙ out) is the softmax's own term, less g_lse
        delta = (g_out * out).sum(dim=-1, keepdim=True)
        if g_lse is not None:
            delta = delta - g_lse.unsqueeze(-1)
        row_lse = lse.masked_fill(lse == _NEG_INF, 0.0).unsqueeze(-1)
        if self.base2:
            row_lse = row_lse * LOG2E
        # a bias or mod-tensor gradient may be shared by all query blocks: one lane, in the
        # calling thread; otherwise the query blocks are dealt to BACKWARD_LANES lanes, a number
        # that does not depend on the threads, each lane with its own dK, dV partial sums, added
        # in lane order: the same bits at every thread count
        one = any(db is not None for db in dbiases) or bool(mod_inputs)
        if one:
            plans = self.plans(1)
        else:
            lanes = min(BACKWARD_LANES, len(self.blocks))
            plans = [_plan([b for i, b in enumerate(self.blocks) if _threads.worker_of(i, lanes) == lane], self.Lk,
                           self.rest, self.block_k, self.mask_shape, self.block_q, q.device) for lane in range(lanes)]
        workers = 1 if one else _threads.workers_for(len(plans), q, k, g_out)
        partials = [(dk, dv)] + [(torch.zeros_like(dk), torch.zeros_like(dv)) for _ in plans[1:]]

        def lane_work(lane):  # dq: disjoint rows; dk, dv: the lane's own partial sums
            pdk, pdv = partials[lane]
            for k0, k1, r0, r1, a0, whole, _ in plans[lane]:
                rows = slice(r0 * G, r1 * G)
                if self.mods:
                    p, back = self._modded_probabilities(row_lse[:, rows], r0, r1, a0, k0, k1, whole, mod_inputs)
                else:
                    p, back = self.exp_(self.scores(row_lse[:, rows], r0, r1, a0, k0, k1, whole)), None
                # products into new tensors, then added: a slice as the output of baddbmm_ would
                # make torch run one matrix product per batch item instead of one batched product
                pdv[:, k0:k1].add_(torch.bmm(p.transpose(1, 2), g_out[:, rows]))
                ds = p.mul_(torch.bmm(g_out[:, rows], self.v[:, k0:k1].transpose(1, 2)).sub_(delta[:, rows]))
                if back is not None:  # through the score mods: dS of their inputs, and their tensors'
                    ds, grads = back(ds)
                    for i, g in enumerate(grads):  # summed over tiles in the compute dtype: a
                        if g is not None:               # bf16 table is rounded once, at the end
                            g = g.to(self.cdt)
                            dmods[i] = g if dmods[i] is None else dmods[i].add_(g)
                dq[:, rows].add_(torch.bmm(ds, k[:, k0:k1]))
                pdk[:, k0:k1].add_(torch.bmm(ds.transpose(1, 2), q[:, rows]))
                for db in dbiases:
                    if db is not None:
                        _add_bias_grad(db, self._ungrouped_tile(ds, r1 - r0), a0, a0 + r1 - r0, k0, k1)

        def work(w):  # worker w takes lanes w, w + workers, ...
            for lane in range(w, len(plans), workers):
                lane_work(lane)

        _threads.share(work, workers)
        for pdk, pdv in partials[1:]:  # in lane order, whichever finished first
            dk.add_(pdk)
            dv.add_(pdv)
        _count("backward", sum(p[-1] for plan in plans for p in plan))
        if self.base2:  # dK = dSᵀ (scale·Q), and q holds scale·log2(e)·Q
            dk.mul_(LN2)
        return dq.mul_(self.scale), dk, dv, dbiases, dmods

    def _modded_probabilities(self, row_lse, r0, r1, a0, k0, k1, whole, mod_inputs):
        """p = exp(s - lse) of one panel whose scores pass through the score mods, and the
        function that takes dS (of the modded scores) back to dS of their inputs and the
        gradients of ``mod_inputs``, by ``torch.autograd.grad`` over the recomputed mods."""
        nq = r1 - r0
        s = self._products(r0, r1, k0, k1)
        hidden = self._additive(s, r0, r1, a0, k0, k1, whole)
        with torch.enable_grad():
            x = s.detach().requires_grad_(True)
            y = self.apply_mods(x, a0, nq, k0, k1)
        p = y.detach().clone()
        self._hide(p, hidden, nq, k1 - k0)
        p = _exp_(p.sub_(row_lse))

        def back(ds):
            grads = torch.autograd.grad(y, [x, *mod_inputs], ds, allow_unused=True)
            return grads[0], grads[1:]

        return p, back

    def _ungrouped_tile(self, ds: torch.Tensor, nq: int) -> torch.Tensor:
        """(N, nq·G, bk) -> (B, H, nq, bk)."""
        bk = ds.shape[-1]
        return ds.view(self.B, self.Hkv, nq, self.G, bk).transpose(2, 3).reshape(self.B, self.H, nq, bk)


class _Running:
    """The running state of one forward pass over the rows (N, Lq·G): ``shift`` each row's
    shift (0 while unset), ``unset`` the rows that have seen no key yet (their shift is still to
    be chosen, their acc is 0), ``acc`` Σ p V, ``total`` the row sums of exp(s - shift);
    ``careful``: check every panel's row sums (see :meth:`Tiles.forward`). The query blocks
    whose rows are all set are kept by their first row (a set, shared by the workers, whose
    blocks are disjoint), so that only a block's first panels look at ``unset``."""

    def __init__(self, n, rows, dv, dtype, device, careful: bool):
        self.shift = torch.zeros(n, rows, 1, dtype=dtype, device=device)
        self.acc = torch.zeros(n, rows, dv, dtype=dtype, device=device)
        self.total = torch.zeros(n, rows, 1, dtype=dtype, device=device)
        self.unset = torch.ones(n, rows, 1, dtype=torch.bool, device=device)
        self.careful = careful
        self._set: dict = {}  # first row -> last row + 1 of a run of settled rows

    def settled(self, r0: int, r1: int) -> bool:
        """Whether every row of r0..r1-1 has its shift (a panel's rows are one settled run or not)."""
        end = self._set.get(r0)
        return end is not None and end >= r1

    def settle(self, r0: int, r1: int) -> None:
        self._set[r0] = max(r1, self._set.get(r0, r1))


class _TiledAttention(torch.autograd.Function):
    """out, lse = f(q, k, v, *biases, *mod_tensors); the backward recomputes tiles (nothing
    (Lq, Lk) is saved). out is in the compute dtype (the caller casts it)."""

    @staticmethod
    def forward(ctx, q, k, v, rest, mods, options, n_biases, *tensors):
        biases = tensors[:n_biases]
        with outside_autocast(q.device.type):
            # out may come in q's dtype only where no backward will read it
            half_out = options["half_out"] and not any(ctx.needs_input_grad)
            tiles = Tiles(q, k, v, rest, biases, mods, **dict(options, half_out=half_out))
            out, lse = tiles.forward()
        ctx.save_for_backward(q, k, v, out, lse, *tensors)
        ctx.rest, ctx.mods, ctx.options, ctx.n_biases = rest, mods, options, n_biases
        return tiles.ungroup_rows(out), tiles.ungroup_lse(lse)

    @staticmethod
    def backward(ctx, g_out, g_lse):
        create_graph = torch.is_grad_enabled()
        q, k, v, out, lse, *tensors = ctx.saved_tensors
        biases, mod_tensors = tensors[:ctx.n_biases], tensors[ctx.n_biases:]
        # the tensors the mods' closures read, as they hold them (autograd.grad needs those very
        # objects, not the saved copies)
        captured = _mod_tensors(ctx.mods)
        wanted = [i for i in range(len(mod_tensors)) if ctx.needs_input_grad[7 + ctx.n_biases + i]]
        wanted_biases = [ctx.needs_input_grad[7 + i] for i in range(ctx.n_biases)]
        with torch.no_grad(), outside_autocast(q.device.type), contextlib.ExitStack() as reading:
            tiles = Tiles(q, k, v, ctx.rest, tuple(biases), ctx.mods, **ctx.options)
            if not wanted and tiles.native_backward_why(wanted_biases) is None:
                args = tiles.native_plan[0]
                dq, dk, dv, dbiases = tiles.native_backward(args, tiles.ungroup_rows(out), tiles.ungroup_lse(lse),
                                                            g_out, g_lse, wanted_biases)
                grads = [dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)]
                grads += [None if db is None else db.to(b.dtype) for b, db in zip(biases, dbiases)]
                grads += [None] * len(mod_tensors)
                if create_graph:
                    grads = _NotTwice.wrap(grads, (q, k, v, *tensors))
                return (grads[0], grads[1], grads[2], None, None, None, None, *grads[3:])
            g_out = tiles.group_rows(g_out.to(tiles.cdt))
            if g_lse is not None:
                g_lse = tiles.group_lse(g_lse.to(tiles.cdt))
            # a low-precision tensor the mods read is read as its compute-dtype twin (the same
            # values), so that its gradient is summed in the compute dtype and rounded once
            inputs = [captured[i] for i in wanted]
            twins = {id(t): t.detach().to(tiles.cdt).requires_grad_(True) for t in inputs
                     if t.is_floating_point() and t.dtype != tiles.cdt}
            if twins:
                done = set()
                for mod in ctx.mods:
                    done.update(reading.enter_context(mod.reading(twins)))
                inputs = [twins[id(t)] if id(t) in done else t for t in inputs]
            dq, dk, dv, dbiases, dmods = tiles.backward(out, lse, g_out, g_lse, tuple(inputs))
            grads = [tiles.ungroup_rows(dq).to(q.dtype), dk.view(k.shape).to(k.dtype), dv.view(v.shape).to(v.dtype)]
            grads += [None if db is None else db.to(b.dtype) for b, db in zip(biases, dbiases)]
            mod_grads: list = [None] * len(mod_tensors)
            for i, g in zip(wanted, dmods):
                mod_grads[i] = None if g is None else g.to(mod_tensors[i].dtype)
            grads += mod_grads
        if create_graph:  # backward(create_graph=True): these gradients must not be differentiated
            grads = _NotTwice.wrap(grads, (q, k, v, *tensors))
        return (grads[0], grads[1], grads[2], None, None, None, None, *grads[3:])


def attend(q, k, v, mask: Optional[Mask], *, scale: float, block_q: int, block_k: int, mask_shape,
           positions: Optional[Sequence[int]] = None, mask_heads: Optional[Sequence[int]] = None,
           native_blocks: Optional[tuple[int, int]] = None):
    """``(out, lse)`` of one attention call by tiles, differentiable in q, k, v, the mask's bias
    tensors, its score mods' ``tensors`` and its sink logits.

    q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), all checked; ``mask`` checked for
    ``mask_shape`` (B, H, Lq, Lk). Returns out (B, H, Lq, Dv) in q's dtype and lse (B, H, Lq)
    in the compute dtype (-inf for a row with no visible key; with a sink, logaddexp(lse, sink)).
    """
    rest, biases = split_additive(mask, mask_shape)
    if mask_heads is not None:
        biases = tuple(b if b.shape[1] == 1 else b[:, list(mask_heads)] for b in biases)
    if rest is not None and mask is not None and mask.plan is not None and rest.plan is None:
        rest = rest.with_plan(mask.plan)  # the plan is of the selecting parts, which rest keeps
    mods = mask.score_mods if mask is not None else ()
    mod_tensors = _mod_tensors(mods)
    options = dict(scale=scale, block_q=block_q, block_k=block_k, mask_shape=tuple(mask_shape),
                   native_blocks=native_blocks,
                   positions=None if positions is None else [int(p) for p in positions],
                   mask_heads=None if mask_heads is None else list(mask_heads),
                   half_out=mask is None or mask.sink_logits is None)
    out, lse = _TiledAttention.apply(q, k, v, rest, mods, options, len(biases), *biases, *mod_tensors)
    sink = mask.sink_logits if mask is not None else None
    if sink is not None:
        out, lse = with_sink(out, lse, sink if mask_heads is None else sink[list(mask_heads)])
    return out.to(q.dtype), lse


def kernel_for(q, k, v, mask: Optional[Mask], *, scale: float, mask_shape,
               native_blocks: Optional[tuple[int, int]] = None) -> str:
    """Which tile kernel :func:`attend` runs for this call, and why: "native kernel (...); forward
    on AMX tiles (or: by brgemm (why)); backward: native kernel" (or "; backward: torch tiles
    (why)") or "torch tiles (why not native)"; for ``explain_dispatch``. Arguments as for
    :func:`attend` (``native_blocks`` None: blocks are not what keeps a call off the AMX tiles)."""
    forward, backward = _kernels(q, k, v, mask, scale=scale, mask_shape=mask_shape)
    if forward is not None:
        return f"torch tiles ({forward})"
    line = _native.status()
    if q.dtype in (torch.bfloat16, torch.float16):
        amx = _native.amx_forward_why_not(q.dtype, q.shape[-1], v.shape[-1], native_blocks)
        line += "; forward on AMX tiles" if amx is None else f"; forward by brgemm ({amx})"
    return line + ("; backward: native kernel" if backward is None else f"; backward: torch tiles ({backward})")


def backward_kernel_for(q, k, v, mask: Optional[Mask], *, scale: float, mask_shape) -> str:
    """"native" or "torch tiles": the kernel that runs this call's backward (for the trace)."""
    return "torch tiles" if _kernels(q, k, v, mask, scale=scale, mask_shape=mask_shape)[1] else "native"


def _kernels(q, k, v, mask: Optional[Mask], *, scale: float, mask_shape) -> tuple[Optional[str], Optional[str]]:
    """Why the native kernel does not run this call's forward and its backward (None: it does)."""
    rest, biases = split_additive(mask, mask_shape)
    groups = q.shape[1] // k.shape[1]
    tiles = Tiles(q, k, v, rest, biases, mask.score_mods if mask is not None else (), scale=scale,
                  block_q=max(1, 256 // groups), block_k=256, mask_shape=mask_shape)
    return tiles.native_plan[1] if tiles.native_plan[0] is None else None, \
        tiles.native_backward_why([b.requires_grad for b in biases])


def _mod_tensors(mods) -> tuple[torch.Tensor, ...]:
    """The tensors the score mods read, each once (a tensor two mods read gets one gradient)."""
    seen: dict[int, torch.Tensor] = {}
    for m in mods:
        for t in m.tensors:
            seen.setdefault(id(t), t)
    return tuple(seen.values())


def with_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor):
    """``(out, lse)`` with a per-head sink logit in the softmax denominator: out (B, H, Lq, Dv),
    lse (B, H, Lq), sink (H,) -> out · exp(lse - logaddexp(lse, sink)), logaddexp(lse, sink).
    Differentiable in all three; a row with no visible key keeps out 0 (and gets lse = sink)."""
    z = sink.to(lse.dtype).view(1, -1, 1)
    total = torch.logaddexp(lse, z)
    return out * torch.exp(lse - total).unsqueeze(-1).to(out.dtype), total


def merge(outputs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]):
    """Attention over the union of disjoint key sets from its parts: ``(out, lse)``.

    outputs: S tensors (..., Lq, Dv), each attention over one key set; lses: their (..., Lq)
    log-sum-exps (-inf for a row that saw no key in that part). Returns the out and lse of
    attention over all the keys at once: lse = log Σ_s exp(lse_s), out = Σ_s exp(lse_s - lse) out_s
    (0 and -inf for a row with no key in any part). Differentiable in every input (no NaN
    gradient for empty rows). Computed in the lse's dtype; out comes back in outputs[0]'s.
    Arguments are not checked (``multihead.merge`` checks them).
    """
    cdt = lses[0].dtype
    stacked = torch.stack([l.to(cdt) for l in lses])  # (S, ..., Lq)
    top = finite_row_max(stacked.movedim(0, -1)).squeeze(-1)  # (..., Lq); -inf everywhere -> 0
    weights = torch.exp(stacked - top)  # (S, ..., Lq); 0 for a part without a key
    total = weights.sum(dim=0)
    seen = total > 0
    safe = torch.where(seen, total, torch.ones_like(total))
    out = sum(w.unsqueeze(-1) * o.to(cdt) for w, o in zip(weights, outputs)) / safe.unsqueeze(-1)
    lse = torch.where(seen, top + torch.log(safe), torch.full_like(total, _NEG_INF))
    return out.to(outputs[0].dtype), lse


def _any(t: torch.Tensor) -> bool:
    """``bool(t.any())``; False on the meta device, which has no data (the branches it guards
    change values, never shapes)."""
    return t.device.type != "meta" and bool(t.any())


#: exp of a score at or below this is taken as 0: exp(-80) ≈ 1.8e-35 is below rounding next to a
#: row sum of at least 1 (see :func:`_exp_`)
EXP_FLOOR = -80.0
_EXP_FLOOR_VALUE = math.exp(EXP_FLOOR) * 1.01
#: log2(e) and ln(2): base-2 scores (:attr:`Tiles.base2`) are log2(e) times the natural ones
LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)


def _exp_(s: torch.Tensor, base2: bool = False) -> torch.Tensor:
    """exp(s) in place (``base2``: 2 ** s, the floor times log2(e)), with exp(x) for
    x <= :data:`EXP_FLOOR` (and -inf) exactly 0; NaN stays.

    torch's vectorised exp leaves its fast path for arguments whose result is subnormal or 0
    (below about -87 in float32: many times slower on such lanes, e.g. -inf from a mask or
    an ALiBi bias far below a row's max), so the arguments are first clamped to the floor and
    the results at the floor set to 0. Every caller exponentiates scores minus a shift at least
    their row's max or lse, so the row sums hold a term 1 (or sum to 1), and a term below
    exp(-80) relative to them is below the rounding of float32 and float64 alike."""
    if base2:
        return torch.threshold_(s.clamp_(min=EXP_FLOOR * LOG2E).exp2_(), _EXP_FLOOR_VALUE, 0.0)
    return torch.threshold_(s.clamp_(min=EXP_FLOOR).exp_(), _EXP_FLOOR_VALUE, 0.0)


def _add_bias_grad(db: torch.Tensor, ds: torch.Tensor, q0, q1, k0, k1) -> None:
    """Add the (B, H, bq, bk) tile gradient ``ds`` into ``db`` (the bias's 4-D broadcast shape)."""
    dims = [i for i in range(4) if db.shape[i] == 1 and ds.shape[i] != 1]
    if dims:
        ds = ds.sum(dim=dims, keepdim=True)
    tile_of(db, q0, q1, k0, k1).add_(ds)


def _query_blocks(lq, block_q, positions):
    """``[(r0, r1, a0), ...]``: local query rows r0..r1-1 at absolute positions a0.. (``positions``,
    or the rows themselves); a block never spans a gap in the positions."""
    runs = _runs(positions) if positions is not None else [(0, lq, 0)]
    return [(r0, min(stop, r0 + block_q), abs0 + (r0 - start))
            for start, stop, abs0 in runs for r0 in range(start, stop, block_q)]


def _plan(blocks, lk, rest: Optional[Mask], block_k, mask_shape, panel_queries, device):
    """The panels of the query ``blocks`` in the order they are computed:
    ``[(k0, k1, r0, r1, a0, whole, tiles), ...]``, keys k0..k1-1 (one key block) x local query
    rows r0..r1-1 at absolute positions a0.. (``tiles`` query blocks of them), key blocks left
    to right; ``whole``: the mask shows every score of the panel (no keep mask is needed).

    Key blocks lie on a grid of ``block_k``; a query block visits those that meet the keys the
    mask lets it see (:meth:`Mask.key_span`), minus the tiles whose ``tile_state`` is "empty",
    so hidden tiles are never computed (counted under "skipped" by :func:`counting`).
    The query blocks of one key block are merged into panels of at most ``panel_queries``
    queries while they are consecutive (rows and positions) and alike: "full" tiles are not
    merged with "partial" ones, so a tall panel needs no keep mask."""
    columns: dict = {}  # k0 -> [[r0, r1, a0, whole, tiles], ...]
    skipped = 0
    mlq, mlk = mask_shape[-2:]
    for r0, r1, a0 in blocks:
        a1 = a0 + (r1 - r0)
        lo, hi = (0, lk) if rest is None else rest.key_span(a0, a1, mlq, mlk)
        for k0 in range(max(lo, 0) // block_k * block_k, hi if lo < hi else 0, block_k):
            k1 = min(lk, k0 + block_k)
            if rest is None:
                state = "full"
            elif device.type == "meta":  # tensor parts would read data: compute every tile in the span
                state = "partial"
            else:
                state = rest.tile_state(a0, a1, k0, k1, mask_shape, device=device)
            if state == "empty":
                skipped += 1
                continue
            whole = state == "full"
            panels = columns.setdefault(k0, [])
            p = panels[-1] if panels else None
            if p and p[1] == r0 and p[2] + (r0 - p[0]) == a0 and p[3] == whole and r1 - p[0] <= panel_queries:
                p[1], p[4] = r1, p[4] + 1
            else:
                panels.append([r0, r1, a0, whole, 1])
    if skipped:
        _count("skipped", skipped)
    return [(k0, min(lk, k0 + block_k), r0, r1, a0, whole, tiles)
            for k0 in sorted(columns) for r0, r1, a0, whole, tiles in columns[k0]]


def _runs(positions: Sequence[int]):
    """Maximal runs of consecutive positions: ``[(local_start, local_stop, absolute_start), ...]``."""
    runs = []
    start = 0
    for i in range(1, len(positions) + 1):
        if i == len(positions) or positions[i] != positions[i - 1] + 1:
            runs.append((start, i, positions[start]))
            start = i
    return runs


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
