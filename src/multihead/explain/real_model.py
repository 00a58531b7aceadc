"""``multihead explain --model NAME|DIR``: what the heads of a real, trained model do on a sentence.

The model (:mod:`.models`: ``minilm``, a 6-layer BERT encoder; ``smollm2``, a 30-layer Llama
decoder with grouped-query attention and RoPE; or a directory transformers loads) runs in
transformers with its attention computed by :func:`multihead.attention`, every call recorded.
What is shown:

* the overview (default): the model's kind, read from the masks its layers passed (a decoder
  masks causally), its heads and key/value heads (which query heads share which kv head), its
  rotary embedding, and every head's pattern label (:mod:`.patterns`: computed from the weights
  and the mask with stated thresholds), with heat maps of the strongest heads;
* ``--layer L`` / ``--head H``: the heat maps of that layer / head;
* ``--token T``: the walkthrough of one real layer (``--layer``, default 0) for query token T of
  head ``--head`` (default 0): project, split, rotary, scores, scale, mask, softmax, weights × V,
  merge, output, with the model's sizes and the real numbers of the sentence;
* ``--neuron``: the neuron view of ``--layer`` (default 0), ``--head`` (default 0) and
  ``--token`` (default: the last token), :mod:`.neuron`; ``--format html`` writes it as a page.

Reusable pieces: :func:`attention_for_text` -- ``(tokens, weights (layers, H, L, L))``;
:func:`layer_maps` -- one :class:`~multihead.explain.visual.HeadMaps` per layer for
``--format html|png`` (:func:`command_visual`), opened at :func:`default_layer` (the layer with the
most labelled heads, the earliest on a tie).
"""

from __future__ import annotations

import importlib.util  # noqa: F401  (the tests patch importlib.util.find_spec through this module)
import functools
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from .. import steps
from .._numerics import is_default_scale
from ..trace import Trace
from .._progress import progress
from . import UsageError, check_out, write_output
from . import models as _models
from .i18n import word
from .long_input import long_maps, long_text, summary_fragment
from .models import LayerRecord, LongRun, ModelError, RealRun
from .patterns import PATTERNS, label_heads, pattern_name, pattern_scores
from .text_width import WIDTH, display_width, fit as _fit

__all__ = [
    "PATTERNS",
    "DEFAULT_TEXT",
    "attention_for_text",
    "pattern_scores",
    "label_heads",
    "render_heatmap",
    "default_layer",
    "layer_maps",
    "layer_walkthrough",
    "model_summary",
    "command",
    "command_visual",
    "ModelPage",
    "explain_model",
    "AttentionsPage",
    "explain_attentions",
]

DEFAULT_TEXT = "The animal didn't cross the street because it was too tired"



def _t(key: str, lang: str, **kw) -> str:
    return word("model." + key, lang, **kw)


# ---------------------------------------------------------------------------- the model
def attention_for_text(text: str, *, model: str = "minilm") -> tuple[list[str], torch.Tensor]:
    """Tokens and attention weights of ``model`` (a name of :data:`.models.MODELS` or a directory)
    on ``text``.

    Returns:
        ``(tokens, weights)``: the L tokens (with the model's special tokens, e.g. [CLS] and
        [SEP]), and weights (layers, H, L, L), float32 on the CPU; ``weights[l, h, i, j]`` is how
        much token i attends to token j in head h of layer l (rows sum to 1).

    Raises:
        ValueError: unknown ``model``, empty or too long ``text``.
        ImportError: the ``hf`` extra or the model's package is missing.
    """
    real = _models.load(model).run(text)
    return real.tokens, real.weights


def _scores_and_labels(real: RealRun):
    scores = pattern_scores(real.weights, real.keep)
    return scores, label_heads(scores)


# ---------------------------------------------------------------------------- rendering
_SHADES = ((0.05, "·"), (0.15, "░"), (0.35, "▒"), (0.60, "▓"), (float("inf"), "█"))


def _shade(x: float) -> str:
    return next(ch for limit, ch in _SHADES if x < limit)


