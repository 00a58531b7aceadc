"""The attention implementations compared side by side, built with the same weights.

Each builder returns a zero-argument callable doing one forward (eval, no grad) or one
forward + backward (train) of a self-attention layer on x (B, L, d):

* ``raw SDPA``           -- the same work written by hand: one fused QKV F.linear, SDPA, output F.linear
* ``multihead[<name>]``  -- multihead.MultiHeadAttention with each registered backend
* ``nn.MHA weights=...`` -- torch.nn.MultiheadAttention, need_weights True (its default) and False
* ``naive``              -- the tutorial module (benchmarks/naive.py)

``est_bytes`` estimates the extra memory of a call, to skip what would not fit.

Legend: B batch, L tokens, d model width, H heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import multihead
from multihead import backends

from .naive import NaiveMHA


@dataclass(frozen=True)
class Case:
    B: int
    L: int
    d: int
    H: int
    dtype: torch.dtype
    causal: bool
    backward: bool

    @property
    def label(self) -> str:
        dt = {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(self.dtype, str(self.dtype))
        return f"{'fwd+bwd' if self.backward else 'fwd'} {dt} {'causal' if self.causal else 'full'}"


def impl_names() -> list:
    mh = [f"multihead[{b}]" for b in backends.names() if b != "auto"]
    return ["raw SDPA", *mh, "nn.MHA weights=False", "nn.MHA weights=True", "naive"]


def _materialises_scores(name: str) -> bool:
    """Implementations that hold (B, H, L, L) score/weight tensors."""
    return name in ("multihead[reference]", "nn.MHA weights=True", "naive")


def est_bytes(name: str, c: Case) -> int:
    """Rough extra memory of one call (activations, scores, masks), for skipping."""
    el = torch.finfo(c.dtype).bits // 8
    acts = 12 * c.B * c.L * c.d * el * (3 if c.backward else 1)
    if _materialises_scores(name):
        # scores, masked scores, softmax (+ their gradients in training); the reference works in fp32
        per = 4 if name == "multihead[reference]" else el
        acts += c.B * c.H * c.L * c.L * per * (6 if c.backward else 3)
    if name.startswith("nn.MHA") and c.causal:
        acts += c.L * c.L * 4  # its causal mask becomes a float (L, L) tensor
    if name == "naive" and c.causal:
        acts += c.L * c.L
    return acts


def _module(c: Case, seed: int = 0) -> multihead.MultiHeadAttention:
    torch.manual_seed(seed)
    return multihead.MultiHeadAttention(c.d, c.H, causal=c.causal, dtype=c.dtype)


def _run(c: Case, forward, params, x):
    """The callable: forward under no_grad, or forward + backward with a fixed output gradient."""
    if not c.backward:
        def fwd():
            with torch.no_grad():
                return forward(x)
        return fwd
    g = torch.randn(c.B, c.L, c.d, dtype=c.dtype)

    def fwd_bwd():
        for p in params:
            p.grad = None
        forward(x).backward(g)
    return fwd_bwd


class RawSDPA(nn.Module):
    """The work of one MultiHeadAttention call written by hand, with a fused QKV weight."""

    def __init__(self, mha: multihead.MultiHeadAttention):
        super().__init__()
        c = mha.config
        self.H, self.D, self.causal = c.num_heads, c.head_dim, c.causal
        with torch.no_grad():
            self.w_qkv = nn.Parameter(torch.cat([mha.q_proj.weight, mha.k_proj.weight, mha.v_proj.weight]))
            self.b_qkv = nn.Parameter(torch.cat([mha.q_proj.bias, mha.k_proj.bias, mha.v_proj.bias]))
            self.w_o = nn.Parameter(mha.out_proj.weight.clone())
            self.b_o = nn.Parameter(mha.out_proj.bias.clone())

    def forward(self, x):
        B, L, d = x.shape
        qkv = F.linear(x, self.w_qkv, self.b_qkv).view(B, L, 3, self.H, self.D).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=self.causal)
        return F.linear(o.transpose(1, 2).reshape(B, L, d), self.w_o, self.b_o)


def build(name: str, c: Case, seed: int = 0):
    """A zero-argument callable running implementation ``name`` on case ``c``."""
    mha = _module(c, seed)
    torch.manual_seed(seed + 1)
    x = torch.randn(c.B, c.L, c.d, dtype=c.dtype)
    if name == "raw SDPA":
        raw = RawSDPA(mha)
        raw.train(c.backward)
        return _run(c, raw, list(raw.parameters()), x)
    if name.startswith("multihead["):
        backend = name[len("multihead["):-1]
        m = multihead.MultiHeadAttention(c.d, c.H, causal=c.causal, backend=backend, dtype=c.dtype)
        m.load_state_dict(mha.state_dict())
        m.train(c.backward)
        return _run(c, m, list(m.parameters()), x)
    if name.startswith("nn.MHA"):
        t = mha.to_torch() if not c.causal else _torch_mha_causal(mha)
        t.train(c.backward)
        need = name.endswith("True")
        mask = torch.ones(c.L, c.L, dtype=torch.bool).triu(1) if c.causal else None

        def forward(inp):
            return t(inp, inp, inp, attn_mask=mask, is_causal=c.causal, need_weights=need)[0]
        return _run(c, forward, list(t.parameters()), x)
    if name == "naive":
        n = NaiveMHA.like(mha)
        n.train(c.backward)
        return _run(c, n, list(n.parameters()), x)
    raise ValueError(f"unknown implementation {name!r}; known: {impl_names()}")


def _torch_mha_causal(mha):
    """nn.MultiheadAttention has no causal setting: copy a non-causal twin; the mask goes per call."""
    c = mha.config
    twin = multihead.MultiHeadAttention(c.d_in, c.num_heads, dtype=mha.q_proj.weight.dtype)
    twin.load_state_dict(mha.state_dict())
    return twin.to_torch()
