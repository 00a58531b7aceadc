"""``python -m benchmarks.gpu`` (``make gpu-check``): the GPU check, in one command.

1. Runs ``tests/api/test_devices.py`` in a subprocess: the tests that compare numbers with the float64
   oracle, on the CPU and, when ``torch.cuda.is_available()``, on CUDA (every backend, the module,
   cached decoding, autocast, ``torch.compile``).
2. Measures, on ``--device`` (default ``cuda``), candidates against baselines side by side:

   * the module (backend "auto") vs the same work by hand (one fused QKV ``F.linear``, SDPA, the
     output ``F.linear``: ``benchmarks/impls.py``'s ``RawSDPA``), forward and forward + backward,
     B=8, L=1024 and 4096, d=1024, h=16, causal and not;
   * one cached decode step (B=1, d=512, h=8, 256 cached tokens, module + ``KVCache``) vs the
     same ops by hand (fused QKV linear, in-place cache write, SDPA, output linear);
   * the chunked backend vs SDPA's flash kernel, causal, B=1, h=8, D=64, L=8192 and 16384,
     forward and forward + backward;

   each in bfloat16 and float16 on CUDA (float32 and bfloat16 on the CPU; the chunked rows in the
   first of them).
3. Prints the device, the torch version and a ratio table: the time of the candidate over the
   baseline's (> 1: slower) and the GFLOP/s each achieves.

Usage::

    python -m benchmarks.gpu                        # tests + benchmark on CUDA, < 5 min on an H100/H200
    python -m benchmarks.gpu --no-tests             # the benchmark only
    python -m benchmarks.gpu --device cpu --quick   # the plumbing on a CPU, small sizes, about a minute
    make gpu-check                                  # the first line

The exit status is 1 when the tests fail (the benchmark still runs and prints), 2 for bad
arguments, among them ``--device cuda`` on a machine without CUDA. ``--device cpu`` without
``--quick`` runs the GPU sizes on the CPU, which takes very long.

Timing: ``benchmarks/harness.py``'s ``side_by_side`` (``torch.utils.benchmark``, which
synchronises the accelerator around each measurement): candidate and baseline interleaved in
rounds, each figure the minimum over rounds of the round's median. FLOPs: ``harness.mha_flops`` and
``harness.attention_flops`` (causal counts the visible triangle; forward + backward = 3 x forward);
a decode step counts its projections and 4·D per cached key and head.

Legend: B batch, L tokens, d model width, h heads, D head dim.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
_SRC = ROOT / "src"
if _SRC.is_dir() and str(_SRC) not in sys.path:  # this checkout's multihead, installed or not
    sys.path.insert(0, str(_SRC))

import multihead  # noqa: E402
from multihead import masks  # noqa: E402

from . import harness as h  # noqa: E402
from .bench_decode import RawStep  # noqa: E402
from .impls import RawSDPA  # noqa: E402

#: the dtypes measured on each device; the chunked rows use the first
DTYPES = {"cuda": (torch.bfloat16, torch.float16), "cpu": (torch.float32, torch.bfloat16)}
SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
HEADER = ["section", "case", "baseline", "baseline ms", "candidate", "candidate ms", "ratio",
          "baseline GFLOP/s", "candidate GFLOP/s"]


@dataclass(frozen=True)
class Plan:
    """The sizes of one run, and how long each measurement lasts."""

    batch: int  # module rows: B, the lengths L, width d, heads h, causal settings
    lengths: tuple
    d: int
    heads: int
    causal: tuple
    decode_d: int  # decode rows: width, heads, cached tokens (B = 1)
    decode_heads: int
    cached: int
    chunked_lengths: tuple  # chunked rows: lengths, heads, head dim (B = 1, causal)
    chunked_heads: int
    chunked_head_dim: int
    rounds: int  # interleaved rounds, and the least time per round and candidate (seconds)
    min_run_s: float


FULL = Plan(8, (1024, 4096), 1024, 16, (True, False), 512, 8, 256, (8192, 16384), 8, 64, rounds=3, min_run_s=0.4)
QUICK = Plan(2, (128, 256), 256, 4, (True,), 512, 8, 256, (512, 1024), 8, 64, rounds=2, min_run_s=0.2)
#: for tests/api/test_devices.py::test_gpu_check_plumbing: every row, in well under a second each
TINY = Plan(1, (16,), 32, 2, (True,), 32, 2, 8, (64,), 2, 8, rounds=1, min_run_s=0.001)


@dataclass
class Row:
    section: str
    case: str
    baseline: str
    baseline_s: float
    candidate: str
    candidate_s: float
    flops: float

    def cells(self) -> list:
        return [self.section, self.case, self.baseline, h.fmt_ms(self.baseline_s), self.candidate,
                h.fmt_ms(self.candidate_s), f"{self.candidate_s / self.baseline_s:.3f}",
                _gflops(self.flops / self.baseline_s), _gflops(self.flops / self.candidate_s)]


def _gflops(rate: float) -> str:
    g = rate / 1e9
    return f"{g:.1f}" if g >= 10 else f"{g:.3g}"


def _timed(cands: dict, plan: Plan) -> dict:
    return h.side_by_side(cands, plan.rounds, plan.min_run_s)


def _train_or_infer(forward, params: list, x: torch.Tensor, backward: bool):
    """The callable: ``forward(x)`` under no_grad, or forward + backward of a fixed output gradient."""
    if not backward:
        def fwd():
            with torch.no_grad():
                return forward(x)
        return fwd
    g = torch.randn_like(forward(x).detach())

    def fwd_bwd():
        for p in params:
            p.grad = None
        forward(x).backward(g)
    return fwd_bwd


# ----------------------------------------------------------------------------- module vs by hand
def module_rows(device: str, plan: Plan) -> list:
    rows = []
    B, d, H = plan.batch, plan.d, plan.heads
    for L in plan.lengths:
        for dtype in DTYPES[device]:
            for causal in plan.causal:
                torch.manual_seed(0)
                mha = multihead.MultiHeadAttention(d, H, causal=causal, device=device, dtype=dtype)
                raw = RawSDPA(mha)
                x = torch.randn(B, L, d, device=device, dtype=dtype)
                for backward in (False, True):
                    mha.train(backward)
                    raw.train(backward)
                    case = (f"{'fwd+bwd' if backward else 'fwd'} {SHORT[dtype]} {'causal' if causal else 'full'} "
                            f"B={B} L={L} d={d} h={H}")
                    print(f"  module {case}", flush=True)
                    t = _timed({"hand": _train_or_infer(raw, list(raw.parameters()), x, backward),
                                "module": _train_or_infer(mha, list(mha.parameters()), x, backward)}, plan)
                    rows.append(Row("module", case, "by hand (fused QKV, SDPA)", t["hand"], "module", t["module"],
                                    h.mha_flops(B, L, d, H, causal, backward)))
    return rows


# ----------------------------------------------------------------------------- decode step


def decode_rows(device: str, plan: Plan) -> list:
    rows = []
    d, H, n = plan.decode_d, plan.decode_heads, plan.cached
    for dtype in DTYPES[device]:
        torch.manual_seed(0)
        m = multihead.MultiHeadAttention(d, H, causal=True, device=device, dtype=dtype).eval()
        prompt = torch.randn(1, n, d, device=device, dtype=dtype)
        x = torch.randn(1, 1, d, device=device, dtype=dtype)
        cache = multihead.KVCache(max_len=n + 1)
        case = f"step {SHORT[dtype]} B=1 d={d} h={H} {n} cached"
        print(f"  decode {case}", flush=True)
        with torch.no_grad():
            m(prompt, cache=cache)
            raw = RawStep(m, cache.keys, cache.values, n + 1)

            def module_step():
                cache.length = n  # rewind, so that every call appends token n + 1
                return m(x, cache=cache)

            t = _timed({"hand": lambda: raw(x), "module": module_step}, plan)
        flops = 2.0 * d * 3 * d + 2.0 * d * d + 4.0 * H * (n + 1) * (d // H)
        rows.append(Row("decode", case, "by hand (fused QKV, cache write, SDPA)", t["hand"], "module + KVCache",
                        t["module"], flops))
    return rows


# ----------------------------------------------------------------------------- chunked vs flash
def chunked_rows(device: str, plan: Plan) -> list:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    dtype, H, D = DTYPES[device][0], plan.chunked_heads, plan.chunked_head_dim
    causal = masks.causal()

    def flash(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def chunk(q, k, v):
        return multihead.attention(q, k, v, causal, backend="chunked")

    for L in plan.chunked_lengths:
        for backward in (False, True):
            gen = torch.Generator(device=device).manual_seed(L)
            q, k, v = (torch.randn(1, H, L, D, device=device, dtype=dtype, generator=gen).requires_grad_(backward)
                       for _ in range(3))
            case = f"{'fwd+bwd' if backward else 'fwd'} {SHORT[dtype]} causal B=1 L={L} h={H} D={D}"
            print(f"  chunked {case}", flush=True)
            t = _timed({name: _train_or_infer(lambda _, f=f: f(q, k, v), [q, k, v], q, backward)
                        for name, f in (("flash", flash), ("chunked", chunk))}, plan)
            flops = h.attention_flops(1, H, L, L, D, causal=True) * (3 if backward else 1)
            rows.append(Row("chunked", case, "SDPA (flash)", t["flash"], "chunked", t["chunked"], flops))
    return rows


# ----------------------------------------------------------------------------- the command
def device_name(device: str) -> str:
    if device == "cuda":
        return f"cuda ({torch.cuda.get_device_name()}, CUDA {torch.version.cuda})"
    return f"cpu ({h.cpu_model()}, {torch.get_num_threads()} torch threads)"


def run_tests() -> bool:
    """tests/api/test_devices.py in a subprocess on this checkout's src; True when it passes."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_SRC), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "pytest", "-q", str(ROOT / "tests" / "api" / "test_devices.py")]
    print("$ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode == 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=(
        "The GPU check: tests/api/test_devices.py on every device here, then a short benchmark of the module, "
        "a decode step and the chunked backend against hand-written ops and SDPA, with a ratio table."))
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="where the benchmark runs (default cuda; cpu: a plumbing run, with --quick)")
    p.add_argument("--quick", action="store_true", help="small sizes and two short rounds: checks the plumbing")
    p.add_argument("--no-tests", action="store_true", help="skip tests/api/test_devices.py, run the benchmark only")
    return p


