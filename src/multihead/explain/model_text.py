"""A real model's run told as text (``multihead explain --model`` without ``--format``): heat maps of
attention weights in shade characters, the grid of head patterns, the strongest heads, and the
summary of what the model is as the run showed it.

    >>> from multihead.explain.model_text import display_width
    >>> display_width("注意力"), display_width("head")      # wide characters take two columns
    (6, 4)
"""

from __future__ import annotations

import unicodedata
from typing import Optional

import torch

from .i18n import word
from .layer_attention import layer_words, lines as attention_lines
from .patterns import PATTERNS, label_heads, pattern_name, pattern_scores
from .records import RealRun

__all__ = ["DEFAULT_TEXT", "WIDTH", "render_heatmap", "display_width", "model_summary"]

#: the sentence explain runs a model on when none is given
DEFAULT_TEXT = "The animal didn't cross the street because it was too tired"
WIDTH = 100


def _t(key: str, lang: str, **kw) -> str:
    return word("model." + key, lang, **kw)


def _scores_and_labels(real: RealRun):
    scores = pattern_scores(real.weights, real.keep)
    return scores, label_heads(scores)


def _or(value: Optional[int], default: int) -> int:
    return default if value is None else value


_SHADES = ((0.05, "·"), (0.15, "░"), (0.35, "▒"), (0.60, "▓"), (float("inf"), "█"))


def _shade(x: float) -> str:
    return next(ch for limit, ch in _SHADES if x < limit)


def display_width(line: str) -> int:
    """Terminal columns of ``line``: wide (CJK) characters take two."""
    return sum(2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1 for ch in line)


def _fit(line: str) -> str:
    """``line`` cut to :data:`WIDTH` terminal columns, ending in … when cut."""
    if display_width(line) <= WIDTH:
        return line
    out, used = [], 0
    for ch in line:
        w = display_width(ch)
        if used + w > WIDTH - 1:
            break
        out.append(ch)
        used += w
    return "".join(out) + "…"


