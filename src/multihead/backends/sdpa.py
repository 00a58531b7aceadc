"""The ``sdpa`` backend: torch.nn.functional.scaled_dot_product_attention (PyTorch's fused kernels).

A causal mask that SDPA can express as ``is_causal`` (top-left alignment, or Lq == Lk) goes to
the kernel as such, so the kernel can skip the blocks above the diagonal; other masks are
materialised to one 4-D tensor (bool when there is no bias, float otherwise; a 3-D one would
send SDPA to its math kernel). A bias is built in the compute dtype, float32 for
float16/bfloat16 inputs: SDPA accepts a float32 ``attn_mask`` beside half q, k, v and adds it to
its float32 scores, so a float32 bias is never rounded to the inputs' precision. Grouped-query
calls use ``enable_gqa``. Rows with no visible key give 0 (PyTorch >= 2.5 does this itself).

On CPU, PyTorch runs its flash kernel unless a condition sends it to the math kernel, which
holds dense (Lq, Lk) scores: for torch 2.13 (``select_sdp_backend_cpp`` in
``aten/src/ATen/native/transformers/sdp_utils_cpp.cpp``) that is dropout, Dv != D, an
``attn_mask`` that requires grad (a bias that requires grad, with autograd recording), a 3-D
``attn_mask``, q/k/v whose last dimension is not contiguous, an empty sequence, or the flash
kernel turned off with ``torch.backends.cuda.enable_flash_sdp(False)``. :func:`plan` asks
PyTorch's own chooser which kernel a call gets and what dense tensors it builds.

``backend="auto"`` declines SDPA when those dense tensors exceed :data:`DENSE_MASK_BUDGET_BYTES`
(a window or a bottom-right causal mask, or math-kernel scores, at long lengths); the
``chunked`` backend then runs the call without any (Lq, Lk) tensor. On the meta device nothing
is allocated, and no budget applies.

Legend: B batch, H query heads, Hkv key/value heads, Lq/Lk query/key lengths, D head dim,
Dv value head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .. import steps as _steps
from .. import trace as _trace
from ..masks import Causal, Mask, as_4d, split_additive
from . import native as _native
from . import tiles as _tiles
from .registry import Backend, Call, get, register
from .._numerics import compute_dtype

#: ``backend="auto"`` passes a call on to the next backend when the dense (Lq, Lk) tensors an
#: SDPA call would build exceed this many bytes: our mask, the float copy PyTorch makes of a
#: bool mask, and, when PyTorch would run its math kernel, its scores (see :func:`plan`).
DENSE_MASK_BUDGET_BYTES = 256 * 2**20

#: Bytes per score the math kernel holds at its peak, in units of the itemsize it computes in
#: (float32 for float16/bfloat16, which it upcasts): the scores and their softmax exist at once,
#: plus the softmax's temporaries (3); a backward adds the gradient of the probabilities (+1),
#: dropout its kept copy (+1). Measured peaks (torch 2.13 CPU, L = 4000 and 8000): 2.3-2.5
#: forward, 3.1-3.3 with backward, 3.1-4.3 with dropout.
MATH_SCORE_COPIES = 3

_KERNELS = {0: "math", 1: "flash attention", 2: "efficient attention", 3: "cuDNN attention", 4: "overrideable"}
_FUSED = frozenset(_KERNELS.values()) - {"math"}


def sdpa_mask_args(mask: Optional[Mask], shape, *, device, dtype):
    """(attn_mask, is_causal) for SDPA from one of our masks, for (B, H, Lq, Lk) = ``shape`` and
    inputs of ``dtype``; a bias is built in ``compute_dtype(dtype)``."""
    if mask is None:
        return None, False
    if _is_kernel_causal(mask, shape):
        return None, True
    mt = mask.materialize(shape, device=device, dtype=compute_dtype(dtype))
    if mt.bias is not None:
        t = mt.bias if mt.keep is None else mt.bias.masked_fill(~mt.keep, float("-inf"))
    elif mt.keep is not None:
        t = mt.keep
    else:  # an invariant: a mask has at least one part, and every leaf builds a keep or a bias
        raise RuntimeError(f"{mask!r} materialized to neither a keep nor a bias tensor")
    return as_4d(t), False  # 4-D: see the module docstring


def _is_kernel_causal(mask: Mask, shape) -> bool:
    parts = mask.parts
    lq, lk = shape[-2:]
    return len(parts) == 1 and isinstance(parts[0], Causal) and (parts[0].align == "top_left" or lq == lk)


@dataclass(frozen=True)
class Plan:
    """How one SDPA call runs: PyTorch's kernel and the dense (Lq, Lk) tensors it builds
    (``scores_bytes``: the math kernel's, counted unless the kernel is known to be a fused one)."""

    kernel: str
    why_math: Optional[str]
    mask: str
    mask_bytes: int
    scores_bytes: int

    @property
    def dense_bytes(self) -> int:
        return self.mask_bytes + self.scores_bytes

    def __str__(self) -> str:
        text = f"torch's {self.kernel} kernel"
        if self.scores_bytes:
            text += f" ({self.why_math or 'no fused kernel known'}) with dense scores of {_size(self.scores_bytes)}"
        text += f", {self.mask}"
        if self.mask_bytes:
            text += f" ({_size(self.mask_bytes)})"
        return text


def _size(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 or n == 0 else f"{n / 2**10:.0f} KiB"


def plan(call: Call) -> Plan:
    """Which kernel PyTorch runs for ``call`` through this backend, and its dense tensors' bytes.

    The kernel comes from PyTorch's own chooser (``torch._fused_sdp_choice``), asked with a
    zero-stride stand-in for the mask, so nothing (Lq, Lk) is built.
    """
    q, k, v, mask = call.q, call.k, call.v, call.mask
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    is_causal = mask is not None and _is_kernel_causal(mask, shape)
    biases = split_additive(mask, shape)[1] if mask is not None else ()
    stand_in, mask_bytes, described = None, 0, "is_causal=True" if is_causal else "no mask"
    if mask is not None and not is_causal:
        dtype = compute_dtype(q.dtype) if biases else torch.bool
        dense = (1,) * (4 - len(mask.dense_shape(shape))) + mask.dense_shape(shape)
        # a bool mask: ours, and the q.dtype copy PyTorch converts it to
        mask_bytes = math.prod(dense) * (1 + q.dtype.itemsize if dtype == torch.bool else dtype.itemsize)
        grad = torch.is_grad_enabled() and any(b.requires_grad for b in biases)
        described = f"{str(dtype).removeprefix('torch.')} mask of shape {dense}"
        with torch.enable_grad() if grad else torch.no_grad():
            stand_in = torch.zeros((), dtype=dtype, device=q.device, requires_grad=grad).expand(dense)
    name = _kernel_name(q, k, v, stand_in, call.dropout_p, is_causal)
    why = _why_math(call, stand_in) if name == "math" else None
    scores = 0
    if name not in _FUSED:
        backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *biases))
        copies = MATH_SCORE_COPIES + int(backward) + int(call.dropout_p > 0)
        scores = math.prod(shape) * compute_dtype(q.dtype).itemsize * copies
    return Plan(name, why, described, mask_bytes, scores)


