"""Find the first step where a user's forward departs from the definition, and say why.

    >>> import torch, torch.nn as nn
    >>> from multihead.diagnosis import diagnose
    >>> class NoTranspose(nn.Module):                       # heads viewed without a transpose
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.num_heads, self.qkv, self.out_proj = 2, nn.Linear(8, 24), nn.Linear(8, 8)
    ...     def forward(self, x):
    ...         B, L, E = x.shape
    ...         q, k, v = self.qkv(x).view(B, 2, L, 3 * E // 2).chunk(3, dim=-1)
    ...         w = torch.softmax(q @ k.transpose(-2, -1) / 2, dim=-1)
    ...         return self.out_proj((w @ v).transpose(1, 2).reshape(B, L, E))
    >>> d = diagnose(NoTranspose())
    >>> d.status, d.finding.step.id, d.finding.role
    ('bug', 'split_heads', 'Q')

Every tensor the forward produced (:mod:`.record`) is labelled with the reference stages it
equals in an allowed layout (:mod:`.layouts`, :mod:`.reference`). A stage counts as right when
it is matched or a stage computed from it is (a fused SDPA call that returns the right
weights × V vouches for the scores, scale, mask and softmax it never wrote out). The first
stage that is not right is the first wrong step; a rule for that stage then looks at the op
that departed (its function, arguments, input layout and values) to say what went wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from .. import steps as _steps
from .layouts import close, find_form
from .record import Op, Recorder, Where, where_raised
from .reference import STAGE_STEPS, STAGES, Reference

__all__ = ["Finding", "locate", "label_ops", "tolerance", "AXES"]

AXES = {
    "P:Q": ("b", "t", "f"), "P:K": ("b", "t", "f"), "P:V": ("b", "t", "f"),
    "H:Q": ("b", "h", "t", "d"), "H:K": ("b", "h", "t", "d"), "H:V": ("b", "h", "t", "d"),
    "S": ("b", "h", "q", "k"), "S*": ("b", "h", "q", "k"), "M": ("b", "h", "q", "k"), "W": ("b", "h", "q", "k"),
    "O": ("b", "h", "q", "d"), "C": ("b", "q", "f"), "Y": ("b", "q", "f"),
}
#: the stages each stage is computed from
_INPUTS = {"H:Q": ("P:Q",), "H:K": ("P:K",), "H:V": ("P:V",), "S": ("H:Q", "H:K"), "S*": ("S",),
           "M": ("S*", "S"), "W": ("M", "S*", "S"), "O": ("W", "H:V"), "C": ("O",), "Y": ("C",)}
_SOFTMAX = ("softmax", "_softmax", "log_softmax")
_RESHAPE = ("view", "reshape", "contiguous", "permute", "transpose", "flatten", "unflatten", "__getitem__",
            "chunk", "split", "unbind", "movedim", "swapaxes", "swapdims", "squeeze", "unsqueeze")
#: blocked scores must be at most this (or -inf): exp() then underflows to 0 next to visible ones
_BLOCKED = -1.0e3


@dataclass
class Finding:
    """The first wrong step: its reference ``stage`` (see :data:`.reference.STAGES`; "dropout"
    for randomness in eval), the catalogue ``step``, the tensor ``role`` (Q, K, V or ""),
    the ``rule`` that explains it (a key of :mod:`.words`) with its ``params``, the user's
    line ``where``, the ``probe`` it showed on, and an optional ``diagram``: (title, right,
    yours) rows of a layout."""

    stage: str
    step: _steps.StepKind
    role: str
    rule: str
    params: dict[str, Any]
    where: Optional[Where]
    probe: str
    diagram: list[tuple[str, str, str]] = field(default_factory=list)
    #: how many reference stages some tensor of the forward matched (how far it got)
    matched: int = 0
    #: the probe in Chinese (``probe`` is English)
    probe_zh: str = ""


def tolerance(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """How far a tensor of a correct ``dtype`` forward may be from the float64 reference ``ref``
    and still count as the same step: 64 units of ``dtype``'s eps of the reference's size
    (wrong steps differ by the size of the values themselves); 4 units for float16/bfloat16."""
    finite = ref[torch.isfinite(ref)]
    size = float(finite.abs().max()) if finite.numel() else 0.0
    eps = torch.finfo(dtype).eps
    return (64 if eps < 1e-4 else 4) * eps * (1.0 + size)  # half types: a few of their (large) units


def _masked_compare(ref: Reference, scaled: bool, dtype: torch.dtype) -> Callable[[torch.Tensor, torch.Tensor], bool]:
    """compare(canonical, M): visible scores equal the reference's (scaled, or not yet scaled),
    blocked ones at most :data:`_BLOCKED`."""
    keep = ref.keep

    def compare(canon: torch.Tensor, want: torch.Tensor) -> bool:
        if keep is None or canon.shape != want.shape:
            return False
        vis = keep.expand_as(want)
        target = want if scaled else want / ref.scale
        tol = tolerance(target[vis], dtype)
        if not bool(((canon[vis] - target[vis]).abs() <= tol).all()):
            return False
        return bool((canon[~vis] <= _BLOCKED).all())

    return compare


def _match(t: torch.Tensor, stage: str, ref: Reference, dtype: torch.dtype) -> Optional[str]:
    r = ref.tensors[stage]
    axes = AXES[stage]
    per_head = stage in ("H:Q", "H:K", "H:V", "S", "S*", "M", "W", "O")
    tol = tolerance(r, dtype)
    if stage == "M":
        for scaled in (True, False):
            form = find_form(t, r, axes, tol=tol, per_head=per_head, compare=_masked_compare(ref, scaled, dtype))
            if form is not None:
                return form if scaled else form + " (before the scale)"
        return None
    rows = ref.rows if stage in ("W", "O", "C", "Y") else None
    form = find_form(t, r, axes, tol=tol, rows=rows, row_axis="q", per_head=per_head)
    if form is None and stage in ("H:Q", "H:K"):
        for factor, how in ((ref.scale, " (scaled)"), (math.sqrt(ref.scale), " (scaled by D^-1/4)")):
            form = find_form(t, r * factor, axes, tol=tol * 2, per_head=True)
            if form is not None:
                return form + how
    return form


def label_ops(rec: Recorder, ref: Reference, dtype: torch.dtype) -> dict[int, list[tuple[str, str]]]:
    """{op index: [(stage, layout), ...]} for every op output that equals a reference stage."""
    labels: dict[int, list[tuple[str, str]]] = {}
    sizes = {s: t.numel() for s, t in ref.tensors.items()}
    widths = [ref.tensors[f"P:{r}"].shape[-1] for r in "QKV"]
    for op in rec.ops:
        for t in op.outputs:
            if not t.is_floating_point():
                continue
            if t.dim() >= 2 and t.shape[-1] in (sum(widths), sum(widths[1:])):  # a fused projection
                roles = "QKV" if t.shape[-1] == sum(widths) else "KV"
                pieces = torch.split(t, [int(widths["QKV".index(r)]) for r in roles], -1)
                for role, piece in zip(roles, pieces):
                    form = _match(piece, f"P:{role}", ref, dtype)
                    if form is not None:
                        labels.setdefault(op.index, []).append((f"P:{role}", form + " (fused)"))
            for stage in STAGES:
                if stage not in ref.tensors:
                    continue
                n = sizes[stage]
                if t.numel() != n and not (AXES[stage][1] == "h" and t.numel() * ref.tensors[stage].shape[1] == n):
                    continue
                form = _match(t, stage, ref, dtype)
                if form is not None:
                    labels.setdefault(op.index, []).append((stage, form))
    return labels


def _downstream() -> dict[str, set[str]]:
    down: dict[str, set[str]] = {s: set() for s in STAGES}
    for s in reversed(STAGES):
        for p in _INPUTS.get(s, ()):
            down[p] |= {s} | down[s]
    return down


_DOWN = _downstream()


def _ancestors(rec: Recorder, start: Optional[int]) -> set[int]:
    seen: set[int] = set()
    todo = [] if start is None else [start]
    while todo:
        i = todo.pop()
        if i in seen:
            continue
        seen.add(i)
        op = rec.ops[i]
        todo += [j for j in (op.source(n) for n in range(len(op.inputs))) if j is not None]
    return seen


Labels = dict[int, list[tuple[str, str]]]


def _stage_of(labels: Labels, i: Optional[int]) -> list[tuple[str, str]]:
    return [] if i is None else labels.get(i, [])


def _departure(rec: Recorder, labels: Labels, stage: str, path: Optional[set[int]], roles_input: dict[str, str]) -> Optional[Op]:
    """The first op that takes a tensor of a stage before ``stage`` (or a probe input) and makes
    one that matches nothing, on the way to the output."""
    before = set(_INPUTS.get(stage, ()))
    if stage.startswith("P:"):
        starts = {roles_input.get(stage[2:], "")}
    else:
        starts = set()
    for op in rec.ops:
        if path is not None and op.index not in path:
            continue
        if op.index in labels:
            continue
        fed = any(any(s in before for s, _ in _stage_of(labels, op.source(n))) for n in range(len(op.inputs)))
        fed = fed or any(name in starts for name in op.inputs)
        if fed:
            return op
    return None


def _softmax_op(rec: Recorder, path: Optional[set[int]]) -> Optional[Op]:
    for op in rec.ops:
        if op.func in _SOFTMAX and (path is None or op.index in path):
            return op
    return None


def _input_tensor(rec: Recorder, op: Op, n: int = 0) -> Optional[torch.Tensor]:
    i = op.source(n)
    return None if i is None else rec.ops[i].outputs[0]


def _canon_scores(t: torch.Tensor, ref: Reference) -> Optional[torch.Tensor]:
    """``t`` as (b, h, q, k) when it is a layout of the scores' shape (any values)."""
    b, h, q, k = ref.tensors["S"].shape
    if t.numel() != b * h * q * k:
        return None
    if tuple(t.shape) in ((b, h, q, k), (b * h, q, k)):
        return t.reshape(b, h, q, k)
    return None


