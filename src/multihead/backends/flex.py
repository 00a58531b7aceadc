"""The ``flex`` backend: torch's FlexAttention (``torch.nn.attention.flex_attention``), compiled.

>>> import torch, multihead
>>> from multihead.backends import flex
>>> q = k = v = torch.randn(1, 2, 64, 16)
>>> bm = flex.to_block_mask(multihead.masks.causal(), 1, 2, 64, 64, device=q.device)
>>> bm.shape
(1, 1, 64, 64)

A multihead mask is translated, part by part, into FlexAttention's two functions and a
`BlockMask` (which tiles of 128 queries x 128 keys are empty, full, or need the mask)::

    causal, window                   mask_mod  kv <= q + offset, q + offset - left <= kv ...
    key_padding, keep, torch 3-D     mask_mod  a lookup of the bool tensor at [b, h, q, kv]
    bias (float tensors)             score_mod s + bias[b, h, q, kv] (in the compute dtype)

and the block mask comes from the mask's own tile states (`to_block_mask`), so no (Lq, Lk)
tensor is built for a structural mask. Per Contract A the additive parts are summed into the
scaled score first, the score mods run after them in written order, and a selecting part that
says False makes the score -inf; a row with no visible key gives 0 (FlexAttention's own rule).

Where it runs (torch 2.13; ``_refuses`` says it by name when it cannot):

* CUDA: compiled (``torch.compile(flex_attention)``), forward and backward, float32/16, bfloat16,
  head dims >= 16 (torch's Triton kernels need it).
* CPU: compiled inference only, float32/float16/bfloat16, on CPUs with AVX2: torch has no CPU
  backward and no CPU log-sum-exp when compiled ("training with FlexAttention using CPU inductor
  backend is not supported", pytorch #148752, #169224). Training on the CPU is refused (use
  ``chunked``), and so is float64.
* inside the caller's ``torch.compile``: ``flex_attention`` is called as is and compiled with the
  caller's graph (the same device rules hold).
* never: dropout, returning the weights.

Compilation is done once per distinct graph: the backend calls one module-level compiled
function, and the translated functions of a given mask kind have the same code each call, so a
second call with the same shapes, dtypes and mask kinds reuses the compiled kernel (torch's
guards; a new length compiles once more, then shapes become dynamic). :func:`run` with
``compiled=False`` runs torch's unfused reference path of FlexAttention instead (it materialises
the scores, takes float64 and returns the log-sum-exp on the CPU too): it checks a translation
without compiling.

``backend="auto"`` does not pick flex on the CPU: side by side in ``benchmarks/bench_flex.py``
(AMD EPYC, 2 threads, torch 2.13, inference, float32) compiled flex ran 1.2-1.8x slower than
sdpa for causal and 1.0-1.6x slower than chunked for packed documents, besides a 5-20 s compile per
new graph (see :data:`AUTO_CPU`). On CUDA ``auto`` picks it for what ``sdpa`` refuses or
declines (score mods, masks whose dense tensor is over budget) at sizes where ``chunked`` would run
(FlexAttention's published speed is about 90% of FlashAttention-2's forward; chunked's Python
tiles launch several kernels per tile), since sdpa comes first in the auto order.

Legend: B batch, H query heads, Hkv key/value heads, Lq/Lk query/key lengths, D head dim,
Dv value head dim, bs the block size (128).
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from .. import trace as _trace
from .._checks import check_positive_int
from ..masks import Causal, KeyPadding, Mask, MaskLike, Window, _tile, as_mask, diagonal_offset
from . import Backend, Call, register
from .reference import compute_dtype

if TYPE_CHECKING:  # the module is imported lazily at run time (see _flex)
    from torch.nn.attention.flex_attention import BlockMask

__all__ = ["run", "translate", "Translation", "to_block_mask", "tile_states", "BLOCK_SIZE", "COMPILE", "AUTO_CPU",
           "CPU_DTYPES"]

#: the tile side of the block masks built here (FlexAttention's default)
BLOCK_SIZE = 128
#: whether ``auto`` may pick flex on the CPU (benchmarks/bench_flex.py: it never won here)
AUTO_CPU = False
#: False: outside a torch.compile region, run torch's unfused FlexAttention instead of compiling
#: (see :func:`run`; for checking translations where a compile per new shape costs too much,
#: as in the test suite: tests/conftest.py sets it)
COMPILE = True
#: the dtypes torch's compiled CPU FlexAttention accepts
CPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
ScoreMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
#: (B, H, Lq, Lk)
Shape = Sequence[int]

_TRAINING_ON_CPU = ("training on the CPU: torch's flex_attention has no CPU backward (\"training with "
                    "FlexAttention using CPU inductor backend is not supported\", pytorch #148752); "
                    "use backend='chunked', which trains exactly in O(L) memory, or run under torch.no_grad()")


def _flex() -> Any:
    """torch's flex_attention module, imported on first use (it pulls in the compiler stack)."""
    import torch.nn.attention.flex_attention as module
    return module


