"""Hugging Face attention layers as ``(AttentionConfig, weights)``: the codec behind
``MultiHeadAttention.from_hf``::

    config, weights = from_hf(layer.self_attn)
    mha = MultiHeadAttention.from_config(config, weights)   # what MultiHeadAttention.from_hf(layer.self_attn) does

``weights`` is a plain dict under :class:`multihead.MultiHeadAttention`'s state_dict names (the
tensors are detached views of the layer's, until ``from_config`` copies them). This module
imports the config, not the module.

Two families are understood, by the names of their submodules (no import of ``transformers``
is needed here, so any module laid out the same way loads, e.g. RoBERTa, Mistral, Qwen2):

==============  ==========================================  =====================================
family          Hugging Face module                         becomes
==============  ==========================================  =====================================
BERT            ``BertAttention``: ``.self.query/key/value``  ``q_proj/k_proj/v_proj``,
                and ``.output.dense``                         ``out_proj``
Llama           ``LlamaAttention``: ``q_proj/k_proj/v_proj/``  the same names; H query heads,
                ``o_proj`` (GQA: fewer k/v heads)             Hkv key/value heads
==============  ==========================================  =====================================

What stays outside the attention module, as in the model itself:

* BERT: the residual and ``LayerNorm`` of ``BertSelfOutput`` (``LayerNorm(dense(attn) + x)``):
  :class:`MultiHeadAttention` returns ``dense(attn)``, the input of that residual.

What comes along:

* Llama: the rotary position embedding (RoPE), which ``LlamaAttention`` applies to Q and K after
  the projections, with the cos/sin its model passes in. The loaded module has ``rope=True``:
  a :class:`multihead.rope.RoPE` with the base and the scaling of the attention's config
  (``config.rope_parameters`` in transformers 5, ``rope_theta`` and ``rope_scaling`` in 4.x).
  Scaling types ("rope_type"): "default", "linear" and "llama3"; any other (dynamic, yarn,
  longrope, ...) is refused by name; a partial rotation (``partial_rotary_factor``, StableLM, Phi)
  of a layer that applies one (``rotary_ndims``) rotates those first coordinates (``rope_dim``).
  Positions start at 0, or at the cache length with a :class:`multihead.KVCache`, as in the
  model's own generation. Transformers computes its cos/sin in float32 whatever the model's
  dtype; multihead in float64, so the two agree to float32 precision.

Weights are ``nn.Linear`` weights (out, in) in both libraries, so they are taken as they are; a
layer with biases on only some projections gets zero biases on the others.
"""

from __future__ import annotations

import re
from typing import Mapping, Optional, TypeGuard, cast

import torch
import torch.nn as nn

from ._checks import check_positive_int
from ._numerics import default_scale
from .config import AttentionConfig
from .rope import ROPE_TYPES, RoPEScaling

__all__ = ["from_hf", "from_bert_state_dict", "bert_layer_keys"]

_SUPPORTED = (
    "a BERT-family attention (BertAttention, with .self.query/.key/.value and .output.dense; "
    "or BertSelfAttention with output_dense=) or a Llama-family attention (LlamaAttention, with "
    ".q_proj/.k_proj/.v_proj/.o_proj)"
)


def is_linear(m: object) -> TypeGuard[nn.Linear]:
    return isinstance(m, nn.Linear)


def has_linears(module, names) -> bool:
    return all(is_linear(getattr(module, n, None)) for n in names)


def _codec(linears: dict, *, num_heads: int, num_kv_heads: int, causal: bool, dropout: float,
           rope: Optional[dict] = None) -> tuple:
    """``(config, weights)`` of ``linears`` = {"q_proj": (weight, bias or None), ...}; ``rope``:
    the config's rope settings (rope, rope_base, rope_scaling), or None for none."""
    wq = linears["q_proj"][0]
    d_out, d_in = wq.shape
    wo = linears["out_proj"][0]
    if tuple(wo.shape) != (d_out, d_out):
        raise ValueError(
            f"the output projection has shape {tuple(wo.shape)}; MultiHeadAttention needs it square "
            f"({d_out}, {d_out}) = (H*D, H*D), i.e. hidden size = heads x head dim"
        )
    if d_in != d_out:
        raise ValueError(
            f"the query projection maps {d_in} features to {d_out}; MultiHeadAttention needs "
            "hidden size = heads x head dim"
        )
    has_bias = any(b is not None for _, b in linears.values())
    config = AttentionConfig(d_in=d_in, num_heads=num_heads, d_out=d_out, num_kv_heads=num_kv_heads, bias=has_bias,
                             dropout=dropout, causal=causal, **(rope or {}))
    weights = {}
    for name, (w, b) in linears.items():
        weights[f"{name}.weight"] = w
        if has_bias:
            weights[f"{name}.bias"] = w.new_zeros(w.shape[0]) if b is None else b
    return config, config.check_weights(weights, "the layer's weights")


