"""An independent float64 oracle for tests: plain torch.softmax on the visible keys.

Written separately from multihead's reference backend (no shared code), so agreement means
something. ``keep`` (bool) and ``bias`` (float) are dense and broadcastable to (B, H, Lq, Lk).
"""

import torch


def attention64(q, k, v, keep=None, bias=None, scale=None):
    """(B, H, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, Dv) -> out (B, H, Lq, Dv), weights (B, H, Lq, Lk)."""
    q, k, v = q.double(), k.double(), v.double()
    B, H, Lq, D = q.shape
    g = H // k.shape[1]
    k = torch.stack([k[:, i // g] for i in range(H)], dim=1)
    v = torch.stack([v[:, i // g] for i in range(H)], dim=1)
    scale = D ** -0.5 if scale is None else scale
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if bias is not None:
        s = s + bias.double()
    visible = torch.ones_like(s, dtype=torch.bool)
    if keep is not None:
        visible = visible & keep
    visible = visible & (s != float("-inf"))
    s = s.masked_fill(~visible, float("-inf"))
    alive = visible.any(-1, keepdim=True)
    w = torch.softmax(torch.where(alive, s, torch.zeros_like(s)), dim=-1) * alive
    return torch.einsum("bhqk,bhkd->bhqd", w, v), w


def causal_keep(lq, lk, align="bottom_right"):
    off = lk - lq if align == "bottom_right" else 0
    return torch.tensor([[j <= i + off for j in range(lk)] for i in range(lq)])


def window_keep(lq, lk, left, right, align="bottom_right"):
    off = lk - lq if align == "bottom_right" else 0
    lo = -10**9 if left is None else -left
    hi = 10**9 if right is None else right
    return torch.tensor([[lo <= j - (i + off) <= hi for j in range(lk)] for i in range(lq)])


def random_qkv(B=2, H=4, Hkv=None, Lq=5, Lk=None, D=8, Dv=None, dtype=torch.float64, seed=0, grad=False):
    """Seeded q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv) drawn in float64, then cast."""
    g = torch.Generator().manual_seed(seed)
    Hkv = H if Hkv is None else Hkv
    Lk = Lq if Lk is None else Lk
    Dv = D if Dv is None else Dv

    def make(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_(grad)

    return make(B, H, Lq, D), make(B, Hkv, Lk, D), make(B, Hkv, Lk, Dv)
