"""The programmable kinds: FlexAttention's ``mask_mod`` and ``score_mod``, evaluated per tile.

`MaskMod` (role "select") is a function of the index tensors that returns where a query may
attend; its tile states come from a `BlockPlan` it makes once per shape. `ScoreMod` (role
"modify") rewrites the scores; it finds the tensors its function reads so that a kernel can
differentiate into them. Both are tried once on a small tile in `Mask.check`.

Legend: B batch, H query heads, Lq/Lk query/key lengths, bq/bk a tile's query/key counts.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ClassVar, Iterator, Optional, Sequence, Union

import torch

from .core import BlockPlan, Mask, Shape, _Built, as_4d
from .geometry import TILE_STATES, _Rows
from .plans import block_plan

def _index_args(
    q0: int, q1: int, k0: int, k1: int, batch: int, heads: Union[int, Sequence[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlexAttention's index arguments for one tile: b (B,1,1,1), h (1,H,1,1), q_idx (1,1,bq,1),
    kv_idx (1,1,1,bk); ``heads``: H (h is 0..H-1) or the head indices themselves."""
    b = torch.arange(batch, device=device).view(batch, 1, 1, 1)
    h = (torch.arange(heads, device=device) if isinstance(heads, int)
         else torch.tensor(list(heads), dtype=torch.int64, device=device)).view(1, -1, 1, 1)
    q = torch.arange(q0, q1, device=device).view(1, 1, q1 - q0, 1)
    kv = torch.arange(k0, k1, device=device).view(1, 1, 1, k1 - k0)
    return b, h, q, kv


def _vmapped(fn: Callable[..., torch.Tensor], with_score: bool) -> Callable[..., torch.Tensor]:
    """``fn`` evaluated element by element, as FlexAttention evaluates mods: vmapped over kv_idx,
    q_idx, h and b in turn (innermost first), each index a 0-d tensor inside, and the score with
    them; called with 1-D index tensors (and the (B, H, bq, bk) score), it returns (B, H, bq, bk)."""
    levels = [(None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)]
    f = fn
    for dims in levels:
        f = torch.vmap(f, in_dims=((0,) + dims) if with_score else dims, out_dims=0)
    return f


def _call_indexed(part: Any, s: Optional[torch.Tensor], q0: int, q1: int, k0: int, k1: int, batch: int,
                  heads: Union[int, Sequence[int]], device: torch.device) -> torch.Tensor:
    """``part.fn`` on one tile: with broadcasting index tensors (b (B,1,1,1), h (1,H,1,1),
    q_idx (1,1,bq,1), kv_idx (1,1,1,bk)), or, for a function written per element (e.g.
    ``bias[b][q_idx]``, which broadcasting indices cannot evaluate), element by element through
    `_vmapped`, as FlexAttention does. The first call decides which (``part._per_element``):
    broadcasting when it runs (what it returns is then judged by the caller), per element when
    broadcasting raises and the element-wise evaluation runs."""
    b, h, q, kv = _index_args(q0, q1, k0, k1, batch, heads, device)
    head = () if s is None else (s,)
    if part._per_element is None:
        try:
            out = part.fn(*head, b, h, q, kv)
        except (RuntimeError, IndexError, TypeError, ValueError) as first:
            try:
                out = _vmapped(part.fn, s is not None)(*head, b.flatten(), h.flatten(), q.flatten(), kv.flatten())
            except Exception as e:  # noqa: BLE001 - any failure of the user's function under vmap is reported by name
                raise TypeError(
                    f"{part.kind} {_fn_name(part.fn)} could not be evaluated on a tile: with broadcasting index "
                    f"tensors it raised {type(first).__name__}: {str(first).splitlines()[0][:160]}; element by "
                    f"element (torch.vmap, as FlexAttention) it raised {type(e).__name__}: "
                    f"{str(e).splitlines()[0][:160]}. Write it with tensor operations of its index arguments, "
                    "without Python if/for on their values (e.g. torch.where(q_idx >= kv_idx, ...))"
                ) from None
            part._per_element = True
            return out
        part._per_element = False  # it ran: its result's shape and dtype are judged by the caller
        return out  # type: ignore[no-any-return]
    if part._per_element:
        return _vmapped(part.fn, s is not None)(*head, b.flatten(), h.flatten(), q.flatten(), kv.flatten())
    return part.fn(*head, b, h, q, kv)  # type: ignore[no-any-return]


def _fn_name(fn: Callable[..., object]) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


#: the probe tile `Mask.check` tries a function on: queries 0..1 x keys 0..2 (when that long)
_PROBE = (2, 3)

