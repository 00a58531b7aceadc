"""The ``multihead`` command line: a thin shell over the library.

``build_parser()`` builds the argparse tree; ``main(argv)`` runs it in-process and returns the
exit code, so tests call ``main([...])``. This module alone knows argparse: it turns the flags
into typed values (:class:`multihead.explain.options.Options`, whose ``example`` is an
:class:`~multihead.explain.example.ExampleConfig`; :func:`parse_options`) and calls the explain
package with them. A user mistake prints one line on stderr and exits 2: a bad value, an option
that does not apply to what was asked (refused, not ignored), a size the chosen format cannot
show (the caps of :mod:`multihead.explain.example`, listed in ``--help``), an ``--out`` that
cannot be written, and any ValueError or TypeError the explain package raises. All of it is
checked before any work. What the explain package warns about
(:class:`multihead.explain.ExplainWarning`) is one line on stderr too.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from dataclasses import fields
from typing import Optional, Sequence

from . import _progress
from .explain import ExplainWarning, UsageError
from .explain.mask_spec import SPECS as _MASK_SPECS, parse_mask
from .explain.example import LIMITS, MAX_BATCH, MAX_FEATURES, MAX_HEADS, ExampleConfig, check_heads
from .explain.options import FORMATS, Options

__all__ = ["build_parser", "parse_options", "main", "UsageError"]

_SEEDS = 2 ** 64  # torch.manual_seed takes 0 .. 2**64 - 1
_RING_MAX = 10  # multihead.explain.ring_view.MAX_RANKS (not imported: it loads torch)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        raise UsageError(message)


def _int_in(name: str, low: int, high: Optional[int] = None, why: str = ""):
    """argparse type: an integer in [low, high], with a one-line message naming the option."""

    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < low:
            bound = "a positive integer" if low == 1 else f">= {low}"
            raise argparse.ArgumentTypeError(f"{name} must be {bound}, got {value}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"{name} must be at most {high} ({why}), got {value}")
        return value

    return parse


def _positive(name):
    return _int_in(name, 1)


def _non_negative(name):
    return _int_in(name, 0)


def _probability(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--dropout must be a number, got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"--dropout must be in [0, 1), got {value}")
    return value


def _version() -> str:
    """The installed distribution's version (one source: pyproject.toml); from a source tree that
    is not installed, ``multihead.__version__``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("multihead")
    except PackageNotFoundError:
        import multihead

        return getattr(multihead, "__version__", "unknown")


def _limits_help() -> str:
    text, picture = LIMITS["text"], LIMITS["html"]
    return (
        f"Sizes the walkthrough can show (larger ones are refused with a message): --batch at most "
        f"{MAX_BATCH} (one batch element is shown at a time), --heads at most {MAX_HEADS} (html and png "
        f"draw a heat map per head), --d-in and --d-out at most {MAX_FEATURES}; --tokens and --keys at "
        f"most {text.tokens} for text, markdown and json (every step's values are kept and recomputed "
        f"in float64; json writes them in full) and {picture.tokens} for html and png (one readable "
        f"heat-map cell per token); batch x heads x tokens x keys at most {text.scores:,} attention "
        f"scores per step ({picture.scores:,} for html and png)."
    )


