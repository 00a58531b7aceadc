"""What one attention layer of a real model did: one description that every view reads.

    >>> from multihead.explain import models
    >>> run = models.load("smollm2").run("The cat sat on the mat.")     # doctest: +SKIP
    >>> run.layers[0].attention.mask, run.layers[0].attention.rope      # doctest: +SKIP
    ('causal', 'full')

:func:`describe` reads a :class:`~multihead.explain.models.LayerRecord` (what the layer passed to
the attention function, and the keyword arguments transformers gave it) and says, as data:

* the mask kind, read from the mask the layer passed: ``causal`` (key j <= query i),
  ``bidirectional`` (every key), ``window`` (causal, the last ``window`` keys: i - w < j <= i),
  ``local`` (bidirectional, |i - j| < ``window``), ``chunked`` (causal within chunks of ``chunk``
  tokens) or ``custom`` (anything else: padding, a user's mask);
* the softcap (s -> cap·tanh(s / cap)) and the sink logits (H,), as the layer passed them;
* whether q and k went through a norm before RoPE (``qk_norm``);
* the scale: the factor of q·k in the call (``scale``), whether it is 1/√D, and the factor
  the layer folded into q right after its projection (``q_scale``, OPT/BART);
* the rotary embedding: ``full`` (rotate-half on all D dims), ``partial`` (the first
  ``rotary_dim`` dims), or None, checked by recomputing the layer's q from its projection (or,
  where q, k and v come from one fused projection, by the tables' width agreeing with the
  config's ``partial_rotary_factor``/``rotary_pct``).

The summary (:func:`multihead.explain.real_model.model_summary`), the page, the neuron view and
the ``--token`` walkthrough all read this; the words are :func:`mask_words` and :func:`lines`.

Shapes: H query heads, L tokens, D head dim, r rotary dims.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from .._numerics import default_scale, is_default_scale
from ..rope import rotate_half

__all__ = ["LayerAttention", "describe", "rotary", "mask_kind", "mask_words", "scale_words", "layer_words", "lines",
           "MASKS"]

#: the mask kinds :func:`mask_kind` tells apart
MASKS = ("causal", "bidirectional", "window", "local", "chunked", "custom")


@dataclass(frozen=True)
class LayerAttention:
    """What one layer's attention did (see the module docstring for each field)."""

    mask: str
    window: Optional[int]
    chunk: Optional[int]
    softcap: Optional[float]
    sinks: Optional[tuple[float, ...]]
    qk_norm: bool
    scale: float
    scale_is_default: bool
    q_scale: Optional[float]
    rope: Optional[str]
    rotary_dim: Optional[int]
    head_dim: int

    @property
    def causal(self) -> bool:
        return self.mask in ("causal", "window", "chunked")


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (..., D) rotated on its first r dims with tables cos, sin (..., r) (rotate-half layout);
    the other D - r dims pass through (partial rotary). r = D is the usual full rotary."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    head, rest = x[..., :r], x[..., r:]
    return torch.cat([head * cos + rotate_half(head) * sin, rest], dim=-1)


def _band(L: int, left: int, right: int) -> torch.Tensor:
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    return (j >= i - left) & (j <= i + right)


