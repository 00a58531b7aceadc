"""The HTML page's own labels (headings, buttons, legends), in English and Chinese.

``UI[lang][key]``, which the page's script reads too: the "page." entries of the one table of
words, :mod:`multihead.explain.i18n` (where they are written, with every other word).
"""

from __future__ import annotations

from .i18n import LANGS, page_words

__all__ = ["LANGS", "UI"]

UI: dict[str, dict[str, str]] = page_words()
