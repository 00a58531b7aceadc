"""A real model's page (``multihead explain --model --format html``, `explain_model`, notebooks):
every layer's heads as maps labelled with their pattern, the score under the pointer worked out
from the layer's q and k, the neuron view as a section; a long text's page of chosen rows; and
`explain_attentions`, the page of weights any model computed.

Shapes: L tokens, H query heads, D head dim; weights (layers, H, L, L).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from .._progress import progress
from . import models as _models
from . import visual
from .long_input import long_maps, summary_fragment
from .model_text import DEFAULT_TEXT, _or, _t
from .neuron import neuron_fragment, neuron_view
from .notebook import iframe
from .patterns import label_heads, pattern_name, pattern_scores
from .records import LayerRecord, LongRun, RealRun
from .visual import HeadMaps

__all__ = ["default_layer", "layer_maps", "ModelPage", "explain_model", "AttentionsPage", "explain_attentions"]


def default_layer(labels) -> int:
    """The layer with the most labelled heads (the earliest on a tie); ``labels`` from
    :func:`label_heads` of (layers, H) scores."""
    counts = [sum(p is not None for p in heads) for heads in labels]
    return counts.index(max(counts))


def layer_maps(tokens: list[str], weights: torch.Tensor, *, model: str = "minilm", text: str = "",
               lang: str = "en", keep: Optional[torch.Tensor] = None, title: Optional[str] = None,
               layers: Optional[Sequence[LayerRecord]] = None,
               operand_layers: Optional[Sequence[int]] = None) -> list:
    """One :class:`~multihead.explain.visual.HeadMaps` per layer, for the visual formats.

    weights: (layers, H, L, L) from :func:`attention_for_text`; ``tokens`` label both axes; keep:
    (layers, H, L, L) bool, the masks (None: all visible). Each head is labelled with its pattern
    (:func:`label_heads`) and that pattern's score, in English and Chinese; the title names the
    model (``title``, default the registry's name of ``model``), the layer and ``text`` (in ``lang``).

    layers: the run's :class:`~multihead.explain.models.LayerRecord` per layer (``RealRun.layers``),
    or None. With them each map also carries the scaled scores (scale × the q kᵀ multihead
    computed) and their operands, the queries (H, L, D) and the keys per kv head (Hkv, L, D) the
    layer passed to the attention function (after the rotary embedding for a Llama-family model),
    with the scale, so the page works the score under the pointer out by hand. A layer that adds
    a bias to its scores gets no operands (q·k × scale is not its score). A layer that caps its
    scores (softcap) or has sinks carries them, and its scores are the capped ones (what the
    softmax read). operand_layers: the layers whose scores, q and k are embedded (None: every
    layer); the notebook cell embeds only the layer it opens at, which keeps the cell lighter.
    """
    if layers is not None and len(layers) != weights.shape[0]:
        raise ValueError(f"layers has {len(layers)} records but weights have {weights.shape[0]} layers")

    scores = pattern_scores(weights, keep)
    labels = label_heads(scores)
    name = title or (_models.MODELS[model].title if model in _models.MODELS else model)

    def head_label(layer: int, head: int, lang_: str) -> str:
        p = labels[layer][head]
        return pattern_name(p, lang_, tokens) + (f" {float(scores[p.key][layer, head]):.2f}" if p is not None else "")

    def operands(layer: int) -> dict:
        if layers is None:
            return {}
        rec = layers[layer]
        a = rec.attention
        scaled = rec.scores.float() * rec.scale
        extra: dict = {}
        if a is not None and a.softcap is not None:
            scaled = a.softcap * torch.tanh(scaled / a.softcap)
            extra["softcap"] = a.softcap
        if a is not None and a.sinks is not None:
            extra["sink"] = list(a.sinks)
        if rec.bias is not None:
            return {"scores": scaled + rec.bias, **extra}
        if operand_layers is not None and layer not in operand_layers:
            return extra   # the notebook cell: weights only, away from the layer it opens at
        return {"scores": scaled, "q": rec.q.float(), "k": rec.k.float(), "scale": rec.scale, **extra}

    return [
        HeadMaps(
            weights[layer], q_tokens=list(tokens), k_tokens=list(tokens),
            title=_t("layer_title", lang, model=name, layer=layer, text=text) + _role_title(layers, layer, lang),
            keep=None if keep is None or bool(keep[layer].all()) else keep[layer],
            head_labels={lg: [head_label(layer, h, lg) for h in range(weights.shape[1])] for lg in ("en", "zh")},
            **operands(layer),
        )
        for layer in range(weights.shape[0])
    ]


def _role_title(layers: Optional[Sequence[LayerRecord]], layer: int, lang: str) -> str:
    """" · cross-attention (decoder → encoder)" and the like for an encoder-decoder's layers, else ""."""
    if layers is None or layers[layer].role == "self":
        return ""
    return " · " + _t("title_" + layers[layer].role, lang)


def _page_parts(real: RealRun, *, model: str, layer: Optional[int], head: Optional[int], neuron: bool,
                token: Optional[int], lang: str, operand_layers=lambda start: None) -> tuple[list, list, int, int]:
    """``(maps, fragments, layer, head)`` of a real model's page: every layer's maps with the
    operands of the worked score (:func:`layer_maps`), the neuron view as a fragment when asked
    (of ``layer``/``head``, default 0, and ``token``, default the last), and the layer (default
    :func:`default_layer`) and head (default 0) shown first."""
    real.check_indices(layer=layer, head=head, token=token)
    fragments = []
    if neuron:
        view = neuron_view(real, _or(layer, 0), _or(head, 0), _or(token, len(real.tokens) - 1))
        fragments.append(neuron_fragment(view))
    weights = real.weights
    keep = real.keep
    start = default_layer(label_heads(pattern_scores(weights, keep))) if layer is None else layer
    maps = layer_maps(real.tokens, weights, model=model, text=real.text, lang=lang, keep=keep,
                      title=real.info.title, layers=real.layers, operand_layers=operand_layers(start))
    return maps, fragments, start, _or(head, 0)


@dataclass(frozen=True, repr=False)
class ModelPage:
    """A real model's explain page, for Python and notebooks (:func:`explain_model`).

    run: the :class:`~multihead.explain.models.RealRun` shown; page: the whole HTML page (what
    ``multihead explain --model ... --format html`` writes: every layer's q and k for the worked
    score). In Jupyter it displays inline (``_repr_html_``: a lighter page, with the scores, q and k
    and exact weights only for the layer it opens at (the others' weights to 1/255), in a sandboxed ``<iframe srcdoc>``, :mod:`.notebook`, so its CSS and
    language switch stay out of the notebook).
    """

    run: "RealRun | LongRun"
    page: str
    options: dict = field(default_factory=dict, repr=False, compare=False)

    def html(self) -> str:
        """The page, to write to a file."""
        return self.page

    @functools.cached_property
    def notebook_page(self) -> str:
        """The page with the scores, q and k (the worked score's operands) and the exact weights
        of the opening layer only, the other layers' weights one byte each and their masks as
        bits (:func:`.visual.weights8`); a long text's page as it is (it holds one layer's rows)."""
        if isinstance(self.run, LongRun):
            return self.page
        return _render(self.run, light=True, **self.options)

    def _repr_html_(self) -> str:
        return iframe(self.notebook_page, title=f"multihead: {self.run.info.title}")

    def __repr__(self) -> str:
        """One line (the page itself is about a megabyte for a 30-layer model)."""
        info = self.run.info
        return (f"<multihead.ModelPage: {info.title}, {info.layers} layers x {info.heads} heads, "
                f"{len(self.run.tokens)} tokens, a {len(self.page) // 1000:,} kB page; .html(), .run>")


def _render_long(real: LongRun, *, model: str, layer: Optional[int], head: Optional[int], lang: str) -> str:
    """A long text's page: the chosen rows of ``layer`` (default 0) per head, opened at ``head``
    (default 0), and every layer x head's summary (:mod:`.long_input`)."""
    real.check_indices(layer=layer, head=head)
    maps = long_maps(real, _or(layer, 0), model=model, lang=lang)
    return visual.render_html(None, maps, lang=lang, group="layer", start=0, head=_or(head, 0),
                              fragments=[summary_fragment(real)])


def _render(real: RealRun, *, model: str, layer: Optional[int], head: Optional[int], neuron: bool,
            token: Optional[int], lang: str, light: bool = False) -> str:
    maps, fragments, start, first = _page_parts(real, model=model, layer=layer, head=head, neuron=neuron,
                                                token=token, lang=lang,
                                                operand_layers=(lambda s: [s]) if light else (lambda s: None))
    return visual.render_html(None, maps, lang=lang, group="layer", start=start, head=first, fragments=fragments,
                              exact=[start] if light else None)


def explain_model(model: Any, text: str = DEFAULT_TEXT, *, layer: Optional[int] = None,
                  head: Optional[int] = None, neuron: bool = False, token: Optional[int] = None,
                  lang: str = "en", rows: Optional[list[int]] = None) -> ModelPage:
    """``model`` on ``text``, as the page ``multihead explain --model`` draws: every layer x head,
    the worked score on hover, and with ``neuron=True`` the neuron view of ``layer``/``head``
    (default 0) and ``token`` (default the last) as a section.

    A text past :data:`~.models.MAX_TOKENS` tokens (up to the model's
    :attr:`~.models.RealModel.max_tokens`) gets the page of :mod:`.long_input`: the query
    ``rows`` (default the last few) of ``layer`` (default 0), their weights recomputed from the
    log-sum-exp in O(L) memory, and every head's summary; ``neuron`` is refused there.

    ``model``: ``"minilm"``, ``"smollm2"``, a directory transformers loads, or a
    ``(model, tokenizer)`` pair already loaded (e.g. by
    :func:`multihead.integrations.transformers.load`; run in eval mode on multihead's recording
    attention, its own attention implementation restored afterwards).

    Raises:
        ValueError: unknown model, empty or too long text, an index out of range, an unknown lang.
        TypeError: an index that is not an int, or ``neuron`` not a bool.
        ImportError: the ``hf`` extra or the model's package is missing.
    """
    if lang not in ("en", "zh"):
        raise ValueError(f"lang must be 'en' or 'zh', got {lang!r}")
    if not isinstance(neuron, bool):
        raise TypeError(f"neuron must be True or False, got {type(neuron).__name__}")
    if token is not None and not neuron:
        raise ValueError("token picks the query of the neuron view: pass neuron=True with it")
    if isinstance(model, tuple) and len(model) == 2:
        loaded = _models.wrap(*model)
        model = loaded.name
    elif isinstance(model, str):
        loaded = _models.load(model)
    else:
        raise TypeError(f"model must be a name ({', '.join(_models.MODELS)}), a directory, or a (model, tokenizer) "
                        f"pair, got {type(model).__name__}")
    _, ids = loaded.tokenize(text)  # a too long text is refused before the forward pass
    for name, value, count, what in (("layer", layer, loaded.info.layers, "layers"),
                                     ("head", head, loaded.info.heads, "heads")):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if not 0 <= value < count:
            raise ValueError(f"{name} {value} is out of range: {loaded.title} has {what} 0-{count - 1}")
    if loaded.is_long(ids):
        if neuron:
            raise ValueError(f"neuron=True draws up to {_models.MAX_TOKENS} tokens; this text has {ids.shape[1]}: "
                             "pass rows=[...] to choose the query rows shown, or shorten the text")
        if token is not None and (isinstance(token, bool) or not isinstance(token, int)):
            raise TypeError(f"token must be an int, got {type(token).__name__}")
        with progress(f"explaining {loaded.title} on {ids.shape[1]} tokens", total=2) as bar:
            long = loaded.run_rows(text, rows)
            bar.update(note="page")
            page = _render_long(long, model=model, layer=layer, head=head, lang=lang)
            bar.update()
        return ModelPage(long, page, dict(model=model, layer=layer, head=head, lang=lang))
    if rows is not None:
        raise ValueError(f"rows picks the query rows of a text past {_models.MAX_TOKENS} tokens; this one has "
                         f"{ids.shape[1]}, whose page shows every row: drop rows")
    options: dict = dict(model=model, layer=layer, head=head, neuron=neuron, token=token, lang=lang)
    with progress(f"explaining {loaded.title}", total=2) as bar:
        real = loaded.run(text)
        bar.update(note="page")
        page = _render(real, **options)
        bar.update()
    return ModelPage(real, page, options)

@dataclass(frozen=True, repr=False)
class AttentionsPage:
    """The page of attention weights some model computed (:func:`explain_attentions`): every
    layer x head with its pattern label, without the worked scores (weights carry no q and k)."""

    tokens: tuple[str, ...]
    weights: torch.Tensor   # (layers, H, L, L)
    page: str

    def html(self) -> str:
        """The page, to write to a file."""
        return self.page

    def _repr_html_(self) -> str:
        return iframe(self.page, title="multihead: attention weights")

    def __repr__(self) -> str:
        layers, heads, L = self.weights.shape[:3]
        return (f"<multihead.AttentionsPage: {layers} layers x {heads} heads, {L} tokens, "
                f"a {len(self.page) // 1000:,} kB page; .html()>")


def explain_attentions(attentions: Any, tokens: Sequence[str], *, title: str = "attention",
                       layer: Optional[int] = None, head: Optional[int] = None, lang: str = "en") -> AttentionsPage:
    """The page of ``outputs.attentions`` (a transformers model run with ``output_attentions=True``,
    any attention implementation) for ``tokens``, as bertviz's ``head_view(attention, tokens)``
    takes them: every layer x head, labelled with its pattern.

    Args:
        attentions: one (1, H, L, L) tensor per layer (``outputs.attentions``), or a
            (layers, H, L, L) tensor; batch element 0 is shown.
        tokens: the L tokens (``tokenizer.convert_ids_to_tokens(ids[0])``); space markers are
            drawn as ``␣``.
        layer: the layer shown first (default: the one with the most labelled heads).
        head: the head shown first (default 0).

    A key whose weight is 0 in every row of a head is still drawn as visible: the weights do not
    say what the mask was (explain_model, which records the mask, does).
    """
    if lang not in ("en", "zh"):
        raise ValueError(f"lang must be 'en' or 'zh', got {lang!r}")
    if isinstance(attentions, (list, tuple)):
        if not attentions or not all(isinstance(a, torch.Tensor) and a.dim() == 4 for a in attentions):
            raise TypeError("attentions must be outputs.attentions: a tuple of (B, H, L, L) tensors, one per layer")
        weights = torch.stack([a[0] for a in attentions])
    elif isinstance(attentions, torch.Tensor) and attentions.dim() == 4:
        weights = attentions
    else:
        raise TypeError(f"attentions must be outputs.attentions (a tuple of (B, H, L, L) tensors) or a "
                        f"(layers, H, L, L) tensor, got {type(attentions).__name__}")
    weights = weights.detach().float().cpu()
    L = weights.shape[-1]
    tokens = [_models.shown(str(t)) for t in tokens]
    if weights.shape[-2] != L or len(tokens) != L:
        raise ValueError(f"attentions are {tuple(weights.shape[-2:])} per head but tokens has {len(tokens)}; "
                         "pass the tokens of the same input")
    for name, value, count in (("layer", layer, weights.shape[0]), ("head", head, weights.shape[1])):
        if value is not None and not (isinstance(value, int) and 0 <= value < count):
            raise ValueError(f"{name} {value!r} is out of range: the attentions have {count} {name}s (0-{count - 1})")
    maps = layer_maps(tokens, weights, model=title, lang=lang, title=title)
    start = default_layer(label_heads(pattern_scores(weights, None))) if layer is None else layer
    page = visual.render_html(None, maps, lang=lang, group="layer", start=start, head=_or(head, 0))
    return AttentionsPage(tuple(tokens), weights, page)
