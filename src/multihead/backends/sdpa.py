"""The ``sdpa`` backend: torch.nn.functional.scaled_dot_product_attention (PyTorch's fused kernels).

A causal mask that SDPA can express as ``is_causal`` (top-left alignment, or Lq == Lk) goes to
the kernel as such, so the kernel can skip the blocks above the diagonal; other masks are
materialised to one tensor (bool when there is no bias, float otherwise). Grouped-query calls
use ``enable_gqa``. Rows with no visible key give 0 (PyTorch >= 2.5 does this itself).

``backend="auto"`` declines SDPA when the dense mask it would need exceeds
:data:`DENSE_MASK_BUDGET_BYTES` (a window or a bottom-right causal mask at long lengths); the
``chunked`` backend then runs it without any (Lq, Lk) tensor.

Legend: B batch, H query heads, Hkv key/value heads, Lq/Lk query/key lengths, D head dim.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from .. import trace as _trace
from ..masks import Causal, Mask
from . import Backend, Call, register

#: ``backend="auto"`` passes a call on to the next backend when the dense mask tensors SDPA would
#: need (our mask, plus the float copy PyTorch makes of a bool mask) exceed this many bytes.
DENSE_MASK_BUDGET_BYTES = 256 * 2**20

_KERNELS = {0: "math", 1: "flash attention", 2: "efficient attention", 3: "cuDNN attention", 4: "overrideable"}


def sdpa_mask_args(mask: Optional[Mask], shape, *, device, dtype):
    """(attn_mask, is_causal) for SDPA from one of our masks, for (B, H, Lq, Lk) = ``shape``."""
    if mask is None:
        return None, False
    if _is_kernel_causal(mask, shape):
        return None, True
    mt = mask.materialize(shape, device=device, dtype=dtype)
    if mt.bias is None:
        t = mt.keep
    elif mt.keep is None:
        t = mt.bias
    else:
        t = mt.bias.masked_fill(~mt.keep, float("-inf"))
    return t.reshape((1,) * (2 - t.dim()) + tuple(t.shape)), False  # SDPA wants at least (Lq|1, Lk|1)


def dense_mask_bytes(mask: Optional[Mask], shape, dtype: torch.dtype) -> int:
    """Bytes of the mask tensors an SDPA call needs for (B, H, Lq, Lk) = ``shape`` (0 for none):
    the materialised mask (bool or ``dtype``) and the ``dtype`` copy SDPA makes of a bool one."""
    if mask is None or _is_kernel_causal(mask, shape):
        return 0
    numel = math.prod(mask.dense_shape(shape))
    itemsize = torch.empty((), dtype=dtype).element_size()
    return numel * (1 + itemsize)


def _is_kernel_causal(mask: Mask, shape) -> bool:
    parts = mask.parts
    lq, lk = shape[-2:]
    return len(parts) == 1 and isinstance(parts[0], Causal) and (parts[0].align == "top_left" or lq == lk)


def _kernel_name(q, k, v, attn_mask, dropout_p, is_causal, scale, gqa) -> str:
    try:
        choice = torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=gqa)
        return _KERNELS.get(int(choice), str(choice))
    except Exception:  # the private chooser is informational only
        return "chosen by PyTorch"


def sdpa_attention(q, k, v, mask, *, scale, dropout_p):
    attn_mask, is_causal = sdpa_mask_args(
        mask, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), device=q.device, dtype=q.dtype
    )
    gqa = q.shape[1] != k.shape[1]
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=gqa
    )
    tr = _trace.current()
    if tr is not None:
        kernel = _kernel_name(q, k, v, attn_mask, dropout_p, is_causal, scale, gqa)
        how = "is_causal=True" if is_causal else ("no mask" if attn_mask is None else f"{attn_mask.dtype} mask tensor")
        tr.record(
            "fused attention (scores, scale, mask, softmax, weights × V)", out,
            "b h q d, b h k d, b h k d -> b h q d", ("b", "h", "t", "d"),
            note=f"torch scaled_dot_product_attention, {kernel} kernel, {how}",
        )
    return out


def _refuses(call: Call) -> Optional[str]:
    if call.need_weights:
        return "it does not return the attention weights (only 'reference' does)"
    return None


def _auto_declines(call: Call) -> Optional[str]:
    shape = (call.q.shape[0], call.q.shape[1], call.q.shape[2], call.k.shape[2])
    need = dense_mask_bytes(call.mask, shape, call.q.dtype)
    if need > DENSE_MASK_BUDGET_BYTES:
        return (f"its dense mask {call.mask!r} of shape {call.mask.dense_shape(shape)} would take "
                f"{need / 2**20:.0f} MiB, over sdpa.DENSE_MASK_BUDGET_BYTES = "
                f"{DENSE_MASK_BUDGET_BYTES / 2**20:.0f} MiB")
    return None


BACKEND = register(
    Backend(
        name="sdpa",
        fn=sdpa_attention,
        refuses=_refuses,
        summary="torch.nn.functional.scaled_dot_product_attention (fused kernels)",
        auto_declines=_auto_declines,
    ),
    auto_rank=0,
)
