"""``multihead explain --format html|png``: the walkthrough as a picture.

Two neutral inputs feed both formats, so any source can be drawn:

* a :class:`multihead.Trace` recorded with ``keep_values=True`` (the steps, their shapes, axes,
  patterns, view/copy flags, checks, and values; the config and the backend that ran);
* per-head attention maps, :class:`HeadMaps` (:mod:`.head_maps`), one per batch element (or one
  per layer of a model): the weights (H, Lq, Lk), optionally the scores and the mask, the
  query/key tokens when there are tokens, and a label per head.

A source (the module example here, a pretrained model in :mod:`.real_model`) calls
:func:`prepare` first (argument checks, before any work), then :func:`write` with its trace and
maps. The steps, checks and notes are told in the words of :mod:`.i18n`, as in the text
walkthrough; :mod:`.visual_text` holds only the page's own labels.

``--format html`` writes one self-contained page (inline CSS, JS and SVG; the data as JSON in a
``<script type="application/json">`` block; no network). ``--format png`` writes a grid of
per-head heat maps with matplotlib (the ``viz`` extra).

Legend: B batch, H query heads, Hkv key/value heads, Lq/Lk query/key lengths, D head dim.
"""

from __future__ import annotations

import base64
import json
import math
import re
import struct
from dataclasses import dataclass
from html import escape
from importlib import resources
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from . import UsageError, check_out, write_output
from ..trace import Step, Trace
from . import visual_text as _text
from .options import Options
from .walkthrough import _MAX_COLS, _MAX_ROWS, Walkthrough, _check_text, _num, _pick_indices, step_blocks
from . import walkthrough as _walkthrough
from .. import steps
from .i18n import check_name, describe_step, note_text, step_title, trace_sizes, word
from .visual_svg import axis_sizes, step_kind, step_svg
from .head_maps import AttentionSteps, HeadMaps, attention_steps, head_maps_from_trace

__all__ = ["HeadMaps", "AttentionSteps", "attention_steps", "head_maps_from_trace", "page_data", "weights8", "bits8",
           "render_html", "step_kind", "prepare", "write", "command"]


# ---------------------------------------------------------------------------- data for the page
def _f32(value: float) -> Optional[float]:
    """The shortest decimal that reads back as the same float32 (keeps the JSON small and exact);
    None (JSON null, drawn as a blocked cell) for -inf, inf and NaN, which JSON cannot hold."""
    if not math.isfinite(value):
        return None
    target = struct.unpack("f", struct.pack("f", value))[0]
    for digits in range(6, 10):
        short = float(f"{target:.{digits}g}")
        if struct.unpack("f", struct.pack("f", short))[0] == target:
            return short
    return target


def _floats(t: torch.Tensor) -> Union[list, Optional[float]]:
    """Nested lists of :func:`_f32` values (one value, not a list, for a 0-d tensor)."""
    t = t.detach().to(torch.float32).cpu()
    if t.dim() == 0:
        return _f32(t.item())
    return [_floats(row) for row in t] if t.dim() > 1 else [_f32(v) for v in t.tolist()]


_GROUPS = ("batch", "layer")


def _step_texts(trace: Trace) -> list[dict]:
    """Per step, its title, meaning and note in every language: {"title": {lang: text}, ...}."""
    return [
        {
            "title": {lang: step_title(s, lang) for lang in _text.LANGS},
            "meaning": {lang: describe_step(s, lang, trace_sizes(trace, s)) for lang in _text.LANGS},
            "note": {lang: note_text(s, lang) for lang in _text.LANGS},
        }
        for s in trace.steps
    ]


def _bytes64(values: torch.Tensor) -> str:
    """Base64 of a 1-D uint8 tensor's bytes."""
    return base64.b64encode(bytes(values.tolist())).decode("ascii")


def weights8(w: torch.Tensor) -> str:
    """Weights in [0, 1] (any shape) as base64 of one byte each, round(w · 255), in row-major
    order: what a compact page stores for display (a weight within 1/510 of its value)."""
    return _bytes64((w.detach().float().cpu().clamp(0, 1) * 255).round().to(torch.uint8).flatten())


def bits8(keep: torch.Tensor) -> str:
    """A bool tensor (any shape) as base64 of its bits, eight to a byte, first bit highest."""
    flat = keep.detach().cpu().flatten().to(torch.uint8)
    flat = torch.cat([flat, flat.new_zeros(-len(flat) % 8)]).view(-1, 8)
    return _bytes64((flat * torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)).sum(1).to(torch.uint8))


