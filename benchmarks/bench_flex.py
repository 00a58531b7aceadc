"""The flex backend (torch's FlexAttention, compiled) against sdpa and chunked, side by side.

Inference (``torch.no_grad``), B=1, H=8, D=64, float32, each call through
``multihead.attention(..., backend=name)``, so flex's figures include what the backend does per
call (translating the mask, building its block mask from the mask's tile states):

* causal: sdpa ``is_causal=True``, chunked (skips the tiles above the diagonal), flex
  (a causal mask_mod and a block mask that skips them too);
* packed documents (8 equal documents, causal within each): sdpa with the dense (L, L) mask,
  chunked and flex with the mask itself (``masks.documents(ids) & masks.causal()``).

The first flex call of each case compiles (torch inductor); its time is reported apart
("compile s") and left out of the timing. Timing is ``benchmarks.harness.side_by_side``: the
candidates interleaved in rounds in this one process, each one's figure the minimum over rounds
of the round's median; the ratios are formed from those. The machine (CPU model, threads, load)
is printed with the table. ``auto``'s CPU rule for flex (``backends.flex._auto_declines``) comes
from these figures: flex where it beat what ``auto`` would run otherwise (packed documents, once
sdpa declines its dense mask: chunked), never for plain causal (sdpa's kernel wins).

``python benchmarks/bench_flex.py [--quick] [--lengths 1024,4096]``; on a machine with CUDA,
``--device cuda`` runs the same table there.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

import torch

_ROOT = Path(__file__).resolve().parent.parent
for _p in (_ROOT / "src", _ROOT):  # this checkout's multihead and benchmarks package
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import multihead  # noqa: E402
from multihead import masks  # noqa: E402
from benchmarks import harness as h  # noqa: E402

B, H, D, DOCS = 1, 8, 64, 8
NAMES = ("sdpa", "chunked", "flex")


def _inputs(L: int, device: str, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, D, generator=g).to(device) for _ in range(3)]


def _masks(case: str, L: int, device: str) -> dict[str, masks.Mask]:
    """The mask each backend gets for ``case``: the same attention, in the form it runs best."""
    if case == "causal":
        m = masks.causal()
        return {name: m for name in NAMES}
    ids = torch.arange(L, device=device) // (L // DOCS)
    m = masks.documents(ids) & masks.causal()
    dense = masks.keep(m.materialize((B, H, L, L), device=torch.device(device), dtype=torch.float32).keep)
    return {"sdpa": dense, "chunked": m, "flex": m}


def rows(case: str, lengths: list[int], rounds: int, min_run_s: float, device: str) -> list[dict]:
    out = []
    for L in lengths:
        q, k, v = _inputs(L, device)
        per = _masks(case, L, device)
        cands: dict[str, Callable[[], object]] = {
            name: (lambda name=name: multihead.attention(q, k, v, per[name], backend=name)) for name in NAMES
        }
        with torch.no_grad():
            t0 = time.perf_counter()
            cands["flex"]()
            compile_s = time.perf_counter() - t0
            best = h.side_by_side(cands, rounds, min_run_s)
        row = {"case": case, "L": L, "compile_s": compile_s, **{f"{n}_s": best[n] for n in NAMES}}
        row["flex/sdpa"] = best["flex"] / best["sdpa"]
        row["flex/chunked"] = best["flex"] / best["chunked"]
        print(row, flush=True)
        out.append(row)
    return out


def main(argv=None) -> str:
    p = argparse.ArgumentParser(prog="bench_flex", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="L = 1024 and 2048, two rounds")
    p.add_argument("--lengths", default=None, help="comma-separated lengths (default 1024,2048,4096)")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else (
        [1024, 2048] if args.quick else [1024, 2048, 4096])
    rounds = args.rounds or (2 if args.quick else 3)
    info = h.machine_info()
    head = "; ".join(f"{k} {v}" for k, v in info.items())
    print(head, flush=True)
    results = [r for case in ("causal", "documents") for r in rows(case, lengths, rounds, 0.3, args.device)]
    table = h.md_table(
        ["case", "L", "sdpa ms", "chunked ms", "flex ms", "flex / sdpa", "flex / chunked", "flex compile s"],
        [[r["case"], r["L"], h.fmt_ms(r["sdpa_s"]), h.fmt_ms(r["chunked_s"]), h.fmt_ms(r["flex_s"]),
          h.fmt_ratio(r["flex/sdpa"]), h.fmt_ratio(r["flex/chunked"]), f"{r['compile_s']:.1f}"] for r in results],
    )
    report = "\n".join([f"## flex backend vs sdpa and chunked ({args.device}, inference, B={B}, H={H}, D={D}, "
                        "float32)", "", head, "", table, "",
                        f"documents: {DOCS} equal documents, causal within each; sdpa gets the dense (L, L) mask. "
                        "flex compile s: its first call of the case; near 0 where an earlier case compiled the same "
                        "graph (causal and documents & causal both become one key-interval mask_mod)."])
    print(report)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
