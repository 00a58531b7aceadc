"""The decode step, decided once: ``mha(x_new, cache=cache)`` without the per-token edge.

A cached decode step of one token costs a few hundred microseconds of tensor work, and the
forward path around it (the edge's checks, the backend choice, the trace lookup, the stacked
block's and the hooks' checks: some forty small Python calls) added 1.2-1.4x to it. Almost all
of what that path decides is the same at every step of a generation: the same module, cache,
input shape and dtype, the same backend. A `DecodeStep` is what the module's first plain decode
step with a cache decided, kept on the module, with the guards under which each next step may
run the same core steps without deciding again::

    cache = multihead.KVCache(max_len=1024)
    with torch.no_grad():
        y = mha(prompt, cache=cache)        # the general path (prefill)
        y = mha(x_next, cache=cache)        # builds the DecodeStep, then runs it
        y = mha(x_next, cache=cache)        # runs it: guards, then the core steps

What it runs is the module's own core, in the same order, on the same tensors, so its output is
bit for bit the general path's: ``mha._project_stacked``'s ops (the one product with the stacked
[W_q; W_k; W_v] block, whose rows the parameters are, then one view of all H + 2 Hkv heads,
split), ``mha._rotate`` (with rope), ``cache._store`` (the cache's trusted write), the backend's
own ``fn`` (the one the dispatch point chose), then ``mha._merge_output``'s ops (merge the heads,
``F.linear`` with ``out_proj``'s current weight and bias). The two ends are written out here,
one line each, because at 0.2 ms a step the five Python calls they would take cost 6% of it.
Nothing derived from the weights is kept.
``tests/test_decode_step.py`` holds every step to the general path bit for bit.

It applies to the call ``mha(x, cache=cache)`` with nothing else (no mask, positions or
weights), one new token per row (Lq = 1; B = 1 takes the stacked block's one product, B > 1
the module's three products, ``mha._project``, as the general path does), a `KVCache` (not a
`StaticKVCache`, which is for torch.compile) without padding, in eager mode with autograd off
(``no_grad``/``inference_mode``), autocast off, no trace recording, no dropout, plain ``nn.Linear``
projections without hooks whose q/k/v parameters are still rows of the stacked block, and a
backend that takes every plain call up to the cache's ``max_len`` keys (``Backend.takes_plain``;
sdpa). Each step checks all of it again (`DecodeStep.__call__`'s guards); any that fails sends
the call to the general path, which validates and raises as always, and may build a new one.
``ENABLED = False`` turns it off (every call takes the general path).

Legend: B batch, Lq new tokens, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
import torch.nn.functional as F

from . import backends as _backends
from . import trace as _trace
from .backends import Call
from .cache import KVCache

__all__ = ["DecodeStep", "ENABLED"]

#: False: every call takes the module's general path (for comparing, and for benchmarks)
ENABLED = True


class DecodeStep:
    """What one module decided for plain one-token steps with one cache, and its guards.

    Built by :meth:`build` from a call the general path would accept; called as
    ``step(mha, query, cache)``, it returns the step's output, or None when a guard fails (then
    nothing was computed or written, and the caller takes the general path).
    """

    __slots__ = ("_cache", "_key", "_shape", "_dtype", "_device", "_device_type", "_inference",
                 "_packed", "_backend", "_auto", "_heads", "_qkv_view", "_stacked")

    def __init__(self, mha: Any, query: torch.Tensor, cache: KVCache, packed: Optional[tuple[Any, ...]],
                 backend: _backends.Backend, auto: bool) -> None:
        self._cache = weakref.ref(cache)  # a cache dropped by the caller is not kept alive here
        self._key = weakref.ref(cache.key)  # its key buffer: a reallocation (select, a new layout) ends this
        self._shape, self._dtype, self._device = query.shape, query.dtype, query.device
        self._device_type = query.device.type
        self._inference = torch.is_inference_mode_enabled()
        self._packed = packed  # the module's stacked block when this was built: re-packing ends this
        self._stacked = packed is not None  # B = 1: the one product with the stacked block
        heads, kv_heads = mha._sizes[0], mha._sizes[1]
        self._heads = (heads, kv_heads)
        self._qkv_view = (1, 1, heads + 2 * kv_heads, mha.config.head_dim)  # (B, Lq, H + 2 Hkv, D)
        self._backend, self._auto = backend, auto

    @classmethod
    def build(cls, mha: Any, query: torch.Tensor, cache: KVCache) -> Optional["DecodeStep"]:
        """The step for ``mha(query, cache=cache)``, or None where it does not apply (see the
        module docstring). Validates the call as the general path's edge does (and raises as it
        does), cheapest refusals first, before deciding anything."""
        name = mha.config.backend
        backend = _backends._REGISTRY.get(_backends.AUTO_ORDER[0] if name == "auto" else name)
        if not ENABLED or type(query) is not torch.Tensor or query.dim() != 3 or query.shape[1] != 1 \
                or type(cache) is not KVCache or cache.keep is not None or backend is None \
                or backend.takes_plain is None or torch.is_grad_enabled() or _trace.current() is not None \
                or (mha._packed is None and query.shape[0] == 1):
            return None  # (the calls that never qualify leave here, before any edge check)
        mha._check_inputs(query, query, query)
        mha._check_cache(cache, query, query, query)
        batch = query.shape[0]
        packed = mha._packed_now() if batch == 1 else None
        if (batch == 1 and (packed is None or packed[0].dtype != query.dtype)) \
                or cache.key is None or cache.value is None or cache._fresh \
                or (mha.training and mha.config.dropout > 0) or not mha._plain() \
                or torch.is_autocast_enabled(query.device.type) \
                or (cache.key.is_inference() and not torch.is_inference_mode_enabled()):
            return None
        heads, kv_heads, head_dim = mha._sizes[0], mha._sizes[1], mha.config.head_dim
        if tuple(cache.key.shape) != (batch, kv_heads, cache.max_len, head_dim) \
                or tuple(cache.value.shape) != (batch, kv_heads, cache.max_len, head_dim) \
                or cache.key.dtype != query.dtype or cache.key.device != query.device:
            return None  # the cache holds another layout: the general path says why (or re-allocates)
        # the backend every step up to the cache's max_len keys gets: takes_plain for the longest
        # step (it holds for fewer keys too), which neither refuses nor declines a plain call
        full = Call(query.new_empty(batch, heads, 1, head_dim), cache.key, cache.value, None, 0.0)
        if not backend.takes_plain(full):
            return None
        return cls(mha, query, cache, packed, backend, name == "auto")

    def __call__(self, mha: Any, query: torch.Tensor, cache: KVCache) -> Optional[torch.Tensor]:
        """The step's output (B, 1, d_out), or None (nothing done) when a guard fails."""
        backend = self._backend
        if (self._cache() is not cache or type(query) is not torch.Tensor or query.shape != self._shape
                or query.dtype is not self._dtype or query.device != self._device
                or torch.is_grad_enabled() or torch.is_inference_mode_enabled() is not self._inference
                or _trace._state.stack or torch.is_autocast_enabled(self._device_type)
                or (mha.training and mha.config.dropout > 0)
                or self._key() is not cache.key or cache._fresh or cache.keep is not None
                or cache.length >= cache.max_len
                or _backends._REGISTRY.get(backend.name) is not backend
                or (self._auto and _backends.AUTO_ORDER[0] != backend.name)
                or not mha._plain() or (self._stacked and mha._packed_now() is not self._packed)):
            return None
        packed = self._packed
        if packed is None:  # B > 1: the general path's own core steps, in its order
            q, k, v = mha._project(query, query, query, None, True)
            if mha.rope is not None:
                q, k = mha._rotate(q, k, cache.length, None, bound=cache.max_len)
            k, v = cache._store(k, v)
            o = backend.fn(q, k, v, None, scale=mha._scale, dropout_p=0.0)  # (B, H, 1, D)
            merged: torch.Tensor = mha._merge_output(o, None, True)
            return merged
        # mha._project_stacked(query, *packed[:2]) written out (its two calls are 2% of the step)
        heads, kv_heads = self._heads
        q, k, v = F.linear(query, packed[0], packed[1]).view(self._qkv_view).transpose(1, 2).split_with_sizes(
            (heads, kv_heads, kv_heads), dim=1)
        if mha.rope is not None:
            q, k = mha._rotate(q, k, cache.length, None, bound=cache.max_len)
        k, v = cache._store(k, v)
        o = backend.fn(q, k, v, None, scale=mha._scale, dropout_p=0.0)  # (1, H, 1, D)
        # mha._merge_output(o, None, True) written out: for one untraced row of plain projections it is
        # these two ops (its three calls, _merge_output, _merge_heads and _linear, cost 4% of the step)
        ps = mha._modules["out_proj"]._parameters
        w = ps.get("weight")
        if w is None or "bias" not in ps:  # a weight made a buffer or deleted: the module's own call
            out: torch.Tensor = mha._merge_output(o, None, True)
            return out
        return F.linear(o.transpose(1, 2).reshape(1, 1, -1), w, ps["bias"])
