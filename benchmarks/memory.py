"""Peak memory of one call, each implementation in a fresh subprocess.

The child builds the layer and its input, resets the kernel's peak-RSS mark to the current RSS
(writing 5 to /proc/self/clear_refs, Linux), runs one call, and reports the new peak (VmHWM)
minus the RSS before the call: the extra memory the call needed at its peak (activations,
scores, masks, workspace; weights and input excluded).

Run as ``python -m benchmarks.memory NAME L DTYPE CAUSAL BACKWARD`` (used by :func:`run`).
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from . import harness as h
from .bench_attention import est_seconds
from .impls import Case, build, est_bytes, impl_names

B, D_MODEL, HEADS = 1, 512, 8


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(name: str, L: int, dtype: str, causal: bool, backward: bool) -> dict:
    c = Case(B, L, D_MODEL, HEADS, getattr(torch, dtype), causal, backward)
    fn = build(name, c)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # peak RSS := current RSS
    before = _status_bytes("VmRSS")
    fn()
    return {"extra_bytes": max(0, _status_bytes("VmHWM") - before)}


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
            cells, skipped = [], []
            for name in names:
                est = est_bytes(name, c)
                secs = est_seconds(name, c)
                if est > budget.max_bytes or secs > 4 * budget.max_call_s:
                    cells.append("skip")
                    skipped.append(name)
                    continue
                print(f"  memory {name} L={L} {c.label}", flush=True)
                got = probe(name, c, timeout_s=120 + 10 * secs)
                cells.append("failed" if got is None else f"{got / 2**20:.0f}")
            rows.append([f"L={L} {c.label}", *cells])
            if skipped:
                budget.skip(f"memory at L={L} {c.label}", ", ".join(skipped) + " (over the memory or time budget)")
    return (
        f"Extra peak memory of one call in MiB (fresh subprocess per cell; peak RSS minus RSS before "
        f"the call), B={B}, d={D_MODEL}, H={HEADS}, fp32, causal.\n\n" + h.md_table(["case", *names], rows)
    )


if __name__ == "__main__":
    name, L, dtype, causal, backward = sys.argv[1:6]
    print(json.dumps(child(name, int(L), dtype, causal == "1", backward == "1")))