def build_parser(*, defaults: bool = True) -> argparse.ArgumentParser:
    """The ``multihead`` argument parser. ``defaults=False`` leaves every option the user did not
    give out of the namespace (how :func:`main` tells a given option from its default)."""

    def d(value):
        return value if defaults else argparse.SUPPRESS

    parser = _Parser(prog="multihead", description="Multi-head attention, step by step.")
    parser.add_argument("--version", action="store_true", default=d(False), help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    ex = sub.add_parser(
        "explain",
        help="walk through every dimension transformation of a real forward pass",
        description="Run MultiHeadAttention on a small example (by default the tutorials': batch 2, "
        "3 tokens, d_in 4, d_out 8, 2 heads, causal, seed 42) and explain every step.",
        epilog=_limits_help(),
    )
    cap = LIMITS["text"].tokens, LIMITS["html"].tokens
    cfg = ex.add_argument_group("configuration (the step-by-step walkthrough)")
    cfg.add_argument("--batch", type=_positive("--batch"), default=d(2), help=f"batch size B (default 2, at most {MAX_BATCH})")
    cfg.add_argument("--tokens", type=_positive("--tokens"), default=d(3),
                     help=f"query tokens Lq (default 3; at most {cap[0]}, {cap[1]} for html/png)")
    cfg.add_argument("--d-in", type=_positive("--d-in"), default=d(4), help=f"input features (default 4, at most {MAX_FEATURES})")
    cfg.add_argument("--d-out", type=_positive("--d-out"), default=d(8),
                     help=f"output features = heads x head_dim (default 8, at most {MAX_FEATURES})")
    cfg.add_argument("--heads", type=_positive("--heads"), default=d(2), help=f"query heads H (default 2, at most {MAX_HEADS})")
    cfg.add_argument("--kv-heads", type=_positive("--kv-heads"), default=d(None), help="key/value heads (GQA; default H)")
    cfg.add_argument("--keys", type=_positive("--keys"), default=d(None),
                     help=f"cross-attention: this many key tokens from a second input (at most {cap[0]}, {cap[1]} for html/png)")
    cfg.add_argument("--causal", dest="causal", action="store_true", default=d(None),
                     help="a causal mask (the default for self-attention; with --keys only when asked)")
    cfg.add_argument("--no-causal", dest="causal", action="store_false", default=d(None), help="no causal mask")
    cfg.add_argument("--seed", type=_int_in("--seed", 0, _SEEDS - 1, "torch's seed range"), default=d(42),
                     help="random seed (default 42)")
    cfg.add_argument("--dropout", type=_probability, default=d(0.0), help="attention dropout, run in training mode")
    cfg.add_argument("--mask", action="append", default=d(None), metavar="SPEC",
                     help="a mask part for the example, combined with & after --causal (causal then aligns per "
                          "document); repeat it or join parts with &, e.g. --mask 'documents:3,2&softcap:5'. "
                          "Parts: " + "; ".join(_MASK_SPECS.values()))
    rv = ex.add_argument_group("ring view (context parallelism)")
    rv.add_argument("--ring", type=_int_in("--ring", 1, _RING_MAX, "one digit per rank in the drawing"), default=d(None),
                    metavar="P", help="draw which of P ranks computes which score blocks at each step of ring "
                    "attention for the example's mask and --tokens (text or json), instead of the walkthrough")
    rv.add_argument("--layout", choices=("contiguous", "zigzag", "documents"), default=d(None),
                    help="how --ring cuts the sequence (default: zigzag when causal, else contiguous; documents: "
                         "the balanced split of --mask documents:...)")
    out = ex.add_argument_group("output")
    out.add_argument("--lang", choices=("en", "zh"), default=d("en"), help="language (default en; png labels are English)")
    out.add_argument("--format", choices=FORMATS, default=d("text"))
    out.add_argument("--out", default=d(None), help="write to this file instead of stdout (needed for html/png; - = stdout)")
    out.add_argument("--values", dest="values", action="store_true", default=d(True), help="print numbers (default; text/json/markdown)")
    out.add_argument("--no-values", dest="values", action="store_false", default=d(True), help="shapes only")
    out.add_argument("--per-head", action="store_true", default=d(False), help="also run the per-head reference and compare (text/json/markdown)")
    out.add_argument("--cost", action="store_true", default=d(False), help="FLOPs and bytes of every step (text/json/markdown)")
    out.add_argument("--quiet", action="store_true", default=d(False),
                     help="no progress on stderr (shown only in a terminal, for loading a model and building a page)")
    real = ex.add_argument_group("real model")
    real.add_argument("--model", default=d(None), metavar="NAME|DIR",
                      help="explain a pretrained model's heads: minilm, smollm2, or a directory transformers loads")
    real.add_argument("--text", default=d(None), help="the sentence to run through --model")
    real.add_argument("sentence", nargs="*", default=d([]), metavar="SENTENCE",
                      help="the sentence, without --text: multihead explain --model minilm \"The cat sat.\"")
    real.add_argument("--layer", type=_non_negative("--layer"), default=d(None), help="layer to show (--model; html/png default: the most labelled layer)")
    real.add_argument("--head", type=_non_negative("--head"), default=d(None), help="head to show (--model)")
    real.add_argument("--token", type=_non_negative("--token"), default=d(None),
                      help="query token: the walkthrough of --layer (default 0) for this token (--model)")
    real.add_argument("--neuron", action="store_true", default=d(False),
                      help="the neuron view of --layer, --head (default 0) and --token (default: the last) (--model)")
    dg = sub.add_parser(
        "diagnose", help="find the first wrong step of your own attention module",
        description="Run your module and the definition (MultiHeadAttention with your weights) on probe "
        "inputs and name the first step where yours departs, with the line and why.")
    dg.add_argument("target", metavar="FILE.py:Class", help="your module: a class, a factory or an instance")
    dg.add_argument("--init", action="append", default=d([]), metavar="NAME=VALUE", help="an argument of Class(...)")
    dg.add_argument("--arg", action="append", default=d([]), metavar="NAME=VALUE", help="an argument forward needs")
    dg.add_argument("--heads", type=_positive("--heads"), default=d(None), help="the head count, if no attribute says it")
    dg.add_argument("--layout", choices=("batch-first", "seq-first"), default=d(None), help="default: tried both")
    dg.add_argument("--lang", choices=("en", "zh"), default=d("en"))
    dg.add_argument("--format", choices=("text", "json", "html"), default=d("text"))
    dg.add_argument("--out", default=d(None), help="write to this file instead of stdout")
    dg.add_argument("--check", action="store_true", default=d(False), help="exit 1 when a step is wrong (for CI)")
    return parser


def _diagnose(args, stdout) -> int:
    """``multihead diagnose``: the report, exit 0 (with ``--check``: 1 when a step is wrong)."""
    from .explain import check_out
    from .diagnosis import diagnose
    from .diagnosis.load import load_module, parse_assignments

    out = check_out(args.out, stdout)
    module = load_module(args.target, parse_assignments(args.init, "--init"))
    layout = None if args.layout is None else args.layout == "batch-first"
    d = diagnose(module, num_heads=args.heads, batch_first=layout, kwargs=parse_assignments(args.arg, "--arg"))
    text = {"text": lambda: d.text(args.lang), "json": lambda: d.to_json(indent=2), "html": lambda: d.html(args.lang)}[args.format]()
    if out is None:
        print(text, file=stdout)
    else:
        out.write_text(text + "\n", encoding="utf-8")
    return 1 if args.check and not d.ok else 0


#: options of the step-by-step walkthrough; --model refuses them
_WALKTHROUGH = ("batch", "tokens", "d_in", "d_out", "heads", "kv_heads", "keys", "causal", "seed", "dropout",
                "mask", "values", "per_head", "cost")
#: options of --model alone
_MODEL = ("text", "layer", "head", "token", "neuron")
#: flags the CLI itself consumes: the positional sentence becomes --text, --quiet silences progress
_CLI_ONLY = ("sentence", "quiet")
#: what html and png do not show
_TEXT_ONLY = ("values", "per_head", "cost")


def _flag(dest: str, args) -> str:
    if dest == "causal":
        return "--causal" if args.causal else "--no-causal"
    if dest == "values":
        return "--values" if args.values else "--no-values"
    return "--" + dest.replace("_", "-")


def _sentence(args, given: set) -> None:
    """The positional sentence becomes ``--text`` (its words joined by spaces, so quotes are optional)."""
    words = getattr(args, "sentence", None) or []
    if not words:
        return
    sentence = " ".join(words)
    if args.model is None:
        raise UsageError(f"unrecognized arguments: {sentence}; a sentence goes with a pretrained model: "
                         f"multihead explain --model minilm \"{sentence}\"")
    if "text" in given:
        raise UsageError(f"the sentence is given twice (--text {args.text!r} and {sentence!r}); give one")
    args.text = sentence
    given.add("text")


def _check_options(args, given: set) -> None:
    """Refuse, before any work, an option that does not apply to what was asked (rather than
    ignore it) and a size the format cannot show."""
    _sentence(args, given)
    picture = args.format in ("html", "png")
    if args.model is None:
        for dest in _MODEL:
            if dest in given:
                raise UsageError(f"{_flag(dest, args)} applies to a pretrained model: add --model minilm, or drop it")
    else:
        for dest in _WALKTHROUGH:
            if dest in given:
                raise UsageError(f"{_flag(dest, args)} belongs to the step-by-step walkthrough, not to --model; drop it")
        from .explain.models import check_name

        check_name(args.model)
    if picture:
        for dest in _TEXT_ONLY:
            if dest in given:
                raise UsageError(f"{_flag(dest, args)} is shown by --format text, markdown and json, "
                                 f"not by --format {args.format}; drop it")
    if args.format == "png" and args.lang != "en":
        raise UsageError(f"--lang {args.lang}: --format png labels in English only (its font has no CJK glyphs); "
                         "use --format html for the bilingual page")
    if args.model is None:
        _check_sizes(args)


def _check_sizes(args) -> None:
    """The example must fit what ``--format`` shows (:data:`multihead.explain.example.LIMITS`)."""
    limits = LIMITS[args.format]
    sizes = (
        ("--batch", args.batch, MAX_BATCH, "every format shows one batch element at a time"),
        ("--heads", args.heads, MAX_HEADS, "html and png draw a heat map per head"),
        ("--d-in", args.d_in, MAX_FEATURES, "the weights and every step's values are kept; BERT-base's 768 fits"),
        ("--d-out", args.d_out, MAX_FEATURES, "the weights and every step's values are kept; BERT-base's 768 fits"),
        ("--tokens", args.tokens, limits.tokens, limits.why),
        ("--keys", args.keys, limits.tokens, limits.why),
    )
    for flag, value, most, why in sizes:
        if value is not None and value > most:
            shows = f"--format {args.format} shows" if flag in ("--tokens", "--keys") else "the walkthrough shows"
            raise UsageError(f"{flag} {value} is more than {shows}: at most {most} ({why}); "
                             "see multihead explain --help")
    keys = args.tokens if args.keys is None else args.keys
    scores = args.batch * args.heads * args.tokens * keys
    if scores > limits.scores:
        of_keys = f"--keys {args.keys}" if args.keys is not None else f"{keys} keys"
        raise UsageError(
            f"--batch {args.batch} x --heads {args.heads} x --tokens {args.tokens} x {of_keys} = {scores:,} "
            f"attention scores per step, more than --format {args.format} shows: at most {limits.scores:,} "
            f"({limits.why}); lower one of them"
        )


#: the ExampleConfig field each walkthrough flag sets (the flag is "--" + the name, "_" as "-")
_EXAMPLE_FIELDS = ("batch", "tokens", "d_in", "d_out", "heads", "kv_heads", "keys", "causal", "seed", "dropout", "mask")
_FLAGS = {name: "--" + name.replace("_", "-") for name in _EXAMPLE_FIELDS}


def _typed(args) -> Options:
    """The :class:`Options` of checked ``args``: the walkthrough's flags become the example's
    config (the heads rule named by its flags), every other flag the option of the same name."""
    example = ExampleConfig()
    if args.model is None:
        check_heads(args.heads, args.d_out, args.kv_heads, names=_FLAGS)
        values = {name: getattr(args, name) for name in _EXAMPLE_FIELDS}
        values["mask"] = tuple(values["mask"] or ())  # --mask may be repeated
        keys = args.tokens if args.keys is None else args.keys
        parse_mask(values["mask"], tokens=args.tokens, keys=keys, heads=args.heads, name="--mask")  # names the flag
        example = ExampleConfig(**values)
    given = {f.name: getattr(args, f.name) for f in fields(Options) if f.name != "example" and hasattr(args, f.name)}
    return Options(**given, example=example)


def parse_options(argv: Sequence[str]) -> Options:
    """The typed :class:`Options` of ``multihead explain`` arguments (``argv`` without the
    command), every option checked as :func:`main` checks it (UsageError / ValueError)."""
    full = ["explain", *argv]
    args = build_parser().parse_args(full)
    _check_options(args, set(vars(build_parser(defaults=False).parse_args(full))))
    return _typed(args)


def _explain(options: Options, stdout) -> int:
    command: object
    if options.model is not None and options.format in ("html", "png"):
        from .explain.real_model import command_visual as command
    elif options.model is not None:
        from .explain.real_model import command
    elif options.format in ("html", "png"):
        from .explain.visual import command
    else:
        from .explain.walkthrough import command
    return command(options, stdout)  # type: ignore[operator]


def main(argv: Optional[Sequence[str]] = None, *, stdout=None, stderr=None) -> int:
    stdout = sys.stdout if stdout is None else stdout
    stderr = sys.stderr if stderr is None else stderr
    argv = sys.argv[1:] if argv is None else list(argv)
    caught: list = []
    try:
        args = build_parser().parse_args(argv)
        if args.version:
            print(f"multihead {_version()}", file=stdout)
            return 0
        if args.command is None:
            raise UsageError("choose a command: multihead explain or multihead diagnose (see multihead --help)")
        if args.command == "diagnose":
            return _diagnose(args, stdout)
        given = set(vars(build_parser(defaults=False).parse_args(argv)))
        if "ring" in given or "layout" in given:
            return _ring(args, given, stdout)
        _check_options(args, given)
        options = _typed(args)
        with warnings.catch_warnings(record=True) as caught, _progress.quiet(args.quiet):
            warnings.simplefilter("always", ExplainWarning)
            return _explain(options, stdout)
    except (ValueError, TypeError) as e:  # UsageError is a ValueError
        print(f"multihead: error: {_one_line(e)}", file=stderr)
        return 2
    except SystemExit as e:  # --help exits 0 through argparse
        return int(e.code or 0)
    finally:
        for w in caught:
            if issubclass(w.category, ExplainWarning):
                print(f"multihead: warning: {_one_line(w.message)}", file=stderr)
            else:  # not ours: shown as Python would have
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)


