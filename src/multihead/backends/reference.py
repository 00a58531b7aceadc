"""The reference backend: attention as the tutorials teach it, one plain tensor op per step.

This is the oracle every other backend and the module are tested against. It is written for
reading, not speed: it materialises the (B, H, Lq, Lk) scores. Equivalent code::

    k, v = repeat_kv(k, H // Hkv), repeat_kv(v, H // Hkv)   # GQA: query head i reads kv head i // g
    scores = (q @ k.transpose(-2, -1)) * scale             # (B, H, Lq, Lk)
    scores = scores + bias                                  # float masks
    scores = mod(scores)                                    # score mods (score_mod, softcap), in order
    scores = scores.masked_fill(~keep, -inf)                # bool masks: selection, not a big negative
    weights = safe_softmax(scores, sink)                    # a row with no visible key -> all 0;
                                                            # a sink adds exp(sink_h) to each denominator
    weights = dropout(weights, dropout_p)
    out = weights @ v                                       # (B, H, Lq, Dv)

float16/bfloat16 inputs are computed in float32 (scores, softmax and the weighted sum) and the
result is cast back.

Legend: B batch, H query heads, Hkv key/value heads, Lq/Lk query/key lengths, D head dim,
Dv value head dim.
"""

from __future__ import annotations

from typing import Literal, Optional, Union, overload

import torch
import torch.nn.functional as F

from .. import steps as _steps
from .. import trace as _trace
from .._numerics import compute_dtype, finite_row_max, is_default_scale
from ..heads import repeat_kv
from ..masks import Mask
from .registry import Backend, Call, register

_NEG_INF = float("-inf")
SCORE_AXES = ("b", "h", "q", "k")