def _kernel_name(q, k, v, attn_mask, dropout_p, is_causal) -> str:
    """PyTorch's kernel for this call, from its private chooser (an unknown kernel, budgeted as
    the math kernel, if the chooser cannot be asked)."""
    try:
        choice = torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal,
                                         enable_gqa=q.shape[1] != k.shape[1])
    except Exception:  # a private function: it may change or go away
        return "unknown"
    return _KERNELS.get(int(choice), str(choice))


def _why_math(call: Call, attn_mask) -> str:
    """The first of torch 2.13's CPU conditions for the math kernel that ``call`` meets."""
    q, k, v = call.q, call.k, call.v
    if q.device.type != "cpu":
        return f"PyTorch's choice on {q.device.type}"
    if not torch.backends.cuda.flash_sdp_enabled():
        return "the flash kernel is turned off: torch.backends.cuda.enable_flash_sdp(False)"
    if call.dropout_p > 0:
        return f"dropout_p = {call.dropout_p} > 0"
    if attn_mask is not None and attn_mask.requires_grad:
        return "the bias requires grad"
    if v.shape[-1] != q.shape[-1]:
        return f"Dv = {v.shape[-1]} differs from D = {q.shape[-1]}"
    if q.shape[2] == 0 or k.shape[2] == 0:
        return "an empty sequence"
    strided = [n for n, t in (("q", q), ("k", k), ("v", v)) if t.stride(-1) != 1]
    if strided:
        return f"{', '.join(strided)} not contiguous in the last dimension (stride != 1)"
    return "PyTorch's choice"


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[Mask], *, scale: float, dropout_p: float
) -> torch.Tensor:
    if mask is None:  # no mask to build (a decode step)
        attn_mask, is_causal = None, False
    else:
        attn_mask, is_causal = sdpa_mask_args(
            mask, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), device=q.device, dtype=q.dtype
        )
    gqa = q.shape[1] != k.shape[1]
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=gqa
    )
    tr = _trace.current()
    if tr is not None:
        tr.record(_steps.FUSED_ATTENTION, out, params={
            "backend": "sdpa", "kernel": _kernel_name(q, k, v, attn_mask, dropout_p, is_causal),
            "mask": "is_causal" if is_causal else ("none" if attn_mask is None else "tensor"),
            "mask_dtype": None if attn_mask is None else str(attn_mask.dtype),
            "lk": k.shape[2], "head_dim": q.shape[-1],
        })
    return out


