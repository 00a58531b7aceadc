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

The projections are the submodules ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``: their
parameters are the single source of truth, so a weight changed in any way (in place, through
``.data`` or a numpy view, by an optimiser, a parametrization or an adapter) is the weight the
next call uses, and nothing derived from the weights is kept between calls.

``forward`` is the public edge (defaults, input, cache and mask checks), then the named steps in
data-flow order, small methods of a trusted core (``_project``, ``_rotate``, ``_write_cache``,
``_attend``, ``_merge_output``), which `multihead.distributed.ContextParallel` calls too,
swapping only the attention step for the ring.

Decoding fast lives in `multihead.decoding`: the q/k/v parameters are rows of one stacked
[W_q; W_k; W_v] block (a one-row call projects with one product; ``stacked_qkv()``), and a plain
decode step ``mha(x, cache=cache)`` runs what the first one decided (a
`multihead.decoding.DecodeStep`, kept on the module) while its guards hold. The module gives it
``projections`` and ``stacked_qkv()``, and stacks the parameters again after conversions that
re-allocate them (``.to``, ``.half()``, ``to_empty``, ``copy.deepcopy``, unpickling). The
trace's "project Q/K/V" steps check on the real values that the one product equals the
separate ones.

Why this file passes ~500 lines: it holds one concept, the layer, whose parts a reader expects
together (the constructor and `from_config`, the edge's checks, the named steps, the trace of the
projections, the converters' entry points), and about half of it is the docstrings of its public
API. The decoding engine is `multihead.decoding`; nn.MultiheadAttention's habits answered at the
edge are `multihead._torch_habits`.

Legend: B batch, L/Lq/Lk lengths, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

from dataclasses import fields
from operator import attrgetter
from typing import Any, Literal, Mapping, Optional, Union, overload

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.types import Device

from . import decoding as _decoding
from . import functional as _functional
from . import masks as _masks
from . import steps as _steps
from . import trace as _trace
from ._checks import check_module_inputs
from ._torch_habits import check_no_torch_arguments, warn_if_inverted
from ._numerics import default_scale
from .integrations.torch_mha import load_torch_state_dict
from .backends import BackendName
from .cache import KVCache
from .config import AttentionConfig, resolved_size
from .heads import merge_heads_traced, split_heads_traced
from .rope import RoPE, RoPEScaling
from . import hf as _hf, interop as _interop, per_head as _per_head

__all__ = ["MultiHeadAttention"]



def _rotate_at(rope: RoPE, x: torch.Tensor, positions: torch.Tensor, bound: int) -> torch.Tensor:
    """x (B, H, L, D) rotated for an (L,) or (B, L) tensor of positions below ``bound``: rows of
    the cos/sin tables picked by indexing, so no position is read on the host (a compiled step
    keeps one graph, and each row of a padded batch gets its own positions). The rotation is the
    line of `RoPE.__call__`; only the table lookup differs (RoPE reads max(positions))."""
    if torch.compiler.is_compiling():  # no table and no bound: the angles of the positions themselves
        cos, sin = rope.cos_sin_at(positions, device=x.device, dtype=x.dtype)
    else:
        cos, sin = rope.cos_sin(bound, device=x.device, dtype=x.dtype)
        cos, sin = cos[positions], sin[positions]  # (L, D) or (B, L, D)
    if positions.dim() == 2:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, L, D): broadcast over the heads
    return rope.rotate(x, cos, sin)


