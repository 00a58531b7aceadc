"""A small pre-LN GPT built on ``MultiHeadAttention``, used as a practitioner would use it.

Training runs under CPU autocast to bfloat16 (float32 weights, AdamW); the same model is compiled
with ``torch.compile(fullgraph=True)`` and generates greedily with one ``StaticKVCache`` per
layer without recompiling per cache length; its logits equal the eager model's with a plain
``KVCache`` and a full recomputation. Legend: B batch, L tokens, V vocabulary, d model width.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import multihead
from oracle import one_thread

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

V, D_MODEL, HEADS, KV_HEADS, LAYERS = 32, 32, 4, 2, 2


class Block(nn.Module):
    """x + attn(ln(x)), then x + mlp(ln(x)): the pre-LN block of GPT-2 and Llama."""

    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.attn = multihead.MultiHeadAttention(D_MODEL, HEADS, num_kv_heads=KV_HEADS, causal=True, rope=True)
        self.mlp = nn.Sequential(nn.Linear(D_MODEL, 4 * D_MODEL), nn.GELU(), nn.Linear(4 * D_MODEL, D_MODEL))

    def forward(self, x, cache=None):
        x = x + self.attn(self.ln1(x), cache=cache)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D_MODEL)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, V, bias=False)

    def forward(self, idx, caches=None):
        """idx (B, L) token ids -> logits (B, L, V); ``caches[i]`` is layer i's cache."""
        x = self.embed(idx)
        for i, block in enumerate(self.blocks):
            x = block(x, None if caches is None else caches[i])
        return self.head(self.ln_f(x))


def _model(dtype=torch.float32) -> GPT:
    torch.manual_seed(0)
    return GPT().to(dtype)


def test_pre_ln_gpt_trains_under_autocast_bf16():
    """30 AdamW steps on one repeated sequence under CPU autocast: the logits are bfloat16, the
    weights and their gradients stay float32 and finite, and the loss falls far below the
    uniform guess ln V (the model memorises the sequence)."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = torch.randint(0, V, (4, 17), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(30):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(idx[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, V), idx[:, 1:].reshape(-1))
        assert logits.dtype == torch.bfloat16
        opt.zero_grad()
        loss.backward()
        for name, p in model.named_parameters():
            assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, name
            assert torch.isfinite(p.grad).all(), name
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 0.8 * torch.log(torch.tensor(float(V))).item()  # starts near the uniform guess
    assert losses[-1] < 0.25 * losses[0], losses


def _generate(model, prompt, steps, caches, step_fn):
    """Greedy generation: the logits of every generated position, (B, steps, V)."""
    out = []
    with torch.no_grad():
        logits = step_fn(prompt, caches)
        for _ in range(steps):
            out.append(logits[:, -1])
            token = logits[:, -1].argmax(-1, keepdim=True)
            logits = step_fn(token, caches)
    return torch.stack(out, dim=1)


def test_compiled_gpt_generates_with_static_caches_without_recompiling():
    """fullgraph=True, dynamic=False: the prefill and the decode step compile once each, and 12
    decode steps at 12 cache lengths reuse them; the logits equal the eager model's with a plain
    KVCache and a full recomputation (float64, so argmax ties cannot differ)."""
    model = _model(torch.float64).eval()
    prompt = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(2))
    steps = 12
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, fullgraph=True, dynamic=False, backend="aot_eager")
    static = multihead.StaticKVCache.layers(LAYERS, max_len=prompt.shape[1] + steps)
    got = _generate(model, prompt, steps, static, compiled)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])

    eager = multihead.KVCache.layers(LAYERS, max_len=prompt.shape[1] + steps)
    want = _generate(model, prompt, steps, eager, model)
    assert (got - want).abs().max().item() <= 1e-10

    tokens = torch.cat([prompt, want[:, :-1].argmax(-1)], dim=1)  # the generated sequence, recomputed at once
    with torch.no_grad():
        full = model(tokens)[:, prompt.shape[1] - 1:]
    assert (want - full).abs().max().item() <= 1e-10