def _groups(form: str) -> list[str]:
    """The axis groups of a layout ("t (b h) d" -> ["t", "bh", "d"]), without a head prefix or note."""
    form = form.split(": ")[-1].split(" (before")[0].split(" (scaled")[0].split(" (fused")[0]
    out, cur, inside = [], "", False
    for ch in form:
        if ch == "(":
            inside, cur = True, ""
        elif ch == ")":
            inside = False
            out.append(cur)
            cur = ""
        elif ch == " ":
            if not inside and cur:
                out.append(cur)
                cur = ""
        else:
            cur += ch
    if cur:
        out.append(cur)
    return out


def _provenance(got: torch.Tensor, source: torch.Tensor, heads: int, d: int) -> Optional[list[tuple[int, int]]]:
    """For a (b, h, t, d) tensor built from a (b, t, h*d) one: which (token, head) chunk of the
    source each row of batch 0 holds, head after head; None when the rows are not whole chunks."""
    if got.dim() != 4 or source.dim() != 3:
        return None
    chunks = source[0].reshape(-1, heads, d)  # (t, h, d)
    out = []
    for row in got[0].reshape(-1, d):
        hit = ((chunks - row).abs().amax(-1) <= 1e-5 * (1 + row.abs().max())).nonzero()
        if not len(hit):
            return None
        out.append((int(hit[0, 0]), int(hit[0, 1])))
    return out