def _map_data(m: HeadMaps, exact: bool) -> dict:
    """One map's JSON; not ``exact``: its weights as :func:`weights8` and its mask as
    :func:`bits8` ("w8", "k8", with "shape" (H, Lq, Lk)), which the script unpacks on load."""
    out = {
        "title": m.title,
        "q_tokens": list(m.q_tokens) if m.q_tokens is not None else None,
        "k_tokens": list(m.k_tokens) if m.k_tokens is not None else None,
        "head_labels": {k: list(v) for k, v in m.head_labels.items()} if m.head_labels is not None else None,
        "weights": _floats(m.weights) if exact else None,
        "scores": _floats(m.scores) if m.scores is not None else None,
        "keep": m.keep.to(torch.int64).tolist() if m.keep is not None and exact else None,
        "q": _floats(m.q) if m.q is not None else None,
        "k": _floats(m.k) if m.k is not None else None,
        "scale": m.scale,
        "softcap": m.softcap,
        "sink": [float(x) for x in m.sink] if m.sink is not None else None,
    }
    if not exact:
        out.update(shape=list(m.weights.shape), w8=weights8(m.weights),
                   k8=bits8(m.keep) if m.keep is not None else None)
    return out


def page_data(
    trace: Optional[Trace],
    maps: Sequence[HeadMaps],
    *,
    lang: str = "en",
    group: str = "batch",
    start: int = 0,
    head: int = 0,
    exact: Optional[Sequence[int]] = None,
) -> dict:
    """Everything the page's script reads, JSON-ready.

    group: what the maps are one of, for the selector's label: "batch" (one per batch element)
    or "layer" (one per layer of a model). start / head: the map and the head shown first.
    exact: the maps whose weights and mask are written as numbers (None: every map); the others'
    are written compactly (:func:`weights8`, :func:`bits8`), about a tenth of the size, and the
    page's hover says their weights are stored to 1/255.
    """
    if lang not in _text.LANGS:
        raise ValueError(f"lang must be one of {_text.LANGS}, got {lang!r}")
    if not maps and trace is None:
        raise ValueError("maps is empty and there is no trace: pass one HeadMaps per batch element, or a trace")
    if group not in _GROUPS:
        raise ValueError(f"group must be one of {_GROUPS}, got {group!r}")
    if not maps:
        pass  # a trace of a fused backend: the steps and checks, no heat maps
    elif not 0 <= start < len(maps):
        raise ValueError(f"start must index maps (0 to {len(maps) - 1}), got {start}")
    elif not 0 <= head < maps[start].num_heads:
        raise ValueError(f"head must be 0 to {maps[start].num_heads - 1}, got {head}")
    texts = _step_texts(trace) if trace is not None else []
    return {
        "lang": lang,
        "ui": _text.UI,
        "group": group,
        "start": start,
        "head": head,
        "config": dict(trace.config) if trace is not None else {},
        "steps": [{**s.to_dict(), "effect": step_kind(s), **t} for s, t in zip(trace.steps if trace else [], texts)],
        "maps": [_map_data(m, exact is None or i in exact) for i, m in enumerate(maps)],
    }


