"""Functional attention: ``attention``, ``attention_weights`` and ``explain_dispatch``.

Legend: B batch, H query heads, Hkv key/value heads, Lq/Lk query/key lengths, D head dim,
Dv value head dim.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal, Optional, Sequence, Union, overload

import torch

from . import backends as _backends
from . import trace as _trace
from ._checks import check_dropout, check_indices, check_qkv, check_scale
from ._numerics import autocast_dtype, autocast_inputs, device_type, outside_autocast
from .backends import tiles as _tiles
from .backends import chunked as _chunked
from .backends import reference as _reference
from .backends import sdpa as _sdpa
from .heads import repeat_kv
from .backends import BackendName
from .masks import Mask, MaskLike, as_mask, from_seqlens

#: query heads or positions to select: a sequence of ints or a 1-D integer tensor
Indices = Union[Sequence[int], torch.Tensor]

__all__ = ["attention", "attention_weights", "explain_dispatch", "merge"]


def prepare_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: MaskLike, scale: Optional[float], dropout_p: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[Mask], float, float]:
    """The public edge's checks: ``(q, k, v, mask, scale, dropout_p)`` validated, the mask as a Mask
    (or None) checked against the call's shapes, and q, k, v in autocast's dtype inside an autocast
    region: the arguments of :func:`attention_core`, in its order."""
    q, k, v = autocast_inputs(q, k, v)
    m, scale, dropout_p = _checked(q, k, v, mask, scale, dropout_p)
    return q, k, v, m, scale, dropout_p


def _checked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: MaskLike, scale: Optional[float], dropout_p: float
) -> tuple[Optional[Mask], float, float]:
    check_qkv(q, k, v)
    scale = check_scale(scale, q.shape[-1])
    dropout_p = check_dropout(dropout_p)
    m = as_mask(mask)
    if m is not None:
        m.check((q.shape[0], q.shape[1], q.shape[2], k.shape[2]), q.device, dtype=q.dtype)
    return m, scale, dropout_p


@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: MaskLike = None, *,
              scale: Optional[float] = None, dropout_p: float = 0.0, backend: BackendName = "auto",
              return_lse: Literal[False] = False) -> torch.Tensor: ...
@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: MaskLike = None, *,
              scale: Optional[float] = None, dropout_p: float = 0.0, backend: BackendName = "auto",
              return_lse: Literal[True]) -> tuple[torch.Tensor, torch.Tensor]: ...


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: MaskLike = None,
    *,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    backend: BackendName = "auto",
    return_lse: bool = False,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Scaled dot-product attention over heads, with grouped-query support.

    >>> import torch, multihead
    >>> from multihead import masks
    >>> q = torch.randn(2, 4, 5, 8)                    # (B, H, Lq, D)
    >>> k, v = torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)   # 2 key/value heads: GQA
    >>> multihead.attention(q, k, v, mask=masks.causal()).shape
    torch.Size([2, 4, 5, 8])

    Equivalent to (plain torch, no dropout; the ``reference`` backend):

    >>> import math
    >>> def reference(q, k, v, keep=None, bias=None, scale=None):
    ...     scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    ...     g = q.shape[1] // k.shape[1]                       # query heads per key/value head
    ...     k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    ...     scores = q @ k.transpose(-2, -1) * scale
    ...     if bias is not None:
    ...         scores = scores + bias
    ...     if keep is not None:
    ...         scores = scores.masked_fill(~keep, float("-inf"))
    ...     weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)   # a row with no key gives 0
    ...     return weights @ v
    >>> keep = torch.ones(5, 5, dtype=torch.bool).tril()            # causal, Lq == Lk
    >>> torch.allclose(multihead.attention(q, k, v, mask=keep), reference(q, k, v, keep), atol=1e-6)
    True

    Args:
        q: (B, H, Lq, D) queries.
        k: (B, Hkv, Lk, D) keys; Hkv divides H (query head i reads key/value head i // (H // Hkv)).
        v: (B, Hkv, Lk, Dv) values.
        mask: None; a `multihead.masks` mask (``causal()``, ``key_padding(keep)``, ``window(w)``,
            ``keep(t)``, ``bias(t)`` or their ``&``); a bool tensor (True = may attend) or a float
            tensor (added to the scores), broadcastable to (B, H, Lq, Lk).
        scale: multiplies q·kᵀ; default 1/√D.
        dropout_p: dropout on the attention weights (pass 0.0 in evaluation).
        backend: "auto", "reference", "sdpa", "chunked" (see `multihead.backends.names`);
            ``explain_dispatch`` says which one "auto" runs and why.
        return_lse: also return the log-sum-exp of each row, for `merge` (backends that can
            give it: see ``explain_dispatch(..., need_lse=True)``; "auto" picks one of them).

    Returns:
        (B, H, Lq, Dv). A query row with no visible key gives 0. With ``return_lse=True``,
        ``(out, lse)``: lse (B, H, Lq) in float32 (float64 for float64 inputs), log Σ_j exp(s_ij)
        over the final scores s (scaled, biased, modded, masked; with a sink part the sink
        term is in the sum), -inf for a row with no visible key; differentiable.

    With ``dropout_p > 0`` the weights pass through ``torch.dropout(weights, dropout_p, True)``
    before ``@ v``.

    Other layouts, as `torch.nn.functional.scaled_dot_product_attention` takes them:

    * 3-D (N, L, E) inputs (one head) and more than 4-D (N, ..., H, L, E) ones; leading axes
      broadcast between q, k, v and a tensor mask (broadcastable to (N, ..., H, Lq, Lk)); a
      `multihead.masks` mask sees the leading axes flattened into one batch axis;
    * jagged nested tensors (``torch.nested.as_nested_tensor(seqs, layout=torch.jagged)``
      transposed to (B, H, j, D)): the sequences are packed into one row with
      ``masks.from_seqlens`` (so ``masks.causal()`` applies per sequence, which torch's nested
      SDPA does not take) and the output is nested the same way.
    """
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be True or False, got {return_lse!r}")
    if any(isinstance(t, torch.Tensor) and t.is_nested for t in (q, k, v)):
        return _attention_nested(q, k, v, mask, scale=scale, dropout_p=dropout_p, backend=backend, return_lse=return_lse)
    if _needs_flattening(q, k, v):
        return _attention_leading(q, k, v, mask, scale=scale, dropout_p=dropout_p, backend=backend, return_lse=return_lse)
    return attention_core(*prepare_inputs(q, k, v, mask, scale, dropout_p), backend,
                          returns="lse" if return_lse else "out")


