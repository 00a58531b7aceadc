"""What a real model's run recorded: one record per attention layer, for a sentence (`RealRun` of
`LayerRecord`s) or for chosen query rows of a long text (`LongRun` of `RowsRecord`s), and what
the model is (`ModelInfo`).

    >>> from multihead.explain.records import kv_groups
    >>> kv_groups(6, 2)                       # query heads reading each key/value head
    ((0, 1, 2), (3, 4, 5))

Shapes (one sentence, batch 1 dropped): L tokens, R chosen query rows, Lk keys, H query heads,
Hkv key/value heads, D head dim, Dv value head dim, d the hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import torch

from . import UsageError

__all__ = ["ModelError", "ModelInfo", "LayerRecord", "RealRun", "RowsRecord", "LongRun", "kv_groups"]


class ModelError(UsageError):
    """A model that cannot be explained: unknown, not installed, or not run by multihead's
    attention. A ValueError for Python callers; the CLI prints it as one line and exits 2."""


def kv_groups(heads: int, kv_heads: int) -> tuple[tuple[int, ...], ...]:
    """The query heads reading each key/value head: query head i reads kv head i // (H // Hkv)."""
    g = heads // kv_heads
    return tuple(tuple(range(j * g, (j + 1) * g)) for j in range(kv_heads))


@dataclass(frozen=True)
class ModelInfo:
    """What a loaded model is, read from its config and checked on its first run.

    kind: "decoder" when every layer's mask was causal on the first run, else "encoder".
    rope: None, or {"type", "base"}: the rotary embedding of the config (the cos/sin themselves are
    recorded per run, see :class:`LayerRecord`); for parameters per layer type (ModernBERT)
    base is None and "per_type" ({layer type: its parameters}) and "layer_types" say them.
    """

    name: str
    title: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    rope: Optional[dict[str, Any]]
    family: str   # "bert", "llama" (q_proj/k_proj/v_proj/o_proj), "opt" (.../out_proj) or "other"

    @property
    def kv_groups(self) -> tuple[tuple[int, ...], ...]:
        return kv_groups(self.heads, self.kv_heads)


@dataclass(repr=False)
class LayerRecord:
    """One attention layer on the sentence, as the model ran it (batch 1 dropped).

    hidden: (L, d) the attention module's input.
    q_proj / k_proj: (H, L, D) / (Hkv, L, D) the projections split into heads, before the rotary
        embedding (None for a layer whose projections multihead does not know).
    cos / sin: (L, D) the model's own rotary tables at positions 0..L-1, or None (no RoPE).
    q, k, v: (H, L, D), (Hkv, L, D), (Hkv, L, Dv): what the layer passed to the attention function.
    keep: (H, L, L) bool, True = query i may attend to key j (the mask the layer passed).
    bias: (H, L, L) float added to the scores, or None.
    scale: the factor of q·k (the layer's ``scaling``).
    scores: (H, L, L) float32, q kᵀ before the scale, as multihead computed them.
    weights: (H, L, L) the softmax multihead computed (rows sum to 1).
    out: (H, L, Dv) weights @ v.
    output: (L, d) the layer's output projection of the merged heads (None if unknown).
    module: the attention module (for :meth:`multihead.MultiHeadAttention.from_hf`).
    softcap: the cap of the scores (Gemma 2's ``attn_logit_softcapping``: s -> cap·tanh(s / cap),
        after the scale, before the mask), or None.
    sinks: (H,) learned sink logits (gpt-oss: exp(sink_h) joins each row's softmax denominator), or None.
    sliding_window: the window transformers passed with the call (its mask is in ``keep``), or None.
    q_normed / k_normed: (H, L, D) / (Hkv, L, D) the projections after the layer's q/k norm and
        before RoPE (Qwen 3, Gemma 3, OLMo 2), or None for a layer without one.
    q_scale: the factor the layer multiplied q by right after its projection (OPT and BART fold
        the scale into q and pass scaling=1), or None.
    attention: the :class:`~multihead.explain.layer_attention.LayerAttention` of this layer:
        what its mask, softcap, sinks, norm, scale and rotary embedding were.
    role: "self" (a model of one sequence), or in an encoder-decoder "encoder" (the encoder's
        self-attention), "decoder" (the decoder's causal self-attention) or "cross" (decoder
        queries, keys and values from the encoder's output).
    memory: (Lk, d) the keys' input of a cross-attention layer (the encoder's output), else None.
    """

    hidden: Optional[torch.Tensor]
    q_proj: Optional[torch.Tensor]
    k_proj: Optional[torch.Tensor]
    cos: Optional[torch.Tensor]
    sin: Optional[torch.Tensor]
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    keep: torch.Tensor
    bias: Optional[torch.Tensor]
    scale: float
    scores: torch.Tensor
    weights: torch.Tensor
    out: torch.Tensor
    output: Optional[torch.Tensor] = None
    module: Any = field(default=None, repr=False)
    module_bias: bool = False   # whether the layer's projections have biases
    softcap: Optional[float] = None
    sinks: Optional[torch.Tensor] = None
    sliding_window: Optional[int] = None
    q_normed: Optional[torch.Tensor] = None
    k_normed: Optional[torch.Tensor] = None
    q_scale: Optional[float] = None
    attention: Any = field(default=None, repr=False)
    role: str = "self"
    memory: Optional[torch.Tensor] = None

    def __repr__(self) -> str:
        return (f"<LayerRecord: q {tuple(self.q.shape)}, k {tuple(self.k.shape)}, v {tuple(self.v.shape)}, "
                f"weights {tuple(self.weights.shape)}, scale {self.scale:.4g}>")

    @property
    def causal(self) -> bool:
        L = self.keep.shape[-1]
        tril = torch.ones(L, L, dtype=torch.bool).tril()
        return bool(L > 1 and (self.keep == tril).all())


