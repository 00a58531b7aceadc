"""A diagnosis as text, plain data (JSON) and HTML, in English or Chinese.

    >>> import torch.nn as nn
    >>> from multihead.diagnosis import diagnose
    >>> print(diagnose(nn.MultiheadAttention(8, 2, batch_first=True)).text("en").splitlines()[0])
    MultiheadAttention: matches the definition

Legend: B batch, L tokens, H heads, D head dim, E features.
"""

from __future__ import annotations

import os
from html import escape
from typing import TYPE_CHECKING, Any

from .words import say

if TYPE_CHECKING:
    from .locate import Finding
    from .verdict import Diagnosis

__all__ = ["render_text", "render_html", "to_dict", "finding_text"]


def _finding_params(params: dict[str, Any], lang: str) -> dict[str, Any]:
    p = dict(params)
    if "axis" in p:
        p["axis_name"] = say(f"axis_{p['axis']}", lang)
        p["implicit_text"] = say("implicit", lang) if p.get("implicit") else ""
    if "factor" in p:
        guess = p.get("guess") or ""
        p["guess_text"] = f" (= {guess})" if guess and lang == "en" else (f"（= {guess}）" if guess else "")
    return p


def _probe(f: "Finding", lang: str) -> str:
    return f.probe_zh if lang == "zh" and f.probe_zh else f.probe


def finding_text(d: "Diagnosis", lang: str) -> str:
    """The finding's sentence in ``lang``."""
    f = d.finding
    assert f is not None
    return say(f.rule, lang, **_finding_params(f.params, lang))


def _step_title(d: "Diagnosis", lang: str) -> str:
    f = d.finding
    assert f is not None
    title = f.step.title
    text = title({"kinds": f.params.get("kinds") or ("keep",)}, lang) if callable(title) else title[0 if lang == "en" else 1]
    return text.replace("{role}", f.role) if "{role}" in text else (f"{text} {f.role}" if f.role else text)


def _facts(d: "Diagnosis", lang: str) -> str:
    facts = d.facts
    layout = say("batch_first" if facts.get("batch_first", True) else "seq_first", lang)
    causal = say("causal", lang) if facts.get("causal") else ""
    return say("facts", lang, heads=facts.get("heads"), head_dim=facts.get("head_dim"), layout=layout,
               proj=facts.get("projections", ""), causal=causal)


def render_text(d: "Diagnosis", lang: str = "en") -> str:
    """The report as text: the verdict line, the finding (where, why, a layout diagram) or the
    measured error, the conventions, what was found and probed."""
    lines = []
    if d.finding is None:
        lines.append(f"{d.module}: {say('matches', lang)}")
        lines.append("  " + say("error_line", lang, error=d.error, bound=d.bound))
    else:
        f = d.finding
        head = say("raised_head" if f.rule == "raised" else "bug", lang)
        lines.append(f"{d.module}: {head}: {_step_title(d, lang)}")
        if f.where is not None:
            lines.append(f"  {say('where', lang, file=os.path.basename(f.where.file), line=f.where.line)}: {f.where.code}")
        lines.append("  " + finding_text(d, lang))
        if f.diagram:
            lines.append("  " + say("mask_diagram" if f.stage == "M" else "diagram", lang))
            width = max(len(r) for _, r, _ in f.diagram)
            lines.append(f"    {'':10} {say('right', lang):{width}}  |  {say('yours', lang)}")
            for title, right, yours in f.diagram:
                lines.append(f"    {title:10} {right:{width}}  |  {yours}")
        lines.append("  " + say("on_probe", lang, probe=_probe(f, lang)))
    if d.conventions:
        lines.append("  " + say("conventions", lang))
        for c in d.conventions:
            lines.append("    - " + say(c.key, lang, **dict(c.params)))
    lines.append("  " + _facts(d, lang))
    return "\n".join(lines)


def to_dict(d: "Diagnosis") -> dict[str, Any]:
    """Plain data: status, module, finding (step id, role, rule, line, code, texts in both
    languages, diagram), conventions (keys and texts), error and bound, facts, probes."""
    measured = d.finding is None  # a module with a wrong step has no error to bound
    out: dict[str, Any] = {"module": d.module, "status": d.status, "error": d.error if measured else None,
                           "bound": d.bound if measured else None, "facts": d.facts, "probes": d.probes}
    if d.finding is not None:
        f = d.finding
        out["finding"] = {
            "step": f.step.id, "stage": f.stage, "role": f.role, "rule": f.rule, "probe": f.probe,
            "file": None if f.where is None else f.where.file, "line": None if f.where is None else f.where.line,
            "code": None if f.where is None else f.where.code,
            "title": {lang: _step_title(d, lang) for lang in ("en", "zh")},
            "text": {lang: finding_text(d, lang) for lang in ("en", "zh")},
            "diagram": [{"row": t, "right": r, "yours": y} for t, r, y in f.diagram],
            "params": {k: (v if isinstance(v, (int, float, str, bool, type(None))) else str(v)) for k, v in f.params.items()},
        }
    else:
        out["finding"] = None
    out["conventions"] = [{"key": c.key, "text": {lang: say(c.key, lang, **dict(c.params)) for lang in ("en", "zh")}}
                          for c in d.conventions]
    return out


def render_html(d: "Diagnosis", lang: str = "en") -> str:
    """One self-contained ``<div>`` (inline styles only, no script), for a page or a notebook."""
    ok = d.finding is None
    color = "#1a7f37" if ok else "#b42318"
    parts = [f'<div class="multihead-diagnosis" lang="{lang}" style="font-family: sans-serif; '
             f'border: 1px solid #dde2e8; border-radius: 6px; padding: 10px 14px;">']
    if ok:
        parts.append(f'<p style="color: {color}; font-weight: bold;">{escape(d.module)}: {escape(say("matches", lang))}</p>')
        parts.append(f"<p>{escape(say('error_line', lang, error=d.error, bound=d.bound))}</p>")
    else:
        f = d.finding
        assert f is not None
        head = say("raised_head" if f.rule == "raised" else "bug", lang)
        parts.append(f'<p style="color: {color}; font-weight: bold;">{escape(d.module)}: {escape(head)}: '
                     f'{escape(_step_title(d, lang))}</p>')
        if f.where is not None:
            parts.append(f"<p>{escape(say('where', lang, file=os.path.basename(f.where.file), line=f.where.line))}: "
                         f"<code>{escape(f.where.code)}</code></p>")
        parts.append(f"<p>{escape(finding_text(d, lang))}</p>")
        if f.diagram:
            rows = "".join(f"<tr><th>{escape(t)}</th><td><code>{escape(r)}</code></td><td><code>{escape(y)}</code></td></tr>"
                           for t, r, y in f.diagram)
            caption = say("mask_diagram" if f.stage == "M" else "diagram", lang)
            parts.append(f'<table style="border-collapse: collapse;"><caption>{escape(caption)}</caption>'
                         f"<tr><th></th><th>{escape(say('right', lang))}</th><th>{escape(say('yours', lang))}</th></tr>"
                         f"{rows}</table>")
        parts.append(f"<p>{escape(say('on_probe', lang, probe=_probe(f, lang)))}</p>")
    if d.conventions:
        items = "".join(f"<li>{escape(say(c.key, lang, **dict(c.params)))}</li>" for c in d.conventions)
        parts.append(f"<p>{escape(say('conventions', lang))}</p><ul>{items}</ul>")
    parts.append(f"<p>{escape(_facts(d, lang))}</p></div>")
    return "".join(parts)
