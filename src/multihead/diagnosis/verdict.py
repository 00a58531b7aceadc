"""The verdict: a finding, or "matches the definition" with the measured error and the bound.

    >>> import torch.nn as nn
    >>> from multihead.diagnosis import diagnose
    >>> d = diagnose(nn.MultiheadAttention(8, 2, batch_first=True))
    >>> d.status, d.error <= d.bound, [c.key for c in d.conventions]
    ('matches', True, ['mask_block', 'row_nan'])

The bound is the oracle's rule (flash-attn's, as the test suite's ``tests/oracle.py`` writes it)
applied to the whole module: the error of the user's output against the float64 reference may be
at most twice the error of a naive same-precision run of the definition (the reference backend
in the module's dtype, with the module's weights) plus a floor of a few roundings of the sizes
involved::

    error <= 2 * naive_error + (4 + (sqrt(D) + 2) * S) * eps(c) * size

S the largest score magnitude, size the largest output magnitude, c the dtype the scores are
computed in (float32 for half inputs). A float64 module's naive error is the float32 one scaled
by eps(float64) / eps(float32), as in the oracle.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .._numerics import compute_dtype
from .anatomy import Anatomy
from .locate import Finding
from .reference import Reference, reference_module
from .render import render_html, render_text, to_dict

__all__ = ["Convention", "Diagnosis", "oracle_bound"]


@dataclass(frozen=True)
class Convention:
    """A choice where the user's module and multihead both are right but differ: ``key`` (a key
    of :mod:`.words`) and the facts it is written with."""

    key: str
    params: tuple[tuple[str, Any], ...] = ()


@dataclass
class Diagnosis:
    """What :func:`multihead.diagnose` found.

    status: "matches" (the module computes the definition; ``conventions`` may name choices
    that differ from multihead's) or "bug" (``finding`` is the first wrong step). error / bound:
    the largest output error against the float64 reference over the probes that matched, and the
    oracle's bound for it. facts: what was found (heads, layout, causal, projections).
    """

    module: str
    status: str
    finding: Optional[Finding]
    conventions: list[Convention]
    error: float
    bound: float
    facts: dict[str, Any] = field(default_factory=dict)
    probes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether the module matches the definition (conventions aside)."""
        return self.status == "matches"

    def text(self, lang: str = "en") -> str:
        """The report as plain text in ``lang`` ("en" or "zh")."""
        return render_text(self, lang)

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data (what :meth:`to_json` writes)."""
        return to_dict(self)

    def to_json(self, **kwargs: Any) -> str:
        """The report as JSON (both languages' texts included)."""
        return json.dumps(self.to_dict(), ensure_ascii=False, **kwargs)

    def html(self, lang: str = "en") -> str:
        """The report as one self-contained HTML fragment in ``lang``."""
        return render_html(self, lang)

    def _repr_html_(self) -> str:
        return self.html("en")

    def __str__(self) -> str:
        return self.text("en")


def oracle_bound(a: Anatomy, num_heads: int, causal: bool, ref: Reference, query: torch.Tensor,
                 key: Optional[torch.Tensor], keep: Optional[torch.Tensor], dtype: torch.dtype) -> float:
    """The oracle's bound on the output error of a ``dtype`` forward on this probe (see the module docstring)."""
    naive_dtype = torch.float32 if dtype == torch.float64 else dtype
    m, square = reference_module(a, num_heads, causal)
    m = m.to(naive_dtype)
    with torch.no_grad():
        q = query.detach().cpu().to(naive_dtype)
        k = None if key is None else key.detach().cpu().to(naive_dtype)
        y = m(q, k, k, mask=keep).double()
        if not square and a.wo is not None:
            y = torch.nn.functional.linear(y.to(naive_dtype), a.wo.cpu().to(naive_dtype),
                                           None if a.bo is None else a.bo.cpu().to(naive_dtype)).double()
    rows = ref.rows
    want = ref.tensors["Y"]
    naive = float((y[:, rows] - want[:, rows]).abs().max()) if bool(rows.any()) else 0.0
    if dtype == torch.float64:
        naive *= torch.finfo(torch.float64).eps / torch.finfo(torch.float32).eps
    d = ref.tensors["O"].shape[-1]
    scores = ref.tensors["S*"]
    s = float(scores.abs().max()) if scores.numel() else 0.0
    size = float(want[:, rows].abs().max()) if bool(rows.any()) else 0.0
    floor = (4 + (math.sqrt(d) + 2) * s) * torch.finfo(compute_dtype(dtype)).eps * size
    return 2 * naive + floor
