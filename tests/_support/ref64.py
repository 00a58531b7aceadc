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


# --------------------------------------------------------------------------- issue 13 kinds
# Each built from its definition by Python loops over (query, key) or from full index grids,
# without multihead: packed documents, chunked-local, ALiBi, window sink tokens, mask_mod,
# score_mod/softcap and sinks.


def attention64_mods(q, k, v, keep=None, bias=None, scale=None, score_fn=None, sink=None):
    """attention64 with FlexAttention's score_mod (``score_fn(s, b, h, q_idx, kv_idx)`` on the full
    index grids, after the bias, before the selection) and a gpt-oss sink: the sink logit (H,) is
    a column appended to every row's scores before the softmax and dropped after it."""
    q, k, v = q.double(), k.double(), v.double()
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    g = H // k.shape[1]
    k = torch.stack([k[:, i // g] for i in range(H)], dim=1)
    v = torch.stack([v[:, i // g] for i in range(H)], dim=1)
    scale = D ** -0.5 if scale is None else scale
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if bias is not None:
        s = s + bias.double()
    if score_fn is not None:
        b = torch.arange(B).view(B, 1, 1, 1)
        h = torch.arange(H).view(1, H, 1, 1)
        qi = torch.arange(Lq).view(1, 1, Lq, 1)
        ki = torch.arange(Lk).view(1, 1, 1, Lk)
        s = score_fn(s, b, h, qi, ki)
    visible = torch.ones(B, H, Lq, Lk, dtype=torch.bool)
    if keep is not None:
        visible = visible & keep
    s = s.masked_fill(~visible, float("-inf"))
    if sink is not None:
        col = sink.double().view(1, H, 1, 1).expand(B, H, Lq, 1)
        w = torch.softmax(torch.cat([s, col], dim=-1), dim=-1)[..., :Lk]
    else:
        alive = visible.any(-1, keepdim=True)
        w = torch.softmax(torch.where(alive, s, torch.zeros_like(s)), dim=-1) * alive
    return torch.einsum("bhqk,bhkd->bhqd", w, v), w


def documents_keep(q_ids, kv_ids=None, *, causal=None, window=None, chunk=None, sinks=0):
    """(B, 1, Lq, Lk) keep of packed documents by loops: same id (>= 0) and, per document, with its
    queries numbered a = 0 .. nq-1 and keys c = 0 .. nk-1, the diagonal key of query a is
    ``a + nk - nq`` (``causal``/``window`` align "bottom_right") or ``a`` ("top_left");
    ``causal=align``: c <= diagonal; ``window=(left, right, align)``: diagonal-left <= c <=
    diagonal+right, or c < sinks (and c <= diagonal+right); ``chunk=(size, align)``:
    c // size == diagonal // size."""
    q_ids = q_ids.view(-1, q_ids.shape[-1]).tolist()
    kv_ids = q_ids if kv_ids is None else kv_ids.view(-1, kv_ids.shape[-1]).tolist()
    B = max(len(q_ids), len(kv_ids))
    Lq, Lk = len(q_ids[0]), len(kv_ids[0])
    out = torch.zeros(B, 1, Lq, Lk, dtype=torch.bool)
    for b in range(B):
        qrow, krow = q_ids[b % len(q_ids)], kv_ids[b % len(kv_ids)]
        for i in range(Lq):
            d = qrow[i]
            if d < 0:
                continue
            qpos = [x for x in range(Lq) if qrow[x] == d]
            kpos = [x for x in range(Lk) if krow[x] == d]
            a, nq, nk = qpos.index(i), len(qpos), len(kpos)
            for c, j in enumerate(kpos):
                ok = True

                def diag(align):
                    return a + nk - nq if align == "bottom_right" else a

                if causal is not None:
                    ok = ok and c <= diag(causal)
                if window is not None:
                    left, right, align = window
                    e = diag(align)
                    inside = (left is None or c >= e - left) and (right is None or c <= e + right)
                    sink_token = c < sinks and (right is None or c <= e + right)
                    ok = ok and (inside or sink_token)
                if chunk is not None:
                    size, align = chunk
                    ok = ok and c // size == diag(align) // size
                out[b, 0, i, j] = ok
    return out


def chunked_keep(lq, lk, size, align="bottom_right"):
    """Chunked-local by loops: key j is in query i's chunk of ``size`` (i + offset the query's position)."""
    off = lk - lq if align == "bottom_right" else 0
    return torch.tensor([[(i + off) // size == j // size for j in range(lk)] for i in range(lq)])


def window_sinks_keep(lq, lk, left, right, sinks, align="bottom_right"):
    """The window of :func:`window_keep`, plus keys j < sinks up to i + offset + right, by loops."""
    off = lk - lq if align == "bottom_right" else 0
    hi = 10**9 if right is None else right
    lo = -10**9 if left is None else -left
    return torch.tensor([[lo <= j - (i + off) <= hi or (j < sinks and j - (i + off) <= hi) for j in range(lk)]
                         for i in range(lq)])


def alibi_bias64(slopes, lq, lk, align="bottom_right"):
    """(1, H, Lq, Lk) ALiBi bias by loops: -slope_h * |j - (i + offset)| (flash-attn's alibi_slopes rule)."""
    off = lk - lq if align == "bottom_right" else 0
    s = [float(x) for x in slopes]
    return torch.tensor([[[-sl * abs(j - (i + off)) for j in range(lk)] for i in range(lq)] for sl in s],
                        dtype=torch.float64).unsqueeze(0)


def mpt_alibi_slopes(n_heads, alibi_bias_max=8):
    """MPT's construction of the ALiBi slopes (written from its definition): for the next power of
    two n >= H, slopes 1 / 2^(k * max / n), k = 1 .. n; with H < n the odd-indexed ones first, then
    the even-indexed ones, cut to H."""
    n = 1
    while n < n_heads:
        n *= 2
    slopes = [1.0 / 2 ** (k * alibi_bias_max / n) for k in range(1, n + 1)]
    if n != n_heads:
        slopes = (slopes[1::2] + slopes[0::2])[:n_heads]
    return torch.tensor(slopes, dtype=torch.float64)


def grid_keep(fn, B, H, lq, lk):
    """(B, H, Lq, Lk) keep of a mask_mod evaluated once on the full index grids."""
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    qi = torch.arange(lq).view(1, 1, lq, 1)
    ki = torch.arange(lk).view(1, 1, 1, lk)
    return fn(b, h, qi, ki).expand(B, H, lq, lk)
