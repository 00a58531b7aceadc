"""The ``flex`` backend: torch's FlexAttention (``torch.nn.attention.flex_attention``), compiled.

>>> import torch, multihead
>>> from multihead.backends import flex
>>> q = k = v = torch.randn(1, 2, 64, 16)
>>> bm = flex.to_block_mask(multihead.masks.causal(), 1, 2, 64, 64, device=q.device)
>>> bm.shape
(1, 1, 64, 64)

A multihead mask is translated into FlexAttention's ``mask_mod``, ``score_mod`` and ``BlockMask``
by :mod:`.flex_masks` (the table of which part becomes what is there).

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
guards). Shapes are static: each new length compiles once (dynamic shapes hit a torch 2.13 CPU
code-generation error, see ``_compiled``); past ``torch._dynamo.config.recompile_limit`` graphs
torch runs flex_attention uncompiled (correct, slow, with torch's warning). :func:`flex_forward` with
``compiled=False`` runs torch's unfused reference path of FlexAttention instead (it materialises
the scores, takes float64 and returns the log-sum-exp on the CPU too): it checks a translation
without compiling.

``backend="auto"`` (sdpa comes first, then flex, then chunked): on the CPU it picks flex for
inference in float32 on masks with packed documents, where sdpa declined the call (its dense
mask over budget) and chunked would run: there compiled flex was faster than both, and slower
than sdpa for plain causal, besides a compile per new shape (side by side with
``benchmarks/bench_flex.py``: docs/benchmarks.md; :data:`AUTO_CPU` = False turns the CPU pick off). On
CUDA it picks flex for what sdpa refuses or declines (score mods, sinks, masks whose dense tensor
is over budget) at sizes where chunked would run, from torch's published figures (FlexAttention
reaches about 90% of FlashAttention-2's forward; chunked's Python tiles launch several kernels
per tile), not measured here.

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

from .. import steps as _steps
from .. import trace as _trace
from .. import masks as _masks
from .._checks import check_positive_int
from .._numerics import compute_dtype
from ..masks import Mask
from . import chunked as _chunked
from .flex_masks import (BLOCK_SIZE, Shape, Translation, _block_mask, _flex, _with_sink_key, from_block_mask, tile_states,
                         to_block_mask, translate)
from .registry import Backend, Call, register

if TYPE_CHECKING:  # the module is imported lazily at run time (see _flex)
    from torch.nn.attention.flex_attention import BlockMask

__all__ = ["flex_forward", "translate", "Translation", "to_block_mask", "from_block_mask", "tile_states", "BLOCK_SIZE", "COMPILE", "AUTO_CPU",
           "CPU_DTYPES"]

#: whether ``auto`` may pick flex on the CPU (for the inference calls benchmarks/bench_flex.py
#: measured it faster on: float32, packed documents, where sdpa declined the call)
AUTO_CPU = True
#: False: outside a torch.compile region, run torch's unfused FlexAttention instead of compiling
#: (see :func:`flex_forward`; for checking translations where a compile per new shape costs too much,
#: as in the test suite: tests/conftest.py sets it)
COMPILE = True
#: the dtypes torch's compiled CPU FlexAttention accepts
CPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


_TRAINING_ON_CPU = ("training on the CPU: torch's flex_attention has no CPU backward (\"training with "
                    "FlexAttention using CPU inductor backend is not supported\", pytorch #148752); "
                    "use backend='chunked', which trains exactly in O(L) memory, or run under torch.no_grad()")


@functools.lru_cache(maxsize=None)
def _compiled() -> Callable[..., Any]:
    """The one compiled flex_attention every call goes through (one compile cache for all).

    Static shapes: a new length compiles a kernel of its own. With dynamic shapes (what dynamo
    switches to at a second length) torch 2.13's CPU kernel for a mask_mod that reads a tensor
    fails to build (C++ "'cur_qSplitSize3' was not declared in this scope").
    """
    return torch.compile(_flex().flex_attention, dynamic=False)


# -- running


def flex_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[Mask], *, scale: float,
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
    shape = (B, H, lq, lk)
    t = translate(mask, shape, device=q.device, dtype=compute_dtype(q.dtype))
    if lq == 0 or lk == 0:  # nothing to attend: out (and lse) of a row with no key
        out = q.new_zeros(B, H, lq, v.shape[-1])
        lse = q.new_full((B, H, lq), float("-inf"), dtype=torch.float32)
        if t.sink is not None:  # lse := logaddexp(lse, sink)
            lse = t.sink.float().view(1, H, 1).expand(B, H, lq).clone()
        return (out, lse) if return_lse else out
    mask_mod, score_mod = t.mask_mod, t.score_mod
    if t.sink is not None:  # one more key, the sink: k and v gain a row of zeros
        mask_mod, score_mod = _with_sink_key(mask_mod, score_mod, t.sink, lk)
        k = torch.cat([k, k.new_zeros(k.shape[0], k.shape[1], 1, k.shape[3])], dim=2)
        v = torch.cat([v, v.new_zeros(v.shape[0], v.shape[1], 1, v.shape[3])], dim=2)
    block_mask = None
    if mask_mod is not None:
        block_mask = _block_mask(mask, shape, device=q.device, block_size=BLOCK_SIZE, mask_mod=mask_mod,
                                 sink=t.sink is not None)
    kwargs: dict[str, Any] = dict(score_mod=score_mod, block_mask=block_mask, scale=scale,
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
    out: torch.Tensor = flex_forward(q, k, v, mask, scale=scale)
    tr = _trace.current()
    if tr is not None:
        shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        computed = total = None
        if mask is not None and q.shape[2] and k.shape[2]:
            empty, _ = tile_states(mask, shape, device=q.device)
            computed, total = int((~empty).sum()), empty.numel()
        tr.record(_steps.FUSED_ATTENTION, out, params={
            "backend": "flex", "kernel": "torch flex_attention " + ("compiled" if COMPILE else "unfused"),
            "tiles_computed": computed, "tiles_total": total, "lk": k.shape[2], "head_dim": q.shape[-1],
            "mask_kinds": tuple(p.kind for p in mask.parts) if mask is not None else (),
        })
    return out


# -- dispatch


def _refuses(call: Call) -> Optional[str]:
    if call.dropout_p > 0:
        return "torch's flex_attention has no dropout; use 'sdpa' or 'reference'"
    if call.need_weights:
        return "it does not return the attention weights (only 'reference' does)"
    q, v = call.q, call.v
    device = q.device.type
    if device not in ("cpu", "cuda"):
        return f"it runs on cpu and cuda, not {device}"
    inside = call.under_compile  # then dynamo runs already, and the platform checks cannot be traced
    if not inside and not torch._dynamo.eval_frame.is_dynamo_supported():
        return "torch.compile is not supported on this Python/platform, and flex_attention needs it"
    if device == "cpu":
        if call.needs_grad:
            return _TRAINING_ON_CPU
        compiled = COMPILE or inside
        if compiled and q.dtype not in CPU_DTYPES:
            return (f"torch's compiled flex_attention on the CPU takes float32, float16 or bfloat16, "
                    f"not {q.dtype}; use 'chunked' or 'reference'")
        if compiled and not inside and not torch.cpu._is_avx2_supported():
            return "torch's compiled flex_attention on the CPU needs AVX2, which this CPU lacks"
    if device == "cuda" and min(q.shape[-1], v.shape[-1]) < 16:
        return (f"torch's flex_attention kernels on CUDA need head dims >= 16, got D={q.shape[-1]}, "
                f"Dv={v.shape[-1]}")
    return None


def _auto_declines(call: Call) -> Optional[str]:
    """``auto`` reaches flex only where sdpa refused or declined the call (sdpa comes first);
    flex then takes it where it was measured faster than what comes next (chunked, reference)."""
    lq, lk = call.q.shape[2], call.k.shape[2]
    if lq * lk < _chunked.AUTO_MIN_SCORES:
        return (f"Lq·Lk = {lq * lk} is below chunked.AUTO_MIN_SCORES = {_chunked.AUTO_MIN_SCORES}: a dense kernel "
                "is faster than compiling one at this size")
    if call.q.device.type != "cpu":
        return None
    if not AUTO_CPU:
        return "flex.AUTO_CPU = False"
    if call.under_compile:
        return "on the CPU inside torch.compile it was not measured (benchmarks/bench_flex.py runs it compiled alone)"
    if call.q.dtype != torch.float32:
        return f"on the CPU it was measured in float32 only (benchmarks/bench_flex.py), not {call.q.dtype}"
    kinds = set() if call.mask is None else {p.kind for p in call.mask.parts}
    if "documents" not in kinds:
        return ("on the CPU it was measured faster than chunked for packed documents only: for causal it "
                "ran slower than sdpa (benchmarks/bench_flex.py, docs/benchmarks.md); the other masks were not measured")
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
)
