"""Decoding fast: the stacked [W_q; W_k; W_v] storage and the decode step decided once.

    >>> import torch, multihead
    >>> mha = multihead.MultiHeadAttention(16, 4, causal=True).eval()
    >>> w, b, _ = mha.stacked_qkv()                # the q/k/v parameters are its rows
    >>> w.shape, mha.k_proj.weight.data_ptr() == w[16:].data_ptr()
    (torch.Size([48, 16]), True)

**The stacked projection.** A decode step of self-attention (one token: a single row,
B * Lq = 1) projects with ONE product, ``x [W_q; W_k; W_v]ᵀ + [b_q; b_k; b_v]``, split into Q, K,
V (views). There the three products are matrix-vector products, memory-bound, and one pass over
the stacked matrix is what the step pays least for; with more rows the products are
compute-bound and one stacked product is no faster (at 2-4 rows MKL's choice can make it
slower), so prefill and training keep the three products they always had.

The stacked matrix is not a copy kept beside the weights. When ``kdim == vdim == d_in``, a
`StackedQKV` makes the q/k/v weights (and biases) adjacent rows of one storage: ``q_proj.weight``
etc. stay ordinary ``nn.Parameter`` objects (names, ``state_dict`` keys, optimisers,
parametrizations, hooks unchanged), views of one (d_out + 2 kv_dim, d_in) block that IS
[W_q; W_k; W_v], whatever is written into the parameters (in place, ``.data`` writes, numpy
views, optimiser steps, ``load_state_dict``). Each one-row call checks, without copying, that the
parameters are still set to their rows (``Tensor.is_set_to``: same storage, offset, shape,
strides); if anything re-bound one (``p.data = t``, ``load_state_dict(assign=True)``, FSDP's flat
parameters, ...) the block is released and the call makes the three products. The module stacks
them again after conversions that re-allocate its parameters (``.to``, ``.half()``,
``to_empty``, ``copy.deepcopy``, unpickling). ``state_dict()`` holds the three weights as views
of one storage: ``torch.save`` writes it once, and ``safetensors`` accepts them (they do not
overlap).

The block is used only where nothing can go stale or differ (`block_for`): eager calls (not
torch.compile, where dynamo cannot check storage, nor a JIT trace) in which no gradient can reach
the weights (``no_grad``, ``inference_mode``, or nothing requires grad), with plain ``nn.Linear``
projections and no hooks (`plain`). Otherwise, for a replaced projection (an adapter), a
parametrized one (weight_norm, LoRA through ``parametrize``), or hooks, each projection is its
own call and every hook fires as before.

**The decided decode step.** A cached decode step of one token costs a few hundred microseconds
of tensor work, and the module's general path around it (the edge's checks, the backend choice,
the trace lookup, the stacked block's and the hooks' checks: some forty small Python calls) costs
a good part of that again. Almost all of what that path decides is the same at every step of a
generation. The module's first plain step ``mha(x, cache=cache)`` keeps a `DecodeStep`: what it
decided, with the guards under which each next step may run the same steps without deciding
again::

    cache = multihead.KVCache(max_len=1024)
    with torch.no_grad():
        y = mha(prompt, cache=cache)        # the general path (prefill)
        y = mha(x_next, cache=cache)        # builds the DecodeStep, then runs it
        y = mha(x_next, cache=cache)        # runs it: guards, then the steps

It runs the same ops as the general path, in the same order, on the same tensors, so its output
is bit for bit the general path's (``tests/decoding/test_decode_step.py`` holds every step to it):
`project_stacked` (B = 1; B > 1 the three products of `linear` and `multihead.heads.split_heads`),
the module's ``rope`` at the cache's length, ``cache.store``, the backend's own ``fn`` (the one
the dispatch would choose), `multihead.heads.merge_heads` and ``F.linear`` with ``out_proj``'s
current weight and bias. Nothing derived from the weights is kept.

It applies to the call ``mha(x, cache=cache)`` with nothing else (no mask, positions or weights),
one new token per row, a `multihead.KVCache` (not a `multihead.StaticKVCache`, which is for
torch.compile) without padding, in eager mode with autograd off (``no_grad``/``inference_mode``),
autocast off, no trace recording, no dropout, plain projections whose q/k/v parameters are still
rows of the stacked block (B = 1), and a backend that takes every plain call up to the cache's
``max_len`` keys (``Backend.takes_plain``; sdpa). Each step checks all of it again
(`DecodeStep.__call__`); any guard that fails sends the call to the general path, which
validates and raises as always. ``ENABLED = False`` turns it off.

**Hooks.** This module talks to the module and the cache through these only:
``mha.stacked_qkv()`` (the block, or None), ``mha.projections`` (the four projections, in the
order q, k, v, out), ``mha.config``, ``mha.num_kv_heads``, ``mha.rope``, ``mha.training``, and
the edge checks the module hands to `DecodeStep.build`;
``cache.settled``, ``cache.store``, ``cache.key``/``value``/``keep``/``length``/``max_len``. Of
torch, it reads what decides whether a projection's call is exactly ``F.linear``
(`plain`: nn.Module's global hook tables, an ``nn.Linear``'s own hooks and parameters).

Legend: B batch, Lq new tokens, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules import module as _nn_module

from . import backends as _backends
from . import trace as _trace
from ._numerics import default_scale
from .backends import Call
from .cache import KVCache
from .heads import merge_heads_traced, split_heads_traced

__all__ = ["StackedQKV", "DecodeStep", "ENABLED", "plain", "linear", "block_for", "project_stacked"]

#: False: every call takes the module's general path (for comparing, and for benchmarks)
ENABLED = True


class StackedQKV(NamedTuple):
    """The block [W_q; W_k; W_v] (and [b_q; b_k; b_v]) whose rows three ``nn.Linear`` parameters are.

        >>> import torch.nn as nn
        >>> q, k, v = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4)
        >>> s = StackedQKV.stack(q, k, v)
        >>> s.weight.shape, s.holds(q, k, v), k.bias.data_ptr() == s.bias[8:].data_ptr()
        (torch.Size([16, 8]), True, True)

    Fields: ``weight`` (rows of q + k + v, d_in), the block; ``bias``, the biases' block, or None
    for projections without bias; ``rows``, the views (q, k, v weights, then biases) the
    parameters are set to.
    """

    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    rows: tuple[torch.Tensor, ...]

    @classmethod
    def stack(cls, q: nn.Module, k: nn.Module, v: nn.Module) -> Optional["StackedQKV"]:
        """Make the three projections' weights (and biases) adjacent rows of one block, keeping
        their values and their Parameter objects (``p.data = row view``); None when they cannot
        be one block (not plain ``nn.Linear``, different input sizes, some with bias and some
        without, mixed dtypes or devices)."""
        lins = (q, k, v)
        if not all(type(lin) is nn.Linear for lin in lins) or len({lin.in_features for lin in lins}) != 1:
            return None
        params = [lin._parameters.get("weight") for lin in lins] + [lin._parameters.get("bias") for lin in lins]
        present = [p for p in params if p is not None]
        if len(present) not in (3, 6) or any(p is None for p in params[:3]):
            return None
        if len({(p.dtype, p.device) for p in present}) != 1:
            return None
        sizes = [p.shape[0] for p in present[:3]]
        with torch.no_grad():
            weight = torch.cat([p.detach() for p in present[:3]])
            bias = torch.cat([p.detach() for p in present[3:]]) if len(present) == 6 else None
        rows = torch.split(weight, sizes) + (torch.split(bias, sizes) if bias is not None else ())
        for p, row in zip(present, rows):
            p.data = row
        return cls(weight, bias, rows)

    def holds(self, q: nn.Module, k: nn.Module, v: nn.Module) -> bool:
        """Whether every q/k/v parameter is still set to its row (same storage, offset, shape and
        strides). Anything that re-bound one (``p.data =``, a conversion,
        ``load_state_dict(assign=True)``) makes this False; meta tensors hold nothing."""
        rows = self.rows
        if self.weight.is_meta:  # meta tensors cannot say where they are (and compute nothing)
            return False
        q_ps, k_ps, v_ps = q._parameters, k._parameters, v._parameters
        # unrolled: every one-row call asks this (its six is_set_to calls are its cost)
        wq, wk, wv = q_ps.get("weight"), k_ps.get("weight"), v_ps.get("weight")
        if wq is None or wk is None or wv is None \
                or not (wq.is_set_to(rows[0]) and wk.is_set_to(rows[1]) and wv.is_set_to(rows[2])):
            return False
        bq, bk, bv = q_ps.get("bias"), k_ps.get("bias"), v_ps.get("bias")
        if self.bias is None:
            return bq is None and bk is None and bv is None
        return bq is not None and bk is not None and bv is not None \
            and bq.is_set_to(rows[3]) and bk.is_set_to(rows[4]) and bv.is_set_to(rows[5])


def plain(projections: tuple[nn.Module, ...]) -> bool:
    """Whether calling each projection is exactly ``F.linear(x, lin.weight, lin.bias)``: a plain
    ``nn.Linear`` (a parametrized or wrapped one is another class), with no hooks of its own or
    global ones (``register_module_forward_hook``, ...), no forward replaced on the instance, and
    no JIT trace recording."""
    if (_nn_module._global_forward_hooks or _nn_module._global_forward_pre_hooks
            or _nn_module._global_backward_hooks or _nn_module._global_backward_pre_hooks
            or torch._C._get_tracing_state()):
        return False
    for lin in projections:
        if (type(lin) is not nn.Linear or lin._forward_hooks or lin._forward_pre_hooks or lin._backward_hooks
                or lin._backward_pre_hooks or "forward" in lin.__dict__):
            return False
    return True


def linear(lin: nn.Module, x: torch.Tensor, is_plain: bool) -> torch.Tensor:
    """``lin(x)``, the projection's own call. For a projection whose call is `plain` that is
    ``F.linear(x, lin.weight, lin.bias)``, called directly: the same op on the same current
    weights, without nn.Module's per-call dispatch. Anything else is called as a module."""
    if is_plain:
        ps = lin._parameters  # what lin.weight, lin.bias read, without nn.Module.__getattr__ (a Python call each)
        w = ps.get("weight")
        if w is not None and "bias" in ps:
            return F.linear(x, w, ps["bias"])
    out: torch.Tensor = lin(x)
    return out


