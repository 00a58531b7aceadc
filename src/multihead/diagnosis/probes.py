"""Probe inputs chosen to make bugs visible, and the ways a mask argument may be passed.

    >>> import torch
    >>> from multihead.diagnosis.probes import make_probes
    >>> [(p.name, tuple(p.query.shape), p.key is None, p.keep is None)
    ...  for p in make_probes(8, 8, torch.float32, "cpu", cross=True, mask=True, causal=False)]
    [('self', (2, 5, 8), True, True), ('cross', (2, 5, 8), False, True), ('mask', (2, 5, 8), True, False)]

Distinct random tokens (so no two rows of a wrong layout can agree by chance), two batch rows
(tokens of one row must never reach the other), Lq = 5 and Lk = 7 (a length taken from the
wrong input shows), 5 tokens for 2+ heads (a view without a transpose moves tokens between
heads), and a mask that is causal except that query 1 sees no key at all (the row whose result
is a convention: 0 here, uniform weights with a finite fill, NaN with -inf).

Legend: B batch, Lq/Lk query/key lengths, E features.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .words import say

__all__ = ["Probe", "make_probes", "ENCODINGS", "BATCH", "LQ", "LK", "EMPTY_ROW"]

BATCH, LQ, LK = 2, 5, 7
#: the query row of the mask probe that sees no key
EMPTY_ROW = 1


@dataclass
class Probe:
    """One probe: batch-first ``query`` (B, Lq, E), ``key`` (B, Lk, Ek) or None (self-attention),
    ``keep`` (Lq, Lk) bool mask (True = may attend) or None."""

    name: str
    query: torch.Tensor
    key: Optional[torch.Tensor]
    keep: Optional[torch.Tensor]

    def describe(self, lang: str = "en") -> str:
        """The probe in words: "cross-attention, B=2, Lq=5, Lk=7" (or in Chinese)."""
        lk = self.query.shape[1] if self.key is None else self.key.shape[1]
        return say(f"probe_{self.name}", lang, B=self.query.shape[0], Lq=self.query.shape[1], Lk=lk)


def _tokens(n: int, length: int, features: int, seed: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, length, features, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)


def mask_keep(lq: int = LQ) -> torch.Tensor:
    """The mask probe's keep (Lq, Lq): causal, with row :data:`EMPTY_ROW` fully masked."""
    keep = torch.ones(lq, lq, dtype=torch.bool).tril()
    keep[EMPTY_ROW] = False
    return keep


def make_probes(d_in: int, kdim: int, dtype: torch.dtype, device: torch.device | str, *, cross: bool, mask: bool,
                causal: bool) -> list[Probe]:
    """The probes for a module taking ``d_in`` (query) and ``kdim`` (key) features: self, then
    cross (a second input; not for a causal module, whose mask is for one sequence), then mask
    (a mask argument)."""
    probes = [Probe("self", _tokens(BATCH, LQ, d_in, 0, dtype, device), None, None)]
    if cross and not causal:
        probes.append(Probe("cross", _tokens(BATCH, LQ, d_in, 1, dtype, device),
                            _tokens(BATCH, LK, kdim, 2, dtype, device), None))
    if mask:
        probes.append(Probe("mask", _tokens(BATCH, LQ, d_in, 3, dtype, device), None, mask_keep()))
    return probes


def _additive(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, -math.inf)


#: how a mask argument may be passed: (name, the convention in words' key, build(keep (Lq, Lk), dtype))
ENCODINGS: list[tuple[str, Callable[[torch.Tensor, torch.dtype], torch.Tensor]]] = [
    ("keep", lambda k, dt: k),
    ("block", lambda k, dt: ~k),
    ("additive", _additive),
    ("keep4d", lambda k, dt: k.expand(BATCH, 1, *k.shape)),
    ("block4d", lambda k, dt: (~k).expand(BATCH, 1, *k.shape)),
    ("additive4d", lambda k, dt: _additive(k, dt).expand(BATCH, 1, *k.shape)),
]