class MaskMod(Mask):
    """``fn(b, h, q_idx, kv_idx) -> bool`` (True = may attend), FlexAttention's mask_mod,
    evaluated on one tile's index tensors at a time."""

    kind: ClassVar[str] = "mask_mod"

    def __init__(self, fn: Callable[..., torch.Tensor]):
        if not callable(fn):
            raise TypeError(f"mask_mod takes a function fn(b, h, q_idx, kv_idx) -> bool tensor, got {type(fn).__name__}")
        self.fn = fn
        #: whether fn is evaluated element by element (see `_call_indexed`; None: not yet known)
        self._per_element: Optional[bool] = None
        #: (shape, device) -> the plan and what it was made from: each tensor the function read
        #: with a copy of its values then
        self._plans: dict[tuple[tuple[int, ...], str], tuple[BlockPlan, list[tuple[torch.Tensor, torch.Tensor]]]] = {}

    def _evaluate(self, q0: int, q1: int, k0: int, k1: int, shape: Shape, device: torch.device) -> torch.Tensor:
        batch, heads = shape[0], shape[1]
        out = _call_indexed(self, None, q0, q1, k0, k1, batch, heads, device)
        want = (batch, heads, q1 - q0, k1 - k0)
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
            got = type(out).__name__ if not isinstance(out, torch.Tensor) else f"a {out.dtype} tensor"
            raise TypeError(
                f"mask_mod {_fn_name(self.fn)} must return a bool tensor (True = may attend), got {got}; "
                "return a comparison of the index arguments, e.g. q_idx >= kv_idx (for 0/1 values: .bool())"
            )
        try:
            fits = tuple(torch.broadcast_shapes(out.shape, want)) == want  # type: ignore[no-untyped-call]
        except RuntimeError:
            fits = False
        if not fits or out.dim() > 4:
            raise ValueError(
                f"mask_mod {_fn_name(self.fn)} returned shape {tuple(out.shape)} for a tile of (B, H, bq, bk) = {want}, "
                "which does not broadcast to it; build the result from the index arguments, which broadcast as "
                "b (B,1,1,1), h (1,H,1,1), q_idx (1,1,bq,1), kv_idx (1,1,1,bk)"
            )
        return as_4d(out)

    def _build_block(self, q0: int, q1: int, k0: int, k1: int, shape: Shape, *, device: torch.device,
                     dtype: torch.dtype, rows: Optional[_Rows] = None) -> _Built:
        return self._evaluate(q0, q1, k0, k1, shape, device), None

    def _probe(self, shape: Shape, device: torch.device, dtype: torch.dtype, name: str) -> None:
        lq, lk = shape[-2:]
        self._evaluate(0, min(lq, _PROBE[0]), 0, min(lk, _PROBE[1]), shape, device)

    def _dense_shape(self, shape: Shape) -> tuple[int, ...]:
        batch, heads, lq, lk = shape
        out = self._evaluate(0, min(lq, _PROBE[0]), 0, min(lk, _PROBE[1]), shape, _captured_device(self.fn))
        return (out.shape[0] if batch > 1 else 1, out.shape[1] if heads > 1 else 1, lq, lk)

    def _dense_dims(self, shape: Shape) -> int:
        return 4  # what `_evaluate` returns, without evaluating the function

    def flex_mod(
        self, mask: Mask, shape: tuple[int, int, int, int], *, device: torch.device, dtype: torch.dtype
    ) -> Optional[tuple[Callable[..., torch.Tensor], str]]:
        return self.fn, f"{self!r} -> mask_mod (the function itself)"  # FlexAttention's signature is ours

    def own_plan(self, shape: Shape, device: Optional[torch.device] = None) -> "BlockPlan":
        """The block plan of this function alone for ``shape``: made once, and made again when a
        tensor the function reads (`_captured`) is another tensor or holds other values than
        when the plan was made. The values are compared with a copy kept beside the plan, so
        every way of changing them counts (in-place ops, ``.data`` writes, numpy views), at the
        cost of one comparison of those tensors per call."""
        dev = device if device is not None else _captured_device(self.fn)
        key = (tuple(shape), str(dev))
        captured = _captured(self.fn)
        held = self._plans.get(key)
        if held is not None and _unchanged(held[1], captured):
            return held[0]
        plan = block_plan(self, shape, device=dev)
        self._plans[key] = (plan, [(t, t.detach().clone()) for t in captured])
        return plan

    def _tile_state(self, q0: int, q1: int, k0: int, k1: int, shape: Shape, device: torch.device) -> int:
        return TILE_STATES.index(self.own_plan(shape).tile_state(q0, q1, k0, k1))

    def __repr__(self) -> str:
        return f"mask_mod({_fn_name(self.fn)})"

