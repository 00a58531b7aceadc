"""Block plans: a mask's tile states over a grid, computed once (FlexAttention's ``BlockMask``).

`block_plan` evaluates a mask's selection one row of tiles at a time; the `BlockPlan` it makes
(in `core`, where kernels read it) is given to a mask with `Mask.with_plan` and shared between
layers. A mask_mod plans for itself (`programmable.MaskMod.own_plan`).

Legend: B batch, H query heads, Lq/Lk query/key lengths.
"""

from __future__ import annotations

from typing import Optional

import torch

from .core import BlockPlan, MaskLike, Shape, _check_count, as_mask, tile_of
from .geometry import _EMPTY, _FULL, _PARTIAL

#: the default block size of a plan (and of the plan a mask_mod makes for itself)

PLAN_BLOCK = 128

def block_plan(
    mask: MaskLike, shape: Shape, *, block_q: int = PLAN_BLOCK, block_k: int = PLAN_BLOCK,
    device: Optional[torch.device] = None,
) -> BlockPlan:
    """The `BlockPlan` of ``mask`` for ``shape`` = (B, H, Lq, Lk): its selection evaluated one row
    of tiles (block_q queries x all keys) at a time, never an (Lq, Lk) tensor.

    >>> import torch
    >>> from multihead import masks
    >>> m = masks.mask_mod(lambda b, h, q, kv: kv <= q)       # causal, written as a function
    >>> plan = masks.block_plan(m, (1, 1, 256, 256), block_q=128, block_k=128)
    >>> plan.states[0, 0].tolist()                          # 0 empty, 1 partial, 2 full
    [[1, 0], [2, 1]]
    >>> shared = m.with_plan(plan)                          # several layers can share it
    >>> shared.tile_state(0, 128, 128, 256, (1, 1, 256, 256))
    'empty'
    """
    m = as_mask(mask, name="block_plan mask")
    if m is None:
        raise TypeError("block_plan needs a mask, got None")
    bq = _check_count(block_q, "block_q", minimum=1)
    bk = _check_count(block_k, "block_k", minimum=1)
    assert bq is not None and bk is not None
    if len(tuple(shape)) != 4:
        raise ValueError(f"block_plan shape must be (B, H, Lq, Lk), got {tuple(shape)}")
    full_shape = (int(shape[0]), int(shape[1]), int(shape[2]), int(shape[3]))
    dev = torch.device("cpu") if device is None else torch.device(device)
    batch, heads, lq, lk = full_shape
    nq, nk = -(-lq // bq), -(-lk // bk)
    rows_out = []
    for qa in range(nq):
        q0, q1 = qa * bq, min(lq, (qa + 1) * bq)
        keep_t = m.block(q0, q1, 0, lk, full_shape, device=dev, dtype=torch.float32).keep
        if keep_t is None:
            rows_out.append(torch.full((1, 1, 1, nk), _FULL, dtype=torch.uint8, device=dev))
            continue
        cols = []
        for ka in range(nk):
            t = tile_of(keep_t, 0, q1 - q0, ka * bk, min(lk, (ka + 1) * bk))
            t = t.expand(t.shape[0], t.shape[1], q1 - q0, t.shape[-1]) if t.shape[-2] == 1 else t
            anyv, allv = t.any(dim=-1).any(dim=-1), t.all(dim=-1).all(dim=-1)
            cols.append(torch.where(allv, _FULL, torch.where(anyv, _PARTIAL, _EMPTY)).to(torch.uint8))
        rows_out.append(torch.stack(torch.broadcast_tensors(*cols), dim=-1).unsqueeze(-2))  # type: ignore[no-untyped-call]
    if not rows_out:
        states = torch.zeros(1, 1, 0, nk, dtype=torch.uint8, device=dev)
    else:
        states = torch.cat(torch.broadcast_tensors(*rows_out), dim=-2)  # type: ignore[no-untyped-call]
    return BlockPlan(full_shape, bq, bk, states)
