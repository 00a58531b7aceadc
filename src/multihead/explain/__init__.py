"""``multihead explain``: the walkthrough (text/json/markdown), the visual formats, real models."""


def write_output(text: str, path, stdout) -> None:
    """Write ``text`` to the file ``path`` (the ``--out`` option) or, when it is None, to ``stdout``."""
    if path is None:
        stdout.write(text)
        return
    from ..cli import UsageError

    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise UsageError(f"cannot write --out {path!r}: {e.strerror}") from None
