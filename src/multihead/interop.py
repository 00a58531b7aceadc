"""Codecs between ``torch.nn.MultiheadAttention`` and ``(AttentionConfig, weights)``.

    >>> import torch.nn as nn, multihead
    >>> config, weights = from_torch(nn.MultiheadAttention(16, 4))
    >>> mha = multihead.MultiHeadAttention.from_config(config, weights)   # or MultiHeadAttention.from_torch(m)
    >>> m = to_torch(mha.config, mha.state_dict())                        # or mha.to_torch()

``weights`` is a plain dict under :class:`multihead.MultiHeadAttention`'s state_dict names
(``config.weight_shapes()``). The tensors map one to one: nn.MultiheadAttention stacks W_q, W_k,
W_v in ``in_proj_weight`` (3*E, E) when the three inputs share a size, or keeps
``q_proj_weight``/``k_proj_weight``/``v_proj_weight`` when kdim/vdim differ; ``out_proj`` is an
nn.Linear in both (the renaming is :mod:`multihead.integrations.torch_mha`'s). This module
imports the config, not the module.

Its masks use the opposite boolean convention (True = blocked): convert them with
:func:`multihead.masks.from_torch`. On a query row whose keys are all masked it returns NaN
where multihead returns 0. A module is batch-first; nn.MultiheadAttention's ``batch_first`` and
training mode are not part of the config (``MultiHeadAttention.from_torch`` keeps the mode).

Legend: E embed_dim.
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn as nn

from .config import AttentionConfig
from .integrations.torch_mha import multihead_to_torch, torch_to_multihead

__all__ = ["from_torch", "to_torch"]


def from_torch(m: nn.MultiheadAttention) -> tuple[AttentionConfig, dict[str, torch.Tensor]]:
    """``(config, weights)`` of an ``nn.MultiheadAttention`` (weights: views of its parameters).

    Raises:
        TypeError: ``m`` is not an nn.MultiheadAttention.
        ValueError: ``add_bias_kv=True`` or ``add_zero_attn=True``, which multihead does not have.
    """
    if not isinstance(m, nn.MultiheadAttention):
        raise TypeError(f"from_torch takes an nn.MultiheadAttention, got {type(m).__name__}")
    if m.bias_k is not None or m.bias_v is not None:
        raise ValueError("nn.MultiheadAttention with add_bias_kv=True has no multihead equivalent")
    if m.add_zero_attn:
        raise ValueError("nn.MultiheadAttention with add_zero_attn=True has no multihead equivalent")
    config = AttentionConfig(d_in=m.embed_dim, num_heads=m.num_heads, kdim=m.kdim, vdim=m.vdim,
                             bias=m.in_proj_bias is not None, dropout=float(m.dropout))
    return config, config.check_weights(torch_to_multihead(m.state_dict()), "nn.MultiheadAttention's state_dict")


def to_torch(config: AttentionConfig, weights: Mapping[str, torch.Tensor], *, batch_first: bool = True) -> nn.MultiheadAttention:
    """An ``nn.MultiheadAttention`` (on the weights' device and dtype) holding copies of ``weights``.

    Raises:
        TypeError: ``config`` is not an AttentionConfig.
        ValueError: what nn.MultiheadAttention cannot express (d_out != d_in, grouped-query
            attention, causal, RoPE), or weights that do not fit ``config`` (named).
    """
    if not isinstance(config, AttentionConfig):
        raise TypeError(
            f"to_torch takes a multihead.AttentionConfig and its weights (mha.config, mha.state_dict()), "
            f"got {type(config).__name__}; for a module call mha.to_torch()"
        )
    blockers = []
    if config.d_out != config.d_in:
        blockers.append(f"d_out={config.d_out} differs from d_in={config.d_in}")
    if config.num_kv_heads != config.num_heads:
        blockers.append(f"num_kv_heads={config.num_kv_heads} (grouped-query attention)")
    if config.causal:
        blockers.append("causal=True (pass the mask per call as attn_mask instead)")
    if config.rope:
        blockers.append("rope=True (nn.MultiheadAttention has no rotary position embeddings)")
    if blockers:
        raise ValueError("nn.MultiheadAttention cannot express this module: " + "; ".join(blockers))
    weights = config.check_weights(weights)
    w0 = weights["q_proj.weight"]
    m = nn.MultiheadAttention(config.d_in, config.num_heads, dropout=config.dropout, bias=config.bias,
                              kdim=config.kdim, vdim=config.vdim, batch_first=batch_first,
                              device=w0.device, dtype=w0.dtype)
    m.load_state_dict(multihead_to_torch(weights, packed=m._qkv_same_embed_dim))
    return m
