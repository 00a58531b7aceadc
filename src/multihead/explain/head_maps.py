"""What the pictures of attention are drawn from, whatever the source: `HeadMaps`, one batch
element's (or one layer's) attention head by head, and the maps read off a `multihead.Trace`
recorded with values (`head_maps_from_trace`, from the steps `attention_steps` finds).

Legend: H query heads, Hkv key/value heads, Lq/Lk query/key lengths, D head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .. import steps
from ..trace import Step, Trace
from . import visual_text as _text

__all__ = ["HeadMaps", "AttentionSteps", "attention_steps", "head_maps_from_trace"]


@dataclass
class HeadMaps:
    """The attention of one batch element, head by head.

    weights: (H, Lq, Lk) attention weights (rows sum to 1 where a key is visible).
    scores: (H, Lq, Lk) scaled scores before the mask, or None when the source has none
        (blocked scores given as -inf are shown as blocked cells).
    keep: (H, Lq, Lk) bool, True = the query may attend to the key; None = no mask.
    q_tokens / k_tokens: Lq / Lk strings, or None to label positions by number.
    title: one line saying what this is (model, layer, batch element).
    head_labels: {lang: H strings}, a short label per head after "head h" (a pattern the head
        shows), in "en" and optionally "zh"; None = no labels.
    q / k: (H, Lq, D) queries and (Hkv, Lk, D) keys (Hkv dividing H: query head h reads key
        head h // (H / Hkv), as grouped-query attention does), the operands of the scores, or None; with both and ``scale`` the page works one
        score out by hand (q_i · k_j = Σ_d q_id k_jd, times the scale) for the cell under the pointer.
    scale: the factor the scores were multiplied by (1/√D by default), or None.
    softcap: the cap of a layer that squashes its scaled scores (s -> cap·tanh(s / cap)); the
        ``scores`` are then the capped ones, and the worked score shows the cap. None: no cap.
    sink: (H,) sink logits that join each row's softmax denominator (rows then sum to less than 1),
        or None.
    """

    weights: torch.Tensor
    q_tokens: Optional[Sequence[str]] = None
    k_tokens: Optional[Sequence[str]] = None
    title: str = ""
    scores: Optional[torch.Tensor] = None
    keep: Optional[torch.Tensor] = None
    head_labels: Optional[dict] = None
    q: Optional[torch.Tensor] = None
    k: Optional[torch.Tensor] = None
    scale: Optional[float] = None
    softcap: Optional[float] = None
    sink: Optional[Sequence[float]] = None

    def __post_init__(self):
        if not isinstance(self.weights, torch.Tensor) or self.weights.dim() != 3:
            raise ValueError(f"weights must be an (H, Lq, Lk) tensor, got {getattr(self.weights, 'shape', type(self.weights))}")
        shape = tuple(self.weights.shape)
        for name in ("scores", "keep"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)} but weights have {shape}; they must match")
        for name, n in (("q_tokens", shape[1]), ("k_tokens", shape[2])):
            tokens = getattr(self, name)
            if tokens is not None and len(tokens) != n:
                raise ValueError(f"{name} has {len(tokens)} tokens but the weights have {n} along that axis")
        if (self.q is None) != (self.k is None):
            raise ValueError("q and k come together (the operands of the scores): give both or neither")
        if self.q is not None and self.k is not None:
            H, Lq, Lk = shape
            if self.q.dim() != 3 or tuple(self.q.shape[:2]) != (H, Lq):
                raise ValueError(f"q must be (H, Lq, D) = ({H}, {Lq}, D) for weights of shape {shape}, got {tuple(self.q.shape)}")
            hkv = self.k.shape[0] if self.k.dim() == 3 else 0
            if hkv == 0 or H % hkv or tuple(self.k.shape[1:]) != (Lk, self.q.shape[2]):
                raise ValueError(f"k must be (Hkv, Lk, D) = (a divisor of {H}, {Lk}, {self.q.shape[2]}) for weights of shape "
                                 f"{shape}, got {tuple(self.k.shape)}")
        if self.scale is not None and (isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)) or not math.isfinite(self.scale)):
            raise ValueError(f"scale must be a finite number (the factor of the scores), got {self.scale!r}")
        if self.head_labels is not None:
            if "en" not in self.head_labels or not set(self.head_labels) <= set(_text.LANGS):
                raise ValueError(f"head_labels must map 'en' (and optionally 'zh') to labels, got keys {sorted(self.head_labels)}")
            for lang, labels in self.head_labels.items():
                if len(labels) != shape[0]:
                    raise ValueError(f"head_labels[{lang!r}] has {len(labels)} labels but the weights have {shape[0]} heads")

    def head_label(self, head: int, lang: str = "en") -> str:
        """The label of ``head`` in ``lang`` (English when there is none in ``lang``), or ""."""
        if self.head_labels is None:
            return ""
        return self.head_labels.get(lang, self.head_labels["en"])[head]

    @property
    def num_heads(self) -> int:
        return self.weights.shape[0]


@dataclass(frozen=True)
class AttentionSteps:
    """The steps of a trace that the heat maps and the worked score are read from.

    q / k: the operands of the scores (B, H, Lq, D) and (B, H, Lk, D) (after rotary embeddings,
    the cache and the kv-head repeat); raw: q kᵀ; scaled: times the scale; before_softmax: the
    scores the softmax read (after bias and mask); softmax: the weights. q and k are None for
    a trace of the functional core alone (no projections recorded).
    """

    q: Optional[Step]
    k: Optional[Step]
    raw: Step
    scaled: Step
    before_softmax: Step
    softmax: Step


def attention_steps(trace: Trace, *, call: Optional[int] = None) -> Optional[AttentionSteps]:
    """The :class:`AttentionSteps` of ``trace`` (of its first module call, or of ``call``), or
    None when it has no scores and softmax (a fused backend records one step)."""
    where = trace.select(call=call) if call is not None else trace.steps
    if call is None and where and where[0].call is not None:
        where = trace.select(call=where[0].call)

    def first(kind: steps.StepKind, role: Optional[str] = None) -> Optional[Step]:
        return next((s for s in where if s.kind is kind and (role is None or s.role == role)), None)

    raw, scaled, softmax = first(steps.SCORES), first(steps.SCALE), first(steps.SOFTMAX)
    scaled = scaled or raw   # a layer whose scale is folded into q (OPT) records no scale step
    if raw is None or scaled is None or softmax is None:
        return None
    i_raw, i_soft = where.index(raw), where.index(softmax)
    # the operands of the scores: the last Q and K tensors with heads before them
    # (after rotary embeddings, the cache and the kv-head repeat)
    q = next((s for s in reversed(where[:i_raw]) if s.role == "Q" and len(s.shape) == 4), None)
    k = next((s for s in reversed(where[:i_raw]) if s.role == "K" and len(s.shape) == 4), None)
    return AttentionSteps(q, k, raw, scaled, where[i_soft - 1], softmax)


def head_maps_from_trace(
    trace: Trace,
    *,
    q_tokens: Optional[Sequence[str]] = None,
    k_tokens: Optional[Sequence[str]] = None,
) -> list[HeadMaps]:
    """One :class:`HeadMaps` per batch element, from a trace with values of the reference backend.

    weights: the ``softmax`` step; scores: the ``scale`` step (scaled, before any mask);
    keep: where the scores the softmax read are finite (-inf = blocked by a mask or a -inf bias);
    q, k: the operands of the scores, and the scale (their ratio to q kᵀ is 1/√D), for the
    worked score.
    """
    found = attention_steps(trace)
    if found is None:
        raise ValueError(
            "the trace has no attention steps (no scores and softmax); record it with the reference "
            "backend (backend='reference' or return_weights=True), or use multihead.explain_module, which re-runs a fused one"
        )
    weights, scores, before = found.softmax.tensor, found.scaled.tensor, found.before_softmax.tensor
    q = found.q.tensor if found.q is not None else None
    k = found.k.tensor if found.k is not None else None
    if q is None or k is None:   # a trace of the functional core: the keys' repeat alone, no queries
        q = k = None
    # keep_values keeps every step's tensor or none: one None means all are
    if weights is None or scores is None or before is None:
        raise ValueError("the trace kept no values; record it with multihead.trace(keep_values=True)")
    keep = before != float("-inf")
    where = trace.select(call=found.softmax.call) if found.softmax.call is not None else trace.steps
    mods = [st for st in where if st.kind is steps.SCORE_MOD]
    softcap = None
    if len(mods) == 1 and tuple(mods[0].params["kinds"]) == ("softcap",) and mods[0].tensor is not None:
        softcap, scores = float(mods[0].params["parts"][0]["cap"]), mods[0].tensor
    elif mods:
        q = k = None   # a score mod of the user's: q·k × scale is not the score the softmax read
    sinks = [st for st in where if st.kind is steps.SINK]
    sink = sinks[0].params["logits"] if sinks else None
    cfg = trace.config
    scale = float(found.scaled.params.get("scale", 1.0)) if q is not None else None
    desc = (
        f"d_in={cfg.get('d_in')}, H={cfg.get('num_heads')}, Hkv={cfg.get('num_kv_heads')}, "
        f"D={cfg.get('head_dim')}, causal={cfg.get('causal')}"
    )
    return [
        HeadMaps(
            weights=weights[b], scores=scores[b], keep=keep[b],
            q_tokens=q_tokens, k_tokens=k_tokens, title=f"MultiHeadAttention({desc}) · b = {b}",
            q=q[b] if q is not None else None, k=k[b] if k is not None else None, scale=scale,
            softcap=softcap, sink=sink,
        )
        for b in range(weights.shape[0])
    ]
