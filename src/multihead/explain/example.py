"""The example that ``multihead explain`` runs: a config, the module and inputs it builds, its trace.

This is the small public API the walkthrough and the visual formats share::

    from multihead.explain.example import ExampleConfig, build_example, trace_example

    config = ExampleConfig()                    # the tutorials' example (seed 000)
    mha, inputs = build_example(config)         # MultiHeadAttention(backend="reference"), (x,) or (x, memory)
    t = trace_example(config)                   # multihead.Trace of mha(*inputs), values kept

Everything is deterministic in ``config.seed`` and leaves torch's global random state as it was.
The draws follow the tutorial's order: x first, then W_key, W_query, W_value (``nn.Linear``'s
default initialisation), then W_O, then the cross-attention memory. With the default config,
Q, K, V and the scores are the numbers the tutorial's own code prints.

Legend: B batch, Lq query tokens, Lk key tokens, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

import torch

from ..masks import Mask

from .._checks import check_dropout, check_positive_int
from ..module import MultiHeadAttention
from ..trace import Trace, trace
from .mask_spec import parse_mask, split_specs

__all__ = ["ExampleConfig", "Limits", "LIMITS", "MAX_BATCH", "MAX_HEADS", "MAX_FEATURES",
           "build_example", "check_heads", "trace_example"]


@dataclass(frozen=True)
class Limits:
    """The largest example one output format can show (``multihead explain`` refuses more, by name).

    tokens: the most query tokens Lq, and key tokens Lk. scores: the most elements B*H*Lq*Lk of
    one score step (the walkthrough keeps every step's values, and recomputes them in float64).
    why: the reason, said in the refusal.
    """

    tokens: int
    scores: int
    why: str


_TEXT = Limits(256, 2 ** 22, "it prints 8 x 8 corners, but keeps every step's values and recomputes them in float64")
#: per ``--format``. text and markdown print 8 x 8 corners of each matrix, json all of it (256 x 256
#: = 65,536 numbers a step); an html heat map cell is at least 18 px wide (64 fill a screen) and
#: the page embeds every map of every head; a png panel is at most 780 px (12 px a cell at 64).
LIMITS = {
    "text": _TEXT,
    "markdown": _TEXT,
    "json": Limits(256, 2 ** 22, "json writes every step's batch-0, head-0 matrix in full"),
    "html": Limits(64, 2 ** 18, "a heat map cell per token pair, and the page embeds every value"),
    "png": Limits(64, 2 ** 18, "one readable cell per token pair in the heat maps"),
}
#: every format shows one batch element at a time (html: a selector; text: batch 0)
MAX_BATCH = 16
#: html and png draw one heat map per head (png: a 4 x 4 grid at most)
MAX_HEADS = 16
#: d_in and d_out: the text prints 8 columns; 1024 holds real models' widths (BERT-base: 768)
MAX_FEATURES = 1024


@dataclass(frozen=True)
class ExampleConfig:
    """The example's sizes. Defaults are the tutorial's: batch 2, 3 tokens, d_in 4, d_out 8, 2 heads,
    causal, seed 42, projections without bias.

    kv_heads: Hkv (None = heads; fewer = grouped-query attention). keys: Lk for cross-attention
    from a second input of that many tokens (None = self-attention, Lk = tokens). causal: None
    (the default) is causal for self-attention and not for cross-attention, where the keys are
    another sequence; True or False says so. dropout: on the attention weights; the module
    then runs in training mode. mask: ``--mask`` specs (:mod:`.mask_spec`, e.g.
    ``("documents:3,2", "softcap:5")``), passed as ``mha(x, mask=...)`` and combined with the
    causal mask. A size the module refuses, or a bad spec, raises ValueError naming the field.
    """

    batch: int = 2
    tokens: int = 3
    d_in: int = 4
    d_out: int = 8
    heads: int = 2
    kv_heads: Optional[int] = None
    keys: Optional[int] = None
    causal: Optional[bool] = None
    seed: int = 42
    dropout: float = 0.0
    bias: bool = False
    mask: tuple[str, ...] = ()

    def __post_init__(self):
        for name in ("batch", "tokens", "d_in", "d_out", "heads"):
            check_positive_int(getattr(self, name), name)
        for name in ("kv_heads", "keys"):
            if getattr(self, name) is not None:
                check_positive_int(getattr(self, name), name)
        check_positive_int(self.seed, "seed", allow_zero=True)
        object.__setattr__(self, "dropout", check_dropout(self.dropout, "dropout"))
        if self.causal is None:
            object.__setattr__(self, "causal", self.keys is None)
        elif not isinstance(self.causal, bool):
            raise TypeError(f"causal must be True, False or None, got {self.causal!r}")
        check_heads(self.heads, self.d_out, self.kv_heads)
        if isinstance(self.mask, str) or not isinstance(self.mask, (tuple, list)):
            raise TypeError(f"mask must be a tuple of spec strings (e.g. ('documents:3,2',)), got {self.mask!r}")
        object.__setattr__(self, "mask", split_specs(self.mask))
        self.build_mask()

    def build_mask(self, name: str = "mask") -> Optional[Mask]:
        """The mask of ``mask``'s specs (None without any); ValueError naming ``name`` for a bad spec."""
        return parse_mask(self.mask, tokens=self.tokens, keys=self.key_tokens, heads=self.heads, name=name)

    @property
    def key_tokens(self) -> int:
        """Lk: ``keys`` for cross-attention, else ``tokens``."""
        return self.tokens if self.keys is None else self.keys

    @property
    def head_dim(self) -> int:
        return self.d_out // self.heads

    @property
    def num_kv_heads(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    def to_dict(self) -> dict:
        return asdict(self)

    def module_call(self) -> str:
        """The Python that builds and runs the module, as a user would write it."""
        args = [str(self.d_in), str(self.heads), str(self.d_out)]
        if self.kv_heads is not None:
            args.append(f"num_kv_heads={self.kv_heads}")
        if self.causal:
            args.append("causal=True")
        if self.dropout:
            args.append(f"dropout={self.dropout}")
        args.append(f"bias={self.bias}")
        args.append('backend="reference"')
        call = "mha(x, memory" if self.keys is not None else "mha(x"
        mask = self.build_mask()
        call += f", mask={mask!r})" if mask is not None else ")"
        return f"mha = MultiHeadAttention({', '.join(args)}); y = {call}"


def check_heads(heads: int, d_out: int, kv_heads: Optional[int], names: Optional[dict[str, str]] = None) -> None:
    """Raise ValueError when ``heads`` does not divide ``d_out`` or ``kv_heads`` does not divide
    ``heads``. ``names``: how the message calls each field (the command line passes its flags,
    ``{"heads": "--heads", ...}``); by default the field names."""
    n = {"heads": "heads", "d_out": "d_out", "kv_heads": "kv_heads", **(names or {})}
    if d_out % heads:
        raise ValueError(
            f"{n['heads']} {heads} does not divide {n['d_out']} {d_out}: choose {n['d_out']} as a multiple "
            f"of {n['heads']} (each head gets d_out / heads features)"
        )
    if kv_heads is not None and heads % kv_heads:
        raise ValueError(
            f"{n['kv_heads']} {kv_heads} does not divide {n['heads']} {heads}: each key/value head "
            "must serve the same number of query heads"
        )


def build_example(config: ExampleConfig = ExampleConfig()) -> tuple[MultiHeadAttention, tuple]:
    """The module and its inputs for ``config``.

    Returns ``(mha, inputs)``: ``mha`` a ``MultiHeadAttention(..., backend="reference")`` in
    training mode when ``config.dropout > 0`` (eval mode otherwise); ``inputs`` is ``(x,)`` with
    x (B, Lq, d_in), or ``(x, memory)`` with memory (B, Lk, d_in) for cross-attention.

    Raises ValueError for sizes the module refuses (heads not dividing d_out, kv_heads not
    dividing heads).
    """
    if not isinstance(config, ExampleConfig):
        raise TypeError(f"config must be an ExampleConfig, got {type(config).__name__}")
    c = config
    with torch.random.fork_rng(devices=[]):
        mha = MultiHeadAttention(
            c.d_in, c.heads, c.d_out, num_kv_heads=c.kv_heads, bias=c.bias, dropout=c.dropout,
            causal=bool(c.causal), backend="reference",
        )
        torch.manual_seed(c.seed)
        x = torch.randn(c.batch, c.tokens, c.d_in)
        with torch.no_grad():
            for linear in (mha.k_proj, mha.q_proj, mha.v_proj, mha.out_proj):  # the tutorial's order
                linear.reset_parameters()
        inputs: tuple = (x,)
        if c.keys is not None:
            inputs = (x, torch.randn(c.batch, c.keys, c.d_in))
    mha.train(c.dropout > 0)
    return mha, inputs


def run_example(config: ExampleConfig, *, keep_values: bool = True):
    """``(mha, inputs, trace, y)``: build the example and run ``mha(*inputs)`` inside a trace."""
    mha, inputs = build_example(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)  # the dropout draws
        with torch.no_grad(), trace(keep_values=keep_values) as t:
            y = mha(*inputs, mask=config.build_mask())
    return mha, inputs, t, y


def trace_example(config: ExampleConfig = ExampleConfig(), *, keep_values: bool = True) -> Trace:
    """The :class:`multihead.Trace` of ``mha(*inputs)`` for ``config`` (see :func:`build_example`)."""
    return run_example(config, keep_values=keep_values)[2]