def block_for(mha: Any, query: torch.Tensor, is_plain: Optional[bool] = None) -> Optional[StackedQKV]:
    """The block ``mha.stacked_qkv()`` for a self-attention call of ``query`` that may use it
    (one row, eager, no gradient can reach the weights, `plain` projections; see the module
    docstring), else None: the call makes three products.

        >>> import torch, multihead
        >>> mha = multihead.MultiHeadAttention(16, 4).eval()
        >>> with torch.no_grad():
        ...     block_for(mha, torch.randn(1, 1, 16)) is not None, block_for(mha, torch.randn(1, 3, 16))
        (True, None)
    """
    # torch.compile first: dynamo folds it to True, and never reads the block
    if torch.compiler.is_compiling() or query.numel() != query.shape[-1]:
        return None
    projections = mha.projections
    if not (plain(projections) if is_plain is None else is_plain):
        return None
    if torch.is_grad_enabled() and (query.requires_grad or any(
            p.requires_grad for lin in projections[:3] for p in lin._parameters.values() if p is not None)):
        return None  # autograd would record a product with the parameters
    block: Optional[StackedQKV] = mha.stacked_qkv()
    return block


def project_stacked(query: torch.Tensor, block: StackedQKV, heads: int, kv_heads: int) -> tuple[torch.Tensor, ...]:
    """Q (B, H, Lq, D), K, V (B, Hkv, Lq, D), views of the one product of ``query`` (B, Lq, d_in)
    with the block: the heads of all three split at once (H + 2 Hkv heads), then apart."""
    qkv = F.linear(query, block[0], block[1])  # (B, Lq, d_out + 2 kv_dim)
    return split_heads_traced(qkv, heads + 2 * kv_heads, None).split_with_sizes((heads, kv_heads, kv_heads), dim=1)