def _script_json(data: dict) -> str:
    """JSON that cannot close its <script> block: <, > and & are written as \\u escapes."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


# ---------------------------------------------------------------------------- HTML
def _both(key_or_texts, tag: str = "span") -> str:
    """The English and the Chinese text, each in its own element; CSS shows one."""
    texts = {lang: _text.UI[lang][key_or_texts] for lang in _text.LANGS} if isinstance(key_or_texts, str) else key_or_texts
    return "".join(f'<{tag} data-l="{lang}" lang="{lang}">{escape(texts[lang])}</{tag}>' for lang in _text.LANGS)


def _shape(step: Step) -> str:
    return "(" + ", ".join(f"{a}={n}" for a, n in zip(step.axes, step.shape)) + ")" if step.axes else str(tuple(step.shape))


def _block_html(blocks: dict) -> str:
    """One captioned matrix of a step, {lang: :class:`.walkthrough.Block`}, as a table: the
    rows and columns the text walkthrough prints, each number written as the text writes it."""
    b = blocks["en"]
    m = b.matrix.unsqueeze(0) if b.matrix.dim() == 1 else b.matrix
    rows, cols = _pick_indices(m.shape[0], _MAX_ROWS), _pick_indices(m.shape[1], _MAX_COLS)
    out = [f'<table class="values"><caption>{_both({lang: blk.caption for lang, blk in blocks.items()})}</caption>']
    for r in rows:
        if r is None:
            out.append(f'<tr class="gap"><th></th><td colspan="{len(cols)}">⋮</td></tr>')
            continue
        label = _both({lang: f"{blk.row_label}{r}" for lang, blk in blocks.items()})
        cells = "".join("<td>…</td>" if c is None else f"<td>{_num(float(m[r, c]), b.integer)}</td>" for c in cols)
        total = f'<td class="sum">{_num(float(m[r].sum()))}</td>' if b.row_sums else ""
        out.append(f"<tr><th>{label}</th>{cells}{total}</tr>")
    out.append("</table>")
    return "".join(out)


def _values_html(step: Step, w: Walkthrough) -> str:
    """The numbers of ``step`` the text walkthrough prints (:func:`.walkthrough.step_blocks`)."""
    per_lang = {lang: step_blocks(step, w, lang) for lang in _text.LANGS}
    tables = [_block_html({lang: per_lang[lang][i] for lang in _text.LANGS}) for i in range(len(per_lang["en"]))]
    return f'<div class="values">{"".join(tables)}</div>' if tables else ""


def _steps_html(w: Walkthrough) -> str:
    trace = w.trace
    items = []
    for i, (s, texts) in enumerate(zip(trace.steps, _step_texts(trace))):
        kind = step_kind(s)
        pattern = f'<p class="pattern"><span class="k">{_both("pattern")}</span> <code>{escape(s.pattern)}</code></p>' if s.pattern else ""
        note = f'<p class="note">{_both(texts["note"])}</p>' if s.note else ""
        meaning = texts["meaning"]
        meaning_html = f'<p class="meaning">{_both(meaning)}</p>' if any(meaning.values()) else ""
        items.append(
            f'<li class="step {kind}" id="step-{i}" data-step="{escape(s.label, quote=True)}">'
            f'<h3><span class="num">{i + 1}</span> <span class="name">{_both(texts["title"])}</span> '
            f'<span class="badge {kind}">{_both(kind)}</span></h3>'
            f'<p class="shape"><code>{escape(_shape(s))}</code></p>{pattern}{meaning_html}'
            f'{step_svg(s, axis_sizes(trace, s))}{_values_html(s, w)}{note}</li>'
        )
    return "".join(items)


def _checks_html(w: Walkthrough) -> str:
    """Every check of the walkthrough (:attr:`.walkthrough.Walkthrough.checks`, the list the
    text prints), "step: check" in both languages."""
    checks = w.checks
    if not checks:
        return f"<p>{_both('checks_none')}</p>"
    held = sum(c.ok for c in checks)
    rows = "".join(
        f'<li class="{"ok" if c.ok else "fail"}"><span class="mark">{"✓" if c.ok else "✗"}</span> '
        + _both({lang: _check_text(c, w, lang) for lang in _text.LANGS})
        + "</li>"
        for c in checks
    )
    return f'<p class="summary" id="checks-summary">{held}/{len(checks)}</p><ul class="checks">{rows}</ul>'


def as_walkthrough(source: Union[Trace, Walkthrough]) -> Walkthrough:
    """``source`` itself, or the walkthrough of a bare trace: its own checks (no recomputations),
    its output the last step's values (an empty tensor when the trace kept none)."""
    if isinstance(source, Walkthrough):
        return source
    if isinstance(source, Trace):
        last = source.steps[-1].tensor if source.steps else None
        return Walkthrough(None, None, (), source, last if last is not None else torch.empty(0))
    raise TypeError(f"expected a multihead.Trace or a Walkthrough, got {type(source).__name__}")


def _config_html(config: dict) -> str:
    items = "".join(
        f"<li><span>{escape(str(k))}</span> <code>{escape(str(v))}</code></li>" for k, v in config.items() if k != "backend"
    )
    backend = escape(str(config.get("backend", "?")))
    return f'<p class="backend">{_both("backend")}: <code id="backend">{backend}</code></p><ul class="config">{items}</ul>'


def _asset(name: str) -> str:
    return resources.files(__package__).joinpath("assets", name).read_text(encoding="utf-8")


