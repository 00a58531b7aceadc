"""One real layer as the walkthrough tells it: its steps recorded through the step catalogue with
the tensors the model computed (`layer_trace`), and the text of one head and query token through
them (`layer_walkthrough`, ``multihead explain --model M --token T``).

Shapes (one sentence, batch 1 dropped): L tokens, H query heads, Hkv key/value heads, D head dim,
d the hidden size.
"""

from __future__ import annotations

import torch

from .. import steps
from .._numerics import is_default_scale
from ..trace import Trace
from .i18n import word
from .model_text import _fit
from .records import ModelError, RealRun

__all__ = ["layer_trace", "layer_walkthrough"]


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
