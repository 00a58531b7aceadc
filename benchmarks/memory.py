"""Peak memory of one call, each implementation in a fresh subprocess.

The child builds the layer and its input, notes its resident memory (RSS), runs one call, and
reports the peak RSS of the process (``ru_maxrss``) minus that figure: the extra memory the call
needed at its peak (activations, scores, masks, workspace; weights and input excluded).

Run as ``python -m benchmarks.memory NAME L DTYPE CAUSAL BACKWARD`` (used by :func:`run`).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import torch

from . import harness as h
from .impls import Case, build, est_bytes, impl_names

B, D_MODEL, HEADS = 1, 512, 8


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def child(name: str, L: int, dtype: str, causal: bool, backward: bool) -> dict:
    c = Case(B, L, D_MODEL, HEADS, getattr(torch, dtype), causal, backward)
    fn = build(name, c)
    before = _rss_bytes()
    fn()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"extra_bytes": max(0, peak - before)}


def probe(name: str, c: Case, timeout_s: float) -> int | None:
    dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[c.dtype]
    cmd = [sys.executable, "-m", "benchmarks.memory", name, str(c.L), dtype, str(int(c.causal)), str(int(c.backward))]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=True)
    except (subprocess.TimeoutExpired, subprocess.CalledProcessError) as e:
        print(f"  memory probe {name} L={c.L} failed: {e}", flush=True)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])["extra_bytes"]


def run(budget: h.Budget, lengths) -> str:
    names = impl_names()
    rows = []
    for L in lengths:
        for backward in (False, True):
            c = Case(B, L, D_MODEL, HEADS, torch.float32, True, backward)
            cells = []
            for name in names:
                est = est_bytes(name, c)
                secs = h.mha_flops(B, L, D_MODEL, HEADS, False, backward) / (0.1 * h.matmul_rate(torch.float32))
                if est > budget.max_bytes or secs > 4 * budget.max_call_s:
                    cells.append("skip")
                    budget.skip(f"memory of {name}, L={L}, {c.label}", "over the memory or time budget")
                    continue
                print(f"  memory {name} L={L} {c.label}", flush=True)
                got = probe(name, c, timeout_s=120 + 10 * secs)
                cells.append("failed" if got is None else f"{got / 2**20:.0f}")
            rows.append([f"L={L} {c.label}", *cells])
    return (
        f"Extra peak memory of one call in MiB (fresh subprocess per cell; peak RSS minus RSS before "
        f"the call), B={B}, d={D_MODEL}, H={HEADS}, fp32, causal.\n\n" + h.md_table(["case", *names], rows)
    )


if __name__ == "__main__":
    name, L, dtype, causal, backward = sys.argv[1:6]
    print(json.dumps(child(name, int(L), dtype, causal == "1", backward == "1")))
