"""Tensor blocks as inline SVG: one drawing per trace step, its input(s) -> its output.

A tensor is drawn as a block: the last axis runs across the front face, the one before it down
the face, the third-last axis is the depth of the stack behind it, and any axes before those are
written as a multiplier on the left ("b = 2 ×"). Every side carries its axis name and size. A
grouped axis such as ``(h d)`` is striped into its first factor's parts, so a head split can be
seen before it happens.

A step with an einops-style pattern draws its input operand(s) from the pattern's left side, an
arrow, and the output; the arrow is dashed for a view (no data moved) and solid otherwise. The
sizes of the input axes come from the step's own output axes and the trace's config.
"""

from __future__ import annotations

import re
from html import escape
from math import prod

__all__ = ["axis_sizes", "parse_pattern", "step_kind", "step_svg"]

_CELL = 18
_MAX_W = 180
_MAX_H = 126
_DEPTH_STEP = 10
_CHAR_W = 7.3  # width of one character of the 12 px monospace labels
_ROW_LABEL_W = 16
_MAX_LAYERS = 4
_MAX_STRIPES = 16
_PAD = 6

_COLORS = {"Q": "#3b7dd8", "K": "#e08a1e", "V": "#3a9a5b", "scores": "#8e5cc2", "": "#6b7785"}


def step_kind(step) -> str:
    """"view" (no data moved), "copy" (a layout change that moved data) or "compute" (a new tensor
    from arithmetic: projections, products, softmax, ...)."""
    if step.view:
        return "view"
    return "copy" if step.pattern and "," not in step.pattern else "compute"


def _role(step) -> str:
    if step.role in ("Q", "K", "V"):
        return step.role
    if step.axes[-2:] == ("q", "k"):
        return "scores"
    return ""


def axis_sizes(trace, step) -> dict[str, int]:
    """Sizes of every axis letter the step's pattern may name: the trace's config, the query and
    key lengths of the scores, then the step's own output axes (which win)."""
    cfg = trace.config
    sizes: dict[str, int] = {}
    heads, kv_heads = cfg.get("num_heads"), cfg.get("num_kv_heads")
    if heads:
        sizes["h"] = heads
    if kv_heads:
        sizes["hkv"] = kv_heads
        if heads:
            sizes["g"] = heads // kv_heads
    if cfg.get("head_dim"):
        sizes["d"] = cfg["head_dim"]
    for s in trace.steps:
        if s.axes[-2:] == ("q", "k"):
            sizes.update(b=s.shape[0], q=s.shape[-2], k=s.shape[-1])
            break
    sizes.update(zip(step.axes, step.shape))
    return sizes


_TOKEN = re.compile(r"\(([^)]*)\)|(\S+)")


def parse_pattern(pattern: str) -> tuple[list[list[tuple[str, ...]]], list[tuple[str, ...]]]:
    """``"b t (h d) -> b t h d"`` -> ``([[("b",), ("t",), ("h", "d")]], [("b",), ("t",), ("h",), ("d",)])``.

    Each axis is a tuple of names (more than one for a group); the left side may list several
    operands separated by commas.
    """
    left, right = pattern.split("->")

    def axes(text):
        return [tuple(m.group(1).split()) if m.group(1) is not None else (m.group(2),) for m in _TOKEN.finditer(text)]

    return [axes(op) for op in left.split(",")], axes(right)


def _label(names: tuple[str, ...], sizes: dict[str, int]) -> tuple[str, int]:
    if len(names) == 1:
        return f"{names[0]} = {sizes[names[0]]}", sizes[names[0]]
    parts = "·".join(str(sizes[n]) for n in names)
    return f"({' '.join(names)}) = {parts}", prod(sizes[n] for n in names)


def _text(x, y, s, *, anchor="middle", rotate=False, cls="ax") -> str:
    rot = f' transform="rotate(-90 {x:.1f} {y:.1f})"' if rotate else ""
    return f'<text class="{cls}" x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}"{rot}>{escape(s)}</text>'


