"""``multihead explain`` as text, JSON or Markdown: every step of a real forward pass.

One concept past 500 lines: the `Walkthrough` and its three renderings, which share the step
blocks, the value tables and the check lines (the HTML and PNG pictures are :mod:`.visual`).

It builds ``MultiHeadAttention(..., backend="reference")`` (see :mod:`multihead.explain.example`),
runs ``mha(x)`` (or ``mha(x, memory)``) inside :func:`multihead.trace`, and prints each recorded
step: its title, shape with axis names, einops pattern, whether data moved, one line of meaning
and, for batch 0 and head 0, the numbers where they teach something. It ends with every check
(the forward pass's own and :mod:`multihead.explain.checks`' recomputations) and exits 1 if
any failed.

API for other front ends::

    w = example_walkthrough(ExampleConfig(), per_head=False, cost=False)   # a Walkthrough
    render_text(w, lang="en", values=True, color=False)         # or render_markdown / render_json
"""

from __future__ import annotations

import json
import math
import unicodedata
from dataclasses import dataclass, field
from typing import Optional

import torch

from . import check_out, write_output
from ..module import MultiHeadAttention
from ..trace import Step, Trace
from . import cost as _cost
from .checks import Check, per_head_difference, walkthrough_checks
from .example import ExampleConfig, build_example, run_example, trace_example
from .options import Options
from .. import steps as S
from .i18n import check_name, describe_step, note_text, step_title, trace_sizes, word

__all__ = [
    "ExampleConfig",
    "build_example",
    "trace_example",
    "Walkthrough",
    "example_walkthrough",
    "render_text",
    "render_markdown",
    "render_json",
    "command",
    "WIDTH",
]

#: every line of text and Markdown output fits this many terminal columns
WIDTH = 100
_MAX_ROWS = 8
_MAX_COLS = 8


@dataclass
class PerHead:
    """``mha`` against ``mha.to_per_head()``: the max difference and the tolerance it is held to."""

    max_diff: float
    tolerance: float
    ok: bool


@dataclass
class Walkthrough:
    """Everything one ``multihead explain`` run computed.

    config: the example that was built, or None for a trace of the user's own module (the
    summary is then read from the trace). module / inputs: what ran, when known.
    """

    config: Optional[ExampleConfig]
    module: Optional[MultiHeadAttention]
    inputs: tuple
    trace: Trace
    output: torch.Tensor
    extra_checks: list = field(default_factory=list)  # Check, from explain's recomputations
    per_head: Optional[PerHead] = None
    costs: Optional[list] = None  # StepCost per step, with cost=True

    @property
    def checks(self) -> list[Check]:
        """The forward pass's own checks, then explain's, then the per-head comparison."""
        own = [Check(s.label, name, ok, s) for s in self.trace.steps for name, ok in s.checks.items()]
        found = own + list(self.extra_checks)
        if self.per_head is not None:
            out = self.trace.select(S.OUTPUT_PROJECTION)[-1]
            found.append(Check(out.label, "per-head reference equals the fused module", self.per_head.ok, out))
        return found

    @property
    def all_checks_hold(self) -> bool:
        return all(c.ok for c in self.checks)

    def sizes(self) -> dict:
        """The numbers the step meanings are written with (:func:`i18n.trace_sizes`)."""
        return trace_sizes(self.trace)


def example_walkthrough(config: ExampleConfig = ExampleConfig(), *, per_head: bool = False, cost: bool = False) -> Walkthrough:
    """Run the example of ``config`` traced, recompute every step, optionally compare with the
    per-head reference and count the cost."""
    mha, inputs, t, y = run_example(config, keep_values=True)
    w = Walkthrough(config, mha, inputs, t, y, walkthrough_checks(t, mha, inputs, config.build_mask()))
    if per_head:
        w.per_head = PerHead(*per_head_difference(mha, inputs, config.build_mask()))
    if cost:
        w.costs = _cost.trace_cost(t)
    return w


