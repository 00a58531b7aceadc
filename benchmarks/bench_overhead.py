"""Module overhead: MultiHeadAttention (backend "auto") vs the same work written by hand.

The hand-written path is ``impls.RawSDPA``: one fused QKV F.linear, SDPA (is_causal when
causal), the output F.linear. Target: the module costs at most 5% more (ratio <= 1.05), fp32
and bf16, causal and not, forward and forward+backward.
"""

from __future__ import annotations

import torch

from . import harness as h
from .impls import Case, build

CONFIGS = [(8, 512, 512, 8), (1, 4096, 1024, 16)]  # (B, L, d, H)
TARGET = 1.05


def run(budget: h.Budget) -> tuple[str, list]:
    rows, ratios = [], []
    configs = CONFIGS[:1] if budget.quick else CONFIGS
    if budget.quick:
        budget.skip("overhead at (B=1, L=4096, d=1024, h=16)", "quick mode")
    max_call_s = 2 * budget.max_call_s  # this section's targets are worth a longer wait
    for B, L, d, H in configs:
        for backward in (False, True):
            for dtype in (torch.float32, torch.bfloat16):
                for causal in (False, True):
                    c = Case(B, L, d, H, dtype, causal, backward)
                    est = h.mha_flops(B, L, d, H, causal, backward) / (0.5 * h.matmul_rate(dtype))
                    if est > max_call_s:
                        budget.skip(f"overhead at B={B} L={L} d={d} h={H} {c.label}",
                                    f"~{est:.0f} s per call estimated > {max_call_s:g} s budget")
                        rows.append([f"B={B} L={L} d={d} h={H}", c.label, "skip (time)", "", "", ""])
                        continue
                    rounds = budget.rounds + (2 if est < 1.0 else 0)
                    print(f"  overhead B={B} L={L} d={d} h={H} {c.label}", flush=True)
                    cands = {"hand": build("raw SDPA", c), "module": build("multihead[auto]", c)}
                    t = h.side_by_side(cands, rounds, budget.min_run_s)
                    r = t["module"] / t["hand"]
                    ratios.append(r)
                    rows.append([f"B={B} L={L} d={d} h={H}", c.label, h.fmt_ms(t["hand"]), h.fmt_ms(t["module"]),
                                 h.fmt_ratio(r), "yes" if r <= TARGET else "**no**"])
    text = (
        "Module (backend \"auto\") vs the same work by hand (fused QKV F.linear, SDPA, output F.linear); "
        f"ms per call, min over {budget.rounds} (slow calls) to {budget.rounds + 2} interleaved rounds. Target: ratio <= {TARGET}.\n\n"
        + h.md_table(["shape", "case", "hand ms", "module ms", "ratio", f"<= {TARGET}"], rows)
    )
    return text, ratios