def _needs_flattening(q: object, k: object, v: object) -> bool:
    """3-D or more than 4-D inputs, all of one rank. (4-D inputs keep one batch size: a batch of 1
    beside a batch of B is reported as a mistake; mixed ranks get check_qkv's error.)"""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        return False  # check_qkv names the one that is not a tensor
    ranks = {q.dim(), k.dim(), v.dim()}
    return len(ranks) == 1 and q.dim() >= 3 and q.dim() != 4


def _attention_leading(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: MaskLike, *, scale: Optional[float],
                       dropout_p: float, backend: BackendName,
                       return_lse: bool) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """`attention` of 3-D or >4-D inputs (SDPA's leading axes): flattened into (B, H, L, D),
    computed, and shaped back."""
    three = q.dim() == 3
    q4, k4, v4 = (t.unsqueeze(-3) for t in (q, k, v)) if three else (q, k, v)
    try:
        lead = torch.broadcast_shapes(q4.shape[:-3], k4.shape[:-3], v4.shape[:-3])  # type: ignore[no-untyped-call]
    except RuntimeError:
        raise ValueError(f"the leading axes of q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} do not "
                         "broadcast; they must be equal or 1 (as in scaled_dot_product_attention)") from None
    flat = [t.expand(*lead, *t.shape[-3:]).reshape(-1, *t.shape[-3:]) for t in (q4, k4, v4)]
    m: MaskLike = mask
    if isinstance(mask, torch.Tensor) and mask.dim() > 2:
        target = (*lead, *(() if three else (q4.shape[-3],)), q.shape[-2], k.shape[-2])
        try:
            fits = torch.broadcast_shapes(mask.shape, target) == torch.Size(target)  # type: ignore[no-untyped-call]
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(f"mask has shape {tuple(mask.shape)}, which does not broadcast to {target}, the "
                             "scores' shape of these inputs")
        full = mask.expand(target)
        m = full.reshape(-1, 1, *target[-2:]) if three else full.reshape(-1, *target[-3:])
    got = attention(flat[0], flat[1], flat[2], m, scale=scale, dropout_p=dropout_p, backend=backend,
                    return_lse=return_lse)  # type: ignore[call-overload]
    out, lse = got if return_lse else (got, None)
    out = out.reshape(*lead, *out.shape[1:])
    if three:
        out = out.squeeze(-3)
    if lse is None:
        return out
    lse = lse.reshape(*lead, *lse.shape[1:])
    return out, (lse.squeeze(-2) if three else lse)


