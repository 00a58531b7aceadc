"""Generation: one decode step against the raw tensor ops it needs, and tokens/s with and
without a KV cache.

Targets: one decode step at issue 12's size (B=1, d=512, h=8, 256 cached tokens) costs at most
1.2x the raw ops (fused QKV linear, view, in-place cache write, SDPA, output linear, written by
hand below), measured side by side in one process; the same at B=1, d=1024, h=16, 2048 cached
tokens is reported too. The module's step with a :class:`multihead.StaticKVCache` (run eagerly:
attention over all of ``max_len``, the price of fixed shapes) is listed beside it. Decoding 512
tokens step by step with the cache is at least 10x faster than recomputing the full causal
attention over the whole prefix at every step.

The module's q/k/v parameters are rows of one stacked block, which a one-row step projects
with in one product (see `multihead.decoding`); "module, three products" is the same module with
its parameters re-bound to separate tensors (``p.data = p.data.clone()``: what FSDP or
``load_state_dict(assign=True)`` leave), which projects with three, as before the block existed.
Prefill (a 256-token prompt into a fresh cache) and a training step (forward + backward) are
timed for both beside it: they make three products either way, so their ratio shows the block
costs them nothing.

``python -m benchmarks.bench_decode`` runs these tables alone (about two minutes), naming the
CPU (model, and whether it has AVX2, AVX-512, AMX).
"""

from __future__ import annotations

import copy
import os
import time

import torch
import torch.nn.functional as F

import multihead
from multihead import decoding

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


def _three_products(m: multihead.MultiHeadAttention) -> multihead.MultiHeadAttention:
    """A copy of ``m`` whose q/k/v parameters are separate tensors: no stacked block, so every
    call projects with three products."""
    twin = copy.deepcopy(m)
    for lin in (twin.q_proj, twin.k_proj, twin.v_proj):
        for p in lin.parameters():
            p.data = p.data.clone()
    if twin.stacked_qkv() is not None:  # an invariant of the re-binding above
        raise RuntimeError("the copy still has its stacked block")
    return twin


def cpu_line() -> str:
    """The CPU's model name and the vector/matrix extensions that decide its kernels."""
    flags: set = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    avx512 = sorted(f for f in flags if f.startswith("avx512"))
    amx = sorted(f for f in flags if f.startswith("amx"))
    return (f"CPU: {h.cpu_model()}; avx2: {'yes' if 'avx2' in flags else 'no'}; "
            f"avx512: {', '.join(avx512) if avx512 else 'no'}; amx: {', '.join(amx) if amx else 'no'}; "
            f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()})")


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
    three = _three_products(m)
    cache, static = multihead.KVCache(max_len), multihead.StaticKVCache(max_len)
    cache3 = multihead.KVCache(max_len)
    m(prompt, cache=cache)
    m(prompt, cache=static)
    three(prompt, cache=cache3)
    raw = RawStep(m, cache.keys, cache.values, max_len)

    def module_step():
        cache.length = cached  # rewind, so every call appends token cached + 1
        return m(x, cache=cache)

    def three_step():
        cache3.length = cached
        return three(x, cache=cache3)

    def static_step():
        static.length = cached
        return m(x, cache=static)

    def general_step():
        cache.length = cached
        decoding.ENABLED = False
        try:
            return m(x, cache=cache)
        finally:
            decoding.ENABLED = True

    cands = {"raw": lambda: raw(x), "module": module_step, "module, general path": general_step,
             "module, three products": three_step, "module, static cache": static_step}
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
                t, ratio = h.paired_ratios(cands, "raw", rounds, run_s)
                r = ratio["module"]
                if i == 0:
                    ratios[threads] = r
                rows.append([f"d={d}, h={heads}, {cached} cached", threads, h.fmt_ms(t["raw"]), h.fmt_ms(t["module"]),
                             h.fmt_ratio(r), "yes" if r <= STEP_TARGET else "**no**",
                             h.fmt_ratio(ratio["module, general path"]), h.fmt_ratio(ratio["module, three products"]),
                             h.fmt_ms(t["module, static cache"]), h.fmt_ratio(ratio["module, static cache"])])
            torch.set_num_threads(default_threads)
    text = (
        f"One decode step, B=1, fp32, the module with a KVCache against the raw ops written by hand in "
        f"benchmarks/bench_decode.py (RawStep); the first size is issue 12's target ({rounds} interleaved "
        f"rounds of {run_s:.2f} s a candidate; times: the least of the rounds' medians; ratios: the median "
        f"over rounds of each round's ratio to the raw ops; outputs agree to {max(errs):.1e}). The module's "
        "step is its `multihead.decoding.DecodeStep` (what the first step decided, under guards); \"general path\" is "
        "the same module with `decoding.ENABLED = False`, deciding everything at every step. The static "
        "cache (max_len = 2 x cached, run eagerly) attends over all of max_len with a mask: the price of "
        "shapes that never change, which is what lets torch.compile keep one graph.\n\n"
        + h.md_table(["size", "torch threads", "raw ops ms", "module ms", "ratio", f"<= {STEP_TARGET}",
                      "general path / raw", "three products / raw", "static cache ms", "static / raw"], rows)
    )
    return text, ratios


