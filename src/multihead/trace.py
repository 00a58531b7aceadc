"""Recording the steps of a real forward pass.

``with multihead.trace() as t: y = mha(x)`` records every named step that the code users run
takes (projections, the head split, scores, mask, softmax, ...), with its shape, axis names,
einops-style pattern, whether it moved data, and checks computed on the tensors.

Recording stays out of the math: the forward pass asks `current` once per function and
records only when a trace is active. With no trace active that is the only cost.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch

from . import steps as _steps

__all__ = ["trace", "Trace", "Step", "ModuleCall", "current"]

class _Active(threading.local):
    """This thread's stack of active traces. The class attribute is what a thread that never
    entered a trace reads: no per-thread lookup that fails (``getattr(local, name, None)``
    raises and catches an AttributeError on every forward of every module)."""

    stack: "list[Trace]" = []


_state = _Active()


def current() -> Optional["Trace"]:
    """The innermost active trace on this thread, or None."""
    stack = _state.stack
    return stack[-1] if stack else None


def _jsonable(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    return value


@dataclass
class Step:
    """One step of a forward pass.

    kind: its :class:`multihead.steps.StepKind` (what it is, in both languages); params: the
    structured facts the producer recorded (the scale and D, the backend and kernel, the mask
    kinds, rope's positions and base, the cache length, ...; see ``kind.params``); role: which
    tensor it acts on ("Q", "K", "V") when the step runs once per tensor; pattern: einops-style
    shape change or None; shape/axes: the output's sizes and axis names; view: True when the
    output shares storage with its input (no data moved); checks: named booleans computed on the
    tensors (keys of :data:`multihead.steps.CHECKS`); dtype: the output's dtype name.
    path / layer / call: the module that ran it (its name under the traced root, "" when the
    trace has no root or the step ran outside a module), the layer index (the first integer in
    the path, else the module's order of first appearance in the trace; None outside a module)
    and which forward call of the trace it belongs to (0, 1, ...; None outside a module).
    ``tensor`` keeps a detached copy of the output when the trace was asked to keep values, and
    ``extras`` copies of side tensors that explain the step (the mask step's bool ``keep``).
    """

    kind: _steps.StepKind
    pattern: Optional[str]
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    view: bool
    checks: dict[str, bool] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    role: str = ""
    dtype: str = ""
    path: str = ""
    layer: Optional[int] = None
    call: Optional[int] = None
    tensor: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
    extras: dict[str, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

    def _values(self, sizes: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        return {**(sizes or {}), **self.params, "role": self.role, "view": self.view}

    @property
    def name(self) -> str:
        """The kind's English name without the role ("split heads"; "causal & padding mask")."""
        if self.kind is _steps.MASK:
            return f"{' & '.join(self.params['kinds'])} mask"
        return self.kind.name.replace(" {role}", "")

    @property
    def label(self) -> str:
        """The name with the role: what :meth:`Trace.step` looks up ("split heads K", "project Q")."""
        return f"{self.name} {self.role}" if self.role else self.name

    def title(self, lang: str = "en") -> str:
        """The step's title in ``lang`` ("split heads K", "分头（键 K）")."""
        role = _steps.ROLES[self.role][_steps.LANGS.index(lang)] if self.role else ""
        text = _steps.fill_text(self.kind.title, {**self._values(), "role": role}, lang)
        if role and not (isinstance(self.kind.title, tuple) and "{role}" in self.kind.title[0]):
            text = f"{text} {role}" if lang == "en" else f"{text}（{role}）"
        return text

    def meaning(self, lang: str = "en", sizes: Optional[dict[str, Any]] = None) -> str:
        """One line saying what the step means, with ``sizes`` (the example's B, Lq, ...) filled in."""
        return _steps.fill_text(self.kind.meaning, self._values(sizes), lang)

    def note_text(self, lang: str = "en") -> str:
        """The step's note in ``lang``, written from its params ("" when it has none)."""
        return _steps.fill_text(self.kind.note, self._values(), lang)

    @property
    def note(self) -> str:
        """The English note (:meth:`note_text`): which kernel ran, which mask, which positions."""
        return self.note_text("en")

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.label,
            "kind": self.kind.id,
            "role": self.role,
            "params": {k: _jsonable(v) for k, v in self.params.items()},
            "pattern": self.pattern,
            "shape": list(self.shape),
            "axes": list(self.axes),
            "view": self.view,
            "checks": dict(self.checks),
            "note": self.note,
            "dtype": self.dtype,
            "path": self.path,
            "layer": self.layer,
        }


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


#: How a :class:`Trace` shows itself in Jupyter (``Trace._repr_html_``): ``html_renderer(trace)``
#: returns the HTML of one output cell. The package's front door (``import multihead``) installs
#: :func:`multihead.explain.notebook.trace_html`, loaded on first display; the trace module
#: itself imports nothing of the explain package (imports point one way).
html_renderer: Optional[Callable[["Trace"], str]] = None


@dataclass
class ModuleCall:
    """One forward call of a module inside a trace: its path under the root, layer index, config."""

    path: str
    layer: int
    config: dict[str, Any] = field(default_factory=dict)


class Trace:
    """The record of one or more forward passes. Use through `trace`."""

    def __init__(self, *, keep_values: bool = True, root: Optional[torch.nn.Module] = None):
        self.keep_values = keep_values
        self.root = root
        self.steps: list[Step] = []
        self.config: dict[str, Any] = {}
        self.calls: list[ModuleCall] = []
        self._open: Optional[int] = None  # index into calls of the module call now running
        self._pending: dict[str, Any] = {}  # set_config values for the next call
        self._layers: dict[int, int] = {}  # id(module) -> its order of first appearance
        self._names: dict[int, str] = {}  # id(module) -> its path under root

    # -- recording (called by the forward pass)
    def record(
        self,
        kind: Union[_steps.StepKind, str],
        tensor: torch.Tensor,
        *,
        role: str = "",
        params: Optional[dict[str, Any]] = None,
        axes: Optional[tuple[str, ...]] = None,
        source: Optional[torch.Tensor] = None,
        checks: Optional[dict[str, bool]] = None,
        extras: Optional[dict[str, torch.Tensor]] = None,
        module: Optional[torch.nn.Module] = None,
    ) -> Step:
        """Append one step of ``kind`` (a :class:`multihead.steps.StepKind` or its id).

        params: the facts the kind's texts and cost are written from (``kind.params``); axes:
        the output's axis names when they differ from the kind's; ``source``: the step's input,
        for the view test and layout checks; ``extras``: side tensors kept (with
        ``keep_values``) to explain the step; ``module``: given with the input step, the module
        whose forward call starts here (its path and layer go on every step until the output
        projection closes the call)."""
        k = _steps.get(kind)
        if k is _steps.INPUT and module is not None:
            self._begin(module)
        view = source is not None and _shares_storage(tensor, source)
        all_checks = dict(checks or {})
        if source is not None:
            all_checks.update(_layout_checks(k, tensor, source, view))
        call = self.calls[self._open] if self._open is not None else None
        step = Step(
            kind=k,
            pattern=k.pattern,
            shape=tuple(tensor.shape),
            axes=tuple(k.axes if axes is None else axes),
            view=view,
            checks={c: bool(v) for c, v in all_checks.items()},
            params=dict(params or {}),
            role=role,
            dtype=str(tensor.dtype).replace("torch.", ""),
            path=call.path if call is not None else "",
            layer=call.layer if call is not None else None,
            call=self._open,
            tensor=tensor.detach().clone() if self.keep_values else None,
            extras={n: v.detach().clone() for n, v in (extras or {}).items()} if self.keep_values else {},
        )
        self.steps.append(step)
        if k is _steps.OUTPUT_PROJECTION:
            self._open = None
        return step

    def enter(self, module: torch.nn.Module) -> None:
        """Start a call of ``module`` (an attention layer whose steps the backends record, such as a
        Hugging Face layer running on multihead): the steps until :meth:`leave` carry its path and
        layer. ``MultiHeadAttention`` does this itself, with its input step."""
        self._begin(module)

    def leave(self) -> None:
        """End the call that :meth:`enter` started."""
        self._open = None

    def _begin(self, module: torch.nn.Module) -> None:
        path = self._path(module)
        layer = _layer_of(path)
        if layer is None:
            layer = self._layers.setdefault(id(module), len(self._layers))
        self.calls.append(ModuleCall(path, layer, dict(self._pending)))
        self._pending = {}
        self._open = len(self.calls) - 1

    def _path(self, module: torch.nn.Module) -> str:
        if self.root is None:
            return ""
        if id(module) not in self._names:  # read again: the root may have changed since
            self._names = {id(m): name for name, m in self.root.named_modules()}
        return self._names.get(id(module), "")

    def set_config(self, **config: Any) -> None:
        """Record settings; the first value of each key wins, except that the backend actually
        chosen replaces "auto". Each module call also keeps its own (``calls[i].config``)."""
        for key, value in config.items():
            if key == "backend" and self.config.get(key) == "auto":
                self.config[key] = value
            else:
                self.config.setdefault(key, value)
        own = self.calls[self._open].config if self._open is not None else self._pending
        for key, value in config.items():
            if key == "backend" and own.get(key) == "auto":
                own[key] = value
            else:
                own.setdefault(key, value)

    # -- reading
    def select(
        self,
        kind: Union[_steps.StepKind, str, None] = None,
        *,
        role: Optional[str] = None,
        layer: Optional[int] = None,
        path: Optional[str] = None,
        call: Optional[int] = None,
    ) -> list[Step]:
        """The steps of ``kind`` (a StepKind or its id; None = any) with the given role, layer,
        module path and call (None = any)."""
        k = None if kind is None else _steps.get(kind)
        return [
            s for s in self.steps
            if (k is None or s.kind is k) and (role is None or s.role == role)
            and (layer is None or s.layer == layer) and (path is None or s.path == path)
            and (call is None or s.call == call)
        ]

    def step(
        self,
        key: Union[_steps.StepKind, str],
        *,
        role: Optional[str] = None,
        layer: Optional[int] = None,
        path: Optional[str] = None,
        call: Optional[int] = None,
    ) -> Step:
        """The first step whose label (name plus role) is ``key``, or, for a StepKind or a kind's
        id, the first step of that kind; ``role``, ``layer``, ``path`` and ``call`` narrow the
        search (``tr.step("softmax", layer=1)``)."""
        where = [s for s in self.select(role=role, layer=layer, path=path, call=call)]
        found = [s for s in where if s.label == key] if isinstance(key, str) else []
        if not found and (isinstance(key, _steps.StepKind) or key in _steps.KINDS):
            k = _steps.get(key)
            found = [s for s in where if s.kind is k]
        if found:
            return found[0]
        narrowed = {n: v for n, v in (("role", role), ("layer", layer), ("path", path), ("call", call)) if v is not None}
        scope = f" with {narrowed}" if narrowed else ""
        raise KeyError(f"no step named {key!r}{scope}; steps are {[s.label for s in where]}")

    @property
    def checks(self) -> dict[str, bool]:
        """Every check of every step, as ``{"step: check": bool}`` (steps of a stack's layer L
        are written "L1 step: check" from the second layer on)."""
        return {f"{_where(s)}{s.label}: {name}": ok for s in self.steps for name, ok in s.checks.items()}

    @property
    def all_checks_hold(self) -> bool:
        return all(self.checks.values())

    def to_dict(self) -> dict[str, Any]:
        return {"config": dict(self.config), "steps": [s.to_dict() for s in self.steps]}

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False, **kwargs)

    def __str__(self) -> str:
        layered = any(s.path or (s.layer or 0) > 0 for s in self.steps)
        rows = [(("layer",) if layered else ()) + ("step", "shape", "axes", "pattern", "view")]
        for s in self.steps:
            rows.append(
                ((s.path or ("" if s.layer is None else str(s.layer)),) if layered else ())
                + (
                    s.label,
                    "(" + ", ".join(str(n) for n in s.shape) + ")",
                    " ".join(s.axes),
                    s.pattern or "",
                    "view" if s.view else "",
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        checks = self.checks
        if checks:
            held = sum(checks.values())
            lines.append(f"checks: {held}/{len(checks)} hold")
            lines.extend(f"  [{'ok' if ok else 'FAIL'}] {name}" for name, ok in checks.items())
        return "\n".join(lines)

    def __len__(self) -> int:
        return len(self.steps)

    def __repr__(self) -> str:
        """One line; ``print(trace)`` gives the table of steps."""
        checks = self.checks
        return _steps.singular_ones(f"<multihead.Trace: {len(self.steps)} steps in {max(len(self.calls), 1)} calls, "
                                    f"checks {sum(checks.values())}/{len(checks)} hold; print() for the steps>")

    def _repr_html_(self) -> Optional[str]:
        """Jupyter's inline display: the walkthrough page of this trace in an isolated iframe, drawn
        by :data:`html_renderer` (None: Jupyter shows the repr)."""
        return None if html_renderer is None else html_renderer(self)

    # -- context manager
    def __enter__(self) -> "Trace":
        if "stack" not in _state.__dict__:  # this thread's first trace: its own list, not the shared default
            _state.stack = []
        _state.stack.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _state.stack.remove(self)


def _where(step: Step) -> str:
    return f"L{step.layer} " if step.layer else ""


def _layer_of(path: str) -> Optional[int]:
    """The first integer component of a module path: 1 for "blocks.1.attn", None for "attn"."""
    for part in path.split("."):
        if part.isdigit():
            return int(part)
    return None


def trace(root: Optional[torch.nn.Module] = None, *, keep_values: bool = True) -> Trace:
    """Record the steps of every multihead forward pass run inside the ``with`` block.

    ``root``: the model being traced (any ``nn.Module``); each step then carries the path of
    the attention module that ran it under ``root`` (``"blocks.1.attn"``) and the layer index in
    that path, which :meth:`Trace.step` and :meth:`Trace.select` can select by.
    ``keep_values=False`` records shapes and checks only (no tensor copies).

    >>> import torch, multihead
    >>> mha = multihead.MultiHeadAttention(16, 2)
    >>> with multihead.trace() as tr:
    ...     out = mha(torch.randn(1, 3, 16))
    >>> tr.all_checks_hold, tr.step("input").label
    (True, 'input')
    """
    if not isinstance(keep_values, bool):
        raise TypeError(f"keep_values must be True or False, got {keep_values!r}")
    _check_root(root)
    return Trace(keep_values=keep_values, root=root)


def _check_root(root: object) -> None:
    if root is not None and not isinstance(root, torch.nn.Module):
        hint = "; keep_values is keyword-only: trace(keep_values=...)" if isinstance(root, bool) else ""
        raise TypeError(f"root must be the nn.Module being traced (or None), got {type(root).__name__}{hint}")


def _layout_checks(kind: _steps.StepKind, out: torch.Tensor, src: torch.Tensor, view: bool) -> dict[str, bool]:
    """Checks for the pure layout steps: the same numbers come out, only indexed differently."""
    if kind is _steps.SPLIT_HEADS:
        return {"same data after view": view and torch.equal(out.reshape(src.shape), src)}
    if kind is _steps.MOVE_HEADS_FORWARD or kind is _steps.MOVE_HEADS_BACK:
        return {"same data after transpose": view and torch.equal(out.transpose(1, 2), src)}
    if kind is _steps.MERGE_HEADS:
        return {"heads concatenated back to d_out": torch.equal(out.view(src.shape), src)}
    return {}
