"""Inline display in Jupyter: the walkthrough page inside an ``<iframe srcdoc>``.

The HTML page (:func:`.visual.render_html`) carries its own stylesheet, script, element ids and
language switch. Put straight into a notebook's output, its CSS would restyle the notebook, its
ids would clash with a second walkthrough's in the next cell, and its language toggle would hide
the notebook's own text. So the notebook gets an ``<iframe>`` whose ``srcdoc`` attribute is the
whole page, HTML-escaped (``& < > " '``): the browser reads it as a separate document, and
``sandbox="allow-scripts"`` (no ``allow-same-origin``) lets the page's script run but not reach
the notebook's page, its cookies or its storage.

Legend: B batch, H query heads, Lq/Lk query/key lengths.
"""

from __future__ import annotations

from html import escape
from typing import Optional

from ..trace import Trace

__all__ = ["DEFAULT_HEIGHT", "iframe", "trace_page", "trace_html"]

#: pixels; the frame scrolls inside itself for a longer page
DEFAULT_HEIGHT = 720


def iframe(page: str, *, height: int = DEFAULT_HEIGHT, title: str = "multihead walkthrough") -> str:
    """``page`` (a whole HTML document) as one ``<iframe>`` element for a notebook output.

    height: the frame's height in CSS pixels (a positive int); the width follows the cell.
    """
    if not isinstance(page, str):
        raise TypeError(f"page must be the HTML text of a page (str), got {type(page).__name__}")
    if isinstance(height, bool) or not isinstance(height, int) or height <= 0:
        raise ValueError(f"height must be a positive number of pixels (int), got {height!r}")
    return (
        f'<iframe class="multihead-walkthrough" title="{escape(title, quote=True)}" '
        f'sandbox="allow-scripts" style="width: 100%; height: {height}px; border: 1px solid #dde2e8; '
        f'border-radius: 6px;" srcdoc="{escape(page, quote=True)}"></iframe>'
    )


def trace_page(trace: Trace, *, lang: str = "en") -> str:
    """The HTML page of a recorded :class:`multihead.Trace`: its steps and checks, and the
    heat maps when the trace holds the reference backend's scores and weights (a fused backend
    records one step and no weights; :func:`multihead.explain` re-runs it to open it up) and
    they fit a page (at most 64 query and key tokens)."""
    from . import visual

    if not isinstance(trace, Trace):
        raise TypeError(f"trace must be a multihead.Trace, got {type(trace).__name__}")
    maps: list["visual.HeadMaps"] = []
    found = visual.attention_steps(trace)
    if trace.keep_values and found is not None and _fits_a_page(found.raw.shape):
        maps = visual.head_maps_from_trace(trace)
    return visual.render_html(trace, maps, lang=lang)


def trace_html(trace: Trace, *, lang: str = "en", height: Optional[int] = None) -> str:
    """What ``Trace._repr_html_`` shows: :func:`trace_page` in an :func:`iframe`."""
    return iframe(trace_page(trace, lang=lang), height=DEFAULT_HEIGHT if height is None else height)


def _fits_a_page(scores_shape: tuple[int, ...]) -> bool:
    """Whether the heat maps of scores (B, H, Lq, Lk) fit the page (:data:`.example.LIMITS`);
    past that the page shows the steps and checks without them."""
    from math import prod

    from .example import LIMITS

    limit = LIMITS["html"]
    return max(scores_shape[-2:]) <= limit.tokens and prod(scores_shape) <= limit.scores
