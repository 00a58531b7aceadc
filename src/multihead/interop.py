"""Conversion to and from ``torch.nn.MultiheadAttention``.

Weights map one to one: nn.MultiheadAttention stacks W_q, W_k, W_v in ``in_proj_weight``
(3*E, E) when the three inputs share a size, or keeps ``q_proj_weight``/``k_proj_weight``/
``v_proj_weight`` when kdim/vdim differ; ``out_proj`` is an nn.Linear in both.

Its masks use the opposite boolean convention (True = blocked): convert them with
:func:`multihead.masks.from_torch`. On a query row whose keys are all masked it returns NaN
where multihead returns 0.
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["from_torch", "to_torch"]


def from_torch(m: nn.MultiheadAttention):
    from .module import MultiHeadAttention

    if not isinstance(m, nn.MultiheadAttention):
        raise TypeError(f"from_torch takes an nn.MultiheadAttention, got {type(m).__name__}")
    if m.bias_k is not None or m.bias_v is not None:
        raise ValueError("nn.MultiheadAttention with add_bias_kv=True has no multihead equivalent")
    if m.add_zero_attn:
        raise ValueError("nn.MultiheadAttention with add_zero_attn=True has no multihead equivalent")
    E, H = m.embed_dim, m.num_heads
    has_bias = m.in_proj_bias is not None
    w0 = m.out_proj.weight
    mha = MultiHeadAttention(E, H, kdim=m.kdim, vdim=m.vdim, bias=has_bias, dropout=m.dropout,
                             device=w0.device, dtype=w0.dtype)
    with torch.no_grad():
        if m._qkv_same_embed_dim:
            wq, wk, wv = m.in_proj_weight.chunk(3)
        else:
            wq, wk, wv = m.q_proj_weight, m.k_proj_weight, m.v_proj_weight
        for lin, w in ((mha.q_proj, wq), (mha.k_proj, wk), (mha.v_proj, wv)):
            lin.weight.copy_(w)
        if has_bias:
            for lin, b in zip((mha.q_proj, mha.k_proj, mha.v_proj), m.in_proj_bias.chunk(3)):
                lin.bias.copy_(b)
        mha.out_proj.load_state_dict(m.out_proj.state_dict())
    mha.train(m.training)
    return mha


def to_torch(mha, *, batch_first: bool = True) -> nn.MultiheadAttention:
    from .module import MultiHeadAttention

    if not isinstance(mha, MultiHeadAttention):
        raise TypeError(f"to_torch takes a multihead.MultiHeadAttention, got {type(mha).__name__}")
    c = mha.config
    blockers = []
    if c.d_out != c.d_in:
        blockers.append(f"d_out={c.d_out} differs from d_in={c.d_in}")
    if c.num_kv_heads != c.num_heads:
        blockers.append(f"num_kv_heads={c.num_kv_heads} (grouped-query attention)")
    if c.causal:
        blockers.append("causal=True (pass the mask per call as attn_mask instead)")
    if c.rope:
        blockers.append("rope=True (nn.MultiheadAttention has no rotary position embeddings)")
    if blockers:
        raise ValueError("nn.MultiheadAttention cannot express this module: " + "; ".join(blockers))
    w0 = mha.q_proj.weight
    m = nn.MultiheadAttention(c.d_in, c.num_heads, dropout=c.dropout, bias=c.bias, kdim=c.kdim, vdim=c.vdim,
                              batch_first=batch_first, device=w0.device, dtype=w0.dtype)
    with torch.no_grad():
        ws = (mha.q_proj.weight, mha.k_proj.weight, mha.v_proj.weight)
        if m._qkv_same_embed_dim:
            m.in_proj_weight.copy_(torch.cat(ws))
        else:
            for dst, w in zip((m.q_proj_weight, m.k_proj_weight, m.v_proj_weight), ws):
                dst.copy_(w)
        if c.bias:
            m.in_proj_bias.copy_(torch.cat([mha.q_proj.bias, mha.k_proj.bias, mha.v_proj.bias]))
        m.out_proj.load_state_dict(mha.out_proj.state_dict())
    m.train(mha.training)
    return m
