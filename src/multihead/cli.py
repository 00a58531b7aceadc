"""The ``multihead`` command line: a thin shell over the library.

``build_parser()`` builds the argparse tree; ``main(argv)`` runs it in-process and returns the
exit code, so tests call ``main([...])``. A user mistake prints one line on stderr and exits 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

__all__ = ["build_parser", "main", "UsageError"]


class UsageError(Exception):
    """A mistake in what the user asked for: reported as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        raise UsageError(message)


def _int_at_least(low: int, name: str):
    """argparse type: an integer >= ``low``, with a one-line message naming the option."""

    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < low:
            bound = "a positive integer" if low == 1 else f">= {low}"
            raise argparse.ArgumentTypeError(f"{name} must be {bound}, got {value}")
        return value

    return parse


def _positive(name):
    return _int_at_least(1, name)


def _non_negative(name):
    return _int_at_least(0, name)


def _probability(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--dropout must be a number, got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"--dropout must be in [0, 1), got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="multihead", description="Multi-head attention, step by step.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    ex = sub.add_parser(
        "explain",
        help="walk through every dimension transformation of a real forward pass",
        description="Run MultiHeadAttention on a small example (by default the tutorials': batch 2, "
        "3 tokens, d_in 4, d_out 8, 2 heads, causal, seed 42) and explain every step.",
    )
    cfg = ex.add_argument_group("configuration")
    cfg.add_argument("--batch", type=_positive("--batch"), default=2, help="batch size B (default 2)")
    cfg.add_argument("--tokens", type=_positive("--tokens"), default=3, help="query tokens Lq (default 3)")
    cfg.add_argument("--d-in", type=_positive("--d-in"), default=4, help="input features (default 4)")
    cfg.add_argument("--d-out", type=_positive("--d-out"), default=8, help="output features = heads x head_dim (default 8)")
    cfg.add_argument("--heads", type=_positive("--heads"), default=2, help="query heads H (default 2)")
    cfg.add_argument("--kv-heads", type=_positive("--kv-heads"), default=None, help="key/value heads (GQA; default H)")
    cfg.add_argument("--keys", type=_positive("--keys"), default=None, help="cross-attention: this many key tokens from a second input")
    cfg.add_argument("--no-causal", dest="causal", action="store_false", help="no causal mask")
    cfg.add_argument("--seed", type=_non_negative("--seed"), default=42, help="random seed (default 42)")
    cfg.add_argument("--dropout", type=_probability, default=0.0, help="attention dropout, run in training mode")
    out = ex.add_argument_group("output")
    out.add_argument("--lang", choices=("en", "zh"), default="en", help="language (default en)")
    out.add_argument("--format", choices=("text", "json", "markdown", "html", "png"), default="text")
    out.add_argument("--out", default=None, help="write to this file instead of stdout (needed for html/png)")
    out.add_argument("--values", dest="values", action="store_true", default=True, help="print numbers (default)")
    out.add_argument("--no-values", dest="values", action="store_false", help="shapes only")
    out.add_argument("--per-head", action="store_true", help="also run the per-head reference and compare")
    out.add_argument("--cost", action="store_true", help="FLOPs and bytes of every step")
    real = ex.add_argument_group("real model")
    real.add_argument("--model", choices=("minilm",), default=None, help="explain a pretrained model's heads")
    real.add_argument("--text", default=None, help="the sentence to run through --model")
    real.add_argument("--layer", type=_non_negative("--layer"), default=None, help="layer to show (--model; html/png default: the most labelled layer)")
    real.add_argument("--head", type=_non_negative("--head"), default=None, help="head to show (--model)")
    return parser


def _explain(args, stdout) -> int:
    if args.model is not None and args.format in ("html", "png"):
        from .explain.real_model import run_visual as run
    elif args.model is not None:
        from .explain.real_model import run
    elif args.format in ("html", "png"):
        from .explain.visual import run
    else:
        from .explain.walkthrough import run
    return run(args, stdout)


def main(argv: Optional[Sequence[str]] = None, *, stdout=None, stderr=None) -> int:
    stdout = sys.stdout if stdout is None else stdout
    stderr = sys.stderr if stderr is None else stderr
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            raise UsageError("choose a command: multihead explain (see multihead --help)")
        return _explain(args, stdout)
    except UsageError as e:
        print(f"multihead: error: {e}", file=stderr)
        return 2
    except SystemExit as e:  # --help exits 0 through argparse
        return int(e.code or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
