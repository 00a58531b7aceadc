"""The definition, computed: `multihead.MultiHeadAttention` built with the user's weights, run
in float64 with the reference backend under `multihead.trace`, its steps kept by stage.

    >>> import torch, torch.nn as nn
    >>> from multihead.diagnosis.anatomy import find_anatomy
    >>> from multihead.diagnosis.reference import reference_steps
    >>> a = find_anatomy(nn.MultiheadAttention(8, 2, batch_first=True))
    >>> ref = reference_steps(a, 2, torch.randn(2, 3, 8), None, None, causal=False)
    >>> [key for key in ref.tensors][:4], tuple(ref.tensors["W"].shape)
    (['P:Q', 'P:K', 'P:V', 'H:Q'], (2, 2, 3, 3))

Stages (the keys of :attr:`Reference.tensors`), in the order the data flows, each one a step of
the catalogue (:data:`STAGE_STEPS`): ``P:Q`` ``P:K`` ``P:V`` the projections (b, t, f);
``H:Q`` ``H:K`` ``H:V`` the heads (b, h, t, d); ``S`` the scores QKᵀ, ``S*`` scaled, ``M``
masked (when a mask applies), ``W`` the softmax weights (b, h, q, k); ``O`` weights × V
(b, h, q, d); ``C`` the heads merged (b, q, h*d); ``Y`` the output (b, q, e).

Legend: b batch, t tokens, h heads, d head dim, q query tokens, k key tokens, f = h*d, e output features.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .. import steps as _steps
from .._numerics import default_scale
from ..module import MultiHeadAttention
from ..trace import trace
from .anatomy import Anatomy

__all__ = ["Reference", "reference_steps", "reference_module", "STAGES", "STAGE_STEPS", "HEAD_STAGES"]

STAGES = ("P:Q", "P:K", "P:V", "H:Q", "H:K", "H:V", "S", "S*", "M", "W", "O", "C", "Y")
#: the catalogue step each stage is
STAGE_STEPS = {
    "P:Q": _steps.PROJECT, "P:K": _steps.PROJECT, "P:V": _steps.PROJECT,
    "H:Q": _steps.SPLIT_HEADS, "H:K": _steps.SPLIT_HEADS, "H:V": _steps.SPLIT_HEADS,
    "S": _steps.SCORES, "S*": _steps.SCALE, "M": _steps.MASK, "W": _steps.SOFTMAX,
    "O": _steps.WEIGHTED_SUM, "C": _steps.MERGE_HEADS, "Y": _steps.OUTPUT_PROJECTION,
}
#: the stages whose tensors have a head axis (b, h, ., .)
HEAD_STAGES = ("H:Q", "H:K", "H:V", "S", "S*", "M", "W", "O")
_FROM_TRACE = {"project": "P", "move_heads_forward": "H", "scores": "S", "scale": "S*", "mask": "M",
               "softmax": "W", "weighted_sum": "O", "merge_heads": "C", "output_projection": "Y"}


@dataclass
class Reference:
    """The reference's tensors by stage (float64, CPU), the scale, the head count, the bool
    ``keep`` (q, k) that applied (None: no mask), and the rows with at least one visible key."""

    tensors: dict[str, torch.Tensor]
    scale: float
    num_heads: int
    keep: Optional[torch.Tensor]
    rows: torch.Tensor
    #: the mask kinds that applied (:data:`multihead.steps.MASK_KINDS` keys): causal, keep
    kinds: tuple[str, ...] = ()


def reference_module(a: Anatomy, num_heads: int, causal: bool) -> tuple[MultiHeadAttention, bool]:
    """`MultiHeadAttention` (reference backend, float64, eval) holding the anatomy's weights, and
    whether it holds W_O too (False: no W_O, or one that changes the width; applied apart)."""
    d_out, d_in = a.wq.shape
    kv_heads = int(a.wk.shape[0]) // (d_out // num_heads)
    square = a.wo is not None and tuple(a.wo.shape) == (d_out, d_out)
    m = MultiHeadAttention(int(d_in), num_heads, int(d_out), num_kv_heads=kv_heads, kdim=int(a.wk.shape[1]),
                           vdim=int(a.wv.shape[1]), bias=True, causal=causal, backend="reference",
                           dtype=torch.float64)
    with torch.no_grad():
        for lin, w, b in ((m.q_proj, a.wq, a.bq), (m.k_proj, a.wk, a.bk), (m.v_proj, a.wv, a.bv)):
            lin.weight.copy_(w.double().cpu())
            lin.bias.copy_(b.double().cpu() if b is not None else torch.zeros(lin.bias.shape))
        if square:
            m.out_proj.weight.copy_(a.wo.double().cpu())  # type: ignore[union-attr]
            m.out_proj.bias.copy_(a.bo.double().cpu() if a.bo is not None else torch.zeros(d_out))
        else:  # no W_O, or one that changes the width: applied below, after the merge
            m.out_proj.weight.copy_(torch.eye(int(d_out), dtype=torch.float64))
            m.out_proj.bias.zero_()
    return m.eval(), square


def reference_steps(a: Anatomy, num_heads: int, query: torch.Tensor, key: Optional[torch.Tensor],
                    keep: Optional[torch.Tensor], *, causal: bool) -> Reference:
    """The reference run on ``query`` (B, Lq, E) and ``key`` (B, Lk, E; None: self-attention)
    with the bool mask ``keep`` (Lq, Lk; True = may attend; None: none) and a causal mask when
    ``causal``; inputs are batch-first."""
    m, square = reference_module(a, num_heads, causal)
    q = query.detach().double().cpu()
    k = None if key is None else key.detach().double().cpu()
    with torch.no_grad(), trace() as tr:
        m(q, k, k, mask=keep)
    tensors: dict[str, torch.Tensor] = {}
    for step in tr.steps:
        stage = _FROM_TRACE.get(step.kind.id)
        if stage is None or step.tensor is None:
            continue
        tensors[f"{stage}:{step.role}" if stage in ("P", "H") else stage] = step.tensor
    if not square:
        y = tensors["C"]
        tensors["Y"] = y if a.wo is None else F.linear(y, a.wo.double().cpu(), None if a.bo is None else a.bo.double().cpu())
    lq, lk = q.shape[1], (q if k is None else k).shape[1]
    full = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        full = full & torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
    if keep is not None:
        full = full & keep
    applied = full if (causal or keep is not None) else None
    kinds = (("causal",) if causal else ()) + (("keep",) if keep is not None else ())
    scale = default_scale(int(a.wq.shape[0]) // num_heads)  # the scale the module uses: 1/sqrt(D)
    return Reference(tensors, scale, num_heads, applied, full.any(-1), kinds)
