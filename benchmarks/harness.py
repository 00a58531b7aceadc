"""Shared pieces of the benchmarks: timing, FLOP counts, the machine's matmul rate, budgets.

Timing uses ``torch.utils.benchmark.Timer``. Candidates that are compared are measured side by
side in one process, interleaved in rounds (A, B, C, then B, C, A, ...: each round starts with the
next candidate), and each candidate's time is
the **minimum over rounds of the round's median**: on a shared machine other processes only ever
add time, so the least disturbed round is the best estimate of the cost itself. Ratios are
formed from those figures, except where a benchmark asks for :func:`paired_ratios`: the median
over rounds of each round's own ratio, for small calls whose ratio moves with the machine's
state (a decode step's Python overhead grows more than its tensor work on a busy machine, and
two minima may come from rounds of different states).
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch.utils import benchmark

GiB = 1024 ** 3


# ----------------------------------------------------------------------------- budgets
@dataclass
class Budget:
    """How much a run may spend. ``quick`` is the few-minute variant."""

    quick: bool
    #: skip a single measurement whose estimated time per call exceeds this (seconds)
    max_call_s: float
    #: skip a measurement whose estimated extra memory exceeds this (bytes)
    max_bytes: int
    #: interleaved rounds for the side-by-side comparisons
    rounds: int
    #: minimum time per round per candidate (seconds)
    min_run_s: float
    skipped: list = field(default_factory=list)

    @classmethod
    def make(cls, quick: bool, max_gib: float) -> "Budget":
        if quick:
            return cls(quick=True, max_call_s=3.0, max_bytes=int(max_gib * GiB), rounds=2, min_run_s=0.2)
        return cls(quick=False, max_call_s=8.0, max_bytes=int(max_gib * GiB), rounds=3, min_run_s=0.4)

    def skip(self, what: str, why: str) -> None:
        self.skipped.append((what, why))


# ----------------------------------------------------------------------------- FLOPs
def attention_flops(B: int, H: int, Lq: int, Lk: int, D: int, causal: bool) -> float:
    """Multiply-adds x 2 of QKᵀ and PV; causal counts only the visible (lower) triangle."""
    pairs = Lq * (Lk + 1) / 2 if causal and Lq == Lk else Lq * Lk
    return 4.0 * B * H * pairs * D


def mha_flops(B: int, L: int, d: int, H: int, causal: bool, backward: bool = False) -> float:
    """Self-attention layer: QKV projection (2·L·d·3d), attention, output projection (2·L·d·d).

    With ``backward`` the usual convention: forward + backward = 3 x forward.
    """
    proj = 2.0 * B * L * d * 3 * d + 2.0 * B * L * d * d
    f = proj + attention_flops(B, H, L, L, d // H, causal)
    return 3.0 * f if backward else f


# ----------------------------------------------------------------------------- timing
def time_call(fn: Callable[[], object], min_run_s: float) -> float:
    """Seconds per call of ``fn()``: one timed call when it alone takes longer than ``min_run_s``,
    else the median of torch.utils.benchmark's adaptive repeats."""
    t = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    once = t.timeit(1).median
    if once >= min_run_s:
        return once
    return t.blocked_autorange(min_run_time=min_run_s).median


def side_by_side(cands: dict, rounds: int, min_run_s: float) -> dict:
    """{name: seconds} for callables measured interleaved in ``rounds`` rounds (min of medians)."""
    for fn in cands.values():  # warm up (allocator, kernels, cached fused weights)
        fn()
    best = {name: float("inf") for name in cands}
    names = list(cands)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:  # each round starts elsewhere
            best[name] = min(best[name], time_call(cands[name], min_run_s))
    return best


def paired_ratios(cands: dict, base: str, rounds: int, min_run_s: float = 0.0,
                  timer: Optional[Callable[[Callable[[], object]], float]] = None) -> tuple[dict, dict]:
    """({name: seconds}, {name: time / time of ``base``}) for callables measured interleaved in
    ``rounds`` rounds: the seconds as in :func:`side_by_side`, the ratio the median over rounds
    of the ratio within each round (each candidate timed back to back with the others, so a
    disturbance that slows a whole round cancels out of its ratios). ``timer(fn)`` gives one
    round's seconds of ``fn`` (default :func:`time_call` with ``min_run_s``)."""
    time_of = timer if timer is not None else (lambda fn: time_call(fn, min_run_s))
    for fn in cands.values():
        fn()
    best = {name: float("inf") for name in cands}
    per_round: dict = {name: [] for name in cands}
    names = list(cands)
    for r in range(rounds):
        t = {}
        for name in names[r % len(names):] + names[: r % len(names)]:
            t[name] = time_of(cands[name])
            best[name] = min(best[name], t[name])
        for name in names:
            per_round[name].append(t[name] / t[base])
    return best, {name: statistics.median(v) for name, v in per_round.items()}


# ----------------------------------------------------------------------------- the machine
_MATMUL_RATE: dict = {}


def matmul_rate(dtype: torch.dtype) -> float:
    """Achieved FLOP/s of the product a projection does, x (2048, 1024) @ W (1024, 1024)ᵀ
    (F.linear), in ``dtype``, measured in this process (best of three)."""
    if dtype not in _MATMUL_RATE:
        x = torch.randn(2048, 1024).to(dtype)
        w = torch.randn(1024, 1024).to(dtype)
        fn = lambda: torch.nn.functional.linear(x, w)  # noqa: E731
        fn()
        best = min(time_call(fn, 0.3) for _ in range(3))
        _MATMUL_RATE[dtype] = 2.0 * 2048 * 1024 * 1024 / best
    return _MATMUL_RATE[dtype]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict:
    return {
        "date (UTC)": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "CPU": cpu_model(),
        "cores (os.cpu_count)": os.cpu_count(),
        "torch threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "CPU capability": torch.backends.cpu.get_cpu_capability(),
        "python": platform.python_version(),
        "load average at start": ", ".join(f"{x:.1f}" for x in os.getloadavg()),
    }


def fmt_ms(s: Optional[float]) -> str:
    return "—" if s is None else (f"{s * 1e3:.1f}" if s >= 0.01 else f"{s * 1e3:.3f}")


def fmt_ratio(x: Optional[float]) -> str:
    return "—" if x is None else f"{x:.2f}"


def md_table(header: list, rows: list) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)
