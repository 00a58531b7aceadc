"""``python -m benchmarks [--quick]`` (``make bench``): run the benchmark suite, write docs/benchmarks.md.

Sections, all in this one process except the memory probes (a fresh subprocess each):
module overhead vs the same work by hand; decode step vs raw ops and tokens/s with and without a
KV cache; every implementation side by side for L from 512 to 32768 (what would not fit the
time or memory budget is skipped and listed); peak memory; and the chunked
backend against SDPA at long L (``benchmarks/bench_chunked.py``).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from . import bench_attention, bench_chunked, bench_decode, bench_overhead, memory
from . import harness as h

ROOT = Path(__file__).resolve().parent.parent


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a few-minute run: fewer lengths, rounds and cases")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"), help="markdown report to write")
    p.add_argument("--max-gib", type=float, default=4.0, help="skip a call estimated to need more extra memory (default 4)")
    p.add_argument("--max-call-s", type=float, default=None, help="skip a call estimated to take longer (default 8, quick 1.5)")
    p.add_argument("--only", choices=["overhead", "decode", "attention", "memory", "chunked"], action="append",
                   help="run only these sections (repeatable)")
    return p


def _chunked_section(quick: bool) -> str:
    """The chunked backend's benchmark (benchmarks/bench_chunked.py) as a markdown section."""
    return bench_chunked.main(argv=[], quick=quick)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    budget = h.Budget.make(args.quick, args.max_gib)
    if args.max_call_s is not None:
        budget.max_call_s = args.max_call_s
    want = set(args.only or ["overhead", "decode", "attention", "memory", "chunked"])
    t0 = time.time()
    info = h.machine_info()
    print("machine: " + "; ".join(f"{k} {v}" for k, v in info.items()), flush=True)
    rates = {dt: h.matmul_rate(dt) for dt in (torch.float32, torch.bfloat16)}
    print(f"matmul rate: fp32 {rates[torch.float32] / 1e9:.1f} GFLOP/s, bf16 {rates[torch.bfloat16] / 1e9:.1f} GFLOP/s", flush=True)

    lengths = [512, 2048] if args.quick else [512, 2048, 8192, 32768]
    mem_lengths = [2048] if args.quick else [2048, 8192]
    if args.quick:
        budget.skip("side by side at L = 8192 and 32768", "quick mode")
    parts, summary = [], []

    if "overhead" in want:
        print("module overhead ...", flush=True)
        text, ratios = bench_overhead.run(budget)
        parts.append(("Module overhead", text))
        summary.append(f"module overhead: worst ratio {max(ratios):.3f} (target <= {bench_overhead.TARGET})")
    if "decode" in want:
        print("decoding ...", flush=True)
        step_text, step_r = bench_decode.decode_step(budget)
        tps_text, speedup = bench_decode.tokens_per_second(budget)
        parts.append(("Decoding with a KV cache", step_text + "\n\n" + tps_text))
        per_threads = lambda d, f: ", ".join(f"{f(v)} with {n} thread{'s' if n > 1 else ''}" for n, v in d.items())  # noqa: E731
        summary.append(f"decode step: {per_threads(step_r, lambda r: f'{r:.3f}x')} the raw ops "
                       f"(target <= {bench_decode.STEP_TARGET})")
        summary.append(f"512-token decode with cache: {per_threads(speedup, lambda s: f'{s:.1f}x')} faster than "
                       f"recomputing (target >= {bench_decode.SPEEDUP_TARGET:g})")
    if "attention" in want:
        print("implementations side by side ...", flush=True)
        agree = bench_attention.check_agreement()
        parts.append(("Implementations side by side", bench_attention.run(budget, lengths)
                      + "\n\nAll implementations compute the same layer; max |difference| to raw SDPA "
                      "at B=2, L=64, d=64, H=4, fp32:\n\n" + h.md_table(["implementation", "mask", "max abs diff"], agree)))
    if "memory" in want:
        print("peak memory (subprocesses) ...", flush=True)
        parts.append(("Peak memory", memory.run(budget, mem_lengths)))
    if "chunked" in want:
        parts.append(("Chunked backend (benchmarks/bench_chunked.py)", _chunked_section(args.quick)))

    minutes = (time.time() - t0) / 60
    info["run took"] = f"{minutes:.1f} min ({'quick' if args.quick else 'default'} mode)"
    doc = render(info, rates, summary, parts, budget, args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(doc)
    print("\n".join(summary))
    print(f"wrote {os.path.relpath(args.out)} in {minutes:.1f} min")
    return 0


def render(info, rates, summary, parts, budget, args) -> str:
    cmd = "python -m benchmarks" + (" --quick" if args.quick else "")
    out = [
        "# Benchmarks",
        "",
        f"Written by `{cmd}` (`make bench` runs the default mode). Times are milliseconds per call "
        "measured with `torch.utils.benchmark`; compared implementations run side by side in one "
        "process, interleaved in rounds, and each figure is the minimum over rounds of the round's "
        "median (other processes only ever add time). Ratios > 1 mean slower than the baseline.",
        "",
        "**Noise.** This machine is shared: other jobs were running during the measurement (see the "
        "load average), so absolute times are inflated and jumpy; ratios of interleaved runs are the "
        "figures to read.",
        "",
        f"**bf16.** This CPU ({info['CPU capability']}) multiplies bf16 at "
        f"{100 * rates[torch.bfloat16] / rates[torch.float32]:.0f}% of the fp32 rate (no native bf16 "
        "instructions), so bf16 cases are the first to exceed the time budget and are skipped where listed.",
        "",
        "**Threads in decoding.** A decode step is a chain of small, memory-bound operations; on a "
        "loaded machine, threads waiting for each other can cost more than they save, so decoding is "
        "measured at the default thread count and at 1 thread.",
        "",
        "## Machine",
        "",
        h.md_table(["", ""], [[k, v] for k, v in info.items()]),
        "",
        f"Matrix-multiply rate measured in this run (F.linear, x (2048, 1024) @ W (1024, 1024)ᵀ): fp32 "
        f"{rates[torch.float32] / 1e9:.1f} GFLOP/s, bf16 {rates[torch.bfloat16] / 1e9:.1f} GFLOP/s.",
        "",
        "## Targets",
        "",
        *[f"- {s}" for s in summary],
    ]
    for title, text in parts:
        out += ["", f"## {title}", "", text]
    out += ["", "## Skipped", ""]
    out += [f"- {what}: {why}" for what, why in budget.skipped] or ["- nothing"]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
