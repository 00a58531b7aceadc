"""The chunked backend against torch SDPA, for issue 5's targets (B=1, H=8, D=64, fp32).

* forward, no mask: chunked vs SDPA (target: chunked <= 1.5x SDPA's time);
* forward, causal: chunked (skips the tiles above the diagonal) vs SDPA ``is_causal=True``;
* forward, ``window(512)``: chunked (computes O(L·w)) vs SDPA given the same mask as a dense
  (L, L) bool tensor (target: chunked >= 5x faster);
* issue 13's rows (``--issue13``): causal at L=4096 in float32 (target: chunked <= 1.5x SDPA)
  and in bfloat16, and 8 packed documents x 1024 tokens at L=8192, causal, forward+backward:
  chunked with ``from_seqlens`` vs SDPA given the equivalent dense (L, L) bool mask (target:
  chunked >= 4x faster), with both calls' peak extra memory in fresh processes; beside the
  float32 row, :func:`bare_tile_loop`, the torch calls of the tiles alone (no masking, no
  bookkeeping), as the floor of a kernel made of torch calls;
* peak extra memory of one call, each in a fresh subprocess: resident memory after the inputs
  exist vs the process's peak resident memory after the call (``VmHWM``; not ``ru_maxrss``,
  which a child inherits from its parent's peak across fork/exec) (target: chunked <= 1 GiB
  at L=32768).

Timing: ``torch.utils.benchmark``, candidates interleaved in rounds (A, B, A, B, ...) in this one
process; each candidate's figure is its fastest round (other processes on a shared machine only
add time) and the ratio is formed from those. GFLOP/s count the useful work only: 4·D FLOPs per
visible (query, key) pair. The matmul rate of the same run is printed for scale.

* issue 22's rows (``--issue22``): the native kernel vs SDPA and the torch tiles, side by side in
  rounds whose ratios are reported as median (range), each with its target and pass/FAIL:
  causal forward at L=4096 with D=64 (float32, bfloat16) and D=128 (float32, bfloat16, float16),
  causal forward+backward, 8 packed documents x 1024 fwd+bwd vs SDPA called once per document,
  window(512) at L=8192 and 16384 vs SDPA's dense mask, the bfloat16 causal forward's share of
  the bf16 matmul rate measured in the same run, and (``--no-memory`` skips it;
  ``--issue22-memory`` runs only it) the peak extra memory of a causal forward+backward at
  L=32768 in a fresh process; the CPU model and features are printed.
* the threads' share (``--scaling``): the causal forward at L=4096 by the native kernel and SDPA
  at 1 and 2 threads, wall and process CPU time of each (does each kernel share its work?).

``python benchmarks/bench_chunked.py [--quick] [--length L] [--blocks 256x1024,128x2048] [--issue13] [--issue22] [--issue22-memory] [--scaling]``;
``main(quick=...)`` returns the markdown report (for ``python -m benchmarks``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils import benchmark

_SRC = Path(__file__).resolve().parent.parent / "src"
if _SRC.is_dir() and str(_SRC) not in sys.path:  # this checkout's multihead, installed or not
    sys.path.insert(0, str(_SRC))

from multihead import masks
from multihead.backends import tiles as _tiles, chunked, cpu_threads, native

try:
    from . import harness as _h  # as part of the benchmarks package (python -m benchmarks)
except ImportError:  # run as a script: this folder is sys.path[0]
    import harness as _h  # type: ignore[no-redef]
from multihead.backends.chunked import chunked_attention

B, H, D, WINDOW = 1, 8, 64, 512
GiB = 2 ** 30


def _inputs(L: int, grad: bool = False, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, D, generator=g).requires_grad_(grad) for _ in range(3)]


def visible_pairs(kind: str, L: int) -> int:
    if kind == "causal":
        return L * (L + 1) // 2
    if kind == "window":
        return sum(min(i, WINDOW) + 1 for i in range(L))
    return L * L


def _time_once(fn) -> float:
    return benchmark.Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()).timeit(1).mean


def side_by_side(cands: dict, rounds: int, warm_up: bool = True) -> dict:
    """{name: fastest seconds over ``rounds`` interleaved rounds} (one call per round)."""
    if warm_up:
        for fn in cands.values():
            fn()
    best = {name: float("inf") for name in cands}
    for _ in range(rounds):
        for name, fn in cands.items():
            best[name] = min(best[name], _time_once(fn))
    return best


def matmul_gflops(n: int = 2048) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n ** 3 / min(_time_once(lambda: a @ b) for _ in range(5)) / 1e9


def _blocks_kw(blocks):
    return {} if blocks is None else {"block_q": blocks[0], "block_k": blocks[1]}


def speed_rows(L: int, rounds: int, blocks=None) -> list[dict]:
    q, k, v = _inputs(L)
    kw = _blocks_kw(blocks)
    rows = []
    cases = {
        "no mask": (None, dict(), None),
        "causal": (masks.causal(), dict(is_causal=True), "causal"),
        f"window({WINDOW})": (masks.window(WINDOW), None, "window"),
    }
    for label, (mask, sdpa_kw, kind) in cases.items():
        with torch.no_grad():
            if sdpa_kw is None:  # the same window as a dense (L, L) bool tensor, built once
                i = torch.arange(L)
                dense = (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - WINDOW)
                sdpa_kw = dict(attn_mask=dense)
            cands = {
                "chunked": lambda: chunked_attention(q, k, v, mask, **kw),
                "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, **sdpa_kw),
            }
            t = side_by_side(cands, rounds, warm_up=L < 16384)  # long calls: the rounds warm up
            sdpa_kw = None
        flops = 4.0 * B * H * D * visible_pairs(kind or "full", L)
        rows.append({
            "case": label, "L": L, "chunked_s": t["chunked"], "sdpa_s": t["sdpa"],
            "chunked/sdpa": t["chunked"] / t["sdpa"],
            "chunked_gflops": flops / t["chunked"] / 1e9, "sdpa_gflops": flops / t["sdpa"] / 1e9,
        })
        print(_speed_line(rows[-1]), flush=True)
    return rows


def _speed_line(r: dict) -> str:
    return (f"{r['case']:>12} L={r['L']}: chunked {r['chunked_s']:.3f} s ({r['chunked_gflops']:.1f} GFLOP/s), "
            f"sdpa {r['sdpa_s']:.3f} s ({r['sdpa_gflops']:.1f} GFLOP/s), chunked/sdpa = {r['chunked/sdpa']:.2f}")


def block_rows(L: int, rounds: int, configs) -> list[dict]:
    """Tile sizes side by side (forward, no mask and causal) for tuning."""
    q, k, v = _inputs(L)
    out = []
    for label, mask in (("no mask", None), ("causal", masks.causal())):
        with torch.no_grad():
            cands = {f"{bq}x{bk}": (lambda bq=bq, bk=bk: chunked_attention(q, k, v, mask, block_q=bq, block_k=bk))
                     for bq, bk in configs}
            cands["sdpa"] = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=mask is not None)
            t = side_by_side(cands, rounds)
        out.append({"case": label, "L": L, **t})
        print(f"{label:>8} L={L}: " + ", ".join(f"{n} {s:.3f} s ({s / t['sdpa']:.2f}x sdpa)" for n, s in t.items()), flush=True)
    return out


# ---------------------------------------------------------------- issue 13: bf16, packed documents
DOCS, DOC_LEN = 8, 1024


def bare_tile_loop(q, k, v, block: int = 256):
    """The torch calls of a causal forward's tiles and nothing else, for scale: per tile of
    ``block`` queries x ``block`` keys (8 heads batched) one product, the shift, exp2, the row
    sums and the second product, on the tile kernel's threads (``cpu_threads.share``, query blocks
    dealt out as there). No masking (diagonal tiles are computed whole) and no bookkeeping, so
    the result is not attention: its time is what those torch calls cost by themselves."""
    B_, H_, L, D_ = q.shape
    q3 = (q * (D_ ** -0.5 / math.log(2))).reshape(B_ * H_, L, D_)
    k3, v3 = k.reshape(B_ * H_, L, D_), v.reshape(B_ * H_, L, D_)
    shift = torch.zeros(B_ * H_, L, 1)
    acc, total = torch.zeros(B_ * H_, L, D_), torch.zeros(B_ * H_, L, 1)
    blocks = L // block
    workers = cpu_threads.workers_for(blocks, q3, k3, v3)

    def work(w):
        mine = [i for i in range(blocks) if cpu_threads.worker_of(i, workers) == w]
        for j in range(blocks):
            for i in mine:
                if i < j:
                    continue
                rows, keys = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
                s = torch.bmm(q3[:, rows], k3[:, keys].transpose(1, 2))
                if j == 0:
                    shift[:, rows] = s.amax(dim=-1, keepdim=True)
                s.sub_(shift[:, rows]).exp2_()
                total[:, rows].add_(s.sum(dim=-1, keepdim=True))
                acc[:, rows].add_(torch.bmm(s, v3[:, keys]))

    cpu_threads.share(work, workers)
    return acc / total


def causal_dtype_rows(L: int, rounds: int) -> list[dict]:
    """Forward, causal: chunked vs SDPA ``is_causal=True`` in float32 and bfloat16; in float32
    also :func:`bare_tile_loop` (the floor of a kernel made of torch calls)."""
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (t.to(dtype) for t in _inputs(L))
        cands = {  # one call a round: these take a tenth of a second
            "chunked": lambda: chunked_attention(q, k, v, masks.causal()),
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        }
        if dtype == torch.float32:
            cands["bare"] = lambda: bare_tile_loop(q, k, v, chunked.BLOCK_K)
        with torch.no_grad():
            t, ratio = _h.paired_ratios(cands, "sdpa", 2 * rounds, timer=_time_once)
        rows.append({"case": f"causal {str(dtype).replace('torch.', '')}", "L": L, "chunked_s": t["chunked"],
                     "sdpa_s": t["sdpa"], "chunked/sdpa": t["chunked"] / t["sdpa"],
                     "paired": ratio["chunked"], "bare": ratio.get("bare")})
        bare = "" if "bare" not in ratio else f"; bare torch loop / sdpa {ratio['bare']:.2f}"
        print(f"{rows[-1]['case']:>16} L={L}: chunked {t['chunked']:.3f} s, sdpa {t['sdpa']:.3f} s, "
              f"chunked/sdpa = {rows[-1]['chunked/sdpa']:.2f} (median of rounds' ratios {ratio['chunked']:.2f}{bare})",
              flush=True)
    return rows


def packed_mask(L: int):
    """(chunked's mask, SDPA's equivalent dense (L, L) bool mask) for DOCS documents, causal."""
    ids = torch.arange(L) // (L // DOCS)
    i = torch.arange(L)
    dense = (ids[:, None] == ids[None, :]) & (i[None, :] <= i[:, None])
    return masks.from_seqlens([L // DOCS] * DOCS) & masks.causal(), dense


def packed_row(rounds: int) -> dict:
    """Forward+backward of DOCS x DOC_LEN packed tokens, causal per document."""
    L = DOCS * DOC_LEN
    q, k, v = _inputs(L, grad=True)
    grad = torch.randn(B, H, L, D)
    m, dense = packed_mask(L)

    def step(fn):
        return lambda: torch.autograd.grad(fn(), (q, k, v), grad)

    t = side_by_side({
        "chunked": step(lambda: chunked_attention(q, k, v, m)),
        "sdpa": step(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense)),
    }, rounds, warm_up=False)
    row = {"case": f"packed {DOCS}x{DOC_LEN} causal fwd+bwd", "L": L, "chunked_s": t["chunked"],
           "sdpa_s": t["sdpa"], "sdpa/chunked": t["sdpa"] / t["chunked"]}
    print(f"{row['case']} L={L}: chunked {t['chunked']:.3f} s, sdpa (dense mask) {t['sdpa']:.3f} s, "
          f"sdpa/chunked = {row['sdpa/chunked']:.2f}", flush=True)
    return row


def issue13_report(rounds: int) -> list[str]:
    lines = [f"## issue 13: chunked vs SDPA (B=1, H=8, D=64; CPU {_tiles.cpu_features()})", "",
             "| case | L | chunked s | SDPA s | chunked / SDPA | median of rounds' ratios | bare torch loop / SDPA |",
             "|---|---|---|---|---|---|---|"]
    for r in causal_dtype_rows(4096, rounds):
        bare = "" if r["bare"] is None else f"{r['bare']:.2f}"
        lines.append(f"| {r['case']} (forward) | {r['L']} | {r['chunked_s']:.3f} | {r['sdpa_s']:.3f} | "
                     f"{r['chunked/sdpa']:.2f} | {r['paired']:.2f} | {bare} |")
    r = packed_row(rounds)
    lines.append(f"| {r['case']} | {r['L']} | {r['chunked_s']:.3f} | {r['sdpa_s']:.3f} (dense mask) | "
                 f"{1 / r['sdpa/chunked']:.2f} (SDPA / chunked = {r['sdpa/chunked']:.2f}) | | |")
    lines += ["", "| peak extra memory (fresh process), packed fwd+bwd | L | MiB |", "|---|---|---|"]
    for which in ("packed-chunked+backward", "packed-sdpa+backward"):
        extra = peak_extra_bytes(which, DOCS * DOC_LEN)
        print(f"peak extra memory {which}: {extra / 2**20:.0f} MiB", flush=True)
        lines.append(f"| {which} | {DOCS * DOC_LEN} | {extra / 2**20:.0f} |")
    return lines


# ---------------------------------------------------------------- issue 22: the native kernel
def _kernel(which: str, fn):
    """``fn`` run with the chunked backend's ``which`` tile kernel ("native" or "torch tiles")."""
    def run():
        before, native.ENABLED = native.ENABLED, which == "native"
        try:
            return fn()
        finally:
            native.ENABLED = before
    return run


