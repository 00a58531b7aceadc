"""``multihead explain``: the walkthrough (text/json/markdown), the visual formats, real models.

The name ``explain`` means this package and the command that prints what it draws (``multihead
explain``). The walkthrough of your own module or trace is
``multihead.explain_module(module_or_trace, x, ...)`` (:func:`.explanation.explain_module`); a
real model's page is ``multihead.explain_model(name, text)``. Both are loaded on first use:
``import multihead`` does not import this package.

Shared here: :class:`UsageError` (what the command line reports as one line, exit 2) and the
``--out`` handling every format uses: :func:`check_out` before any work, :func:`write_output`
at the end. Imports point one way: the CLI imports this package, never the reverse.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Optional, Union

__all__ = ["UsageError", "ExplainWarning", "check_out", "write_output"]


class UsageError(ValueError):
    """A mistake in what the user asked for (an option, a size, a path).

    A ValueError for Python callers; ``multihead`` prints its message as one line and exits 2.
    """


class ExplainWarning(UserWarning):
    """Something the explanation shows that the user may not expect (a sentence the model's
    vocabulary cannot represent, ...). ``multihead`` prints it as one line on stderr."""


def check_out(path: Optional[str], stdout=None, *, binary: bool = False) -> Optional[Path]:
    """The file ``--out`` names, checked before any work; None when the output goes to ``stdout``.

    ``path`` None or "-" means stdout; ``binary`` output (png) needs a stdout with a byte
    ``buffer`` that is not a terminal. Otherwise ``path`` must not be a directory and a file must
    be creatable there (probed with a temporary file, removed at once) or, when it exists,
    writable. Each failure raises :class:`UsageError` naming ``--out`` and the OS's reason.
    """
    if path is None or path == "-":
        isatty = getattr(stdout, "isatty", None)
        if binary and (getattr(stdout, "buffer", None) is None or (isatty is not None and isatty())):
            raise UsageError("--out - would write binary PNG to a terminal or text stream; "
                             "redirect stdout to a file (> heads.png) or give --out heads.png")
        return None
    out = Path(path)
    if out.is_dir():
        raise UsageError(f"--out {path} is a directory; give a file name such as {out / 'walkthrough.html'}")
    try:
        if out.exists():
            with open(out, "r+b"):  # writable, and nothing truncated yet
                pass
        else:
            with tempfile.TemporaryFile(dir=out.parent):
                pass
    except FileNotFoundError:
        raise UsageError(f"cannot write --out {path}: the directory {out.parent} does not exist; create it first") from None
    except OSError as e:
        where = "" if out.exists() else f"{out.parent}: "
        raise UsageError(f"cannot write --out {path}: {where}{e.strerror}") from None
    return out


def write_output(data: Union[str, bytes], out: Optional[Path], stdout) -> None:
    """Write ``data`` to the file ``out`` (from :func:`check_out`) or, when it is None, to ``stdout``
    (bytes to ``stdout.buffer``). An OS error while writing (a full disk) raises :class:`UsageError`."""
    if out is None:
        if isinstance(data, bytes):
            stdout.flush()
            stdout.buffer.write(data)
            stdout.buffer.flush()
        else:
            stdout.write(data)
        return
    try:
        if isinstance(data, bytes):
            out.write_bytes(data)
        else:
            out.write_text(data, encoding="utf-8")
    except OSError as e:
        raise UsageError(f"cannot write --out {out}: {e.strerror}") from None
