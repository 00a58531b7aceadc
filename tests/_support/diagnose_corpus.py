"""The corpus `multihead diagnose` is held to: the seeds' four implementations written afresh,
correct implementations in many styles, and mutants that each carry one classic bug.

Every mutant is the textbook module (:class:`Textbook`) with one method replaced. Each says
where the bug comes from: the seeds (../shared/seeds, described in their README), or a pattern
that recurs in public Q&A threads and tutorial issue trackers, described rather than linked.
A mutant runs in two of the four variants: batch-first or sequence-first (the torch style,
heads folded into the batch: (B*H, L, D)), separate q/k/v projections or one fused qkv Linear.

Sizes are tiny (d_model 12, 3 heads of 4) so the whole corpus runs in seconds.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

D_MODEL, HEADS = 12, 3
CONTEXT = 16  # the longest sequence a causal buffer covers


# ---------------------------------------------------------------------------- the textbook module
class Textbook(nn.Module):
    """Multi-head attention as the tutorials write it, one method per step, correct.

    fused: one qkv Linear (self-attention: forward(x, mask=None)); else q/k/v Linears
    (forward(query, key, value, mask=None)). batch_first: (B, L, E) inputs, heads split as
    (B, H, L, D); else (L, B, E) inputs and heads folded into the batch (B*H, L, D), as
    nn.MultiheadAttention does. causal: a tril buffer besides the mask argument (True = keep).
    """

    def __init__(self, *, fused=False, batch_first=True, causal=False, d=D_MODEL, heads=HEADS, dropout=0.1):
        super().__init__()
        self.num_heads, self.head_dim, self.batch_first, self.fused = heads, d // heads, batch_first, fused
        if fused:
            self.qkv = nn.Linear(d, 3 * d)
        else:
            self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)
        self.drop = nn.Dropout(dropout)
        self.causal = causal
        if causal:
            self.register_buffer("tril", torch.tril(torch.ones(CONTEXT, CONTEXT)).bool())

    # steps, in data-flow order
    def project(self, query, key, value):
        if self.fused:
            return self.qkv(query).chunk(3, dim=-1)
        return self.q_proj(query), self.k_proj(key), self.v_proj(value)

    def split(self, t, length, batch):
        if self.batch_first:
            return t.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        return t.reshape(length, batch * self.num_heads, self.head_dim).transpose(0, 1)

    def scores(self, q, k):
        return q @ k.transpose(-2, -1)

    def scale(self, s):
        return s / math.sqrt(self.head_dim)

    def causal_keep(self, lq, lk):
        return self.tril[:lq, :lk]

    def mask(self, s, mask, lq, lk):
        if self.causal:
            s = s.masked_fill(~self.causal_keep(lq, lk), float("-inf"))
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        return s

    def softmax(self, s):
        return torch.softmax(s, dim=-1)

    def dropout(self, w):
        return self.drop(w)

    def weighted(self, w, v):
        return w @ v

    def merge(self, o, length, batch):
        if self.batch_first:
            return o.transpose(1, 2).reshape(batch, length, -1)
        return o.transpose(0, 1).reshape(length, batch, -1)

    def output(self, c):
        return self.out_proj(c)

    def run(self, query, key, value, mask):
        bdim, ldim = (0, 1) if self.batch_first else (1, 0)
        batch, lq, lk = query.shape[bdim], query.shape[ldim], key.shape[ldim]
        q, k, v = self.project(query, key, value)
        q, k, v = self.split(q, lq, batch), self.split(k, lk, batch), self.split(v, lk, batch)
        s = self.mask(self.scale(self.scores(q, k)), mask, lq, lk)
        o = self.weighted(self.dropout(self.softmax(s)), v)
        return self.output(self.merge(o, lq, batch))


class Separate(Textbook):
    def forward(self, query, key, value, mask=None):
        return self.run(query, key, value, mask)


class Fused(Textbook):
    def forward(self, x, mask=None):
        return self.run(x, x, x, mask)


VARIANTS = {
    "bf-separate": lambda **kw: Separate(fused=False, batch_first=True, **kw),
    "sf-separate": lambda **kw: Separate(fused=False, batch_first=False, **kw),
    "bf-fused": lambda **kw: Fused(fused=True, batch_first=True, **kw),
    "sf-fused": lambda **kw: Fused(fused=True, batch_first=False, **kw),
}


# ---------------------------------------------------------------------------- the mutants
def _split_view_no_transpose(self, t, length, batch):
    # Q&A pattern: "view(B, H, L, D) instead of view(B, L, H, D).transpose(1, 2)": heads mixed with tokens
    if self.batch_first:
        return t.view(batch, self.num_heads, length, self.head_dim)
    return t.reshape(batch * self.num_heads, length, self.head_dim)


def _split_missing_transpose(self, t, length, batch):
    # seed 000 insists on the transpose after the view; learners drop it (the matmul then runs over heads)
    if self.batch_first:
        return t.view(batch, length, self.num_heads, self.head_dim)
    return t.reshape(length, batch * self.num_heads, self.head_dim)


def _split_query_length(self, t, length, batch):
    # seed 003 (and 002): keys and values reshaped with the query's length (cross-attention defect)
    lq = self._lq
    if self.batch_first:
        return t.view(batch, lq, self.num_heads, self.head_dim).transpose(1, 2)
    return t.reshape(lq, batch * self.num_heads, self.head_dim).transpose(0, 1)


def _run_remembering_lq(self, query, key, value, mask):
    self._lq = query.shape[1 if self.batch_first else 0]
    return Textbook.run(self, query, key, value, mask)


def _scale_missing(self, s):
    # Q&A pattern: "attention without the 1/sqrt(d_k)", softmax saturates as d grows
    return s


def _scale_by_d(self, s):
    # Q&A pattern: dividing by d_k instead of sqrt(d_k)
    return s / self.head_dim


def _scale_by_d_model(self, s):
    # Q&A pattern: scaling with the model width (sqrt(d_model)) instead of the head's
    return s / math.sqrt(self.num_heads * self.head_dim)


def _scale_multiplied(self, s):
    # Q&A pattern: multiplying by sqrt(d_k) (scale written as d ** 0.5 then used with *)
    return s * math.sqrt(self.head_dim)


def _scale_after_softmax(self, w):
    # Q&A pattern: the scale applied to the weights after softmax instead of the scores
    return torch.softmax(w * math.sqrt(self.head_dim), dim=-1) / math.sqrt(self.head_dim)


def _causal_inverted(self, s, mask, lq, lk):
    # Q&A pattern: a tril "keep" matrix used with masked_fill(mask == 1, -inf): polarity inverted
    s = s.masked_fill(self.causal_keep(lq, lk), float("-inf"))
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _causal_diagonal(self, s, mask, lq, lk):
    # Q&A pattern: triu(ones, diagonal=0) instead of diagonal=1: a token may not see itself
    blocked = torch.triu(torch.ones(lq, lk, dtype=torch.bool), diagonal=0)
    s = s.masked_fill(blocked, float("-inf"))
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _fill_zero(self, s, mask, lq, lk):
    # Q&A pattern: masked_fill(mask == 0, 0): a blocked score of 0 still gets weight
    if self.causal:
        s = s.masked_fill(~self.causal_keep(lq, lk), 0.0)
    return s if mask is None else s.masked_fill(~mask, 0.0)


def _fill_typo(self, s, mask, lq, lk):
    # Q&A pattern: the 1e-9 / -1e9 typo: masked_fill(mask == 0, 1e-9)
    if self.causal:
        s = s.masked_fill(~self.causal_keep(lq, lk), 1e-9)
    return s if mask is None else s.masked_fill(~mask, 1e-9)


def _mask_not_assigned(self, s, mask, lq, lk):
    # Q&A pattern: scores.masked_fill(...) without assigning the result (masked_fill is not in place)
    if self.causal:
        s.masked_fill(~self.causal_keep(lq, lk), float("-inf"))
    if mask is not None:
        s.masked_fill(~mask, float("-inf"))
    return s


def _mask_multiplied(self, s, mask, lq, lk):
    # Q&A pattern: scores * mask instead of a fill: blocked scores become 0, not -inf
    if self.causal:
        s = s * self.causal_keep(lq, lk)
    return s if mask is None else s * mask


def _additive_sign(self, s, mask, lq, lk):
    # seed 002's additive causal mask (-inf above the diagonal) subtracted instead of added
    if self.causal:
        additive = torch.zeros(lq, lk).masked_fill(~self.causal_keep(lq, lk), float("-inf"))
        s = s - additive
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _softmax_query_axis(self, s):
    # Q&A pattern: softmax(dim=-2) (or dim=2 on (B, H, Lq, Lk)): columns sum to 1, not rows
    return torch.softmax(s, dim=-2)


def _softmax_head_axis(self, s):
    # Q&A pattern: softmax(dim=1), taken from 3-D code, on (B, H, Lq, Lk): normalises over heads
    return torch.softmax(s, dim=1 if self.batch_first else 0)


def _log_softmax(self, s):
    # Q&A pattern: log_softmax where softmax is meant (copied from a classifier's loss)
    return torch.log_softmax(s, dim=-1)


def _weights_transposed(self, w, v):
    # Q&A pattern: weights transposed before the product with V
    return w.transpose(-2, -1) @ v


def _merge_no_transpose(self, o, length, batch):
    # Q&A pattern: "heads merged in the wrong order": o.view(B, L, E) without transposing back
    if self.batch_first:
        return o.reshape(batch, length, -1)
    return o.reshape(length, batch, -1)


def _merge_feature_order(self, o, length, batch):
    # Q&A pattern: permute(0, 2, 3, 1) before the reshape: features ordered (d h), not (h d)
    if self.batch_first:
        return o.permute(0, 2, 3, 1).reshape(batch, length, -1)
    return o.reshape(batch, self.num_heads, length, self.head_dim).permute(2, 0, 3, 1).reshape(length, batch, -1)


def _out_missing(self, c):
    # Q&A pattern: the output projection defined in __init__ and never applied
    return c


def _out_per_head(self, c):
    # issue 26's list: W_O applied per head and the heads averaged instead of one product
    w, b = self.out_proj.weight, self.out_proj.bias
    pieces = [F.linear(c[..., h * self.head_dim:(h + 1) * self.head_dim], w[:, h * self.head_dim:(h + 1) * self.head_dim])
              for h in range(self.num_heads)]
    return torch.stack(pieces).mean(0) + b


def _dropout_functional(self, w):
    # Q&A pattern: F.dropout(w, p) in forward: its training argument defaults to True, so eval drops too
    return F.dropout(w, 0.1)


def _dropout_always(self, w):
    # Q&A pattern: F.dropout(w, p, training=True) hard-coded
    return F.dropout(w, 0.1, training=True)


def _value_with_key_weights(self, query, key, value):
    # Q&A pattern: copy-paste, V = self.k_proj(value)
    return self.q_proj(query), self.k_proj(key), self.k_proj(value)


def _key_from_query(self, query, key, value):
    # Q&A pattern: keys projected from the query input (cross-attention that is self-attention)
    return self.q_proj(query), self.k_proj(query), self.v_proj(value)


def _key_not_transposed(self, q, k):
    # Q&A pattern: k.transpose(1, 2) on (B, H, L, D) instead of transpose(-2, -1)
    return q @ k.transpose(1, 2) if self.batch_first else q @ k.transpose(0, 1)


def _scale_twice(self, s):
    # Q&A pattern: the scale applied to q and again to the scores
    return s / math.sqrt(self.head_dim) / math.sqrt(self.head_dim)


#: name -> (methods replaced, variants, expected step id, expected rule or None, constructor kwargs)
SEPARATE = ("bf-separate", "sf-separate")
MUTANTS = {
    "split_view_no_transpose": ({"split": _split_view_no_transpose}, ("bf-separate", "sf-fused"), "split_heads", None, {}),
    "split_missing_transpose": ({"split": _split_missing_transpose}, ("bf-fused", "sf-separate"), "move_heads_forward", "no_transpose", {}),
    "keys_with_query_length": ({"split": _split_query_length, "run": _run_remembering_lq}, SEPARATE, "split_heads", "kv_query_length", {}),
    "scale_missing": ({"scale": _scale_missing}, ("bf-separate", "sf-fused"), "scale", "scale_wrong", {}),
    "scale_by_d": ({"scale": _scale_by_d}, ("bf-fused", "sf-separate"), "scale", "scale_wrong", {}),
    "scale_by_d_model": ({"scale": _scale_by_d_model}, ("bf-separate", "sf-fused"), "scale", "scale_wrong", {}),
    "scale_multiplied": ({"scale": _scale_multiplied}, ("bf-fused", "sf-separate"), "scale", "scale_wrong", {}),
    "scale_twice": ({"scale": _scale_twice}, ("bf-separate", "sf-fused"), "scale", "scale_wrong", {}),
    "scale_after_softmax": ({"scale": _scale_missing, "softmax": _scale_after_softmax}, ("bf-fused", "sf-separate"), "scale", "scale_wrong", {}),
    "causal_inverted": ({"mask": _causal_inverted}, ("bf-separate", "sf-fused"), "mask", "mask_inverted", {"causal": True}),
    "causal_diagonal": ({"mask": _causal_diagonal}, ("bf-fused", "sf-separate"), "mask", "mask_pattern", {"causal": True}),
    "fill_zero": ({"mask": _fill_zero}, ("bf-separate", "sf-fused"), "mask", "mask_fill", {}),
    "fill_zero_causal": ({"mask": _fill_zero}, ("bf-fused", "sf-separate"), "mask", "mask_fill", {"causal": True}),
    "fill_typo": ({"mask": _fill_typo}, ("bf-separate", "sf-fused"), "mask", "mask_fill", {}),
    "mask_not_assigned": ({"mask": _mask_not_assigned}, ("bf-fused", "sf-separate"), "mask", "mask_missing", {"causal": True}),
    "mask_multiplied": ({"mask": _mask_multiplied}, ("bf-separate", "sf-fused"), "mask", "mask_fill", {"causal": True}),
    "additive_sign": ({"mask": _additive_sign}, ("bf-fused", "sf-separate"), "mask", "mask_fill", {"causal": True}),
    "softmax_query_axis": ({"softmax": _softmax_query_axis}, ("bf-separate", "sf-fused"), "softmax", "softmax_axis", {}),
    "softmax_head_axis": ({"softmax": _softmax_head_axis}, ("bf-fused", "sf-separate"), "softmax", "softmax_axis", {}),
    "log_softmax": ({"softmax": _log_softmax}, ("bf-separate", "sf-fused"), "softmax", None, {}),
    "weights_transposed": ({"weighted": _weights_transposed}, ("bf-fused", "sf-separate"), "weighted_sum", None, {}),
    "merge_no_transpose": ({"merge": _merge_no_transpose}, ("bf-separate", "sf-fused"), "merge_heads", None, {}),
    "merge_feature_order": ({"merge": _merge_feature_order}, ("bf-fused", "sf-separate"), "merge_heads", None, {}),
    "out_missing": ({"output": _out_missing}, ("bf-separate", "sf-fused"), "output_projection", "out_unused", {}),
    "out_per_head": ({"output": _out_per_head}, ("bf-fused", "sf-separate"), "output_projection", "out_per_head", {}),
    "dropout_functional": ({"dropout": _dropout_functional}, ("bf-separate", "sf-fused"), "dropout", "dropout_eval", {}),
    "dropout_always": ({"dropout": _dropout_always}, ("bf-fused", "sf-separate"), "dropout", "dropout_eval", {}),
    "value_with_key_weights": ({"project": _value_with_key_weights}, SEPARATE, "project", "project_unused", {}),
    "key_from_query": ({"project": _key_from_query}, SEPARATE, "project", "project_wrong_input", {}),
    "key_not_transposed": ({"scores": _key_not_transposed}, ("bf-separate", "sf-fused"), "scores", None, {}),
}


def mutant(name: str, variant: str) -> nn.Module:
    """The mutant ``name`` in ``variant``, with seeded weights."""
    methods, _, _, _, kwargs = MUTANTS[name]
    base = VARIANTS[variant]
    torch.manual_seed(0)
    module = base(**kwargs)
    for method, fn in methods.items():
        setattr(module, method, fn.__get__(module))
    return module


def mutant_cases() -> list[tuple[str, str]]:
    return [(name, variant) for name, (_, variants, _, _, _) in MUTANTS.items() for variant in variants]


# ---------------------------------------------------------------------------- the seeds, written afresh
class Seed000(nn.Module):
    """Seed 000: the step-by-step causal MHA (no biases on the projections, a triu buffer of
    blocked positions filled with -inf, softmax of scores / sqrt(head_dim), out_proj)."""

    def __init__(self, d_in=D_MODEL, d_out=D_MODEL, context=CONTEXT, num_heads=HEADS):
        super().__init__()
        self.num_heads, self.head_dim, self.d_out = num_heads, d_out // num_heads, d_out
        self.W_query = nn.Linear(d_in, d_out, bias=False)
        self.W_key = nn.Linear(d_in, d_out, bias=False)
        self.W_value = nn.Linear(d_in, d_out, bias=False)
        self.out_proj = nn.Linear(d_out, d_out)
        self.register_buffer("mask", torch.triu(torch.ones(context, context), diagonal=1))

    def forward(self, x):
        b, n, _ = x.shape
        keys = self.W_key(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        queries = self.W_query(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        values = self.W_value(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        scores = queries @ keys.transpose(2, 3)
        scores = scores.masked_fill(self.mask.bool()[:n, :n], -torch.inf)
        weights = torch.softmax(scores / self.head_dim ** 0.5, dim=-1)
        context = (weights @ values).transpose(1, 2).reshape(b, n, self.d_out)
        return self.out_proj(context)


class Seed001(nn.Module):
    """Seed 001: W_q, W_k, W_v, W_o with biases, forward(Q, K, V, mask) with mask == 0 -> -1e9,
    attention dropout, heads split by view(B, -1, H, d_k).transpose(1, 2)."""

    def __init__(self, d_model=D_MODEL, n_heads=HEADS, dropout=0.1):
        super().__init__()
        self.d_model, self.n_heads, self.d_k = d_model, n_heads, d_model // n_heads
        self.W_q, self.W_k, self.W_v = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.W_o = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, Q, K, V, mask=None):
        batch = Q.size(0)
        Q = self.W_q(Q).view(batch, -1, self.n_heads, self.d_k).transpose(1, 2)
        K = self.W_k(K).view(batch, -1, self.n_heads, self.d_k).transpose(1, 2)
        V = self.W_v(V).view(batch, -1, self.n_heads, self.d_k).transpose(1, 2)
        scores = torch.matmul(Q, K.transpose(-2, -1)) / math.sqrt(self.d_k)
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)
        attn = self.dropout(torch.softmax(scores, dim=-1))
        out = torch.matmul(attn, V).transpose(1, 2).contiguous().view(batch, -1, self.d_model)
        return self.W_o(out)


class Seed002(nn.Module):
    """Seed 002: wq/wk/wv/wo without biases, attention and residual dropout, an optional causal
    buffer of max_seq_len added (-inf above the diagonal); forward(q, k, v) takes the sequence
    length from q for all three (its cross-attention defect, like seed 003's)."""

    def __init__(self, dim=D_MODEL, n_heads=HEADS, dropout=0.1, max_seq_len=CONTEXT, is_causal=False):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.attn_dropout, self.resid_dropout = nn.Dropout(dropout), nn.Dropout(dropout)
        self.is_causal = is_causal
        if is_causal:
            self.register_buffer("mask", torch.triu(torch.full((1, 1, max_seq_len, max_seq_len), float("-inf")), diagonal=1))

    def forward(self, q, k, v):
        bsz, seqlen, _ = q.shape
        xq, xk, xv = self.wq(q), self.wk(k), self.wv(v)
        xq = xq.view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        xk = xk.view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        xv = xv.view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        scores = torch.matmul(xq, xk.transpose(-2, -1)) / math.sqrt(self.head_dim)
        if self.is_causal:
            scores = scores + self.mask[:, :, :seqlen, :seqlen]
        scores = self.attn_dropout(F.softmax(scores.float(), dim=-1))
        out = torch.matmul(scores, xv).transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.resid_dropout(self.wo(out))


class Seed003(nn.Module):
    """Seed 003: q_proj/k_proj/v_proj/out_proj, scale = head_dim ** -0.5, heads by
    view + permute(0, 2, 1, 3), masked_fill(mask == 0, -inf); K and V are reshaped with the
    query's length (the known cross-attention defect)."""

    def __init__(self, embed_dim=D_MODEL, num_heads=HEADS, dropout=0.0):
        super().__init__()
        assert embed_dim % num_heads == 0
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.q_proj, self.k_proj = nn.Linear(embed_dim, embed_dim), nn.Linear(embed_dim, embed_dim)
        self.v_proj, self.out_proj = nn.Linear(embed_dim, embed_dim), nn.Linear(embed_dim, embed_dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, query, key, value, mask=None):
        batch_size, seq_len, _ = query.size()
        Q = self.q_proj(query).view(batch_size, seq_len, self.num_heads, self.head_dim).permute(0, 2, 1, 3)
        K = self.k_proj(key).view(batch_size, seq_len, self.num_heads, self.head_dim).permute(0, 2, 1, 3)
        V = self.v_proj(value).view(batch_size, seq_len, self.num_heads, self.head_dim).permute(0, 2, 1, 3)
        scores = torch.matmul(Q, K.transpose(-2, -1)) * self.scale
        if mask is not None:
            scores = scores.masked_fill(mask == 0, float("-inf"))
        probs = self.dropout(F.softmax(scores, dim=-1))
        out = torch.matmul(probs, V).permute(0, 2, 1, 3).contiguous().view(batch_size, seq_len, self.embed_dim)
        return self.out_proj(out)


# ---------------------------------------------------------------------------- correct, in other styles
class Einsum(nn.Module):
    """einsum throughout, heads last until the scores; an additive float mask argument."""

    def __init__(self, d=D_MODEL, h=HEADS):
        super().__init__()
        self.h = h
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x, context=None, mask=None):
        context = x if context is None else context
        b, n, d = x.shape
        q = self.to_q(x).reshape(b, n, self.h, -1)
        k = self.to_k(context).reshape(b, context.shape[1], self.h, -1)
        v = self.to_v(context).reshape(b, context.shape[1], self.h, -1)
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
        if mask is not None:
            s = s + mask
        w = s.softmax(dim=-1)
        return self.to_out(torch.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, n, d))


