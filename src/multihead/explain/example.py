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

from .._checks import check_dropout, check_positive_int
from . import UsageError
from ..module import MultiHeadAttention
from ..trace import Trace, trace

__all__ = ["ExampleConfig", "Limits", "LIMITS", "MAX_BATCH", "MAX_HEADS", "MAX_FEATURES",
           "build_example", "config_from_args", "trace_example"]


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
    from a second input of that many tokens (None = self-attention, Lk = tokens). dropout: on
    the attention weights; the module then runs in training mode.
    """

    batch: int = 2
    tokens: int = 3
    d_in: int = 4
    d_out: int = 8
    heads: int = 2
    kv_heads: Optional[int] = None
    keys: Optional[int] = None
    causal: bool = True
    seed: int = 42
    dropout: float = 0.0
    bias: bool = False

    def __post_init__(self):
        for name in ("batch", "tokens", "d_in", "d_out", "heads"):
            check_positive_int(getattr(self, name), name)
        for name in ("kv_heads", "keys"):
            if getattr(self, name) is not None:
                check_positive_int(getattr(self, name), name)
        check_positive_int(self.seed, "seed", allow_zero=True)
        object.__setattr__(self, "dropout", check_dropout(self.dropout, "dropout"))

    @classmethod
    def from_args(cls, args) -> "ExampleConfig":
        """From the parsed ``multihead explain`` options."""
        return cls(
            batch=args.batch, tokens=args.tokens, d_in=args.d_in, d_out=args.d_out, heads=args.heads,
            kv_heads=args.kv_heads, keys=args.keys, causal=args.causal, seed=args.seed,
            dropout=args.dropout,
        )

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
        call = "mha(x, memory)" if self.keys is not None else "mha(x)"
        return f"mha = MultiHeadAttention({', '.join(args)}); y = {call}"


def config_from_args(args) -> ExampleConfig:
    """The example config of the parsed ``multihead explain`` options, checked before any work:
    a size the module refuses raises :class:`UsageError` naming the options."""
    if args.d_out % args.heads:
        raise UsageError(
            f"--heads {args.heads} does not divide --d-out {args.d_out}: choose --d-out as a multiple "
            f"of --heads (each head gets d_out / heads features)"
        )
    if args.kv_heads is not None and args.heads % args.kv_heads:
        raise UsageError(
            f"--kv-heads {args.kv_heads} does not divide --heads {args.heads}: each key/value head "
            "must serve the same number of query heads"
        )
    try:
        config = ExampleConfig.from_args(args)
        build_example(config)  # the module validates everything else: fail before any output
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from None
    return config


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
            causal=c.causal, backend="reference",
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
            y = mha(*inputs)
    return mha, inputs, t, y


def trace_example(config: ExampleConfig = ExampleConfig(), *, keep_values: bool = True) -> Trace:
    """The :class:`multihead.Trace` of ``mha(*inputs)`` for ``config`` (see :func:`build_example`)."""
    return run_example(config, keep_values=keep_values)[2]
