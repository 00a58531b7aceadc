"""Plain causal self-attention: chunked's native kernel against SDPA's own causal kernel, the
measurement behind ``auto``'s rule for plain causal calls (``multihead.backends.sdpa``:
``PLAIN_CAUSAL_MIN_LENGTH``, float32 without gradients and bfloat16 with gradients go native).

``OMP_NUM_THREADS=2 python -m benchmarks.bench_plain_causal`` prints, for B=1, H=8, D=64 and
L = 512 .. 4096, native / SDPA (best of 5 after a warm-up, forward alone and forward + backward)
in float32 and bfloat16, through the functional API as a user calls it, with the CPU's model and
features. Figures and the machine they came from: docs/benchmarks.md (issue 22).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from multihead import masks
from multihead.backends import native
from multihead.backends.chunked import chunked_attention


def _best(fn, n: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {native.status()}")
    print("| dtype | L | pass | native / SDPA | native ms | SDPA ms |\n|---|---|---|---|---|---|")
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for L in (512, 1024, 2048, 4096):
            for grad in (False, True):
                q, k, v = (torch.randn(1, 8, L, 64, dtype=dtype, requires_grad=grad) for _ in range(3))

                def run(attend):
                    def step():
                        out = attend()
                        if grad:
                            out.sum().backward()
                    return step

                a = _best(run(lambda: chunked_attention(q, k, v, masks.causal())))
                b = _best(run(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)))
                print(f"| {str(dtype)[6:]} | {L} | {'fwd+bwd' if grad else 'fwd'} | {a / b:.2f} | "
                      f"{a * 1e3:.1f} | {b * 1e3:.1f} |", flush=True)


if __name__ == "__main__":
    main()
