"""Progress of slow work (loading a model, dequantising it, building a page), on stderr.

::

    with progress("de-quantising SmolLM2", total=272) as bar:
        for tensor in tensors:
            ...
            bar.update()

What is shown depends on where stderr goes:

=====================  ===============================================================
stderr                 shown
=====================  ===============================================================
a terminal             one bar, redrawn in place (at most 10 times a second), then one
                       line with the time taken
a notebook (IPython    one light line: the task's name when it starts, "done (N s)"
kernel)                when it ends; no bar, no redraws
a pipe or a file       nothing
=====================  ===============================================================

:func:`quiet` (the CLI's ``--quiet``) or the environment variable ``MULTIHEAD_PROGRESS=0`` turn
it off; ``MULTIHEAD_PROGRESS=1`` turns the terminal bar on whatever stderr is (for tests).
A task started inside another shows as the outer bar's note ("de-quantising 12/272"): one
bar, the one the user waits on.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Iterable, Iterator, Optional, TextIO, TypeVar

__all__ = ["Progress", "progress", "track", "quiet", "mode"]

T = TypeVar("T")
_WIDTH = 24          # characters of the bar itself
_REDRAW_S = 0.1      # the least time between two redraws
_state = threading.local()
_quiet = False


def mode(stream: Optional[TextIO] = None) -> str:
    """``"bar"``, ``"line"`` (a notebook) or ``"off"`` for ``stream`` (default ``sys.stderr``)."""
    setting = os.environ.get("MULTIHEAD_PROGRESS", "")
    if _quiet or setting == "0":
        return "off"
    if setting == "1":
        return "bar"
    stream = sys.stderr if stream is None else stream
    if stream is None:
        return "off"
    try:
        if stream.isatty():
            return "bar"
    except (AttributeError, ValueError):   # a closed or odd stream
        return "off"
    return "line" if "ipykernel" in sys.modules and type(stream).__name__ == "OutStream" else "off"


@contextlib.contextmanager
def quiet(on: bool = True) -> Iterator[None]:
    """No progress output inside the block (``on=False``: the default rules again)."""
    global _quiet
    before, _quiet = _quiet, on
    try:
        yield
    finally:
        _quiet = before


class Progress:
    """One task: ``update(n)`` after each unit of work (``total`` units, or unknown: None).
    Use :func:`progress` to make one; it is also a no-op object when output is off or nested."""

    def __init__(self, what: str, total: Optional[int] = None, stream: Optional[TextIO] = None):
        self.what, self.total, self.done = what, total, 0
        self._stream = sys.stderr if stream is None else stream
        self._outer: Optional[Progress] = getattr(_state, "active", None)
        self._mode = mode(self._stream) if self._outer is None else "nested"
        self._start = self._drawn = time.monotonic()
        self._width = 0

    def __enter__(self) -> "Progress":
        if self._mode in ("bar", "line"):
            _state.active = self
            if self._mode == "line":
                self._write(f"{self.what} ...")
            else:
                self._draw()
        return self

    def update(self, n: int = 1, note: str = "") -> None:
        """``n`` more units done; ``note`` (short) is shown after the count."""
        self.done += n
        if self._mode == "nested" and self._outer is not None:
            count = f"{self.done}/{self.total}" if self.total else f"{self.done}"
            self._outer.update(0, note=f"{self.what}: {note or count}")
        elif self._mode == "bar":
            now = time.monotonic()
            if now - self._drawn >= _REDRAW_S or (self.total is not None and self.done >= self.total):
                self._drawn = now
                self._draw(note)

    def __exit__(self, kind: object, value: object, tb: object) -> None:
        if self._mode not in ("bar", "line"):
            return
        _state.active = None
        took = time.monotonic() - self._start
        if self._mode == "line":
            self._write(f" done ({took:.0f} s)\n" if kind is None else " stopped\n")
        else:
            end = f"{self.what}: done in {took:.1f} s" if kind is None else f"{self.what}: stopped after {took:.1f} s"
            self._write("\r" + end.ljust(self._width) + "\n")

    def _draw(self, note: str = "") -> None:
        took = time.monotonic() - self._start
        if self.total:
            filled = min(_WIDTH, _WIDTH * self.done // self.total)
            line = f"{self.what} [{'#' * filled}{'.' * (_WIDTH - filled)}] {self.done}/{self.total} {took:.1f} s"
        else:
            line = f"{self.what} ... {took:.1f} s" + (f" ({self.done})" if self.done else "")
        if note:
            line += f" {note}"
        self._write("\r" + line.ljust(self._width))
        self._width = max(self._width, len(line))

    def _write(self, text: str) -> None:
        try:
            self._stream.write(text)
            self._stream.flush()
        except (OSError, ValueError):  # a closed terminal: progress is never worth an error
            self._mode = "off"


def progress(what: str, total: Optional[int] = None) -> Progress:
    """A :class:`Progress` for the task ``what`` (a few words: "loading SmolLM2"), to use as a
    context manager; nothing is written when stderr is not a terminal (see the module docstring)."""
    return Progress(what, total)


def track(items: Iterable[T], what: str, total: Optional[int] = None) -> Iterator[T]:
    """``items``, with one :func:`progress` update per item: ``for t in track(tensors, "reading")``."""
    if total is None:
        try:
            total = len(items)  # type: ignore[arg-type]
        except TypeError:
            total = None
    with progress(what, total) as bar:
        for item in items:
            yield item
            bar.update()