#: (B, L) of the prefill and of the training step, at the target's d and heads
PREFILL, TRAIN = (1, 256), (4, 128)


def prefill_and_training(budget: h.Budget) -> tuple[str, dict]:
    """The module against its three-product copy, side by side, where both make three products:
    prefill (eval, no_grad, a fresh KVCache) and a training step (train mode, forward + backward).
    Returns (markdown, {case: module / three products})."""
    d, heads, _ = STEP_SIZES[0]
    m = _layer(d=d, heads=heads)
    three = _three_products(m)
    torch.manual_seed(3)
    prompt = torch.randn(1, PREFILL[1], d)
    batch = torch.randn(*TRAIN, d)

    def prefill(mod):
        def run():
            with torch.no_grad():
                return mod(prompt, cache=multihead.KVCache(PREFILL[1]))
        return run

    def train_step(mod):
        def run():
            mod.zero_grad(set_to_none=True)
            mod(batch).square().mean().backward()
        return run

    rounds, run_s = budget.rounds + 8, budget.min_run_s / 2
    ratios, rows = {}, []
    for case, make, mode in (("prefill", prefill, "eval"), ("training step", train_step, "train")):
        for mod in (m, three):
            mod.train(mode == "train")
        t = h.side_by_side({"module": make(m), "three products": make(three)}, rounds, run_s)
        ratios[case] = r = t["module"] / t["three products"]
        shape = PREFILL if case == "prefill" else TRAIN
        rows.append([case, f"B={shape[0]}, L={shape[1]}", h.fmt_ms(t["three products"]), h.fmt_ms(t["module"]),
                     h.fmt_ratio(r)])
    text = (
        f"Prefill and training at d={d}, h={heads}, fp32, {torch.get_num_threads()} thread(s): the module against "
        f"the same module without its stacked block (min over {rounds} interleaved rounds of {run_s:.2f} s).\n\n"
        + h.md_table(["case", "shape", "three products ms", "module ms", "module / three products"], rows)
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
    """The decode-step, prefill and training tables, quick budget (``python -m benchmarks.bench_decode``)."""
    budget = h.Budget.make(quick=True, max_gib=4.0)
    print(cpu_line() + "; load average " + ", ".join(f"{x:.1f}" for x in os.getloadavg()) + "\n")
    text, ratios = decode_step(budget)
    print(text + "\n")
    other, other_ratios = prefill_and_training(budget)
    print(other + "\n")
    print("module / raw at the target size: " + ", ".join(f"{r:.3f} with {n} thread(s)" for n, r in ratios.items()))
    print("module / three products: " + ", ".join(f"{case} {r:.3f}" for case, r in other_ratios.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