def mask_kind(keep: torch.Tensor, sliding_window: Optional[int] = None) -> tuple[str, Optional[int], Optional[int]]:
    """``(kind, window, chunk)`` of a mask keep (H, L, L) (True = may attend; :data:`MASKS`).

    A causal band is a ``window`` when it cuts keys (i - w < j <= i, w < L), or when the layer
    was given ``sliding_window`` w and its mask is that band (a text shorter than the window)."""
    L = keep.shape[-1]
    first = keep[0]
    if not bool((keep == first).all()):
        return "custom", None, None
    if bool(first.all()):
        return "bidirectional", None, None
    tril = _band(L, L, 0)
    if sliding_window is not None and 0 < sliding_window and torch.equal(first, _band(L, sliding_window - 1, 0)):
        return "window", int(sliding_window), None
    if torch.equal(first, tril):
        return "causal", None, None
    for left in range(L - 1):
        if torch.equal(first, _band(L, left, 0)):
            return "window", left + 1, None
        if torch.equal(first, _band(L, left, left)):
            return "local", left + 1, None
    idx = torch.arange(L)
    for c in range(1, L):
        if torch.equal(first, tril & ((idx[:, None] // c) == (idx[None, :] // c))):
            return "chunked", None, c
    return "custom", None, None


def _rope_mode(rec: Any) -> tuple[Optional[str], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The rotary layout that turns the layer's projection into the q it passed, with its tables
    at the full rotary width: ``("full" | "partial", cos, sin)``, or (None, None, None) when no
    layout reproduces q (or nothing was recorded)."""
    before = rec.q_normed if rec.q_normed is not None else rec.q_proj
    if rec.cos is None or rec.sin is None:
        return None, None, None
    if before is None:  # fused q/k/v (GPT-NeoX, Phi-3): the table width and the config must agree
        return _rope_from_config(rec)
    q = rec.q.double()
    D, w = q.shape[-1], rec.cos.shape[-1]
    candidates = [(rec.cos, rec.sin)]
    if 2 * w == D:  # gpt-oss: tables of D/2 columns for the two halves
        candidates.insert(0, (torch.cat([rec.cos, rec.cos], -1), torch.cat([rec.sin, rec.sin], -1)))
    eps = torch.finfo(rec.q.dtype).eps
    for cos, sin in candidates:
        if cos.shape[-1] > D or cos.shape[-1] % 2:
            continue
        got = rotary(before.double(), cos.double(), sin.double())
        size = before.double().abs().amax() * 2 + 1
        if float((got - q).abs().max()) <= 8 * eps * float(size):
            return ("full" if cos.shape[-1] == D else "partial"), cos, sin
    return None, None, None


def _rotary_factor(config: Any) -> Optional[float]:
    """The config's fraction of the head dim that RoPE turns (``partial_rotary_factor``,
    ``rotary_pct``), or None when it names none."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params.get("partial_rotary_factor") is not None:
        return float(params["partial_rotary_factor"])
    for name in ("partial_rotary_factor", "rotary_pct"):
        value = getattr(config, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def _rope_from_config(rec: Any) -> tuple[Optional[str], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The rotary layout of a layer whose q projection was not recorded: the width r of the tables
    the layer received, when its config's rotary fraction gives the same r = factor · D."""
    factor = _rotary_factor(getattr(rec.module, "config", None))
    D, w = rec.q.shape[-1], rec.cos.shape[-1]
    if factor is None or w % 2 or w > D or int(D * factor) != w:
        return None, None, None
    return ("full" if w == D else "partial"), rec.cos, rec.sin


def describe(rec: Any) -> LayerAttention:
    """The :class:`LayerAttention` of a :class:`~multihead.explain.models.LayerRecord`; also
    rewrites ``rec.cos``/``rec.sin`` to the tables at the full rotary width (or None when no
    rotary layout reproduces the layer's q)."""
    kind, window, chunk = mask_kind(rec.keep, rec.sliding_window)
    mode, cos, sin = _rope_mode(rec)
    rec.cos, rec.sin = cos, sin
    D = rec.q.shape[-1]
    return LayerAttention(
        mask=kind, window=window, chunk=chunk, softcap=rec.softcap,
        sinks=None if rec.sinks is None else tuple(float(x) for x in rec.sinks.tolist()),
        qk_norm=rec.q_normed is not None, scale=rec.scale, scale_is_default=is_default_scale(rec.scale, D),
        q_scale=rec.q_scale, rope=mode, rotary_dim=None if cos is None else cos.shape[-1], head_dim=D,
    )


# ---------------------------------------------------------------------------- words
_MASK_WORDS = {
    "causal": ("causal (token i sees tokens 0..i)", "因果（token i 看 token 0..i）"),
    "bidirectional": ("bidirectional (every token sees every token)", "双向（每个 token 看所有 token）"),
    "window": ("causal, sliding window of {w} (token i sees tokens i-{w1}..i)",
               "因果，滑动窗口 {w}（token i 看 token i-{w1}..i）"),
    "local": ("bidirectional, local window |i - j| < {w}", "双向，局部窗口 |i - j| < {w}"),
    "chunked": ("causal within chunks of {c} tokens", "在每 {c} 个 token 的块内因果"),
    "custom": ("a mask of its own (see the heat maps)", "自定义掩码（见热图）"),
}


def mask_words(a: LayerAttention, lang: str = "en") -> str:
    """The mask of ``a`` in words ("causal, sliding window of 3 (token i sees tokens i-2..i)")."""
    text = _MASK_WORDS[a.mask][0 if lang == "en" else 1]
    return text.format(w=a.window, w1=(a.window or 1) - 1, c=a.chunk)


def scale_words(a: LayerAttention, lang: str = "en") -> str:
    """Where the scale of ``a`` is applied and what it is, in words."""
    D = a.head_dim
    en = lang == "en"
    if a.q_scale is not None:
        ref = f" (1/√{D})" if is_default_scale(a.q_scale, D) else ""
        return (f"scale folded into q: q = q_proj × {a.q_scale:.6g}{ref}; the scores are not scaled again" if en
                else f"缩放并入 q：q = q_proj × {a.q_scale:.6g}{ref}；分数不再缩放")
    if a.scale_is_default:
        return f"scores × {a.scale:.6g} (1/√{D})" if en else f"分数 × {a.scale:.6g}（1/√{D}）"
    return (f"scores × {a.scale:.6g} (the layer's own scaling, e.g. Gemma's query_pre_attn_scalar; not 1/√D = "
            f"{default_scale(D):.6g})" if en else
            f"分数 × {a.scale:.6g}（该层自己的缩放，如 Gemma 的 query_pre_attn_scalar；不是 1/√D = {default_scale(D):.6g}）")


def layer_words(ids: Sequence[int], lang: str) -> str:
    """"layer 0" / "layers 0, 2" / "第 0, 2 层"."""
    word = ("layer " if len(ids) == 1 else "layers ") if lang == "en" else "第 "
    tail = "" if lang == "en" else " 层"
    return word + ", ".join(map(str, ids)) + tail


def lines(attention: Sequence[LayerAttention], lang: str = "en") -> list[str]:
    """The model summary's lines about its layers: the mask of each kind of layer, then softcap,
    sinks, q/k norm, scale and rotary layout when any layer has them."""
    en = lang == "en"
    groups: dict[str, list[int]] = {}
    for i, a in enumerate(attention):
        groups.setdefault(mask_words(a, lang), []).append(i)
    out = []
    kinds = {a.mask for a in attention}
    if len(groups) == 1:
        words = next(iter(groups))
        what = ("decoder" if en else "解码器") if all(a.causal for a in attention) else \
            ("encoder" if en else "编码器")
        out.append(f"{what}: {words}" if en else f"{what}：{words}")
        if kinds == {"bidirectional"}:
            out[-1] = "encoder: every token sees every token" if en else "编码器：每个 token 都能看到所有 token"
        elif kinds == {"causal"}:
            out[-1] = ("decoder: every layer's mask is causal (token i sees tokens 0..i)" if en
                       else "解码器：每一层的掩码都是因果的（token i 只看 token 0..i）")
    else:
        what = ("decoder, layers differ:" if en else "解码器，各层不同：") if all(a.causal for a in attention) else \
            ("layers differ:" if en else "各层不同：")
        out.append(what)
        for words, ids in groups.items():
            out.append(f"  {layer_words(ids, lang)}: {words}" if en else f"  {layer_words(ids, lang)}：{words}")
    caps = sorted({a.softcap for a in attention if a.softcap is not None})
    if caps:
        cap = ", ".join(f"{c:g}" for c in caps)
        out.append(f"softcap: s -> {cap}·tanh(s / {cap}) after the scale, before the mask" if en
                   else f"软上限 softcap：缩放之后、掩码之前 s → {cap}·tanh(s / {cap})")
    if any(a.sinks is not None for a in attention):
        out.append("attention sinks: a learned logit per head joins each row's softmax denominator, so rows sum to "
                   "less than 1" if en else "注意力汇聚 sink：每个头一个学到的 logit 加入每行 softmax 的分母，所以每行之和小于 1")
    if any(a.qk_norm for a in attention):
        out.append("q/k norm: q and k are normalised per head (the layer's RMSNorm) before RoPE" if en
                   else "q/k norm：q 和 k 在 RoPE 之前按头归一化（该层的 RMSNorm）")
    scales = {scale_words(a, lang) for a in attention}
    if any(a.q_scale is not None or not a.scale_is_default for a in attention):
        out += sorted(scales)
    partial = sorted({(a.rotary_dim, a.head_dim) for a in attention if a.rope == "partial" and a.rotary_dim is not None})
    for r, D in partial:
        out.append(f"partial rotary: RoPE turns the first {r} of {D} dims; the other {D - r} pass unchanged" if en
                   else f"部分旋转：RoPE 只旋转 {D} 维中的前 {r} 维，其余 {D - r} 维不变")
    return out
