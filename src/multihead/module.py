"""``MultiHeadAttention``: projections, head split, attention, head merge, output projection.

Data flow of ``mha(x)`` (self-attention), with the step names the trace prints::

    x (B, L, d_in)
      -> project Q, K, V      one product with [W_q; W_k; W_v]   (B, L, d_out) and 2 x (B, L, Hkv*D)
      -> split heads          'b t (h d) -> b t h d'  (a view)    (B, L, H, D)
      -> move heads forward   'b t h d -> b h t d'    (a view)    (B, H, L, D)
      -> rotary position embedding  (rope=True) q, k rotated by their positions
      -> append to the cache  (cache=...) K, V written after the cached tokens (B, Hkv, Lk, D)
      -> attention            scores, scale, mask, softmax, weights x V   (B, H, L, D)
      -> move heads back      'b h t d -> b t h d'                (B, L, H, D)
      -> merge heads          'b t h d -> b t (h d)'              (B, L, d_out)
      -> output projection    W_O                                 (B, L, d_out)

Legend: B batch, L/Lq/Lk lengths, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import backends as _backends
from . import functional as _functional
from . import masks as _masks
from . import trace as _trace
from ._checks import check_module_inputs
from .backends import reference as _reference
from .cache import KVCache
from .config import AttentionConfig
from .heads import merge_heads, split_heads
from .rope import RoPE

__all__ = ["MultiHeadAttention"]

_FUSED_QKV = "one product with the concatenated weights [W_q; W_k; W_v]"
_FUSED_KV = "K and V: one product with [W_k; W_v]"


class MultiHeadAttention(nn.Module):
    """Multi-head attention, batch-first, with GQA, cross-attention and typed masks.

    Args:
        d_in: feature size of the query input.
        num_heads: H, the number of query heads.
        d_out: H * head_dim, the size of the output (default ``d_in``).
        num_kv_heads: Hkv, key/value heads (default H). Hkv < H is grouped-query attention.
        kdim: feature size of the key input (default ``d_in``).
        vdim: feature size of the value input (default ``kdim``).
        bias: whether the four projections have biases.
        dropout: dropout on the attention weights, applied in training only.
        causal: apply a bottom-right aligned causal mask (see :func:`multihead.masks.causal`).
        backend: "auto" (the fastest backend that supports the call), "reference", "sdpa" or
            "chunked" (see :func:`multihead.explain_dispatch`).
        rope: True to rotate q and k by their positions (rotary embeddings, Hugging Face Llama's
            rotate-half layout), or a :class:`multihead.rope.RoPE` to use. Self-attention only.
        rope_base: the RoPE frequency base (ignored when ``rope`` is a RoPE object).

    Submodules ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj`` are ``nn.Linear`` (weight is
    (out, in)), so weights from other implementations load by copying tensors.
    """

    def __init__(
        self,
        d_in: int,
        num_heads: int,
        d_out: Optional[int] = None,
        *,
        num_kv_heads: Optional[int] = None,
        kdim: Optional[int] = None,
        vdim: Optional[int] = None,
        bias: bool = True,
        dropout: float = 0.0,
        causal: bool = False,
        backend: str = "auto",
        rope=False,
        rope_base: float = 10000.0,
        device=None,
        dtype=None,
    ):
        super().__init__()
        rope_obj = rope if isinstance(rope, RoPE) else None
        if rope_obj is not None:
            rope, rope_base = True, rope_obj.base
        cfg = AttentionConfig(
            d_in=d_in, num_heads=num_heads, d_out=d_out, num_kv_heads=num_kv_heads, kdim=kdim,
            vdim=vdim, bias=bias, dropout=dropout, causal=causal, backend=backend,
            rope=rope, rope_base=rope_base,
        )
        if rope_obj is not None and rope_obj.head_dim != cfg.head_dim:
            raise ValueError(
                f"rope was built for head_dim={rope_obj.head_dim} but this module's head_dim is {cfg.head_dim}; "
                f"pass RoPE({cfg.head_dim}) or rope=True"
            )
        self.config = cfg
        self.rope = rope_obj if rope_obj is not None else (RoPE(cfg.head_dim, cfg.rope_base) if cfg.rope else None)
        factory = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(cfg.d_in, cfg.d_out, bias=cfg.bias, **factory)
        self.k_proj = nn.Linear(cfg.kdim, cfg.kv_dim, bias=cfg.bias, **factory)
        self.v_proj = nn.Linear(cfg.vdim, cfg.kv_dim, bias=cfg.bias, **factory)
        self.out_proj = nn.Linear(cfg.d_out, cfg.d_out, bias=cfg.bias, **factory)
        self._causal_mask = _masks.causal() if cfg.causal else None
        self._fused_cache: dict = {}

    # ------------------------------------------------------------------ settings
    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.config.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    def extra_repr(self) -> str:
        c = self.config
        parts = [f"d_in={c.d_in}", f"num_heads={c.num_heads}", f"d_out={c.d_out}", f"head_dim={c.head_dim}"]
        if c.num_kv_heads != c.num_heads:
            parts.append(f"num_kv_heads={c.num_kv_heads}")
        if c.kdim != c.d_in or c.vdim != c.d_in:
            parts.append(f"kdim={c.kdim}, vdim={c.vdim}")
        parts += [f"causal={c.causal}", f"dropout={c.dropout}", f"backend={c.backend!r}"]
        if c.rope:
            parts.append(f"rope_base={c.rope_base:g}")
        return ", ".join(parts)

    # ------------------------------------------------------------------ projections
    def _fused(self, names: tuple) -> tuple:
        """Concatenated weight and bias of the named projections.

        With autograd recording, they are concatenated on each call (the backward then splits
        the gradient). Otherwise the concatenation is cached and rebuilt only when a weight
        changes (its storage or its in-place version counter).
        """
        linears = [getattr(self, n) for n in names]
        tensors = [p for lin in linears for p in (lin.weight, lin.bias) if p is not None]
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            return (
                torch.cat([lin.weight for lin in linears]),
                torch.cat([lin.bias for lin in linears]) if self.config.bias else None,
            )
        # storage and in-place version of each tensor; dtype and device of the first (a moved or
        # converted tensor gets new storage, so its data_ptr changes too)
        key = (tensors[0].dtype, tensors[0].device, *[(t.data_ptr(), t._version) for t in tensors])
        hit = self._fused_cache.get(names)
        if hit is not None and hit[0] == key:
            return hit[1], hit[2]
        with torch.no_grad():
            w = torch.cat([lin.weight for lin in linears])
            b = torch.cat([lin.bias for lin in linears]) if self.config.bias else None
        self._fused_cache[names] = (key, w, b)
        return w, b

    def _project(self, query, key, value, tr):
        """Q (B, Lq, d_out), K and V (B, Lk, Hkv*D): one product for self-attention,
        one for K and V when they share an input."""
        cfg = self.config
        sizes = (cfg.d_out, cfg.kv_dim, cfg.kv_dim)
        if key is query and value is query:
            w, b = self._fused(("q_proj", "k_proj", "v_proj"))
            q, k, v = F.linear(query, w, b).split(sizes, dim=-1)
            fused = {"Q": _FUSED_QKV, "K": _FUSED_QKV, "V": _FUSED_QKV}
        else:
            q = F.linear(query, self.q_proj.weight, self.q_proj.bias)
            if value is key and cfg.kdim == cfg.vdim:
                w, b = self._fused(("k_proj", "v_proj"))
                k, v = F.linear(key, w, b).split(sizes[1:], dim=-1)
                fused = {"K": _FUSED_KV, "V": _FUSED_KV}
            else:
                k = F.linear(key, self.k_proj.weight, self.k_proj.bias)
                v = F.linear(value, self.v_proj.weight, self.v_proj.bias)
                fused = {}
        if tr is not None:
            for name, t, lin, src in (("Q", q, self.q_proj, query), ("K", k, self.k_proj, key), ("V", v, self.v_proj, value)):
                checks = {}
                note = fused.get(name, "")
                if note:  # the seeds' claim: one product with stacked weights = separate products
                    separate = F.linear(src, lin.weight, lin.bias)
                    checks["equals its own separate product"] = torch.allclose(t, separate, rtol=1e-4, atol=1e-5)
                tr.record(f"project {name}", t, None, ("b", "t", "d_out" if name == "Q" else "d_kv"), checks=checks, note=note)
        return q, k, v

    # ------------------------------------------------------------------ forward
    def _check_inputs(self, query, key, value):
        check_module_inputs(self.config, self.q_proj.weight, query, key, value)
        if self.rope is not None and key is not query:
            raise ValueError(
                "this module has rope=True, which is for self-attention: query and key positions "
                "would come from different sequences; call mha(x) or build it with rope=False"
            )

    def _check_cache(self, cache, query, key, value) -> None:
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a multihead.KVCache, got {type(cache).__name__}")
        if key is not query or value is not query:
            raise ValueError(
                "cache= is for self-attention decoding (mha(x_new, cache=cache)); in cross-attention the "
                "keys/values come from another sequence: project them once and pass them as key/value"
            )
        if not self.config.causal:
            raise ValueError(
                "cache= appends tokens that must not see later ones, which needs a causal module; "
                "build it with causal=True"
            )

    def forward(
        self,
        query: torch.Tensor,
        key: Optional[torch.Tensor] = None,
        value: Optional[torch.Tensor] = None,
        *,
        mask=None,
        return_weights: bool = False,
        cache: Optional[KVCache] = None,
    ):
        """Attend from ``query`` to ``key``/``value``.

        Args:
            query: (B, Lq, d_in).
            key: (B, Lk, kdim); default ``query`` (self-attention).
            value: (B, Lk, vdim); default ``key``.
            mask: a :mod:`multihead.masks` mask, a bool tensor (True = may attend) or a float
                tensor (added to the scores), broadcastable to (B, H, Lq, Lk). Combined with
                the module's causal mask when ``causal=True``.
            return_weights: also return the per-head weights (B, H, Lq, Lk) actually applied
                (after dropout in training); this runs the reference backend.
            cache: a :class:`multihead.KVCache` (causal self-attention only). The Lq new tokens
                are projected, rotated for positions ``len(cache) ...`` (rope), appended to the
                cache, and attend to every cached token with the bottom-right causal mask, so
                Lk = len(cache) after the append. The output equals the last Lq rows of a full
                causal forward over the whole sequence.

        Returns:
            (B, Lq, d_out), or ``(out, weights)``.
        """
        cfg = self.config
        if key is None:
            if cfg.kdim != cfg.d_in:
                raise ValueError(
                    f"key is required: kdim={cfg.kdim} differs from d_in={cfg.d_in}, so the query cannot be its own key"
                )
            key = query
        if value is None:
            if cfg.vdim != cfg.kdim:
                raise ValueError(
                    f"value is required: vdim={cfg.vdim} differs from kdim={cfg.kdim}; call mha(query, key, value)"
                )
            value = key
        self._check_inputs(query, key, value)
        offset = 0
        if cache is not None:
            self._check_cache(cache, query, key, value)
            offset = cache.length
        tr = _trace.current()
        if tr is not None:
            tr.set_config(**{k: v for k, v in cfg.to_dict().items()}, head_dim=cfg.head_dim)
            tr.record("input", query, None, ("b", "t", "d_in"))

        q, k, v = self._project(query, key, value, tr)
        q = split_heads(q, cfg.num_heads, role="Q")
        k = split_heads(k, cfg.num_kv_heads, role="K")
        v = split_heads(v, cfg.num_kv_heads, role="V")
        if self.rope is not None:
            q, k = self.rope(q, offset), self.rope(k, offset)
            if tr is not None:
                note = f"positions {offset}..{offset + q.shape[2] - 1}, base {self.rope.base:g}, rotate-half layout"
                tr.record("rotary position embedding", q, None, ("b", "h", "t", "d"), role="Q", note=note)
                tr.record("rotary position embedding", k, None, ("b", "h", "t", "d"), role="K", note=note)
        if cache is not None:
            k, v = cache.append(k, v)
            if tr is not None:
                note = f"{cache.length} of max_len={cache.max_len} tokens cached; {cfg.num_kv_heads} kv heads"
                tr.record("append to the cache", k, None, ("b", "h", "t", "d"), role="K", note=note)
                tr.record("append to the cache", v, None, ("b", "h", "t", "d"), role="V", note=note)

        m = _masks.as_mask(mask)
        # bottom-right causal lets a single query see every key: no mask is needed (decode steps)
        if self._causal_mask is not None and (m is not None or q.shape[2] > 1):
            m = self._causal_mask if m is None else self._causal_mask & m
        dropout_p = cfg.dropout if self.training else 0.0
        shape = (q.shape[0], cfg.num_heads, q.shape[2], k.shape[2])
        if m is not None:
            m.check(shape, q.device)
        scale = cfg.head_dim ** -0.5

        weights = None
        if return_weights:
            _functional.warn_once_if_dense_weights_are_large(q, k)
            if tr is not None:
                tr.set_config(backend="reference")
            o, weights = _reference.attend(q, k, v, m, scale=scale, dropout_p=dropout_p)
        else:
            chosen = _backends.resolve(cfg.backend, _backends.Call(q, k, v, m, dropout_p))
            if tr is not None:
                tr.set_config(backend=chosen.name)
            o = chosen.fn(q, k, v, m, scale=scale, dropout_p=dropout_p)

        o = merge_heads(o)
        out = F.linear(o, self.out_proj.weight, self.out_proj.bias)
        if tr is not None:
            tr.record("output projection", out, None, ("b", "t", "d_out"), note="W_O mixes the heads")
        return (out, weights) if return_weights else out

    # ------------------------------------------------------------------ conversions
    def to_per_head(self):
        """The same layer as h independent heads (:class:`multihead.PerHeadAttention`)."""
        from .per_head import to_per_head

        return to_per_head(self)

    @classmethod
    def from_per_head(cls, p, *, num_kv_heads: Optional[int] = None) -> "MultiHeadAttention":
        """Fuse a :class:`PerHeadAttention` back; with ``num_kv_heads`` its K/V copies are regrouped."""
        from .per_head import from_per_head

        return from_per_head(p, num_kv_heads=num_kv_heads)

    @classmethod
    def from_torch(cls, m: nn.MultiheadAttention) -> "MultiHeadAttention":
        """Copy an ``nn.MultiheadAttention``; the result is batch-first whatever ``m.batch_first`` is."""
        from .interop import from_torch

        return from_torch(m)

    @classmethod
    def from_hf(cls, module: nn.Module, *, output_dense: Optional[nn.Linear] = None) -> "MultiHeadAttention":
        """Copy a Hugging Face ``BertAttention`` or ``LlamaAttention`` (see :func:`multihead.hf.from_hf`)."""
        from .hf import from_hf

        return from_hf(module, output_dense=output_dense)

    def to_torch(self, *, batch_first: bool = True) -> nn.MultiheadAttention:
        """An ``nn.MultiheadAttention`` with the same weights (raises ValueError if it cannot express this module)."""
        from .interop import to_torch

        return to_torch(self, batch_first=batch_first)
