"""The multi-head attention module as introductory tutorials usually write it, for comparison.

Three separate projections, heads split with view + transpose, the full (B, H, L, L) score
tensor, a causal mask built on every call and filled with -inf, softmax, weights x V, heads
merged back, output projection. Nothing fused, nothing skipped: this is the baseline people
start from. Written for this benchmark; weights can be copied from a MultiHeadAttention.

Legend: B batch, L tokens, H heads, D head dim, d model width (H * D).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn


class NaiveMHA(nn.Module):
    def __init__(self, d: int, num_heads: int, causal: bool = False, device=None, dtype=None):
        super().__init__()
        self.h, self.dk, self.causal = num_heads, d // num_heads, causal
        kw = {"device": device, "dtype": dtype}
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, **kw) for _ in range(4))

    @classmethod
    def like(cls, mha) -> "NaiveMHA":
        """The same weights as a multihead.MultiHeadAttention (num_kv_heads == num_heads)."""
        c = mha.config
        w = mha.q_proj.weight
        n = cls(c.d_in, c.num_heads, c.causal, device=w.device, dtype=w.dtype)
        for mine, theirs in ((n.wq, mha.q_proj), (n.wk, mha.k_proj), (n.wv, mha.v_proj), (n.wo, mha.out_proj)):
            mine.load_state_dict(theirs.state_dict())
        return n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, d = x.shape

        def heads(t):  # (B, L, d) -> (B, H, L, D)
            return t.view(B, L, self.h, self.dk).transpose(1, 2)

        q, k, v = heads(self.wq(x)), heads(self.wk(x)), heads(self.wv(x))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.dk)  # (B, H, L, L)
        if self.causal:
            future = torch.triu(torch.ones(L, L, dtype=torch.bool, device=x.device), diagonal=1)
            scores = scores.masked_fill(future, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        out = (weights @ v).transpose(1, 2).reshape(B, L, d)
        return self.wo(out)
