"""The neuron view: one attention score worked out from the vectors, for a real model.

For a chosen layer, head and query token i it shows the query vector q_i, every key vector k_j
the head may read (after the rotary embedding for a Llama-family model, with the model's own
cos/sin), their elementwise product q_i ⊙ k_j and its sum q_i · k_j = the score, the scale, the
mask, the softmax, and the weighted values w_ij v_j whose sum is the head's output for token i::

    from multihead.explain import models, neuron
    run = models.load("smollm2").run("The cat sat on the mat.")
    view = neuron.neuron_view(run, layer=3, head=4, token=5)
    print(neuron.render_text(view))              # or neuron_html(view): a self-contained <div>

The vectors are the ones the model passed to multihead's attention function (recorded by
:meth:`multihead.explain.models.RealModel.run`); everything derived from them here is computed in
float64, so the view shows the exact arithmetic of those float32 vectors. ``model_scores`` and
``model_weights`` keep what multihead computed in the model's own float32 run, for comparison.

Shapes: Lk keys, D head dim, Dv value dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from html import escape
from typing import Any, Optional

import torch

from .i18n import word
from .layer_attention import scale_words
from .records import RealRun
from .visual import Fragment

__all__ = ["Rotary", "NeuronView", "neuron_view", "render_text", "neuron_html", "neuron_fragment", "neuron_page",
           "SHOWN_DIMS"]

#: head dims written out per vector in the text view (the rest are summed as one term)
SHOWN_DIMS = 6


@dataclass(frozen=True)
class Rotary:
    """The rotary step of the query and the keys, with the model's own tables.

    q_before (D,), k_before (Lk, D): the projections before RoPE; cos, sin (Lk, D): the model's
    tables at positions 0..Lk-1 (row i is the query's position). After it: q = q_before * cos_i +
    rotate_half(q_before) * sin_i, rotate_half(x) = (-x[D/2:], x[:D/2]).
    """

    q_before: torch.Tensor
    k_before: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


@dataclass(frozen=True)
class NeuronView:
    """One query of one head, term by term (float64 unless said otherwise).

    q (D,): query ``token`` of ``head``; k (Lk, D) the keys of ``kv_head``; products (Lk, D) =
    q * k; dots (Lk,) = products.sum(-1) = q · k_j; scaled (Lk,) = scale * dots (+ bias);
    capped (Lk,) = softcap·tanh(scaled / softcap) when the layer caps its scores (Gemma 2), else None;
    keep (Lk,) bool (True = visible); weights (Lk,) = softmax of the (capped) scaled scores over
    the visible keys (0 elsewhere), with exp(sink) in the denominator when the layer has a sink
    logit for this head (gpt-oss: the weights then sum to 1 - sink_mass); v (Lk, Dv); weighted (Lk, Dv) = weights[:, None] * v; out (Dv,) = weighted.sum(0).
    model_scores / model_weights (Lk,): multihead's float32 q·k (before the scale) and weights
    in the model's run. kv_group: the query heads that share ``kv_head``.
    """

    model: str
    layer: int
    head: int
    kv_head: int
    kv_group: tuple[int, ...]
    token: int
    tokens: tuple[str, ...]
    q: torch.Tensor
    k: torch.Tensor
    products: torch.Tensor
    dots: torch.Tensor
    scale: float
    bias: Optional[torch.Tensor]
    scaled: torch.Tensor
    keep: torch.Tensor
    weights: torch.Tensor
    v: torch.Tensor
    weighted: torch.Tensor
    out: torch.Tensor
    model_scores: torch.Tensor
    model_weights: torch.Tensor
    rotary: Optional[Rotary] = None
    softcap: Optional[float] = None
    capped: Optional[torch.Tensor] = None
    sink: Optional[float] = None
    attention: Any = None
    role: str = "self"
    rope_not_shown: bool = False   # the model rotates q and k, but its projections were not recorded

    @property
    def sink_mass(self) -> float:
        """The part of the row the sink takes: 1 - Σ_j w_j (0 without a sink)."""
        return 0.0 if self.sink is None else 1.0 - float(self.weights.sum())

    @property
    def head_dim(self) -> int:
        return self.q.shape[0]


def neuron_view(run: RealRun, layer: int, head: int, token: int) -> NeuronView:
    """The :class:`NeuronView` of query ``token`` in ``head`` of ``layer`` of ``run``.

    Raises:
        TypeError: ``run`` is not a :class:`~multihead.explain.models.RealRun`, or an index is not an int.
        ValueError: ``layer``, ``head`` or ``token`` out of range (the message names the option
            and the range).
    """
    if not isinstance(run, RealRun):
        raise TypeError(f"run must be a RealRun (models.load(name).run(text)), got {type(run).__name__}")
    run.check_indices(layer=layer, head=head, token=token)
    rec = run.layers[layer]
    H, Hkv = rec.q.shape[0], rec.k.shape[0]
    kv = head // (H // Hkv)
    q = rec.q[head, token].double()
    k = rec.k[kv].double()
    v = rec.v[kv].double()
    keep = rec.keep[head, token].clone()
    products = q[None, :] * k
    dots = products.sum(-1)
    scaled = dots * rec.scale
    bias = None
    if rec.bias is not None:
        bias = rec.bias[head, token].double()
        scaled = scaled + bias
    a = rec.attention
    capped = None
    if a is not None and a.softcap is not None:
        capped = a.softcap * torch.tanh(scaled / a.softcap)
    final = scaled if capped is None else capped
    sink = None if a is None or a.sinks is None else float(a.sinks[head])
    weights = torch.zeros_like(scaled)
    if keep.any():
        row = final[keep]
        if sink is not None:
            row = torch.cat([row, row.new_tensor([sink])])
        weights[keep] = row.softmax(-1)[: int(keep.sum())]
    weighted = weights[:, None] * v
    rotary = None
    before = rec.q_normed if rec.q_normed is not None else rec.q_proj
    k_before = rec.k_normed if rec.k_normed is not None else rec.k_proj
    if rec.cos is not None and rec.sin is not None and before is not None and k_before is not None:
        rotary = Rotary(before[head, token].double(), k_before[kv].double(), rec.cos.double(), rec.sin.double())
    g = H // Hkv
    return NeuronView(
        model=run.info.title, layer=layer, head=head, kv_head=kv, kv_group=tuple(range(kv * g, (kv + 1) * g)),
        token=token, tokens=tuple(run.tokens), q=q, k=k, products=products, dots=dots, scale=rec.scale,
        bias=bias, scaled=scaled, keep=keep, weights=weights, v=v, weighted=weighted, out=weighted.sum(0),
        model_scores=rec.scores[head, token].float(), model_weights=rec.weights[head, token].float(),
        rotary=rotary, softcap=None if a is None else a.softcap, capped=capped, sink=sink, attention=a, role=rec.role,
        rope_not_shown=rotary is None and run.info.rope is not None,
    )


# ---------------------------------------------------------------------------- words


def _w(key: str, lang: str, **kw: Any) -> str:
    if lang not in ("en", "zh"):
        raise ValueError(f"lang must be 'en' or 'zh', got {lang!r}")
    return word("neuron." + key, lang, **kw)


def _group_line(view: NeuronView, lang: str) -> str:
    if len(view.kv_group) > 1:
        return _w("gqa", lang, head=view.head, kv=view.kv_head, group=", ".join(map(str, view.kv_group)))
    return _w("mha", lang, head=view.head, kv=view.kv_head)


# ---------------------------------------------------------------------------- text
def _scale_text(view: NeuronView, lang: str) -> str:
    """The layer's scale and where it is applied (:func:`.layer_attention.scale_words`)."""
    if view.attention is None:
        return _w("scale_plain", lang, scale=view.scale)
    return scale_words(view.attention, lang)


def _num(x: float) -> str:
    return f"{x:+7.3f}"


def render_text(view: NeuronView, lang: str = "en", *, dims: int = SHOWN_DIMS) -> str:
    """The view as text lines (at most 100 columns). The head dims written out are the ``dims``
    that contribute most to the scores (largest sum over the visible keys of |q_d k_jd|); for each
    visible key: those products q_d k_jd, the sum of the other products, and their total q·k_j;
    then the scaled score and the weight, and the first dims of the output."""
    n = min(dims, view.head_dim)
    rest = view.head_dim - n
    tok = view.tokens[view.token]
    visible = view.keep.nonzero().flatten()
    shown = view.products[visible].abs().sum(0).topk(n).indices.sort().values.tolist()
    others = [d for d in range(view.head_dim) if d not in shown]

    def row(label: str, values: torch.Tensor) -> str:
        return f"  {label:<13} " + " ".join(_num(x) for x in values[shown].tolist())

    lines = [_w("title", lang, model=view.model, layer=view.layer, head=view.head, token=view.token, tok=tok),
             _group_line(view, lang), "",
             *_w("dims", lang, D=view.head_dim, n=n, rest=rest).split("\n"),
             f"  {'':<13} " + " ".join(f"{'d' + str(d):>7}" for d in shown) + (f" {_w('others', lang):>8}" if rest else "")]
    a = view.attention
    if view.role == "cross":
        lines.insert(2, _w("cross", lang))
    if a is not None and a.q_scale is not None:
        lines.insert(-1, _scale_text(view, lang))
    if a is not None and a.qk_norm:
        lines.insert(-1, _w("qk_norm", lang))
    if view.rope_not_shown:
        lines.insert(-1, _w("rope_not_shown", lang))
    if view.rotary is not None:
        r = view.rotary
        i = view.token
        rd = r.cos.shape[-1]
        lines.insert(-1, _w("rope_line", lang) if rd == view.head_dim else _w("rope_partial", lang, r=rd, D=view.head_dim))

        def table(values: torch.Tensor, fill: float) -> torch.Tensor:   # a partial table: cos 1, sin 0 after it
            pad = view.head_dim - values.shape[0]
            return values if pad == 0 else torch.cat([values, values.new_full((pad,), fill)])

        lines += [row(_w("before", lang), r.q_before), row("cos", table(r.cos[i], 1.0)),
                  row("sin", table(r.sin[i], 0.0))]
    lines += [row("q", view.q), "", _w("scores", lang)]
    for j, t in enumerate(view.tokens):
        if not view.keep[j]:
            continue
        p = view.products[j]
        other = f" {p[others].sum().item():+8.3f}" if rest else ""
        lines.append(f"  {j:>2} {t[:10]:<10} " + " ".join(_num(x) for x in p[shown].tolist())
                     + f"{other} = {view.dots[j].item():+.4f}")
    lines += ["", _scale_text(view, lang) if a is None or a.q_scale is None else _w("scale_folded", lang)]
    if view.softcap is not None:
        lines.append(_w("softcap", lang, cap=f"{view.softcap:g}"))
    if view.sink is not None:
        lines.append(_w("sink", lang, head=view.head, logit=view.sink, mass=view.sink_mass))
    lines.append(_w("then_softmax", lang))
    for j, t in enumerate(view.tokens):
        if view.keep[j]:
            w = view.weights[j].item()
            bar = "█" * round(w * 30)
            cap = f" → {view.capped[j].item():+8.4f}" if view.capped is not None else ""
            lines.append(f"  {j:>2} {t[:10]:<10} {view.dots[j].item():+9.4f} → {view.scaled[j].item():+8.4f}{cap}"
                         f"  w = {w:.4f} {bar}")
        else:
            lines.append(f"  {j:>2} {t[:10]:<10} {'':>9}   {'-inf':>8}  {_w('blocked', lang)}")
    nv = min(dims, view.out.shape[0])
    lines += ["", _w("out", lang, n=nv, Dv=view.out.shape[0]),
              "  " + " ".join(_num(x) for x in view.out[:nv].tolist()) + " …"]
    dw = (view.weights.float() - view.model_weights).abs().max().item()
    ds = (view.dots[visible].float() - view.model_scores[visible]).abs().max().item()
    lines += ["", _w("model", lang, dw=dw, ds=ds)]
    return "\n".join(line.rstrip() for line in lines) + "\n"


# ---------------------------------------------------------------------------- html
_CSS = """
.mh-neuron{font:13px/1.4 system-ui,sans-serif;color:#222;background:#fff;padding:12px;max-width:100%;overflow-x:auto}
.mh-neuron h3{font-size:15px;margin:0 0 4px}
.mh-neuron p{margin:2px 0 8px}
.mh-neuron table{border-collapse:collapse}
.mh-neuron td,.mh-neuron th{padding:1px 4px;white-space:nowrap;text-align:right}
.mh-neuron th.v,.mh-neuron td.w,.mh-neuron th.w{text-align:left}
.mh-neuron th{font-weight:600;font-size:12px;color:#555}
.mh-neuron td.tok{text-align:left;font-family:ui-monospace,monospace}
.mh-neuron .vec{display:flex;gap:0}
.mh-neuron .vec span{display:inline-block;width:4px;height:15px}
.mh-neuron tr.q td{border-bottom:1px solid #ccc}
.mh-neuron tr.blocked{color:#aaa}
.mh-neuron .bar{display:inline-block;height:10px;background:#2a7ab9;vertical-align:middle}
.mh-neuron .num{font-family:ui-monospace,monospace}
""".strip()


def _color(x: float, top: float) -> str:
    a = 0.0 if top <= 0 else min(1.0, abs(x) / top)
    rgb = "230,120,20" if x >= 0 else "30,110,200"
    return f"rgba({rgb},{a:.3f})"


def _vec(values: torch.Tensor, top: float) -> str:
    cells = "".join(f'<span style="background:{_color(x, top)}" title="d{d}: {x:.5g}"></span>'
                    for d, x in enumerate(values.tolist()))
    return f'<div class="vec">{cells}</div>'


def neuron_html(view: NeuronView, lang: str = "en") -> str:
    """The view as one self-contained ``<div class="mh-neuron">`` (its CSS inside, scoped to the
    class; no script), to include in a page or a notebook cell: a row for q, then a row per key
    with k_j, q ⊙ k_j (a colored cell per head dim; hover for the value), the sum q·k_j, the
    scaled score and the weight as a number and a bar."""
    tok = view.tokens[view.token]
    cap_th = f" → {view.softcap:g}·tanh(s / {view.softcap:g})" if view.softcap is not None else ""
    top_qk = max(view.q.abs().max().item(), view.k.abs().max().item())
    top_p = view.products.abs().max().item()
    head = (f"<tr><th></th><th>{_w('token', lang)}</th><th class=v>{_w('k', lang)}</th><th class=v>{_w('qk', lang)}</th>"
            f"<th>{_w('sum', lang)}</th><th>{_w('scaled', lang)} {view.scale:.4g}{cap_th}</th><th class=w>{_w('weight', lang)}</th></tr>")
    final = view.scaled if view.capped is None else view.capped
    rows = [f'<tr class="q"><td>q</td><td class="tok">{view.token} {escape(tok)}</td><td>{_vec(view.q, top_qk)}</td>'
            f'<td colspan="4"></td></tr>']
    for j, t in enumerate(view.tokens):
        if view.keep[j]:
            w = view.weights[j].item()
            rows.append(
                f'<tr class="key"><td>{j}</td><td class="tok">{escape(t)}</td><td>{_vec(view.k[j], top_qk)}</td>'
                f'<td>{_vec(view.products[j], top_p)}</td><td class="num">{view.dots[j].item():+.3f}</td>'
                f'<td class="num">{final[j].item():+.3f}</td><td class="num w">{w:.3f} '
                f'<span class="bar" style="width:{round(w * 80)}px"></span></td></tr>')
        else:
            rows.append(f'<tr class="blocked"><td>{j}</td><td class="tok">{escape(t)}</td><td></td><td></td>'
                        f'<td></td><td>-inf</td><td>{_w("blocked", lang)}</td></tr>')
    rotary = ""
    if view.rotary is not None:
        r, i = view.rotary, view.token
        top_r = max(r.q_before.abs().max().item(), view.q.abs().max().item())
        rotary = (f"<p>{escape(_w('rotary', lang, pos=i))}</p><table>"
                  f"<tr><th>{escape(_w('before', lang))}</th><td>{_vec(r.q_before, top_r)}</td></tr>"
                  f"<tr><th>cos</th><td>{_vec(r.cos[i], 1.0)}</td></tr>"
                  f"<tr><th>sin</th><td>{_vec(r.sin[i], 1.0)}</td></tr>"
                  f"<tr><th>{escape(_w('after', lang))}</th><td>{_vec(view.q, top_r)}</td></tr></table>")
    title = _w("title", lang, model=view.model, layer=view.layer, head=view.head, token=view.token, tok=tok)
    a = view.attention
    said = [_scale_text(view, lang)] + ([_w("cross", lang)] if view.role == "cross" else [])
    if view.rope_not_shown:
        said.append(_w("rope_not_shown", lang))
    if a is not None and a.qk_norm:
        said.append(_w("qk_norm", lang))
    if view.softcap is not None:
        said.append(_w("softcap", lang, cap=f"{view.softcap:g}"))
    if view.sink is not None:
        said.append(_w("sink", lang, head=view.head, logit=view.sink, mass=view.sink_mass))
    steps_p = "".join(f"<p>{escape(line)}</p>" for line in said)
    return (f'<div class="mh-neuron" lang="{lang}"><style>{_CSS}</style><h3>{escape(title)}</h3>'
            f"<p>{escape(_group_line(view, lang))}. {escape(_w('html_intro', lang))}</p>{steps_p}{rotary}"
            f"<table>{head}{''.join(rows)}</table></div>")


def neuron_fragment(view: NeuronView) -> Any:
    """The view as a section of the explain page (a :class:`multihead.explain.visual.Fragment`),
    in both languages: the page's language switch shows one."""
    body = "".join(f'<div data-l="{lg}" lang="{lg}">{neuron_html(view, lg)}</div>' for lg in ("en", "zh"))
    return Fragment("neuron", {lg: _w("section", lg) for lg in ("en", "zh")}, body)


def neuron_page(view: NeuronView, lang: str = "en") -> str:
    """A standalone HTML page holding :func:`neuron_html` (``explain --neuron --format html``)."""
    title = escape(_w("title", lang, model=view.model, layer=view.layer, head=view.head, token=view.token,
                      tok=view.tokens[view.token]))
    return (f'<!DOCTYPE html>\n<html lang="{lang}"><head><meta charset="utf-8"><title>{title}</title></head>'
            f"<body style=\"margin:0\">{neuron_html(view, lang)}</body></html>\n")

