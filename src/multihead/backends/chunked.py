"""The ``chunked`` backend: online softmax over tiles (FlashAttention's algorithm) in plain PyTorch.

The kernel itself, forward and backward with its log-sum-exp, is :mod:`multihead.backends.tiles`
(read its docstring for the algorithm, why it is exact, the threads and the bfloat16 products);
this module is the backend around it: the default tile sizes, the argument checks, autocast,
:func:`selected_weights` for :func:`multihead.attention_weights`, and what ``auto`` and
``explain_dispatch`` say about it. Every mask kind runs by tiles: the selecting parts per tile,
the additive parts (bias tensors, differentiable; ALiBi), the score mods in written order
(differentiable, also into the tensors they read), a sink through the lse; tiles a mask hides
entirely (causal, window, documents, chunked-local, a block plan) are never computed.

Under ``torch.autocast`` the inputs are cast as autocast casts them for SDPA (float64 stays);
the tiles themselves are always computed in the compute dtype. float16/bfloat16 inputs are
computed in float32 and cast back once (never bfloat16 products: see the tiles' docstring). Dropout is not supported (see :func:`_refuses`).

Legend: B batch, H query heads, Hkv key/value heads, G = H // Hkv, Lq/Lk query/key lengths,
D head dim, Dv value head dim.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from .. import steps as _steps
from .. import trace as _trace
from .._checks import check_positive_int, check_qkv, check_scale
from .._numerics import autocast_inputs, compute_dtype, outside_autocast
from ..masks import Mask, as_mask
from . import tiles as _tiles
from .registry import Backend, Call, register
from . import native as _native
from .tiles import _runs

__all__ = ["chunked_attention", "selected_weights", "BLOCK_ROWS", "BLOCK_K", "AUTO_MIN_SCORES"]

#: default rows (queries x query heads per kv head) of a query block. With BLOCK_K, a tile of
#: B·Hkv x 256 x 256 scores (2 MiB in float32 at B·Hkv = 8): each elementwise pass of the online
#: softmax reads it from a nearer cache than a 512 x 512 tile's 8 MiB (256 x 256 against
#: 512 x 512 side by side: docs/benchmarks.md, "Figures behind the code's choices").
BLOCK_ROWS = 256
#: default keys per key block
BLOCK_K = 256
#: the native kernel's default tile, one head's queries x keys (when the caller gives no block
#: sizes; given ones are used by both kernels): 256 x 256 led a side-by-side sweep of
#: 128-512 x 128-1024 in every dtype and head dim of issue 22's causal rows (docs/benchmarks.md)
NATIVE_BLOCK_Q = 256
NATIVE_BLOCK_K = 256
#: ``backend="auto"`` declines the chunked backend when Lq·Lk is below this: SDPA's fused
#: kernel is faster there and the dense mask it may need is small.
AUTO_MIN_SCORES = 2048 * 2048

_NEG_INF = float("-inf")


def default_block_q(groups: int) -> int:
    """Queries per block: :data:`BLOCK_ROWS` rows shared by the ``groups`` query heads of a kv head."""
    return max(1, BLOCK_ROWS // groups)


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
        return_lse: also return lse (B, H, Lq), the log-sum-exp over keys of the final scores
            (scaled, biased, modded, masked; ``-inf`` for a row with no visible key; with a sink
            part, logaddexp of that and the head's sink logit); differentiable.

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
    native_blocks = (NATIVE_BLOCK_Q, NATIVE_BLOCK_K) if block_q is None and block_k is None else None
    block_q = default_block_q(groups) if block_q is None else check_positive_int(block_q, "block_q")
    block_k = BLOCK_K if block_k is None else check_positive_int(block_k, "block_k")
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2]) if mask_shape is None else tuple(mask_shape)
    m = as_mask(mask)
    if m is not None:
        m.check(shape, q.device, dtype=q.dtype)
    out, lse = _tiles.attend(q, k, v, m, scale=scale, block_q=block_q, block_k=block_k, mask_shape=shape,
                             positions=positions, mask_heads=mask_heads, native_blocks=native_blocks)
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
                s = mask.apply_block(s, a0, a0 + r1 - r0, 0, Lk, shape, heads)
                if mt.keep is not None:
                    s = s.masked_fill(~(mt.keep if mt.keep.shape[1] == 1 else mt.keep[:, heads]), _NEG_INF)
            pieces.append(torch.exp(s - lse[:, :, r0:r1]))
    if not pieces:
        return q.new_zeros(B, len(heads), len(rows), Lk)
    return torch.cat(pieces, dim=2).to(q.dtype)


def _backend_fn(q, k, v, mask, *, scale, dropout_p):
    return _backend_lse_fn(q, k, v, mask, scale=scale, dropout_p=dropout_p)[0]


def _backend_lse_fn(q, k, v, mask, *, scale, dropout_p):
    if dropout_p > 0:
        raise ValueError(f"the chunked backend does not do dropout (got dropout_p={dropout_p}); "
                         "use backend='sdpa' or 'reference' for dropout")
    with _tiles.counting() as counts:
        out, lse = chunked_attention(q, k, v, mask, scale=scale, return_lse=True)
    tr = _trace.current()
    if tr is not None:
        groups = q.shape[1] // k.shape[1]
        ran_native = counts.native > 0
        bq, bk = (NATIVE_BLOCK_Q, NATIVE_BLOCK_K) if ran_native else (default_block_q(groups), BLOCK_K)
        total = math.ceil(q.shape[2] / bq) * math.ceil(k.shape[2] / bk)
        # panels redone with the exact max mean the forward ran a second, checked pass
        redone = counts["redone"]
        tr.record(_steps.FUSED_ATTENTION, out, params={
            "backend": "chunked", "block_q": bq, "block_k": bk, "kernel": "native" if ran_native else "torch tiles",
            # the kernel of the backward pass, where one will run
            "backward_kernel": _tiles.backward_kernel_for(q, k, v, mask, scale=scale, mask_shape=(
                *q.shape[:3], k.shape[2])) if out.requires_grad else None,
            "tiles_computed": counts["forward"] // (2 if redone else 1), "tiles_total": total,
            "redone": redone,
            "lk": k.shape[2], "head_dim": q.shape[-1],
            "mask_kinds": tuple(p.kind for p in mask.parts) if mask is not None else (),
        })
    return out, lse


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
    return None


def _auto_declines(call: Call) -> Optional[str]:
    lq, lk = call.q.shape[2], call.k.shape[2]
    if lq * lk < AUTO_MIN_SCORES:
        return (f"Lq·Lk = {lq * lk} is below chunked.AUTO_MIN_SCORES = {AUTO_MIN_SCORES}: "
                "SDPA's fused kernel is faster at this size")
    return None


def _describe(call: Call) -> str:
    """explain_dispatch's ``how``: the tiles, the products' dtype and the CPU features they follow."""
    groups = call.q.shape[1] // call.k.shape[1]
    cdt = compute_dtype(call.q.dtype)
    products = f"matrix products, softmax and sums in {str(cdt).replace('torch.', '')}"
    where = f"; CPU {_tiles.cpu_features()}" if call.q.device.type == "cpu" else ""
    shape = (call.q.shape[0], call.q.shape[1], call.q.shape[2], call.k.shape[2])
    kernel = _tiles.kernel_for(call.q, call.k, call.v, call.mask, scale=1.0, mask_shape=shape,
                               native_blocks=(NATIVE_BLOCK_Q, NATIVE_BLOCK_K))
    return (f"online softmax over tiles of {default_block_q(groups)} queries x {BLOCK_K} keys, "
            f"{products}; tiles the mask hides are skipped{where}; kernel: {kernel}")


BACKEND = register(
    Backend(
        name="chunked",
        fn=_backend_fn,
        refuses=_refuses,
        summary="online softmax over tiles in PyTorch; skips masked-out tiles; O(L) memory in training too",
        auto_declines=_auto_declines,
        describe=_describe,
        lse_fn=_backend_lse_fn,
    ),
)