@dataclass(repr=False)
class RowsRecord:
    """One attention layer on a long text, at the chosen query rows only (batch 1 dropped).

    weights: (H, R, Lk) float32, the weights of the R chosen query rows, exp(s - lse) from the
        chunked backend's log-sum-exp (:func:`multihead.attention_weights` with ``rows=``): no
        (H, L, L) tensor is built.
    keep: (H, R, Lk) bool, True = the row's query may attend to the key (the layer's mask at those rows).
    scale: the factor of q·k (the layer's ``scaling``).
    role: as :attr:`LayerRecord.role`.
    """

    weights: torch.Tensor
    keep: torch.Tensor
    scale: float
    role: str = "self"

    def __repr__(self) -> str:
        return f"<RowsRecord: weights {tuple(self.weights.shape)}, scale {self.scale:.4g}>"


class _Layers:
    """What a sentence's run (`RealRun`) and a long text's (`LongRun`) share: ``layers``, one
    record per attention layer, each with ``weights`` and ``keep`` (H, R, Lk) at the run's R query
    rows (every row of the sentence, R = L, for a `RealRun`)."""

    info: ModelInfo
    tokens: list[str]
    layers: Sequence[Union[LayerRecord, RowsRecord]]

    @property
    def weights(self) -> torch.Tensor:
        """(layers, H, R, Lk) float32, every layer's attention weights at the run's query rows."""
        return torch.stack([r.weights for r in self.layers]).float()

    @property
    def keep(self) -> torch.Tensor:
        """(layers, H, R, Lk) bool, every layer's mask at the run's query rows."""
        return torch.stack([r.keep for r in self.layers])

    def check_indices(self, *, layer: Optional[int] = None, head: Optional[int] = None,
                      token: Optional[int] = None) -> None:
        """ValueError (:class:`ModelError`) naming the option and the range for an index out of range."""
        for flag, value, count, what in (("--layer", layer, self.info.layers, "layers"),
                                         ("--head", head, self.info.heads, "heads"),
                                         ("--token", token, len(self.tokens), "tokens on this text")):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{flag.lstrip('-')} must be an int, got {type(value).__name__}")
            if not 0 <= value < count:
                raise ModelError(f"{flag} {value} is out of range: {self.info.title} has {what} 0-{count - 1}")


@dataclass(repr=False)
class RealRun(_Layers):
    """A sentence through a model: its L tokens and one :class:`LayerRecord` per layer; ``net``
    is the transformers model that ran."""

    info: ModelInfo
    text: str
    tokens: list[str]
    ids: list[int]
    layers: list[LayerRecord]
    net: Any = field(default=None, repr=False)

    def __repr__(self) -> str:
        return (f"<RealRun: {self.info.title}, {len(self.tokens)} tokens, {len(self.layers)} layers x "
                f"{self.info.heads} heads; .tokens, .weights (layers, H, L, L), .layers[i]>")

    @property
    def causal(self) -> bool:
        return all(r.causal for r in self.layers)

    @property
    def kind(self) -> str:
        """"decoder" when every layer masked causally, "encoder" otherwise."""
        return "decoder" if self.causal else "encoder"


@dataclass(repr=False)
class LongRun(_Layers):
    """A long text through a model (more than :data:`MAX_TOKENS` tokens): its L tokens, the chosen
    query ``rows`` and one :class:`RowsRecord` per layer (:meth:`RealModel.run_rows`)."""

    info: ModelInfo
    text: str
    tokens: list[str]
    ids: list[int]
    rows: list[int]
    layers: list[RowsRecord]

    def __repr__(self) -> str:
        return (f"<LongRun: {self.info.title}, {len(self.tokens)} tokens, rows {self.rows}, {len(self.layers)} layers x "
                f"{self.info.heads} heads; .weights (layers, H, R, L), .summary()>")

    def summary(self) -> dict[str, torch.Tensor]:
        """Per layer and head, over the chosen rows (each (layers, H)): "top" the key with the most
        weight summed over the rows, "top_weight" its mean weight, "first" the mean weight on
        token 0, "entropy" the mean entropy of a row in bits (log2 of how many keys it spreads over)."""
        w = self.weights
        top_weight, top = w.mean(2).max(-1)
        logs = torch.where(w > 0, torch.log2(w.clamp_min(torch.finfo(w.dtype).tiny)), torch.zeros_like(w))
        return {"top": top, "top_weight": top_weight, "first": w[..., 0].mean(2),
                "entropy": -(w * logs).sum(-1).mean(2)}
