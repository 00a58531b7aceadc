"""What a head attends to, computed from its weights: the head-pattern labels of ``explain --model``.

::

    scores = pattern_scores(weights, keep)    # weights (..., L, L), keep (..., L, L) bool or None
    labels = label_heads(scores)              # nested lists shaped like weights[..., 0, 0]

Every score is computed from the weights W (rows = queries i, columns = keys j, each row summing
to 1) and the mask (``keep``, True = query i may see key j), never assumed from the model's kind.
A row counts only where the score could be anything but trivial: a query that sees one key only
(the first query of a causal model) tells nothing, and neither does a "first token" weight of the
first query (it is its own weight). "Eligible rows" below are the queries with at least two visible
keys for which the target key is visible and, except for "itself", is not the query itself.

=============  ================================================  ==========  =====================
pattern        score (mean over the eligible rows i)             labelled    target key t(i)
=============  ================================================  ==========  =====================
first token    W[i, 0]                                           ≥ 0.5       0 ([CLS], <s>, BOS,
                                                                             or a decoder's sink)
previous       W[i, i-1]                                         ≥ 0.5       i - 1
itself         W[i, i]                                           ≥ 0.5       i
next           W[i, i+1]                                         ≥ 0.5       i + 1
last token     W[i, L-1]                                         ≥ 0.5       L - 1 ([SEP], </s>)
broad          entropy(W[i]) / log(visible keys of i)            ≥ 0.85      (all visible keys)
=============  ================================================  ==========  =====================

A pattern with no eligible row scores 0 (next and last token under a causal mask). A positional
label means that on average more than half of each query's attention goes to that one place;
"broad" that rows are close to uniform over what they may see (entropy at least 85% of the uniform
row's). A head passing several thresholds gets the one furthest above its own (largest
score / threshold); a head passing none is unlabelled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

__all__ = ["Pattern", "PATTERNS", "pattern_scores", "label_heads", "pattern_name", "pattern"]


@dataclass(frozen=True)
class Pattern:
    key: str
    code: str        # one letter in the overview grid
    threshold: float
    en: str
    zh: str


PATTERNS = (
    Pattern("first", "f", 0.5, "first token", "第一个 token"),
    Pattern("previous", "p", 0.5, "previous token", "前一个 token"),
    Pattern("self", "s", 0.5, "itself", "自身"),
    Pattern("next", "n", 0.5, "next token", "后一个 token"),
    Pattern("last", "l", 0.5, "last token", "最后一个 token"),
    Pattern("broad", "b", 0.85, "broad", "广泛"),
)
_BY_KEY = {p.key: p for p in PATTERNS}


def _check(weights: torch.Tensor, keep: Optional[torch.Tensor]) -> torch.Tensor:
    if not isinstance(weights, torch.Tensor) or weights.dim() < 2:
        raise TypeError(f"weights must be a (..., L, L) tensor, got {type(weights).__name__}")
    L = weights.shape[-1]
    if weights.shape[-2] != L or L < 2:
        raise ValueError(f"weights must be (..., L, L) with L >= 2, got shape {tuple(weights.shape)}")
    if keep is None:
        return torch.ones(weights.shape, dtype=torch.bool)
    if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool:
        raise TypeError(f"keep must be a bool tensor (True = may attend) or None, got {getattr(keep, 'dtype', keep)}")
    try:
        return keep.expand(weights.shape)
    except RuntimeError:
        raise ValueError(f"keep has shape {tuple(keep.shape)}, which does not broadcast to the weights' "
                         f"{tuple(weights.shape)}") from None


def pattern_scores(weights: torch.Tensor, keep: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
    """The score of every pattern in :data:`PATTERNS` for every head (the module docstring).

    Args:
        weights: (..., L, L), rows = queries, each row summing to 1; L ≥ 2.
        keep: bool, broadcastable to ``weights``: True where query i may see key j; None = all.

    Returns:
        {pattern key: (...) float32}.
    """
    keep = _check(weights, keep)
    w = weights.double()
    L = w.shape[-1]
    i = torch.arange(L)
    visible = keep.sum(-1)                       # (..., L)
    informative = visible >= 2

    def positional(target: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        idx = target.clamp(0, L - 1).expand(w.shape[:-1]).unsqueeze(-1)
        value = w.gather(-1, idx).squeeze(-1)
        seen = keep.gather(-1, idx).squeeze(-1)
        rows = seen & informative & valid
        n = rows.sum(-1)
        return torch.where(n > 0, (value * rows).sum(-1) / n.clamp_min(1), torch.zeros_like(n, dtype=w.dtype))

    plogp = torch.where(w > 0, w * w.clamp_min(1e-300).log(), torch.zeros_like(w))
    entropy = -plogp.sum(-1)
    norm = torch.where(informative, entropy / visible.clamp_min(2).double().log(), torch.zeros_like(entropy))
    n_inf = informative.sum(-1)
    broad = torch.where(n_inf > 0, norm.sum(-1) / n_inf.clamp_min(1), torch.zeros_like(n_inf, dtype=w.dtype))
    scores = {
        "first": positional(torch.zeros_like(i), i >= 1),
        "previous": positional(i - 1, i >= 1),
        "self": positional(i, torch.ones(L, dtype=torch.bool)),
        "next": positional(i + 1, i <= L - 2),
        "last": positional(torch.full_like(i, L - 1), i <= L - 2),
        "broad": broad,
    }
    return {k: v.float() for k, v in scores.items()}


def label_heads(scores: dict[str, torch.Tensor]) -> Any:
    """For each head, the :class:`Pattern` it shows (or None), as nested lists shaped like the scores
    (one Pattern or None for 0-d scores).

    A head passing several thresholds gets the pattern with the largest score / threshold.
    """
    shape = next(iter(scores.values())).shape
    ratio = torch.stack([scores[p.key].double() / p.threshold for p in PATTERNS], dim=-1)  # (..., patterns)
    best_ratio, best = ratio.max(dim=-1)
    flat = [PATTERNS[b] if r >= 1 else None for b, r in zip(best.flatten().tolist(), best_ratio.flatten().tolist())]

    def nest(items: list[Optional[Pattern]], dims: list[int]) -> Any:
        if not dims:
            return items[0]
        step = len(items) // dims[0]
        return [nest(items[k * step:(k + 1) * step], dims[1:]) for k in range(dims[0])]

    return nest(flat, list(shape))


def pattern_name(p: Optional[Pattern], lang: str, tokens: Optional[Sequence[str]] = None) -> str:
    """The label of ``p`` in ``lang`` ("en" or "zh"); first and last token name the token when
    ``tokens`` are given (``first token ([CLS])``); None reads "no clear pattern"."""
    if p is None:
        from .i18n import word

        return word("model.no_label", lang)
    name = p.en if lang == "en" else p.zh
    if tokens and p.key in ("first", "last"):
        name += f" ({tokens[0 if p.key == 'first' else -1]})"
    return name


def pattern(key: str) -> Pattern:
    """The :class:`Pattern` of ``key``."""
    if key not in _BY_KEY:
        raise ValueError(f"pattern must be one of {list(_BY_KEY)}, got {key!r}")
    return _BY_KEY[key]

