"""The checks ``multihead explain`` adds to the trace's own: each step recomputed independently.

The forward pass records its own checks as it runs (a view kept the data, rows sum to 1, ...).
Here every arithmetic step is recomputed from the step before it, in float64, and the whole
forward pass is recomputed from scratch with the tutorial's plain code (``triu`` mask,
``torch.softmax``, ``view``/``transpose``), so a wrong number anywhere makes a check fail.

Tolerance rule (the project's): a float32 result may differ from the float64 one by at most
twice the error of the same plain computation done in float32, plus a floor of a few units in
the last place of the largest value. Exact steps (the scale, the mask) are compared exactly.

Legend: B batch, H query heads, Hkv key/value heads, Lq/Lk query/key lengths, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, cast

import torch

from .._numerics import default_scale
from .. import steps as _steps
from ..masks import Mask
from ..trace import Step, Trace

__all__ = [
    "Check",
    "close_to_float64",
    "check_scores",
    "check_scale",
    "check_mask",
    "check_causal_keep",
    "check_softmax",
    "check_dropout",
    "check_weighted_sum",
    "check_output_projection",
    "plain_forward",
    "check_forward",
    "per_head_difference",
    "walkthrough_checks",
    "check_rotary",
    "chain_checks",
]


@dataclass(frozen=True)
class Check:
    """One named check on one step: ``step`` is the step's label, ``source`` the step itself
    (what the renderers title it by), ``name`` a key of :data:`multihead.steps.CHECKS`."""

    step: str
    name: str
    ok: bool
    source: Optional[Step] = field(default=None, compare=False, repr=False)


def _floor(ref: torch.Tensor, dtype: torch.dtype) -> float:
    finite = ref[torch.isfinite(ref)]
    biggest = float(finite.abs().max()) if finite.numel() else 0.0
    return 4 * torch.finfo(dtype).eps * biggest + torch.finfo(dtype).tiny


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| where -inf meets -inf counting as 0; inf if they disagree on being finite."""
    a, b = a.double(), b.double()
    same_inf = torch.isinf(a) & torch.isinf(b) & (a == b)
    if ((torch.isinf(a) | torch.isinf(b)) & ~same_inf).any() or torch.isnan(a).any() or torch.isnan(b).any():
        return float("inf")
    d = torch.where(same_inf, torch.zeros_like(a), a - b).abs()
    return float(d.max()) if d.numel() else 0.0