class PerHeadLoop(nn.Module):
    """One Linear per role, then a Python loop over the heads' slices, concatenated."""

    def __init__(self, d=D_MODEL, n_heads=HEADS):
        super().__init__()
        self.n_heads = n_heads
        self.query, self.key, self.value, self.proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x, y=None):
        y = x if y is None else y
        q, k, v = self.query(x), self.key(y), self.value(y)
        dh = q.shape[-1] // self.n_heads
        heads = []
        for i in range(self.n_heads):
            sl = slice(i * dh, (i + 1) * dh)
            w = torch.softmax(q[..., sl] @ k[..., sl].transpose(1, 2) / math.sqrt(dh), dim=-1)
            heads.append(w @ v[..., sl])
        return self.proj(torch.cat(heads, dim=-1))


class TimmStyle(nn.Module):
    """One fused qkv Linear reshaped to (B, L, 3, H, D) and permuted to (3, B, H, L, D)."""

    def __init__(self, dim=D_MODEL, num_heads=HEADS):
        super().__init__()
        self.num_heads, self.scale = num_heads, (dim // num_heads) ** -0.5
        self.qkv, self.proj = nn.Linear(dim, dim * 3), nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = ((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(B, N, C))


class NanoGPT(nn.Module):
    """Causal self-attention through F.scaled_dot_product_attention(is_causal=True)."""

    def __init__(self, n_embd=D_MODEL, n_head=HEADS):
        super().__init__()
        self.n_head = n_head
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class ScaleOnQuery(nn.Module):
    """Seq-first, heads folded head-major as torch.cat(split) does: (H*B, L, D); the scale on q;
    masked_fill(mask == 0, -1e9) with a (Lq, Lk) mask."""

    def __init__(self, d=D_MODEL, heads=HEADS):
        super().__init__()
        self.heads = heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d) for _ in range(4))

    def forward(self, query, key, value, mask=None):
        dh = query.shape[-1] // self.heads
        fold = lambda t: torch.cat(t.split(dh, dim=-1), dim=1).transpose(0, 1)  # noqa: E731  (H*B, L, D)
        q, k, v = fold(self.wq(query) * dh ** -0.5), fold(self.wk(key)), fold(self.wv(value))
        s = torch.bmm(q, k.transpose(1, 2))
        if mask is not None:
            s = s.masked_fill(mask == 0, -1e9)
        o = torch.bmm(s.softmax(-1), v).transpose(0, 1)  # (L, H*B, D)
        o = torch.cat(o.split(query.shape[1], dim=1), dim=-1)
        return self.wo(o)