# ---------------------------------------------------------------------------------- text helpers
def _width(text: str) -> int:
    """Terminal columns of ``text`` (CJK characters take two)."""
    return sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)


def _pad(text: str, width: int) -> str:
    return text + " " * max(0, width - _width(text))


def _wrap(text: str, indent: str, width: int = WIDTH, first: Optional[str] = None) -> list[str]:
    """Wrap on spaces, and between any two CJK characters, to ``width`` columns; continuation
    lines start with ``indent``, the first line with ``first`` (default ``indent``)."""
    prefix = indent if first is None else first
    tokens: list[str] = []
    for word_ in text.split(" "):
        chunk = ""
        for ch in word_:
            if _width(ch) == 2:
                if chunk:
                    tokens.append(chunk)
                tokens.append(ch)
                chunk = ""
            else:
                chunk += ch
        if chunk:
            tokens.append(chunk)
        tokens.append(" ")
    lines, line = [], ""
    for tok in tokens[:-1]:
        if _width(prefix + line + tok) > width and line.strip():
            lines.append(prefix + line.rstrip())
            prefix = indent
            line = "" if tok == " " else tok
        else:
            line += tok
    if line.strip() or not lines:
        lines.append(prefix + line.rstrip())
    return lines


def _shape_text(step: Step) -> str:
    if len(step.axes) == len(step.shape):
        return "(" + ", ".join(f"{a}={n}" for a, n in zip(step.axes, step.shape)) + ")"
    return "(" + ", ".join(str(n) for n in step.shape) + ")"


def _num(x: float, integer: bool = False) -> str:
    if integer:
        return str(int(x))
    if math.isinf(x):
        return "-inf" if x < 0 else "inf"
    if math.isnan(x):
        return "nan"
    return f"{x:.4f}"


def _pick_indices(n: int, limit: int) -> list[Optional[int]]:
    """All of range(n), or the first limit-2, None (an ellipsis), the last."""
    if n <= limit:
        return list(range(n))
    return list(range(limit - 2)) + [None, n - 1]


@dataclass
class Block:
    """A 2-D slice of a step's values to print, with what its rows are."""

    caption: str
    matrix: torch.Tensor
    row_label: str  # "t", "q", "head "
    integer: bool = False
    row_sums: bool = False


