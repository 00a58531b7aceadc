"""Does a user's tensor hold a reference step's values, in a layout a correct implementation may use?

    >>> import torch
    >>> from multihead.diagnosis.layouts import find_form
    >>> ref = torch.randn(2, 3, 5, 4)                       # (b, h, t, d)
    >>> mine = ref.permute(0, 2, 1, 3)                      # heads last: (b, t, h, d)
    >>> find_form(mine, ref, ("b", "h", "t", "d"), tol=1e-9)
    'b t h d'
    >>> find_form(ref.reshape(2, 5, 3, 4), ref, ("b", "h", "t", "d"), tol=1e-9) is None   # a view, no transpose
    True

A layout is a permutation of the reference's axes in which some adjacent axes may be merged:
batch and heads in either order (``(b h) t d`` as nn.MultiheadAttention keeps them), or batch
and tokens (sequence-first code). A per-head loop's tensors are one head of the reference
(``head 1: b t d``). Heads and head features are never merged here: ``b t (h d)`` is the
projection or the merged output, a stage of its own. Values are compared after undoing the
layout, within ``tol``, on the rows that ``rows`` keeps (a query with no visible key is a
matter of convention, judged apart).

Legend: b batch, h heads, t tokens, d head dim, q query tokens, k key tokens, f features.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Callable, Iterator, Optional, Sequence

import torch

__all__ = ["find_form", "forms", "close"]

_MERGEABLE = {("b", "h"), ("h", "b"), ("b", "t"), ("t", "b"), ("b", "q"), ("q", "b")}


def forms(axes: Sequence[str], sizes: Sequence[int]) -> Iterator[tuple[tuple[str, ...], tuple[int, ...], list[tuple[str, ...]]]]:
    """Every allowed layout of ``axes``: (permutation, the user's shape, the axis groups)."""
    return iter([f[:3] for f in _forms(tuple(axes), tuple(int(s) for s in sizes))])


@functools.lru_cache(maxsize=256)
def _forms(axes: tuple[str, ...], sizes: tuple[int, ...]) -> list[tuple[tuple[str, ...], tuple[int, ...], list[tuple[str, ...]], tuple[int, ...]]]:
    size = dict(zip(axes, sizes))
    out = []
    for perm in itertools.permutations(axes):
        groups_options: list[list[tuple[str, ...]]] = [[(a,) for a in perm]]
        for i in range(len(perm) - 1):
            if (perm[i], perm[i + 1]) in _MERGEABLE:
                g: list[tuple[str, ...]] = [(a,) for a in perm[:i]]
                g += [(perm[i], perm[i + 1])] + [(a,) for a in perm[i + 2:]]
                groups_options.append(g)
        for groups in groups_options:
            shape = tuple(math.prod(size[a] for a in g) for g in groups)
            out.append((perm, shape, groups, _squeezed(shape)))
    return out


def close(got: torch.Tensor, ref: torch.Tensor, tol: float) -> bool:
    """Equal within ``tol`` (NaN equals NaN only where both are; inf where both are the same)."""
    if got.shape != ref.shape:
        return False
    if got.numel() == 0:
        return True
    both_inf = torch.isinf(got) & torch.isinf(ref) & (torch.sign(got) == torch.sign(ref))
    both_nan = torch.isnan(got) & torch.isnan(ref)
    diff = (got - ref).abs().masked_fill(both_inf | both_nan, 0)
    return bool((diff <= tol).all())


def _squeezed(shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(s for s in shape if s != 1)


def _describe(groups: list[tuple[str, ...]]) -> str:
    return " ".join(g[0] if len(g) == 1 else "(" + " ".join(g) + ")" for g in groups)


def find_form(got: torch.Tensor, ref: torch.Tensor, axes: Sequence[str], *, tol: float,
              rows: Optional[torch.Tensor] = None, row_axis: Optional[str] = None, per_head: bool = False,
              compare: Optional[Callable[[torch.Tensor, torch.Tensor], bool]] = None) -> Optional[str]:
    """The layout (e.g. ``'b t h d'``, ``'(b h) t d'``, ``'head 1: b t d'``) in which ``got``
    equals ``ref`` (whose axes are ``axes``), or None. ``rows`` (bool, the size of
    ``row_axis``) keeps the rows compared; ``per_head`` also tries each head of an ``h`` axis
    alone; ``compare(canonical, ref)`` replaces :func:`close`."""
    if not got.is_floating_point() or got.numel() == 0:
        return None
    candidates: list[tuple[str, torch.Tensor, tuple[str, ...]]] = [("", ref, tuple(axes))]
    if per_head and "h" in axes and ref.shape[list(axes).index("h")] > 1:
        hx = list(axes).index("h")
        rest = tuple(a for a in axes if a != "h")
        candidates += [(f"head {i}: ", ref.select(hx, i), rest) for i in range(ref.shape[hx])]
    target = _squeezed(got.shape)
    for label, r, names in candidates:
        if got.numel() != r.numel():
            continue
        for perm, shape, groups, squeezed in _forms(names, tuple(r.shape)):
            if squeezed != target:
                continue
            full = tuple(r.shape[names.index(a)] for a in perm)
            canon = got.reshape(full).permute([perm.index(a) for a in names])
            want = r
            if rows is not None and row_axis in names and not bool(rows.all()):
                ax = names.index(row_axis)
                canon, want = canon.index_select(ax, rows.nonzero().flatten()), r.index_select(ax, rows.nonzero().flatten())
            ok = compare(canon, want) if compare is not None else close(canon, want, tol)
            if ok:
                return label + _describe(groups)
    return None