def _refuses(call: Call) -> Optional[str]:
    if call.need_weights:
        return "it does not return the attention weights (only 'reference' does)"
    return refuses_score_kinds(call.mask)


def refuses_score_kinds(mask: Optional[Mask]) -> Optional[str]:
    """Why SDPA cannot run ``mask``: it has score mods or a sink (SDPA adds one dense mask to
    its scores and nothing else); None when it can."""
    if mask is None:
        return None
    kinds = [repr(p) for p in mask.score_mods]
    if mask.sink_logits is not None:
        kinds.append(next(repr(p) for p in mask.parts if p.role == "denominator"))
    if kinds:
        return (f"torch's scaled_dot_product_attention cannot apply {' & '.join(kinds)} "
                "(score mods and sinks change the softmax itself); use backend='chunked' or 'reference'")
    return None


#: the most bytes per score an SDPA call can build, for the widest compute dtype (float64): a
#: bool mask and its float copy, and the math kernel's scores with a backward and dropout
_MOST_BYTES_PER_SCORE = 1 + 8 + 8 * (MATH_SCORE_COPIES + 2)


def _within_any_budget(call: Call) -> bool:
    """Whether the dense tensors of any SDPA call of this size fit the budget, whatever its dtype,
    mask and kernel (every decode step): then nothing needs planning. Also the backend's
    ``takes_plain``: a call without mask, dropout, weights or lse is refused for none of
    `_refuses`' reasons, so within the budget auto takes it; fewer keys stay within it."""
    q_shape = call.q.shape
    return q_shape[0] * q_shape[1] * q_shape[2] * call.k.shape[2] * _MOST_BYTES_PER_SCORE <= DENSE_MASK_BUDGET_BYTES


#: ``backend="auto"`` passes a masked call on to chunked when chunked's native kernel runs it and
#: SDPA would need a dense mask (not is_causal): the native kernel computes only the tiles the
#: mask leaves visible, SDPA every score (measured side by side: docs/benchmarks.md, issue 22).
#: Packed documents keep flex's own measured rule (flex comes before chunked in the auto order).
NATIVE_FIRST = True
#: Plain causal self-attention (Lq = Lk) on the CPU from this many tokens on goes to the native kernel
#: where it was measured faster than SDPA's own causal kernel side by side (docs/benchmarks.md, issue
#: 22; 2 threads, D=64): float32 without gradients, bfloat16 with gradients (forward + backward), and
#: bfloat16 without gradients where its forward runs on AMX tiles. Elsewhere (float32 training,
#: bfloat16 inference by brgemm) SDPA was as fast or faster and keeps the call; shorter calls stay
#: below chunked's own AUTO_MIN_SCORES.
PLAIN_CAUSAL_MIN_LENGTH = 2048


def _native_wins_plain_causal(call: Call) -> bool:
    """Whether a plain causal call falls where the native kernel was measured faster (see
    :data:`PLAIN_CAUSAL_MIN_LENGTH`)."""
    lq, lk = call.q.shape[2], call.k.shape[2]
    if lq != lk or call.dropout_p or call.need_weights:
        return False
    if lq < PLAIN_CAUSAL_MIN_LENGTH:
        return False
    training = call.needs_grad
    if call.q.dtype == torch.float32:
        return not training
    return call.q.dtype == torch.bfloat16 and (training or _amx_forward(call))


def _amx_forward(call: Call) -> bool:
    """Whether the native forward of ``call`` runs on AMX tiles (chunked's default blocks)."""
    return _native.amx_forward_why_not(call.q.dtype, call.q.shape[-1], call.v.shape[-1]) is None


