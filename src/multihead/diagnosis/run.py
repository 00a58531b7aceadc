"""``diagnose(module)``: run the user's module and the definition on the probes, compare, locate.

    >>> import torch.nn as nn
    >>> from multihead.diagnosis import diagnose
    >>> diagnose(nn.MultiheadAttention(8, 2)).facts["batch_first"]      # found by trial
    False

For each way the module may be meant (head count, batch layout, causal or not: the ones its
attributes do not say are tried), every probe (:mod:`.probes`) is run through the module under
the recorder (:mod:`.record`) and through the reference (:mod:`.reference`). A reading whose
outputs all match is the verdict "matches" (with the conventions seen on the mask probe);
otherwise the reading that got furthest (the latest probe, then the latest first wrong stage,
then the most stages matched) gives the finding (:mod:`.locate`). Before any of it, the module
is run twice in eval mode: different outputs are randomness left on, a finding of its own.

Legend: B batch, Lq/Lk query/key lengths, E features, H heads.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Optional

import torch
import torch.nn as nn

from .. import steps as _steps
from .anatomy import Anatomy, find_anatomy
from .layouts import close
from .locate import Finding, locate, tolerance
from .probes import ENCODINGS, EMPTY_ROW, Probe, make_probes
from .record import Recorder
from .reference import STAGES, Reference, reference_steps
from .verdict import Convention, Diagnosis, oracle_bound

__all__ = ["diagnose"]


@contextlib.contextmanager
def _eval(module: nn.Module) -> Iterator[None]:
    modes = {m: m.training for m in module.modules()}
    module.eval()
    try:
        yield
    finally:
        for m, mode in modes.items():
            m.training = mode


def _names(a: Anatomy, inputs: dict[int, str]) -> dict[int, str]:
    return {**{i: f"param {n}" for i, n in a.params.items()}, **inputs}


def _run(module: nn.Module, a: Anatomy, probe: Probe, mask: Any, batch_first: bool,
         seed: int = 0) -> tuple[Recorder, Optional[torch.Tensor], Optional[int], Optional[BaseException]]:
    """(recorder, output (B, Lq, E) batch-first or None, the output's op index, the error or None)."""
    q = probe.query if batch_first else probe.query.transpose(0, 1).contiguous()
    k = None if probe.key is None else (probe.key if batch_first else probe.key.transpose(0, 1).contiguous())
    inputs = {id(q): "input query"}
    if k is not None:
        inputs[id(k)] = "input key"
    if isinstance(mask, torch.Tensor):
        inputs[id(mask)] = "input mask"
    args, kwargs = a.call.arguments(q, k, mask)
    rec = Recorder(_names(a, inputs))
    torch.manual_seed(seed)
    try:
        with torch.no_grad(), rec:  # hooks and forward, eager even after Module.compile(): each op must be seen
            out = getattr(module, "_call_impl")(*args, **kwargs)
    except Exception as error:  # the user's forward raised: that is what is diagnosed
        return rec, None, None, error
    while isinstance(out, (tuple, list)) and out:
        out = out[0]
    if not isinstance(out, torch.Tensor):
        return rec, None, None, TypeError(f"forward returned {type(out).__name__}, not a tensor or (tensor, ...)")
    origin = rec.origin(out)
    index = int(origin[3:]) if origin.startswith("op ") else None
    y = out.detach().to("cpu", torch.float64)
    if not batch_first and y.dim() == 3:
        y = y.transpose(0, 1)
    return rec, y, index, None


def _roles(a: Anatomy, probe: Probe) -> dict[str, str]:
    kv = "input key" if probe.key is not None and a.call.cross else "input query"
    return {"Q": "input query", "K": kv, "V": kv}


def _weights_of(a: Anatomy) -> dict[str, str]:
    out = {}
    for role in "qkvo":
        name = a.names.get(role)
        if name and " " not in name and not name.startswith("in_proj"):
            out[role] = f"param {name}.weight"
    return out


def _output_ok(y: Optional[torch.Tensor], ref: Reference, bound: float) -> bool:
    """Whether the output is the reference's within the oracle's ``bound``, on the rows that see a key."""
    want = ref.tensors["Y"]
    if y is None or y.shape != want.shape:
        return False
    rows = ref.rows
    return close(y[:, rows], want[:, rows], bound)


def _empty_row(y: torch.Tensor, ref: Reference, a: Anatomy, dtype: torch.dtype) -> Optional[str]:
    """The convention of the row that sees no key: None (0 weights, as multihead), or a words key."""
    want = ref.tensors["Y"]
    got, right = y[:, EMPTY_ROW], want[:, EMPTY_ROW]
    tol = tolerance(want, dtype)
    if close(got, right, tol):
        return None
    if bool(torch.isnan(got).all()):
        return "row_nan"
    v = ref.tensors["H:V"]  # (b, hkv, k, d): uniform weights average every value
    h = ref.num_heads
    mean = v.mean(2).repeat_interleave(h // v.shape[1], 1).reshape(v.shape[0], -1)
    wo = torch.eye(mean.shape[-1], dtype=torch.float64) if a.wo is None else a.wo.double().cpu()
    bo = None if a.bo is None else a.bo.double().cpu()
    uniform = torch.nn.functional.linear(mean, wo, bo)
    return "row_uniform" if close(got, uniform, tol * 4) else "row_other"


class _Outcome:
    def __init__(self) -> None:
        self.finding: Optional[Finding] = None
        self.depth: tuple[int, int, int] = (-1, -1, -1)
        self.conventions: list[Convention] = []
        self.error = 0.0
        self.bound = 0.0
        self.probes: list[str] = []


def _try(module: nn.Module, a: Anatomy, heads: int, batch_first: bool, causal: bool, dtype: torch.dtype,
         device: torch.device, explain: bool = True) -> _Outcome:
    """Run every probe for one reading of the module; on the first probe that differs, locate
    the first wrong step (unless ``explain`` is False: then only whether all match is wanted)."""
    result = _Outcome()
    probes = make_probes(int(a.wq.shape[1]), int(a.wk.shape[1]), dtype, device, cross=a.call.cross,
                         mask=a.call.mask is not None, causal=causal)
    for index, probe in enumerate(probes):
        result.probes.append(probe.describe())
        ref = reference_steps(a, heads, probe.query, probe.key, probe.keep, causal=causal)
        encodings: list[Any] = [None] if probe.keep is None else ENCODINGS
        attempts = []
        bound = oracle_bound(a, heads, causal, ref, probe.query, probe.key, probe.keep, dtype)
        for enc in encodings:
            mask = None if enc is None else enc[1](probe.keep.to(device), dtype)  # type: ignore[union-attr]
            rec, y, out_index, error = _run(module, a, probe, mask, batch_first)
            if error is None and _output_ok(y, ref, bound):
                assert y is not None
                if enc is not None:
                    name = enc[0]
                    if name.startswith(("block", "additive")):
                        result.conventions.append(Convention("mask_" + name.replace("4d", "")))
                    if name.endswith("4d"):
                        result.conventions.append(Convention("mask_4d"))
                    row = _empty_row(y, ref, a, dtype)
                    if row is not None:
                        result.conventions.append(Convention(row))
                rows = ref.rows
                result.error = max(result.error, float((y[:, rows] - ref.tensors["Y"][:, rows]).abs().max()))
                result.bound = max(result.bound, bound)
                break
            attempts.append((rec, y, out_index, error, enc))
        else:
            result.depth = (index, -1, -1)
            if not explain:
                result.finding = Finding("", _steps.OUTPUT_PROJECTION, "", "generic", {}, None, probe.describe())
                return result
            ran = [t for t in attempts if t[3] is None] or attempts[:1]
            attempts = ran
            best: Optional[tuple[tuple[int, int, int], Finding]] = None
            lk = probe.key.shape[1] if probe.key is not None else probe.query.shape[1]
            for rec, y, out_index, error, enc in attempts:
                f = locate(rec, ref, out_index, dtype, probe.describe(), _roles(a, probe), _weights_of(a), lk, error)
                f.probe_zh = probe.describe("zh")
                if error is not None and f.rule.endswith(("_other", "generic")):
                    f.rule = "raised"
                depth = (index, STAGES.index(f.stage) if f.stage in STAGES else 0, f.matched)
                if best is None or depth > best[0]:
                    best = (depth, f)
            assert best is not None
            result.depth, result.finding = best
            return result
    result.depth = (len(probes), len(STAGES), 0)
    return result


def _randomness(module: nn.Module, a: Anatomy, dtype: torch.dtype, device: torch.device,
                layouts: list[bool]) -> Optional[Finding]:
    """A finding when two eval-mode runs on the same input differ (dropout left on)."""
    probe = make_probes(int(a.wq.shape[1]), int(a.wk.shape[1]), dtype, device, cross=False, mask=False, causal=False)[0]
    for bf in layouts:
        rec, y1, _, e1 = _run(module, a, probe, None, bf, seed=1)
        _, y2, _, e2 = _run(module, a, probe, None, bf, seed=2)
        if e1 is None and e2 is None and y1 is not None and y2 is not None:
            if torch.equal(torch.nan_to_num(y1), torch.nan_to_num(y2)):
                return None
            found = Finding("dropout", _steps.DROPOUT, "", "dropout_eval", {"line": "?", "func": "?"}, None,
                            probe.describe(), probe_zh=probe.describe("zh"))
            for op in rec.ops:
                training = op.kwargs.get("training", op.args[1] if len(op.args) > 1 else True)
                if ("dropout" in op.func and training is True) or op.func in ("bernoulli", "bernoulli_", "rand", "rand_like"):
                    w = op.where
                    found.where = w
                    found.params = {"line": w.line if w else "?", "func": op.func, "code": w.code if w else ""}
                    break
            return found
    return None


_MASKING = ("masked_fill", "masked_fill_", "where", "tril", "triu", "tril_", "triu_")


def _masks_itself(module: nn.Module, a: Anatomy, dtype: torch.dtype, device: torch.device, layouts: list[bool]) -> bool:
    """Whether the forward masks its scores when no mask is given (a causal module): a masking
    op, ``is_causal=True``, or a bool (L, L) or -inf tensor made along the way."""
    probe = make_probes(int(a.wq.shape[1]), int(a.wk.shape[1]), dtype, device, cross=False, mask=False, causal=False)[0]
    lq = probe.query.shape[1]
    for bf in layouts:
        rec, _, _, error = _run(module, a, probe, None, bf)
        if error is not None:
            continue
        for op in rec.ops:
            if op.func in _MASKING or op.kwargs.get("is_causal") is True:
                return True
            for t in op.outputs:
                if t.dim() >= 2 and tuple(t.shape[-2:]) == (lq, lq) and (t.dtype == torch.bool or bool((t == -math.inf).any())):
                    return True
        return False
    return False


def _facts(a: Anatomy, heads: int, batch_first: bool, causal: bool) -> dict[str, Any]:
    fused = " ".join(sorted({a.names[r] for r in "qkv"})) if len({a.names[r].split(" ")[0] for r in "qkv"}) == 1 \
        else ", ".join(a.names[r] for r in "qkv")
    out = a.names.get("o", "no W_O") if a.wo is not None else "no W_O"
    return {"heads": heads, "head_dim": a.d_out // heads, "batch_first": batch_first, "causal": causal,
            "projections": f"q/k/v: {fused.split(' (')[0]}; out: {out}", "d_model": int(a.wq.shape[1])}


def diagnose(module: nn.Module, x: Optional[torch.Tensor] = None, *, num_heads: Optional[int] = None,
             batch_first: Optional[bool] = None, kwargs: Optional[dict[str, Any]] = None) -> Diagnosis:
    """Find the first step where ``module`` (your own multi-head attention) departs from the definition.

        >>> import torch.nn as nn, multihead
        >>> multihead.diagnose(nn.MultiheadAttention(8, 2, batch_first=True)).status
        'matches'

    Args:
        module: any attention ``nn.Module``: separate q/k/v/out Linears or a fused one, any
            attribute names, batch- or sequence-first, self- or cross-attention, with or without
            a mask argument, returning the output or (output, weights).
        x: an example input (B, L, E), optional: its feature size is checked and it fixes the
            device and dtype the probes run in (default: the module's parameters').
        num_heads: the head count, when the module has no attribute that says it (otherwise
            every divisor of the projections' width is tried).
        batch_first: the input layout, when the module does not say (otherwise both are tried).
        kwargs: further arguments ``forward`` needs (passed to every call).

    Returns:
        A :class:`multihead.diagnosis.Diagnosis`: ``.status`` "matches" or "bug", ``.finding``
        (the step, role, rule, source line, diagram), ``.conventions``, ``.error`` / ``.bound``;
        ``.text(lang)``, ``.to_json()``, ``.html(lang)`` and inline display in Jupyter.

    Raises:
        TypeError: ``module`` is not an nn.Module, ``x`` not a tensor.
        ValueError: not an attention module (naming what was looked for), too large (the limit
            is stated), parameters on several devices or on meta, a forward needing arguments
            that cannot be guessed (say what to pass), an ``x`` that does not fit.
    """
    module = getattr(module, "_orig_mod", module)  # torch.compile(module): the module it wraps
    a = find_anatomy(module, num_heads=num_heads, batch_first=batch_first, kwargs=kwargs)
    first = next(iter(module.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    dtype = first.dtype if first is not None and first.is_floating_point() else torch.float32
    if x is not None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be an example input tensor (B, L, E), got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != a.wq.shape[1]:
            raise ValueError(f"x has shape {tuple(x.shape)}, but the query projection takes {int(a.wq.shape[1])} "
                             f"features: pass x of shape (B, L, {int(a.wq.shape[1])})")
        if x.device != device:
            raise ValueError(f"x is on {x.device} but the module is on {device}: move one of them (module.to(x.device))")
        dtype = x.dtype
    layouts = [a.batch_first] if a.batch_first is not None else [True, False]
    name = type(module).__name__
    with _eval(module):
        dropout = _randomness(module, a, dtype, device, layouts)
        if dropout is not None:
            h = a.head_counts()[0]
            return Diagnosis(name, "bug", dropout, [], 0.0, 0.0, _facts(a, h, layouts[0], False), [dropout.probe])
        best: Optional[tuple[tuple[int, int, int], _Outcome, int, bool, bool]] = None
        masks_itself = _masks_itself(module, a, dtype, device, layouts)
        for heads in a.head_counts():
            for bf in layouts:
                for causal in ((True, False) if masks_itself else (False, True)):
                    outcome = _try(module, a, heads, bf, causal, dtype, device, explain=causal == masks_itself)
                    if outcome.finding is None:
                        conventions = list(outcome.conventions)
                        if causal and a.call.cross:
                            conventions.append(Convention("causal_self"))
                        return Diagnosis(name, "matches", None, conventions, outcome.error, outcome.bound,
                                         _facts(a, heads, bf, causal), outcome.probes)
                    if causal != masks_itself:  # a reading the code contradicts explains nothing
                        continue
                    if best is None or outcome.depth > best[0]:
                        best = (outcome.depth, outcome, heads, bf, causal)
    assert best is not None
    _, outcome, heads, bf, causal = best
    return Diagnosis(name, "bug", outcome.finding, outcome.conventions, outcome.error, outcome.bound,
                     _facts(a, heads, bf, causal), outcome.probes)
