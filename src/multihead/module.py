"""``MultiHeadAttention``: projections, head split, attention, head merge, output projection.

Data flow of ``mha(x)`` (self-attention), with the step names the trace prints::

    x (B, L, d_in)
      -> project Q, K, V      q_proj, k_proj, v_proj              (B, L, d_out) and 2 x (B, L, Hkv*D)
      -> split heads          'b t (h d) -> b t h d'  (a view)    (B, L, H, D)
      -> move heads forward   'b t h d -> b h t d'    (a view)    (B, H, L, D)
      -> rotary position embedding  (rope=True) q, k rotated by their positions
      -> append to the cache  (cache=...) K, V written after the cached tokens (B, Hkv, Lk, D)
      -> attention            scores, scale, mask, softmax, weights x V   (B, H, L, D)
      -> move heads back      'b h t d -> b t h d'                (B, L, H, D)
      -> merge heads          'b t h d -> b t (h d)'              (B, L, d_out)
      -> output projection    W_O                                 (B, L, d_out)

The projections are the submodules ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``, called on
every forward (three products, not one with [W_q; W_k; W_v]): they are the single source of
truth, so a weight changed in any way (in place, through ``.data`` or a numpy view, by an
optimiser, a parametrization or an adapter) is the weight the next call uses, and nothing
derived from the weights is kept between calls. The seeds' identity "one product with the
stacked [W_q; W_k; W_v] equals the three separate products" is checked on the real values
when a trace is recording (the "project Q/K/V" steps).

``forward`` is the public edge (defaults, input, cache and mask checks); the steps after it are
small methods of a trusted core, in data-flow order (``_project``, ``_rotate``,
``_write_cache``, ``_attend``, ``_merge_output``), which :class:`multihead.distributed.ContextParallel`
calls too, swapping only the attention step for the ring.

Legend: B batch, L/Lq/Lk lengths, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import functional as _functional
from . import masks as _masks
from . import trace as _trace
from ._checks import check_module_inputs
from ._numerics import default_scale
from .integrations.torch_mha import load_torch_state_dict
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
        # an nn.MultiheadAttention state_dict (in_proj_weight, ...) loads too
        self.register_load_state_dict_pre_hook(load_torch_state_dict)

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

    # ------------------------------------------------------------------ the edge
    def _defaults(self, query, key, value) -> tuple:
        """key defaults to query, value to key (when the feature sizes allow it)."""
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
        return key, value

    def _weights_like(self, query: torch.Tensor) -> torch.Tensor:
        """A tensor with the projections' dtype and device: q_proj's weight, without evaluating a
        parametrization (its first parameter then), or ``query`` for a q_proj without parameters."""
        w = self.q_proj._parameters.get("weight")
        if w is None:
            w = next(self.q_proj.parameters(), query)
        return w

    def _check_inputs(self, query, key, value) -> None:
        check_module_inputs(self.config, self._weights_like(query), query, key, value)
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

    def _mask(self, mask, batch: int, lq: int, lk: int, device):
        """The call's mask combined with the module's causal mask, checked against (B, H, Lq, Lk)."""
        m = _masks.as_mask(mask)
        # bottom-right causal lets a single query see every key: no mask is needed (decode steps)
        if self._causal_mask is not None and (m is not None or lq > 1):
            m = self._causal_mask if m is None else self._causal_mask & m
        if m is not None:
            m.check((batch, self.config.num_heads, lq, lk), device)
        return m

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
        key, value = self._defaults(query, key, value)
        self._check_inputs(query, key, value)
        offset = 0
        if cache is not None:
            self._check_cache(cache, query, key, value)
            offset = cache.length
        m = self._mask(mask, query.shape[0], query.shape[1], offset + key.shape[1], query.device)
        tr = _trace.current()
        if tr is not None:
            tr.set_config(**self.config.to_dict(), head_dim=self.config.head_dim)
            tr.record("input", query, None, ("b", "t", "d_in"))
        q, k, v = self._project(query, key, value, tr)
        if self.rope is not None:
            q, k = self._rotate(q, k, offset, tr)
        if cache is not None:
            k, v = self._write_cache(cache, k, v, tr)
        o, weights = self._attend(q, k, v, m, return_weights, tr)
        out = self._merge_output(o, tr)
        return (out, weights) if return_weights else out

    # ------------------------------------------------------------------ the core (trusted inputs)
    def _project(self, query, key, value, tr) -> tuple:
        """Q (B, H, Lq, D), K (B, Hkv, Lk, D), V (B, Hkv, Lk, Dv): the projections, then the head split.

        The projections are the submodules' own calls (``self.q_proj(query)``, ...), so their
        current weights, parametrizations, hooks and replacements are what runs: nothing is cached.
        """
        cfg = self.config
        q, k, v = self.q_proj(query), self.k_proj(key), self.v_proj(value)
        if tr is not None:
            self._record_projections(tr, (q, k, v), (query, key, value))
        return (
            split_heads(q, cfg.num_heads, role="Q"),
            split_heads(k, cfg.num_kv_heads, role="K"),
            split_heads(v, cfg.num_kv_heads, role="V"),
        )

    def _record_projections(self, tr, outs: tuple, inputs: tuple) -> None:
        """Trace the three projections, with the seeds' claim checked on the real values: when
        the inputs are shared, one product with the stacked weights [W_q; W_k; W_v] (or
        [W_k; W_v]) gives the same Q, K, V as the separate products the module computed."""
        query, key, value = inputs
        linears = (self.q_proj, self.k_proj, self.v_proj)
        if key is query and value is query:
            stacked, note = (0, 1, 2), _FUSED_QKV
        elif value is key and self.config.kdim == self.config.vdim:
            stacked, note = (1, 2), _FUSED_KV
        else:
            stacked, note = (), ""
        if not all(isinstance(linears[i], nn.Linear) for i in stacked):
            stacked, note = (), ""  # a replaced projection (an adapter, ...) is no longer one matrix
        fused = {}
        if stacked:
            with torch.no_grad():
                ws = [linears[i].weight for i in stacked]
                bias = torch.cat([linears[i].bias for i in stacked]) if self.config.bias else None
                parts = F.linear(inputs[stacked[0]], torch.cat(ws), bias).split([w.shape[0] for w in ws], dim=-1)
            fused = dict(zip(stacked, parts))
        for i, (name, t) in enumerate(zip("QKV", outs)):
            checks = {}
            if i in fused:
                checks["equals its own separate product"] = torch.allclose(fused[i], t, rtol=1e-4, atol=1e-5)
            tr.record(f"project {name}", t, None, ("b", "t", "d_out" if name == "Q" else "d_kv"),
                      checks=checks, note=note if i in fused else "")

    def _rotate(self, q, k, positions, tr) -> tuple:
        """q, k rotated (RoPE) for ``positions``: an int offset (tokens at offset, offset + 1, ...)
        or a (L,) tensor of global positions (a context-parallel shard)."""
        if isinstance(positions, torch.Tensor):
            q, k = self.rope(q, positions=positions), self.rope(k, positions=positions)
            where = f"global positions of this shard ({positions.numel()} tokens)"
        else:
            q, k = self.rope(q, positions), self.rope(k, positions)
            where = f"positions {positions}..{positions + q.shape[2] - 1}"
        if tr is not None:
            note = f"{where}, base {self.rope.base:g}, rotate-half layout"
            tr.record("rotary position embedding", q, None, ("b", "h", "t", "d"), role="Q", note=note)
            tr.record("rotary position embedding", k, None, ("b", "h", "t", "d"), role="K", note=note)
        return q, k

    def _write_cache(self, cache: KVCache, k, v, tr) -> tuple:
        """k, v appended to ``cache``; returns every cached key (B, Hkv, Lk, D) and value."""
        k, v = cache.append(k, v)
        if tr is not None:
            note = f"{cache.length} of max_len={cache.max_len} tokens cached; {self.config.num_kv_heads} kv heads"
            tr.record("append to the cache", k, None, ("b", "h", "t", "d"), role="K", note=note)
            tr.record("append to the cache", v, None, ("b", "h", "t", "d"), role="V", note=note)
        return k, v

    def _attend(self, q, k, v, m, return_weights: bool, tr) -> tuple:
        """(out (B, H, Lq, Dv), weights (B, H, Lq, Lk) or None) for a checked mask ``m``."""
        cfg = self.config
        dropout_p = cfg.dropout if self.training else 0.0
        scale = default_scale(cfg.head_dim)
        if return_weights:
            return _functional.attend_with_weights(q, k, v, m, scale=scale, dropout_p=dropout_p)
        return _functional.attend(q, k, v, m, scale=scale, dropout_p=dropout_p, backend=cfg.backend), None

    def _merge_output(self, o, tr) -> torch.Tensor:
        """(B, H, Lq, Dv) -> (B, Lq, d_out): merge the heads, then W_O."""
        out = self.out_proj(merge_heads(o))
        if tr is not None:
            tr.record("output projection", out, None, ("b", "t", "d_out"), note="W_O mixes the heads")
        return out

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
