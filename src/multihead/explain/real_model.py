"""``multihead explain --model NAME|DIR``: what the heads of a real, trained model do on a sentence.

The model (:mod:`.models`: ``minilm``, a 6-layer BERT encoder; ``smollm2``, a 30-layer Llama
decoder with grouped-query attention and RoPE; or a directory transformers loads) runs in
transformers with its attention computed by :func:`multihead.attention`, every call recorded.
What is shown:

* the overview (default): the model's kind, read from the masks its layers passed (a decoder
  masks causally), its heads and key/value heads (which query heads share which kv head), its
  rotary embedding, and every head's pattern label (:mod:`.patterns`: computed from the weights
  and the mask with stated thresholds), with heat maps of the strongest heads;
* ``--layer L`` / ``--head H``: the heat maps of that layer / head;
* ``--token T``: the walkthrough of one real layer (``--layer``, default 0) for query token T of
  head ``--head`` (default 0): project, split, rotary, scores, scale, mask, softmax, weights × V,
  merge, output, with the model's sizes and the real numbers of the sentence;
* ``--neuron``: the neuron view of ``--layer`` (default 0), ``--head`` (default 0) and
  ``--token`` (default: the last token), :mod:`.neuron`; ``--format html`` writes it as a page.

This module is the command (:func:`command` for text, :func:`command_visual` for ``--format html|png``)
and the API's one import path; the pieces live by concept: the text report in :mod:`.model_text`,
one real layer's walkthrough in :mod:`.model_layer`, the page (:func:`explain_model`,
:func:`explain_attentions`) in :mod:`.model_page`, the run in :mod:`.recording` and
:mod:`.records`, loading in :mod:`.models`.

Reusable pieces: :func:`attention_for_text` -- ``(tokens, weights (layers, H, L, L))``;
:func:`layer_maps` -- one :class:`~multihead.explain.visual.HeadMaps` per layer for
``--format html|png`` (:func:`command_visual`), opened at :func:`default_layer` (the layer with the
most labelled heads, the earliest on a tie).
"""

from __future__ import annotations

import importlib.util  # noqa: F401  (the tests patch importlib.util.find_spec through this module)

import torch

from .._progress import progress
from . import UsageError, check_out, visual, write_output
from . import models as _models
from .i18n import word
from .long_input import long_text
from .model_layer import layer_trace, layer_walkthrough
from .model_page import AttentionsPage, ModelPage, _page_parts, _render_long, default_layer, explain_attentions, \
    explain_model, layer_maps
from .model_text import (DEFAULT_TEXT, _grid, _head_title, _or, _scores_and_labels, _scores_line, _strongest, _t,
                         _token_list, display_width, model_summary, render_heatmap)
from .neuron import neuron_view, render_text
from .patterns import PATTERNS, label_heads, pattern_name, pattern_scores
from .records import LongRun, RealRun

__all__ = [
    "PATTERNS",
    "DEFAULT_TEXT",
    "attention_for_text",
    "pattern_scores",
    "label_heads",
    "render_heatmap",
    "default_layer",
    "layer_maps",
    "layer_trace",
    "layer_walkthrough",
    "display_width",
    "model_summary",
    "command",
    "command_visual",
    "ModelPage",
    "explain_model",
    "AttentionsPage",
    "explain_attentions",
]


def attention_for_text(text: str, *, model: str = "minilm") -> tuple[list[str], torch.Tensor]:
    """Tokens and attention weights of ``model`` (a name of :data:`.models.MODELS` or a directory)
    on ``text``.

    Returns:
        ``(tokens, weights)``: the L tokens (with the model's special tokens, e.g. [CLS] and
        [SEP]), and weights (layers, H, L, L), float32 on the CPU; ``weights[l, h, i, j]`` is how
        much token i attends to token j in head h of layer l (rows sum to 1).

    Raises:
        ValueError: unknown ``model``, empty or too long ``text``.
        ImportError: the ``hf`` extra or the model's package is missing.
    """
    real = _models.load(model).run(text)
    return real.tokens, real.weights


def _real(args) -> "RealRun | LongRun":
    """The run of ``args.text`` (default :data:`DEFAULT_TEXT`) through ``args.model``, every index
    option checked against the model and the sentence (UsageError; ImportError as UsageError);
    a :class:`~.models.LongRun` of the ``--token`` row (default the last few) past
    :data:`~.models.MAX_TOKENS` tokens."""
    text = DEFAULT_TEXT if args.text is None else args.text
    if not text.strip():
        raise UsageError("--text is empty; give a sentence, e.g. --text \"The cat sat on the mat\"")
    try:
        model = _models.load(args.model)
    except ImportError as e:
        raise UsageError(str(e)) from None
    _, ids = model.tokenize(text)  # a too long text is refused before the forward pass
    for flag, value, count, what in (("--layer", args.layer, model.info.layers, "layers"),
                                     ("--head", args.head, model.info.heads, "heads")):
        if value is not None and not 0 <= value < count:
            raise UsageError(f"{flag} {value} is out of range: {model.title} has {what} 0-{count - 1}")
    token = getattr(args, "token", None)
    if model.is_long(ids):
        if getattr(args, "neuron", False):
            raise UsageError(f"--neuron draws up to {_models.MAX_TOKENS} tokens; this text has {ids.shape[1]}: drop "
                             "--neuron (--token T then picks the query row shown) or shorten the text")
        with progress(f"running {model.title} on {ids.shape[1]} tokens"):
            return model.run_rows(text, None if token is None else [token])
    with progress(f"running {model.title}"):
        real = model.run(text)
    real.check_indices(token=token)
    return real


