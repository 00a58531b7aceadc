"""Lines for a terminal: how many columns a line takes (wide CJK characters take two) and a
line cut to the width the model pages print at.

>>> from multihead.explain.text_width import display_width, fit
>>> display_width("注意 attention"), fit("x" * 120)[-3:]
(14, 'xx…')
"""

from __future__ import annotations

import unicodedata

__all__ = ["WIDTH", "display_width", "fit"]

#: terminal columns of a model page's text lines
WIDTH = 100


def display_width(line: str) -> int:
    """Terminal columns of ``line``: wide (CJK) characters take two."""
    return sum(2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1 for ch in line)


def fit(line: str) -> str:
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
