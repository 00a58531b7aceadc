"""FLOPs and bytes of every traced step, and the seeds' argument about head counts.

Counting rules, one per step kind (:data:`multihead.steps.COST_RULES`): a multiply-add is 2
FLOPs; an element-wise op is 1 FLOP per element (softmax counts 5: max, subtract, exp, sum,
divide); masking is a select, 0 FLOPs. Bytes are what a step reads plus what it writes, at the
step's element size; a view reads and writes nothing. These are the textbook counts of the
ops, not measurements.

The argument (tutorial 002): with h heads of d_model/h, the score products cost
2·B·Lq·Lk·d_model (QKᵀ) + 2·B·Lq·Lk·d_model (weights × V) whatever h is; only the number of
score matrices (h of them) grows. :func:`attention_cost` computes that for any h.

Legend: B batch, H query heads, Hkv key/value heads, Lq/Lk query/key lengths, D head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .. import steps as _steps
from ..steps import COST_RULES
from ..trace import Step, Trace

__all__ = ["StepCost", "AttentionCost", "step_cost", "trace_cost", "attention_cost", "head_count_table"]


@dataclass(frozen=True)
class StepCost:
    """FLOPs and bytes (read + written) of one step, labelled as in the trace."""

    label: str
    flops: int
    bytes: int


def _itemsize(step: Step) -> int:
    if step.tensor is not None:
        return step.tensor.element_size()
    return torch.empty((), dtype=getattr(torch, step.dtype or "float32")).element_size()


def step_cost(step: Step, score_shape: Optional[tuple[int, ...]] = None) -> tuple[int, int]:
    """``(FLOPs, bytes)`` of one recorded step, by its kind's cost rule
    (:data:`multihead.steps.COST_RULES`), from the step's shape and params.

    score_shape: (B, H, Lq, Lk) of the scores before a ``weighted_sum`` step, when the step does
    not record its key length.
    """
    n = math.prod(step.shape)
    size = _itemsize(step)
    p = step.params
    rule = step.kind.cost
    if rule in ("none", "view"):
        return 0, 0
    if rule == "linear":
        f_in, f_out = p["f_in"], step.shape[-1]
        bias = 1 if p.get("bias") else 0
        tokens = n // f_out
        return 2 * n * f_in + bias * n, (tokens * f_in + f_in * f_out + bias * f_out + n) * size
    if rule == "copy":
        return 0, 2 * n * size
    if rule == "cache":
        B, H, _, D = step.shape
        return 0, 2 * B * H * p["new"] * D * size
    if rule == "rope":
        _, _, L, D = step.shape
        return 3 * n, (2 * n + 2 * L * D) * size
    if rule == "scores":
        B, H, Lq, Lk = step.shape
        d = p["head_dim"]
        return 2 * n * d, (B * H * Lq * d + B * H * Lk * d + n) * size
    if rule == "scale":
        return n, 2 * n * size
    if rule == "norm":
        return 4 * n, 2 * n * size
    if rule == "sink":
        return 2 * n // step.shape[-1], 0
    if rule in ("add", "dropout"):
        return n, 3 * n * size
    if rule == "score_mod":
        return n * len(p["kinds"]), 2 * n * size
    if rule == "select":
        return 0, 2 * n * size + n
    if rule == "softmax":
        return 5 * n, 2 * n * size
    if rule == "weighted_sum":
        B, H, Lq, Dv = step.shape
        if "lk" in p:
            Lk = p["lk"]
        elif score_shape is not None:
            Lk = score_shape[-1]
        else:
            raise ValueError(f"the step {step.label!r} records no key length and no scores came before it")
        return 2 * B * H * Lq * Lk * Dv, (B * H * Lq * Lk + B * H * Lk * Dv + n) * size
    if rule == "fused":
        B, H, Lq, Dv = step.shape
        Lk, d = p["lk"], p["head_dim"]
        scores = B * H * Lq * Lk
        return 2 * scores * d + 2 * scores * Dv + 6 * scores, (B * H * Lq * d + B * H * Lk * (d + Dv) + n) * size
    raise ValueError(f"no cost rule {rule!r} (step kind {step.kind.id!r}); the rules are {sorted(COST_RULES)}")


def trace_cost(trace: Trace) -> list[StepCost]:
    """The cost of every step of a multihead trace, by the step kinds' cost rules.

    A fused backend's single step is counted as the reference's arithmetic without the score
    matrix's round trips (see :data:`multihead.steps.COST_RULES`).
    """
    costs = []
    score_shape: Optional[tuple[int, ...]] = None  # (B, H, Lq, Lk), for the steps after the scores
    for s in trace.steps:
        if s.kind is _steps.SCORES:
            score_shape = s.shape
        flops, moved = step_cost(s, score_shape)
        costs.append(StepCost(s.label, int(flops), int(moved)))
    return costs


@dataclass(frozen=True)
class AttentionCost:
    """The FLOPs of one self- or cross-attention layer, by part, for a head count."""

    heads: int
    head_dim: int
    projections: int  # Q, K, V and output projections
    attention: int  # QKᵀ and weights × V
    elementwise: int  # scale, softmax
    score_elements: int  # B·H·Lq·Lk: the size of the score matrices

    @property
    def total(self) -> int:
        return self.projections + self.attention + self.elementwise


def attention_cost(batch: int, lq: int, lk: int, d_in: int, d_out: int, heads: int, kv_heads: int, *, bias: bool = False) -> AttentionCost:
    """FLOPs of MultiHeadAttention(d_in, heads, d_out, num_kv_heads=kv_heads) on (batch, lq) queries
    and (batch, lk) keys, with the same counting rules as :func:`trace_cost`."""
    d = d_out // heads
    kv = kv_heads * d
    b = 1 if bias else 0
    projections = (2 * d_in + b) * batch * lq * d_out + 2 * (2 * d_in + b) * batch * lk * kv + (2 * d_out + b) * batch * lq * d_out
    scores = batch * heads * lq * lk
    attention = 2 * scores * d + 2 * scores * d  # = 4·B·Lq·Lk·d_out
    elementwise = scores + 5 * scores  # scale, softmax
    return AttentionCost(heads, d, projections, attention, elementwise, scores)


def head_count_table(batch: int, lq: int, lk: int, d_in: int, d_out: int, *, bias: bool = False, limit: int = 6) -> list[AttentionCost]:
    """:func:`attention_cost` for up to ``limit`` head counts dividing d_out (1, 2, 4, ... first)."""
    divisors = [h for h in range(1, d_out + 1) if d_out % h == 0]
    powers = [h for h in divisors if h & (h - 1) == 0]
    chosen = (powers + [h for h in divisors if h not in powers])[:limit]
    return [attention_cost(batch, lq, lk, d_in, d_out, h, h, bias=bias) for h in sorted(chosen)]