def bart_attention():
    """Hugging Face's BartAttention from a tiny random config (eager attention)."""
    from transformers import BartConfig
    from transformers.models.bart.modeling_bart import BartAttention

    config = BartConfig(d_model=D_MODEL, encoder_attention_heads=HEADS, decoder_attention_heads=HEADS)
    config._attn_implementation = "eager"
    return BartAttention(D_MODEL, HEADS, config=config)


def bert_self_attention():
    """Hugging Face's BertSelfAttention (no output projection: its dense sits in BertSelfOutput)."""
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertSelfAttention

    config = BertConfig(hidden_size=D_MODEL, num_attention_heads=HEADS)
    config._attn_implementation = "eager"
    return BertSelfAttention(config)


class GroupedQuery(nn.Module):
    """Grouped-query attention: 4 query heads share 2 key/value heads (repeat_interleave), SDPA."""

    def __init__(self, d=16):
        super().__init__()
        self.n_heads = 4
        self.wq, self.wk, self.wv, self.wo = nn.Linear(d, d), nn.Linear(d, d // 2), nn.Linear(d, d // 2), nn.Linear(d, d)

    def forward(self, x):
        B, L, d = x.shape
        q = self.wq(x).view(B, L, 4, d // 4).transpose(1, 2)
        k = self.wk(x).view(B, L, 2, d // 4).transpose(1, 2).repeat_interleave(2, 1)
        v = self.wv(x).view(B, L, 2, d // 4).transpose(1, 2).repeat_interleave(2, 1)
        return self.wo(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, L, d))


def _torch_mha(batch_first):
    return lambda: nn.MultiheadAttention(D_MODEL, HEADS, batch_first=batch_first)


def _multihead():
    import multihead

    return multihead.MultiHeadAttention(D_MODEL, HEADS, backend="reference")


#: name -> (builder, the conventions the diagnosis must name)
CORRECT = {
    "textbook bf-separate": (lambda: Separate(), ("row_nan",)),
    "textbook sf-fused causal": (lambda: Fused(fused=True, batch_first=False, causal=True), ("row_nan",)),
    "einsum": (Einsum, ("mask_additive", "row_nan")),
    "per-head loop": (PerHeadLoop, ()),
    "timm fused qkv": (TimmStyle, ()),
    "nn.MultiheadAttention": (_torch_mha(False), ("mask_block", "row_nan")),
    "nn.MultiheadAttention batch_first": (_torch_mha(True), ("mask_block", "row_nan")),
    "nanoGPT sdpa is_causal": (NanoGPT, ()),
    "Hugging Face BartAttention": (bart_attention, ("mask_additive", "row_nan")),
    "Hugging Face BertSelfAttention, no W_O": (bert_self_attention, ("mask_additive", "row_nan")),
    "grouped-query sdpa": (GroupedQuery, ()),
    "scale on q, (h b) fold, -1e9": (ScaleOnQuery, ("row_uniform",)),
    "multihead.MultiHeadAttention": (_multihead, ()),
    "seed 000": (Seed000, ()),
    "seed 001": (Seed001, ("row_uniform",)),
    "seed 002 causal": (lambda: Seed002(is_causal=True), ("causal_self",)),
}