@dataclass(frozen=True)
class Fragment:
    """A section another view gives the page (the neuron view of :mod:`.neuron`, ...).

    id: the section's element id (letters, digits and dashes); title: {lang: heading} for every
    language; html: the section's body, HTML the producer has escaped; script: JavaScript run
    after the page's own (or ""), reading its data from the body's elements.
    """

    id: str
    title: dict
    html: str
    script: str = ""

    def __post_init__(self):
        if not re.fullmatch(r"[a-z][a-z0-9-]*", self.id) or self.id in _PAGE_IDS:
            raise ValueError(f"Fragment id must be lower-case letters, digits and dashes and not one of {_PAGE_IDS}, got {self.id!r}")
        if set(self.title) != set(_text.LANGS):
            raise ValueError(f"Fragment title must map each of {_text.LANGS} to a heading, got keys {sorted(self.title)}")
        if "</script" in self.script.lower():
            raise ValueError("Fragment script must not contain '</script'")


_PAGE_IDS = ("config", "steps", "attention", "model-view", "checks", "reopened")


def _attention_html(maps: Sequence[HeadMaps], group: str, start: int, head: int) -> str:
    selected = lambda i, chosen: " selected" if i == chosen else ""  # noqa: E731
    batch_options = "".join(f'<option value="{b}"{selected(b, start)}>{b}</option>' for b in range(len(maps)))
    head_options = "".join(f'<option value="{h}"{selected(h, head)}>{h}</option>' for h in range(maps[start].num_heads))
    heading = "attention" if group == "batch" else "attention_layer"
    return (
        f'<section id="attention"><h2>{_both(heading)}</h2>'
        f'<p class="map-title" id="map-title">{escape(maps[start].title)}</p>'
        f'<div class="controls">'
        f'<label>{_both(group)} <select id="batch-select">{batch_options}</select></label>'
        f'<label>{_both("head")} <select id="head-select">{head_options}</select></label>'
        f'<span class="head-label" id="head-label"></span></div>'
        f'<p class="hint">{_both("hover")}</p><p class="hint" id="no-scores" hidden>{_both("no_scores")}</p>'
        f'<div class="panels">'
        f'<figure class="panel" id="panel-scores"><figcaption>{_both("scores")}</figcaption><div class="heat" id="heat-scores"></div></figure>'
        f'<figure class="panel" id="panel-mask"><figcaption>{_both("mask")}</figcaption><div class="heat" id="heat-mask"></div></figure>'
        f'<figure class="panel" id="panel-weights"><figcaption>{_both("weights")}</figcaption><div class="heat" id="heat-weights"></div></figure>'
        f"</div>"
        f'<figure class="worked" id="worked" hidden><figcaption>{_both("worked")}</figcaption>'
        f'<p class="hint">{_both("worked_hint")}</p><pre id="worked-text"></pre></figure>'
        f'<h3>{_both("all_heads")}</h3><div class="heads" id="all-heads"></div></section>'
    )


def _model_view_html(maps: Sequence[HeadMaps]) -> str:
    """Every layer x head as a thumbnail (drawn by the script from the weights), bertviz's model view."""
    return (
        f'<section id="model-view"><h2>{_both("model_view")}</h2><p class="intro">{_both("model_view_intro")}</p>'
        f'<div class="mv" id="mv-grid"></div></section>'
    )


