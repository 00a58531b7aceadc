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
