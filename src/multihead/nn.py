"""``multihead.nn.MultiheadAttention``: a drop-in for ``torch.nn.MultiheadAttention``.

    >>> from multihead.nn import MultiheadAttention
    >>> attn = MultiheadAttention(16, 4, batch_first=True)
    >>> x, pad = torch.randn(2, 5, 16), torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    >>> out, weights = attn(x, x, x, key_padding_mask=pad)  # pad: True = padding, as in torch
    >>> out.shape, weights.shape
    (torch.Size([2, 5, 16]), torch.Size([2, 5, 5]))

The same constructor, forward signature, parameter names and state_dict keys as
``nn.MultiheadAttention`` (torch 2.13), so call sites, ``nn.TransformerEncoderLayer`` /
``nn.TransformerDecoderLayer`` / ``nn.Transformer`` and existing checkpoints work unchanged; the
attention itself runs on :func:`multihead.attention`. Its parameters are the single source of
truth: each call projects with ``in_proj_weight`` (or ``q_proj_weight``, ``k_proj_weight``,
``v_proj_weight``) and ``out_proj`` as they are, with nothing derived from them kept between calls.

Data flow of ``attn(query, key, value)`` (the step names are :class:`multihead.MultiHeadAttention`'s)::

    query (L, N, E) or (N, L, E) or (L, E)  -> batch-first (N, L, E), a view
      -> project Q, K, V      in_proj_weight / in_proj_bias (one product when query is key is value)
      -> split heads          'b t (h d) -> b h t d'                      (N, H, L, D)
      -> extend the keys      add_bias_kv: + bias_k, bias_v; add_zero_attn: + a zero key and value
      -> attention            multihead.attention, nn.MultiheadAttention's masks converted  (N, H, L, D)
      -> merge heads          'b h t d -> b t (h d)'                      (N, L, E)
      -> output projection    out_proj                                   back to the input layout

Where it differs from ``nn.MultiheadAttention``:

* A query row that no key may attend to gives attention output 0 (so the layer returns
  ``out_proj.bias`` there) and weights 0; torch returns NaN for that row.
* ``is_causal=True`` is, as in torch, a hint that ``attn_mask`` is the causal mask, and torch
  2.13's rule is followed exactly: ``attn_mask`` is required (ValueError without it, where torch
  raises RuntimeError); with ``need_weights=False`` and no ``key_padding_mask`` the attention is
  top-left causal (query i sees keys j <= i, SDPA's ``is_causal``) and ``attn_mask`` is not
  read; otherwise ``attn_mask`` is applied as given. Shapes are checked in both cases.
* Training with dropout draws the same dropout masks as torch at the same seed on CPU, for the
  layer alone and inside ``nn.TransformerEncoderLayer``/``nn.TransformerDecoderLayer``: the
  attention dropout over the (N, H, L, S) weights in the same order, and the output in torch's
  memory layout ((L, N, E) in memory, a transposed view when ``batch_first``), because the
  layer's next dropout (``dropout1``) draws its mask over that tensor in memory order. On CUDA
  this is not promised: there torch's SDPA picks a fused kernel with dropout (its own random
  stream) by its own rules, which multihead's backend choice does not follow.
* Bad input raises ValueError/TypeError naming the argument where torch raises AssertionError
  or RuntimeError.
* Inside ``nn.TransformerEncoderLayer`` in inference (eval, autograd off, ``batch_first=True``,
  biases, even ``num_heads``, ...) the layer takes torch's fused fast path, as it does for
  ``nn.MultiheadAttention``: it reads ``in_proj_weight``, ``in_proj_bias``, ``out_proj`` and
  :meth:`merge_masks` from this module and does not call its forward. Every other call
  (training, autograd on, ``batch_first=False``, decoder layers) runs this module's forward.

Legend: N (also B) batch, L query length, S key length, E embed_dim, H num_heads, D head_dim.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from . import masks as _masks
from ._checks import check_dropout, check_positive_int, check_tensor
from .functional import attention, attention_core, prepare_inputs
from .heads import merge_heads, split_heads
from .integrations.torch_mha import load_multihead_state_dict

__all__ = ["MultiheadAttention", "swap_in"]


class MultiheadAttention(nn.Module):
    """``torch.nn.MultiheadAttention``'s interface, computed by :func:`multihead.attention`.

    Args (as torch's):
        embed_dim: E, the model size; num_heads: H, which must divide E (head_dim D = E // H).
        dropout: dropout on the attention weights, in training only.
        bias: biases in the input and output projections.
        add_bias_kv: learn one extra key and value (``bias_k``, ``bias_v``, each (1, 1, E)),
            appended to every sequence's keys and values.
        add_zero_attn: append a key and a value of zeros (after the projections and ``bias_k``).
        kdim, vdim: feature sizes of ``key`` and ``value`` (default E); when either differs from
            E the projections are ``q_proj_weight``/``k_proj_weight``/``v_proj_weight``, else
            the stacked ``in_proj_weight`` (3E, E) = [W_q; W_k; W_v].
        batch_first: inputs and outputs are (N, L, E) rather than (L, N, E).

    ``state_dict()`` has nn.MultiheadAttention's keys (``in_proj_weight``, ``in_proj_bias``,
    ``out_proj.weight``, ...), so its checkpoints load with ``strict=True`` and this module's
    load into it. A :class:`multihead.MultiHeadAttention` state_dict (``q_proj.weight``, ...)
    of the same sizes loads too.
    """

    __constants__ = ["batch_first"]
    bias_k: Optional[torch.Tensor]
    bias_v: Optional[torch.Tensor]

    def __init__(
        self,
        embed_dim,
        num_heads,
        dropout=0.0,
        bias=True,
        add_bias_kv=False,
        add_zero_attn=False,
        kdim=None,
        vdim=None,
        batch_first=False,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        embed_dim = check_positive_int(embed_dim, "embed_dim")
        num_heads = check_positive_int(num_heads, "num_heads")
        if embed_dim % num_heads:
            raise ValueError(
                f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}; "
                "choose embed_dim as a multiple of num_heads (head_dim = embed_dim // num_heads)"
            )
        for flag, name in ((bias, "bias"), (add_bias_kv, "add_bias_kv"), (add_zero_attn, "add_zero_attn"),
                           (batch_first, "batch_first")):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        factory = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.kdim = embed_dim if kdim is None else check_positive_int(kdim, "kdim")
        self.vdim = embed_dim if vdim is None else check_positive_int(vdim, "vdim")
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout = check_dropout(dropout, "dropout")
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads

        # registered in nn.MultiheadAttention's order, so that state_dict() lists the same keys
        # in the same order and a seed gives the same initial values
        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty((3 * embed_dim, embed_dim), **factory))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty((embed_dim, embed_dim), **factory))
            self.k_proj_weight = nn.Parameter(torch.empty((embed_dim, self.kdim), **factory))
            self.v_proj_weight = nn.Parameter(torch.empty((embed_dim, self.vdim), **factory))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        # torch's class for out_proj: dynamic quantization leaves it a Linear, whose weight we read
        self.out_proj = NonDynamicallyQuantizableLinear(embed_dim, embed_dim, bias=bias, **factory)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty((1, 1, embed_dim), **factory))
            self.bias_v = nn.Parameter(torch.empty((1, 1, embed_dim), **factory))
        else:
            self.bias_k = self.bias_v = None
        self.add_zero_attn = add_zero_attn
        self._reset_parameters()  # out_proj initialised itself above, as in torch
        self.register_load_state_dict_pre_hook(load_multihead_state_dict)

    # nn.TransformerEncoderLayer's fast path asks self_attn to merge its masks; torch's method
    # reads only self.num_heads, so it serves this class unchanged
    merge_masks = nn.MultiheadAttention.merge_masks

    @classmethod
    def from_torch(cls, m: nn.MultiheadAttention) -> "MultiheadAttention":
        """A copy of ``m`` (settings, weights, training mode) that computes with multihead."""
        if not isinstance(m, nn.MultiheadAttention):
            raise TypeError(f"from_torch takes an nn.MultiheadAttention, got {type(m).__name__}")
        w = m.out_proj.weight
        new = cls(m.embed_dim, m.num_heads, dropout=m.dropout, bias=m.in_proj_bias is not None,
                  add_bias_kv=m.bias_k is not None, add_zero_attn=m.add_zero_attn, kdim=m.kdim,
                  vdim=m.vdim, batch_first=m.batch_first, device=w.device, dtype=w.dtype)
        new.load_state_dict(m.state_dict())
        return new.train(m.training)

    def reset_parameters(self) -> None:
        """Initialise every parameter as the constructor does (nn.MultiheadAttention's scheme:
        ``out_proj`` as an nn.Linear, Xavier-uniform projections, zero biases, Xavier-normal
        ``bias_k``/``bias_v``). For meta-device construction: ``m.to_empty(device=...)``, then
        ``m.reset_parameters()``; under one seed it gives what construction on that device gives."""
        self.out_proj.reset_parameters()
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        """nn.MultiheadAttention's own ``_reset_parameters`` (everything but out_proj's weight)."""
        if self._qkv_same_embed_dim:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            nn.init.xavier_uniform_(self.q_proj_weight)
            nn.init.xavier_uniform_(self.k_proj_weight)
            nn.init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.constant_(self.in_proj_bias, 0.0)
            nn.init.constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None and self.bias_v is not None:  # set together (add_bias_kv)
            nn.init.xavier_normal_(self.bias_k)
            nn.init.xavier_normal_(self.bias_v)

    def extra_repr(self) -> str:
        parts = [f"embed_dim={self.embed_dim}", f"num_heads={self.num_heads}", f"batch_first={self.batch_first}"]
        if not self._qkv_same_embed_dim:
            parts.append(f"kdim={self.kdim}, vdim={self.vdim}")
        if self.dropout:
            parts.append(f"dropout={self.dropout}")
        if self.bias_k is not None:
            parts.append("add_bias_kv=True")
        if self.add_zero_attn:
            parts.append("add_zero_attn=True")
        return ", ".join(parts)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: Optional[torch.Tensor] = None,
        need_weights: bool = True,
        attn_mask: Optional[torch.Tensor] = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(attn_output, attn_weights or None)``, as ``nn.MultiheadAttention.forward``.

        Args:
            query: (L, N, E), or (N, L, E) with ``batch_first``, or unbatched (L, E).
            key: (S, N, kdim) / (N, S, kdim) / (S, kdim); value: the same with vdim.
            key_padding_mask: (N, S) or, unbatched, (S,): bool with True = **padding** (ignored
                key), or float added to the scores.
            need_weights: also return the attention weights (those applied, after dropout).
            attn_mask: (L, S) or (N*H, L, S) (unbatched: (H, L, S)): bool with True = **blocked**,
                or float added to the scores. (nn.MultiheadAttention's convention, the opposite
                of multihead's; converted by :func:`multihead.masks.from_torch`.)
            average_attn_weights: weights averaged over heads (N, L, S), else per head (N, H, L, S).
            is_causal: a hint that ``attn_mask`` is the causal mask (see the module docstring).

        Returns:
            attn_output in the input's layout (L, N, E) / (N, L, E) / (L, E), and the weights
            ((N, L, S) or (N, H, L, S); unbatched (L, S) or (H, L, S)) or None.
        """
        batched = self._check_inputs(query, key, value)
        self_attention, shared_kv = query is key and key is value, key is value
        if not batched:  # a batch of one, removed again at the end
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        self._check_masks(attn_mask, key_padding_mask, is_causal, query.shape[0], query.shape[1], key.shape[1], batched)
        if not batched and key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)

        q, k, v = self._project(query, key, value, self_attention, shared_kv)
        q, k, v = (split_heads(t, self.num_heads, role=r) for t, r in ((q, "Q"), (k, "K"), (v, "V")))
        k, v, extra = self._extend_keys(k, v)
        if extra:  # the appended keys are visible to every query, as torch pads its masks with 0
            attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, extra))
            key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, extra))
        mask: Optional[_masks.Mask]
        if is_causal and key_padding_mask is None and not need_weights:
            mask = _masks.causal(align="top_left")  # torch 2.13 reads only the hint here
        else:
            mask = _masks.from_torch(attn_mask=attn_mask, key_padding_mask=key_padding_mask)

        dropout_p = self.dropout if self.training else 0.0
        weights = None
        if need_weights:
            o, weights = attention_core(*prepare_inputs(q, k, v, mask, None, dropout_p), returns="weights")
            if average_attn_weights:
                weights = weights.mean(dim=1)
        else:
            o = attention(q, k, v, mask, dropout_p=dropout_p)
        # (L, N, E) in memory, as torch lays it out: a dropout after this layer (the encoder
        # layer's dropout1) draws its mask over the tensor in memory order, so the same seed
        # gives the same mask only with the same layout
        out = F.linear(merge_heads(o).transpose(0, 1), self.out_proj.weight, self.out_proj.bias).contiguous()

        if not batched:
            return out.squeeze(1), None if weights is None else weights.squeeze(0)
        return (out.transpose(0, 1) if self.batch_first else out), weights

    # ------------------------------------------------------------------ the edge
    def _weight(self) -> torch.Tensor:
        return self.out_proj.weight

    def _check_inputs(self, query, key, value) -> bool:
        """Whether the call is batched; ValueError/TypeError for what torch would reject."""
        for t, name in ((query, "query"), (key, "key"), (value, "value")):
            check_tensor(t, name)
            if t.is_nested:
                raise TypeError(
                    f"{name} is a NestedTensor, which only torch's fused inference path takes (inside "
                    "nn.TransformerEncoder it still does); pass a padded tensor and key_padding_mask"
                )
        layout = "(N, L, E)" if self.batch_first else "(L, N, E)"
        if query.dim() not in (2, 3):
            raise ValueError(
                f"query must be {layout} (batch_first={self.batch_first}) or unbatched (L, E), "
                f"got shape {tuple(query.shape)}"
            )
        for t, name in ((key, "key"), (value, "value")):
            if t.dim() != query.dim():
                raise ValueError(
                    f"{name} has {t.dim()} dimensions but query has {query.dim()}; "
                    f"for a {'batched' if query.dim() == 3 else 'unbatched'} query, {name} must be too"
                )
        for t, name, size, what in ((query, "query", self.embed_dim, "embed_dim"),
                                    (key, "key", self.kdim, "kdim"), (value, "value", self.vdim, "vdim")):
            if t.shape[-1] != size:
                raise ValueError(f"{name} has {t.shape[-1]} features but {what}={size}")
        seq = 1 if (query.dim() == 3 and self.batch_first) else 0
        if key.shape[:-1] != value.shape[:-1]:
            raise ValueError(
                f"key {tuple(key.shape)} and value {tuple(value.shape)} must have the same batch and sequence sizes"
            )
        if query.dim() == 3 and query.shape[1 - seq] != key.shape[1 - seq]:
            raise ValueError(
                f"query has batch {query.shape[1 - seq]} but key has {key.shape[1 - seq]} "
                f"(batch is dim {1 - seq} with batch_first={self.batch_first}); they must match"
            )
        w = self._weight()
        for t, name in ((query, "query"), (key, "key"), (value, "value")):
            if t.device != w.device:
                raise ValueError(f"{name} is on {t.device} but the module is on {w.device}; move one of them")
            if t.dtype != w.dtype and not torch.is_autocast_enabled(t.device.type):
                raise TypeError(
                    f"{name} is {t.dtype} but the module's weights are {w.dtype}; "
                    f"call attn.to({t.dtype}) or pass {name}.to({w.dtype})"
                )
        return query.dim() == 3

    @staticmethod
    def _check_mask_type(m, name: str) -> None:
        if not isinstance(m, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(m).__name__}")
        if m.dtype != torch.bool and not m.is_floating_point():
            raise TypeError(
                f"{name} must be bool (True = {'padding' if 'padding' in name else 'blocked'}) "
                f"or float (added to the scores), got {m.dtype}"
            )

    def _check_masks(self, attn_mask, key_padding_mask, is_causal, n, lq, lk, batched) -> None:
        """nn.MultiheadAttention's mask rules, for a call with batch n, lengths lq and lk."""
        if not isinstance(is_causal, bool):
            raise TypeError(f"is_causal must be True or False, got {is_causal!r}")
        if is_causal and attn_mask is None:
            raise ValueError(
                "is_causal=True needs attn_mask: as in nn.MultiheadAttention, is_causal is a hint that "
                "attn_mask is the causal mask; pass attn_mask=nn.Transformer.generate_square_subsequent_mask(L)"
            )
        if key_padding_mask is not None:
            self._check_mask_type(key_padding_mask, "key_padding_mask")
            want = (n, lk) if batched else (lk,)
            if tuple(key_padding_mask.shape) != want:
                raise ValueError(
                    f"key_padding_mask must be {'(N, S)' if batched else '(S,) for an unbatched query'} = {want}, "
                    f"got shape {tuple(key_padding_mask.shape)}"
                )
            if key_padding_mask.device != self._weight().device:
                raise ValueError(f"key_padding_mask is on {key_padding_mask.device}; move it to {self._weight().device}")
        if attn_mask is not None:
            self._check_mask_type(attn_mask, "attn_mask")
            allowed = ((lq, lk), (n * self.num_heads, lq, lk))
            if tuple(attn_mask.shape) not in allowed:
                names = "(N*num_heads, L, S)" if batched else "(num_heads, L, S)"
                raise ValueError(
                    f"attn_mask must be (L, S) = {allowed[0]} or {names} = {allowed[1]}, "
                    f"got shape {tuple(attn_mask.shape)}"
                )
            if attn_mask.device != self._weight().device:
                raise ValueError(f"attn_mask is on {attn_mask.device}; move it to {self._weight().device}")

    # ------------------------------------------------------------------ the core
    def _project(self, query, key, value, self_attention: bool, shared_kv: bool) -> tuple:
        """Q (N, L, E), K and V (N, S, E) from the parameters as they are now: one product with
        ``in_proj_weight`` for self-attention, one with its K/V rows when key is value."""
        E = self.embed_dim
        b = self.in_proj_bias
        bq, bk, bv = (None, None, None) if b is None else b.chunk(3)
        if not self._qkv_same_embed_dim:
            return (F.linear(query, self.q_proj_weight, bq), F.linear(key, self.k_proj_weight, bk),
                    F.linear(value, self.v_proj_weight, bv))
        w = self.in_proj_weight
        if self_attention:
            return F.linear(query, w, b).chunk(3, dim=-1)
        q = F.linear(query, w[:E], bq)
        if shared_kv:
            k, v = F.linear(key, w[E:], None if b is None else b[E:]).chunk(2, dim=-1)
            return q, k, v
        return q, F.linear(key, w[E:2 * E], bk), F.linear(value, w[2 * E:], bv)

    def _extend_keys(self, k, v) -> tuple:
        """k, v (N, H, S, D) with ``bias_k``/``bias_v``, then a zero key and value, appended
        (torch's order); and how many keys were appended."""
        n, h, _, d = k.shape
        extra_k, extra_v = [], []
        if self.bias_k is not None and self.bias_v is not None:  # set together (add_bias_kv)
            extra_k.append(self.bias_k.view(1, h, 1, d).expand(n, h, 1, d).to(k.dtype))
            extra_v.append(self.bias_v.view(1, h, 1, d).expand(n, h, 1, d).to(v.dtype))
        if self.add_zero_attn:
            extra_k.append(k.new_zeros(n, h, 1, d))
            extra_v.append(v.new_zeros(n, h, 1, d))
        if not extra_k:
            return k, v, 0
        return torch.cat([k, *extra_k], dim=2), torch.cat([v, *extra_v], dim=2), len(extra_k)


def swap_in(model: nn.Module) -> nn.Module:
    """Replace, in place, every ``nn.MultiheadAttention`` inside ``model`` by a
    :class:`MultiheadAttention` with the same settings and weights; returns ``model``.

        >>> layer = swap_in(nn.TransformerEncoderLayer(16, 4, batch_first=True))
        >>> type(layer.self_attn).__module__
        'multihead.nn'
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"swap_in takes an nn.Module, got {type(model).__name__}")
    if isinstance(model, nn.MultiheadAttention):
        raise TypeError("swap_in replaces the attention inside a model; for one layer use MultiheadAttention.from_torch(m)")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.MultiheadAttention):
                setattr(parent, name, MultiheadAttention.from_torch(child))
    return model
