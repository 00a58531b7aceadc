"""What a user's attention module is made of: its projections, its head count and how to call it.

    >>> import torch.nn as nn
    >>> from multihead.diagnosis.anatomy import find_anatomy
    >>> a = find_anatomy(nn.MultiheadAttention(12, 3, batch_first=True))
    >>> a.num_heads, a.batch_first, a.wq.shape, a.call.mask
    (3, True, torch.Size([12, 12]), 'attn_mask')

The projections are found by their attribute names (``q_proj``, ``W_q``, ``query``, ``wq``,
``to_q``...; a fused ``qkv``/``in_proj``/``c_attn`` of 3 x d_out rows; a fused ``kv``; the
output ``out_proj``/``W_o``/``o_proj``/``wo``/``dense``/``proj``), then by their order and shapes
(four square ``nn.Linear`` in q, k, v, out order). The head count comes from an attribute
(``num_heads``, ``n_heads``, ``h``, ``head_dim``...) or, when none is found, from trial runs
(:data:`Anatomy.num_heads` is then None and the caller tries every divisor of d_out).
How to call the module comes from ``forward``'s signature (:class:`ForwardSignature`).

Legend: E the query input's features, d_out = H * D the projections' width.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn as nn

from .._checks import check_positive_int
from ..interop import from_torch

__all__ = ["Anatomy", "ForwardSignature", "find_anatomy", "NotAttention", "MAX_PARAMETERS", "LOOKED_FOR"]

#: a module with more parameters than this is refused: diagnose one attention layer, not a model
MAX_PARAMETERS = 50_000_000

#: what is looked for, as the one-line refusal says it
LOOKED_FOR = ("q/k/v projections: nn.Linear attributes named like q_proj, W_q, query, wq, to_q (and k, v), "
              "a fused qkv/in_proj/c_attn Linear of 3 x d_out rows, or nn.MultiheadAttention's in_proj_weight")

_Q = re.compile(r"^(w_?|to_|linear_|lin_)?q(uery|ueries)?(_?proj(ection)?|_?lin(ear)?|_?layer|_?w)?$")
_K = re.compile(r"^(w_?|to_|linear_|lin_)?k(ey|eys)?(_?proj(ection)?|_?lin(ear)?|_?layer|_?w)?$")
_V = re.compile(r"^(w_?|to_|linear_|lin_)?v(alue|alues)?(_?proj(ection)?|_?lin(ear)?|_?layer|_?w)?$")
_QKV = re.compile(r"^(w_?|to_)?(qkv|in_proj|c_attn|qkv_proj|wqkv|attn_in|in_linear)$")
_KV = re.compile(r"^(w_?|to_)?kv(_proj|_linear)?$")
_OUT = re.compile(r"^(w_?|to_)?(o|out|output|o_proj|out_proj|proj|c_proj|dense|fc|fc_out|out_linear|linear_out|wo|"
                  r"output_proj|out_layer|projection|merge)$")

_HEAD_ATTRS = ("num_heads", "n_heads", "n_head", "nhead", "num_attention_heads", "heads", "h", "head_count",
               "num_head", "attention_heads")
_HEAD_DIM_ATTRS = ("head_dim", "d_k", "d_head", "dk", "head_size", "attention_head_size", "dim_head", "d_h")

#: forward parameter names, by the role diagnose gives them
KEY_NAMES = ("key", "k", "keys", "kv", "context", "memory", "encoder_hidden_states", "key_value_states", "y",
             "x_kv", "encoder_out", "enc", "source", "src", "kv_input", "context_states")
VALUE_NAMES = ("value", "v", "values")
MASK_NAMES = ("attn_mask", "mask", "attention_mask")
#: parameters nn.MultiheadAttention and Hugging Face layers take that diagnose leaves at their default
OPTIONAL_OK = ("key_padding_mask", "need_weights", "average_attn_weights", "is_causal", "past_key_value",
               "past_key_values", "cache", "layer_head_mask", "output_attentions", "position_ids",
               "cache_position", "use_cache", "return_weights", "return_attention", "positions")


class NotAttention(ValueError):
    """The module has no q/k/v projections diagnose can find (one line, naming what it looked for)."""


@dataclass(frozen=True)
class ForwardSignature:
    """How to call the module's forward: the names of its query, key and value parameters (key
    and value None when forward takes one input: self-attention only), of its mask parameter
    (None: no mask), and what else the caller passes (``kwargs``)."""

    query: str
    key: Optional[str]
    value: Optional[str]
    mask: Optional[str]
    positional: tuple[str, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)

    def arguments(self, query: torch.Tensor, key: Optional[torch.Tensor], mask: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """(args, kwargs) of a call with ``query`` and ``key`` (also the value); ``key`` None for self-attention."""
        given: dict[str, Any] = {self.query: query}
        if self.key is not None:
            given[self.key] = query if key is None else key
        if self.value is not None:
            given[self.value] = query if key is None else key
        if mask is not None and self.mask is not None:
            given[self.mask] = mask
        args = []
        for name in self.positional:
            if name not in given:
                break
            args.append(given.pop(name))
        return tuple(args), {**self.kwargs, **given}

    @property
    def cross(self) -> bool:
        """Whether forward takes a second input (keys/values from another sequence)."""
        return self.key is not None


@dataclass
class Anatomy:
    """The weights diagnose found, as (out, in) matrices and biases (None = no bias), the head
    count (None: to be found by trial), the batch layout (None: to be found by trial), how to
    call the module, where each weight came from, and the module's parameters by id (to name
    a weight the forward uses)."""

    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: Optional[torch.Tensor]
    bq: Optional[torch.Tensor]
    bk: Optional[torch.Tensor]
    bv: Optional[torch.Tensor]
    bo: Optional[torch.Tensor]
    num_heads: Optional[int]
    batch_first: Optional[bool]
    call: ForwardSignature
    names: dict[str, str]
    params: dict[int, str]

    @property
    def d_out(self) -> int:
        return int(self.wq.shape[0])

    def head_counts(self) -> list[int]:
        """The head counts to try: the module's own, or every divisor of d_out (GQA-compatible)."""
        if self.num_heads is not None:
            return [self.num_heads]
        kv = int(self.wk.shape[0])
        return [h for h in range(1, self.d_out + 1) if self.d_out % h == 0 and kv % (self.d_out // h) == 0]


def _linears(module: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(n, m) for n, m in module.named_modules() if n and isinstance(m, nn.Linear)]


def _leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1].lower()


def _pick(linears: list[tuple[str, nn.Linear]], pattern: re.Pattern[str]) -> list[tuple[str, nn.Linear]]:
    return [(n, m) for n, m in linears if pattern.match(_leaf(n))]


def _wb(lin: nn.Linear) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    b: Optional[torch.Tensor] = lin.bias
    return lin.weight.detach(), None if b is None else b.detach()


def _split(w: torch.Tensor, b: Optional[torch.Tensor], n: int) -> list[tuple[torch.Tensor, Optional[torch.Tensor]]]:
    ws = w.chunk(n, 0)
    bs: list[Optional[torch.Tensor]] = list(b.chunk(n, 0)) if b is not None else [None] * n
    return list(zip(ws, bs))


def _find_weights(module: nn.Module) -> tuple[dict[str, Any], dict[str, str]]:
    """{"q": (w, b), "k": ..., "v": ..., "o": (w, b) or None} and where each came from."""
    if isinstance(module, nn.MultiheadAttention):
        _, w = from_torch(module)

        def get(n: str) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
            return w[f"{n}.weight"].detach(), w[f"{n}.bias"].detach() if f"{n}.bias" in w else None

        where = {"q": "in_proj_weight[0:E]", "k": "in_proj_weight[E:2E]", "v": "in_proj_weight[2E:3E]", "o": "out_proj"}
        return {"q": get("q_proj"), "k": get("k_proj"), "v": get("v_proj"), "o": get("out_proj")}, where
    linears = _linears(module)
    q, k, v, o = _pick(linears, _Q), _pick(linears, _K), _pick(linears, _V), _pick(linears, _OUT)
    qkv, kv = _pick(linears, _QKV), _pick(linears, _KV)
    found: dict[str, Any] = {}
    names: dict[str, str] = {}
    if len(q) == 1 and len(k) == 1 and len(v) == 1:
        for role, hit in (("q", q), ("k", k), ("v", v)):
            found[role], names[role] = _wb(hit[0][1]), hit[0][0]
    elif len(qkv) == 1 and qkv[0][1].weight.shape[0] % 3 == 0:
        name, lin = qkv[0]
        for role, part in zip("qkv", _split(*_wb(lin), 3)):
            found[role], names[role] = part, f"{name} (its {'first second third'.split()['qkv'.index(role)]} third)"
    elif len(q) == 1 and len(kv) == 1 and kv[0][1].weight.shape[0] % 2 == 0:
        found["q"], names["q"] = _wb(q[0][1]), q[0][0]
        for role, part in zip("kv", _split(*_wb(kv[0][1]), 2)):
            found[role], names[role] = part, f"{kv[0][0]} (its {'first' if role == 'k' else 'second'} half)"
    elif len(linears) == 4 and len({tuple(m.weight.shape) for _, m in linears}) == 1:
        for role, (name, lin) in zip("qkvo", linears):  # four alike: q, k, v, out in the order written
            found[role], names[role] = _wb(lin), name
    else:
        seen = ", ".join(f"{n} {tuple(m.weight.shape)}" for n, m in linears) or "no nn.Linear at all"
        raise NotAttention(f"{type(module).__name__} is not an attention module diagnose can read: it looked for "
                           f"{LOOKED_FOR}; found {seen}")
    if "o" not in found:
        used = {names[r].split(" ")[0] for r in "qkv"}
        outs = [(n, m) for n, m in o if n not in used]
        if len(outs) >= 1:
            found["o"], names["o"] = _wb(outs[-1][1]), outs[-1][0]
        else:
            found["o"] = None
    return found, names


def _heads(module: nn.Module, d_out: int) -> Optional[int]:
    for owner in (module, getattr(module, "config", None)):
        if owner is None:
            continue
        for name in _HEAD_ATTRS:
            value = getattr(owner, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0 and d_out % value == 0:
                return value
        for name in _HEAD_DIM_ATTRS:
            value = getattr(owner, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0 and d_out % value == 0:
                return d_out // value
    return None


def _call(module: nn.Module, kwargs: dict[str, Any]) -> ForwardSignature:
    sig = inspect.signature(module.forward)
    params = [p for p in sig.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if not params:
        raise ValueError(f"{type(module).__name__}.forward takes no tensor argument; diagnose needs forward(x, ...)")
    positional = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    query = params[0].name
    rest = [p for p in params[1:] if p.name not in kwargs]
    key = next((p.name for p in rest if p.name.lower() in KEY_NAMES), None)
    value = next((p.name for p in rest if p.name.lower() in VALUE_NAMES), None)
    mask = next((p.name for p in rest if p.name.lower() in MASK_NAMES), None)
    if key is None and value is None:  # forward(x, y): a second required tensor input is the keys' source
        second = [p for p in rest if p.default is p.empty and p.name not in (mask,)]
        if second and second[0].name not in OPTIONAL_OK:
            key = second[0].name
    known = {query, key, value, mask}
    needed = [p.name for p in rest if p.default is p.empty and p.name not in known]
    if needed:
        what = ", ".join(repr(n) for n in needed)
        example = ", ".join(f"{n!r}: ..." for n in needed)
        raise ValueError(f"{type(module).__name__}.forward needs {what}, which diagnose cannot guess: pass "
                         f"kwargs={{{example}}} (CLI: --arg {needed[0]}=VALUE)")
    return ForwardSignature(query, key, value, mask, positional, dict(kwargs))


def find_anatomy(module: nn.Module, *, num_heads: Optional[int] = None, batch_first: Optional[bool] = None,
                 kwargs: Optional[dict[str, Any]] = None) -> Anatomy:
    """The :class:`Anatomy` of ``module``.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
        NotAttention: no q/k/v projections (the message names what was looked for).
        ValueError: a module above :data:`MAX_PARAMETERS` parameters, parameters on the meta
            device or on several devices, a forward that needs arguments diagnose cannot guess.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"diagnose takes your attention module (a torch.nn.Module), got {type(module).__name__}")
    if num_heads is not None:
        check_positive_int(num_heads, "num_heads")
    if batch_first is not None and not isinstance(batch_first, bool):
        raise TypeError(f"batch_first must be True, False or None (try both), got {batch_first!r}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict of forward's arguments by name, got {type(kwargs).__name__}")
    count = sum(p.numel() for p in module.parameters())
    if count > MAX_PARAMETERS:
        raise ValueError(f"{type(module).__name__} has {count:,} parameters, more than diagnose runs "
                         f"({MAX_PARAMETERS:,}): pass one attention layer, not a whole model")
    devices = {p.device for p in module.parameters()}
    if any(d.type == "meta" for d in devices):
        raise ValueError(f"{type(module).__name__}'s parameters are on the meta device (no values): load them first")
    if len(devices) > 1:
        raise ValueError(f"{type(module).__name__}'s parameters are on several devices ({sorted(map(str, devices))}): "
                         "move the module to one with .to(device)")
    found, names = _find_weights(module)
    (wq, bq), (wk, bk), (wv, bv) = found["q"], found["k"], found["v"]
    wo, bo = found["o"] if found["o"] is not None else (None, None)
    heads = num_heads if num_heads is not None else _heads(module, int(wq.shape[0]))
    if heads is not None and int(wq.shape[0]) % heads:
        raise ValueError(f"num_heads={heads} does not divide the query projection's width {int(wq.shape[0])}")
    layout = batch_first if batch_first is not None else getattr(module, "batch_first", None)
    if not isinstance(layout, bool):
        layout = None
    params = {id(p): n for n, p in module.named_parameters()}
    return Anatomy(wq, wk, wv, wo, bq, bk, bv, bo, heads, layout, _call(module, dict(kwargs or {})), names, params)