class DecodeStep:
    """What one module decided for plain one-token steps with one cache, and its guards.

        >>> import torch, multihead
        >>> mha, cache = multihead.MultiHeadAttention(16, 4, causal=True).eval(), multihead.KVCache(8)
        >>> with torch.no_grad():
        ...     _ = mha(torch.randn(1, 3, 16), cache=cache)   # prefill
        ...     step = DecodeStep.build(mha, torch.randn(1, 1, 16), cache)
        ...     step(mha, torch.randn(1, 1, 16), cache).shape
        torch.Size([1, 1, 16])

    Built by :meth:`build` from a call the general path would accept; called as
    ``step(mha, query, cache)``, it returns the step's output, or None when a guard fails (then
    nothing was computed or written, and the caller takes the general path).
    """

    __slots__ = ("_cache", "_key", "_shape", "_dtype", "_device", "_device_type", "_inference",
                 "_block", "_backend", "_auto", "_heads", "_scale", "_stacked")

    def __init__(self, mha: Any, query: torch.Tensor, cache: KVCache, block: Optional[StackedQKV],
                 backend: _backends.Backend, auto: bool) -> None:
        self._cache = weakref.ref(cache)  # a cache dropped by the caller is not kept alive here
        self._key = weakref.ref(cache.key)  # its key buffer: a reallocation (select, a new layout) ends this
        self._shape, self._dtype, self._device = query.shape, query.dtype, query.device
        self._device_type = query.device.type
        self._inference = torch.is_inference_mode_enabled()
        self._block = block  # the module's stacked block when this was built: re-stacking ends this
        self._stacked = block is not None  # B = 1: the one product with the stacked block
        self._heads = (mha.config.num_heads, mha.num_kv_heads)
        self._scale = default_scale(mha.config.head_dim)
        self._backend, self._auto = backend, auto

    @classmethod
    def build(cls, mha: Any, query: torch.Tensor, cache: KVCache,
              check: Callable[[], None] = lambda: None) -> Optional["DecodeStep"]:
        """The step for ``mha(query, cache=cache)``, or None where it does not apply (see the
        module docstring). ``check``: the module's edge checks of the call (raising as its
        general path does), run after the cheapest refusals and before anything is decided."""
        name = mha.config.backend
        backend = _backends.get(_backends.AUTO_ORDER[0] if name == "auto" else name)
        if not ENABLED or type(query) is not torch.Tensor or query.dim() != 3 or query.shape[1] != 1 \
                or type(cache) is not KVCache or cache.keep is not None or backend.takes_plain is None \
                or torch.is_grad_enabled() or _trace.current() is not None or torch.compiler.is_compiling() \
                or (query.shape[0] == 1 and mha.stacked_qkv() is None):
            return None  # (the calls that never qualify leave here, before any edge check)
        check()
        batch = query.shape[0]
        block = mha.stacked_qkv() if batch == 1 else None
        key, value = cache.key, cache.value
        if (batch == 1 and (block is None or block.weight.dtype != query.dtype)) or key is None or value is None \
                or not cache.settled \
                or (mha.training and mha.config.dropout > 0) or not plain(mha.projections) \
                or torch.is_autocast_enabled(query.device.type) \
                or (key.is_inference() and not torch.is_inference_mode_enabled()):
            return None
        heads, kv_heads, head_dim = mha.config.num_heads, mha.num_kv_heads, mha.config.head_dim
        layout = (batch, kv_heads, cache.max_len, head_dim)
        if tuple(key.shape) != layout or tuple(value.shape) != layout \
                or key.dtype != query.dtype or key.device != query.device:
            return None  # another layout (a value head dim of its own, ...): the general path decides
        # the backend every step up to the cache's max_len keys gets: takes_plain for the longest
        # step (it holds for fewer keys too), which neither refuses nor declines a plain call
        full = Call(query.new_empty(batch, heads, 1, head_dim), key, value, None, 0.0)
        if not backend.takes_plain(full):
            return None
        return cls(mha, query, cache, block, backend, name == "auto")

    def __call__(self, mha: Any, query: torch.Tensor, cache: KVCache) -> Optional[torch.Tensor]:
        """The step's output (B, 1, d_out), or None (nothing done) when a guard fails."""
        backend, block = self._backend, self._block
        projections = mha.projections
        if (self._cache() is not cache or type(query) is not torch.Tensor or query.shape != self._shape
                or query.dtype is not self._dtype or query.device != self._device
                or torch.is_grad_enabled() or torch.is_inference_mode_enabled() is not self._inference
                or _trace.current() is not None or torch.is_autocast_enabled(self._device_type)
                or (mha.training and mha.config.dropout > 0)
                or self._key() is not cache.key or not cache.settled or cache.keep is not None
                or cache.length >= cache.max_len
                or (self._auto and _backends.AUTO_ORDER[0] != backend.name)
                or _backends.get(backend.name) is not backend
                or not plain(projections)
                # B = 1: the parameters are still rows of the block (the module's: it stacks anew only when not)
                or (block is not None and not block.holds(projections[0], projections[1], projections[2]))):
            return None
        heads, kv_heads = self._heads
        if block is not None:  # B = 1: the one product with the stacked block
            q, k, v = project_stacked(query, block, heads, kv_heads)
        else:  # B > 1: three products, as the general path makes them
            q, k, v = (split_heads_traced(linear(lin, query, True), n, None)
                       for lin, n in zip(projections[:3], (heads, kv_heads, kv_heads)))
        rope = mha.rope
        if rope is not None:
            q, k = rope(q, cache.length), rope(k, cache.length)
        k, v = cache.store(k, v)
        o = backend.fn(q, k, v, None, scale=self._scale, dropout_p=0.0)  # (B, H, 1, D)
        return linear(projections[3], merge_heads_traced(o, None), True)