class MultiHeadAttention(nn.Module):
    """Multi-head attention, batch-first, with GQA, cross-attention and typed masks.

    >>> import torch, multihead
    >>> mha = multihead.MultiHeadAttention(d_in=16, num_heads=4, num_kv_heads=2, causal=True)
    >>> x = torch.randn(2, 5, 16)                      # (B, L, d_in)
    >>> mha(x).shape                                   # (B, L, d_out)
    torch.Size([2, 5, 16])
    >>> out, weights = mha(x, return_weights=True)     # weights: (B, H, Lq, Lk)
    >>> weights.shape, torch.allclose(out, mha(x), atol=1e-6)
    (torch.Size([2, 4, 5, 5]), True)

    Args:
        d_in: feature size of the query input.
        num_heads: H, the number of query heads.
        d_out: H * head_dim, the size of the output (default ``d_in``).
        num_kv_heads: Hkv, key/value heads (default H). Hkv < H is grouped-query attention.
        kdim: feature size of the key input (default ``d_in``).
        vdim: feature size of the value input (default ``kdim``).
        bias: whether the four projections have biases.
        dropout: dropout on the attention weights, applied in training only.
        causal: apply a bottom-right aligned causal mask (see `multihead.masks.causal`).
        backend: "auto" (the fastest backend that supports the call), "reference", "sdpa" or
            "chunked" (see `multihead.explain_dispatch`).
        rope: True to rotate q and k by their positions (rotary embeddings, Hugging Face Llama's
            rotate-half layout), or a `multihead.rope.RoPE` to use. Self-attention only.
        rope_base: the RoPE frequency base.
        rope_scaling: a `multihead.rope.RoPEScaling` rule for the RoPE frequencies
            (linear or llama3), or None. With ``rope`` a RoPE object, its base and scaling are
            used, and ``rope_base``/``rope_scaling`` must be left out or agree with them.
        rope_interleaved: GPT-J's interleaved layout (pairs 2i, 2i+1). With ``rope`` a RoPE
            object, its own layout is used.
        rope_dim: rotate only the first ``rope_dim`` coordinates of each head (GPT-NeoX, Phi);
            None: all of them.
        device: of the projections' parameters.
        dtype: of the projections' parameters.

    These are the fields of `multihead.AttentionConfig` (``mha.config``), plus device and
    dtype; `from_config` builds the module from a config and its weights.

    Submodules ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj`` are ``nn.Linear`` (weight is
    (out, in)), so weights from other implementations load by copying tensors. Inputs are
    batch-first (``batch_first`` is always True).
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
        backend: BackendName = "auto",
        rope: Union[bool, RoPE] = False,
        rope_base: float = 10000.0,
        rope_scaling: Optional[RoPEScaling] = None,
        rope_interleaved: bool = False,
        rope_dim: Optional[int] = None,
        device: Device = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        rope_obj: Optional[RoPE] = None
        if isinstance(rope, RoPE):
            rope_obj, rope_flag = rope, True
            rope_base, rope_scaling = _settings_of(rope, rope_base, rope_scaling)
            rope_interleaved, rope_dim = rope.interleaved, (None if rope.rotary_dim == rope.head_dim else rope.rotary_dim)
        else:
            rope_flag = rope  # AttentionConfig checks it is True or False
        cfg = AttentionConfig(
            d_in=d_in, num_heads=num_heads, d_out=d_out, num_kv_heads=num_kv_heads, kdim=kdim,
            vdim=vdim, bias=bias, dropout=dropout, causal=causal, backend=backend,
            rope=rope_flag, rope_base=rope_base, rope_scaling=rope_scaling,
            rope_interleaved=rope_interleaved, rope_dim=rope_dim,
        )
        if rope_obj is not None and rope_obj.head_dim != cfg.head_dim:
            raise ValueError(
                f"rope was built for head_dim={rope_obj.head_dim} but this module's head_dim is {cfg.head_dim}; "
                f"pass RoPE({cfg.head_dim}) or rope=True"
            )
        self.config = cfg
        if rope_obj is None and cfg.rope:
            rope_obj = RoPE(cfg.head_dim, cfg.rope_base, scaling=cfg.rope_scaling,
                            interleaved=cfg.rope_interleaved, rotary_dim=cfg.rope_dim)
        self.rope = rope_obj
        factory = {"device": device, "dtype": dtype}
        d_out = resolved_size(cfg.d_out)
        self.q_proj = nn.Linear(cfg.d_in, d_out, bias=cfg.bias, **factory)
        self.k_proj = nn.Linear(resolved_size(cfg.kdim), cfg.kv_dim, bias=cfg.bias, **factory)
        self.v_proj = nn.Linear(resolved_size(cfg.vdim), cfg.kv_dim, bias=cfg.bias, **factory)
        self.out_proj = nn.Linear(d_out, d_out, bias=cfg.bias, **factory)
        self._stacked: Optional[_decoding.StackedQKV] = None  # the q/k/v parameters' block (multihead.decoding)
        self._decode_step: Optional[_decoding.DecodeStep] = None  # what a plain decode step decided
        self._stack_qkv()
        self._causal_mask = _masks.causal() if cfg.causal else None
        # static for the module's life (the config is frozen): read per call, not re-derived
        self._scale = default_scale(cfg.head_dim)
        self._sizes = (cfg.num_heads, cfg.kv_dim // cfg.head_dim, d_out, cfg.kv_dim)  # H, Hkv, d_out, kv_dim
        # an nn.MultiheadAttention state_dict (in_proj_weight, ...) loads too
        self.register_load_state_dict_pre_hook(load_torch_state_dict)

    @classmethod
    def from_config(
        cls, config: AttentionConfig, weights: Optional[Mapping[str, torch.Tensor]] = None, *,
        device: Device = None, dtype: Optional[torch.dtype] = None,
    ) -> "MultiHeadAttention":
        """The module of ``config``, holding copies of ``weights``.

            >>> mha = MultiHeadAttention(16, 4, num_kv_heads=2, causal=True)
            >>> twin = MultiHeadAttention.from_config(mha.config, mha.state_dict())

        Args:
            config: an `multihead.AttentionConfig` (e.g. ``mha.config``, or what a converter
                of `multihead.interop`, `multihead.hf`, `multihead.per_head` returns).
            weights: tensors under the module's state_dict names, exactly
                ``config.weight_shapes()`` (e.g. ``mha.state_dict()``); None for a freshly
                initialised module.
            device: of the parameters; by default that of ``weights["q_proj.weight"]``
                (torch's default without weights).
            dtype: of the parameters; by default that of ``weights["q_proj.weight"]`` (torch's
                default without weights). Weights of another dtype are cast.

        Returns:
            A module in training mode, as a constructed one is; its config equals ``config``.

        Raises:
            TypeError: ``config`` is not an AttentionConfig; a weight is not a floating tensor.
            ValueError: a missing or unexpected weight name, or a wrong shape (named, with the
                expected shape).
        """
        if not isinstance(config, AttentionConfig):
            raise TypeError(
                f"config must be a multihead.AttentionConfig (e.g. mha.config), got {type(config).__name__}; "
                "for a dict of its fields pass AttentionConfig(**d)"
            )
        settings = {f.name: getattr(config, f.name) for f in fields(config)}
        if weights is None:
            return cls(**settings, device=device, dtype=dtype)
        weights = config.check_weights(weights)
        like = weights["q_proj.weight"]
        # built without initialising (every parameter is overwritten next), then filled
        mha = cls(**settings, device="meta", dtype=like.dtype if dtype is None else dtype)
        mha.to_empty(device=like.device if device is None else device)
        mha.load_state_dict(weights)
        return mha

    def reset_parameters(self) -> None:
        """Re-initialise the four projections as ``nn.Linear`` does (uniform in ±1/sqrt(fan_in)),
        e.g. after building on the meta device and ``to_empty``."""
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            lin.reset_parameters()  # in place: the q/k/v parameters stay rows of their block

    # ------------------------------------------------------------------ hooks of multihead.decoding
    @property
    def projections(self) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
        """The four projections, ``(q_proj, k_proj, v_proj, out_proj)``."""
        mods: dict[str, nn.Module] = self._modules  # type: ignore[assignment]  # (no typing.cast call per step)
        return mods["q_proj"], mods["k_proj"], mods["v_proj"], mods["out_proj"]

    def stacked_qkv(self) -> Optional[_decoding.StackedQKV]:
        """(weight [W_q; W_k; W_v] (d_out + 2 kv_dim, d_in), bias [b_q; b_k; b_v] or None, rows):
        the block the q/k/v parameters are rows of, or None when they are not (cross-attention
        sizes, a replaced projection, or a parameter re-bound since: the old block is released).

            >>> mha = MultiHeadAttention(16, 4, num_kv_heads=2)
            >>> mha.stacked_qkv().weight.shape             # 16 + 2 * 8 rows
            torch.Size([32, 16])

        See `multihead.decoding` (the block is what a one-row call projects with)."""
        stacked = self._stacked
        if stacked is None:
            return None
        q, k, v, _ = self.projections
        if not stacked.holds(q, k, v):
            self._stacked = None  # a parameter was re-bound: release the old block's memory
            return None
        return stacked

    def _stack_qkv(self) -> None:
        """Make the q/k/v parameters rows of one block, keeping their values (a no-op when they are)."""
        if self.stacked_qkv() is None:
            self._stacked = _decoding.StackedQKV.stack(*self.projections[:3])

    def _apply(self, fn, recurse: bool = True):
        # .to(), .half(), .cuda(), to_empty, ... re-allocate the parameters: stack them again
        out = super()._apply(fn, recurse)
        self._decode_step = None
        self._stack_qkv()
        return out

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_stacked"] = None  # copy.deepcopy and pickle copy the parameters one by one ...
        state["_decode_step"] = None  # (it refers to a cache by weak reference, which cannot be copied)
        return state

    def __setstate__(self, state: dict) -> None:
        state.pop("_packed", None)  # a module pickled by multihead 0.2
        super().__setstate__(state)
        self.__dict__.setdefault("_decode_step", None)  # a module pickled before decode steps existed
        self._stacked = None
        self._stack_qkv()  # ... so their copies are stacked again

    @property
    def batch_first(self) -> bool:
        """Always True: inputs and outputs are (B, L, features), as nn.MultiheadAttention(batch_first=True)."""
        return True

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    @property
    def num_kv_heads(self) -> int:
        return resolved_size(self.config.num_kv_heads)

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    def extra_repr(self) -> str:
        return self.config.summary()

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
        q_lin: nn.Module = self._modules["q_proj"]  # type: ignore[assignment]
        w: Optional[torch.Tensor] = q_lin._parameters.get("weight")
        if w is None:
            w = next(q_lin.parameters(), query)
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
            raise TypeError(
                f"cache must be a multihead.KVCache or multihead.StaticKVCache, got {type(cache).__name__}; "
                "for a model of several layers pass caches[i] of a multihead.KVCaches"
            )
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
        cache._check_step(query.shape[0], query.shape[1], query.device)

    def _check_positions(self, positions: object, batch: int, lq: int, device) -> torch.Tensor:
        """forward's ``positions=``: (B, Lq) or (Lq,) ints >= 0, for a module with rope."""
        if self.rope is None:
            raise ValueError("positions= gives RoPE positions, but this module has rope=False; build it with rope=True")
        if not isinstance(positions, torch.Tensor) or positions.is_floating_point() or positions.dtype == torch.bool:
            raise TypeError(
                f"positions must be an integer torch.Tensor (B, Lq) or (Lq,), got "
                f"{getattr(positions, 'dtype', type(positions).__name__)}; use torch.tensor(positions)"
            )
        if tuple(positions.shape) not in ((lq,), (batch, lq)):
            raise ValueError(
                f"positions must be (B, Lq) = {(batch, lq)} or (Lq,) = ({lq},), one per query token, "
                f"got {tuple(positions.shape)}"
            )
        if positions.device != device:
            raise ValueError(f"positions are on {positions.device} but the input is on {device}; move them with .to()")
        if positions.numel():
            if torch.compiler.is_compiling():  # no host read in a graph: the check runs as an op
                torch._assert_async(positions.min() >= 0, "positions must be >= 0")
            elif int(positions.min()) < 0:
                raise ValueError(f"positions must be >= 0, got {int(positions.min())}")
        return positions.long()

    def _mask(self, mask, query: torch.Tensor, lk: int, *, causal: bool = True):
        """The call's mask checked against (B, H, Lq, Lk) for ``query`` (B, Lq, d_in), combined
        with the module's causal mask (unless ``causal=False``: with a cache, the cache's own
        mask says what each token sees)."""
        lq = query.shape[1]
        if mask is None and (not causal or self._causal_mask is None or lq == 1):
            return None  # the common decode step: nothing to check or combine
        m = _masks.as_mask(mask)
        if m is not None:
            m.check((query.shape[0], self.config.num_heads, lq, lk), query.device, dtype=query.dtype)
            warn_if_inverted(mask, lq, lk)
        # bottom-right causal lets a single query see every key: no mask is needed (decode steps)
        if causal and self._causal_mask is not None and (m is not None or lq > 1):
            m = self._causal_mask if m is None else self._causal_mask & m
        return m

    @overload
    def forward(
        self, query: torch.Tensor, key: Optional[torch.Tensor] = None, value: Optional[torch.Tensor] = None, *,
        mask: _masks.MaskLike = None, return_weights: Literal[False] = False, cache: Optional[KVCache] = None, positions: Optional[torch.Tensor] = None,
    ) -> torch.Tensor: ...

    @overload
    def forward(
        self, query: torch.Tensor, key: Optional[torch.Tensor] = None, value: Optional[torch.Tensor] = None, *,
        mask: _masks.MaskLike = None, return_weights: Literal[True], cache: Optional[KVCache] = None, positions: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    @overload
    def forward(
        self, query: torch.Tensor, key: Optional[torch.Tensor] = None, value: Optional[torch.Tensor] = None, *,
        mask: _masks.MaskLike = None, return_weights: bool = False, cache: Optional[KVCache] = None, positions: Optional[torch.Tensor] = None,
    ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]: ...

    def forward(
        self,
        query: torch.Tensor,
        key: Optional[torch.Tensor] = None,
        value: Optional[torch.Tensor] = None,
        *,
        mask: _masks.MaskLike = None,
        return_weights: bool = False,
        cache: Optional[KVCache] = None,
        positions: Optional[torch.Tensor] = None,
        **unexpected: Any,
    ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Attend from ``query`` to ``key``/``value``.

        Args:
            query: (B, Lq, d_in).
            key: (B, Lk, kdim); default ``query`` (self-attention).
            value: (B, Lk, vdim); default ``key``.
            mask: a `multihead.masks` mask, a bool tensor (True = may attend) or a float
                tensor (added to the scores), broadcastable to (B, H, Lq, Lk). Combined with
                the module's causal mask when ``causal=True``.
            return_weights: also return the per-head weights (B, H, Lq, Lk) actually applied
                (after dropout in training); this runs the reference backend.
            cache: a `multihead.KVCache` or `multihead.StaticKVCache` (causal
                self-attention only). The Lq new tokens are projected, rotated for their
                positions (``len(cache) ...``, or each row's own with a padded cache), written
                to the cache, and attend to every cached token they may see (earlier ones, real
                ones), so no mask is needed at any step. A ``mask`` given too must fit
                Lk = len(cache) after the write (KVCache) or Lk = max_len (StaticKVCache). The
                output equals the last Lq rows of a full causal forward over the whole sequence.
            positions: (B, Lq) or (Lq,) integer RoPE positions of the query tokens, for a module
                with rope; e.g. restarting at 0 for every document packed into a row (with
                ``mask=masks.documents(ids)``). Default: 0 .. Lq-1, or the cache's positions.
                With a cache they are the positions the new tokens are rotated at and written to
                the cache with (the cached keys keep the rotation of their own step); which keys
                each token sees is still the cache's order and the mask's (a new document in a
                cache: ``masks.documents(q_ids, kv_ids)`` hides the earlier ones).

        Returns:
            (B, Lq, d_out), or ``(out, weights)``.

        Raises:
            TypeError: nn.MultiheadAttention's arguments (``attn_mask=``, ``key_padding_mask=``,
                ``is_causal=``, ``need_weights=``), with the multihead way to say each; the
                drop-in `multihead.nn.MultiheadAttention` takes them as torch does.

        A bool ``mask`` whose diagonal is all False (every query's own key hidden, as torch's
        True = blocked ``triu(1)`` reads in multihead's convention) warns once per process.
        """
        if unexpected:
            check_no_torch_arguments(unexpected)
        if cache is not None and key is None and value is None and mask is None and positions is None \
                and not return_weights and _decoding.ENABLED and not torch.compiler.is_dynamo_compiling():
            step = self._decode_step  # a plain decode step: what an earlier one decided (multihead.decoding)
            out = step(self, query, cache) if step is not None else None
            out = self._decide_step(query, cache) if out is None else out
            if out is not None:
                return out
        key, value, m, at, bound = self._edge(query, key, value, mask, cache, positions)
        tr = _trace.current()
        if tr is not None:
            tr.set_config(**self.config.to_dict(), head_dim=self.config.head_dim)
            tr.record(_steps.INPUT, query, module=self)
        plain = _decoding.plain(self.projections)
        q, k, v = self._project(query, key, value, tr, plain)          # x W_Q, x W_K, x W_V; split heads
        if self.rope is not None:
            q, k = self._rotate(q, k, at, tr, bound=bound)             # rotary position embedding
        if cache is not None:
            k, v, m = self._write_cache(cache, k, v, m, tr)            # append to the cache
        o, weights = self._attend(q, k, v, m, return_weights, tr)      # softmax(q kᵀ * scale + mask) v
        out = self._merge_output(o, tr, plain)                         # merge heads; W_O
        return (out, weights) if return_weights else out

    def _edge(self, query, key, value, mask, cache, positions) -> tuple:
        """forward's checks and defaults: (key, value, the checked mask, the RoPE positions (an
        int offset or a tensor), their bound or None)."""
        key, value = self._defaults(query, key, value)
        self._check_inputs(query, key, value)
        batch, lq = query.shape[0], query.shape[1]
        given = None if positions is None else self._check_positions(positions, batch, lq, query.device)
        at: Union[int, torch.Tensor] = 0
        lk, bound = key.shape[1], None
        if cache is not None:
            self._check_cache(cache, query, key, value)
            at, lk, bound = cache._positions(lq), cache._key_length(lq), cache.max_len
        if given is not None:  # any (Lq,) or (B, Lq) ints, looked up below their own bound (compiled:
            # no bound is read on the host, `_rotate_at` takes the angles of the positions themselves)
            at, bound = given, (0 if torch.compiler.is_compiling() else int(given.max()) + 1 if given.numel() else 1)
        return key, value, self._mask(mask, query, lk, causal=cache is None), at, bound

    def _decide_step(self, query: torch.Tensor, cache: KVCache) -> Optional[torch.Tensor]:
        """``mha(query, cache=cache)`` by a `multihead.decoding.DecodeStep` decided now (the call
        checked as the edge checks it, raising as it does), kept for the next steps; None: the
        general path runs it (and the last step decided stays, for the cache it was built for)."""
        def check() -> None:
            self._check_inputs(query, query, query)
            self._check_cache(cache, query, query, query)
        step = _decoding.DecodeStep.build(self, query, cache, check)
        if step is None:
            return None
        self._decode_step = step
        return step(self, query, cache)

    # ------------------------------------------------------------------ the core (trusted inputs)
    def _project(self, query, key, value, tr, plain: Optional[bool] = None) -> tuple:
        """Q (B, H, Lq, D), K (B, Hkv, Lk, D), V (B, Hkv, Lk, Dv): the projections, then the head split.

        Self-attention: one product with the stacked weights, split into Q, K, V (views); else,
        or when a projection must run as its own call, three calls (``self.q_proj(query)``, ...).
        Either way the current weights, parametrizations and hooks are what runs: nothing is kept.
        """
        heads, kv_heads, d_out, kv_dim = self._sizes
        if plain is None:
            plain = _decoding.plain(self.projections)
        stacked = _decoding.block_for(self, query, plain) if key is query and value is query else None
        if stacked is not None:
            if tr is None:
                return _decoding.project_stacked(query, stacked, heads, kv_heads)
            qkv = F.linear(query, stacked.weight, stacked.bias)  # (B, 1, d_out + 2 kv_dim)
            q, k, v = qkv.split_with_sizes((d_out, kv_dim, kv_dim), dim=-1)
        else:
            q_proj, k_proj, v_proj, _ = self.projections
            q, k, v = (_decoding.linear(q_proj, query, plain), _decoding.linear(k_proj, key, plain),
                       _decoding.linear(v_proj, value, plain))
        if tr is not None:
            self._record_projections(tr, (q, k, v), (query, key, value), stacked is not None)
        return split_heads_traced(q, heads, tr, "Q"), split_heads_traced(k, kv_heads, tr, "K"), split_heads_traced(v, kv_heads, tr, "V")

    def _record_projections(self, tr, outs: tuple, inputs: tuple, one_product: bool = False) -> None:
        """Trace the three projections, with the seeds' claim checked on the real values: when
        the inputs are shared, one product with the stacked weights [W_q; W_k; W_v] (or
        [W_k; W_v]) gives the same Q, K, V as the separate products. ``one_product``: the module
        computed the one product (then the separate products are computed here to compare),
        else it computed the separate ones (then the stacked product is)."""
        query, key, value = inputs
        linears = (self.q_proj, self.k_proj, self.v_proj)
        stacked: tuple[int, ...]
        if key is query and value is query:
            stacked, fused_as = (0, 1, 2), "qkv"
        elif value is key and self.config.kdim == self.config.vdim:
            stacked, fused_as = (1, 2), "kv"
        else:
            stacked, fused_as = (), None
        if not all(isinstance(linears[i], nn.Linear) for i in stacked):
            stacked, fused_as = (), None  # a replaced projection (an adapter, ...) is no longer one matrix
        other = {}
        if stacked:
            with torch.no_grad():
                if one_product:
                    other = {i: F.linear(inputs[i], linears[i].weight, linears[i].bias) for i in stacked}
                else:
                    ws = [linears[i].weight for i in stacked]
                    bias = torch.cat([linears[i].bias for i in stacked]) if self.config.bias else None
                    parts = F.linear(inputs[stacked[0]], torch.cat(ws), bias).split([w.shape[0] for w in ws], dim=-1)
                    other = dict(zip(stacked, parts))
        for i, (name, t) in enumerate(zip("QKV", outs)):
            checks = {}
            if i in other:
                checks["equals its own separate product"] = torch.allclose(other[i], t, rtol=1e-4, atol=1e-5)
            tr.record(_steps.PROJECT, t, role=name, axes=("b", "t", "d_out" if name == "Q" else "d_kv"), checks=checks,
                      params={"f_in": inputs[i].shape[-1], "bias": getattr(linears[i], "bias", None) is not None,
                              "fused": fused_as if i in other else None})

    def _rotate(self, q, k, positions, tr, *, bound: Optional[int] = None) -> tuple:
        """q, k rotated (RoPE) for ``positions``: an int offset (tokens at offset, offset + 1, ...),
        an (L,) tensor of global positions (a context-parallel shard), or, with ``bound``, an
        (L,) or (B, L) tensor of positions below ``bound`` from a cache (per-row positions of a
        padded batch, a static cache's columns), applied without reading them on the host."""
        rope = self.rope
        if rope is None:  # an invariant: forward and the ring call this only for a module with rope
            raise RuntimeError("_rotate needs a module built with rope")
        if bound is not None and isinstance(positions, torch.Tensor):
            q, k = _rotate_at(rope, q, positions, bound), _rotate_at(rope, k, positions, bound)
        elif isinstance(positions, torch.Tensor):
            q, k = rope(q, positions=positions), rope(k, positions=positions)
        else:
            q, k = rope(q, positions), rope(k, positions)
        if tr is not None:  # the params are read only when recording (an int of a traced tensor breaks a graph)
            where: dict
            if bound is not None and isinstance(positions, torch.Tensor):
                where = {"positions": "cache", "per_row": positions.dim() == 2}
            elif isinstance(positions, torch.Tensor):
                where = {"positions": "shard", "count": positions.numel()}
            else:
                where = {"positions": "offset", "start": int(positions), "stop": int(positions) + q.shape[2] - 1}
            params = {**where, "base": float(rope.base), "layout": "interleaved" if rope.interleaved else "rotate-half"}
            tr.record(_steps.ROPE, q, role="Q", params=params)
            tr.record(_steps.ROPE, k, role="K", params=params)
        return q, k

    def _write_cache(self, cache: KVCache, k, v, m, tr) -> tuple:
        """k, v written to ``cache``; returns the keys (B, Hkv, Lk, D) and values to attend over,
        and ``m`` combined with the cache's mask (which keys each new token may see)."""
        new = k.shape[2]
        k, v, cache_mask = cache._write(k, v)
        if cache_mask is not None:
            m = cache_mask if m is None else cache_mask & m
        if tr is not None:
            params = {"length": cache.length, "max_len": cache.max_len, "kv_heads": resolved_size(self.config.num_kv_heads),
                      "new": new}
            tr.record(_steps.CACHE_APPEND, k, role="K", params=params)
            tr.record(_steps.CACHE_APPEND, v, role="V", params=params)
        return k, v, m

    def _attend(self, q, k, v, m, return_weights: bool, tr) -> tuple:
        """(out (B, H, Lq, Dv), weights (B, H, Lq, Lk) or None) for a checked mask ``m``."""
        cfg = self.config
        dropout_p = cfg.dropout if self.training else 0.0
        scale = self._scale
        if return_weights:
            return _functional.attention_core(q, k, v, m, scale, dropout_p, returns="weights", tr=tr)
        return _functional.attention_core(q, k, v, m, scale, dropout_p, cfg.backend, tr=tr), None

    def _merge_output(self, o, tr, plain: Optional[bool] = None) -> torch.Tensor:
        """(B, H, Lq, Dv) -> (B, Lq, d_out): merge the heads, then W_O."""
        if plain is None:
            plain = _decoding.plain(self.projections)
        out = _decoding.linear(self.projections[3], merge_heads_traced(o, tr), plain)
        if tr is not None:
            tr.record(_steps.OUTPUT_PROJECTION, out, params={
                "f_in": o.shape[1] * o.shape[3], "bias": getattr(self.out_proj, "bias", None) is not None})
        return out

    # ------------------------------------------------------------------ conversions
    # Each is a converter's codec (config, weights) plus from_config; the codecs never import this module.
    def _weights(self) -> dict:
        """The projections' weights as they are used now (a parametrization evaluated), under the
        state_dict names of ``config.weight_shapes()``."""
        return {name: attrgetter(name)(self).detach() for name in self.config.weight_shapes()}

    def to_per_head(self) -> _per_head.PerHeadAttention:
        """The same layer as h independent heads (`multihead.PerHeadAttention`)."""
        return _per_head.to_per_head(self.config, self._weights()).train(self.training)

    @classmethod
    def from_per_head(cls, p: _per_head.PerHeadAttention, *, num_kv_heads: Optional[int] = None) -> "MultiHeadAttention":
        """Fuse a `PerHeadAttention` back; with ``num_kv_heads`` its K/V copies are regrouped."""
        return cls.from_config(*_per_head.from_per_head(p, num_kv_heads=num_kv_heads)).train(p.training)

    @classmethod
    def from_torch(cls, m: nn.MultiheadAttention) -> "MultiHeadAttention":
        """Copy an ``nn.MultiheadAttention``; the result is batch-first whatever ``m.batch_first`` is."""
        return cls.from_config(*_interop.from_torch(m)).train(m.training)

    @classmethod
    def from_hf(cls, module: nn.Module, *, output_dense: Optional[nn.Linear] = None) -> "MultiHeadAttention":
        """Copy a Hugging Face ``BertAttention`` or ``LlamaAttention`` (see `multihead.hf.from_hf`)."""
        return cls.from_config(*_hf.from_hf(module, output_dense=output_dense)).train(module.training)

    def to_torch(self, *, batch_first: bool = True) -> nn.MultiheadAttention:
        """An ``nn.MultiheadAttention`` with the same weights (raises ValueError if it cannot express this module)."""
        return _interop.to_torch(self.config, self._weights(), batch_first=batch_first).train(self.training)


def _settings_of(rope: RoPE, rope_base: float, rope_scaling) -> tuple:
    """(base, scaling) of a RoPE object passed as ``rope=``; rope_base/rope_scaling given beside it must agree."""
    if rope_base != 10000.0 and rope_base != rope.base:
        raise ValueError(
            f"rope is {rope} but rope_base={rope_base}; pass the base in one place (RoPE(head_dim, base) or rope_base=)"
        )
    if rope_scaling is not None and rope_scaling != rope.scaling:
        raise ValueError(
            f"rope is {rope} but rope_scaling={rope_scaling}; pass the scaling in one place "
            "(RoPE(head_dim, base, scaling=) or rope_scaling=)"
        )
    return rope.base, rope.scaling
