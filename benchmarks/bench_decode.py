"""Generation: one decode step against the raw tensor ops it needs, and tokens/s with and
without a KV cache.

Targets: one decode step at issue 12's size (B=1, d=512, h=8, 256 cached tokens) costs at most
1.2x the raw ops (fused QKV linear, view, in-place cache write, SDPA, output linear, written by
hand below), measured side by side in one process; the same at B=1, d=1024, h=16, 2048 cached
tokens is reported too. The module's step with a :class:`multihead.StaticKVCache` (run eagerly:
attention over all of ``max_len``, the price of fixed shapes) is listed beside it. Decoding 512
tokens step by step with the cache is at least 10x faster than recomputing the full causal
attention over the whole prefix at every step.

``python -m benchmarks.bench_decode`` runs the decode-step table alone (about a minute).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

import multihead

from . import harness as h

#: (d_model, heads, cached tokens) of the decode-step tables; the first is issue 12's target
STEP_SIZES = [(512, 8, 256), (1024, 16, 2048)]
D_MODEL, HEADS = 1024, 16
STEP_TARGET, SPEEDUP_TARGET, TOKENS = 1.2, 10.0, 512


def _layer(rope: bool = False, seed: int = 0, d: int = D_MODEL, heads: int = HEADS) -> multihead.MultiHeadAttention:
    torch.manual_seed(seed)
    return multihead.MultiHeadAttention(d, heads, causal=True, rope=rope).eval()


class RawStep:
    """One decode step written by hand over preallocated buffers (B=1, no RoPE): one linear with
    the pre-concatenated [W_q; W_k; W_v], the new key/value copied into place, SDPA over the
    filled part, the output linear."""

    def __init__(self, m: multihead.MultiHeadAttention, keys: torch.Tensor, values: torch.Tensor, max_len: int):
        c = m.config
        self.H, self.D, self.d = c.num_heads, c.head_dim, c.d_out
        self.w_qkv = torch.cat([m.q_proj.weight, m.k_proj.weight, m.v_proj.weight]).detach()
        self.b_qkv = torch.cat([m.q_proj.bias, m.k_proj.bias, m.v_proj.bias]).detach()
        self.w_o, self.b_o = m.out_proj.weight.detach(), m.out_proj.bias.detach()
        self.k_buf = keys.new_empty(1, self.H, max_len, self.D)  # the cached keys' device and dtype
        self.v_buf = values.new_empty(1, self.H, max_len, self.D)
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


def _step_candidates(d: int, heads: int, cached: int) -> tuple[dict, float]:
    """{name: one decode step} for the raw ops, the module with a KVCache and with a
    StaticKVCache, each appending token ``cached + 1`` again and again; and the largest
    difference between their outputs."""
    max_len = 2 * cached
    m = _layer(d=d, heads=heads)
    torch.manual_seed(1)
    prompt = torch.randn(1, cached, d)
    x = torch.randn(1, 1, d)
    cache, static = multihead.KVCache(max_len), multihead.StaticKVCache(max_len)
    m(prompt, cache=cache)
    m(prompt, cache=static)
    raw = RawStep(m, cache.keys, cache.values, max_len)

    def module_step():
        cache.length = cached  # rewind, so every call appends token cached + 1
        return m(x, cache=cache)

    def static_step():
        static.length = cached
        return m(x, cache=static)

    cands = {"raw": lambda: raw(x), "module": module_step, "module, static cache": static_step}
    ref = raw(x)
    err = max((fn() - ref).abs().max().item() for fn in cands.values())
    return cands, err


def decode_step(budget: h.Budget) -> tuple[str, dict]:
    """The decode-step tables; returns (markdown, {threads: module / raw} at the target size)."""
    default_threads = torch.get_num_threads()
    # a step takes well under a millisecond: many short rounds, so that the least disturbed one
    # (the minimum over rounds) is found even on a busy machine
    rounds, run_s = 5 * (budget.rounds + 4), budget.min_run_s / 4
    rows, ratios, errs = [], {}, []
    with torch.no_grad():
        for i, (d, heads, cached) in enumerate(STEP_SIZES):
            cands, err = _step_candidates(d, heads, cached)
            errs.append(err)
            for threads in _thread_counts():
                torch.set_num_threads(threads)
                t = h.side_by_side(cands, rounds, run_s)
                r = t["module"] / t["raw"]
                if i == 0:
                    ratios[threads] = r
                rows.append([f"d={d}, h={heads}, {cached} cached", threads, h.fmt_ms(t["raw"]), h.fmt_ms(t["module"]),
                             h.fmt_ratio(r), "yes" if r <= STEP_TARGET else "**no**",
                             h.fmt_ms(t["module, static cache"]), h.fmt_ratio(t["module, static cache"] / t["raw"])])
            torch.set_num_threads(default_threads)
    text = (
        f"One decode step, B=1, fp32, the module with a KVCache against the raw ops written by hand in "
        f"benchmarks/bench_decode.py (RawStep); the first size is issue 12's target (min over {rounds} "
        f"interleaved rounds of {run_s:.2f} s; outputs agree to {max(errs):.1e}). The static cache (max_len = 2 x cached, "
        "run eagerly) attends over all of max_len with a mask: the price of shapes that never change, "
        "which is what lets torch.compile keep one graph.\n\n"
        + h.md_table(["size", "torch threads", "raw ops ms", "module ms", "ratio", f"<= {STEP_TARGET}",
                      "static cache ms", "static / raw"], rows)
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


def main() -> int:
    """The decode-step table alone, quick budget (``python -m benchmarks.bench_decode``)."""
    text, ratios = decode_step(h.Budget.make(quick=True, max_gib=4.0))
    print(text)
    print("module / raw at the target size: " + ", ".join(f"{r:.3f} with {n} thread(s)" for n, r in ratios.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
