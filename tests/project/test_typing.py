"""The public API is typed: mypy, run on a user's snippet with the project's config, accepts the
documented calls and rejects a wrong argument type (a mask that is not a MaskLike, an unknown
backend name) on exactly the lines that pass one."""

from __future__ import annotations

import pathlib
import re

import pytest

api = pytest.importorskip("mypy.api")

ROOT = pathlib.Path(__file__).resolve().parents[2]

GOOD = """\
import torch
import multihead
from multihead import masks
from multihead.backends import BackendName

q = k = v = torch.randn(1, 2, 4, 8)
backend: BackendName = "chunked"
out: torch.Tensor = multihead.attention(q, k, v, mask=masks.causal() & masks.window(2), backend=backend)
multihead.attention(q, k, v, mask=torch.ones(4, 4, dtype=torch.bool))
multihead.attention(q, k, v, mask=None, scale=0.5, dropout_p=0.0)
w: torch.Tensor = multihead.attention_weights(q, k, masks.keep(torch.ones(4, 4, dtype=torch.bool)), heads=[0])
mask: masks.MaskLike = torch.zeros(4, 4)
print(multihead.explain_dispatch(q, k, v, mask).backend)
o, lse = multihead.attention(q, k, v, return_lse=True)
both: tuple[torch.Tensor, torch.Tensor] = multihead.merge([o, o], [lse, lse])
"""

#: each line a wrong call, with what mypy must say about it
BAD = [
    # attention is overloaded on return_lse (Tensor, or (out, lse) for return_lse=True), so mypy
    # names the call's argument types, the wrong one among them, instead of the parameter
    ("multihead.attention(q, k, v, mask=3)",
     'no overload variant of "attention" matches argument types "tensor", "tensor", "tensor", "int"'),
    ("multihead.attention(q, k, v, mask=[[True]])",
     'no overload variant of "attention" matches argument types "tensor", "tensor", "tensor", "list[list[bool]]"'),
    ("multihead.attention(q, k, v, backend='sdpaa')",
     'no overload variant of "attention" matches argument types "tensor", "tensor", "tensor", "str"'),
    ("multihead.attention(q, k, v, return_lse=1)", 'no overload variant of "attention" matches argument types'),
    ("a, b, c = multihead.attention(q, k, v, return_lse=True)", "need more than 2 values to unpack"),
    ("multihead.attention_weights(q, k, mask='causal')", 'argument "mask" to "attention_weights"'),
    ("n: int = multihead.attention(q, k, v)", 'incompatible types in assignment (expression has type "Tensor"'),
]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict[int, str]:
    """mypy's messages on GOOD followed by BAD, by line, checked with the project's config
    against this checkout's src (one run: mypy's cache in the repository keeps it fast)."""
    snippet = tmp_path_factory.mktemp("typing") / "snippet.py"
    snippet.write_text(GOOD + "".join(line + "\n" for line, _ in BAD), encoding="utf-8")
    mp = pytest.MonkeyPatch()
    mp.setenv("MYPYPATH", str(ROOT / "src"))  # this checkout's multihead, not an installed one
    try:
        out, err, _ = api.run(["--config-file", str(ROOT / "pyproject.toml"),
                               "--cache-dir", str(ROOT / ".mypy_cache"), str(snippet)])
    finally:
        mp.undo()
    assert "snippet.py" in out or "Success" in out, out + err  # mypy ran on the snippet
    by_line: dict[int, str] = {}
    for m in re.finditer(r"snippet\.py:(\d+): error: (.*)", out):
        by_line[int(m[1])] = by_line.get(int(m[1]), "") + m[2] + "\n"
    return by_line


def test_documented_calls_type_check(report):
    good = {n: why for n, why in report.items() if n <= GOOD.count("\n")}
    assert not good, good


@pytest.mark.parametrize("n, call, complaint", [(i, *b) for i, b in enumerate(BAD)], ids=[b[0] for b in BAD])
def test_wrong_argument_types_are_rejected(report, n, call, complaint):
    line = GOOD.count("\n") + 1 + n
    assert complaint.lower() in report.get(line, "").lower(), report
