"""Ring attention: per-rank peak memory and time for long sequences, P = 1, 2, 4 processes.

Each configuration is launched with torchrun (gloo, one host). Every rank creates only its own
shard (B, H, L/P, D) of q, k, v, runs ``ring_attention`` forward and backward once, and
reports its wall time, its peak resident memory (``ru_maxrss``) and that peak above its
baseline (the peak after importing torch, joining the process group and one tiny warm-up
call). Run::

    python benchmarks/bench_ring.py                      # L = 16k, 32k, 64k; P = 1, 2, 4
    python benchmarks/bench_ring.py --seq-lens 4096 --ranks 1 2 --markdown out.md   # appends
    python benchmarks/bench_ring.py --seq-lens 65536 --no-backward                 # forward only
    python benchmarks/bench_ring.py --mode ulysses --heads 8 --ranks 1 2 4 8       # all-to-all

Ranks on one host share its cores (one torch thread per rank unless ``--threads``): with more
ranks than cores the time is not a speed-up measurement; the point is memory per rank and
that the ring runs. Attention FLOPs are reported as achieved GFLOP/s over all ranks
(forward 4·B·H·L²·D, backward 2.5x that; halved when causal).

Legend: B batch, H query heads, L sequence length, P ranks, D head dim.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

def _worker(args) -> None:
    import resource

    import torch
    import torch.distributed as dist

    from multihead import masks
    from multihead.distributed import ring_attention
    from multihead.distributed import ulysses_attention

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    def run(q, k, v):
        if args.mode == "ring":
            return ring_attention(q, k, v, causal=args.causal)
        return ulysses_attention(q, k, v, masks.causal() if args.causal else None, layout="contiguous")

    # a tiny call first, so that the baseline includes torch's lazy initialisation
    tiny = [torch.randn(1, world, 8, 8, requires_grad=True) for _ in range(3)]
    run(*tiny).sum().backward()
    base_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    n = args.seq_len // world
    g = torch.Generator().manual_seed(rank)
    shape = (args.batch, args.heads, n, args.head_dim)
    q, k, v = (torch.randn(shape, generator=g).requires_grad_(True) for _ in range(3))
    grad = torch.randn(shape, generator=g)
    dist.barrier()
    t0 = time.perf_counter()
    out = run(q, k, v)
    t1 = time.perf_counter()
    if args.backward:
        out.backward(grad)
    t2 = time.perf_counter()
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    finite = bool(torch.isfinite(out).all() and (not args.backward or torch.isfinite(q.grad).all()))
    shard_bytes = q.numel() * q.element_size()
    (args.results / f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "world": world, "seq_len": args.seq_len, "forward_s": t1 - t0, "backward_s": t2 - t1,
        "peak_mib": peak_kib / 1024, "above_base_mib": (peak_kib - base_kib) / 1024,
        "shard_mib": shard_bytes / 2**20, "finite": finite, "threads": torch.get_num_threads(),
    }))
    dist.destroy_process_group()


def _launch(args, seq_len: int, world: int, results: Path) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
        __file__, "--worker", f"--seq-len={seq_len}", f"--batch={args.batch}", f"--heads={args.heads}",
        f"--head-dim={args.head_dim}", "--causal" if args.causal else "--no-causal", f"--mode={args.mode}",
        "--backward" if args.backward else "--no-backward", f"--results={results}",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    rows = [json.loads(f.read_text()) for f in sorted(results.glob("rank*.json"))]
    if proc.returncode or len(rows) != world:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return rows


def _gflops(args, seq_len: int, seconds: float, factor: float) -> float:
    flops = 4 * args.batch * args.heads * seq_len**2 * args.head_dim * factor
    return flops * (0.5 if args.causal else 1.0) / seconds / 1e9


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[16384, 32768, 65536])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--mode", choices=("ring", "ulysses"), default="ring",
                   help="ring_attention, or ulysses_attention (all-to-all; P must divide H)")
    p.add_argument("--backward", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the backward pass (--no-backward: forward only)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (OMP_NUM_THREADS)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per configuration")
    p.add_argument("--markdown", type=Path, help="also write the table to this file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--seq-len", type=int, help=argparse.SUPPRESS)
    p.add_argument("--results", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0

    header = (
        f"{args.mode}: B={args.batch}, H={args.heads}, D={args.head_dim}, float32, causal={args.causal} "
        f"({'zigzag' if args.mode == 'ring' else 'contiguous'} layout), {args.threads} thread(s) per rank, {os.cpu_count()} CPU cores shared by all ranks\n\n"
        "| L | P | pass | shard q (MiB) | peak RSS per rank (MiB) | above baseline (MiB) | dense scores, one process (MiB) "
        "| forward (s) | backward (s) | GFLOP/s (all ranks) |\n"
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    print(header, flush=True)
    lines = [header]
    for seq_len in args.seq_lens:
        for world in args.ranks:
            with tempfile.TemporaryDirectory() as tmp:
                rows = _launch(args, seq_len, world, Path(tmp))
            if not all(r["finite"] for r in rows):
                raise RuntimeError(f"non-finite output at L={seq_len}, P={world}")
            fwd = max(r["forward_s"] for r in rows)
            bwd = max(r["backward_s"] for r in rows) if args.backward else None
            dense = args.batch * args.heads * seq_len**2 * 4 / 2**20
            line = (
                f"| {seq_len} | {world} | {'fwd+bwd' if args.backward else 'fwd'} | {rows[0]['shard_mib']:.0f} "
                f"| {max(r['peak_mib'] for r in rows):.0f} | {max(r['above_base_mib'] for r in rows):.0f} | {dense:.0f} "
                f"| {fwd:.1f} | {'-' if bwd is None else f'{bwd:.1f}'} "
                f"| {_gflops(args, seq_len, fwd + (bwd or 0.0), 3.5 if args.backward else 1.0):.1f} |"
            )
            print(line, flush=True)
            lines.append(line)
    if args.markdown:
        with args.markdown.open("a") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
