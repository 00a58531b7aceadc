"""A grid of per-head attention heat maps with matplotlib (the ``viz`` extra).

Uses ``matplotlib.figure.Figure`` directly (no pyplot, no global state, no display needed).
Legend: H heads, Lq/Lk query/key lengths.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

from . import UsageError

__all__ = ["require_matplotlib", "heads_figure", "png_bytes", "save_heads_png"]

_MAX_COLS = 4
_ANNOTATE_UP_TO = 12  # print the value in each cell when both lengths are at most this


def require_matplotlib() -> None:
    """Raise UsageError (one line, exit 2) when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--format png needs matplotlib: install multihead[viz] (pip install 'multihead[viz]')") from None


def _tick_labels(tokens, n: int) -> list[str]:
    if tokens is None:
        return [str(i) for i in range(n)]
    return [t.replace("$", r"\$") for t in tokens]  # a '$' would start mathtext


def heads_figure(maps):
    """A matplotlib Figure with one heat map per head of ``maps`` (a :class:`HeadMaps`).

    Rows are queries, columns keys; colour 0..1 shared by all panels; each cell's value is
    printed when the maps are small enough to read; blocked cells (mask 0) are marked ×.
    Panel titles are "head h", followed by the head's English label when the maps have labels.
    """
    require_matplotlib()
    from matplotlib.figure import Figure

    weights = maps.weights.detach().float().cpu()
    H, Lq, Lk = weights.shape
    ncols = min(H, _MAX_COLS)
    nrows = math.ceil(H / ncols)
    longest = max((len(t) for t in (maps.k_tokens or []) + list(maps.q_tokens or [])), default=2)
    panel = max(2.6, min(6.0, 0.42 * max(Lq, Lk) + 0.09 * longest + 1.0))
    fig = Figure(figsize=(ncols * panel + 1.2, nrows * panel + 0.8), dpi=130, layout="constrained")
    grid = fig.subplots(nrows, ncols, squeeze=False)
    annotate = Lq <= _ANNOTATE_UP_TO and Lk <= _ANNOTATE_UP_TO
    q_labels, k_labels = _tick_labels(maps.q_tokens, Lq), _tick_labels(maps.k_tokens, Lk)
    image = None
    for h, ax in enumerate(grid.flat):
        if h >= H:
            fig.delaxes(ax)
            continue
        image = ax.imshow(weights[h].numpy(), vmin=0.0, vmax=1.0, cmap="Blues", aspect="equal")
        label = maps.head_label(h)  # English: the default font has no CJK glyphs
        ax.set_title(f"head {h} · {label}" if label else f"head {h}")
        ax.set_xticks(range(Lk), labels=k_labels, rotation=90 if maps.k_tokens is not None else 0)
        ax.set_yticks(range(Lq), labels=q_labels)
        ax.set_xlabel("key")
        ax.set_ylabel("query")
        if annotate:
            for i in range(Lq):
                for j in range(Lk):
                    blocked = maps.keep is not None and not bool(maps.keep[h, i, j])
                    v = float(weights[h, i, j])
                    ax.text(j, i, "×" if blocked else f"{v:.2f}", ha="center", va="center", fontsize=8,
                            color="#999999" if blocked else ("white" if v > 0.55 else "#1a1a1a"))
    fig.colorbar(image, ax=list(grid.flat[:H]), shrink=0.8, label="weight")
    if maps.title:
        fig.suptitle(maps.title, fontsize=10)
    return fig


def png_bytes(maps) -> bytes:
    """:func:`heads_figure` of ``maps`` as the bytes of a PNG file."""
    buffer = io.BytesIO()
    heads_figure(maps).savefig(buffer, format="png")
    return buffer.getvalue()


def save_heads_png(maps, path) -> Path:
    """Write :func:`heads_figure` of ``maps`` to ``path`` as PNG."""
    path = Path(path)
    path.write_bytes(png_bytes(maps))
    return path