def _linears(module: object, names: tuple[str, ...]) -> list[nn.Linear]:
    """``module``'s attributes ``names``, which the caller has checked are nn.Linear (:func:`has_linears`)."""
    return [cast(nn.Linear, getattr(module, n)) for n in names]


def _linear_pair(lin: nn.Linear):
    return lin.weight.detach(), None if lin.bias is None else lin.bias.detach()


def from_hf(module: nn.Module, *, output_dense: Optional[nn.Linear] = None) -> tuple:
    """``(config, weights)`` of a Hugging Face attention module, for ``MultiHeadAttention.from_config``.

    Args:
        module: ``BertAttention`` (or anything with ``.self.{query,key,value}`` and
            ``.output.dense``), ``BertSelfAttention`` together with ``output_dense``, or
            ``LlamaAttention`` (anything with ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``).
        output_dense: the output projection, only for a bare ``BertSelfAttention``
            (``layer.attention.output.dense``).

    Returns:
        ``(AttentionConfig, weights)`` of a module computing ``out_proj(attention(x))``:
        (B, L, hidden) -> (B, L, hidden). For BERT that is the input of ``BertSelfOutput``'s
        residual + LayerNorm; for Llama it is ``LlamaAttention`` with its rotary embedding
        (``rope=True``, the config's ``rope_theta`` and ``rope_scaling``; see the module
        docstring). Causality and dropout are taken from ``module`` (and its training mode by
        ``MultiHeadAttention.from_hf``).

    Raises:
        TypeError: ``module`` is not one of the supported layouts.
        ValueError: what the module cannot express: hidden size != heads x head dim, a scaling
            other than 1/√D, a rope type other than default, linear or llama3, a partial
            rotation, per-head norms of q and k (``q_norm``/``k_norm``), or a Llama-family
            attention without the ``config`` its RoPE is read from.

    Example::

        config, weights = from_hf(model.model.layers[0].self_attn)   # config.rope is True, GQA kept
        mha = MultiHeadAttention.from_config(config, weights)
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"from_hf takes a torch.nn.Module, got {type(module).__name__}; pass {_SUPPORTED}")
    if has_linears(getattr(module, "self", None), ("query", "key", "value")):
        self_attn = module.self
        dense = getattr(getattr(module, "output", None), "dense", None)
        if not is_linear(dense):
            raise TypeError(f"{type(module).__name__}.output.dense is not an nn.Linear; pass {_SUPPORTED}")
        if output_dense is not None:
            raise ValueError("output_dense is only for a bare BertSelfAttention; a BertAttention has its own")
        return _from_bert(self_attn, dense)
    if has_linears(module, ("query", "key", "value")):
        if not is_linear(output_dense):
            raise ValueError(
                f"{type(module).__name__} has no output projection: pass output_dense=layer.attention.output.dense, "
                "or pass the BertAttention (layer.attention) itself"
            )
        return _from_bert(module, output_dense)
    if has_linears(module, ("q_proj", "k_proj", "v_proj", "o_proj")):
        if output_dense is not None:
            raise ValueError("output_dense is only for a bare BertSelfAttention; this module has o_proj")
        return _from_llama(module)
    raise TypeError(f"from_hf got {type(module).__name__}, which it does not know; pass {_SUPPORTED}")


def _check_scaling(module, head_dim: int) -> None:
    scaling = getattr(module, "scaling", None)
    default = default_scale(head_dim)
    if scaling is not None and abs(float(scaling) - default) > 1e-12 * default:
        raise ValueError(
            f"{type(module).__name__}.scaling is {scaling}, not 1/sqrt(head_dim) = {default}; "
            "MultiHeadAttention always scales by 1/sqrt(head_dim)"
        )


def _from_bert(self_attn: object, dense: nn.Linear) -> tuple:
    num_heads = getattr(self_attn, "num_attention_heads", None)
    if not isinstance(num_heads, int):
        raise TypeError(f"{type(self_attn).__name__} has no integer num_attention_heads; pass {_SUPPORTED}")
    query, key, value = _linears(self_attn, ("query", "key", "value"))
    d_out = query.weight.shape[0]
    _check_scaling(self_attn, d_out // num_heads)
    dropout = getattr(getattr(self_attn, "dropout", None), "p", 0.0)
    linears = {
        "q_proj": _linear_pair(query),
        "k_proj": _linear_pair(key),
        "v_proj": _linear_pair(value),
        "out_proj": _linear_pair(dense),
    }
    causal = bool(getattr(self_attn, "is_causal", False))
    return _codec(linears, num_heads=num_heads, num_kv_heads=num_heads, causal=causal, dropout=dropout)


def _from_llama(module: nn.Module) -> tuple:
    head_dim = getattr(module, "head_dim", None)
    if not isinstance(head_dim, int) or head_dim < 1:
        raise TypeError(f"{type(module).__name__} has no integer head_dim; pass {_SUPPORTED}")
    q_proj, k_proj, v_proj, o_proj = _linears(module, ("q_proj", "k_proj", "v_proj", "o_proj"))
    q_out = q_proj.weight.shape[0]
    kv_out = k_proj.weight.shape[0]
    if q_out % head_dim or kv_out % head_dim:
        raise ValueError(
            f"q_proj has {q_out} and k_proj {kv_out} outputs, not multiples of head_dim={head_dim}"
        )
    _check_scaling(module, head_dim)
    norms = [n for n in ("q_norm", "k_norm", "q_layernorm", "k_layernorm") if isinstance(getattr(module, n, None), nn.Module)]
    norms = norms if getattr(module, "qk_layernorm", True) else []  # StableLM builds them only with qk_layernorm
    if norms:
        raise ValueError(
            f"{type(module).__name__} normalises each head of q and k ({', '.join(norms)}) before RoPE, which "
            "MultiHeadAttention does not; run the model with attn_implementation=\"multihead\" "
            "(multihead.integrations.transformers) instead"
        )
    rope = _rope_settings(module)
    linears = {
        "q_proj": _linear_pair(q_proj),
        "k_proj": _linear_pair(k_proj),
        "v_proj": _linear_pair(v_proj),
        "out_proj": _linear_pair(o_proj),
    }
    dropout = float(getattr(module, "attention_dropout", 0.0) or 0.0)
    return _codec(linears, num_heads=q_out // head_dim, num_kv_heads=kv_out // head_dim,
                  causal=bool(getattr(module, "is_causal", True)), dropout=dropout, rope=rope)


def _rope_parameters(module: nn.Module) -> dict:
    """The rotary embedding's parameters from ``module.config``, in transformers 5's spelling
    (``rope_parameters``: rope_type, rope_theta, factor, ...) whichever version wrote the config:
    transformers 4.x keeps ``rope_theta`` and ``rope_scaling`` (None, or with "rope_type" or the
    older "type") on the config itself."""
    name = type(module).__name__
    config = getattr(module, "config", None)
    if config is None:
        raise ValueError(
            f"{name} has no .config, where from_hf reads its rotary embedding (rope_theta, rope_scaling); "
            "pass the attention of a transformers model, e.g. model.model.layers[0].self_attn"
        )
    params = getattr(config, "rope_parameters", None)
    if params is None:  # transformers 4.x
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", None))
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if params["rope_type"] == "llama3":  # transformers fills it in the same way
        params.setdefault("original_max_position_embeddings", getattr(config, "max_position_embeddings", None))
    if params.get("rope_theta") is None:
        raise ValueError(
            f"{name}.config has no rope_theta (rope parameters: {params}); from_hf needs the RoPE base"
        )
    return params


def _rope_settings(module: nn.Module) -> dict:
    """The rotary embedding of a Llama-family attention as AttentionConfig fields: rope=True, its
    config's base (rope_base) and scaling rule (rope_scaling)."""
    name = type(module).__name__
    params = _rope_parameters(module)
    rope_type = params["rope_type"]
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"{name} uses rope_type {rope_type!r}, which from_hf does not support (supported: "
            f"{', '.join(ROPE_TYPES)}); run the model with attn_implementation=\"multihead\" "
            "(multihead.integrations.transformers), which keeps the model's own RoPE"
        )
    partial = params["partial_rotary_factor"]
    rope_dim = getattr(module, "rotary_ndims", None)  # StableLM, Phi: the first rotary_ndims coordinates turn
    if rope_dim is None and partial is not None and float(partial) != 1.0:
        raise ValueError(
            f"{name}'s config has partial_rotary_factor={partial} but the layer has no rotary_ndims (it rotates "
            "whole heads, and its own forward cannot run that config); from_hf reads a partial rotation from "
            "layers that apply one (StableLM, Phi)"
        )

    def need(key):
        if params.get(key) is None:
            raise ValueError(f"{name}.config's rope_type {rope_type!r} needs {key}, which it lacks ({params})")
        return params[key]

    scaling = None
    if rope_type == "linear":
        scaling = RoPEScaling("linear", need("factor"))
    elif rope_type == "llama3":
        scaling = RoPEScaling("llama3", need("factor"), need("low_freq_factor"), need("high_freq_factor"),
                              need("original_max_position_embeddings"))
    return {"rope": True, "rope_base": params["rope_theta"], "rope_scaling": scaling, "rope_dim": rope_dim}


