"""``PerHeadAttention``: h independent heads, concatenated, then W_O.

This is multi-head attention as the paper writes it, ``Concat(head_1, ..., head_h) W_O`` with
``head_i = Attention(x W_q^i, x W_k^i, x W_v^i)``. It exists to show, executably, that it is
the same function as :class:`multihead.MultiHeadAttention`, which computes all heads with one
product over the stacked matrices ``W_q = [W_q^1; ...; W_q^h]`` and a reshape. Convert between
them with ``mha.to_per_head()`` and ``MultiHeadAttention.from_per_head(p)``, which are the codecs
:func:`to_per_head` ``(config, weights) -> PerHeadAttention`` and :func:`from_per_head`
``PerHeadAttention -> (config, weights)`` around ``MultiHeadAttention.from_config``; this module
imports the config, not the module.

Legend: B batch, Lq/Lk lengths, D head dim.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Optional

import torch
import torch.nn as nn

from . import masks as _masks
from ._checks import check_heads, check_module_inputs, check_positive_int
from ._numerics import compute_dtype
from .config import AttentionConfig, resolved_size
from .functional import attention

__all__ = ["PerHeadAttention", "Head", "to_per_head", "from_per_head"]


class Head(nn.Module):
    """One attention head: its own W_q^i, W_k^i, W_v^i (each ``nn.Linear`` to head_dim)."""

    def __init__(self, d_in: int, kdim: int, vdim: int, head_dim: int, bias: bool, **factory):
        super().__init__()
        self.q = nn.Linear(d_in, head_dim, bias=bias, **factory)
        self.k = nn.Linear(kdim, head_dim, bias=bias, **factory)
        self.v = nn.Linear(vdim, head_dim, bias=bias, **factory)

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: _masks.MaskLike, dropout_p: float
    ) -> torch.Tensor:
        """(B, Lq, d_in), (B, Lk, kdim), (B, Lk, vdim) -> (B, Lq, D); the head axis is 1 inside."""
        q = self.q(query).unsqueeze(1)
        k = self.k(key).unsqueeze(1)
        v = self.v(value).unsqueeze(1)
        return attention(q, k, v, mask, dropout_p=dropout_p, backend="reference").squeeze(1)


class PerHeadAttention(nn.Module):
    """h independent :class:`Head` modules, concatenated and projected by ``out_proj`` (W_O).

    Same arguments as :class:`multihead.MultiHeadAttention` except ``num_kv_heads`` (each head
    here has its own K/V; see ``to_per_head`` for GQA).
    """

    def __init__(
        self,
        d_in: int,
        num_heads: int,
        d_out: Optional[int] = None,
        *,
        kdim: Optional[int] = None,
        vdim: Optional[int] = None,
        bias: bool = True,
        dropout: float = 0.0,
        causal: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        cfg = AttentionConfig(d_in=d_in, num_heads=num_heads, d_out=d_out, kdim=kdim, vdim=vdim,
                              bias=bias, dropout=dropout, causal=causal, backend="reference")
        self.config = cfg
        factory = {"device": device, "dtype": dtype}
        self.heads = nn.ModuleList(
            Head(cfg.d_in, resolved_size(cfg.kdim), resolved_size(cfg.vdim), cfg.head_dim, cfg.bias, **factory) for _ in range(cfg.num_heads)
        )
        d_out = resolved_size(cfg.d_out)
        self.out_proj = nn.Linear(d_out, d_out, bias=cfg.bias, **factory)

    def forward(
        self,
        query: torch.Tensor,
        key: Optional[torch.Tensor] = None,
        value: Optional[torch.Tensor] = None,
        *,
        mask: _masks.MaskLike = None,
    ) -> torch.Tensor:
        """(B, Lq, d_in) [, (B, Lk, kdim) [, (B, Lk, vdim)]] -> (B, Lq, d_out)."""
        cfg = self.config
        key = query if key is None else key
        value = key if value is None else value
        check_module_inputs(cfg, self.out_proj.weight, query, key, value)
        m = _masks.as_mask(mask)
        if cfg.causal:
            m = _masks.causal() if m is None else _masks.causal() & m
        p = cfg.dropout if self.training else 0.0
        head_masks = _split_mask_by_head(m, (query.shape[0], cfg.num_heads, query.shape[1], key.shape[1]), query)
        outs = [head(query, key, value, hm, p) for head, hm in zip(self.heads, head_masks)]
        return self.out_proj(torch.cat(outs, dim=-1))


def _split_mask_by_head(m, shape, query) -> list:
    """Head i's mask, (B, 1, Lq, Lk): a mask may differ per head (a keep or bias tensor with an H
    axis, nn.MultiheadAttention's (B*H, Lq, Lk) attn_mask), so it is built for the whole
    (B, H, Lq, Lk) = ``shape`` and sliced at head i; score mods see head i as their h, and a
    sink gives head i its own logit."""
    if m is None:
        return [None] * shape[1]
    m.check(shape, query.device)
    built = m.materialize(shape, device=query.device, dtype=compute_dtype(query.dtype))

    def head(t, i):
        if t is None:
            return None
        t = _masks.as_4d(t)  # as (B|1, H|1, Lq|1, Lk|1)
        return t[:, i:i + 1] if t.shape[1] > 1 else t

    masks = []
    for i in range(shape[1]):
        keep, bias = head(built.keep, i), head(built.bias, i)
        parts = [_masks.keep(keep)] if keep is not None else []
        parts += [_masks.bias(bias)] if bias is not None else []
        parts += [_head_score_mod(mod, i) for mod in m.score_mods]
        if m.sink_logits is not None:
            parts.append(_masks.sink(m.sink_logits[i:i + 1]))
        one = None
        for part in parts:
            one = part if one is None else one & part
        masks.append(one)
    return masks


def _head_score_mod(mod, i: int):
    """``mod`` as head i alone sees it: its function called with h + i (softcap reads no h)."""
    if mod.kind == "softcap":
        return mod
    fn = mod.fn
    return _masks.score_mod(lambda s, b, h, q, kv: fn(s, b, h + i, q, kv), tensors=mod.tensors)


def to_per_head(config: AttentionConfig, weights: Mapping[str, torch.Tensor]) -> PerHeadAttention:
    """The layer of ``(config, weights)`` (a MultiHeadAttention's: ``mha.config, mha.state_dict()``)
    as independent heads, on the weights' device and dtype; GQA K/V projections are copied to
    every head that reads them. Head i holds rows ``i*D ... i*D + D - 1`` of W_q (and of W_k,
    W_v of its key/value head ``i // g``).

    Raises:
        TypeError: ``config`` is not an AttentionConfig.
        ValueError: ``config.rope`` (PerHeadAttention has none), or weights that do not fit ``config``.
    """
    if not isinstance(config, AttentionConfig):
        raise TypeError(
            f"to_per_head takes a multihead.AttentionConfig and its weights (mha.config, mha.state_dict()), "
            f"got {type(config).__name__}; for a module call mha.to_per_head()"
        )
    if config.rope:
        raise ValueError("PerHeadAttention has no rotary position embeddings; to_per_head needs a module with rope=False")
    weights = config.check_weights(weights)
    w0 = weights["q_proj.weight"]
    p = PerHeadAttention(config.d_in, config.num_heads, config.d_out, kdim=config.kdim, vdim=config.vdim,
                         bias=config.bias, dropout=config.dropout, causal=config.causal,
                         device=w0.device, dtype=w0.dtype)
    D, g = config.head_dim, config.groups
    heads = {}
    for i in range(config.num_heads):
        for part, proj, row in (("q", "q_proj", i), ("k", "k_proj", i // g), ("v", "v_proj", i // g)):
            for kind in ("weight", "bias") if config.bias else ("weight",):
                heads[f"heads.{i}.{part}.{kind}"] = weights[f"{proj}.{kind}"][row * D:(row + 1) * D]
    out = {k: t for k, t in weights.items() if k.startswith("out_proj.")}
    p.load_state_dict(heads | out)
    return p


def from_per_head(p: PerHeadAttention, *, num_kv_heads: Optional[int] = None) -> tuple:
    """``(config, weights)`` of the MultiHeadAttention that stacks the heads' matrices (new tensors).

    With ``num_kv_heads`` = Hkv < H, heads ``j*g ... j*g+g-1`` (g = H // Hkv) must hold identical
    K and V projections, which become key/value head j; otherwise ValueError.
    """
    if not isinstance(p, PerHeadAttention):
        raise TypeError(f"from_per_head takes a PerHeadAttention, got {type(p).__name__}")
    c = p.config
    hkv = c.num_heads if num_kv_heads is None else check_positive_int(num_kv_heads, "num_kv_heads")
    check_heads(c.num_heads, hkv, "num_heads", "num_kv_heads")
    g = c.num_heads // hkv
    heads = list(p.heads)
    for j in range(hkv):
        group = heads[j * g:(j + 1) * g]
        for name in ("k", "v"):
            first = getattr(group[0], name)
            for other_i, other in enumerate(group[1:], start=j * g + 1):
                lin = getattr(other, name)
                same = torch.equal(lin.weight, first.weight) and (not c.bias or torch.equal(lin.bias, first.bias))
                if not same:
                    raise ValueError(
                        f"num_kv_heads={hkv}: heads {j * g}..{j * g + g - 1} should share one {name.upper()} projection, "
                        f"but head {other_i}'s differs from head {j * g}'s; use a larger num_kv_heads (or None)"
                    )
    config = replace(c, num_kv_heads=hkv, backend="auto")
    kv_heads = heads[::g]  # the first head of each group
    weights = {}
    for proj, part, source in (("q_proj", "q", heads), ("k_proj", "k", kv_heads), ("v_proj", "v", kv_heads)):
        for kind in ("weight", "bias") if c.bias else ("weight",):
            weights[f"{proj}.{kind}"] = torch.cat([getattr(getattr(h, part), kind).detach() for h in source])
    weights |= {f"out_proj.{k}": t.detach().clone() for k, t in p.out_proj.state_dict().items()}
    return config, config.check_weights(weights)
