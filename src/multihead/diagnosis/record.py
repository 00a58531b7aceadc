"""Record every tensor a user's forward produces, with the source line that made it.

    >>> import torch
    >>> from multihead.diagnosis.record import Recorder
    >>> x = torch.ones(2, 3)
    >>> with Recorder({id(x): "input query"}) as rec:
    ...     y = (x * 2).transpose(0, 1)
    >>> [(op.func, op.inputs) for op in rec.ops]
    [('mul', ['input query']), ('transpose', ['op 0'])]

A :class:`torch.overrides.TorchFunctionMode` sees each torch function and tensor method the
forward calls (``F.linear``, ``view``, ``@``, ``softmax``, ``masked_fill``...; a call such as
``F.scaled_dot_product_attention`` is one op: what it calls inside is not seen). Each op keeps
a float64 copy of its outputs on the CPU, where its tensor inputs came from (a probe input, a
parameter of the module, an earlier op), its non-tensor arguments, and the first frame outside
torch and multihead: the user's file, line and code. An op that raises is kept too
(:attr:`Recorder.failed`), so a forward that fails still says where.
"""

from __future__ import annotations

import linecache
import os
import sys
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["Op", "Recorder", "Where", "where_raised"]

_SKIP = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: methods that read a tensor's metadata: not ops of the computation
_META = {"size", "dim", "numel", "__get__", "__len__", "is_floating_point", "is_contiguous", "stride",
         "data_ptr", "element_size", "__format__", "__repr__", "__bool__", "item", "tolist", "__index__",
         "__int__", "__float__", "__hash__", "is_complex", "get_device", "__iter__"}


@dataclass(frozen=True)
class Where:
    """A source line: the file, its line number, the function and the code written there."""

    file: str
    line: int
    function: str
    code: str

    def __str__(self) -> str:
        return f"{os.path.basename(self.file)}:{self.line}"


@dataclass
class Op:
    """One op of the forward: ``func`` its name; ``inputs`` where each tensor argument came
    from ("input query", "param q_proj.weight", "op 3", "constant"); ``args`` its non-tensor
    arguments (shapes, dims, fill values); ``outputs`` float64 CPU copies of the tensors it
    returned; ``where`` the user's line; ``error`` what it raised, if it did."""

    index: int
    func: str
    inputs: list[str]
    args: list[Any]
    outputs: list[torch.Tensor]
    where: Optional[Where]
    kwargs: dict[str, Any] = field(default_factory=dict)
    input_shapes: list[tuple[int, ...]] = field(default_factory=list)
    error: Optional[BaseException] = None

    def source(self, i: int) -> Optional[int]:
        """The op index input ``i`` came from, or None."""
        s = self.inputs[i]
        return int(s[3:]) if s.startswith("op ") else None


def _name(func: Any) -> str:
    name = getattr(func, "__name__", None) or getattr(func, "name", None) or str(func)
    return str(name)


def _where() -> Optional[Where]:
    frame: Optional[FrameType] = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_SKIP) and "contextlib" not in path:
            code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
            return Where(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name, code)
        frame = frame.f_back
    return None  # every frame is torch's or multihead's


def where_raised(error: BaseException) -> Optional[Where]:
    """The innermost frame of ``error``'s traceback in the user's code (outside torch and multihead)."""
    found = None
    tb = error.__traceback__
    while tb is not None:
        path = os.path.abspath(tb.tb_frame.f_code.co_filename)
        if not path.startswith(_SKIP):
            code = linecache.getline(tb.tb_frame.f_code.co_filename, tb.tb_lineno).strip()
            found = Where(tb.tb_frame.f_code.co_filename, tb.tb_lineno, tb.tb_frame.f_code.co_name, code)
        tb = tb.tb_next
    return found


def _flat(obj: Any) -> list[Any]:
    if isinstance(obj, (list, tuple)):
        return [y for x in obj for y in _flat(x)]
    if isinstance(obj, dict):
        return [y for x in obj.values() for y in _flat(x)]
    return [obj]


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Size):
        return tuple(value)
    if isinstance(value, (int, float, bool, str, type(None))):
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value) if not isinstance(value, torch.Size) else tuple(value)
    if isinstance(value, torch.dtype):
        return str(value)
    return type(value).__name__


class Recorder(TorchFunctionMode):
    """Records the ops of the code run inside ``with Recorder(names):``; ``names`` maps
    ``id(tensor)`` of the probe inputs and the module's parameters to their names."""

    def __init__(self, names: dict[int, str]):
        super().__init__()
        self.names = dict(names)
        self.ops: list[Op] = []
        self.failed: Optional[Op] = None
        self._origin: dict[int, str] = {}
        self._alive: list[torch.Tensor] = []  # keeps the ids of recorded tensors from being reused

    def origin(self, t: torch.Tensor) -> str:
        """Where ``t`` came from (see :class:`Op`)."""
        return self._origin.get(id(t)) or self.names.get(id(t)) or "constant"

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = _name(func)
        if name in _META:
            return func(*args, **kwargs)
        everything = _flat(list(args)) + _flat(kwargs)
        tensors = [a for a in everything if isinstance(a, torch.Tensor)]
        inputs = [self.origin(t) for t in tensors]
        extra = [_plain(a) for a in _flat(list(args)) if not isinstance(a, torch.Tensor)]
        kw = {k: _plain(v) for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
        shapes = [tuple(t.shape) for t in tensors]
        try:
            out = func(*args, **kwargs)
        except Exception as error:
            if self.failed is None:
                self.failed = Op(len(self.ops), name, inputs, extra, [], _where(), kw, shapes, error)
            raise
        outs = [t for t in _flat(out) if isinstance(t, torch.Tensor)]
        if outs:
            index = len(self.ops)
            copies = []
            for t in outs:
                self._origin[id(t)] = f"op {index}"
                self._alive.append(t)
                copies.append(t.detach().to("cpu", torch.float64) if t.is_floating_point() else t.detach().cpu())
            self.ops.append(Op(index, name, inputs, extra, copies, _where(), kw, shapes))
        return out