def safe_softmax(scores: torch.Tensor, sink: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Softmax over the last axis in which a row of only -inf gives zeros, not NaN.

    ``sink`` (H,) adds ``exp(sink_h)`` to the denominator of every row of head h (scores
    (B, H, Lq, Lk)). NaN and +inf inputs propagate as IEEE arithmetic says.
    """
    if scores.shape[-1] == 0:
        return scores.clone()
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    extra = None
    if sink is not None:
        extra = sink.to(scores.dtype).view(1, -1, 1, 1)
        row_max = torch.maximum(row_max, extra.detach())
    row_max = torch.where(row_max == _NEG_INF, torch.zeros_like(row_max), row_max)
    e = torch.exp(scores - row_max)
    total = e.sum(dim=-1, keepdim=True)
    if extra is not None:
        total = total + torch.exp(extra - row_max)
    return e / torch.where(total == 0, torch.ones_like(total), total)


@overload
def attention_probs(q: torch.Tensor, k: torch.Tensor, mask: Optional[Mask], *, scale: float,
                    with_lse: Literal[False] = False) -> torch.Tensor: ...
@overload
def attention_probs(q: torch.Tensor, k: torch.Tensor, mask: Optional[Mask], *, scale: float,
                    with_lse: Literal[True]) -> tuple[torch.Tensor, torch.Tensor]: ...


def attention_probs(
    q: torch.Tensor, k: torch.Tensor, mask: Optional[Mask], *, scale: float, with_lse: bool = False
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """softmax(q kᵀ · scale + mask) in the compute dtype: (B, H, Lq, Lk). k is (B, H, Lk, D).
    ``with_lse``: also the rows' log-sum-exp (B, H, Lq) of the final scores (see `row_lse`)."""
    tr = _trace.current()
    cdt = compute_dtype(q.dtype)
    scores = q.to(cdt) @ k.to(cdt).transpose(-2, -1)
    if tr is not None:
        tr.record(_steps.SCORES, scores, params={"head_dim": q.shape[-1]})
    scores = scores * scale
    if tr is not None:
        tr.record(_steps.SCALE, scores, params={"scale": scale, "head_dim": q.shape[-1],
                                                   "default": is_default_scale(scale, q.shape[-1])})
    keep = None
    sink = None
    if mask is not None:
        mt = mask.materialize(tuple(scores.shape), device=scores.device, dtype=cdt)
        keep = mt.keep
        sink = mask.sink_logits
        if mt.bias is not None:
            scores = scores + mt.bias
            if tr is not None:
                tr.record(_steps.ADD_BIAS, scores)
        parts = _steps.part_params(mask.parts) if tr is not None else ()
        if mask.score_mods:
            scores = mask.apply_block(scores, 0, scores.shape[-2], 0, scores.shape[-1], tuple(scores.shape))
            if tr is not None:
                tr.record(_steps.SCORE_MOD, scores, params={
                    "kinds": tuple(m.kind for m in mask.score_mods),
                    "parts": tuple(p for p in parts if p["kind"] in ("score_mod", "softcap")),
                })
        if keep is not None:
            scores = scores.masked_fill(~keep, _NEG_INF)
            if tr is not None:
                tr.record(
                    _steps.MASK, scores,
                    checks={"blocked scores are -inf": bool((scores.masked_select(~keep.expand_as(scores)) == _NEG_INF).all())},
                    params={"kinds": _steps.selecting_kinds(mask.parts), "parts": parts, "sink": sink is not None,
                            "code": repr(mask)},
                    extras={"keep": keep},
                )
    if tr is not None and sink is not None:  # the sink's logits, a step of their own before the softmax
        tr.record(_steps.SINK, scores, params={"logits": [float(x) for x in sink.detach().flatten().tolist()]})
    weights = safe_softmax(scores) if sink is None else safe_softmax(scores, sink)
    if tr is not None:
        tr.record(_steps.SOFTMAX, weights, checks=_softmax_checks(weights, scores, sink is not None),
                  params={"sink": True} if sink is not None else None)
    return (weights, row_lse(scores, sink)) if with_lse else weights


def row_lse(scores: torch.Tensor, sink: Optional[torch.Tensor] = None) -> torch.Tensor:
    """log(Σ_j exp(s_ij) [+ exp(sink_h)]) of scores (B, H, Lq, Lk): (B, H, Lq); -inf for a row
    with no visible key (and no sink). Differentiable, with no NaN gradient for such rows."""
    top = finite_row_max(scores)
    total = torch.exp(scores - top).sum(dim=-1, keepdim=True)
    seen = total > 0
    lse = torch.where(seen, top + torch.log(torch.where(seen, total, torch.ones_like(total))),
                      torch.full_like(total, _NEG_INF)).squeeze(-1)
    if sink is not None:
        lse = torch.logaddexp(lse, sink.to(lse.dtype).view(1, -1, 1))
    return lse


def _softmax_checks(weights: torch.Tensor, scores: torch.Tensor, sink: bool = False) -> dict[str, bool]:
    blocked = scores == _NEG_INF
    visible_rows = ~blocked.all(dim=-1)
    sums = weights.sum(dim=-1)
    tol = 8 * torch.finfo(weights.dtype).eps * max(1, weights.shape[-1])
    checks = {
        ("rows sum to at most 1 (a sink takes the rest)" if sink else "rows sum to 1"):
            bool(((sums - 1 <= tol) if sink else ((sums - 1).abs() <= tol))[visible_rows].all()),
        "masked weights are exactly 0": bool((weights[blocked] == 0).all()),
    }
    if (~visible_rows).any():
        checks["rows with no visible key are all 0"] = bool((weights[~visible_rows] == 0).all())
    return checks


def forward_with_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[Mask],
    *,
    scale: float,
    dropout_p: float,
    lse: Optional[list[torch.Tensor]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference forward, returning ``(out, weights)``; weights are those applied (after dropout).
    A list given as ``lse`` receives the rows' log-sum-exp (B, H, Lq) (of the scores, before dropout)."""
    tr = _trace.current()
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        src_k, src_v = k, v
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        if tr is not None:
            tr.record(_steps.REPEAT_KV, k, source=src_k, role="K", params={"groups": groups})
            tr.record(_steps.REPEAT_KV, v, source=src_v, role="V", params={"groups": groups})
    if lse is None:
        weights = attention_probs(q, k, mask, scale=scale)
    else:
        weights, row = attention_probs(q, k, mask, scale=scale, with_lse=True)
        lse.append(row)
    if dropout_p > 0:
        weights = F.dropout(weights, dropout_p, training=True)
        if tr is not None:
            tr.record(_steps.DROPOUT, weights, params={"p": dropout_p})
    out = weights @ v.to(weights.dtype)
    if tr is not None:
        tr.record(_steps.WEIGHTED_SUM, out, params={"lk": v.shape[2]})
    return out.to(q.dtype), weights.to(q.dtype)


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[Mask], *, scale: float, dropout_p: float
) -> torch.Tensor:
    return forward_with_weights(q, k, v, mask, scale=scale, dropout_p=dropout_p)[0]


def reference_attention_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[Mask], *, scale: float, dropout_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    lse: list[torch.Tensor] = []
    out = forward_with_weights(q, k, v, mask, scale=scale, dropout_p=dropout_p, lse=lse)[0]
    return out, lse[0]


def _accepts_everything(call: Call) -> Optional[str]:
    return None


BACKEND = register(
    Backend(
        name="reference",
        fn=reference_attention,
        refuses=_accepts_everything,
        summary="plain tensor ops in the tutorials' order; materialises the (B, H, Lq, Lk) scores",
        lse_fn=reference_attention_lse,
    ),
)