# ---------------------------------------------------------------------------- state dicts
_LAYER_RE = re.compile(r"(?:^|\.)encoder\.layer\.(\d+)\.")
_BERT_NAMES = (
    ("q_proj", "attention.self.query"),
    ("k_proj", "attention.self.key"),
    ("v_proj", "attention.self.value"),
    ("out_proj", "attention.output.dense"),
)


def bert_layer_keys(layer: int, prefix: str = "") -> list[str]:
    """The eight state-dict names of layer ``layer``'s attention, e.g.
    ``encoder.layer.0.attention.self.query.weight``; ``prefix`` is ``""`` or ``"bert."``."""
    return [f"{prefix}encoder.layer.{layer}.{name}.{p}" for _, name in _BERT_NAMES for p in ("weight", "bias")]


def from_bert_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    layer: int,
    num_heads: int,
    *,
    prefix: Optional[str] = None,
    dropout: float = 0.0,
):
    """``(config, weights)`` of BERT layer ``layer``'s attention from a state dict (e.g.
    ``safetensors.torch.load_file``): ``MultiHeadAttention.from_config(*from_bert_state_dict(sd, 3, 12))``.

    Args:
        state_dict: names -> tensors, with ``encoder.layer.{i}.attention.self.{query,key,value}``
            and ``encoder.layer.{i}.attention.output.dense`` (``.weight`` (out, in), ``.bias``).
        layer: i, 0-based.
        num_heads: H (``num_attention_heads`` in the model's config.json; weights cannot tell it).
        prefix: the names' prefix; by default ``""`` or ``"bert."``, whichever the dict has.
        dropout: attention dropout of the returned module (used in training mode only).

    Returns:
        ``(AttentionConfig, weights)`` of a module (B, L, hidden) -> (B, L, hidden): the input of
        the layer's residual + LayerNorm. (``from_config`` returns it in training mode: call
        ``.eval()`` for inference if ``dropout`` > 0.)

    Raises:
        ValueError: missing names (listed), or sizes that do not fit ``num_heads``.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"state_dict must be a mapping of names to tensors, got {type(state_dict).__name__}; "
            "read a file with safetensors.torch.load_file(path)"
        )
    layer = check_positive_int(layer, "layer", allow_zero=True)
    num_heads = check_positive_int(num_heads, "num_heads")
    if prefix is None:
        candidates = ("", "bert.")
        prefix = next((p for p in candidates if all(k in state_dict for k in bert_layer_keys(layer, p))), "")
    missing = [k for k in bert_layer_keys(layer, prefix) if k not in state_dict]
    if missing:
        layers = sorted({int(m.group(1)) for k in state_dict if (m := _LAYER_RE.search(k))})
        have = f"the dict has layers {layers}" if layers else "the dict has no encoder.layer.* names"
        raise ValueError(f"state_dict lacks {', '.join(missing)} ({have}; prefix={prefix!r})")
    linears = {}
    for ours, name in _BERT_NAMES:
        base = f"{prefix}encoder.layer.{layer}.{name}"
        linears[ours] = (state_dict[f"{base}.weight"], state_dict[f"{base}.bias"])
    d_out = linears["q_proj"][0].shape[0]
    if d_out % num_heads:
        raise ValueError(f"the query projection has {d_out} outputs, not a multiple of num_heads={num_heads}")
    return _codec(linears, num_heads=num_heads, num_kv_heads=num_heads, causal=False, dropout=dropout)