def _attention_nested(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: MaskLike, *, scale: Optional[float],
                      dropout_p: float, backend: BackendName,
                      return_lse: bool) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """`attention` of jagged nested (B, H, j, D) inputs: packed into one row of documents."""
    parts = []
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        if not (isinstance(t, torch.Tensor) and t.is_nested and t.layout == torch.jagged and t.dim() == 4):
            raise TypeError(f"{name} must be a jagged nested tensor (B, H, j, D) like q, e.g. torch.nested."
                            "as_nested_tensor(seqs, layout=torch.jagged).transpose(1, 2) with seqs (L_i, H, D); "
                            f"got {type(t).__name__} {getattr(t, 'layout', '')}")
        parts.append(t.unbind())  # B tensors (H, L_i, D)
    qs, ks, vs = parts
    if not len(qs) == len(ks) == len(vs):
        raise ValueError(f"q, k, v hold {len(qs)}, {len(ks)} and {len(vs)} sequences; give one per batch row each")
    if mask is not None and not isinstance(mask, Mask):
        raise TypeError("a nested input takes a multihead.masks mask (e.g. masks.causal(), masks.window(8)), which "
                        "applies to each sequence; a tensor mask has no place in a jagged batch")
    lq, lk = [t.shape[1] for t in qs], [t.shape[1] for t in ks]
    docs = from_seqlens(lq, None if lk == lq else lk, device=qs[0].device)
    packed = [torch.cat(list(ts), dim=1).unsqueeze(0) for ts in (qs, ks, vs)]  # (1, H, sum L, D)
    got = attention(packed[0], packed[1], packed[2], docs if mask is None else docs & mask, scale=scale,
                    dropout_p=dropout_p, backend=backend, return_lse=return_lse)  # type: ignore[call-overload]
    out, lse = got if return_lse else (got, None)

    def nest(x: torch.Tensor) -> torch.Tensor:  # (1, H, sum Lq, ...) -> nested (B, H, j, ...)
        seqs = [c.transpose(0, 1) for c in x[0].split_with_sizes(lq, dim=1)]  # (L_i, H, ...)
        return torch.nested.as_nested_tensor(seqs, layout=torch.jagged).transpose(1, 2)

    return nest(out) if lse is None else (nest(out), nest(lse))