def close_to_float64(actual: torch.Tensor, fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> tuple[bool, float, float]:
    """Is ``actual`` (low precision) ``fn(*inputs)`` up to rounding?

    Returns ``(ok, error, tolerance)``: error = max |actual - fn(inputs in float64)|, tolerance =
    2 x the error of ``fn`` run in ``actual``'s dtype + a floor of 4 eps x the largest value.
    """
    if tuple(actual.shape) != tuple(fn(*inputs).shape):
        return False, float("inf"), 0.0
    ref = fn(*(t.double() for t in inputs))
    plain = fn(*(t.to(actual.dtype) for t in inputs))
    tol = 2 * _max_abs_diff(plain, ref) + _floor(ref, actual.dtype)
    err = _max_abs_diff(actual, ref)
    return err <= tol, err, tol


def check_scores(q: torch.Tensor, k: torch.Tensor, scores: torch.Tensor) -> bool:
    """scores (B, H, Lq, Lk) = q (B, H, Lq, D) @ k (B, H, Lk, D)ᵀ."""
    return close_to_float64(scores, lambda a, b: a @ b.transpose(-2, -1), q, k)[0]


def check_scale(scores: torch.Tensor, scaled: torch.Tensor, head_dim: int) -> bool:
    """scaled is scores times 1/√D, bit for bit (the same one multiplication)."""
    return scaled.shape == scores.shape and torch.equal(scaled, scores * default_scale(head_dim))


def check_mask(scaled: torch.Tensor, masked: torch.Tensor, keep: torch.Tensor) -> bool:
    """Where ``keep`` is True the scores went through unchanged (blocked ones are the trace's check)."""
    keep = keep.expand_as(masked)
    return masked.shape == scaled.shape and torch.equal(masked[keep], scaled[keep])


def check_causal_keep(keep: torch.Tensor, lq: int, lk: int) -> bool:
    """The keep mask is the tutorial's ``triu(ones, diagonal=1)`` flipped (True = may attend),
    with the diagonal moved by Lk - Lq so the last query sits on the last key."""
    blocked = torch.triu(torch.ones(lq, lk, dtype=torch.bool), diagonal=1 + lk - lq)
    return bool((keep.expand(*keep.shape[:-2], lq, lk) == ~blocked).all())


def _softmax_rows(s: torch.Tensor, sink: Optional[torch.Tensor] = None) -> torch.Tensor:
    """softmax over the last axis (a row of only -inf: weights 0, not NaN); with ``sink`` (H,)
    logits, exp(sink_h) joins each row's denominator."""
    if sink is None:
        return torch.softmax(s, dim=-1).nan_to_num(0.0)
    extra = sink.to(s.dtype).view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
    return torch.softmax(torch.cat([s, extra], dim=-1), dim=-1)[..., :-1]


def check_softmax(masked: torch.Tensor, weights: torch.Tensor, sink: Optional[torch.Tensor] = None) -> bool:
    """weights = softmax(masked scores) over the keys (a fully blocked row gives 0), with the
    sink's logits (H,) in the denominator when given."""
    return close_to_float64(weights, lambda s: _softmax_rows(s, sink), masked)[0]


def check_softcap(before: torch.Tensor, after: torch.Tensor, cap: float) -> bool:
    """after = cap · tanh(before / cap), recomputed in float64 from the definition."""
    return close_to_float64(after, lambda s: cap * torch.tanh(s / cap), before)[0]


def check_dropout(weights: torch.Tensor, dropped: torch.Tensor, p: float) -> bool:
    """Each dropped weight is 0 or the weight / (1 - p), up to one rounding."""
    if dropped.shape != weights.shape:
        return False
    scaled = weights.double() / (1 - p)
    ulp = 2 * torch.finfo(weights.dtype).eps * scaled.abs()
    kept_ok = (dropped.double() - scaled).abs() <= ulp
    return bool(((dropped == 0) | kept_ok).all())


def check_weighted_sum(weights: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> bool:
    """out (B, H, Lq, D) = weights (B, H, Lq, Lk) @ v (B, H, Lk, D)."""
    return close_to_float64(out, lambda w, x: w @ x, weights, v)[0]


def check_output_projection(merged: torch.Tensor, out: torch.Tensor, linear: torch.nn.Linear) -> bool:
    """out (B, Lq, d_out) = merged (B, Lq, d_out) @ W_Oᵀ + b."""
    bias: Optional[torch.Tensor] = linear.bias  # torch annotates it Tensor; bias=False makes it None
    if bias is None:
        return close_to_float64(out, lambda m, w: m @ w.T, merged, linear.weight.detach())[0]
    return close_to_float64(out, lambda m, w, b: m @ w.T + b, merged, linear.weight.detach(), bias.detach())[0]


def plain_forward(mha, inputs: tuple, dtype: torch.dtype, *, dropout_keep: Optional[torch.Tensor] = None,
                  mask: Optional[Mask] = None) -> torch.Tensor:
    """The tutorial's code, written out plainly, with ``mha``'s weights in ``dtype``.

    inputs: ``(x,)`` or ``(x, memory)``. dropout_keep: bool (B, H, Lq, Lk), the weights that
    dropout kept (for a forward run in training mode), or None. mask: the call's mask (the
    example's ``--mask``): its dense keep and bias, its score mods and its sink join the code.
    Returns (B, Lq, d_out).
    """
    c = mha.config
    x = inputs[0].to(dtype)
    memory = inputs[-1].to(dtype)

    def linear(t, lin):
        y = t @ lin.weight.detach().to(dtype).T
        return y if lin.bias is None else y + lin.bias.detach().to(dtype)

    B, Lq, _ = x.shape
    Lk = memory.shape[1]
    H, Hkv, D = c.num_heads, c.num_kv_heads, c.head_dim
    q = linear(x, mha.q_proj).view(B, Lq, H, D).transpose(1, 2)
    k = linear(memory, mha.k_proj).view(B, Lk, Hkv, D).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
    v = linear(memory, mha.v_proj).view(B, Lk, Hkv, D).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
    scores = q @ k.transpose(2, 3) / D ** 0.5
    sink = None
    blocked = torch.zeros(Lq, Lk, dtype=torch.bool)
    if mask is not None:
        mt = mask.materialize((B, H, Lq, Lk), device=scores.device, dtype=dtype)
        if mt.bias is not None:
            scores = scores + mt.bias
        for mod in mask.score_mods:
            scores = mod.apply_block(scores, 0, Lq, 0, Lk, (B, H, Lq, Lk))
        if mt.keep is not None:
            blocked = blocked | ~mt.keep
        sink = mask.sink_logits
    if c.causal:
        blocked = blocked | torch.triu(torch.ones(Lq, Lk, dtype=torch.bool), diagonal=1 + Lk - Lq)
    weights = _softmax_rows(scores.masked_fill(blocked, float("-inf")), sink)
    if dropout_keep is not None:
        weights = weights * dropout_keep / (1 - c.dropout)
    context = (weights @ v).transpose(1, 2).reshape(B, Lq, H * D)
    return linear(context, mha.out_proj)


def check_forward(mha, inputs: tuple, y: torch.Tensor, *, dropout_keep: Optional[torch.Tensor] = None,
                  mask: Optional[Mask] = None) -> tuple[bool, float, float]:
    """``y`` against :func:`plain_forward` in float64: ``(ok, error, tolerance)``."""
    ref = plain_forward(mha, inputs, torch.float64, dropout_keep=dropout_keep, mask=mask)
    plain = plain_forward(mha, inputs, y.dtype, dropout_keep=dropout_keep, mask=mask)
    tol = 2 * _max_abs_diff(plain, ref) + _floor(ref, y.dtype)
    err = _max_abs_diff(y, ref)
    return err <= tol, err, tol


def per_head_difference(mha, inputs: tuple, mask: Optional[Mask] = None) -> tuple[float, float, bool]:
    """Run ``mha`` and ``mha.to_per_head()`` in eval mode on ``inputs``.

    Returns ``(max |fused - per-head|, tolerance, ok)``: ok when both outputs are within the
    float64 tolerance of the plain code (so they differ by at most twice that: the tolerance shown).
    """
    was_training = mha.training
    mha.eval()
    try:
        per_head = mha.to_per_head().eval()
        with torch.no_grad():
            fused = mha(*inputs, mask=mask)
            separate = per_head(*inputs, mask=mask)
        ok_fused, _, tol = check_forward(mha, inputs, fused, mask=mask)
        ok_separate, _, _ = check_forward(mha, inputs, separate, mask=mask)
    finally:
        mha.train(was_training)
    return _max_abs_diff(fused, separate), 2 * tol, ok_fused and ok_separate


def _sink_logits(trace: Trace) -> Optional[torch.Tensor]:
    """The sink logits (H,) the trace's sink step recorded, or None."""
    step = _find(trace, _steps.SINK)
    return None if step is None else torch.tensor(step.params["logits"], dtype=torch.float64)


def _find(trace: Trace, kind: _steps.StepKind, role: str = ""):
    found = trace.select(kind, role=role or None)
    return found[0] if found else None


def walkthrough_checks(trace: Trace, mha, inputs: tuple, mask: Optional[Mask] = None) -> list[Check]:
    """Recompute every arithmetic step of ``trace`` (a reference-backend run of
    ``mha(*inputs, mask=mask)`` with values kept) from the step before it, and the whole output
    from scratch."""
    c = mha.config
    steps = trace.steps
    if any(s.tensor is None for s in steps):
        raise ValueError("walkthrough_checks needs the step values: record with multihead.trace(keep_values=True)")
    # from here on every step's tensor is set (the casts below rely on this check)
    found: list[Check] = []
    q = _find(trace, _steps.ROPE, "Q") or _find(trace, _steps.MOVE_HEADS_FORWARD, "Q")
    k = (_find(trace, _steps.REPEAT_KV, "K") or _find(trace, _steps.CACHE_APPEND, "K")
         or _find(trace, _steps.ROPE, "K") or _find(trace, _steps.MOVE_HEADS_FORWARD, "K"))
    v = _find(trace, _steps.REPEAT_KV, "V") or _find(trace, _steps.CACHE_APPEND, "V") or _find(trace, _steps.MOVE_HEADS_FORWARD, "V")
    scores = _find(trace, _steps.SCORES)
    scaled = _find(trace, _steps.SCALE)
    softmax = _find(trace, _steps.SOFTMAX)
    dropout = _find(trace, _steps.DROPOUT)
    weighted = _find(trace, _steps.WEIGHTED_SUM)
    merged = _find(trace, _steps.MERGE_HEADS)
    out = _find(trace, _steps.OUTPUT_PROJECTION)
    masked = _find(trace, _steps.MASK)
    add_bias = _find(trace, _steps.ADD_BIAS)
    score_mod = _find(trace, _steps.SCORE_MOD)

    if q and k and scores:
        found.append(Check(scores.label, "equals Q·Kᵀ in float64", check_scores(q.tensor, k.tensor, scores.tensor), scores))
    if scores and scaled and scaled.params.get("default", True):
        found.append(Check(scaled.label, "is exactly scores × 1/√D", check_scale(scores.tensor, scaled.tensor, c.head_dim), scaled))
    elif scores and scaled:
        found.append(Check(scaled.label, "is exactly scores × the scale",
                           torch.equal(cast(torch.Tensor, scaled.tensor),
                                       cast(torch.Tensor, scores.tensor) * float(scaled.params["scale"])), scaled))
    before_mask = add_bias or scaled
    if score_mod is not None and before_mask is not None and tuple(score_mod.params["kinds"]) == ("softcap",):
        cap = float(score_mod.params["parts"][0]["cap"])
        found.append(Check(score_mod.label, "equals cap·tanh(s / cap) in float64",
                           check_softcap(before_mask.tensor, score_mod.tensor, cap), score_mod))
    before_mask = score_mod or before_mask
    if masked is not None and before_mask is not None:
        keep = masked.extras["keep"]
        found.append(Check(masked.label, "visible scores unchanged", check_mask(before_mask.tensor, cast(torch.Tensor, masked.tensor), keep), masked))
        if tuple(masked.params["kinds"]) == ("causal",):
            lq, lk = masked.shape[-2:]
            found.append(Check(masked.label, "mask is triu(ones, diagonal=1 + Lk - Lq) flipped", check_causal_keep(keep, lq, lk), masked))
    last_scores = masked or score_mod or add_bias or scaled
    sink = _sink_logits(trace)
    if sink is None and mask is not None:
        sink = mask.sink_logits
    if last_scores and softmax:
        found.append(Check(softmax.label, "equals softmax in float64",
                           check_softmax(cast(torch.Tensor, last_scores.tensor), softmax.tensor, sink), softmax))
    if softmax and dropout:
        found.append(Check(dropout.label, "each weight is 0 or weight / (1 - p)", check_dropout(softmax.tensor, dropout.tensor, c.dropout), dropout))
    applied = dropout or softmax
    if applied and v and weighted:
        found.append(Check(weighted.label, "equals weights × V in float64", check_weighted_sum(applied.tensor, v.tensor, weighted.tensor), weighted))
    if merged and out:
        found.append(Check(out.label, "equals merged × W_Oᵀ in float64", check_output_projection(merged.tensor, out.tensor, mha.out_proj), out))
    if out:
        dropout_keep = (dropout.tensor != 0) if dropout else None
        found.append(Check(out.label, "output equals the tutorial's plain code in float64", check_forward(mha, inputs, out.tensor, dropout_keep=dropout_keep, mask=mask)[0], out))
    return found


def check_rotary(before: torch.Tensor, after: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """after = before rotated with the tables cos, sin (rotate-half layout, the first cos.shape[-1]
    dims when that is fewer than D), recomputed in float64."""
    from .layer_attention import rotary

    return close_to_float64(after, rotary, before, cos, sin)[0]


#: the steps whose tensor is (B, H, L, D): the operands of the scores and of weights × V
_HEADS_LAYOUT = (_steps.MOVE_HEADS_FORWARD, _steps.QK_NORM, _steps.ROPE, _steps.REPEAT_KV, _steps.CACHE_APPEND)


def chain_checks(trace: Trace) -> list[Check]:
    """Every arithmetic step of ``trace`` recomputed from the step before it, needing nothing but
    the trace (a real model's layer, :func:`multihead.explain.real_model.layer_trace`): the scale
    folded into q, the rotary embedding (with the tables in the step's extras), q·kᵀ, the scale
    (the recorded factor), the softcap, the mask, the softmax (with the sink step's logits) and
    weights × V, each within the project's float64 rule (exact steps exactly)."""
    if any(s.tensor is None for s in trace.steps):
        raise ValueError("chain_checks needs the step values: record with multihead.trace(keep_values=True)")
    found: list[Check] = []

    def add(step: Step, name: str, ok: bool) -> None:
        found.append(Check(step.label, name, bool(ok), step))

    last: dict[str, Step] = {}   # the latest (b, h, t, d) tensor of each role
    scores: Optional[Step] = None
    before: Optional[Step] = None   # the scores the next score step reads
    weights: Optional[Step] = None
    sink: Optional[torch.Tensor] = None
    for s in trace.steps:
        t = cast(torch.Tensor, s.tensor)
        k = s.kind
        if k is _steps.SCALE_Q:
            proj = _find(trace, _steps.PROJECT, "Q")
            if proj is not None:
                add(s, "is exactly q_proj × the folded scale",
                    torch.equal(t, cast(torch.Tensor, proj.tensor) * float(s.params["scale"])))
        elif k is _steps.ROPE and s.role in last:
            prev = cast(torch.Tensor, last[s.role].tensor)
            add(s, "equals the rotary formula in float64", check_rotary(prev, t, s.extras["cos"], s.extras["sin"]))
        elif k is _steps.SCORES and "Q" in last and "K" in last:
            add(s, "equals Q·Kᵀ in float64", check_scores(cast(torch.Tensor, last["Q"].tensor),
                                                        cast(torch.Tensor, last["K"].tensor), t))
            scores = before = s
            continue
        elif k is _steps.SCALE and before is not None:
            add(s, "is exactly scores × the scale", torch.equal(t, cast(torch.Tensor, before.tensor) * float(s.params["scale"])))
        elif k is _steps.SCORE_MOD and before is not None and tuple(s.params["kinds"]) == ("softcap",):
            add(s, "equals cap·tanh(s / cap) in float64",
                check_softcap(cast(torch.Tensor, before.tensor), t, float(s.params["parts"][0]["cap"])))
        elif k is _steps.MASK and before is not None:
            add(s, "visible scores unchanged", check_mask(cast(torch.Tensor, before.tensor), t, s.extras["keep"]))
        elif k is _steps.SINK and before is not None:
            sink = torch.tensor(s.params["logits"], dtype=torch.float64)
            add(s, "visible scores unchanged", torch.equal(t, cast(torch.Tensor, before.tensor)))
        elif k is _steps.SOFTMAX and before is not None:
            add(s, "equals softmax in float64", check_softmax(cast(torch.Tensor, before.tensor), t, sink))
            weights = s
        elif k is _steps.WEIGHTED_SUM and weights is not None and "V" in last:
            add(s, "equals weights × V in float64",
                check_weighted_sum(cast(torch.Tensor, weights.tensor), cast(torch.Tensor, last["V"].tensor), t))
        if s.role in ("Q", "K", "V") and k in _HEADS_LAYOUT:
            last[s.role] = s
        if scores is not None and s.axes[-2:] == ("q", "k") and k is not _steps.SOFTMAX:
            before = s
    return found
