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
from typing import Any, Optional

import torch

__all__ = ["trace", "Trace", "Step", "current"]

_state = threading.local()


def current() -> Optional["Trace"]:
    """The innermost active trace on this thread, or None."""
    stack = getattr(_state, "stack", None)
    return stack[-1] if stack else None


@dataclass
class Step:
    """One step of a forward pass.

    name: what the step does ("split heads", "softmax", ...); role: which tensor it acts on
    ("Q", "K", "V") when the step runs once per tensor; pattern: einops-style shape change or
    None; shape/axes: the output's sizes and axis names; view: True when the output shares
    storage with its input (no data moved); checks: named booleans computed on the tensors;
    note: a short remark (which kernel ran, which mask); dtype: the output's dtype name.
    ``tensor`` keeps a detached copy of the output when the trace was asked to keep values, and
    ``extras`` copies of side tensors that explain the step (the mask step's bool ``keep``).
    """

    name: str
    pattern: Optional[str]
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    view: bool
    checks: dict[str, bool] = field(default_factory=dict)
    note: str = ""
    role: str = ""
    dtype: str = ""
    tensor: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
    extras: dict[str, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

    @property
    def label(self) -> str:
        return f"{self.name} {self.role}".strip() if self.role and self.role not in self.name else self.name

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.label,
            "pattern": self.pattern,
            "shape": list(self.shape),
            "axes": list(self.axes),
            "view": self.view,
            "checks": dict(self.checks),
            "note": self.note,
            "dtype": self.dtype,
        }


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class Trace:
    """The record of one or more forward passes. Use through `trace`."""

    def __init__(self, *, keep_values: bool = True):
        self.keep_values = keep_values
        self.steps: list[Step] = []
        self.config: dict[str, Any] = {}

    # -- recording (called by the forward pass)
    def record(
        self,
        name: str,
        tensor: torch.Tensor,
        pattern: Optional[str] = None,
        axes: tuple[str, ...] = (),
        *,
        source: Optional[torch.Tensor] = None,
        checks: Optional[dict[str, bool]] = None,
        note: str = "",
        role: str = "",
        extras: Optional[dict[str, torch.Tensor]] = None,
    ) -> Step:
        """Append one step. ``source``: the step's input, for the view test and layout checks;
        ``extras``: side tensors kept (with ``keep_values``) to explain the step."""
        view = source is not None and _shares_storage(tensor, source)
        all_checks = dict(checks or {})
        if source is not None and pattern is not None:
            all_checks.update(_layout_checks(name, tensor, source, view))
        step = Step(
            name=name,
            pattern=pattern,
            shape=tuple(tensor.shape),
            axes=tuple(axes),
            view=view,
            checks={k: bool(v) for k, v in all_checks.items()},
            note=note,
            role=role,
            dtype=str(tensor.dtype).replace("torch.", ""),
            tensor=tensor.detach().clone() if self.keep_values else None,
            extras={k: v.detach().clone() for k, v in (extras or {}).items()} if self.keep_values else {},
        )
        self.steps.append(step)
        return step

    def set_config(self, **config: Any) -> None:
        """Record settings; the first value of each key wins, except that the backend actually
        chosen replaces "auto"."""
        for key, value in config.items():
            if key == "backend" and self.config.get(key) == "auto":
                self.config[key] = value
            else:
                self.config.setdefault(key, value)

    # -- reading
    def step(self, label: str) -> Step:
        """The first step whose label (name plus role) is ``label``."""
        for s in self.steps:
            if s.label == label:
                return s
        raise KeyError(f"no step named {label!r}; steps are {[s.label for s in self.steps]}")

    @property
    def checks(self) -> dict[str, bool]:
        """Every check of every step, as ``{"step: check": bool}``."""
        return {f"{s.label}: {name}": ok for s in self.steps for name, ok in s.checks.items()}

    @property
    def all_checks_hold(self) -> bool:
        return all(self.checks.values())

    def to_dict(self) -> dict[str, Any]:
        return {"config": dict(self.config), "steps": [s.to_dict() for s in self.steps]}

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False, **kwargs)

    def __str__(self) -> str:
        rows = [("step", "shape", "axes", "pattern", "view")]
        for s in self.steps:
            rows.append(
                (
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

    def _repr_html_(self) -> str:
        """Jupyter's inline display: the walkthrough page of this trace in an isolated iframe
        (:mod:`multihead.explain.notebook`, imported only when a notebook asks)."""
        from .explain.notebook import trace_html

        return trace_html(self)

    # -- context manager
    def __enter__(self) -> "Trace":
        stack = getattr(_state, "stack", None)
        if stack is None:
            stack = _state.stack = []
        stack.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _state.stack.remove(self)


def trace(*, keep_values: bool = True) -> Trace:
    """Record the steps of every multihead forward pass run inside the ``with`` block.

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
    return Trace(keep_values=keep_values)


def _layout_checks(name: str, out: torch.Tensor, src: torch.Tensor, view: bool) -> dict[str, bool]:
    """Checks for the pure layout steps: the same numbers come out, only indexed differently."""
    if name == "split heads":
        return {"same data after view": view and torch.equal(out.reshape(src.shape), src)}
    if name == "move heads forward" or name == "move heads back":
        return {"same data after transpose": view and torch.equal(out.transpose(1, 2), src)}
    if name == "merge heads":
        return {"heads concatenated back to d_out": torch.equal(out.view(src.shape), src)}
    return {}
