"""Side by side: every implementation on the same self-attention layer, as ratios to raw SDPA.

For each sequence length L and each case (forward / forward+backward, fp32 / bf16, causal /
full), all implementations run interleaved in one process; the table gives milliseconds per
call, the ratio to ``raw SDPA`` (1.00 = as fast as the hand-written fused path), and raw SDPA's
achieved GFLOP/s with its fraction of the matmul rate measured in the same run.
"""

from __future__ import annotations

import torch

from . import harness as h
from .impls import Case, build, est_bytes, impl_names

B, D_MODEL, HEADS = 1, 512, 8


def est_seconds(name: str, c: Case) -> float:
    """Pessimistic time estimate: full (non-causal) FLOPs at 30% of the matmul rate; the
    score-materialising implementations at 10%."""
    flops = h.mha_flops(c.B, c.L, c.d, c.H, causal=False, backward=c.backward)
    eff = 0.1 if name in ("multihead[reference]", "nn.MHA weights=True", "naive") else 0.3
    return flops / (eff * h.matmul_rate(c.dtype))


def check_agreement() -> list:
    """Every implementation's output on one small case against raw SDPA (fp32, causal)."""
    rows = []
    for causal in (False, True):
        c = Case(2, 64, 64, 4, torch.float32, causal, False)
        outs = {}
        for name in impl_names():
            fn = build(name, c)
            outs[name] = fn()
        ref = outs["raw SDPA"]
        for name, o in outs.items():
            rows.append((name, "causal" if causal else "full", f"{(o - ref).abs().max().item():.1e}"))
    return rows


def run(budget: h.Budget, lengths) -> str:
    names = impl_names()
    sections = []
    for L in lengths:
        rows = []
        for backward in (False, True):
            for dtype in (torch.float32, torch.bfloat16):
                for causal in (False, True):
                    c = Case(B, L, D_MODEL, HEADS, dtype, causal, backward)
                    cands, cells, skipped = {}, {}, []
                    for name in names:
                        mem, secs = est_bytes(name, c), est_seconds(name, c)
                        if mem > budget.max_bytes:
                            cells[name] = "skip (mem)"
                            skipped.append(f"{name} (~{mem / h.GiB:.1f} GiB > {budget.max_bytes / h.GiB:.1f} GiB budget)")
                        elif secs > budget.max_call_s:
                            cells[name] = "skip (time)"
                            skipped.append(f"{name} (~{secs:.0f} s per call > {budget.max_call_s:g} s budget)")
                        else:
                            cands[name] = build(name, c)
                    if skipped:
                        budget.skip(f"L={L} {c.label}", ", ".join(skipped))
                    if "raw SDPA" not in cands:
                        continue
                    print(f"  L={L} {c.label}: {len(cands)} implementations", flush=True)
                    times = h.side_by_side(cands, budget.rounds, budget.min_run_s)
                    base = times["raw SDPA"]
                    for name, t in times.items():
                        cells[name] = f"{h.fmt_ms(t)} ({h.fmt_ratio(t / base)})"
                    flops = h.mha_flops(c.B, c.L, c.d, c.H, causal=c.causal, backward=c.backward)
                    rate = flops / base
                    frac = rate / h.matmul_rate(dtype)
                    rows.append([c.label, *[cells[n] for n in names], f"{rate / 1e9:.1f}", f"{100 * frac:.0f}%"])
                    del cands
        if rows:
            sections.append(
                f"### L = {L} (B={B}, d={D_MODEL}, H={HEADS}, D={D_MODEL // HEADS})\n\n"
                "ms per call (ratio to raw SDPA); forward runs in eval mode under no_grad, "
                "forward+backward in train mode.\n\n"
                + h.md_table(["case", *names, "raw SDPA GFLOP/s", "of matmul rate"], rows)
            )
        else:
            sections.append(f"### L = {L}\n\nEvery case skipped at this length (see the skip list).")
    return "\n\n".join(sections)