def _heads_diagram(prov: list[tuple[int, int]], heads: int, tokens: int) -> list[tuple[str, str, str]]:
    rows = []
    for h in range(min(heads, 3)):
        right = " ".join(f"t{t}h{h}" for t in range(tokens))
        yours = " ".join(f"t{t}h{g}" for t, g in prov[h * tokens:(h + 1) * tokens])
        rows.append((f"head {h}", right, yours))
    return rows


def locate(rec: Recorder, ref: Reference, out_index: Optional[int], dtype: torch.dtype, probe: str,
           roles_input: dict[str, str], weights_of: dict[str, str], lk: int,
           error: Optional[BaseException] = None) -> Finding:
    """The :class:`Finding` for one probe whose output differs from the reference's.

    ``out_index``: the op that made the output (None if the forward raised); ``roles_input``:
    the name each role's probe input was recorded under; ``weights_of``: the recorded name of
    each role's weight ("q", "k", "v", "o")."""
    labels = label_ops(rec, ref, dtype)
    matched = {s for ls in labels.values() for s, _ in ls}
    right = {s for s in ref.tensors if s in matched or (_DOWN[s] & matched)}
    stage = next((s for s in STAGES if s in ref.tensors and s not in right), "Y")
    path = None if out_index is None else _ancestors(rec, out_index)
    failed = rec.failed
    if failed is not None:  # what the failing op was computing: the stage its inputs feed
        fed = {s for n in range(len(failed.inputs)) for s, _ in _stage_of(labels, failed.source(n))}
        consumers = [s for s in STAGES if s in ref.tensors and set(_INPUTS.get(s, ())) & fed and s not in matched]
        if consumers:
            stage = consumers[0]
    op = failed if failed is not None else _departure(rec, labels, stage, path, roles_input)
    where = op.where if op is not None else None
    role = stage[2:] if ":" in stage else ""
    base = dict(line=where.line if where else "?", code=where.code if where else "", func=op.func if op else "",
                role=role, probe=probe, kinds=ref.kinds)
    raised = failed.error if failed is not None else error
    if raised is not None:
        base["error"] = f"{type(raised).__name__}: {str(raised).splitlines()[0] if str(raised) else ''}"
        if failed is None:
            where = where_raised(raised)
            base.update(line=where.line if where else "?", code=where.code if where else "")

    def finding(st: str, rule: str, diagram: Sequence[tuple[str, str, str]] = (),
                step: Optional[_steps.StepKind] = None, **params: Any) -> Finding:
        return Finding(st, step or STAGE_STEPS.get(st, _steps.OUTPUT_PROJECTION), params.get("role", base["role"]),
                       rule, {**base, **params}, where, probe, list(diagram), len(matched))

    b, h, lq, d = ref.tensors["O"].shape
    # -- projections
    if stage.startswith("P:"):
        linears = [o for o in rec.ops if o.func == "linear"]
        mine = [o for o in linears if weights_of.get(role.lower(), "?") in o.inputs]
        for o in mine:
            if o.inputs and o.inputs[0] != roles_input.get(role) and o.inputs[0].startswith("input"):
                where = o.where
                base.update(line=where.line if where else "?", code=where.code if where else "")
                return finding(stage, "project_wrong_input", given=o.inputs[0].split()[-1],
                               wanted=roles_input.get(role, "").split()[-1])
        if not mine:
            return finding(stage, "project_unused", weight=weights_of.get(role.lower(), "?").replace("param ", ""))
        return finding(stage, "project_other")
    # -- heads
    if stage.startswith("H:"):
        if op is not None and op.func in ("view", "reshape") and role in ("K", "V") and lk != lq:
            shape = [a for a in op.args if isinstance(a, int)] or [x for a in op.args if isinstance(a, tuple) for x in a]
            if lq in shape and lk not in shape:
                return finding(stage, "kv_query_length", lq=lq, lk=lk, shape=tuple(shape))
        if op is not None and op.outputs:
            got = op.outputs[0]
            prov = _provenance(got, ref.tensors[f"P:{role}"], h if role == "Q" else ref.tensors[stage].shape[1], d)
            if prov is not None and got.dim() == 4 and tuple(got.shape[1:3]) == (ref.tensors[stage].shape[1], got.shape[2]):
                tokens = got.shape[2]
                first = prov[:tokens]
                return finding(stage, "split_no_transpose", _heads_diagram(prov, min(h, got.shape[1]), tokens),
                               shape=tuple(got.shape), tokens=sorted({t for t, _ in first}),
                               heads=sorted({g for _, g in first}))
        return finding(stage, "heads_other")
    # -- scores: are the matmul's inputs heads whose last two axes are (h, d)?
    if stage == "S":
        mm = op if op is not None and op.func in ("matmul", "__matmul__", "bmm", "einsum") else None
        if mm is not None:
            moved = {s for ls in labels.values() for s, form in ls
                     if s.startswith("H:") and len(_groups(form)) >= 2 and "t" in "".join(_groups(form)[-2:])}
            for n in range(len(mm.inputs)):
                for s, form in _stage_of(labels, mm.source(n)):
                    g = _groups(form)
                    if s.startswith("H:") and s not in moved and len(g) >= 2 and g[-1] == "d" and "t" not in g[-2]:
                        where = rec.ops[mm.source(n)].where  # type: ignore[index]
                        base.update(line=where.line if where else "?", code=where.code if where else "")
                        return finding(stage, "no_transpose", step=_steps.MOVE_HEADS_FORWARD, role=s[2:],
                                       form=form)
        return finding(stage, "scores_other")
    sm = _softmax_op(rec, path)
    x = _input_tensor(rec, sm) if sm is not None else None
    xs = None if x is None else _canon_scores(x, ref)
    s_ref, s_star = ref.tensors["S"], ref.tensors["S*"]
    vis = torch.ones_like(s_ref, dtype=torch.bool) if ref.keep is None else ref.keep.expand_as(s_ref)
    if stage in ("S*", "M", "W") and xs is not None and sm is not None:
        made = rec.ops[sm.source(0) or 0]  # xs is not None: the input is an op's
        where = made.where
        base.update(line=where.line if where else "?", code=where.code if where else "", func=made.func)
        # a scale other than 1/sqrt(D): the softmax's input is c * QK^T on the visible scores
        num = float((xs[vis] * s_ref[vis]).sum())
        den = float((s_ref[vis] ** 2).sum()) or 1.0
        c = num / den
        if close(xs[vis], c * s_ref[vis], tolerance(s_ref, dtype) * 4) and not math.isclose(c, ref.scale, rel_tol=max(1e-3, 8 * torch.finfo(dtype).eps)):
            guess = _scale_guess(c, d, ref)
            up = sorted(_ancestors(rec, made.index))
            raw = [i for i in up if any(st == "S" for st, _ in labels.get(i, []))]
            after = [i for i in up if raw and i > raw[-1]]
            scaler = rec.ops[after[0]] if after else made
            where = scaler.where
            base.update(line=where.line if where else "?", code=where.code if where else "", func=scaler.func)
            return Finding("S*", _steps.SCALE, "", "scale_wrong", {**base, "factor": c, "want": ref.scale, "guess": guess,
                                                                    "D": d}, where, probe, matched=len(matched))
        if ref.keep is not None and not bool(ref.keep.all()):
            want = s_star
            if close(xs[vis], want[vis], tolerance(want, dtype)) or close(xs[vis], s_ref[vis], tolerance(want, dtype)):
                blocked = xs[~vis]
                low = blocked <= _BLOCKED
                if bool(low.all()):
                    pass  # the mask is right: the softmax is what departs
                elif close(xs, want, tolerance(want, dtype)) or close(xs, s_ref, tolerance(want, dtype)):
                    return Finding("M", _steps.MASK, "", "mask_missing", base, where, probe, matched=len(matched))
                else:
                    fills = sorted({round(float(v), 6) for v in blocked[~low]})
                    return Finding("M", _steps.MASK, "", "mask_fill", {**base, "fill": fills[0]}, where, probe, matched=len(matched))
            yours = xs[0, 0] <= _BLOCKED
            blocked_right = ~ref.keep
            diagram = [(f"query {i}", "".join("x" if v else "." for v in blocked_right[i].tolist()),
                        "".join("x" if v else "." for v in yours[i].tolist())) for i in range(blocked_right.shape[0])]
            if bool((yours == ref.keep).all()):
                return Finding("M", _steps.MASK, "", "mask_inverted", base, where, probe, diagram, len(matched))
            extra = sorted({(int(i), int(j)) for i, j in (yours & ~blocked_right).nonzero().tolist()})
            return Finding("M", _steps.MASK, "", "mask_pattern", {**base, "extra": len(extra)}, where, probe, diagram,
                           len(matched))
    if stage == "W" and sm is not None:
        where = sm.where
        base.update(line=where.line if where else "?", code=where.code if where else "", func=sm.func)
        dim = sm.kwargs.get("dim")
        if dim is None:
            ints = [a for a in sm.args if isinstance(a, int) and not isinstance(a, bool)]
            dim = ints[0] if ints else None
        nd = x.dim() if x is not None else 4
        if dim is None:
            dim = 0 if nd in (0, 1, 3) else 1  # what torch picks when dim is not given
            implicit = True
        else:
            implicit = False
        axis = None
        for s, form in _stage_of(labels, sm.source(0)):
            names = _groups(form)
            if len(names) == nd and s in ("S", "S*", "M"):
                axis = names[dim][-1]
        if axis is None and x is not None and nd == 4:
            axis = "bhqk"[dim]
        if axis is not None and axis != "k":
            where = sm.where
            base.update(line=where.line if where else "?", code=where.code if where else "")
            return finding("W", "softmax_axis", axis=axis, dim=dim, implicit=implicit)
        return finding("W", "softmax_other")
    if stage == "C" and op is not None and op.func in ("view", "reshape", "flatten"):
        for s, form in _stage_of(labels, op.source(0)):
            if s == "O" and form.startswith("b h"):
                merged = op.outputs[0] if op.outputs else None
                diagram = []
                if merged is not None and merged.dim() == 3:
                    chunks = ref.tensors["O"][0].permute(1, 0, 2)  # (h, q, d) -> (q, h, d)
                    labels_row = []
                    for row in merged[0, : min(lq, 3)].reshape(-1, d):
                        hit = ((chunks - row).abs().amax(-1) <= 1e-5 * (1 + row.abs().max())).nonzero()
                        labels_row.append(f"t{int(hit[0, 0])}h{int(hit[0, 1])}" if len(hit) else "?")
                    for t in range(min(lq, 3)):
                        diagram.append((f"token {t}", " ".join(f"t{t}h{g}" for g in range(h)),
                                        " ".join(labels_row[t * h:(t + 1) * h])))
                return finding("C", "merge_no_transpose", diagram)
        return finding("C", "merge_other")
    if stage == "Y":
        uses = [o for o in rec.ops if weights_of.get("o", "?") in o.inputs]
        last = rec.ops[out_index] if out_index is not None else None
        if weights_of.get("o") and not uses:
            where = last.where if last is not None else None
            base.update(line=where.line if where else "?", code=where.code if where else "")
            return finding("Y", "out_unused", weight=weights_of["o"].replace("param ", ""))
        if len(uses) > 1 or any(o.func in ("__getitem__", "narrow", "split", "chunk") for o in uses):
            where = uses[0].where
            base.update(line=where.line if where else "?", code=where.code if where else "")
            return finding("Y", "out_per_head")
        return finding("Y", "out_other")
    if stage == "O":
        return finding(stage, "weighted_other")
    return finding(stage, "generic")


def _scale_guess(c: float, d: int, ref: Reference) -> str:
    """What a factor ``c`` looks like: "1" (no scale), "1/D", "sqrt(D)", "1/sqrt(E)"... or ""."""
    e = ref.tensors["C"].shape[-1]
    for value, text in ((1.0, "1"), (1.0 / d, "1/D"), (math.sqrt(d), "√D"), (float(d), "D"),
                        (1.0 / math.sqrt(e), "1/√d_model"), (1.0 / e, "1/d_model")):
        if math.isclose(c, value, rel_tol=1e-3):
            return text
    return ""