def mask_mod(fn: Callable[..., torch.Tensor]) -> Mask:
    """A mask from a function ``fn(b, h, q_idx, kv_idx) -> bool tensor`` (FlexAttention's
    ``mask_mod``; True = may attend), evaluated per tile on broadcasting index tensors.

    >>> import torch, multihead
    >>> from multihead import masks
    >>> def even_keys(b, h, q_idx, kv_idx):
    ...     return kv_idx % 2 == 0
    >>> q = k = v = torch.randn(1, 2, 3, 4)
    >>> w = multihead.attention_weights(q, k, masks.mask_mod(even_keys))
    >>> (w[..., 1::2] == 0).all().item()
    True
    """
    return MaskMod(fn)

def _captured(fn: Callable[..., object]) -> list[torch.Tensor]:
    """The tensors ``fn`` reads from outside: closure cells, defaults, globals it names, and the
    parameters and buffers of a module (``fn`` itself, or one it holds)."""
    found: list[object] = []
    target = getattr(fn, "__func__", fn)
    owner = getattr(fn, "__self__", None)
    if owner is not None:
        found.append(owner)
    if isinstance(fn, torch.nn.Module):
        found.append(fn)
    for cell in getattr(target, "__closure__", None) or ():
        try:
            found.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    found.extend(getattr(target, "__defaults__", None) or ())
    code = getattr(target, "__code__", None)
    glob = getattr(target, "__globals__", {})
    if code is not None:
        found.extend(glob[n] for n in code.co_names if n in glob)
    out: dict[int, torch.Tensor] = {}
    for obj in found:
        if isinstance(obj, torch.nn.Module):
            for t in list(obj.parameters()) + list(obj.buffers()):
                out.setdefault(id(t), t)
        elif isinstance(obj, torch.Tensor):
            out.setdefault(id(obj), obj)
    return list(out.values())


def _unchanged(held: list[tuple[torch.Tensor, torch.Tensor]], now: list[torch.Tensor]) -> bool:
    """Whether ``now`` (from `_captured`) are the tensors ``held`` pairs with copies of their
    values, with the same values."""
    return len(held) == len(now) and all(
        t is n and t.shape == c.shape and t.dtype == c.dtype and bool(torch.equal(t.detach(), c))
        for (t, c), n in zip(held, now)
    )


def _holds(cell: Any, swap: dict[int, torch.Tensor]) -> bool:
    try:
        return id(cell.cell_contents) in swap
    except ValueError:  # an empty cell
        return False


def _captured_device(fn: Callable[..., object]) -> torch.device:
    ts = _captured(fn)
    return ts[0].device if ts else torch.device("cpu")

class _BuildsNothing(Mask):
    """A part that neither selects keys nor adds a tensor (a score mod, a sink): the backends
    read it through `Mask.score_mods` / `Mask.sink_logits`, so its keep/bias tiles are empty."""

    def _build_block(self, q0: int, q1: int, k0: int, k1: int, shape: Shape, *, device: torch.device,
                     dtype: torch.dtype, rows: Optional[_Rows] = None) -> _Built:
        return None, None

    def _dense_shape(self, shape: Shape) -> tuple[int, ...]:
        return ()

