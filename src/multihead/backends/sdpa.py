"""The ``sdpa`` backend: torch.nn.functional.scaled_dot_product_attention (PyTorch's fused kernels).

A causal mask that SDPA can express as ``is_causal`` (top-left alignment, or Lq == Lk) goes to
the kernel as such, so the kernel can skip the blocks above the diagonal; other masks are
materialised to one tensor (bool when there is no bias, float otherwise). Grouped-query calls
use ``enable_gqa``. Rows with no visible key give 0 (PyTorch >= 2.5 does this itself).

Legend: B batch, H query heads, Hkv key/value heads, Lq/Lk query/key lengths, D head dim.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .. import trace as _trace
from ..masks import Causal, Mask
from . import Backend, Call, register

_KERNELS = {0: "math", 1: "flash attention", 2: "efficient attention", 3: "cuDNN attention", 4: "overrideable"}


def sdpa_mask_args(mask: Optional[Mask], shape, *, device, dtype):
    """(attn_mask, is_causal) for SDPA from one of our masks, for (B, H, Lq, Lk) = ``shape``."""
    if mask is None:
        return None, False
    lq, lk = shape[-2:]
    parts = mask.parts
    if len(parts) == 1 and isinstance(parts[0], Causal) and (parts[0].align == "top_left" or lq == lk):
        return None, True
    mt = mask.materialize(shape, device=device, dtype=dtype)
    if mt.bias is None:
        t = mt.keep
    elif mt.keep is None:
        t = mt.bias
    else:
        t = mt.bias.masked_fill(~mt.keep, float("-inf"))
    return t.reshape((1,) * (2 - t.dim()) + tuple(t.shape)), False  # SDPA wants at least (Lq|1, Lk|1)


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
    return None


BACKEND = register(
    Backend(
        name="sdpa",
        fn=sdpa_attention,
        refuses=_refuses,
        summary="torch.nn.functional.scaled_dot_product_attention (fused kernels)",
    ),
    auto_rank=0,
)
