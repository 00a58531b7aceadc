"""The backend registry: what a backend is (`Backend`), what it is asked (`Call`), and how
``"auto"`` chooses (`AUTO_ORDER`, `resolve`, `explain_dispatch_call`). The backends import this
module; `multihead.backends` imports the backends, so that each registers itself.

Legend: B batch, H query heads, Hkv key/value heads, Lq/Lk query/key lengths, D head dim,
Dv value head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, NamedTuple, Optional

import torch

from .. import trace as _trace
from ..masks import Mask

BackendName = Literal["auto", "reference", "sdpa", "chunked", "flex"]
"""The built-in backends' names, the type of ``backend=``; at run time any registered name (a
backend added with `register` included) is accepted, and an unknown one is a ValueError."""

__all__ = ["BackendName", "Backend", "Call", "register", "get", "names", "resolve", "explain_dispatch_call", "Dispatch"]


class Call(NamedTuple):
    """What a backend is asked to do, for deciding whether it can.

    An immutable record (a NamedTuple: one is built for every attention call, and a tuple is
    built in a third of a frozen dataclass's time)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: Optional[Mask]
    dropout_p: float
    need_weights: bool = False
    #: whether the call is traced by torch.compile (None: ask ``torch.compiler.is_compiling()``)
    compiling: Optional[bool] = None
    #: whether the caller wants the log-sum-exp too (``return_lse=True``)
    need_lse: bool = False

    @property
    def under_compile(self) -> bool:
        return torch.compiler.is_compiling() if self.compiling is None else self.compiling

    @property
    def needs_grad(self) -> bool:
        """Whether autograd will ask this call for gradients: grad mode on and q, k, v or one of the
        mask's float tensors (biases, ALiBi slopes, sink logits, a score_mod's) requiring grad."""
        if not torch.is_grad_enabled():
            return False
        tensors = [self.q, self.k, self.v]
        if self.mask is not None:
            tensors += list(self.mask.tensors)
            for p in self.mask.parts:
                tensors += [t for name in ("tensor", "slopes", "logits") if isinstance(t := getattr(p, name, None), torch.Tensor)]
        return any(t.requires_grad for t in tensors)


@dataclass(frozen=True)
class Backend:
    name: str
    fn: Callable[..., torch.Tensor]
    refuses: Callable[[Call], Optional[str]]
    summary: str
    #: why ``"auto"`` should pass this call to a later backend although this one could run it
    auto_declines: Optional[Callable[[Call], Optional[str]]] = None
    #: how this backend would run the call (its kernel, the tensors it builds), for explain_dispatch
    describe: Optional[Callable[[Call], str]] = None
    #: ``(out, lse)`` for the arguments of ``fn``; None: this backend cannot give the lse
    lse_fn: Optional[Callable[..., tuple[torch.Tensor, torch.Tensor]]] = None
    #: a quick sufficient test, for a call without mask, dropout, weights or lse (a decode step),
    #: that this backend neither refuses it nor would decline it for ``"auto"``; when it says True
    #: for the first backend of `AUTO_ORDER`, auto takes that one without asking for reasons.
    #: It must hold for every call that differs only by having fewer keys (`multihead.decoding`
    #: asks it once for a cache's longest step). None: auto always asks ``refuses`` and ``auto_declines``
    takes_plain: Optional[Callable[[Call], bool]] = None


@dataclass(frozen=True)
class Dispatch:
    """Which backend ``"auto"`` would run, how (``how``; "" when it does not say), and why each
    other one was not chosen."""

    backend: str
    refused: dict[str, str]
    how: str = ""

    def __str__(self) -> str:
        lines = [f"backend: {self.backend}"] + ([f"  runs: {self.how}"] if self.how else [])
        lines += [f"  not {name}: {why}" for name, why in self.refused.items()]
        return "\n".join(lines)


_REGISTRY: dict[str, Backend] = {}

#: preference order for ``backend="auto"``: the built-in backends, fastest first (each of them
#: registers itself when `multihead.backends` imports it); a backend added with
#: ``register(..., auto_rank=i)`` joins it at position i
AUTO_ORDER: list[str] = ["sdpa", "flex", "chunked", "reference"]


def register(backend: Backend, *, auto_rank: Optional[int] = None) -> Backend:
    """Add ``backend``; with ``auto_rank`` it also joins AUTO_ORDER at that position."""
    _REGISTRY[backend.name] = backend
    if auto_rank is not None and backend.name not in AUTO_ORDER:
        AUTO_ORDER.insert(auto_rank, backend.name)
    return backend


def names() -> list[str]:
    return ["auto", *_REGISTRY]


def get(name: str) -> Backend:
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; known backends: {', '.join(names())}")
    return _REGISTRY[name]


def _refusal(backend: Backend, call: Call) -> Optional[str]:
    """Why ``backend`` cannot run ``call`` at all, or None."""
    if call.need_lse and backend.lse_fn is None:
        able = [name for name, b in _REGISTRY.items() if b.lse_fn is not None]
        return (f"it does not return the log-sum-exp (return_lse=True); backends that do: "
                f"{', '.join(repr(n) for n in able)}")
    return backend.refuses(call)


def why_not(backend: Backend, call: Call) -> Optional[str]:
    """Why ``auto`` passes ``call`` over ``backend``, or None when it can take it."""
    why = _refusal(backend, call)
    if why is None and backend.auto_declines is not None:
        why = backend.auto_declines(call)
    return why


def explain_dispatch_call(call: Call) -> Dispatch:
    refused: dict[str, str] = {}
    chosen = None
    for name in AUTO_ORDER:
        why = why_not(_REGISTRY[name], call)
        if why is None and chosen is None:
            chosen = name
        elif why is not None:
            refused[name] = why
        else:
            refused[name] = f"'{chosen}' comes first in the auto order"
    assert chosen is not None, "the reference backend accepts every call"
    describe = _REGISTRY[chosen].describe
    return Dispatch(chosen, refused, describe(call) if describe is not None else "")


def resolve(name: str, call: Call) -> Backend:
    """The backend to run ``call`` with: ``name`` itself, or the auto choice.

    For ``"auto"`` this asks the backends in AUTO_ORDER only until one accepts; the reasons of
    all of them are gathered only when a trace is recording (it stores them).
    """
    return resolve_traced(name, call, _trace.current())


def resolve_traced(name: str, call: Call, tr: Optional[_trace.Trace]) -> Backend:
    """:func:`resolve`, for a caller that looked up the trace (``tr``, or None) already."""
    if name == "auto":
        if tr is not None:
            dispatch = explain_dispatch_call(call)
            tr.set_config(dispatch={"backend": dispatch.backend, "refused": dict(dispatch.refused)})
            return _REGISTRY[dispatch.backend]
        if call.mask is None and not call.dropout_p and not call.need_weights and not call.need_lse:
            first = _REGISTRY[AUTO_ORDER[0]]
            if first.takes_plain is not None and first.takes_plain(call):
                return first
        for candidate in AUTO_ORDER:
            backend = _REGISTRY[candidate]
            if why_not(backend, call) is None:
                return backend
        raise AssertionError("the reference backend accepts every call")
    backend = get(name)
    why = _refusal(backend, call)
    if why is not None:
        raise ValueError(f"backend {name!r} cannot run this call: {why}; use backend='auto'")
    return backend