def merge(outputs: Union[Sequence[torch.Tensor], torch.Tensor],
          lses: Union[Sequence[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over disjoint key sets into attention over their union, exactly.

    >>> import torch, multihead
    >>> q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    >>> a = multihead.attention(q, k[:, :, :2], v[:, :, :2], return_lse=True)   # keys 0, 1
    >>> b = multihead.attention(q, k[:, :, 2:], v[:, :, 2:], return_lse=True)   # keys 2 .. 5
    >>> out, lse = multihead.merge([a[0], b[0]], [a[1], b[1]])
    >>> torch.allclose(out, multihead.attention(q, k, v), atol=1e-6)
    True

    Args:
        outputs: S partial outputs (B, H, Lq, Dv) (any leading axes, the same for all), each
            attention of the same queries over one key set, as a list/tuple or stacked
            (S, B, H, Lq, Dv) (xFormers' ``merge_attentions`` layout).
        lses: their log-sum-exps (B, H, Lq), from ``attention(..., return_lse=True)``, as a
            list/tuple or stacked (S, B, H, Lq); -inf for a row with no key in that part.

    Returns:
        ``(out, lse)``: out = Σ_s exp(lse_s - lse) · out_s in the outputs' dtype, lse =
        log Σ_s exp(lse_s) in the lses' dtype (at least float32); a row with no key in any part
        gives out 0 and lse -inf. Differentiable in every output and lse (no NaN gradients
        for empty rows). The key sets must not overlap (a key in two parts counts twice).
    """
    outs = _parts(outputs, "outputs")
    ls = _parts(lses, "lses")
    if len(outs) != len(ls):
        raise ValueError(f"merge needs one lse per output: got {len(outs)} outputs and {len(ls)} lses")
    first = outs[0]
    for i, (o, l) in enumerate(zip(outs, ls)):
        if o.shape != first.shape or o.dtype != first.dtype or o.device != first.device:
            raise ValueError(
                f"outputs[{i}] is {tuple(o.shape)} {o.dtype} on {o.device} but outputs[0] is "
                f"{tuple(first.shape)} {first.dtype} on {first.device}; every part must be the same queries' "
                "attention (same shape, dtype and device)")
        if not l.is_floating_point():
            raise TypeError(f"lses[{i}] must be a float tensor (a log-sum-exp), got {l.dtype}")
        if o.dim() < 1 or tuple(l.shape) != tuple(o.shape[:-1]) or l.device != o.device:
            raise ValueError(
                f"lses[{i}] has shape {tuple(l.shape)} on {l.device} but must be outputs[{i}].shape[:-1] = "
                f"{tuple(o.shape[:-1])} on {o.device}: one log-sum-exp per query row, as attention(..., "
                "return_lse=True) returns it")
    cdt = torch.float32
    for l in ls:
        cdt = torch.promote_types(cdt, l.dtype)
    return _tiles.merge(outs, [l.to(cdt) for l in ls])


def _parts(x: object, name: str) -> list[torch.Tensor]:
    """A list/tuple of tensors, or a stacked tensor split on its first axis; checked non-empty."""
    if isinstance(x, torch.Tensor):
        if x.dim() < 2:
            raise ValueError(f"{name} as one tensor must be stacked parts (S, ...), got shape {tuple(x.shape)}")
        parts = list(x.unbind(0))
    elif isinstance(x, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in x):
        parts = list(x)
    else:
        raise TypeError(f"{name} must be a list or tuple of tensors (or one stacked tensor), got {type(x).__name__}")
    if not parts:
        raise ValueError(f"{name} is empty; merge needs at least one part")
    return parts


_LOOK_UP = object()  # attention_core's tr default: look the recording trace up


@overload
def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[Mask], scale: float,
                   dropout_p: float, backend: str = "auto", *, returns: Literal["out"] = "out",
                   tr: Any = _LOOK_UP) -> torch.Tensor: ...
@overload
def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[Mask], scale: float,
                   dropout_p: float, backend: str = "auto", *, returns: Literal["lse", "weights"],
                   tr: Any = _LOOK_UP) -> tuple[torch.Tensor, torch.Tensor]: ...


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[Mask], scale: float,
                   dropout_p: float, backend: str = "auto", *, returns: str = "out",
                   tr: Any = _LOOK_UP) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """The trusted core behind `attention`, the module and the integrations: resolve the backend
    and run it.

    >>> import torch
    >>> from multihead.functional import attention_core, prepare_inputs
    >>> q = torch.randn(1, 2, 3, 8)                                 # (B, H, L, D)
    >>> out, weights = attention_core(*prepare_inputs(q, q, q, None, None, 0.0), returns="weights")
    >>> out.shape, weights.shape
    (torch.Size([1, 2, 3, 8]), torch.Size([1, 2, 3, 3]))

    Arguments arrive validated (:func:`prepare_inputs`: ``mask`` a Mask or None, ``scale`` a
    float) and, inside an autocast region, already in autocast's dtype; the backend itself runs
    with autocast off, so that it computes as it documents (scores and softmax in float32 for half
    inputs, biases at their own precision) in and out of autocast.

    returns: "out" (B, H, Lq, Dv); "lse": ``(out, lse)`` from a backend that gives the
    log-sum-exp (B, H, Lq); "weights": ``(out, weights)`` (B, H, Lq, Lk) from the reference
    backend, which alone returns the weights it applied (``backend`` is not read).
    tr: the recording :class:`multihead.Trace` (or None), for a caller that looked it up already.
    """
    if tr is _LOOK_UP:
        tr = _trace.current()
    if returns == "weights":
        warn_once_if_dense_weights_are_large(q, k)
        if tr is not None:
            tr.set_config(backend="reference")
        with outside_autocast(device_type(q)):
            return _reference.forward_with_weights(q, k, v, mask, scale=scale, dropout_p=dropout_p)
    if returns not in ("out", "lse"):
        raise ValueError(f"returns must be 'out', 'lse' or 'weights', got {returns!r}")
    need_lse = returns == "lse"
    chosen = _backends.resolve_traced(backend, _backends.Call(q, k, v, mask, dropout_p, need_lse=need_lse), tr)
    if tr is not None:
        tr.set_config(backend=chosen.name)
    device = device_type(q)
    if need_lse:
        assert chosen.lse_fn is not None, "resolve refuses backends without lse_fn for need_lse"
        with outside_autocast(device):
            return chosen.lse_fn(q, k, v, mask, scale=scale, dropout_p=dropout_p)
    if autocast_dtype(device) is None:  # autocast is off: no context to enter
        return chosen.fn(q, k, v, mask, scale=scale, dropout_p=dropout_p)
    with outside_autocast(device):
        return chosen.fn(q, k, v, mask, scale=scale, dropout_p=dropout_p)


_warned_dense_weights = False


def warn_once_if_dense_weights_are_large(q: torch.Tensor, k: torch.Tensor) -> None:
    """One warning per process when returning weights materialises more float32 scores than
    ``auto`` allows itself for a dense mask (``backends.sdpa.DENSE_MASK_BUDGET_BYTES``)."""
    global _warned_dense_weights
    need = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * 4
    if _warned_dense_weights or need <= _sdpa.DENSE_MASK_BUDGET_BYTES:
        return
    _warned_dense_weights = True
    warnings.warn(
        f"returning attention weights (return_weights, output_attentions or need_weights=True) runs the reference "
        f"backend, which builds the full (B, H, Lq, Lk) scores: {need / 2**20:.0f} MiB here, O(Lq·Lk) "
        "time and memory instead of the tiled backends; at this length drop the weights, or take a slice "
        "with multihead.attention_weights(q, k, heads=..., rows=...). Shown once per process.",
        UserWarning, stacklevel=2,
    )


def attention_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: MaskLike = None,
    *,
    scale: Optional[float] = None,
    heads: Optional[Indices] = None,
    rows: Optional[Indices] = None,
) -> torch.Tensor:
    """The softmax probabilities (B, H, Lq, Lk) for q (B, H, Lq, D) and k (B, Hkv, Lk, D).

    >>> import torch, multihead
    >>> q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    >>> w = multihead.attention_weights(q, k, multihead.masks.causal())
    >>> w.shape, w[0, 0, 0].tolist()                   # the first query sees only key 0
    (torch.Size([1, 2, 3, 3]), [1.0, 0.0, 0.0])
    >>> torch.allclose(w.sum(-1), torch.ones(1, 2, 3))
    True
    >>> multihead.attention_weights(q, k, heads=[1], rows=[2]).shape   # a slice, at any L
    torch.Size([1, 1, 1, 3])

    Rows sum to 1 where any key is visible and are all 0 where none is.

    ``heads`` (query head indices) and/or ``rows`` (query positions), as lists of ints or 1-D
    integer tensors, select a slice (B, len(heads), len(rows), Lk) computed from the chunked
    backend's log-sum-exp, without the full (H, Lq, Lk) tensor: use them at long L. An empty
    list selects nothing: ``heads=[]`` gives (B, 0, Lq, Lk), ``rows=[]`` (B, H, 0, Lk).
    """
    check_qkv(q, k)
    scale = check_scale(scale, q.shape[-1])
    m = as_mask(mask)
    if m is not None:
        m.check((q.shape[0], q.shape[1], q.shape[2], k.shape[2]), q.device, dtype=q.dtype)
    if heads is not None or rows is not None:
        heads = check_indices(heads, q.shape[1], "heads", "query head")
        rows = check_indices(rows, q.shape[2], "rows", "query position")
        if not heads or not rows:  # nothing selected: the empty (B, len(heads), len(rows), Lk), like q[:, []]
            return q.new_zeros(q.shape[0], len(heads), len(rows), k.shape[2])
        return _chunked.selected_weights(q, k, m, scale=scale, heads=heads, rows=rows)
    k = repeat_kv(k, q.shape[1] // k.shape[1])
    return _reference.attention_probs(q, k, m, scale=scale).to(q.dtype)


def explain_dispatch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: MaskLike = None,
    *,
    dropout_p: float = 0.0,
    need_weights: bool = False,
    compiling: Optional[bool] = None,
    need_lse: bool = False,
) -> _backends.Dispatch:
    """Which backend ``backend="auto"`` would run for this call, how, and why each other was refused.

    ``need_weights=True`` asks for a backend that also returns the weights (only ``reference``).
    ``need_lse=True`` asks for a backend that also returns the log-sum-exp (``return_lse=True``).
    ``compiling=True`` asks what ``auto`` runs inside ``torch.compile`` (default: whether this
    call is itself being compiled); there ``chunked`` is routed around.
    ``Dispatch.how`` says how the chosen backend runs the call where it can tell: for ``sdpa``,
    the kernel torch will run (its math kernel, with its reason and dense scores, or a fused one)
    and the mask tensor it gets (a bias stays float32 beside float16/bfloat16 inputs).
    The thresholds are module settings: ``multihead.backends.sdpa.DENSE_MASK_BUDGET_BYTES`` (the
    dense mask and, when torch would run its math kernel, its scores) and
    ``multihead.backends.chunked.AUTO_MIN_SCORES``. The call is planned, not run: nothing of
    size (Lq, Lk) is built.
    """
    m, _, dropout_p = _checked(q, k, v, mask, None, dropout_p)
    return _backends.explain_dispatch_call(_backends.Call(q, k, v, m, dropout_p, bool(need_weights), compiling,
                                                          bool(need_lse)))