def command(args, stdout) -> int:
    """``multihead explain --model M [--text T] [--layer L] [--head H] [--token T | --neuron]
    [--lang zh] [--out FILE]``: the text report (``--format html|png`` go to :func:`command_visual`)."""
    lang = getattr(args, "lang", "en")
    fmt = getattr(args, "format", "text")
    if fmt != "text":
        raise UsageError(f"--model writes text, html or png; drop --format {fmt}")
    out = check_out(getattr(args, "out", None))
    real = _real(args)
    if isinstance(real, LongRun):
        write_output("\n".join(long_text(real, args.layer, args.head, lang)) + "\n", out, stdout)
        return 0
    if getattr(args, "neuron", False):
        view = neuron_view(real, _or(args.layer, 0), _or(args.head, 0), _or(args.token, len(real.tokens) - 1))
        write_output(render_text(view, lang), out, stdout)
        return 0
    if getattr(args, "token", None) is not None:
        write_output("\n".join(layer_walkthrough(real, _or(args.layer, 0), _or(args.head, 0), args.token, lang))
                     + "\n", out, stdout)
        return 0
    info, tokens = real.info, real.tokens
    scores, labels = _scores_and_labels(real)
    keep = real.keep
    layers = list(range(info.layers)) if args.layer is None else [args.layer]
    heads = list(range(info.heads)) if args.head is None else [args.head]

    lines = [*_t("header", lang, model=info.title, layers=info.layers, heads=info.heads, n=len(tokens)).split("\n"),
             *model_summary(real, lang), _t("tokens", lang), *_token_list(tokens), ""]
    if args.head is None:
        lines += _grid(scores, labels, layers, info.heads, lang, tokens) + [""]
    if args.layer is None and args.head is None:
        found = _strongest(scores, labels, layers, heads)
        lines.append(_t("found", lang) if found else _t("none_found", lang))
        for p, l, h, score in found:
            lines.append("  " + _t("score_line", lang, label=pattern_name(p, lang, tokens), layer=l, head=h, score=score))
        shown = [(l, h) for _, l, h, _ in found]
    else:
        shown = [(l, h) for l in layers for h in heads]
    if shown:
        lines += ([] if lines[-1] == "" else [""]) + _t("shades", lang).split("\n")
    weights = real.weights
    for l, h in shown:
        lines.append("")
        lines += render_heatmap(tokens, weights[l, h], _head_title(l, h, labels, scores, lang, tokens),
                                top=3 if len(shown) == 1 else 2, keep=keep[l, h])
        lines.append(_scores_line(l, h, scores, lang))
    write_output("\n".join(lines) + "\n", out, stdout)
    return 0


def command_visual(args, stdout) -> int:
    """``multihead explain --model M [--text T] [--layer L] --format html|png --out FILE``.

    html: one page with every layer's heads (a layer selector), opened at ``--layer`` (default
    :func:`default_layer`) and ``--head`` (default 0), the score under the pointer worked out
    from the layer's q and k; with ``--neuron``, the neuron view of ``--layer``/``--head``
    (default 0) and ``--token`` (default the last) as a section of it. png: the heads of that
    layer in a grid; ``--head`` is refused there, since the grid shows every head.
    """
    out = visual.prepare(args, stdout)
    neuron = getattr(args, "neuron", False)
    if args.format == "png" and (args.head is not None or neuron):
        flag = "--neuron" if neuron else "--head"
        raise UsageError(f"--format png draws every head of the layer; drop {flag} (or use --format html)")
    real = _real(args)
    if getattr(args, "token", None) is not None and not neuron and not isinstance(real, LongRun):
        raise UsageError("--token without --neuron is the layer walkthrough, which --format text shows; "
                         "drop --format or add --neuron")
    if isinstance(real, LongRun):
        if args.format == "png":
            raise UsageError(f"--format png draws every cell of (L, L) maps, up to {_models.MAX_TOKENS} tokens; this "
                             f"text has {len(real.tokens)}: use --format html or text")
        page = _render_long(real, model=args.model, layer=args.layer, head=args.head, lang=args.lang)
        write_output(page, out, stdout)
        if out is not None:
            print(word("wrote", args.lang, path=out, kib=out.stat().st_size // 1024 + 1), file=stdout)
        return 0
    with progress(f"drawing {real.info.title}'s {args.format}", total=2) as bar:
        maps, fragments, layer, head = _page_parts(real, model=args.model, layer=args.layer, head=args.head,
                                                   neuron=neuron, token=getattr(args, "token", None), lang=args.lang)
        bar.update()
        written = visual.write(args, out, None, maps, stdout, group="layer", start=layer, head=head,
                               fragments=fragments)
        bar.update()
    return written