def render_heatmap(tokens: list[str], w: torch.Tensor, title: str, *, top: int = 2,
                   keep: Optional[torch.Tensor] = None) -> list[str]:
    """Lines of a text heat map of one head, at most :data:`WIDTH` columns.

    w (L, L): rows = queries, one shaded cell per key (two characters wide up to 24 tokens; blank
    where ``keep`` (L, L) bool says the key is masked),
    then each row's ``top`` most attended keys with at least 0.05 of its weight, as ``j:token w``.
    Column numbers are the key positions, printed as a tens line and a units line.
    """
    L = len(tokens)
    cell = 2 if L <= 24 else 1
    pad = " " * 14  # "12 tokenname__"
    lines = [title]
    if L > 10:
        lines.append(pad + "".join((str(j // 10) if j >= 10 else " ").rjust(cell) for j in range(L)))
    lines.append(pad + "".join(str(j % 10).rjust(cell) for j in range(L)))
    for i, tok in enumerate(tokens):
        row = w[i]
        cells = "".join((_shade(float(x)) if keep is None or keep[i, j] else " ") * cell for j, x in enumerate(row))
        best = torch.topk(row, min(top, L))
        tops = ", ".join(f"{j}:{tokens[j]} {v:.2f}" for v, j in zip(best.values.tolist(), best.indices.tolist())
                         if v >= 0.05)
        lines.append(_fit(f"{i:>2} {tok[:10]:>10} " + cells + "  " + tops))
    return lines


def _token_list(tokens: list[str]) -> list[str]:
    lines, cur = [], ""
    for j, tok in enumerate(tokens):
        item = f"{j}:{tok}"
        if cur and len(cur) + 1 + len(item) > WIDTH - 2:
            lines.append("  " + cur)
            cur = item
        else:
            cur = f"{cur} {item}" if cur else item
    lines.append("  " + cur)
    return lines


def _head_title(layer: int, head: int, labels, scores, lang: str, tokens) -> str:
    p = labels[layer][head]
    name = pattern_name(p, lang, tokens)
    score = f" {float(scores[p.key][layer, head]):.2f}" if p is not None else ""
    return f"{_t('map_title', lang, layer=layer, head=head)} · {name}{score}"


def _scores_line(layer: int, head: int, scores, lang: str) -> str:
    parts = [f"{pattern_name(p, lang)} {float(scores[p.key][layer, head]):.2f}" for p in PATTERNS]
    return _fit(_t("scores", lang) + " " + " · ".join(parts))


def _grid(scores, labels, layers: list[int], heads: int, lang: str, tokens) -> list[str]:
    lines = [_t("grid", lang), "      " + "".join(f"{'H' + str(h):>6}" for h in range(heads))]
    for layer in layers:
        cells = []
        for h in range(heads):
            p = labels[layer][h]
            cells.append(f"{p.code}{float(scores[p.key][layer, h]):.2f}" if p is not None else "·")
        lines.append(f"  L{layer:<3}" + "".join(f"{c:>6}" for c in cells))
    items = [f"{p.code} = {pattern_name(p, lang, tokens)}" for p in PATTERNS]
    cur = f"  {_t('legend_codes', lang)}"
    for item in items:
        if display_width(cur + "  " + item) > WIDTH:
            lines.append(cur)
            cur = "   "
        cur += "  " + item
    lines.append(cur)
    lines += ["  " + part for part in _t("thresholds", lang).split("\n")]
    return lines


def _strongest(scores, labels, layers: list[int], heads: list[int]):
    """For each pattern present among the labels, the (layer, head) with the highest score."""
    found = []
    for p in PATTERNS:
        cands = [(float(scores[p.key][l, h]), l, h) for l in layers for h in heads if labels[l][h] is p]
        if cands:
            score, l, h = max(cands)
            found.append((p, l, h, score))
    return found


def model_summary(real: RealRun, lang: str = "en") -> list[str]:
    """Lines saying what the model is, as this run showed it (:mod:`.layer_attention`): each
    kind of layer's mask (causal, sliding window, local, chunked; "decoder"/"encoder" when every
    layer is alike), softcap, sinks, q/k norm, the scale where it is not 1/√D on the scores, its
    heads and key/value heads (which query heads share which kv head), its rotary embedding
    (per layer type where the config gives one per type)."""
    info = real.info
    roles = [r.role for r in real.layers]
    if any(role != "self" for role in roles):   # an encoder-decoder: its three kinds of attention
        lines = [_t("encdec", lang)]
        for role in ("encoder", "decoder", "cross"):
            ids = [i for i, r in enumerate(roles) if r == role]
            if ids:
                kinds = attention_lines([real.layers[i].attention for i in ids], lang)
                what = kinds[0].split(": ", 1)[-1].split("：", 1)[-1] if len(kinds) == 1 or not kinds[1].startswith("  ") \
                    else _t("mixed", lang)
                lines.append("  " + _t("role_" + role, lang, which=layer_words(ids, lang), mask=what))
        found = attention_lines([r.attention for r in real.layers], lang)[1:]
        found = [x for x in found if not x.startswith("  ")]
        lines.append(_t("gqa", lang, kv=info.kv_heads, D=info.head_dim, groups="; ".join(
            _t("group", lang, j=j, qs=f"{g[0]}-{g[-1]}") for j, g in enumerate(info.kv_groups)))
            if info.kv_heads < info.heads else _t("mha", lang, heads=info.heads, D=info.head_dim))
        return [_fit(line) for line in lines + found]
    found = attention_lines([r.attention for r in real.layers], lang)
    lines = found[:1]
    if info.kv_heads < info.heads:
        groups = "; ".join(_t("group", lang, j=j, qs=f"{g[0]}-{g[-1]}") for j, g in enumerate(info.kv_groups))
        gqa = [_t("gqa", lang, kv=info.kv_heads, D=info.head_dim, groups=groups)]
    else:
        gqa = [_t("mha", lang, heads=info.heads, D=info.head_dim)]
    rest = found[1:]
    per_layer = [x for x in rest if x.startswith("  ")]
    lines += per_layer + gqa + [x for x in rest if not x.startswith("  ")]
    rope = info.rope
    if rope is not None and rope.get("base") is not None:
        lines.append(_t("rope", lang, type=rope["type"], base=float(rope["base"])))
    elif rope is not None and rope.get("per_type"):
        for kind, params in rope["per_type"].items():
            layers = [i for i, t in enumerate(rope.get("layer_types", ())) if t == kind]
            lines.append(_t("rope_type", lang, kind=kind, type=params.get("rope_type", "default"),
                            base=float(params.get("rope_theta") or 0.0), layers=", ".join(map(str, layers)) or "-"))
    return [_fit(line) for line in lines]
