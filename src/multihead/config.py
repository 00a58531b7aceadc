"""The module's settings: a small frozen dataclass, validated once, and the weights that go with it.

A `multihead.MultiHeadAttention` is fully described by ``(config, weights)``: its
`AttentionConfig` and a plain dict of tensors under its ``state_dict`` names
(`AttentionConfig.weight_shapes`). The converters (`multihead.interop`,
`multihead.hf`, `multihead.per_head`) exchange that pair and know nothing of the
module; ``MultiHeadAttention.from_config(config, weights)`` builds it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

import torch

from ._checks import check_dropout, check_heads, check_positive_int
from .backends import names as backend_names
from .rope import RoPEScaling, check_rope_base

__all__ = ["AttentionConfig"]

#: Each projection's weight (out, in), by the config's names for the sizes.
_PROJECTIONS = {
    "q_proj": ("d_out", "d_in"),
    "k_proj": ("kv_dim", "kdim"),
    "v_proj": ("kv_dim", "vdim"),
    "out_proj": ("d_out", "d_out"),
}


def resolved_size(value: Optional[int]) -> int:
    """A size field as `AttentionConfig.__post_init__` leaves it: an int (None is only ever passed in)."""
    if value is None:
        raise AttributeError("an AttentionConfig size is read before __post_init__ resolved it")
    return value


@dataclass(frozen=True)
class AttentionConfig:
    """Settings of `multihead.MultiHeadAttention`: its constructor's arguments, resolved.

    d_in: query feature size. num_heads: H, query heads. d_out: H * head_dim (default d_in).
    num_kv_heads: Hkv key/value heads (default H; fewer = grouped-query attention, 1 = multi-query).
    kdim / vdim: feature sizes of the key and value inputs (default d_in).
    bias: projections have biases. dropout: on the attention weights, in training only.
    causal: apply a bottom-right causal mask. backend: see multihead.backends.names().
    rope: rotate q and k by their positions (rotary embeddings, `multihead.rope.RoPE`);
    self-attention only, needs an even head_dim. rope_base: the RoPE frequency base.
    rope_scaling: a `multihead.rope.RoPEScaling` rule for the frequencies (rope=True only),
    or None; a dict of its fields (as `to_dict` writes it) is read as one.
    rope_interleaved: GPT-J's layout (pairs 2i, 2i+1) instead of rotate-half. rope_dim: rotate
    only the first rope_dim coordinates of each head (GPT-NeoX, Phi; None: all of them).

    Example::

        c = AttentionConfig(d_in=64, num_heads=8, num_kv_heads=2, causal=True)
        assert (c.head_dim, c.kv_dim) == (8, 16) and AttentionConfig(**c.to_dict()) == c
    """

    d_in: int
    num_heads: int
    d_out: Optional[int] = None
    num_kv_heads: Optional[int] = None
    kdim: Optional[int] = None
    vdim: Optional[int] = None
    bias: bool = True
    dropout: float = 0.0
    causal: bool = False
    backend: str = "auto"
    rope: bool = False
    rope_base: float = 10000.0
    rope_scaling: Optional[RoPEScaling] = None
    rope_interleaved: bool = False
    rope_dim: Optional[int] = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        check_positive_int(self.d_in, "d_in")
        check_positive_int(self.num_heads, "num_heads")
        d_out = self.d_in if self.d_out is None else check_positive_int(self.d_out, "d_out")
        num_kv_heads = self.num_heads if self.num_kv_heads is None else check_positive_int(self.num_kv_heads, "num_kv_heads")
        set_(self, "d_out", d_out)
        set_(self, "num_kv_heads", num_kv_heads)
        set_(self, "kdim", self.d_in if self.kdim is None else check_positive_int(self.kdim, "kdim"))
        set_(self, "vdim", self.kdim if self.vdim is None else check_positive_int(self.vdim, "vdim"))
        if d_out % self.num_heads:
            raise ValueError(
                f"d_out={self.d_out} is not divisible by num_heads={self.num_heads}; "
                f"choose d_out as a multiple of num_heads (head_dim = d_out // num_heads)"
            )
        check_heads(self.num_heads, num_kv_heads, "num_heads", "num_kv_heads")
        set_(self, "dropout", check_dropout(self.dropout, "dropout"))
        if not isinstance(self.bias, bool):
            raise TypeError(f"bias must be True or False, got {self.bias!r}")
        if not isinstance(self.causal, bool):
            raise TypeError(f"causal must be True or False, got {self.causal!r}")
        if not isinstance(self.rope, bool):
            raise TypeError(f"rope must be True or False, got {self.rope!r}")
        set_(self, "rope_base", check_rope_base(self.rope_base))
        set_(self, "rope_scaling", _check_rope_scaling(self.rope_scaling))
        if self.rope_scaling is not None and not self.rope:
            raise ValueError(
                f"rope_scaling={self.rope_scaling} rescales rotary embeddings, but rope=False; "
                "pass rope=True, or rope_scaling=None"
            )
        if not isinstance(self.rope_interleaved, bool):
            raise TypeError(f"rope_interleaved must be True or False, got {self.rope_interleaved!r}")
        if (self.rope_interleaved or self.rope_dim is not None) and not self.rope:
            raise ValueError("rope_interleaved / rope_dim shape rotary embeddings, but rope=False; pass rope=True")
        if self.rope_dim is not None:
            rd = check_positive_int(self.rope_dim, "rope_dim")
            if rd % 2 or rd > self.head_dim:
                raise ValueError(f"rope_dim must be even and <= head_dim={self.head_dim}, got {rd}")
            set_(self, "rope_dim", None if rd == self.head_dim else rd)
        if self.rope and self.head_dim % 2:
            raise ValueError(
                f"rope=True needs an even head_dim (RoPE rotates pairs of coordinates), got "
                f"head_dim={self.head_dim} (d_out={self.d_out} / num_heads={self.num_heads})"
            )
        if self.rope and self.kdim != self.d_in:
            raise ValueError(
                f"rope=True is for self-attention, but kdim={self.kdim} differs from d_in={self.d_in} "
                "(cross-attention: query and key positions come from different sequences); use rope=False"
            )
        if self.backend not in backend_names():
            raise ValueError(f"unknown backend {self.backend!r}; known backends: {', '.join(backend_names())}")

    @property
    def head_dim(self) -> int:
        return resolved_size(self.d_out) // self.num_heads

    @property
    def kv_dim(self) -> int:
        """Output size of the key and value projections: Hkv * head_dim."""
        return resolved_size(self.num_kv_heads) * self.head_dim

    @property
    def groups(self) -> int:
        """Query heads per key/value head."""
        return self.num_heads // resolved_size(self.num_kv_heads)

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain values (``rope_scaling`` as a dict or None): ``AttentionConfig(**d)`` reads it back."""
        return asdict(self)

    def summary(self) -> str:
        """``d_in=8, num_heads=2, d_out=8, head_dim=4, causal=False, ...``: the sizes, the switches,
        and every other field whose value is not the default it would resolve to (the module's repr)."""
        plain = AttentionConfig(d_in=self.d_in, num_heads=self.num_heads, d_out=self.d_out)
        always = ("d_in", "num_heads", "d_out", "causal", "dropout", "backend")
        parts = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in always or value != getattr(plain, f.name) or (f.name == "rope_base" and self.rope):
                parts.append(f"{f.name}={value!r}" if isinstance(value, str) else f"{f.name}={value}")
            if f.name == "d_out":
                parts.append(f"head_dim={self.head_dim}")
        return ", ".join(parts)

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """The module's ``state_dict`` names and their shapes, in its order::

            q_proj.weight (d_out, d_in)    k_proj.weight (kv_dim, kdim)    v_proj.weight (kv_dim, vdim)
            out_proj.weight (d_out, d_out)  and with bias=True each ``.bias`` (out,)
        """
        shapes: dict[str, tuple[int, ...]] = {}
        for name, axes in _PROJECTIONS.items():
            out, inp = (getattr(self, a) for a in axes)
            shapes[f"{name}.weight"] = (out, inp)
            if self.bias:
                shapes[f"{name}.bias"] = (out,)
        return shapes

    def check_weights(self, weights: Mapping[str, torch.Tensor], name: str = "weights") -> dict[str, torch.Tensor]:
        """``weights`` as a plain dict in `weight_shapes` order, after checking that it has
        exactly those names, each a floating tensor of that shape (ValueError/TypeError naming the
        key and the expected shape otherwise)."""
        if not isinstance(weights, Mapping):
            raise TypeError(
                f"{name} must be a mapping of state_dict names to tensors (e.g. mha.state_dict()), "
                f"got {type(weights).__name__}"
            )
        shapes = self.weight_shapes()
        missing = [k for k in shapes if k not in weights]
        unexpected = [k for k in weights if k not in shapes]
        if missing or unexpected:
            problems = [f"lacks {', '.join(f'{k} (shape {shapes[k]})' for k in missing)}"] if missing else []
            problems += [f"has unexpected keys {', '.join(map(str, unexpected))}"] if unexpected else []
            if any(str(k).endswith("in_proj_weight") for k in unexpected):
                hint = ("; it is an nn.MultiheadAttention state_dict: convert it with "
                        "multihead.integrations.torch_mha.torch_to_multihead")
            elif not unexpected and all(k.endswith(".bias") for k in missing):
                hint = " (this config has bias=True: pass the biases, or bias=False)"
            elif not missing and all(str(k).endswith(".bias") for k in unexpected):
                hint = " (this config has bias=False: drop them, or bias=True)"
            else:
                hint = ""
            layout = ", ".join(f"{k} {shape}" for k, shape in shapes.items())
            raise ValueError(f"{name} {' and '.join(problems)}{hint}; this config's weights are: {layout}")
        for k, shape in shapes.items():
            t = weights[k]
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}[{k!r}] must be a torch.Tensor of shape {shape}, got {type(t).__name__}")
            if not t.is_floating_point():
                raise TypeError(f"{name}[{k!r}] must have a floating dtype, got {t.dtype}")
            if tuple(t.shape) != shape:
                axes = _PROJECTIONS[k.split(".")[0]]
                expected = f"({axes[0]}, {axes[1]}) = {shape}" if k.endswith(".weight") else f"({axes[0]},) = {shape}"
                raise ValueError(f"{name}[{k!r}] has shape {tuple(t.shape)} but this config needs {expected}")
        return {k: weights[k] for k in shapes}


def _check_rope_scaling(scaling: object) -> Optional[RoPEScaling]:
    if scaling is None or isinstance(scaling, RoPEScaling):
        return scaling
    if isinstance(scaling, Mapping):
        return RoPEScaling(**scaling)
    raise TypeError(
        f"rope_scaling must be a multihead.rope.RoPEScaling or None, got {type(scaling).__name__}; "
        "e.g. RoPEScaling('linear', 4.0)"
    )
