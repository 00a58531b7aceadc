"""FLOPs and bytes of every traced step, and the seeds' argument about head counts.

Counting rules: a multiply-add is 2 FLOPs; an element-wise op is 1 FLOP per element (softmax
counts 5: max, subtract, exp, sum, divide); masking is a select, 0 FLOPs. Bytes are what a
step reads plus what it writes, at the step's element size; a view reads and writes nothing.
These are the textbook counts of the reference backend's ops, not measurements.

The argument (tutorial 002): with h heads of d_model/h, the score products cost
2·B·Lq·Lk·d_model (QKᵀ) + 2·B·Lq·Lk·d_model (weights × V) whatever h is; only the number of
score matrices (h of them) grows. :func:`attention_cost` computes that for any h.

Legend: B batch, H query heads, Hkv key/value heads, Lq/Lk query/key lengths, D head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..trace import Step, Trace

__all__ = ["StepCost", "AttentionCost", "trace_cost", "attention_cost", "head_count_table"]


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


def trace_cost(trace: Trace) -> list[StepCost]:
    """The cost of every step of a multihead trace of ``MultiHeadAttention``'s forward pass.

    Needs the trace's config (``d_in``, ``kdim``, ``head_dim``, ``bias``), which the module records.
    """
    cfg = trace.config
    costs = []
    score_shape: tuple[int, ...] | None = None  # (B, H, Lq, Lk), for the steps after the scores
    for s in trace.steps:
        n = math.prod(s.shape)
        size = _itemsize(s)
        flops = moved = 0
        name = s.name
        if name == "input":
            pass
        elif name.startswith("project "):
            f_in = cfg["d_in"] if s.label == "project Q" else cfg["kdim"]
            tokens_out = n // s.shape[-1]
            flops = 2 * n * f_in + (n if cfg.get("bias") else 0)
            w = f_in * s.shape[-1] + (s.shape[-1] if cfg.get("bias") else 0)
            moved = (tokens_out * f_in + w + n) * size
        elif s.view:
            moved = 0
        elif name == "repeat kv heads" or name == "merge heads":
            moved = 2 * n * size
        elif name == "scores QKᵀ":
            score_shape = s.shape
            d = cfg["head_dim"]
            B, H, Lq, Lk = s.shape
            flops = 2 * n * d
            moved = (B * H * Lq * d + B * H * Lk * d + n) * size
        elif name in ("scale", "add bias", "dropout"):
            flops = n
            moved = (2 if name == "scale" else 3) * n * size
        elif name.endswith(" mask"):
            moved = 2 * n * size + n  # scores in and out, one bool per score
        elif name == "softmax":
            flops = 5 * n
            moved = 2 * n * size
        elif name == "weights × V":
            if score_shape is None:  # the reference backend records the scores before this step
                raise ValueError(f"trace_cost found {s.label!r} before the scores step; trace a whole forward pass")
            B, H, Lq, Lk = score_shape
            flops = 2 * B * H * Lq * Lk * s.shape[-1]
            moved = (B * H * Lq * Lk + B * H * Lk * s.shape[-1] + n) * size
        elif name == "output projection":
            d = s.shape[-1]
            flops = 2 * n * d + (n if cfg.get("bias") else 0)
            moved = (n + d * d + (d if cfg.get("bias") else 0) + n) * size
        else:
            raise ValueError(
                f"trace_cost counts the reference backend's steps and does not know {s.label!r}; "
                'trace a module built with backend="reference"'
            )
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
