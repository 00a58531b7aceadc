"""`ContextParallel`: a `multihead.MultiHeadAttention` run on a sequence sharded across a group,
the module's own steps on each rank's tokens and its attention step the ring.

Legend: B batch, Lq/Lk this rank's query/key tokens, d_in/d_out the model's widths.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from .._numerics import default_scale
from ..module import MultiHeadAttention
from .layouts import _check_layout, shard_positions
from .ring import ring_attention

__all__ = ["ContextParallel", "context_parallel"]


class ContextParallel(nn.Module):
    """Runs a :class:`multihead.MultiHeadAttention` on a sequence sharded across ``group``.

    The module's own steps run on this rank's tokens (its projections and head split, RoPE at
    the shard's global positions from :func:`shard_positions`, the head merge and output
    projection); only its attention step becomes :func:`ring_attention`. The module's
    ``causal`` setting is honoured (zigzag layout by default). Parameters are shared with the
    wrapped module, not copied.

    Each rank's parameter gradients are its shard's share: sum them over the group
    (``torch.distributed.all_reduce(p.grad, group=group)``) to get the gradients of the whole
    sequence, as data parallelism does.

    Args:
        mha: the module; dropout must be 0 (or the module in eval mode).
        group: the process group holding the shards (default: the whole world).
        layout: see :func:`ring_attention`.
        timeout: see :func:`ring_attention`.
    """

    def __init__(self, mha: nn.Module, group=None, *, layout: Optional[str] = None, timeout: Optional[float] = None):
        super().__init__()
        if not isinstance(mha, MultiHeadAttention):
            raise TypeError(f"mha must be a multihead.MultiHeadAttention, got {type(mha).__name__}")
        self.mha = mha
        self.group = group
        self.layout = None if layout is None else _check_layout(layout)
        self.timeout = timeout

    def forward(self, query: torch.Tensor, key: Optional[torch.Tensor] = None, value: Optional[torch.Tensor] = None, *, mask=None) -> torch.Tensor:
        """query (B, Lq, d_in), key (B, Lk, kdim), value (B, Lk, vdim): this rank's shards
        (key/value default to query). mask: None or ``masks.key_padding`` of the (B, Lk) shard.
        Returns (B, Lq, d_out), this rank's rows of the module's output on the whole sequence."""
        mha, cfg = self.mha, self.mha.config
        key, value = mha._defaults(query, key, value)
        mha._check_inputs(query, key, value)
        if mha.training and cfg.dropout > 0:
            raise ValueError(
                f"the module has dropout={cfg.dropout}, which ring attention does not apply; "
                "call mha.eval() or build it with dropout=0"
            )
        layout = self.layout or ("zigzag" if cfg.causal else "contiguous")
        q, k, v = mha._project(query, key, value, None)
        if mha.rope is not None:  # self-attention (checked above): the queries' positions are the keys'
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(
                    "ContextParallel needs torch.distributed: call torch.distributed.init_process_group"
                    "(backend='gloo' or 'nccl') first, e.g. in a script launched with torchrun"
                )
            rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
            positions = shard_positions(rank, world, query.shape[1] * world, layout, device=query.device)
            q, k = mha._rotate(q, k, positions, None)
        o = ring_attention(
            q, k, v, mask, causal=cfg.causal, scale=default_scale(cfg.head_dim), group=self.group,
            layout=layout, timeout=self.timeout,
        )
        return mha._merge_output(o, None)


def context_parallel(mha: nn.Module, group=None, *, layout: Optional[str] = None, timeout: Optional[float] = None) -> ContextParallel:
    """``ContextParallel(mha, group, layout=..., timeout=...)``: the module on a sharded sequence."""
    return ContextParallel(mha, group, layout=layout, timeout=timeout)