def render_html(
    source: Union[Trace, Walkthrough, None],
    maps: Sequence[HeadMaps],
    *,
    lang: str = "en",
    group: str = "batch",
    start: int = 0,
    head: int = 0,
    fragments: Sequence[Fragment] = (),
    source_note: Optional[dict] = None,
    exact: Optional[Sequence[int]] = None,
) -> str:
    """One self-contained HTML page: the steps of ``source`` (a trace, or the walkthrough the text
    formats print, with its numbers and every check of its list), the heat maps of ``maps`` (when any), a layers x heads grid when ``maps`` are the layers of a model, and the
    ``fragments`` other views give (in order, after the heat maps).

    ``source_note``: {lang: text} for every language, shown first, saying where the steps come
    from (a fused call re-run on the reference backend), or None.

    ``maps`` are one per batch element (``group="batch"``) or one per layer of a model
    (``group="layer"``); ``start`` and ``head`` pick what is shown first, ``exact`` the maps whose
    weights are written as numbers, the others compactly (see :func:`page_data`).
    """
    for f in fragments:
        if not isinstance(f, Fragment):
            raise TypeError(f"fragments must be visual.Fragment objects, got {type(f).__name__}")
    if len({f.id for f in fragments}) != len(fragments):
        raise ValueError(f"fragments must have distinct ids, got {[f.id for f in fragments]}")
    w = as_walkthrough(source) if source is not None else None
    trace = w.trace if w is not None else None
    data = page_data(trace, maps, lang=lang, group=group, start=start, head=head, exact=exact)
    title = _text.UI[lang]["title"]
    sections = []
    targets = []
    if source_note is not None:
        if set(source_note) != set(_text.LANGS):
            raise ValueError(f"source_note must map each of {_text.LANGS} to a text, got keys {sorted(source_note)}")
        sections.append(f'<section id="reopened"><h2>{_both("reopened")}</h2><p>{_both(source_note)}</p></section>')
    if w is not None:
        sections.append(f'<section id="config"><h2>{_both("config")}</h2>{_config_html(w.trace.config)}</section>')
        sections.append(
            f'<section id="steps"><h2>{_both("steps")}</h2><p class="intro">{_both("steps_intro")}</p>'
            f'<ol class="steps">{_steps_html(w)}</ol></section>'
        )
        targets.append("steps")
    if maps:
        sections.append(_attention_html(maps, group, start, head))
        targets.append("attention")
        if group == "layer" and len(maps) > 1:
            sections.append(_model_view_html(maps))
            targets.append("model-view")
    for f in fragments:
        sections.append(f'<section id="{f.id}"><h2>{_both(f.title)}</h2>{f.html}</section>')
    if w is not None:
        sections.append(f'<section id="checks"><h2>{_both("checks")}</h2>{_checks_html(w)}</section>')
        targets.append("checks")
    nav = "".join(f'<a href="#{t}">{_both("nav_" + t.replace("-", "_"))}</a>' for t in targets)
    scripts = "".join(f"<script>{f.script}</script>" for f in fragments if f.script)
    return (
        f'<!DOCTYPE html>\n<html lang="{lang}" data-lang="{lang}"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(title)}</title><style>{_asset('walkthrough.css')}</style></head><body>"
        f'<header><h1>{_both("title")}</h1><nav>{nav}</nav><button type="button" id="lang-toggle">'
        f'{_both("lang_button")}</button></header><main>{"".join(sections)}</main>'
        f'<div id="tip" role="tooltip" hidden></div>'
        f'<script type="application/json" id="mh-data">{_script_json(data)}</script>'
        f"<script>{_asset('walkthrough.js')}</script>{scripts}</body></html>\n"
    )


# ---------------------------------------------------------------------------- CLI
def prepare(args: Options, stdout=None) -> Optional[Path]:
    """Check ``--out`` (and matplotlib for png) before any work; returns the output path, or None
    for ``--out -`` (stdout).

    A user mistake raises :class:`UsageError` (one line, exit 2).
    """
    if args.out is None:
        example = "walkthrough.html" if args.format == "html" else "heads.png"
        raise UsageError(f"--format {args.format} writes a file: add --out FILE (for example --out {example}; - for stdout)")
    out = check_out(args.out, stdout, binary=args.format == "png")
    if args.format == "png":
        from .visual_png import require_matplotlib

        require_matplotlib()
    return out


def write(
    args: Options,
    out: Optional[Path],
    trace: Union[Trace, Walkthrough, None],
    maps: Sequence[HeadMaps],
    stdout,
    *,
    group: str = "batch",
    start: int = 0,
    head: int = 0,
    fragments: Sequence[Fragment] = (),
) -> int:
    """Write ``--format html`` (a trace or walkthrough, maps and fragments, see :func:`render_html`) or ``png`` (the heads of
    ``maps[start]``) to ``out`` (from :func:`prepare`; None = stdout)."""
    data: Union[str, bytes]
    if args.format == "html":
        data = render_html(trace, maps, lang=args.lang, group=group, start=start, head=head, fragments=fragments)
    elif args.format == "png":
        from .visual_png import png_bytes

        data = png_bytes(maps[start])
    else:
        raise ValueError(f"format must be 'html' or 'png', got {args.format!r}")
    write_output(data, out, stdout)
    if out is not None:
        print(word("wrote", args.lang, path=out, kib=out.stat().st_size // 1024 + 1), file=stdout)
    return 0


def command(args: Options, stdout) -> int:
    """``multihead explain --format html|png --out FILE`` for the module example; returns the exit code.

    The example is the walkthrough the text formats print (:func:`.walkthrough.example_walkthrough`): the
    same steps, numbers and checks.
    """
    out = prepare(args, stdout)
    w = _walkthrough.example_walkthrough(args.example)
    return write(args, out, w, head_maps_from_trace(w.trace), stdout)
