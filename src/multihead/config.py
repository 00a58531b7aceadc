"""The module's settings: a small frozen dataclass, validated once."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from ._checks import check_dropout, check_heads, check_positive_int
from .backends import names as backend_names
from .rope import check_rope_base


@dataclass(frozen=True)
class AttentionConfig:
    """Settings of :class:`multihead.MultiHeadAttention`.

    d_in: query feature size. num_heads: H, query heads. d_out: H * head_dim (default d_in).
    num_kv_heads: Hkv key/value heads (default H; fewer = grouped-query attention, 1 = multi-query).
    kdim / vdim: feature sizes of the key and value inputs (default d_in).
    bias: projections have biases. dropout: on the attention weights, in training only.
    causal: apply a bottom-right causal mask. backend: see multihead.backends.names().
    rope: rotate q and k by their positions (rotary embeddings, :class:`multihead.rope.RoPE`);
    self-attention only, needs an even head_dim. rope_base: the RoPE frequency base.
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

    def __post_init__(self):
        set_ = object.__setattr__
        check_positive_int(self.d_in, "d_in")
        check_positive_int(self.num_heads, "num_heads")
        set_(self, "d_out", self.d_in if self.d_out is None else check_positive_int(self.d_out, "d_out"))
        set_(self, "num_kv_heads", self.num_heads if self.num_kv_heads is None else check_positive_int(self.num_kv_heads, "num_kv_heads"))
        set_(self, "kdim", self.d_in if self.kdim is None else check_positive_int(self.kdim, "kdim"))
        set_(self, "vdim", self.kdim if self.vdim is None else check_positive_int(self.vdim, "vdim"))
        if self.d_out % self.num_heads:
            raise ValueError(
                f"d_out={self.d_out} is not divisible by num_heads={self.num_heads}; "
                f"choose d_out as a multiple of num_heads (head_dim = d_out // num_heads)"
            )
        check_heads(self.num_heads, self.num_kv_heads, "num_heads", "num_kv_heads")
        set_(self, "dropout", check_dropout(self.dropout, "dropout"))
        if not isinstance(self.bias, bool):
            raise TypeError(f"bias must be True or False, got {self.bias!r}")
        if not isinstance(self.causal, bool):
            raise TypeError(f"causal must be True or False, got {self.causal!r}")
        if not isinstance(self.rope, bool):
            raise TypeError(f"rope must be True or False, got {self.rope!r}")
        set_(self, "rope_base", check_rope_base(self.rope_base))
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
        return self.d_out // self.num_heads

    @property
    def kv_dim(self) -> int:
        """Output size of the key and value projections: Hkv * head_dim."""
        return self.num_kv_heads * self.head_dim

    @property
    def groups(self) -> int:
        """Query heads per key/value head."""
        return self.num_heads // self.num_kv_heads

    def to_dict(self) -> dict:
        return asdict(self)
