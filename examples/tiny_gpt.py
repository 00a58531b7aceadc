"""A tiny GPT on multihead: train a character-level language model, then generate with a KV cache.

nanoGPT's shape in a few dozen lines: token embeddings, blocks of (LayerNorm, causal
self-attention, LayerNorm, MLP) with residuals, a final LayerNorm and a linear head. The
attention is ``multihead.MultiHeadAttention(causal=True, rope=True)`` (rotary positions, so no
position embedding table), with grouped-query attention (4 query heads share 2 key/value
heads). Generation prefills the prompt once, then feeds one token per step through
``multihead.KVCache.layers``: each step attends to the cached keys and values instead of
recomputing the whole prefix, and gives the same logits as a full forward pass.

Run:  python examples/tiny_gpt.py          (a few seconds on a laptop CPU)
"""

from __future__ import annotations

import argparse
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import multihead

TEXT = (
    "the cat sat on the mat. the dog sat on the log. the cat saw the dog. "
    "the dog saw the cat on the mat. a cat and a dog sat on a log. "
) * 4


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d: int, heads: int, kv_heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = multihead.MultiHeadAttention(d, heads, num_kv_heads=kv_heads, causal=True, rope=True, bias=False)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, cache: Optional[multihead.KVCache] = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), cache=cache)
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """(B, L) token ids -> (B, L, vocab) logits."""

    def __init__(self, vocab: int, d: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads, kv_heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor, caches: Optional[multihead.KVCaches] = None) -> torch.Tensor:
        x = self.embed(ids)
        for i, block in enumerate(self.blocks):
            x = block(x, None if caches is None else caches[i])
        return self.head(self.ln(x))


def batches(data: torch.Tensor, block: int, batch: int, generator: torch.Generator):
    """Random windows of ``block`` tokens and the same windows shifted by one (the targets)."""
    while True:
        starts = torch.randint(0, len(data) - block - 1, (batch,), generator=generator)
        x = torch.stack([data[s:s + block] for s in starts])
        y = torch.stack([data[s + 1:s + block + 1] for s in starts])
        yield x, y


def train(model: TinyGPT, data: torch.Tensor, steps: int, *, block: int = 32, batch: int = 16, seed: int = 0) -> list[float]:
    """AdamW on next-character cross-entropy; returns the loss of every step."""
    generator = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    model.train()
    for _, (x, y) in zip(range(steps), batches(data, block, batch, generator)):
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@torch.no_grad()
def generate(model: TinyGPT, prompt: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Greedy decoding with a KV cache: ``(ids (1, P + new_tokens), the logits of each step)``."""
    model.eval()
    caches = multihead.KVCache.layers(len(model.blocks), max_len=prompt.shape[1] + new_tokens)
    logits = model(prompt, caches)[:, -1]          # prefill: the whole prompt at once
    ids, steps = prompt, [logits]
    for _ in range(new_tokens - 1):
        nxt = logits.argmax(-1, keepdim=True)      # (1, 1)
        ids = torch.cat([ids, nxt], dim=1)
        logits = model(nxt, caches)[:, -1]         # one token, attending to the cache
        steps.append(logits)
    return torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1), steps


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    parser.add_argument("--prompt", default="the cat ", help="where generation starts")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    chars = sorted(set(TEXT))
    to_id = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([to_id[c] for c in TEXT])
    model = TinyGPT(len(chars))
    losses = train(model, data, args.steps)
    print(f"loss: {losses[0]:.2f} at step 1, {sum(losses[-20:]) / 20:.2f} over the last 20 steps")

    prompt = torch.tensor([[to_id[c] for c in args.prompt if c in to_id]])
    ids, _ = generate(model, prompt, 40)
    print(repr("".join(chars[i] for i in ids[0].tolist())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