@functools.lru_cache(maxsize=None)
def _compiled() -> Callable[..., Any]:
    """The one compiled flex_attention every call goes through (one compile cache for all)."""
    return torch.compile(_flex().flex_attention)


# -- translation: a multihead mask -> FlexAttention's mask_mod and score_mod


@dataclass(frozen=True)
class Translation:
    """FlexAttention's functions for one mask at one shape.

    ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (None: every key visible), ``score_mod(score, b, h,
    q_idx, kv_idx) -> score`` (None: the scaled score as is), and the kinds of the parts each came
    from (``parts``: ``"causal -> mask_mod"``, ...), for explain_dispatch.
    """

    mask_mod: Optional[MaskMod]
    score_mod: Optional[ScoreMod]
    parts: tuple[str, ...]


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))


def _lookup(t: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """t[b, h, q, kv] for a tensor broadcastable to (B, H, Lq, Lk): a size-1 axis reads index 0."""
    t = _as_4d(t)
    nb, nh, nq, nk = (int(n) for n in t.shape)

    def at(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return t[b if nb > 1 else 0, h if nh > 1 else 0, q if nq > 1 else 0, kv if nk > 1 else 0]

    return at


def _causal_mod(offset: int) -> MaskMod:
    def causal(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return kv <= q + offset
    return causal


def _window_mod(offset: int, left: Optional[int], right: Optional[int]) -> MaskMod:
    def window(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        ok = kv == kv
        if left is not None:
            ok = ok & (kv >= q + offset - left)
        if right is not None:
            ok = ok & (kv <= q + offset + right)
        return ok
    return window


def _padding_mod(real: torch.Tensor) -> MaskMod:
    def padding(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return real[b, kv]
    return padding


def _keep_mod(keep: torch.Tensor) -> MaskMod:
    at = _lookup(keep)

    def kept(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return at(b, h, q, kv)
    return kept


def _all_of(mods: Sequence[MaskMod]) -> MaskMod:
    first, rest = mods[0], tuple(mods[1:])

    def all_of(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        ok = first(b, h, q, kv)
        for mod in rest:
            ok = ok & mod(b, h, q, kv)
        return ok
    return all_of


def _add_bias(bias: torch.Tensor) -> ScoreMod:
    at = _lookup(bias)

    def add_bias(s: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return s + at(b, h, q, kv)
    return add_bias


def _chain(mods: Sequence[ScoreMod]) -> ScoreMod:
    mods = tuple(mods)

    def chain(s: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        for mod in mods:
            s = mod(s, b, h, q, kv)
        return s
    return chain


def translate(mask: Optional[Mask], shape: Shape, *, device: torch.device, dtype: torch.dtype) -> Translation:
    """FlexAttention's ``mask_mod`` and ``score_mod`` for ``mask`` at ``shape`` = (B, H, Lq, Lk).

    ``dtype`` is the compute dtype a bias is added in (float32 for half inputs). Tensors are
    captured as views, not copied; causal and window become index arithmetic.

    >>> import torch
    >>> from multihead import masks
    >>> from multihead.backends import flex
    >>> t = flex.translate(masks.causal(), (1, 1, 2, 3), device=torch.device("cpu"), dtype=torch.float32)
    >>> q, kv = torch.arange(2).view(2, 1), torch.arange(3).view(1, 3)
    >>> t.mask_mod(0, 0, q, kv).int().tolist()        # bottom-right: query 0 sits on key 1
    [[1, 1, 0], [1, 1, 1]]
    """
    if mask is None:
        return Translation(None, None, ())
    _, _, lq, lk = (int(n) for n in shape)
    selects: list[MaskMod] = []
    adds: list[ScoreMod] = []
    described: list[str] = []
    for part in mask.parts:
        if isinstance(part, Causal):
            selects.append(_causal_mod(diagonal_offset(part.align, lq, lk)))
            described.append("causal -> mask_mod")
        elif isinstance(part, Window):
            selects.append(_window_mod(diagonal_offset(part.align, lq, lk), part.left, part.right))
            described.append("window -> mask_mod")
        elif isinstance(part, KeyPadding):
            selects.append(_padding_mod(part.tensor))
            described.append("padding -> mask_mod (a (B, Lk) lookup)")
        else:  # a tensor part (keep, bias, nn.MultiheadAttention's 3-D mask): look its tensors up
            keep_t, bias_t = part._build(tuple(shape), device=device, dtype=dtype)
            if keep_t is not None:
                selects.append(_keep_mod(keep_t))
                described.append(f"{part.kind} -> mask_mod (a lookup of its {tuple(keep_t.shape)} tensor)")
            if bias_t is not None:
                adds.append(_add_bias(bias_t.to(dtype)))
                described.append(f"{part.kind} -> score_mod (adds its {tuple(bias_t.shape)} tensor)")
    mask_mod = None if not selects else selects[0] if len(selects) == 1 else _all_of(selects)
    score_mod = None if not adds else adds[0] if len(adds) == 1 else _chain(adds)
    return Translation(mask_mod, score_mod, tuple(described))


# -- block masks


def _part_states(part: Mask, q0: torch.Tensor, q1: torch.Tensor, k0: torch.Tensor, k1: torch.Tensor,
                 shape: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(empty, full): bool (nq, nk) grids of which tiles ``part`` hides entirely or shows entirely,
    for tiles with first query q0 (nq, 1), past-the-end query q1, and keys k0 .. k1-1 (1, nk)."""
    lq, lk = shape[-2:]
    if isinstance(part, Causal):
        off = diagonal_offset(part.align, lq, lk)
        return k0 > q1 - 1 + off, k1 - 1 <= q0 + off
    if isinstance(part, Window):
        off = diagonal_offset(part.align, lq, lk)
        empty = torch.zeros(q0.shape[0], k0.shape[1], dtype=torch.bool)
        full = torch.ones_like(empty)
        if part.left is not None:
            empty = empty | (k1 - 1 < q0 + off - part.left)
            full = full & (k0 >= q1 - 1 + off - part.left)
        if part.right is not None:
            empty = empty | (k0 > q1 - 1 + off + part.right)
            full = full & (k1 - 1 <= q0 + off + part.right)
        return empty, full
    empty = torch.zeros(q0.shape[0], k0.shape[1], dtype=torch.bool)
    full = torch.ones_like(empty)
    keep_t, _ = part._build(shape, device=device, dtype=torch.float32)
    if keep_t is None:  # an additive part: it hides nothing
        return empty, full
    # per tile: does any (b, h, q, kv) of it see a key, do all of them
    for i in range(q0.shape[0]):
        for j in range(k0.shape[1]):
            tile = _tile(keep_t, int(q0[i, 0]), int(q1[i, 0]), int(k0[0, j]), int(k1[0, j]))
            empty[i, j] = not bool(tile.any())
            full[i, j] = bool(tile.all())
    return empty, full


def tile_states(mask: Optional[Mask], shape: Shape, *, device: torch.device,
                block_size: int = BLOCK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """(empty, full): bool (nq, nk) grids over the tiles of ``block_size`` queries x keys of
    ``shape`` = (B, H, Lq, Lk); a tile in neither is partial (its mask_mod must be evaluated).
    A tile is empty or full only if it is so for every batch row and head."""
    lq, lk = int(shape[-2]), int(shape[-1])
    nq, nk = math.ceil(lq / block_size), math.ceil(lk / block_size)
    q0 = torch.arange(nq).view(nq, 1) * block_size
    k0 = torch.arange(nk).view(1, nk) * block_size
    q1, k1 = (q0 + block_size).clamp(max=lq), (k0 + block_size).clamp(max=lk)
    empty = torch.zeros(nq, nk, dtype=torch.bool)
    full = torch.ones(nq, nk, dtype=torch.bool)
    if mask is not None:
        for part in mask.parts:
            e, f = _part_states(part, q0, q1, k0, k1, tuple(int(n) for n in shape), device)
            empty, full = empty | e, full & f
    return empty, full & ~empty


def _indices(chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_blocks (1, 1, nq), indices (1, 1, nq, nk)) int32, the chosen key blocks of each
    query block first, in key order."""
    nk = chosen.shape[1]
    order = torch.where(chosen, torch.arange(nk), nk + torch.arange(nk)).argsort(dim=1)
    return (chosen.sum(dim=1, dtype=torch.int32)[None, None],
            order.to(torch.int32)[None, None])


def to_block_mask(mask: MaskLike, B: int, H: int, Lq: int, Lk: int, *, device: torch.device,
                  block_size: int = BLOCK_SIZE, mask_mod: Optional[MaskMod] = None) -> "BlockMask":
    """torch's ``BlockMask`` for ``mask`` over (B, H, Lq, Lk), from the mask's own tile states.

    The block mask is shared by every batch row and head (shape (1, 1, Lq, Lk)); its
    ``mask_mod`` is the mask's translation (or ``mask_mod`` when given). Nothing (Lq, Lk) is
    built for causal and window parts; a tensor part is read tile by tile.

    >>> import torch
    >>> from multihead import masks
    >>> from multihead.backends import flex
    >>> bm = flex.to_block_mask(masks.causal(), 1, 1, 256, 256, device=torch.device("cpu"))
    >>> bm.to_dense()[0, 0].int().tolist()          # 2 x 2 tiles of 128: the upper one is skipped
    [[1, 0], [1, 1]]
    """
    B, H, Lq, Lk = (check_positive_int(n, name) for n, name in ((B, "B"), (H, "H"), (Lq, "Lq"), (Lk, "Lk")))
    block_size = check_positive_int(block_size, "block_size")
    m = as_mask(mask, name="to_block_mask's mask")
    if m is not None:
        m.check((B, H, Lq, Lk), torch.device(device))
    mask = m
    if mask_mod is None:
        mask_mod = translate(mask, (B, H, Lq, Lk), device=device, dtype=torch.float32).mask_mod
    empty, full = tile_states(mask, (B, H, Lq, Lk), device=device, block_size=block_size)
    kv_num, kv_idx = _indices(~empty & ~full)
    full_num, full_idx = _indices(full)
    return _flex().BlockMask.from_kv_blocks(
        kv_num.to(device), kv_idx.to(device), full_num.to(device), full_idx.to(device),
        BLOCK_SIZE=block_size, mask_mod=mask_mod, seq_lengths=(Lq, Lk),
    )


# -- running


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[Mask], *, scale: float,
        compiled: Optional[bool] = None, return_lse: bool = False) -> Any:
    """flex_attention on q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv) with ``mask``
    translated; (B, H, Lq, Dv), and with ``return_lse`` also the log-sum-exp (B, H, Lq) float32
    (-inf for a row with no visible key).

    ``compiled=False`` runs torch's unfused FlexAttention (scores materialised; float64 and the
    log-sum-exp work on the CPU): for checking a translation, not for speed; None: :data:`COMPILE`.
    Inside a ``torch.compile`` region flex_attention is called as is either way.
    """
    if compiled is None:
        compiled = COMPILE
    B, H, lq, _ = q.shape
    lk = k.shape[2]
    if lq == 0 or lk == 0:  # nothing to attend: out (and lse) of a row with no key
        out = q.new_zeros(B, H, lq, v.shape[-1])
        return (out, q.new_full((B, H, lq), float("-inf"), dtype=torch.float32)) if return_lse else out
    t = translate(mask, (B, H, lq, lk), device=q.device, dtype=compute_dtype(q.dtype))
    block_mask = None
    if t.mask_mod is not None:
        block_mask = to_block_mask(mask, B, H, lq, lk, device=q.device, mask_mod=t.mask_mod)
    kwargs: dict[str, Any] = dict(score_mod=t.score_mod, block_mask=block_mask, scale=scale,
                                  enable_gqa=q.shape[1] != k.shape[1])
    if return_lse:
        kwargs["return_aux"] = _flex().AuxRequest(lse=True)
    if torch.compiler.is_compiling():
        result = _flex().flex_attention(q, k, v, **kwargs)
    elif compiled:
        result = _compiled()(q, k, v, **kwargs)
    else:
        with warnings.catch_warnings():  # torch warns that the unfused path is slow: it is meant
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            result = _flex().flex_attention(q, k, v, **kwargs)
    if return_lse:
        out, aux = result
        return out, aux.lse
    return result


def _backend_fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[Mask], *, scale: float,
                dropout_p: float) -> torch.Tensor:
    if dropout_p > 0:
        raise ValueError(f"the flex backend does not do dropout (got dropout_p={dropout_p}); "
                         "use backend='sdpa' or 'reference' for dropout")
    out: torch.Tensor = run(q, k, v, mask, scale=scale)
    tr = _trace.current()
    if tr is not None:
        tr.record(
            "fused attention (scores, scale, mask, softmax, weights × V)", out,
            "b h q d, b h k d, b h k d -> b h q d", ("b", "h", "t", "d"),
            note=f"torch flex_attention, {_describe(Call(q, k, v, mask, dropout_p))}",
        )
    return out


# -- dispatch


def _grad_needed(call: Call) -> bool:
    if not torch.is_grad_enabled():
        return False
    tensors = [call.q, call.k, call.v]
    if call.mask is not None:
        tensors += [t for p in call.mask.parts if isinstance(t := getattr(p, "tensor", None), torch.Tensor)]
    return any(t.requires_grad for t in tensors)


def _refuses(call: Call) -> Optional[str]:
    if call.dropout_p > 0:
        return "torch's flex_attention has no dropout; use 'sdpa' or 'reference'"
    if call.need_weights:
        return "it does not return the attention weights (only 'reference' does)"
    q, v = call.q, call.v
    device = q.device.type
    if device not in ("cpu", "cuda"):
        return f"it runs on cpu and cuda, not {device}"
    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile is not supported on this Python/platform, and flex_attention needs it"
    if device == "cpu":
        if _grad_needed(call):
            return _TRAINING_ON_CPU
        compiled = COMPILE or call.under_compile
        if compiled and q.dtype not in CPU_DTYPES:
            return (f"torch's compiled flex_attention on the CPU takes float32, float16 or bfloat16, "
                    f"not {q.dtype}; use 'chunked' or 'reference'")
        if compiled and not torch.cpu._is_avx2_supported():
            return "torch's compiled flex_attention on the CPU needs AVX2, which this CPU lacks"
    if device == "cuda" and min(q.shape[-1], v.shape[-1]) < 16:
        return (f"torch's flex_attention kernels on CUDA need head dims >= 16, got D={q.shape[-1]}, "
                f"Dv={v.shape[-1]}")
    return None


def _auto_declines(call: Call) -> Optional[str]:
    if call.q.device.type == "cpu" and not AUTO_CPU:
        return ("on the CPU compiled flex_attention was slower than sdpa and chunked in "
                "benchmarks/bench_flex.py (inference, causal and packed documents) and compiles for "
                "5-20 s per new graph: flex.AUTO_CPU = False")
    from .chunked import AUTO_MIN_SCORES
    lq, lk = call.q.shape[2], call.k.shape[2]
    if lq * lk < AUTO_MIN_SCORES:
        return (f"Lq·Lk = {lq * lk} is below chunked.AUTO_MIN_SCORES = {AUTO_MIN_SCORES}: a dense kernel "
                "is faster than compiling one at this size")
    return None


def _describe(call: Call) -> str:
    q, k = call.q, call.k
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    mode = "inside torch.compile" if call.under_compile else "compiled with torch.compile (inductor)"
    t = translate(call.mask, shape, device=q.device, dtype=compute_dtype(q.dtype))
    text = f"{mode} on {q.device.type}"
    if t.parts:
        text += "; " + ", ".join(t.parts)
    if t.mask_mod is not None and shape[2] and shape[3]:
        empty, full = tile_states(call.mask, shape, device=q.device)
        total = empty.numel()
        text += (f"; block mask of {BLOCK_SIZE}x{BLOCK_SIZE} tiles: {total - int(empty.sum())} of {total} "
                 f"computed, {int(full.sum())} of them without the mask_mod")
    return text


BACKEND = register(
    Backend(
        name="flex",
        fn=_backend_fn,
        refuses=_refuses,
        summary="torch's FlexAttention, compiled: mask_mod/score_mod and a block mask from the mask",
        auto_declines=_auto_declines,
        describe=_describe,
    ),
    auto_rank=1,
)
