"""Long texts for ``multihead explain --model``: chosen query rows and a per-head summary.

Past :data:`~multihead.explain.models.MAX_TOKENS` tokens the whole (L, L) views neither read
on a screen nor fit in memory (a 30-layer, 9-head model at 4096 tokens would hold 4.5 G weights).
Up to :data:`~multihead.explain.models.LONG_MAX_TOKENS` a long text is run with
:meth:`~multihead.explain.models.RealModel.run_rows`: each layer's output from the chunked
backend, and the weights of the chosen query rows only, p = exp(s - lse) from the saved
log-sum-exp, so memory grows as O(L) per head and row. What is shown:

* text: every head's summary over the rows (its top key and that key's mean weight), then the
  rows of ``--layer``/``--head`` (default layer 0, head 0) with their top keys;
* html: the rows of one layer (``--layer``, default 0) as an (R, L) heat map per head, and the
  per-head summary of every layer as a table.

::

    from multihead.explain import models
    from multihead.explain.long_input import long_text
    run = models.load("smollm2").run_rows(long_text_of_2000_tokens, rows=[1999])
    print("\\n".join(long_text(run)))

Shapes: L tokens, R chosen rows, H query heads.
"""

from __future__ import annotations

from html import escape
from typing import Any, Optional

from .i18n import word
from .models import MAX_TOKENS, LongRun
from .text_width import fit as _fit

__all__ = ["long_text", "long_maps", "summary_fragment"]

TOP = 5   # keys listed per row


def _t(key: str, lang: str, **kw: Any) -> str:
    return word("model.long." + key, lang, **kw)


def _heads_line(run: LongRun, lang: str) -> str:
    info = run.info
    if info.kv_heads < info.heads:
        groups = "; ".join(word("model.group", lang, j=j, qs=f"{g[0]}-{g[-1]}") for j, g in enumerate(info.kv_groups))
        return word("model.gqa", lang, kv=info.kv_heads, D=info.head_dim, groups=groups)
    return word("model.mha", lang, heads=info.heads, D=info.head_dim)


def _row_label(run: LongRun, r: int) -> str:
    return f"{r}:{run.tokens[r]}"


def long_text(run: LongRun, layer: Optional[int] = None, head: Optional[int] = None, lang: str = "en") -> list[str]:
    """The text report of a long run: header, what was computed, every head's summary over the
    rows, and the rows of ``layer``/``head`` (default 0/0; only one given: all of the other)
    with their :data:`TOP` keys."""
    info, L = run.info, len(run.tokens)
    s = run.summary()
    lines = [*word("model.header", lang, model=info.title, layers=info.layers, heads=info.heads, n=L).split("\n"),
             _t("what", lang, L=L, max=MAX_TOKENS, rows=", ".join(_row_label(run, r) for r in run.rows)),
             _heads_line(run, lang), "", _t("grid", lang),
             "      " + "".join(f"{'H' + str(h):>10}" for h in range(info.heads))]
    for l in range(info.layers):
        cells = [f"{int(s['top'][l, h])}:{float(s['top_weight'][l, h]):.2f}" for h in range(info.heads)]
        lines.append(_fit(f"  L{l:<3}" + "".join(f"{c:>10}" for c in cells)))
    if layer is None and head is None:
        shown = [(0, 0)]
    else:
        shown = [(l, h) for l in ([layer] if layer is not None else range(info.layers))
                 for h in ([head] if head is not None else range(info.heads))]
    w = run.weights
    for l, h in shown:
        lines += ["", _t("rows_title", lang, layer=l, head=h, entropy=float(s["entropy"][l, h]))]
        for i, r in enumerate(run.rows):
            best = w[l, h, i].topk(min(TOP, L))
            tops = ", ".join(f"{j}:{run.tokens[j]} {v:.2f}" for v, j in zip(best.values.tolist(), best.indices.tolist()))
            lines.append(_fit(f"{r:>5} {run.tokens[r][:10]:>10}  {tops}"))
    return lines


def long_maps(run: LongRun, layer: int, *, model: str, lang: str = "en") -> list[Any]:
    """The heat maps of ``layer`` at the chosen rows: one
    :class:`~multihead.explain.visual.HeadMaps` of weights (H, R, L), the rows' tokens on the
    query axis, each head labelled with its summary (top key, its mean weight, entropy)."""
    from .visual import HeadMaps

    s = run.summary()
    rec = run.layers[layer]
    keep = rec.keep

    def label(h: int, lg: str) -> str:
        j = int(s["top"][layer, h])
        return _t("head_label", lg, j=j, tok=run.tokens[j], w=float(s["top_weight"][layer, h]),
                  entropy=float(s["entropy"][layer, h]))

    return [HeadMaps(rec.weights, q_tokens=[run.tokens[r] for r in run.rows], k_tokens=list(run.tokens),
                     title=word("model.layer_title", lang, model=run.info.title, layer=layer, text=_short(run.text))
                     + " · " + _t("rows_note", lang, R=len(run.rows), L=len(run.tokens)),
                     keep=None if bool(keep.all()) else keep,
                     head_labels={lg: [label(h, lg) for h in range(rec.weights.shape[0])] for lg in ("en", "zh")})]


def _short(text: str, n: int = 60) -> str:
    return text if len(text) <= n else text[:n - 1] + "…"


def summary_fragment(run: LongRun) -> Any:
    """Every layer x head's summary over the rows as a table, a section of the page
    (:class:`~multihead.explain.visual.Fragment`) in both languages."""
    from .visual import Fragment

    s = run.summary()
    info = run.info

    def table(lg: str) -> str:
        head_row = "".join(f"<th>H{h}</th>" for h in range(info.heads))
        body = []
        for l in range(info.layers):
            cells = []
            for h in range(info.heads):
                j = int(s["top"][l, h])
                tip = escape(_t("head_label", lg, j=j, tok=run.tokens[j], w=float(s["top_weight"][l, h]),
                                entropy=float(s["entropy"][l, h])), quote=True)
                cells.append(f'<td title="{tip}">{j}: {float(s["top_weight"][l, h]):.2f}</td>')
            body.append(f"<tr><th>L{l}</th>{''.join(cells)}</tr>")
        return (f"<p>{escape(_t('grid', lg))}</p><table class=\"mh-long\"><tr><th></th>{head_row}</tr>"
                f"{''.join(body)}</table>")

    html = "".join(f'<div data-l="{lg}" lang="{lg}">{table(lg)}</div>' for lg in ("en", "zh"))
    return Fragment("long-summary", {lg: _t("section", lg) for lg in ("en", "zh")}, html)