def _native_runs_it(call: Call) -> Optional[str]:
    """Why chunked's native kernel should run ``call`` instead (see :data:`NATIVE_FIRST`), or None."""
    mask = call.mask
    if not NATIVE_FIRST or mask is None or call.q.device.type != "cpu" or call.under_compile:
        return None
    shape = (*call.q.shape[:3], call.k.shape[2])
    plain_causal = _is_kernel_causal(mask, shape)
    if plain_causal and not _native_wins_plain_causal(call):
        return None
    if not plain_causal and not any(p.is_structural or p.kind == "padding" for p in mask.parts):
        return None
    if any(p.kind == "documents" for p in mask.parts):  # flex's measured rule comes first for those
        return None
    chunked = get("chunked")
    if chunked.refuses(call) is not None or (chunked.auto_declines and chunked.auto_declines(call)):
        return None
    kernel = _tiles.kernel_for(call.q, call.k, call.v, mask, scale=1.0, mask_shape=shape)
    if not kernel.startswith("native"):
        return None
    if plain_causal:
        what = ("float32 inference" if call.q.dtype == torch.float32 else "bfloat16 training" if call.needs_grad
                else "bfloat16 inference on AMX tiles")
        return ("chunked's native kernel was measured faster than SDPA's causal kernel for plain causal "
                f"{what} at this length (docs/benchmarks.md; sdpa.NATIVE_FIRST = False keeps sdpa first)")
    return ("chunked's native kernel runs this mask and computes only the tiles it leaves visible, where SDPA "
            "would compute every score through a dense mask (measured faster: docs/benchmarks.md; "
            "sdpa.NATIVE_FIRST = False keeps sdpa first)")


def _auto_declines(call: Call) -> Optional[str]:
    native = _native_runs_it(call)
    if native is not None:
        return native
    if _within_any_budget(call):
        return None
    q_shape = call.q.shape
    scores = q_shape[0] * q_shape[1] * q_shape[2] * call.k.shape[2]
    if call.q.device.type == "meta":
        return None  # a meta tensor allocates nothing: no budget to keep
    budget = DENSE_MASK_BUDGET_BYTES
    c = compute_dtype(call.q.dtype).itemsize
    # the most an SDPA call of this size can build per score in its own dtype
    if scores * (1 + c + c * (MATH_SCORE_COPIES + 2)) <= budget:
        return None
    if call.under_compile:
        return _dense_mask_over_budget(call, budget)
    p = plan(call)
    if p.dense_bytes <= budget:
        return None
    over = f"over sdpa.DENSE_MASK_BUDGET_BYTES = {_size(budget)}"
    if p.scores_bytes:
        mask = f" and its {p.mask} ({_size(p.mask_bytes)})" if p.mask_bytes else ""
        return (f"torch would run its {p.kernel} kernel for this call ({p.why_math or 'no fused kernel known'}) "
                f"with dense scores of {_size(p.scores_bytes)}{mask}, {over}")
    dense = call.mask
    if dense is None:  # an invariant: no dense scores here, so the bytes over budget are a mask's
        raise RuntimeError("a call without a mask was planned over the dense mask budget")
    return (f"its dense mask {dense!r} of shape {dense.dense_shape((*call.q.shape[:3], call.k.shape[2]))} "
            f"would take {_size(p.mask_bytes)}, {over}")


def _dense_mask_over_budget(call: Call, budget: int) -> Optional[str]:
    """Inside torch.compile, where torch's kernel chooser cannot be asked (it returns an int, which
    dynamo cannot trace), only the dense mask is budgeted: the compiler picks the kernel."""
    shape = (*call.q.shape[:3], call.k.shape[2])
    if call.mask is None or _is_kernel_causal(call.mask, shape):
        return None
    dense = call.mask.dense_shape(shape)
    need = math.prod(dense) * (1 + compute_dtype(call.q.dtype).itemsize)
    if need <= budget:
        return None
    return (f"its dense mask {call.mask!r} of shape {dense} would take {_size(need)}, "
            f"over sdpa.DENSE_MASK_BUDGET_BYTES = {_size(budget)} (inside torch.compile: the mask alone is budgeted)")


def _describe(call: Call) -> str:
    return str(plan(call))


BACKEND = register(
    Backend(
        name="sdpa",
        fn=sdpa_attention,
        refuses=_refuses,
        summary="torch.nn.functional.scaled_dot_product_attention (fused kernels)",
        auto_declines=_auto_declines,
        describe=_describe,
        takes_plain=_within_any_budget,
    ),
)
