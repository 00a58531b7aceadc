"""A learner's multi-head attention with one classic bug, for `multihead diagnose` (README, docs/diagnose.md)."""

import math

import torch
import torch.nn as nn


class MyAttention(nn.Module):
    def __init__(self, d_model=16, num_heads=4):
        super().__init__()
        self.num_heads, self.d_k = num_heads, d_model // num_heads
        self.W_q = nn.Linear(d_model, d_model)
        self.W_k = nn.Linear(d_model, d_model)
        self.W_v = nn.Linear(d_model, d_model)
        self.W_o = nn.Linear(d_model, d_model)

    def forward(self, x, mask=None):
        B, L, _ = x.shape
        q = self.W_q(x).view(B, self.num_heads, L, self.d_k)  # the bug: no view(B, L, H, D).transpose(1, 2)
        k = self.W_k(x).view(B, self.num_heads, L, self.d_k)
        v = self.W_v(x).view(B, self.num_heads, L, self.d_k)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_k)
        if mask is not None:
            scores = scores.masked_fill(mask == 0, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        out = (weights @ v).transpose(1, 2).reshape(B, L, -1)
        return self.W_o(out)
