"""The README's ```python blocks run, in order, in one namespace."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def test_readme_has_examples():
    assert len(BLOCKS) >= 5


def test_readme_examples_run(capsys):
    ns: dict = {"__name__": "readme"}
    for i, block in enumerate(BLOCKS):
        try:
            exec(compile(block, f"README.md[block {i}]", "exec"), ns)
        except Exception as e:  # pragma: no cover - the message is the point
            pytest.fail(f"README block {i} failed: {type(e).__name__}: {e}\n{block}")