def _block(axes: list[tuple[str, ...]], sizes: dict[str, int], x: float, color: str, top: float) -> tuple[str, float, float]:
    """SVG for one tensor at left edge ``x``; returns (svg, width, height)."""
    labelled = [_label(a, sizes) for a in axes]
    cols_label, cols = labelled[-1]
    rows_label, rows = labelled[-2] if len(labelled) >= 2 else ("", 1)
    depth_label, depth = labelled[-3] if len(labelled) >= 3 else ("", 1)
    outer = labelled[:-3]
    w = min(max(cols * _CELL, _CELL), _MAX_W)
    h = min(max(rows * _CELL, _CELL), _MAX_H)
    layers = min(depth, _MAX_LAYERS)
    dz = _DEPTH_STEP * (layers - 1)
    out = []
    fx, fy = x, top + 18 + dz  # front face, top-left; 18 px above for the top label
    if outer:
        text = " × ".join(lbl for lbl, _ in outer) + " ×"
        out.append(_text(x, fy + h / 2 + 4, text, anchor="start", cls="ax outer"))
        fx += _CHAR_W * len(text) + _PAD
    if rows_label:
        fx += _ROW_LABEL_W
    for i in range(layers - 1, 0, -1):  # the stack behind, farthest first
        out.append(
            f'<rect x="{fx + i * _DEPTH_STEP:.1f}" y="{fy - i * _DEPTH_STEP:.1f}" width="{w:.1f}" height="{h:.1f}" '
            f'fill="{color}" fill-opacity="{0.18 + 0.06 * (layers - i)}" stroke="{color}"/>'
        )
    out.append(f'<rect x="{fx:.1f}" y="{fy:.1f}" width="{w:.1f}" height="{h:.1f}" fill="{color}" fill-opacity="0.35" stroke="{color}" stroke-width="1.5"/>')
    if cols * _CELL <= _MAX_W and cols > 1:
        for c in range(1, cols):
            out.append(f'<line x1="{fx + c * _CELL:.1f}" y1="{fy:.1f}" x2="{fx + c * _CELL:.1f}" y2="{fy + h:.1f}" class="grid"/>')
    if rows * _CELL <= _MAX_H and rows > 1:
        for r in range(1, rows):
            out.append(f'<line x1="{fx:.1f}" y1="{fy + r * _CELL:.1f}" x2="{fx + w:.1f}" y2="{fy + r * _CELL:.1f}" class="grid"/>')
    group = axes[-1]
    if len(group) > 1 and 1 < sizes[group[0]] <= _MAX_STRIPES:  # stripe a grouped last axis into its first factor
        n = sizes[group[0]]
        for i in range(n):
            out.append(
                f'<rect x="{fx + i * w / n:.1f}" y="{fy:.1f}" width="{w / n:.1f}" height="{h:.1f}" '
                f'fill="{color}" fill-opacity="{0.25 if i % 2 else 0.0}" stroke="{color}" stroke-width="2"/>'
            )
    out.append(_text(fx + w / 2 + dz, fy - dz - 5, cols_label))  # along the top of the farthest layer
    if rows_label:
        out.append(_text(fx - 5, fy + h / 2, rows_label, rotate=True))
    if depth_label:
        out.append(_text(fx + w + dz + 4, fy - dz + 10, depth_label, anchor="start", cls="ax depth"))
    width = (fx - x) + w + dz + (_CHAR_W * len(depth_label) + 8 if depth_label else 0)
    width = max(width, (fx - x) + _CHAR_W * len(cols_label) / 2 + w / 2 + dz)
    height = 18 + dz + h + 6
    return "".join(out), width, height


def _operand_color(step, op, i: int, n: int, color: str) -> str:
    """One input keeps the step's colour; of two (a product), the scores, Q, K and V get theirs."""
    if n == 1:
        return color
    names = [a[0] for a in op]
    if names[-2:] == ["q", "k"]:
        return _COLORS["scores"]
    if i == 0:
        return _COLORS["Q"]
    return _COLORS["K"] if _role(step) == "scores" else _COLORS["V"]


def step_svg(step, sizes: dict[str, int]) -> str:
    """The drawing of one step, a ``<div class="figure">`` of SVG pieces that wrap on a narrow
    screen: input block(s), arrow, output block for a pattern step; else the output alone."""
    color = _COLORS[_role(step)]
    operands: list[list[tuple[str, ...]]] = []
    out_axes: list[tuple[str, ...]] = [(a,) for a in step.axes]
    if step.pattern:
        try:
            operands, right = parse_pattern(step.pattern)
        except ValueError:  # not an "a b -> c d" pattern: draw the output alone
            operands, right = [], []
        if any(n not in sizes for op in operands for group in op for n in group):
            operands = []  # an input axis of unknown size: draw the output alone
        if [prod(sizes.get(n, 0) for n in g) for g in right] == list(step.shape):
            out_axes = right  # the pattern's own output names, groups included: "(h d)", "(hkv g)"
    if not out_axes:
        out_axes = [(f"#{i}",) for i in range(len(step.shape))]
        sizes = {**sizes, **{f"#{i}": n for i, n in enumerate(step.shape)}}
    pieces: list[str] = []
    for i, op in enumerate(operands):
        pieces.append(_svg(*_block(op, sizes, _PAD, _operand_color(step, op, i, len(operands), color), 4)))
        if i < len(operands) - 1:
            pieces.append('<span class="sep">,</span>')
    if operands:
        kind = step_kind(step)
        dash = ' stroke-dasharray="5 4"' if kind == "view" else ""
        pieces.append(
            f'<svg class="arrow {kind}" viewBox="0 0 56 16" width="56" height="16" aria-hidden="true">'
            f'<line x1="4" y1="8" x2="44" y2="8"{dash}/><path d="M44,3 L52,8 L44,13 z"/></svg>'
        )
    pieces.append(_svg(*_block(out_axes, sizes, _PAD, color, 4)))
    label = escape(f"{step.label}: shape ({', '.join(str(n) for n in step.shape)})", quote=True)
    return f'<div class="figure" role="img" aria-label="{label}">{"".join(pieces)}</div>'


def _svg(body: str, width: float, height: float) -> str:
    w, h = width + 2 * _PAD, height + 8
    return f'<svg class="blocks" viewBox="0 0 {w:.0f} {h:.0f}" width="{w:.0f}" height="{h:.0f}">{body}</svg>'