#: flags of the ring view alone (multihead.explain.ring_view), not of Options
_RING_ONLY = ("ring", "layout")
#: walkthrough options the ring view reads: the example's sequence and mask
_RING_READS = (*_RING_ONLY, "tokens", "heads", "causal", "mask", "lang", "format", "out", "quiet")


def _ring(args, given: set, stdout) -> int:
    """``multihead explain --ring P``: the ring's plan for the example's mask, text or json."""
    if "ring" not in given:
        raise UsageError("--layout applies to the ring view: add --ring P, or drop it")
    for dest in sorted(given - set(_RING_READS) - {"command"}):
        raise UsageError(f"{_flag(dest, args)} does not apply to --ring (it draws the ring's plan for --tokens, "
                         "--heads, --causal and --mask); drop it")
    if args.format not in ("text", "json"):
        raise UsageError(f"--ring draws with --format text or json, not {args.format}")
    from . import masks
    from .explain import check_out, write_output
    from .explain.ring_view import RingView

    out = check_out(args.out, stdout)
    part = parse_mask(tuple(args.mask or ()), tokens=args.tokens, keys=args.tokens, heads=args.heads, name="--mask")
    causal = True if args.causal is None else args.causal
    mask = masks.causal() if causal else None
    mask = part if mask is None else (mask if part is None else mask & part)
    view = RingView(args.ring, args.tokens, mask=mask, layout=args.layout, heads=args.heads)
    text = view.text(args.lang) if args.format == "text" else view.to_json()
    write_output(text + "\n", out, stdout)
    return 0


def _one_line(message: object) -> str:
    return " ".join(str(message).split())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