def paired_rounds(cands: dict, base: str, rounds: int) -> dict:
    """{name: (fastest seconds, [time / time of ``base``, one per round])}: the candidates timed
    back to back in each round, in a rotated order (a slow spell of a shared machine falls on a
    whole round and cancels out of its ratios); one warm-up call each first."""
    for fn in cands.values():
        fn()
    names = list(cands)
    seconds: dict = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            seconds[n].append(_time_once(cands[n]))
    return {n: (min(seconds[n]), [a / b for a, b in zip(seconds[n], seconds[base])]) for n in names}


def _span(ratios) -> str:
    lo, hi = min(ratios), max(ratios)
    mid = sorted(ratios)[len(ratios) // 2]
    return f"{mid:.2f} ({lo:.2f}-{hi:.2f})"


def bf16_matmul_gflops(n: int = 2048) -> float:
    a, b = torch.randn(n, n).bfloat16(), torch.randn(n, n).bfloat16()
    a @ b
    return 2 * n ** 3 / min(_time_once(lambda: a @ b) for _ in range(5)) / 1e9


def _verdict(value: float, target: float, at_most: bool) -> str:
    ok = value <= target if at_most else value >= target
    return "pass" if ok else "FAIL"


def issue22_report(rounds: int, memory: bool = True) -> list[str]:
    """Issue 22's targets, side by side in this process: the native kernel vs SDPA (and the
    torch tiles), per-round ratios as median (range), each with its target and pass/FAIL (judged
    on the median); then the bf16 matmul share and, in a fresh process, the memory of a causal
    forward+backward at L=32768."""
    flags = sorted(native.cpu_flags() & set(native._VECTOR_FLAGS))
    lines = [f"## issue 22: the native tile kernel vs SDPA (B=1, H=8; {_h.cpu_model()})", "",
             f"CPU features: {', '.join(flags) or 'baseline x86-64'}", "",
             f"{native.status()}", "", f"bf16 matmul (2048³, torch.mm) in this run: {bf16_matmul_gflops():.0f} GFLOP/s; "
             f"fp32: {matmul_gflops():.0f} GFLOP/s", "",
             "| case | L | native s | SDPA s | native / SDPA, median (range) | target | verdict | torch tiles / SDPA "
             "| native GFLOP/s |",
             "|---|---|---|---|---|---|---|---|---|"]

    def row(case, L, res, flops, target):
        n_s, n_r = res["native"]
        s_s, _ = res["sdpa"]
        t = _span(res["tiles"][1]) if "tiles" in res else "—"
        median = sorted(n_r)[len(n_r) // 2]
        verdict = _verdict(median, target, at_most=True)
        line = (f"| {case} | {L} | {n_s:.3f} | {s_s:.3f} | {_span(n_r)} | <= {target:.2f} | {verdict} | {t} "
                f"| {flops / n_s / 1e9:.0f} |")
        print(line, flush=True)
        lines.append(line)
        return flops / n_s / 1e9

    g = torch.Generator().manual_seed(0)
    bf16_rate = None
    for d, dtypes in ((64, (torch.float32, torch.bfloat16)), (128, (torch.float32, torch.bfloat16, torch.float16))):
        for dtype in dtypes:
            q, k, v = (torch.randn(B, H, 4096, d, generator=g).to(dtype) for _ in range(3))
            cands = {"native": _kernel("native", lambda: chunked_attention(q, k, v, masks.causal())),
                     "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)}
            if d == 64:
                cands["tiles"] = _kernel("torch tiles", lambda: chunked_attention(q, k, v, masks.causal()))
            with torch.no_grad():
                res = paired_rounds(cands, "sdpa", rounds)
            rate = row(f"causal forward, D={d}, {str(dtype)[6:]}", 4096, res,
                       _h.attention_flops(B, H, 4096, 4096, d, causal=True), 1.0)
            if dtype == torch.bfloat16 and d == 64:
                bf16_rate = rate
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(B, H, 4096, 64, generator=g).to(dtype).requires_grad_(True) for _ in range(3))
        grad = torch.randn(B, H, 4096, 64, generator=g).to(dtype)

        def step(fn):
            return lambda: torch.autograd.grad(fn(), (q, k, v), grad)

        res = paired_rounds({"native": _kernel("native", step(lambda: chunked_attention(q, k, v, masks.causal()))),
                             "sdpa": step(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))},
                            "sdpa", rounds)
        row(f"causal forward+backward (native forward and backward), {str(dtype)[6:]}", 4096, res,
            3 * _h.attention_flops(B, H, 4096, 4096, 64, causal=True), 1.0)
    L = DOCS * DOC_LEN
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(B, H, L, 64, generator=g).to(dtype).requires_grad_(True) for _ in range(3))
        grad = torch.randn(B, H, L, 64, generator=g).to(dtype)
        m = masks.from_seqlens([DOC_LEN] * DOCS) & masks.causal()

        def per_document():
            return torch.cat([F.scaled_dot_product_attention(q[:, :, a:a + DOC_LEN], k[:, :, a:a + DOC_LEN],
                                                             v[:, :, a:a + DOC_LEN], is_causal=True)
                              for a in range(0, L, DOC_LEN)], dim=2)

        res = paired_rounds({"native": _kernel("native", lambda: torch.autograd.grad(chunked_attention(q, k, v, m),
                                                                                      (q, k, v), grad)),
                             "sdpa": lambda: torch.autograd.grad(per_document(), (q, k, v), grad)}, "sdpa", rounds)
        row(f"packed {DOCS}x{DOC_LEN} causal fwd+bwd vs SDPA once per document, {str(dtype)[6:]}", L, res,
            3 * DOCS * _h.attention_flops(B, H, DOC_LEN, DOC_LEN, 64, causal=True), 1 / 1.3)
    for L in (8192, 16384):
        q, k, v = (torch.randn(B, H, L, 64, generator=g) for _ in range(3))
        keep = masks.window(WINDOW).materialize((B, H, L, L), device=q.device, dtype=q.dtype).keep
        with torch.no_grad():
            res = paired_rounds({"native": _kernel("native", lambda: chunked_attention(q, k, v, masks.window(WINDOW))),
                                 "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=keep)},
                                "sdpa", rounds)
        row(f"window({WINDOW}) forward vs SDPA with the dense mask, float32", L, res,
            4.0 * B * H * visible_pairs("window", L) * 64, 1 / 5)
        del keep, res
    if bf16_rate is not None:
        share = bf16_rate / bf16_matmul_gflops()
        lines += ["", f"bfloat16 causal forward (D=64) at {100 * share:.0f}% of this run's bf16 matmul rate "
                      f"(target >= 45%: {_verdict(share, 0.45, at_most=False)})."]
    if memory:
        L = 32768
        extra = peak_extra_bytes("causal-chunked+backward", L)
        lines += ["", f"causal forward+backward at L={L} (B=1, H=8, D=64, float32, fresh process): peak extra "
                      f"memory {extra / 2 ** 20:.0f} MiB (target < 1024 MiB: {_verdict(extra, GiB, at_most=True)})."]
    return lines


# ---------------------------------------------------------------- memory, in a fresh process


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _peak_rss_bytes() -> int:
    """This process's peak resident memory (VmHWM), reset by exec unlike ``ru_maxrss``."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _child(which: str, L: int) -> dict:
    backward = which.endswith("+backward")
    q, k, v = _inputs(L, grad=backward)
    before = _rss_bytes()  # the dense mask SDPA needs is counted: building it is part of the call
    if which.startswith("causal-chunked"):
        out = chunked_attention(q, k, v, masks.causal())
    elif which.startswith("packed-chunked"):
        out = chunked_attention(q, k, v, masks.from_seqlens([L // DOCS] * DOCS) & masks.causal())
    elif which.startswith("packed-sdpa"):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=packed_mask(L)[1])
    elif which.startswith("chunked"):
        out = chunked_attention(q, k, v)
    else:
        out = F.scaled_dot_product_attention(q, k, v)
    if backward:
        out.sum().backward()
    return {"extra_bytes": max(0, _peak_rss_bytes() - before)}


def peak_extra_bytes(which: str, L: int, timeout_s: float = 1800) -> int:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", which, str(L)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])["extra_bytes"]


# ---------------------------------------------------------------- report


def scaling_report(rounds: int, threads=(1, 2)) -> list[str]:
    """Causal forward at L=4096 (H=8), the native kernel and SDPA at each thread count, side by
    side: fastest wall seconds and the process CPU seconds of that call (a kernel that shares its
    work runs in about 1/n of its 1-thread wall time at the same CPU time; a serial one does not)."""
    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    lines = ["| case | threads | native wall ms | native CPU ms | SDPA wall ms | SDPA CPU ms | native / SDPA (wall) |",
             "|---|---|---|---|---|---|---|"]
    before = torch.get_num_threads()
    try:
        for D in (64, 128):
            for dtype in (torch.float32, torch.bfloat16):
                g = torch.Generator().manual_seed(0)
                q, k, v = (torch.randn(1, 8, 4096, D, generator=g).to(dtype) for _ in range(3))
                cands = {"native": _kernel("native", lambda: chunked_attention(q, k, v, masks.causal())),
                         "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)}
                for n in threads:
                    torch.set_num_threads(n)
                    best = {name: (float("inf"), 0.0) for name in cands}
                    for fn in cands.values():
                        fn()
                    for _ in range(rounds):
                        for name, fn in cands.items():
                            w0, c0 = time.perf_counter(), cpu()
                            fn()
                            w, c = time.perf_counter() - w0, cpu() - c0
                            best[name] = min(best[name], (w, c))
                    (nw, nc), (sw, sc) = best["native"], best["sdpa"]
                    lines.append(f"| causal forward, D={D}, {str(dtype)[6:]} | {n} | {nw * 1e3:.0f} | {nc * 1e3:.0f} | "
                                 f"{sw * 1e3:.0f} | {sc * 1e3:.0f} | {nw / sw:.2f} |")
                    print(lines[-1], flush=True)
    finally:
        torch.set_num_threads(before)
    return lines


def main(argv=None, *, quick: bool = False) -> str:
    p = argparse.ArgumentParser(prog="bench_chunked", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="L = 8192, two rounds")
    p.add_argument("--length", type=int, default=None, help="sequence length (default 32768, quick 8192)")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--blocks", default=None, help="compare tile sizes instead, e.g. 256x1024,128x2048")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--only-memory", action="store_true")
    p.add_argument("--issue13", action="store_true", help="only issue 13's rows (causal fp32/bf16 at 4096, packed)")
    p.add_argument("--issue22", action="store_true", help="only issue 22's rows: the native kernel vs SDPA")
    p.add_argument("--issue22-memory", action="store_true", help="only issue 22's memory target (L=32768)")
    p.add_argument("--scaling", action="store_true", help="the native kernel and SDPA at 1 and 2 threads (wall and CPU time)")
    args = p.parse_args([] if argv is None else argv)
    quick = quick or args.quick
    L = args.length or (8192 if quick else 32768)
    rounds = args.rounds or (2 if quick else 3)
    threads = torch.get_num_threads()
    head = (f"torch {torch.__version__}, {threads} threads, {os.cpu_count()} cores, load average "
            f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}; fp32 matmul {matmul_gflops():.1f} GFLOP/s")
    print(head, flush=True)
    if args.issue22_memory:
        extra = peak_extra_bytes("causal-chunked+backward", 32768)
        report = f"causal forward+backward at L=32768: peak extra memory {extra / 2 ** 20:.0f} MiB"
        print(report)
        return report
    if args.scaling:
        report = "\n".join([head, ""] + scaling_report(rounds))
        print(report)
        return report
    if args.issue22:
        report = "\n".join([head, ""] + issue22_report(rounds, memory=not args.no_memory))
        print(report)
        return report
    if args.issue13:
        report = "\n".join([head, ""] + issue13_report(rounds))
        print(report)
        return report
    if args.blocks:
        configs = [tuple(int(x) for x in c.split("x")) for c in args.blocks.split(",")]
        block_rows(L, rounds, configs)
        return head
    lines = ["## chunked backend vs SDPA (forward, B=1, H=8, D=64, fp32)", "", head, "",
             f"default tiles: {chunked.BLOCK_ROWS} query rows x {chunked.BLOCK_K} keys", "",
             "| case | L | chunked s | SDPA s | chunked / SDPA | chunked GFLOP/s | SDPA GFLOP/s |",
             "|---|---|---|---|---|---|---|"]
    for r in ([] if args.only_memory else speed_rows(L, rounds)):
        lines.append(f"| {r['case']} | {r['L']} | {r['chunked_s']:.3f} | {r['sdpa_s']:.3f} | "
                     f"{r['chunked/sdpa']:.2f} | {r['chunked_gflops']:.1f} | {r['sdpa_gflops']:.1f} |")
    lines += ["", f"SDPA's window({WINDOW}) gets the mask as a dense (L, L) bool tensor."]
    if not args.no_memory:
        lines += ["", "| peak extra memory (fresh process), no mask | L | MiB |", "|---|---|---|"]
        for which in ("chunked", "sdpa", "chunked+backward"):
            extra = peak_extra_bytes(which, L)
            print(f"peak extra memory {which} L={L}: {extra / 2**20:.0f} MiB", flush=True)
            lines.append(f"| {which} | {L} | {extra / 2**20:.0f} |")
    report = "\n".join(lines)
    print(report)
    return report


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(_child(sys.argv[2], int(sys.argv[3]))))
    else:
        main(sys.argv[1:])