def render_heatmap(tokens: list[str], w: torch.Tensor, title: str, *, top: int = 2,
                   keep: Optional[torch.Tensor] = None) -> list[str]:
    """Lines of a text heat map of one head, at most :data:`WIDTH` columns.

    w (L, L): rows = queries, one shaded cell per key (two characters wide up to 24 tokens; blank
    where ``keep`` (L, L) bool says the key is masked),
    then each row's ``top`` most attended keys with at least 0.05 of its weight, as ``j:token w``.
    Column numbers are the key positions, printed as a tens line and a units line.
    """
    L = len(tokens)
    cell = 2 if L <= 24 else 1
    pad = " " * 14  # "12 tokenname__"
    lines = [title]
    if L > 10:
        lines.append(pad + "".join((str(j // 10) if j >= 10 else " ").rjust(cell) for j in range(L)))
    lines.append(pad + "".join(str(j % 10).rjust(cell) for j in range(L)))
    for i, tok in enumerate(tokens):
        row = w[i]
        cells = "".join((_shade(float(x)) if keep is None or keep[i, j] else " ") * cell for j, x in enumerate(row))
        best = torch.topk(row, min(top, L))
        tops = ", ".join(f"{j}:{tokens[j]} {v:.2f}" for v, j in zip(best.values.tolist(), best.indices.tolist())
                         if v >= 0.05)
        lines.append(_fit(f"{i:>2} {tok[:10]:>10} " + cells + "  " + tops))
    return lines


def _token_list(tokens: list[str]) -> list[str]:
    lines, cur = [], ""
    for j, tok in enumerate(tokens):
        item = f"{j}:{tok}"
        if cur and len(cur) + 1 + len(item) > WIDTH - 2:
            lines.append("  " + cur)
            cur = item
        else:
            cur = f"{cur} {item}" if cur else item
    lines.append("  " + cur)
    return lines


def _head_title(layer: int, head: int, labels, scores, lang: str, tokens) -> str:
    p = labels[layer][head]
    name = pattern_name(p, lang, tokens)
    score = f" {float(scores[p.key][layer, head]):.2f}" if p is not None else ""
    return f"{_t('map_title', lang, layer=layer, head=head)} · {name}{score}"


def _scores_line(layer: int, head: int, scores, lang: str) -> str:
    parts = [f"{pattern_name(p, lang)} {float(scores[p.key][layer, head]):.2f}" for p in PATTERNS]
    return _fit(_t("scores", lang) + " " + " · ".join(parts))


def _grid(scores, labels, layers: list[int], heads: int, lang: str, tokens) -> list[str]:
    lines = [_t("grid", lang), "      " + "".join(f"{'H' + str(h):>6}" for h in range(heads))]
    for layer in layers:
        cells = []
        for h in range(heads):
            p = labels[layer][h]
            cells.append(f"{p.code}{float(scores[p.key][layer, h]):.2f}" if p is not None else "·")
        lines.append(f"  L{layer:<3}" + "".join(f"{c:>6}" for c in cells))
    items = [f"{p.code} = {pattern_name(p, lang, tokens)}" for p in PATTERNS]
    cur = f"  {_t('legend_codes', lang)}"
    for item in items:
        if display_width(cur + "  " + item) > WIDTH:
            lines.append(cur)
            cur = "   "
        cur += "  " + item
    lines.append(cur)
    lines += ["  " + part for part in _t("thresholds", lang).split("\n")]
    return lines


def _strongest(scores, labels, layers: list[int], heads: list[int]):
    """For each pattern present among the labels, the (layer, head) with the highest score."""
    found = []
    for p in PATTERNS:
        cands = [(float(scores[p.key][l, h]), l, h) for l in layers for h in heads if labels[l][h] is p]
        if cands:
            score, l, h = max(cands)
            found.append((p, l, h, score))
    return found


def model_summary(real: RealRun, lang: str = "en") -> list[str]:
    """Lines saying what the model is, as this run showed it (:mod:`.layer_attention`): each
    kind of layer's mask (causal, sliding window, local, chunked; "decoder"/"encoder" when every
    layer is alike), softcap, sinks, q/k norm, the scale where it is not 1/√D on the scores, its
    heads and key/value heads (which query heads share which kv head), its rotary embedding
    (per layer type where the config gives one per type)."""
    from .layer_attention import layer_words, lines as attention_lines

    info = real.info
    roles = [r.role for r in real.layers]
    if any(role != "self" for role in roles):   # an encoder-decoder: its three kinds of attention
        lines = [_t("encdec", lang)]
        for role in ("encoder", "decoder", "cross"):
            ids = [i for i, r in enumerate(roles) if r == role]
            if ids:
                kinds = attention_lines([real.layers[i].attention for i in ids], lang)
                what = kinds[0].split(": ", 1)[-1].split("：", 1)[-1] if len(kinds) == 1 or not kinds[1].startswith("  ") \
                    else _t("mixed", lang)
                lines.append("  " + _t("role_" + role, lang, which=layer_words(ids, lang), mask=what))
        found = attention_lines([r.attention for r in real.layers], lang)[1:]
        found = [x for x in found if not x.startswith("  ")]
        lines.append(_t("gqa", lang, kv=info.kv_heads, D=info.head_dim, groups="; ".join(
            _t("group", lang, j=j, qs=f"{g[0]}-{g[-1]}") for j, g in enumerate(info.kv_groups)))
            if info.kv_heads < info.heads else _t("mha", lang, heads=info.heads, D=info.head_dim))
        return [_fit(line) for line in lines + found]
    found = attention_lines([r.attention for r in real.layers], lang)
    lines = found[:1]
    if info.kv_heads < info.heads:
        groups = "; ".join(_t("group", lang, j=j, qs=f"{g[0]}-{g[-1]}") for j, g in enumerate(info.kv_groups))
        gqa = [_t("gqa", lang, kv=info.kv_heads, D=info.head_dim, groups=groups)]
    else:
        gqa = [_t("mha", lang, heads=info.heads, D=info.head_dim)]
    rest = found[1:]
    per_layer = [x for x in rest if x.startswith("  ")]
    lines += per_layer + gqa + [x for x in rest if not x.startswith("  ")]
    rope = info.rope
    if rope is not None and rope.get("base") is not None:
        lines.append(_t("rope", lang, type=rope["type"], base=float(rope["base"])))
    elif rope is not None and rope.get("per_type"):
        for kind, params in rope["per_type"].items():
            layers = [i for i, t in enumerate(rope.get("layer_types", ())) if t == kind]
            lines.append(_t("rope_type", lang, kind=kind, type=params.get("rope_type", "default"),
                            base=float(params.get("rope_theta") or 0.0), layers=", ".join(map(str, layers)) or "-"))
    return [_fit(line) for line in lines]


def _real(args) -> "RealRun | LongRun":
    """The run of ``args.text`` (default :data:`DEFAULT_TEXT`) through ``args.model``, every index
    option checked against the model and the sentence (UsageError; ImportError as UsageError);
    a :class:`~.models.LongRun` of the ``--token`` row (default the last few) past
    :data:`~.models.MAX_TOKENS` tokens."""
    text = DEFAULT_TEXT if args.text is None else args.text
    if not text.strip():
        raise UsageError("--text is empty; give a sentence, e.g. --text \"The cat sat on the mat\"")
    try:
        model = _models.load(args.model)
    except ImportError as e:
        raise UsageError(str(e)) from None
    _, ids = model.tokenize(text)  # a too long text is refused before the forward pass
    for flag, value, count, what in (("--layer", args.layer, model.info.layers, "layers"),
                                     ("--head", args.head, model.info.heads, "heads")):
        if value is not None and not 0 <= value < count:
            raise UsageError(f"{flag} {value} is out of range: {model.title} has {what} 0-{count - 1}")
    token = getattr(args, "token", None)
    if model.is_long(ids):
        if getattr(args, "neuron", False):
            raise UsageError(f"--neuron draws up to {_models.MAX_TOKENS} tokens; this text has {ids.shape[1]}: drop "
                             "--neuron (--token T then picks the query row shown) or shorten the text")
        with progress(f"running {model.title} on {ids.shape[1]} tokens"):
            return model.run_rows(text, None if token is None else [token])
    with progress(f"running {model.title}"):
        real = model.run(text)
    real.check_indices(token=token)
    return real


def command(args, stdout) -> int:
    """``multihead explain --model M [--text T] [--layer L] [--head H] [--token T | --neuron]
    [--lang zh] [--out FILE]``: the text report (``--format html|png`` go to :func:`command_visual`)."""
    lang = getattr(args, "lang", "en")
    fmt = getattr(args, "format", "text")
    if fmt != "text":
        raise UsageError(f"--model writes text, html or png; drop --format {fmt}")
    out = check_out(getattr(args, "out", None))
    real = _real(args)
    if isinstance(real, LongRun):
        write_output("\n".join(long_text(real, args.layer, args.head, lang)) + "\n", out, stdout)
        return 0
    if getattr(args, "neuron", False):
        from .neuron import neuron_view, render_text

        view = neuron_view(real, _or(args.layer, 0), _or(args.head, 0), _or(args.token, len(real.tokens) - 1))
        write_output(render_text(view, lang), out, stdout)
        return 0
    if getattr(args, "token", None) is not None:
        write_output("\n".join(layer_walkthrough(real, _or(args.layer, 0), _or(args.head, 0), args.token, lang))
                     + "\n", out, stdout)
        return 0
    info, tokens = real.info, real.tokens
    scores, labels = _scores_and_labels(real)
    keep = real.keep
    layers = list(range(info.layers)) if args.layer is None else [args.layer]
    heads = list(range(info.heads)) if args.head is None else [args.head]

    lines = [*_t("header", lang, model=info.title, layers=info.layers, heads=info.heads, n=len(tokens)).split("\n"),
             *model_summary(real, lang), _t("tokens", lang), *_token_list(tokens), ""]
    if args.head is None:
        lines += _grid(scores, labels, layers, info.heads, lang, tokens) + [""]
    if args.layer is None and args.head is None:
        found = _strongest(scores, labels, layers, heads)
        lines.append(_t("found", lang) if found else _t("none_found", lang))
        for p, l, h, score in found:
            lines.append("  " + _t("score_line", lang, label=pattern_name(p, lang, tokens), layer=l, head=h, score=score))
        shown = [(l, h) for _, l, h, _ in found]
    else:
        shown = [(l, h) for l in layers for h in heads]
    if shown:
        lines += ([] if lines[-1] == "" else [""]) + _t("shades", lang).split("\n")
    weights = real.weights
    for l, h in shown:
        lines.append("")
        lines += render_heatmap(tokens, weights[l, h], _head_title(l, h, labels, scores, lang, tokens),
                                top=3 if len(shown) == 1 else 2, keep=keep[l, h])
        lines.append(_scores_line(l, h, scores, lang))
    write_output("\n".join(lines) + "\n", out, stdout)
    return 0


def _or(value: Optional[int], default: int) -> int:
    return default if value is None else value


# ---------------------------------------------------------------------------- one real layer
def _mask_params(a) -> dict:
    """The mask step's params for a layer whose attention is ``a`` (:class:`.layer_attention.LayerAttention`)."""
    parts: tuple[dict, ...]
    if a.mask == "causal":
        parts, code = ({"kind": "causal"},), "masks.causal()"
    elif a.mask == "window":
        parts, code = ({"kind": "window", "left": a.window - 1, "right": 0},), f"masks.window({a.window - 1})"
    elif a.mask == "local":
        parts, code = ({"kind": "window", "left": a.window - 1, "right": a.window - 1},), \
            f"masks.window({a.window - 1}, {a.window - 1})"
    elif a.mask == "chunked":
        parts, code = ({"kind": "causal"}, {"kind": "chunked_local", "chunk": a.chunk}), \
            f"masks.causal() & masks.chunked_local({a.chunk})"
    else:
        parts, code = ({"kind": "keep"},), "masks.keep(mask)"
    return {"kinds": tuple(p["kind"] for p in parts), "parts": parts, "sink": a.sinks is not None, "code": code}


def layer_trace(real: RealRun, layer: int) -> Trace:
    """The steps of ``layer`` on the sentence, recorded through the step catalogue
    (:mod:`multihead.steps`) with the tensors the model computed (batch 1), as the layer's
    description (:mod:`.layer_attention`) says it ran them: input, the Q/K/V projections, the
    scale folded into q (OPT, BART), the head split and transpose, the q/k norm (Qwen 3), the
    rotary embedding with the model's own cos/sin (in the steps' ``extras``; partial when it
    turns fewer than D dims), the kv heads repeated for grouped-query attention, multihead's
    scores, the layer's scale, the softcap (Gemma 2), the mask (causal, window, local, chunked),
    the sinks (gpt-oss), the softmax, weights × V, the merge and the output projection. Each
    step follows from the one before (:func:`multihead.explain.checks.chain_checks`).

    The trace's root is the model, so each step carries the layer's module path and index.
    Raises ValueError for ``layer`` out of range, or a layer whose input multihead did not record
    (an attention layout other than BERT's, Llama's or OPT's).
    """
    real.check_indices(layer=layer)
    rec, info = real.layers[layer], real.info
    a = rec.attention
    if rec.hidden is None or rec.q_proj is None or rec.k_proj is None:
        raise ModelError(f"--token: {info.title}'s attention layout is not BERT's, Llama's or OPT's, so its "
                         "projections were not recorded; use --neuron, which needs only q, k and v")
    if rec.cos is None and real.net is not None and _rotary_missing(rec):
        raise ModelError(f"--token: layer {layer} of {info.title} changes q between its projection and the attention "
                         "call in a way the step catalogue cannot show (no rotary layout reproduces it); use --neuron")
    H, Hkv, L, D = rec.q.shape[0], rec.k.shape[0], rec.q.shape[1], rec.q.shape[-1]
    d = rec.hidden.shape[-1]
    tr = Trace(root=real.net)
    tr.set_config(d_in=d, kdim=d, d_out=H * D, num_heads=H, num_kv_heads=Hkv, head_dim=D, dropout=0.0,
                  causal=a.causal, bias=rec.module_bias, rope=rec.cos is not None, backend="reference")
    b = rec.module_bias
    tr.record(steps.INPUT, rec.hidden[None], module=rec.module)
    q_heads = rec.q_proj if a.q_scale is None else rec.q_proj * a.q_scale
    heads = {"Q": rec.q_proj, "K": rec.k_proj, "V": rec.v}
    for role, t in heads.items():
        tr.record(steps.PROJECT, t.transpose(0, 1).reshape(1, L, -1), role=role,
                  params={"f_in": d, "bias": b, "fused": None})
    if a.q_scale is not None:
        tr.record(steps.SCALE_Q, q_heads.transpose(0, 1).reshape(1, L, -1), role="Q",
                  params={"scale": a.q_scale, "head_dim": D})
    heads["Q"] = q_heads
    for role, t in heads.items():
        split = t.transpose(0, 1)[None]
        tr.record(steps.SPLIT_HEADS, split, role=role)
        tr.record(steps.MOVE_HEADS_FORWARD, t[None], role=role)
    if rec.q_normed is not None and rec.k_normed is not None:
        for role, t in (("Q", rec.q_normed), ("K", rec.k_normed)):
            tr.record(steps.QK_NORM, t[None], role=role)
    if rec.cos is not None and rec.sin is not None:
        base = float(_rope_base(info.rope, layer, real) or 0.0)
        for role, t in (("Q", rec.q), ("K", rec.k)):
            tr.record(steps.ROPE, t[None], role=role,
                      params={"positions": "offset", "start": 0, "stop": L - 1, "base": base,
                              "rotary_dim": rec.cos.shape[-1], "head_dim": D},
                      extras={"cos": rec.cos, "sin": rec.sin})
    g = H // Hkv
    if g > 1:
        for role, t in (("K", rec.k), ("V", rec.v)):
            tr.record(steps.REPEAT_KV, t.repeat_interleave(g, 0)[None], role=role, params={"groups": g})
    tr.record(steps.SCORES, rec.scores[None], params={"head_dim": D})
    scaled = rec.scores
    if a.q_scale is None or rec.scale != 1.0:
        scaled = rec.scores * rec.scale
        tr.record(steps.SCALE, scaled[None], params={"scale": rec.scale, "head_dim": D,
                                                     "default": is_default_scale(rec.scale, D)})
    if a.softcap is not None:
        scaled = a.softcap * torch.tanh(scaled / a.softcap)
        tr.record(steps.SCORE_MOD, scaled[None], params={"kinds": ("softcap",),
                                                         "parts": ({"kind": "softcap", "cap": a.softcap},)})
    if rec.bias is not None:
        scaled = scaled + rec.bias
        tr.record(steps.ADD_BIAS, scaled[None])
    if not bool(rec.keep.all()):
        scaled = scaled.masked_fill(~rec.keep, float("-inf"))
        tr.record(steps.MASK, scaled[None], params=_mask_params(a), extras={"keep": rec.keep[None]})
    if a.sinks is not None:
        tr.record(steps.SINK, scaled[None], params={"logits": list(a.sinks)})
    tr.record(steps.SOFTMAX, rec.weights[None], params={"sink": True} if a.sinks is not None else None)
    tr.record(steps.WEIGHTED_SUM, rec.out[None], params={"lk": L})
    back = rec.out.transpose(0, 1)[None]
    tr.record(steps.MOVE_HEADS_BACK, back)
    tr.record(steps.MERGE_HEADS, back.reshape(1, L, -1), params={"view": False})
    if rec.output is not None:
        tr.record(steps.OUTPUT_PROJECTION, rec.output[None], params={"f_in": H * rec.out.shape[-1], "bias": b})
    return tr


def _rotary_missing(rec) -> bool:
    """Whether the layer's q differs from its (normed) projection although no rotary layout was found."""
    before = rec.q_normed if rec.q_normed is not None else rec.q_proj
    if rec.attention.q_scale is not None:
        return False
    return not torch.equal(before, rec.q)


def _rope_base(rope, layer: int, real: RealRun):
    """The rotary base of ``layer``: the config's, or its layer type's (ModernBERT, Gemma 3)."""
    if not rope:
        return None
    if rope.get("base") is not None:
        return rope["base"]
    per = rope.get("per_type") or {}
    types = rope.get("layer_types") or ()
    if layer < len(types) and types[layer] in per:
        return per[types[layer]].get("rope_theta")
    return None


def _w(key: str, lang: str, **kw) -> str:
    return word("model.walk." + key, lang, **kw)


def _vec(t: torch.Tensor, n: int) -> str:
    more = " …" if t.shape[-1] > n else ""
    return "   " + " ".join(f"{x:+.3f}" for x in t[:n].tolist()) + more


def layer_walkthrough(real: RealRun, layer: int, head: int, token: int, lang: str = "en", *, n: int = 8) -> list[str]:
    """The tutorial's steps on one real layer (:func:`layer_trace`, titled by the step
    catalogue), with the model's sizes and, for query ``token`` of ``head``, the numbers of the
    sentence (vectors: their first ``n`` numbers; the scores, the mask and the weights: the whole row).

    Raises ValueError (naming ``--layer``/``--head``/``--token`` and the range) for an index out
    of range.
    """
    real.check_indices(layer=layer, head=head, token=token)
    tr = layer_trace(real, layer)
    tokens, info = real.tokens, real.info
    t, tok = token, tokens[token]
    H, Hkv, D = tr.config["num_heads"], tr.config["num_kv_heads"], tr.config["head_dim"]
    kv = head // (H // Hkv)
    path = tr.steps[0].path or type(real.layers[layer].module).__name__
    out = [_fit(_w("title", lang, model=info.title, layer=layer, head=head, token=t, tok=tok)),
           _fit(_w("sizes", lang, L=len(tokens), d=tr.config["d_in"], H=H, Hkv=Hkv, D=D)),
           _fit(_w("first", lang, n=n, path=path)), ""]
    for i, step in enumerate(tr.steps, start=1):
        x = step.tensor
        assert x is not None
        shape = "(" + ", ".join(map(str, step.shape)) + ")"
        pattern = f"  '{step.pattern}'" if step.pattern else ""
        out.append(_fit(f"{i:>2}. {step.title(lang)}  {shape}{pattern}"))
        k = step.kind
        if k is steps.INPUT or (k is steps.OUTPUT_PROJECTION):
            out.append(f"   [{t}] " + _vec(x[0, t], n)[3:])
        elif k is steps.PROJECT and step.role == "Q":
            out.append(f"   [{t}] " + _vec(x[0, t], n)[3:])
        elif k is steps.MOVE_HEADS_FORWARD and step.role == "Q":
            out.append(f"   [{head}, {t}] " + _vec(x[0, head, t], n)[3:])
        elif k is steps.ROPE and step.role == "Q":
            r = step.extras["cos"].shape[-1]
            out += [_fit(_w("rotary", lang, t=t) if r == D else _w("rotary_partial", lang, t=t, r=r, D=D)),
                    "   cos" + _vec(step.extras["cos"][t], n)[2:],
                    "   sin" + _vec(step.extras["sin"][t], n)[2:], f"   q[{head}, {t}] " + _vec(x[0, head, t], n)[3:]]
        elif k is steps.REPEAT_KV and step.role == "K":
            group = ", ".join(map(str, info.kv_groups[kv])) if info.kv_heads == Hkv else str(kv)
            out.append(_fit(_w("group", lang, head=head, kv=kv, group=group)))
        elif k is steps.QK_NORM and step.role == "Q":
            out.append(f"   [{head}, {t}] " + _vec(x[0, head, t], n)[3:])
        elif k is steps.SCALE_Q:
            out.append(_fit(_w("scale_q", lang, s=step.params["scale"], t=t)))
            out.append(f"   [{t}] " + _vec(x[0, t], n)[3:])
        elif k is steps.SINK:
            logit = float(step.params["logits"][head])
            weights = tr.steps[i].tensor   # the softmax, the step after this one
            assert weights is not None
            taken = 1 - float(weights[0, head, t].sum())
            out.append(_fit(_w("sink", lang, head=head, logit=logit, t=t, taken=taken)))
        elif k in (steps.SCORES, steps.SCALE, steps.SCORE_MOD, steps.SOFTMAX):
            out.append(_w("row", lang, t=t, tok=tok))
            row = x[0, head, t]
            for j, key in enumerate(tokens):
                v = row[j].item()
                bar = " " + "█" * round(v * 40) if k is steps.SOFTMAX else ""
                out.append(f"   {j:>2} {key[:12]:<12} {v:+10.4f}{bar}")
        elif k is steps.MASK:
            out += [_w("mask_row", lang, t=t), "   " + " ".join(str(int(b)) for b in step.extras["keep"][0, head, t])]
        elif k is steps.WEIGHTED_SUM:
            out.append(f"   [{head}, {t}] " + _vec(x[0, head, t], n)[3:])
    if tr.steps[-1].kind is not steps.OUTPUT_PROJECTION:
        out.append(_w("no_output", lang))
    return [line.rstrip() for line in out]


# ---------------------------------------------------------------------------- html and png
def default_layer(labels) -> int:
    """The layer with the most labelled heads (the earliest on a tie); ``labels`` from
    :func:`label_heads` of (layers, H) scores."""
    counts = [sum(p is not None for p in heads) for heads in labels]
    return counts.index(max(counts))


def layer_maps(tokens: list[str], weights: torch.Tensor, *, model: str = "minilm", text: str = "",
               lang: str = "en", keep: Optional[torch.Tensor] = None, title: Optional[str] = None,
               layers: Optional[Sequence[LayerRecord]] = None,
               operand_layers: Optional[Sequence[int]] = None) -> list:
    """One :class:`~multihead.explain.visual.HeadMaps` per layer, for the visual formats.

    weights: (layers, H, L, L) from :func:`attention_for_text`; ``tokens`` label both axes; keep:
    (layers, H, L, L) bool, the masks (None: all visible). Each head is labelled with its pattern
    (:func:`label_heads`) and that pattern's score, in English and Chinese; the title names the
    model (``title``, default the registry's name of ``model``), the layer and ``text`` (in ``lang``).

    layers: the run's :class:`~multihead.explain.models.LayerRecord` per layer (``RealRun.layers``),
    or None. With them each map also carries the scaled scores (scale × the q kᵀ multihead
    computed) and their operands, the queries (H, L, D) and the keys per kv head (Hkv, L, D) the
    layer passed to the attention function (after the rotary embedding for a Llama-family model),
    with the scale, so the page works the score under the pointer out by hand. A layer that adds
    a bias to its scores gets no operands (q·k × scale is not its score). A layer that caps its
    scores (softcap) or has sinks carries them, and its scores are the capped ones (what the
    softmax read). operand_layers: the layers whose scores, q and k are embedded (None: every
    layer); the notebook cell embeds only the layer it opens at, which keeps the cell lighter.
    """
    from .visual import HeadMaps

    if layers is not None and len(layers) != weights.shape[0]:
        raise ValueError(f"layers has {len(layers)} records but weights have {weights.shape[0]} layers")

    scores = pattern_scores(weights, keep)
    labels = label_heads(scores)
    name = title or (_models.MODELS[model].title if model in _models.MODELS else model)

    def head_label(layer: int, head: int, lang_: str) -> str:
        p = labels[layer][head]
        return pattern_name(p, lang_, tokens) + (f" {float(scores[p.key][layer, head]):.2f}" if p is not None else "")

    def operands(layer: int) -> dict:
        if layers is None:
            return {}
        rec = layers[layer]
        a = rec.attention
        scaled = rec.scores.float() * rec.scale
        extra: dict = {}
        if a is not None and a.softcap is not None:
            scaled = a.softcap * torch.tanh(scaled / a.softcap)
            extra["softcap"] = a.softcap
        if a is not None and a.sinks is not None:
            extra["sink"] = list(a.sinks)
        if rec.bias is not None:
            return {"scores": scaled + rec.bias, **extra}
        if operand_layers is not None and layer not in operand_layers:
            return extra   # the notebook cell: weights only, away from the layer it opens at
        return {"scores": scaled, "q": rec.q.float(), "k": rec.k.float(), "scale": rec.scale, **extra}

    return [
        HeadMaps(
            weights[layer], q_tokens=list(tokens), k_tokens=list(tokens),
            title=_t("layer_title", lang, model=name, layer=layer, text=text) + _role_title(layers, layer, lang),
            keep=None if keep is None or bool(keep[layer].all()) else keep[layer],
            head_labels={lg: [head_label(layer, h, lg) for h in range(weights.shape[1])] for lg in ("en", "zh")},
            **operands(layer),
        )
        for layer in range(weights.shape[0])
    ]


def _role_title(layers: Optional[Sequence[LayerRecord]], layer: int, lang: str) -> str:
    """" · cross-attention (decoder → encoder)" and the like for an encoder-decoder's layers, else ""."""
    if layers is None or layers[layer].role == "self":
        return ""
    return " · " + _t("title_" + layers[layer].role, lang)


def _page_parts(real: RealRun, *, model: str, layer: Optional[int], head: Optional[int], neuron: bool,
                token: Optional[int], lang: str, operand_layers=lambda start: None) -> tuple[list, list, int, int]:
    """``(maps, fragments, layer, head)`` of a real model's page: every layer's maps with the
    operands of the worked score (:func:`layer_maps`), the neuron view as a fragment when asked
    (of ``layer``/``head``, default 0, and ``token``, default the last), and the layer (default
    :func:`default_layer`) and head (default 0) shown first."""
    real.check_indices(layer=layer, head=head, token=token)
    fragments = []
    if neuron:
        from .neuron import neuron_fragment, neuron_view

        view = neuron_view(real, _or(layer, 0), _or(head, 0), _or(token, len(real.tokens) - 1))
        fragments.append(neuron_fragment(view))
    weights = real.weights
    keep = real.keep
    start = default_layer(label_heads(pattern_scores(weights, keep))) if layer is None else layer
    maps = layer_maps(real.tokens, weights, model=model, text=real.text, lang=lang, keep=keep,
                      title=real.info.title, layers=real.layers, operand_layers=operand_layers(start))
    return maps, fragments, start, _or(head, 0)


def command_visual(args, stdout) -> int:
    """``multihead explain --model M [--text T] [--layer L] --format html|png --out FILE``.

    html: one page with every layer's heads (a layer selector), opened at ``--layer`` (default
    :func:`default_layer`) and ``--head`` (default 0), the score under the pointer worked out
    from the layer's q and k; with ``--neuron``, the neuron view of ``--layer``/``--head``
    (default 0) and ``--token`` (default the last) as a section of it. png: the heads of that
    layer in a grid; ``--head`` is refused there, since the grid shows every head.
    """
    from . import visual

    out = visual.prepare(args, stdout)
    neuron = getattr(args, "neuron", False)
    if args.format == "png" and (args.head is not None or neuron):
        flag = "--neuron" if neuron else "--head"
        raise UsageError(f"--format png draws every head of the layer; drop {flag} (or use --format html)")
    real = _real(args)
    if getattr(args, "token", None) is not None and not neuron and not isinstance(real, LongRun):
        raise UsageError("--token without --neuron is the layer walkthrough, which --format text shows; "
                         "drop --format or add --neuron")
    if isinstance(real, LongRun):
        if args.format == "png":
            raise UsageError(f"--format png draws every cell of (L, L) maps, up to {_models.MAX_TOKENS} tokens; this "
                             f"text has {len(real.tokens)}: use --format html or text")
        page = _render_long(real, model=args.model, layer=args.layer, head=args.head, lang=args.lang)
        write_output(page, out, stdout)
        if out is not None:
            print(word("wrote", args.lang, path=out, kib=out.stat().st_size // 1024 + 1), file=stdout)
        return 0
    with progress(f"drawing {real.info.title}'s {args.format}", total=2) as bar:
        maps, fragments, layer, head = _page_parts(real, model=args.model, layer=args.layer, head=args.head,
                                                   neuron=neuron, token=getattr(args, "token", None), lang=args.lang)
        bar.update()
        written = visual.write(args, out, None, maps, stdout, group="layer", start=layer, head=head,
                               fragments=fragments)
        bar.update()
    return written


@dataclass(frozen=True, repr=False)
class ModelPage:
    """A real model's explain page, for Python and notebooks (:func:`explain_model`).

    run: the :class:`~multihead.explain.models.RealRun` shown; page: the whole HTML page (what
    ``multihead explain --model ... --format html`` writes: every layer's q and k for the worked
    score). In Jupyter it displays inline (``_repr_html_``: a lighter page, with the scores, q and k
    and exact weights only for the layer it opens at (the others' weights to 1/255), in a sandboxed ``<iframe srcdoc>``, :mod:`.notebook`, so its CSS and
    language switch stay out of the notebook).
    """

    run: "RealRun | LongRun"
    page: str
    options: dict = field(default_factory=dict, repr=False, compare=False)

    def html(self) -> str:
        """The page, to write to a file."""
        return self.page

    @functools.cached_property
    def notebook_page(self) -> str:
        """The page with the scores, q and k (the worked score's operands) and the exact weights
        of the opening layer only, the other layers' weights one byte each and their masks as
        bits (:func:`.visual.weights8`); a long text's page as it is (it holds one layer's rows)."""
        if isinstance(self.run, LongRun):
            return self.page
        return _render(self.run, light=True, **self.options)

    def _repr_html_(self) -> str:
        from .notebook import iframe

        return iframe(self.notebook_page, title=f"multihead: {self.run.info.title}")

    def __repr__(self) -> str:
        """One line (the page itself is about a megabyte for a 30-layer model)."""
        info = self.run.info
        return (f"<multihead.ModelPage: {info.title}, {info.layers} layers x {info.heads} heads, "
                f"{len(self.run.tokens)} tokens, a {len(self.page) // 1000:,} kB page; .html(), .run>")


def _render_long(real: LongRun, *, model: str, layer: Optional[int], head: Optional[int], lang: str) -> str:
    """A long text's page: the chosen rows of ``layer`` (default 0) per head, opened at ``head``
    (default 0), and every layer x head's summary (:mod:`.long_input`)."""
    from . import visual
    real.check_indices(layer=layer, head=head)
    maps = long_maps(real, _or(layer, 0), model=model, lang=lang)
    return visual.render_html(None, maps, lang=lang, group="layer", start=0, head=_or(head, 0),
                              fragments=[summary_fragment(real)])


def _render(real: RealRun, *, model: str, layer: Optional[int], head: Optional[int], neuron: bool,
            token: Optional[int], lang: str, light: bool = False) -> str:
    from . import visual

    maps, fragments, start, first = _page_parts(real, model=model, layer=layer, head=head, neuron=neuron,
                                                token=token, lang=lang,
                                                operand_layers=(lambda s: [s]) if light else (lambda s: None))
    return visual.render_html(None, maps, lang=lang, group="layer", start=start, head=first, fragments=fragments,
                              exact=[start] if light else None)


def explain_model(model: Any, text: str = DEFAULT_TEXT, *, layer: Optional[int] = None,
                  head: Optional[int] = None, neuron: bool = False, token: Optional[int] = None,
                  lang: str = "en", rows: Optional[list[int]] = None) -> ModelPage:
    """``model`` on ``text``, as the page ``multihead explain --model`` draws: every layer x head,
    the worked score on hover, and with ``neuron=True`` the neuron view of ``layer``/``head``
    (default 0) and ``token`` (default the last) as a section.

    A text past :data:`~.models.MAX_TOKENS` tokens (up to the model's
    :attr:`~.models.RealModel.max_tokens`) gets the page of :mod:`.long_input`: the query
    ``rows`` (default the last few) of ``layer`` (default 0), their weights recomputed from the
    log-sum-exp in O(L) memory, and every head's summary; ``neuron`` is refused there.

    ``model``: ``"minilm"``, ``"smollm2"``, a directory transformers loads, or a
    ``(model, tokenizer)`` pair already loaded (e.g. by
    :func:`multihead.integrations.transformers.load`; run in eval mode on multihead's recording
    attention, its own attention implementation restored afterwards).

    Raises:
        ValueError: unknown model, empty or too long text, an index out of range, an unknown lang.
        TypeError: an index that is not an int, or ``neuron`` not a bool.
        ImportError: the ``hf`` extra or the model's package is missing.
    """
    if lang not in ("en", "zh"):
        raise ValueError(f"lang must be 'en' or 'zh', got {lang!r}")
    if not isinstance(neuron, bool):
        raise TypeError(f"neuron must be True or False, got {type(neuron).__name__}")
    if token is not None and not neuron:
        raise ValueError("token picks the query of the neuron view: pass neuron=True with it")
    if isinstance(model, tuple) and len(model) == 2:
        loaded = _models.wrap(*model)
        model = loaded.name
    elif isinstance(model, str):
        loaded = _models.load(model)
    else:
        raise TypeError(f"model must be a name ({', '.join(_models.MODELS)}), a directory, or a (model, tokenizer) "
                        f"pair, got {type(model).__name__}")
    _, ids = loaded.tokenize(text)  # a too long text is refused before the forward pass
    for name, value, count, what in (("layer", layer, loaded.info.layers, "layers"),
                                     ("head", head, loaded.info.heads, "heads")):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if not 0 <= value < count:
            raise ValueError(f"{name} {value} is out of range: {loaded.title} has {what} 0-{count - 1}")
    if loaded.is_long(ids):
        if neuron:
            raise ValueError(f"neuron=True draws up to {_models.MAX_TOKENS} tokens; this text has {ids.shape[1]}: "
                             "pass rows=[...] to choose the query rows shown, or shorten the text")
        if token is not None and (isinstance(token, bool) or not isinstance(token, int)):
            raise TypeError(f"token must be an int, got {type(token).__name__}")
        with progress(f"explaining {loaded.title} on {ids.shape[1]} tokens", total=2) as bar:
            long = loaded.run_rows(text, rows)
            bar.update(note="page")
            page = _render_long(long, model=model, layer=layer, head=head, lang=lang)
            bar.update()
        return ModelPage(long, page, dict(model=model, layer=layer, head=head, lang=lang))
    if rows is not None:
        raise ValueError(f"rows picks the query rows of a text past {_models.MAX_TOKENS} tokens; this one has "
                         f"{ids.shape[1]}, whose page shows every row: drop rows")
    options: dict = dict(model=model, layer=layer, head=head, neuron=neuron, token=token, lang=lang)
    with progress(f"explaining {loaded.title}", total=2) as bar:
        real = loaded.run(text)
        bar.update(note="page")
        page = _render(real, **options)
        bar.update()
    return ModelPage(real, page, options)

@dataclass(frozen=True, repr=False)
class AttentionsPage:
    """The page of attention weights some model computed (:func:`explain_attentions`): every
    layer x head with its pattern label, without the worked scores (weights carry no q and k)."""

    tokens: tuple[str, ...]
    weights: torch.Tensor   # (layers, H, L, L)
    page: str

    def html(self) -> str:
        """The page, to write to a file."""
        return self.page

    def _repr_html_(self) -> str:
        from .notebook import iframe

        return iframe(self.page, title="multihead: attention weights")

    def __repr__(self) -> str:
        layers, heads, L = self.weights.shape[:3]
        return (f"<multihead.AttentionsPage: {layers} layers x {heads} heads, {L} tokens, "
                f"a {len(self.page) // 1000:,} kB page; .html()>")


def explain_attentions(attentions: Any, tokens: Sequence[str], *, title: str = "attention",
                       layer: Optional[int] = None, head: Optional[int] = None, lang: str = "en") -> AttentionsPage:
    """The page of ``outputs.attentions`` (a transformers model run with ``output_attentions=True``,
    any attention implementation) for ``tokens``, as bertviz's ``head_view(attention, tokens)``
    takes them: every layer x head, labelled with its pattern.

    Args:
        attentions: one (1, H, L, L) tensor per layer (``outputs.attentions``), or a
            (layers, H, L, L) tensor; batch element 0 is shown.
        tokens: the L tokens (``tokenizer.convert_ids_to_tokens(ids[0])``); space markers are
            drawn as ``␣``.
        layer: the layer shown first (default: the one with the most labelled heads).
        head: the head shown first (default 0).

    A key whose weight is 0 in every row of a head is still drawn as visible: the weights do not
    say what the mask was (explain_model, which records the mask, does).
    """
    from . import visual

    if lang not in ("en", "zh"):
        raise ValueError(f"lang must be 'en' or 'zh', got {lang!r}")
    if isinstance(attentions, (list, tuple)):
        if not attentions or not all(isinstance(a, torch.Tensor) and a.dim() == 4 for a in attentions):
            raise TypeError("attentions must be outputs.attentions: a tuple of (B, H, L, L) tensors, one per layer")
        weights = torch.stack([a[0] for a in attentions])
    elif isinstance(attentions, torch.Tensor) and attentions.dim() == 4:
        weights = attentions
    else:
        raise TypeError(f"attentions must be outputs.attentions (a tuple of (B, H, L, L) tensors) or a "
                        f"(layers, H, L, L) tensor, got {type(attentions).__name__}")
    weights = weights.detach().float().cpu()
    L = weights.shape[-1]
    tokens = [_models.shown(str(t)) for t in tokens]
    if weights.shape[-2] != L or len(tokens) != L:
        raise ValueError(f"attentions are {tuple(weights.shape[-2:])} per head but tokens has {len(tokens)}; "
                         "pass the tokens of the same input")
    for name, value, count in (("layer", layer, weights.shape[0]), ("head", head, weights.shape[1])):
        if value is not None and not (isinstance(value, int) and 0 <= value < count):
            raise ValueError(f"{name} {value!r} is out of range: the attentions have {count} {name}s (0-{count - 1})")
    maps = layer_maps(tokens, weights, model=title, lang=lang, title=title)
    start = default_layer(label_heads(pattern_scores(weights, None))) if layer is None else layer
    page = visual.render_html(None, maps, lang=lang, group="layer", start=start, head=_or(head, 0))
    return AttentionsPage(tuple(tokens), weights, page)