def main(argv=None, *, plan: Optional[Plan] = None) -> int:
    """The command; ``plan`` replaces the sizes ``--quick`` chooses (tests pass :data:`TINY`)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda: no CUDA device (torch.cuda.is_available() is False; torch {torch.__version__}, "
                     f"built with CUDA {torch.version.cuda}); for a plumbing run on the CPU pass --device cpu --quick")
    plan = plan or (QUICK if args.quick else FULL)
    t0 = time.time()
    passed = None
    if not args.no_tests:
        devices = "cpu and cuda" if torch.cuda.is_available() else "cpu only (no CUDA device)"
        print(f"tests/api/test_devices.py on {devices} ...", flush=True)
        passed = run_tests()
    print(f"benchmark on {args.device} ...", flush=True)
    rows = module_rows(args.device, plan) + decode_rows(args.device, plan) + chunked_rows(args.device, plan)
    bad = [r.case for r in rows if not (math.isfinite(r.baseline_s) and math.isfinite(r.candidate_s))]
    print()
    sizes = "quick" if args.quick else "default"
    print(f"device: {device_name(args.device)}; torch {torch.__version__}; {sizes} sizes, "
          f"{plan.rounds} rounds of >= {plan.min_run_s:g} s per candidate")
    print("ratio = candidate ms / baseline ms (> 1: the candidate is slower); GFLOP/s of the useful work")
    print()
    print(h.md_table(HEADER, [r.cells() for r in rows]))
    print()
    tests = {None: "not run (--no-tests)", True: "passed", False: "FAILED"}[passed]
    print(f"tests/api/test_devices.py: {tests}; took {time.time() - t0:.0f} s")
    if bad:
        print(f"no time measured for: {bad}")
    return 1 if passed is False or bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