def step_blocks(step: Step, w: Walkthrough, lang: str) -> list[Block]:
    """The numbers worth showing for ``step`` (batch 0, head 0), as captioned matrices."""
    t = step.tensor
    if t is None:
        return []
    kind = step.kind
    if kind in (S.INPUT, S.PROJECT, S.OUTPUT_PROJECTION):
        return [Block(word("batch0", lang), t[0], "t")]
    if kind is S.SPLIT_HEADS:
        return [Block(word("token0", lang), t[0, 0], word("head", lang) + " ")]
    if kind in (S.MOVE_HEADS_FORWARD, S.ROPE, S.CACHE_APPEND, S.REPEAT_KV):
        return [Block(word("rows_tokens", lang), t[0, 0], "t")]
    if kind in (S.SCORES, S.SCALE, S.ADD_BIAS, S.SCORE_MOD):
        return [Block(word("rows_queries", lang), t[0, 0], "q")]
    if kind is S.MASK:
        keep = step.extras["keep"].expand(t.shape)[0, 0].to(torch.int64)
        return [Block(word("mask01", lang), keep, "q", integer=True), Block(word("masked_scores", lang), t[0, 0], "q")]
    if kind in (S.SOFTMAX, S.DROPOUT):
        return [Block(word("rows_weights", lang), t[0, 0], "q", row_sums=True)]
    if kind in (S.WEIGHTED_SUM, S.FUSED_ATTENTION):
        return [Block(word("rows_out", lang), t[0, 0], "q")]
    if kind is S.MERGE_HEADS:
        sizes = trace_sizes(w.trace, step)
        D = sizes.get("D", 1)
        heads = sizes.get("H", step.shape[-1] // D)
        shown = [i for i in _pick_indices(heads, 4)]
        ranges = ", ".join("…" if i is None else f"{i}: {i * D}-{i * D + D - 1}" for i in shown)
        return [Block(word("merged_cols", lang, ranges=ranges), t[0], "t")]
    return []


def _block_lines(block: Block, indent: str, lang: str) -> list[str]:
    m = block.matrix
    if m.dim() == 1:
        m = m.unsqueeze(0)
    rows = _pick_indices(m.shape[0], _MAX_ROWS)
    cols = _pick_indices(m.shape[1], _MAX_COLS)
    label_w = max(len(f"{block.row_label}{r}") for r in rows if r is not None)
    cell_w = 2 if block.integer else 8
    lines = [indent + block.caption]
    for r in rows:
        if r is None:
            lines.append(indent + "  " + " " * label_w + "  ⋮")
            continue
        cells = [("…" if c is None else _num(float(m[r, c]), block.integer)).rjust(cell_w) for c in cols]
        line = f"{indent}  {f'{block.row_label}{r}'.ljust(label_w)}  " + " ".join(cells)
        if block.row_sums:
            line += f"   | {_num(float(m[r].sum()))}"
        lines.append(line)
    return lines


class _Style:
    def __init__(self, color: bool):
        self.color = color

    def _wrap(self, code: str, text: str) -> str:
        return f"\033[{code}m{text}\033[0m" if self.color else text

    def bold(self, text: str) -> str:
        return self._wrap("1", text)

    def ok(self, text: str) -> str:
        return self._wrap("32", text)

    def bad(self, text: str) -> str:
        return self._wrap("31;1", text)


def _meaning(step: Step, w: Walkthrough, lang: str) -> str:
    text = describe_step(step, lang, trace_sizes(w.trace, step))
    if step.kind is S.PROJECT:  # a fused product is said once, at the first step it concerns
        first = "K" if step.params.get("fused") == "kv" else "Q"
        note = note_text(step, lang) if step.role == first else ""
    elif step.kind is S.MASK:
        note = ""  # the mask's code: shown as code, not prose
    else:
        note = note_text(step, lang)
    if note:
        sep = " " if lang == "en" else ""
        end = "." if lang == "en" else "。"
        text = f"{text}{sep}{note[0].upper() + note[1:] if lang == 'en' else note}{end}" if text else note
    return text


def _module_code(w: Walkthrough) -> str:
    """The traced module as one line of code, or "" when the walkthrough has none."""
    if w.module is None:
        return ""
    return f"{type(w.module).__name__}({w.module.config.summary()})"


def _summary_lines(w: Walkthrough, lang: str) -> list[tuple[str, str]]:
    c, s, cfg = w.config, w.sizes(), w.trace.config
    parts = [word("sizes", lang, **s)] if "H" in s and "B" in s and "d_in" in s else []
    if s.get("Hkv", s.get("H")) != s.get("H"):
        parts.append(word("kv_heads", lang, **s))
    if c is not None and c.keys is not None:
        parts.append(word("cross", lang, **s))
    if cfg.get("causal"):
        parts.append(word("causal", lang))
    if s.get("p") and (w.module is None or w.module.training):
        parts.append(word("dropout", lang, **s))
    if c is not None:
        parts.append(word("seed", lang, seed=c.seed))
    sep = ", " if lang == "en" else "，"
    backend = cfg.get("backend", "reference")
    lines = [(word("example", lang), sep.join(parts))] if parts else []
    code = c.module_call() if c is not None else _module_code(w)
    if code:
        lines.append((word("code", lang), code))
    return lines + [
        (word("backend", lang), word("backend_line", lang) if backend == "reference"
         else word("backend_fused_line", lang, backend=backend)),
        (word("axes", lang), word("axes_line", lang)),
    ]


# ---------------------------------------------------------------------------------- renderers
def render_text(w: Walkthrough, *, lang: str = "en", values: bool = True, color: bool = False) -> str:
    """The walkthrough as lines of at most :data:`WIDTH` columns."""
    st = _Style(color)
    out = [st.bold(word("title", lang)), ""]
    summary = _summary_lines(w, lang)
    if values:
        summary.append((word("values", lang), word("values_line", lang)))
    key_w = max(_width(k) for k, _ in summary) + 2
    for key, text in summary:
        out.extend(_wrap(text, " " * key_w, first=_pad(key + ":", key_w)))
    steps = w.trace.steps
    num_w = len(str(len(steps)))
    title_w = min(34, max(_width(step_title(s, lang)) for s in steps) + 2)
    for i, s in enumerate(steps, 1):
        out.append("")
        head = f"{str(i).rjust(num_w)}. " + _pad(step_title(s, lang), title_w)
        shape = _shape_text(s)
        kind = "" if s.kind is S.INPUT else word("view", lang) if s.view else word("copy", lang)
        line = st.bold(head) + _pad(shape, 24) + " " + kind
        if _width(head + _pad(shape, 24) + " " + kind) > WIDTH:
            out.append(st.bold(head.rstrip()))
            line = " " * (num_w + 2) + shape + "  " + kind
        out.append(line.rstrip())
        indent = " " * (num_w + 2)
        if s.pattern:
            out.append(f"{indent}{word('pattern', lang)}: {s.pattern}")
        out.extend(_wrap(_meaning(s, w, lang), indent))
        if values:
            for block in step_blocks(s, w, lang):
                out.extend(_block_lines(block, indent, lang))
    if w.per_head is not None:
        out += ["", st.bold(word("per_head", lang))]
        out += _wrap(word("per_head_line", lang, **w.sizes()), "  ")
        if w.sizes().get("p"):
            out += _wrap(word("per_head_eval", lang), "  ")
        out.append("  " + word("max_diff", lang, diff=w.per_head.max_diff, tol=w.per_head.tolerance))
    if w.costs is not None:
        out += ["", st.bold(word("cost", lang))] + _cost_lines(w, w.costs, lang)
    out += [""] + _check_lines(w, lang, st)
    return "\n".join(out) + "\n"


def _table(rows: list[tuple], right: set) -> list[str]:
    widths = [max(_width(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for n, r in enumerate(rows):
        cells = []
        for i, cell in enumerate(r):
            cell = str(cell)
            pad = " " * (widths[i] - _width(cell))
            cells.append(pad + cell if i in right else cell + pad)
        lines.append("  " + "  ".join(cells).rstrip())
        if n == 0:
            lines.append("  " + "  ".join("-" * wd for wd in widths))
    return lines


def _cost_lines(w: Walkthrough, costs: list, lang: str) -> list[str]:
    """The cost section of ``w``, whose ``costs`` (not None) the caller passes."""
    lines = _wrap(word("cost_note", lang, dtype=w.output.dtype).replace("torch.", ""), "  ")
    rows: list[tuple] = [(word("cost_step", lang), word("flops", lang), word("bytes", lang))]
    for s, c in zip(w.trace.steps, costs):
        rows.append((step_title(s, lang), f"{c.flops:,}", f"{c.bytes:,}"))
    rows.append((word("total", lang), f"{sum(c.flops for c in costs):,}", f"{sum(c.bytes for c in costs):,}"))
    lines += _table(rows, {1, 2})
    table = _head_counts(w)
    if table is None:
        return lines
    sz = w.sizes()
    lines += [""] + _wrap(word("heads_table", lang, Lq=sz["Lq"], Lk=sz["Lk"], d_out=sz["d_out"]), "  ")
    rows = [tuple(word(k, lang) for k in ("heads_col", "hd_col", "attn_col", "proj_col", "total_col", "scores_col"))]
    for a in table:
        rows.append((a.heads, a.head_dim, f"{a.attention:,}", f"{a.projections:,}", f"{a.total:,}", f"{a.score_elements:,}"))
    lines += _table(rows, {0, 1, 2, 3, 4, 5})
    core = 4 * sz["B"] * sz["Lq"] * sz["Lk"] * sz["d_out"]
    lines += _wrap(word("heads_conclusion", lang, core=f"{core:,}"), "  ")
    return lines


def _head_counts(w: Walkthrough) -> Optional[list]:
    """The seeds' head-count table for the traced sizes, or None when the trace has no module config."""
    s = w.sizes()
    if not all(k in s for k in ("B", "Lq", "Lk", "d_in", "d_out")):
        return None
    return _cost.head_count_table(s["B"], s["Lq"], s["Lk"], s["d_in"], s["d_out"], bias=bool(w.trace.config.get("bias")))


def _check_text(c: Check, w: Walkthrough, lang: str) -> str:
    title = step_title(c.source, lang) if c.source is not None else c.step
    return f"{title}: {check_name(c.name, lang)}"


def _check_lines(w: Walkthrough, lang: str, st: _Style) -> list[str]:
    checks = w.checks
    held = sum(c.ok for c in checks)
    lines = [st.bold(f"{word('checks', lang)} ({word('hold', lang, held=held, total=len(checks))})")]
    ok_w = max(_width(word("ok", lang)), _width(word("fail", lang)))
    for c in checks:
        mark = word("ok", lang) if c.ok else word("fail", lang)
        wrapped = _wrap(_check_text(c, w, lang), " " * (ok_w + 4), first="  " + _pad(mark, ok_w) + "  ")
        wrapped[0] = wrapped[0].replace(mark, st.ok(mark) if c.ok else st.bad(mark), 1)
        lines.extend(wrapped)
    failed = len(checks) - held
    lines.append(st.ok(word("all_hold", lang)) if not failed else st.bad(word("some_failed", lang, n=failed)))
    return lines


def render_markdown(w: Walkthrough, *, lang: str = "en", values: bool = True) -> str:
    """The walkthrough as Markdown: a table of the steps, their meanings, values and checks."""
    out = [f"# {word('title', lang)}", ""]
    for key, text in _summary_lines(w, lang):
        out.extend(_wrap(text, "  ", first=f"- **{key}**: "))
    steps = w.trace.steps
    out += ["", f"| # | {word('step', lang)} | {word('table_shape', lang)} | {word('pattern', lang)} | {word('table_view', lang)} |",
            "|---:|---|---|---|---|"]
    for i, s in enumerate(steps, 1):
        pattern = f"`{s.pattern}`" if s.pattern else ""
        view = word("yes", lang) if s.view else word("no", lang)
        out.append(f"| {i} | {step_title(s, lang)} | {_shape_text(s)} | {pattern} | {view} |")
    out += ["", f"## {word('meaning', lang)}", ""]
    for i, s in enumerate(steps, 1):
        out.extend(_wrap(_meaning(s, w, lang), "   ", first=f"{i}. **{step_title(s, lang)}**: "))
    if values:
        out += ["", f"## {word('values', lang)} ({word('values_line', lang)})"]
        for i, s in enumerate(steps, 1):
            blocks = step_blocks(s, w, lang)
            if not blocks:
                continue
            out += ["", f"{i}. **{step_title(s, lang)}**", "", "```text"]
            for b in blocks:
                out.extend(_block_lines(b, "", lang))
            out.append("```")
    if w.per_head is not None:
        out += ["", f"## {word('per_head', lang)}", ""]
        out += _wrap(word("per_head_line", lang, **w.sizes()), "")
        out += ["", "`" + word("max_diff", lang, diff=w.per_head.max_diff, tol=w.per_head.tolerance) + "`"]
    if w.costs is not None:
        out += ["", f"## {word('cost', lang)}", "", "```text"] + _cost_lines(w, w.costs, lang) + ["```"]
    checks = w.checks
    held = sum(c.ok for c in checks)
    out += ["", f"## {word('checks', lang)} ({word('hold', lang, held=held, total=len(checks))})", ""]
    for c in checks:
        out.extend(_wrap(_check_text(c, w, lang), "      ", first=f"- [{'x' if c.ok else ' '}] "))
    return "\n".join(out) + "\n"


def _jsonable(t: torch.Tensor):
    """Nested lists of numbers, with infinities and NaN as the strings "-inf", "inf", "nan"."""
    if t.dim() == 0:
        x = t.item()
        if isinstance(x, float) and not math.isfinite(x):
            return _num(x)
        return x
    return [_jsonable(r) for r in t]


def render_json(w: Walkthrough, *, lang: str = "en", values: bool = True) -> str:
    """``w.trace.to_dict()`` with, per step, its title and meaning (and values), plus the example,
    every check, the per-head comparison and the cost when they were computed. Valid JSON."""
    data = w.trace.to_dict()
    for s, d in zip(w.trace.steps, data["steps"]):
        d["title"] = step_title(s, lang)
        d["meaning"] = _meaning(s, w, lang)
        if values:
            d["values"] = [{"caption": b.caption, "row_label": b.row_label, "matrix": _jsonable(b.matrix)}
                           for b in step_blocks(s, w, lang)]
    data["example"] = w.config.to_dict() if w.config is not None else None
    data["code"] = w.config.module_call() if w.config is not None else (_module_code(w) or None)
    data["lang"] = lang
    data["checks"] = [{"step": c.step, "name": c.name, "text": _check_text(c, w, lang), "ok": c.ok} for c in w.checks]
    data["all_checks_hold"] = w.all_checks_hold
    if w.per_head is not None:
        data["per_head"] = {"max_abs_diff": w.per_head.max_diff, "tolerance": w.per_head.tolerance, "ok": w.per_head.ok}
    if w.costs is not None:
        data["cost"] = {
            "steps": [{"step": x.label, "flops": x.flops, "bytes": x.bytes} for x in w.costs],
            "total_flops": sum(x.flops for x in w.costs),
            "total_bytes": sum(x.bytes for x in w.costs),
            "head_counts": [
                {"heads": a.heads, "head_dim": a.head_dim, "attention_flops": a.attention,
                 "projection_flops": a.projections, "total_flops": a.total, "score_elements": a.score_elements}
                for a in _head_counts(w) or []
            ],
        }
    return json.dumps(data, ensure_ascii=False, indent=1, allow_nan=False) + "\n"


# ---------------------------------------------------------------------------------- CLI entry
def command(options: Options, stdout) -> int:
    """``multihead explain`` for the text, json and markdown formats of ``options.example``.
    Returns the exit code: 0 when every check held, 1 when one failed. An ``out`` that cannot
    be written raises UsageError (a ValueError) before any work."""
    if not isinstance(options, Options):
        raise TypeError(f"options must be a multihead.explain.options.Options, got {type(options).__name__} "
                        "(multihead.cli.parse_options builds one from command-line flags)")
    if options.format not in ("text", "json", "markdown"):
        raise ValueError(f"the walkthrough writes text, json or markdown, not {options.format!r}; "
                         "html and png are multihead.explain.visual.command")
    out = check_out(options.out)
    w = example_walkthrough(options.example, per_head=options.per_head, cost=options.cost)
    lang, values = options.lang, options.values
    if options.format == "json":
        text = render_json(w, lang=lang, values=values)
    elif options.format == "markdown":
        text = render_markdown(w, lang=lang, values=values)
    else:
        color = out is None and _wants_color(stdout)
        text = render_text(w, lang=lang, values=values, color=color)
    write_output(text, out, stdout)
    return 0 if w.all_checks_hold else 1


def _wants_color(stream) -> bool:
    import os

    if os.environ.get("NO_COLOR"):
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())
