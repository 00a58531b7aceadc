"""Generation: one decode step against the raw tensor ops it needs, and tokens/s with and
without a KV cache.

Targets: one decode step (B=1, d=1024, h=16, 2048 cached tokens) costs at most 1.2x the raw ops
(fused QKV linear, view, cache write, SDPA, output linear, written by hand below); decoding 512
tokens step by step with the cache is at least 10x faster than recomputing the full causal
attention over the whole prefix at every step.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

import multihead

from . import harness as h

D_MODEL, HEADS, CACHED, MAX_LEN = 1024, 16, 2048, 4096
STEP_TARGET, SPEEDUP_TARGET, TOKENS = 1.2, 10.0, 512


def _layer(rope: bool = False, seed: int = 0) -> multihead.MultiHeadAttention:
    torch.manual_seed(seed)
    return multihead.MultiHeadAttention(D_MODEL, HEADS, causal=True, rope=rope).eval()


class RawStep:
    """One decode step written by hand over preallocated buffers (B=1, no RoPE)."""

    def __init__(self, m: multihead.MultiHeadAttention, keys: torch.Tensor, values: torch.Tensor):
        c = m.config
        self.H, self.D, self.d = c.num_heads, c.head_dim, c.d_out
        self.w_qkv = torch.cat([m.q_proj.weight, m.k_proj.weight, m.v_proj.weight]).detach()
        self.b_qkv = torch.cat([m.q_proj.bias, m.k_proj.bias, m.v_proj.bias]).detach()
        self.w_o, self.b_o = m.out_proj.weight.detach(), m.out_proj.bias.detach()
        self.k_buf = torch.empty(1, self.H, MAX_LEN, self.D)
        self.v_buf = torch.empty(1, self.H, MAX_LEN, self.D)
        n = keys.shape[2]
        self.k_buf[:, :, :n] = keys
        self.v_buf[:, :, :n] = values
        self.n = n

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = self.n
        q, k, v = F.linear(x, self.w_qkv, self.b_qkv).view(1, 1, 3, self.H, self.D).unbind(2)
        self.k_buf[:, :, n:n + 1].copy_(k.transpose(1, 2))
        self.v_buf[:, :, n:n + 1].copy_(v.transpose(1, 2))
        o = F.scaled_dot_product_attention(q.transpose(1, 2), self.k_buf[:, :, :n + 1], self.v_buf[:, :, :n + 1])
        return F.linear(o.transpose(1, 2).reshape(1, 1, self.d), self.w_o, self.b_o)


def _thread_counts() -> list:
    """The default thread count, and 1: a decode step is a chain of small, memory-bound ops, where
    synchronising threads can cost more than it saves (much more on a loaded machine)."""
    n = torch.get_num_threads()
    return [n, 1] if n > 1 else [n]


def decode_step(budget: h.Budget) -> tuple[str, dict]:
    m = _layer()
    torch.manual_seed(1)
    prompt = torch.randn(1, CACHED, D_MODEL)
    x = torch.randn(1, 1, D_MODEL)
    cache = multihead.KVCache(MAX_LEN)
    default_threads = torch.get_num_threads()
    rows, ratios = [], {}
    rounds = budget.rounds + 4
    with torch.no_grad():
        m(prompt, cache=cache)
        raw = RawStep(m, cache.keys, cache.values)

        def module_step():
            cache.length = CACHED  # rewind, so every call appends token CACHED + 1
            return m(x, cache=cache)

        err = (module_step() - raw(x)).abs().max().item()
        for threads in _thread_counts():
            torch.set_num_threads(threads)
            t = h.side_by_side({"raw": lambda: raw(x), "module": module_step}, rounds, budget.min_run_s)
            r = ratios[threads] = t["module"] / t["raw"]
            rows.append([threads, h.fmt_ms(t["raw"]), h.fmt_ms(t["module"]), h.fmt_ratio(r),
                         "yes" if r <= STEP_TARGET else "**no**"])
        torch.set_num_threads(default_threads)
    text = (
        f"One decode step, B=1, d={D_MODEL}, h={HEADS}, {CACHED} cached tokens, fp32 "
        f"(min over {rounds} interleaved rounds; outputs agree to {err:.1e}). The raw ops are written "
        "by hand in benchmarks/bench_decode.py (RawStep).\n\n"
        + h.md_table(["torch threads", "raw ops ms", "module ms", "ratio", f"<= {STEP_TARGET}"], rows)
    )
    return text, ratios


def _generate(m, xs, cached: bool) -> tuple[float, torch.Tensor]:
    """Seconds to run len(xs) steps; the last output."""
    L = xs.shape[1]
    with torch.no_grad():
        t0 = time.perf_counter()
        if cached:
            cache = multihead.KVCache(L)
            for t in range(L):
                y = m(xs[:, t:t + 1], cache=cache)
        else:
            for t in range(L):
                y = m(xs[:, : t + 1])[:, -1:]
        return time.perf_counter() - t0, y


def tokens_per_second(budget: h.Budget) -> tuple[str, dict]:
    rows, speedups = [], {}
    torch.manual_seed(2)
    xs = torch.randn(1, TOKENS, D_MODEL)
    default_threads = torch.get_num_threads()
    variants = [(threads, False) for threads in _thread_counts()]
    if not budget.quick:
        variants.append((default_threads, True))
    for threads, rope in variants:
        torch.set_num_threads(threads)
        m = _layer(rope)
        _generate(m, xs[:, :8], True)  # warm up
        with_cache, y1 = min((_generate(m, xs, True) for _ in range(2 if budget.quick else 3)), key=lambda p: p[0])
        print(f"  decode {TOKENS} tokens, {threads} threads, rope={rope}: with cache {with_cache:.2f} s; now without", flush=True)
        without, y2 = _generate(m, xs, False)
        err = (y1 - y2).abs().max().item()
        s = without / with_cache
        if not rope:
            speedups[threads] = s
        rows.append([
            threads, "yes" if rope else "no", f"{TOKENS / with_cache:.0f}", f"{TOKENS / without:.1f}", f"{s:.1f}",
            "yes" if s >= SPEEDUP_TARGET else "**no**", f"{err:.1e}",
        ])
    torch.set_num_threads(default_threads)
    text = (
        f"Decoding {TOKENS} tokens one at a time (B=1, d={D_MODEL}, h={HEADS}, fp32, one layer): with a "
        "KVCache vs recomputing the full causal forward over the whole prefix at every step "
        "(best of 2-3 runs with the cache, one run without).\n\n"
        + h.md_table(["torch threads", "rope", "tokens/s with cache", "tokens/s without", "speed-up",
                      f">= {SPEEDUP_TARGET:g}x", "last output difference"], rows)
    )
    return text, speedups
