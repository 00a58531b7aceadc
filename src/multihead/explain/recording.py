"""A real model run with its attention recorded: `RealModel` runs a transformers model whose
attention layers call multihead's attention through ``transformers.AttentionInterface``, and
keeps what each call passed and computed (`multihead.explain.records`).

The attention entry (``_NAME``) wraps
:func:`~multihead.integrations.transformers.attention_forward`: while a run is active
(``_state.rec``, per thread) each call is recorded: the q, k, v the layer passed (after its
rotary embedding, if any), the mask it let through, the scale, the scores q kᵀ and the weights
multihead computed; forward pre-hooks keep each layer's input and rotary tables. A long text's
run records the weights of chosen query rows only, from the chunked backend's log-sum-exp.

Shapes (one sentence, batch 1 dropped): L tokens, H query heads, Hkv key/value heads, D head dim,
d the hidden size.
"""

from __future__ import annotations

import functools
import threading
import warnings
from typing import Any, Optional, cast

import torch

from .. import steps
from .._numerics import default_scale
from ..functional import attention_weights
from ..hf import has_linears, is_linear
from ..trace import trace
from . import ExplainWarning
from .layer_attention import describe
from .records import LayerRecord, LongRun, ModelError, ModelInfo, RealRun, RowsRecord

__all__ = ["MAX_TOKENS", "LONG_MAX_TOKENS", "LONG_ROWS", "RealModel", "shown", "SPACE", "ROLES"]

#: the longest sentence (in tokens) the views lay out whole: every layer's (L, L) weights of every head
MAX_TOKENS = 60
#: the longest text (in tokens) explain takes: past MAX_TOKENS it shows chosen query rows, their
#: weights recomputed from the log-sum-exp (O(L) memory per head and row), and a per-head summary;
#: past this the forward pass itself (the model's MLPs, on the CPU) is what takes the time
LONG_MAX_TOKENS = 4096
#: how many query rows a long text shows when none is chosen: its last tokens
LONG_ROWS = 4
_NAME = "multihead_explain"  # the AttentionInterface entry of the recording wrapper


#: what a token's leading space is drawn as
SPACE = "␣"


def shown(token: str) -> str:
    """``token`` as the views print it: the space markers of byte-level BPE (GPT-2, Llama 3,
    SmolLM2: ``Ġ``) and SentencePiece (``▁``) drawn as a visible space, ``␣``."""
    return token.replace("Ġ", SPACE).replace("▁", SPACE)


_state = threading.local()


def _recording() -> Optional[dict[str, Any]]:
    return getattr(_state, "rec", None)


def _recorded_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None, dropout: float = 0.0,
                        is_causal: Optional[bool] = None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """:func:`multihead.integrations.transformers.attention_forward` with ``output_attentions``,
    recording its inputs and results when a :meth:`RealModel.run` is active."""
    # imported here, not at the top: importing the integration imports transformers (the optional
    # ``hf`` extra, seconds), which only a model's run needs
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
    for s in tr.steps:
        if s.kind is steps.SCORES and s.tensor is not None:
            return cast(torch.Tensor, s.tensor)
    raise ModelError("the attention call recorded no scores step; multihead's reference backend did not run")


def _attention_modules(net: Any) -> list[tuple[Any, str, Any]]:
    """(module, family, output projection or None) of every attention layer whose projections
    multihead knows: Llama-family (q_proj, k_proj, v_proj, o_proj), OPT/BART-family (q_proj, k_proj,
    v_proj, out_proj) and BERT-family
    (query, key, value; the output projection is the parent's ``output.dense``)."""
    found = []
    for name, m in net.named_modules():
        if has_linears(m, ("q_proj", "k_proj", "v_proj", "o_proj")):
            found.append((m, "llama", m.o_proj))
        elif has_linears(m, ("q_proj", "k_proj", "v_proj", "out_proj")):
            found.append((m, "opt", m.out_proj))
        elif has_linears(m, ("query", "key", "value")):
            parent = net.get_submodule(name.rsplit(".", 1)[0]) if "." in name else net
            dense = getattr(getattr(parent, "output", None), "dense", None)
            found.append((m, "bert", dense if is_linear(dense) else None))
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

    def __init__(self, name: str, title: str, tokenizer: Any, net: Any, *, language: Optional[str] = None):
        self.name, self.title, self.tokenizer, self.net = name, title, tokenizer, net.eval()
        #: the language the vocabulary was trained on (named in the unknown-token warning), if known
        self.language = language
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
            warnings.warn(ExplainWarning(
                f"text: {unknown} of {len(tokens)} tokens are {unk}: the {self.title} vocabulary cannot represent "
                "them, so their rows and columns say nothing about the words; use text in the model's language"
                + (f" ({self.language} for {self.name})" if self.language else "")), stacklevel=3)

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