class ScoreMod(_BuildsNothing):
    """``fn(score, b, h, q_idx, kv_idx) -> score``, FlexAttention's score_mod, applied to each
    tile's scores (after the biases, before the selection)."""

    kind: ClassVar[str] = "score_mod"
    role = "modify"

    def __init__(self, fn: Callable[..., torch.Tensor], tensors: Optional[Sequence[torch.Tensor]] = None):
        if not callable(fn):
            raise TypeError(f"score_mod takes a function fn(score, b, h, q_idx, kv_idx) -> score, got {type(fn).__name__}")
        if tensors is not None:
            tensors = tuple(tensors)
            bad = [type(t).__name__ for t in tensors if not isinstance(t, torch.Tensor)]
            if bad:
                raise TypeError(f"score_mod tensors= must be torch.Tensors, got {', '.join(bad)}")
        self.fn = fn
        #: whether fn is evaluated element by element (see `_call_indexed`; None: not yet known)
        self._per_element: Optional[bool] = None
        self._tensors = tuple(tensors) if tensors is not None else tuple(
            t for t in _captured(fn) if t.is_floating_point() or t.is_complex()
        )

    def _own_tensors(self) -> tuple[torch.Tensor, ...]:
        return self._tensors

    @contextlib.contextmanager
    def reading(self, swap: dict[int, torch.Tensor]) -> Iterator[list[int]]:
        """While open, the function reads ``swap[id(t)]`` where it read the tensor ``t`` from its
        closure, its defaults or the globals it names (a kernel's float32 twin of a bfloat16
        table, so that the table's gradient is summed in float32 and rounded once). Yields the
        ids it swapped; a tensor it reaches otherwise (a module's parameters) is read as it is."""
        target = getattr(self.fn, "__func__", self.fn)
        cells = [c for c in (getattr(target, "__closure__", None) or ()) if _holds(c, swap)]
        old_cells = [c.cell_contents for c in cells]
        old_defaults = getattr(target, "__defaults__", None)
        code, glob = getattr(target, "__code__", None), getattr(target, "__globals__", {})
        names = [n for n in (code.co_names if code is not None else ()) if id(glob.get(n)) in swap]
        old_globals = {n: glob[n] for n in names}
        swapped = {id(t) for t in old_cells} | {id(t) for t in old_globals.values()}
        try:
            for c in cells:
                c.cell_contents = swap[id(c.cell_contents)]
            for n, t in old_globals.items():
                glob[n] = swap[id(t)]
            if old_defaults:
                target.__defaults__ = tuple(swap.get(id(d), d) if isinstance(d, torch.Tensor) else d
                                            for d in old_defaults)
                swapped |= {id(d) for d in old_defaults if isinstance(d, torch.Tensor) and id(d) in swap}
            yield sorted(swapped)
        finally:
            for c, old in zip(cells, old_cells):
                c.cell_contents = old
            glob.update(old_globals)
            if old_defaults:
                target.__defaults__ = old_defaults

    def _apply(self, s: torch.Tensor, q0: int, q1: int, k0: int, k1: int, shape: Shape,
               heads: Optional[Sequence[int]] = None) -> torch.Tensor:
        out = _call_indexed(self, s, q0, q1, k0, k1, s.shape[0], s.shape[1] if heads is None else heads, s.device)
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"score_mod {_fn_name(self.fn)} must return a tensor of the score's shape, got {type(out).__name__}; "
                "return an expression of score, e.g. score + bias_table[h, q_idx - kv_idx]"
            )
        if tuple(out.shape) != tuple(s.shape):
            raise ValueError(
                f"score_mod {_fn_name(self.fn)} changed the scores' shape from {tuple(s.shape)} to {tuple(out.shape)}; "
                "it must return one score per (b, h, q_idx, kv_idx): combine score with the index arguments "
                "(b (B,1,1,1), h (1,H,1,1), q_idx (1,1,bq,1), kv_idx (1,1,1,bk)) by broadcasting"
            )
        if out.dtype != s.dtype:
            raise TypeError(
                f"score_mod {_fn_name(self.fn)} changed the scores' dtype from {s.dtype} to {out.dtype}; "
                "cast what it adds, e.g. score + table[h, q_idx].to(score.dtype)"
            )
        return out

    def _probe(self, shape: Shape, device: torch.device, dtype: torch.dtype, name: str) -> None:
        batch, heads, lq, lk = shape
        bq, bk = min(lq, _PROBE[0]), min(lk, _PROBE[1])
        with torch.no_grad():
            self._apply(torch.zeros(batch, heads, bq, bk, dtype=dtype, device=device), 0, bq, 0, bk, shape)

    def __repr__(self) -> str:
        extra = f", tensors={[tuple(t.shape) for t in self._tensors]}" if self._tensors else ""
        return f"score_mod({_fn_name(self.fn)}{extra})"

def score_mod(fn: Callable[..., torch.Tensor], *, tensors: Optional[Sequence[torch.Tensor]] = None) -> Mask:
    """Scores modified by ``fn(score, b, h, q_idx, kv_idx) -> score`` (FlexAttention's
    ``score_mod``), applied after the biases and before the selection. ``tensors``: the tensors
    ``fn`` reads that may need gradients (default: found in its closure, defaults and globals).

    >>> import torch, multihead
    >>> from multihead import masks
    >>> table = torch.zeros(2, 8, requires_grad=True)           # a learned bias per head and distance
    >>> def relative(score, b, h, q_idx, kv_idx):
    ...     return score + table[h, (q_idx - kv_idx).abs()]
    >>> m = masks.score_mod(relative) & masks.causal()
    >>> m.tensors[0] is table
    True
    >>> q = k = v = torch.randn(1, 2, 5, 4)
    >>> multihead.attention(q, k, v, mask=m, backend="reference").sum().backward()
    >>> table.grad.shape
    torch.Size([2, 8])
    """
    return ScoreMod(fn, tensors)
