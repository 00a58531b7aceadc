"""A multihead mask in FlexAttention's terms: its ``mask_mod``, ``score_mod`` and ``BlockMask``;
and back (torch's ``BlockMask`` as a multihead mask). The ``flex`` backend (:mod:`.flex`) runs
what is translated here.

>>> import multihead
>>> from multihead.backends import flex_masks
>>> flex_masks.to_block_mask(multihead.masks.causal(), 1, 2, 64, 64, device="cpu").shape
(1, 1, 64, 64)

A multihead mask is translated, part by part, into FlexAttention's two functions and a
`BlockMask` (which tiles of 128 queries x 128 keys are empty, full, or need the mask)::

    causal, window (sink tokens),   mask_mod   lo[b, q] <= kv < hi[b, q]: the key intervals each
    documents, chunked_local                   row may see, (B|1, Lq) tensors from the masks' rule
    key_padding, keep, torch 3-D    mask_mod   a lookup of the bool tensor at [b, h, q, kv]
    mask_mod(fn)                    mask_mod   fn itself (FlexAttention's signature)
    bias, alibi                     score_mod  s + bias[b, h, q, kv]; s - slope[h] |kv - d[b, q]|
    score_mod(fn), softcap          score_mod  fn itself, in written order, after the biases
    sink                            one more key (index Lk, value 0) that every row sees, with
                                    the score sink[h]: the denominator gains exp(sink[h])

and the block mask comes from the mask's own tile states (`to_block_mask`; a block plan the
mask carries is used as it is), so no (Lq, Lk) tensor is built for a structural mask. Per
Contract A the additive parts are summed into the scaled score first, the score mods run after
them in written order, and a selecting part that says False makes the score -inf; a row with
no visible key gives 0 (FlexAttention's own rule; with a sink, w = 0 there too).

Legend: B batch, H query heads, Lq/Lk query/key lengths, bs the block size (128).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from .. import masks as _masks
from .._checks import check_positive_int
from ..masks import Mask, MaskLike, as_4d, as_mask

if TYPE_CHECKING:  # the module is imported lazily at run time (see _flex)
    from torch.nn.attention.flex_attention import BlockMask

__all__ = ["translate", "Translation", "to_block_mask", "from_block_mask", "tile_states", "BLOCK_SIZE"]

#: the tile side of the block masks built here (FlexAttention's default)
BLOCK_SIZE = 128

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
ScoreMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
#: (B, H, Lq, Lk)
Shape = Sequence[int]


def _flex() -> Any:
    """torch's flex_attention module, imported on first use (it pulls in the compiler stack)."""
    import torch.nn.attention.flex_attention as module
    return module




@dataclass(frozen=True)
class Translation:
    """FlexAttention's functions for one mask at one shape.

    ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (None: every key visible), ``score_mod(score, b, h,
    q_idx, kv_idx) -> score`` (None: the scaled score as is), ``sink`` the (H,) sink logits or
    None, and what each part became (``parts``: ``"causal -> mask_mod"``, ...), for explain_dispatch.
    """

    mask_mod: Optional[MaskMod]
    score_mod: Optional[ScoreMod]
    sink: Optional[torch.Tensor]
    parts: tuple[str, ...]


def _lookup(t: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """t[b, h, q, kv] for a tensor broadcastable to (B, H, Lq, Lk): a size-1 axis reads index 0."""
    t = as_4d(t)
    nb, nh, nq, nk = (int(n) for n in t.shape)

    def at(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return t[b if nb > 1 else 0, h if nh > 1 else 0, q if nq > 1 else 0, kv if nk > 1 else 0]

    return at


def intervals_mod(ivs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> MaskMod:
    """Key kv is visible from row (b, q) when lo[b, q] <= kv < hi[b, q] for one of the intervals
    (the per-row intervals of the structural parts: causal, window, documents, chunked_local)."""
    bounds = tuple((lo, hi, lo.shape[0] > 1) for lo, hi in ivs)

    def intervals(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        seen = None
        for lo, hi, per_batch in bounds:
            row = b if per_batch else 0
            inside = (kv >= lo[row, q]) & (kv < hi[row, q])
            seen = inside if seen is None else seen | inside
        assert seen is not None
        return seen

    return intervals


def _keep_mod(keep: torch.Tensor) -> MaskMod:
    at = _lookup(keep)

    def kept(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return at(b, h, q, kv)
    return kept


def _all_of(mods: Sequence[MaskMod]) -> MaskMod:
    first, rest = mods[0], tuple(mods[1:])

    def all_of(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        ok = first(b, h, q, kv)
        for mod in rest:
            ok = ok & mod(b, h, q, kv)
        return ok
    return all_of


def _add_bias(bias: torch.Tensor) -> ScoreMod:
    at = _lookup(bias)

    def add_bias(s: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return s + at(b, h, q, kv)
    return add_bias


def _chain(mods: Sequence[ScoreMod]) -> ScoreMod:
    mods = tuple(mods)

    def chain(s: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        for mod in mods:
            s = mod(s, b, h, q, kv)
        return s
    return chain


def _with_sink_key(mask_mod: Optional[MaskMod], score_mod: Optional[ScoreMod], sink: torch.Tensor,
                   lk: int) -> tuple[MaskMod, ScoreMod]:
    """The functions over Lk + 1 keys, key Lk being the sink: visible from every row, its score
    ``sink[h]``, so that the softmax's denominator gains exp(sink[h]) (its value is 0). The
    other functions see key indices clamped to Lk - 1 (their tensors are never read past the end)."""
    last = lk - 1

    def sink_mask(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        is_sink = kv == lk
        if mask_mod is None:
            return is_sink | (kv < lk)
        return is_sink | mask_mod(b, h, q, kv.clamp(max=last))

    def sink_score(s: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        if score_mod is not None:
            s = score_mod(s, b, h, q, kv.clamp(max=last))
        return torch.where(kv == lk, sink[h].to(s.dtype), s)

    return sink_mask, sink_score


def translate(mask: Optional[Mask], shape: Shape, *, device: torch.device, dtype: torch.dtype) -> Translation:
    """FlexAttention's ``mask_mod`` and ``score_mod`` for ``mask`` at ``shape`` = (B, H, Lq, Lk).

    ``dtype`` is the compute dtype a bias is added in (float32 for half inputs). The structural
    parts (causal, window with its sink tokens, documents, chunked_local) become one lookup of
    the key intervals each row may see ((B|1, Lq) tensors, from `multihead.masks`' own rule);
    tensors are captured as views, not copied; a mask_mod or score_mod function is passed on as
    it is (FlexAttention's signatures are ours).

    >>> import torch
    >>> from multihead import masks
    >>> from multihead.backends import flex
    >>> t = flex.translate(masks.causal(), (1, 1, 2, 3), device=torch.device("cpu"), dtype=torch.float32)
    >>> q, kv = torch.arange(2).view(2, 1), torch.arange(3).view(1, 3)
    >>> t.mask_mod(0, 0, q, kv).int().tolist()        # bottom-right: query 0 sits on key 1
    [[1, 1, 0], [1, 1, 1]]
    """
    if mask is None:
        return Translation(None, None, None, ())
    shape4 = (int(shape[0]), int(shape[1]), int(shape[2]), int(shape[3]))  # (B, H, Lq, Lk) as ints
    shape = shape4
    _, _, lq, lk = shape
    parts = mask.parts
    selects: list[MaskMod] = []
    adds: list[ScoreMod] = []
    described: list[str] = []
    ivs = mask.row_intervals(shape)
    if ivs is not None:
        selects.append(intervals_mod([(lo.to(device), hi.to(device)) for lo, hi in ivs]))
        kinds = " & ".join(p.kind for p in parts if p.is_structural)
        described.append(f"{kinds} -> mask_mod (the key intervals of each row, {len(ivs)} per row)")
    for part in parts:
        if part.is_structural or part.role in ("modify", "denominator"):
            continue
        own = part.flex_mod(mask, shape4, device=device, dtype=dtype)  # the kind's own translation
        if own is not None:
            (selects if part.role == "select" else adds).append(own[0])
            described.append(own[1])
        else:  # a tensor part (keep, key_padding, bias, nn.MultiheadAttention's 3-D mask): look it up
            built = part.materialize(shape, device=device, dtype=dtype)
            keep_t, bias_t = built.keep, built.bias
            if keep_t is not None:
                selects.append(_keep_mod(keep_t))
                described.append(f"{part.kind} -> mask_mod (a lookup of its {tuple(keep_t.shape)} tensor)")
            if bias_t is not None:
                adds.append(_add_bias(bias_t.to(dtype)))
                described.append(f"{part.kind} -> score_mod (adds its {tuple(bias_t.shape)} tensor)")
    for part in mask.score_mods:
        adds.append(part.fn)  # type: ignore[attr-defined]  # every score-mod part is a masks.ScoreMod
        described.append(f"{part!r} -> score_mod")
    sink = mask.sink_logits
    if sink is not None:
        described.append("sink -> one more key, visible from every row, scored sink[h], value 0")
    mask_mod = None if not selects else selects[0] if len(selects) == 1 else _all_of(selects)
    score_mod = None if not adds else adds[0] if len(adds) == 1 else _chain(adds)
    return Translation(mask_mod, score_mod, None if sink is None else sink.to(device), tuple(described))


# -- block masks


def _structural_states(mask: Mask, shape: tuple[int, int, int, int], block_size: int,
                       nq: int, nk: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(empty, full) (nq, nk) of the structural parts, from each row's key intervals, or None."""
    _, _, lq, lk = shape
    ivs = mask.row_intervals(shape)
    if ivs is None:
        return None
    k0 = torch.arange(nk) * block_size
    k1 = (k0 + block_size).clamp(max=lk)
    # (B|1, Lq) ends -> (B|1, Lq, nk)
    seen, covered = _masks.interval_cover([(lo.cpu().unsqueeze(-1), hi.cpu().unsqueeze(-1)) for lo, hi in ivs], k0, k1)
    pad = nq * block_size - lq  # rows past Lq: they see nothing and need nothing
    seen = torch.nn.functional.pad(seen, (0, 0, 0, pad), value=False)
    covered = torch.nn.functional.pad(covered, (0, 0, 0, pad), value=True)
    seen = seen.view(seen.shape[0], nq, block_size, nk).any(dim=2).any(dim=0)
    covered = covered.view(covered.shape[0], nq, block_size, nk).all(dim=2).all(dim=0)
    return ~seen, covered


def tile_states(mask: Optional[Mask], shape: Shape, *, device: torch.device,
                block_size: int = BLOCK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """(empty, full): bool (nq, nk) grids over the tiles of ``block_size`` queries x keys of
    ``shape`` = (B, H, Lq, Lk); a tile in neither is partial (its mask_mod must be evaluated).
    A tile is empty or full only if it is so for every batch row and head (as `Mask.tile_state`
    says; the structural parts are read for all tiles at once from their per-row intervals).
    Inside torch.compile the other selecting parts are not read tile by tile (that branches on
    their contents): a tile they could hide is partial."""
    full_shape = (int(shape[0]), int(shape[1]), int(shape[2]), int(shape[3]))
    lq, lk = full_shape[2:]
    nq, nk = math.ceil(lq / block_size), math.ceil(lk / block_size)
    empty = torch.zeros(nq, nk, dtype=torch.bool)
    full = torch.ones(nq, nk, dtype=torch.bool)
    if mask is None:
        return empty, full
    structural = _structural_states(mask, full_shape, block_size, nq, nk)
    if structural is not None:
        empty, full = structural
    others = [p for p in mask.parts if p.role == "select" and not p.is_structural]
    if others and torch.compiler.is_compiling():  # traced: no branch on tile contents; a tile the
        return empty, torch.zeros_like(full)     # other parts may hide is evaluated (partial)
    for i in range(nq):
        for j in range(nk):
            if empty[i, j]:
                continue
            q0, q1, k0, k1 = i * block_size, min(lq, (i + 1) * block_size), j * block_size, min(lk, (j + 1) * block_size)
            for part in others:  # a mask_mod answers from its own block plan (made once per shape)
                state = part.tile_state(q0, q1, k0, k1, full_shape, device=device)
                if state == "empty":
                    empty[i, j] = True
                    break
                if state == "partial":
                    full[i, j] = False
    return empty, full & ~empty


def _indices(chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_blocks (B|1, H|1, nq), indices (B|1, H|1, nq, nk)) int32 of a bool (B|1, H|1, nq, nk)
    choice of key blocks: each query block's chosen key blocks first, in key order."""
    nk = chosen.shape[-1]
    order = torch.where(chosen, torch.arange(nk), nk + torch.arange(nk)).argsort(dim=-1)
    return chosen.sum(dim=-1, dtype=torch.int32), order.to(torch.int32)


def _block_mask(mask: Optional[Mask], shape: tuple[int, int, int, int], *, device: torch.device,
                block_size: int, mask_mod: Optional[MaskMod], sink: bool = False) -> "BlockMask":
    """The BlockMask of ``mask`` at ``shape`` (arguments trusted); with ``sink`` over Lk + 1 keys,
    the last one (the sink key) visible from every row."""
    _, _, lq, lk = shape
    plan = None if mask is None else mask.plan
    if plan is not None and plan.shape == shape and plan.block_q == plan.block_k == block_size:
        states = plan.states.cpu()  # (B|1, H|1, nq, nk): the plan the mask carries, as it is
        empty, full = states == 0, states == 2
    else:
        e, f = tile_states(mask, shape, device=device, block_size=block_size)
        empty, full = e[None, None], f[None, None]
    if sink:
        if lk % block_size == 0:  # the sink key starts a block of its own: every row sees all of it
            empty = torch.cat([empty, torch.zeros_like(empty[..., :1])], dim=-1)
            full = torch.cat([full, torch.ones_like(full[..., :1])], dim=-1)
        else:  # it ends the last block: a block no row saw must now be evaluated
            empty = empty.clone()
            empty[..., -1] = False
    kv_num, kv_idx = _indices(~empty & ~full)
    full_num, full_idx = _indices(full)
    block_mask: BlockMask = _flex().BlockMask.from_kv_blocks(
        kv_num.to(device), kv_idx.to(device), full_num.to(device), full_idx.to(device),
        BLOCK_SIZE=block_size, mask_mod=mask_mod, seq_lengths=(lq, lk + 1 if sink else lk),
    )
    return block_mask


def _check_dims(B: object, H: object, Lq: object, Lk: object) -> tuple[int, int, int, int]:
    b, h, q, k = (check_positive_int(n, name) for n, name in ((B, "B"), (H, "H"), (Lq, "Lq"), (Lk, "Lk")))
    return b, h, q, k


def to_block_mask(mask: MaskLike, B: int, H: int, Lq: int, Lk: int, *, device: torch.device,
                  block_size: int = BLOCK_SIZE) -> "BlockMask":
    """torch's ``BlockMask`` for ``mask`` over (B, H, Lq, Lk), from the mask's own tile states,
    with the mask's translation (`translate`) as its ``mask_mod``.

    The block mask is shared by every batch row and head (shape (1, 1, Lq, Lk)), or is the
    mask's `multihead.masks.BlockPlan` as it is when it carries one of this shape and block
    size. Nothing (Lq, Lk) is built for the structural parts (causal, window, documents,
    chunked_local); a tensor part is read tile by tile. Score mods, biases and sinks are not
    part of a BlockMask (`translate` gives the score_mod).

    >>> import torch
    >>> from multihead import masks
    >>> from multihead.backends import flex
    >>> bm = flex.to_block_mask(masks.causal(), 1, 1, 256, 256, device=torch.device("cpu"))
    >>> bm.to_dense()[0, 0].int().tolist()          # 2 x 2 tiles of 128: the upper one is skipped
    [[1, 0], [1, 1]]
    """
    shape = _check_dims(B, H, Lq, Lk)
    block_size = check_positive_int(block_size, "block_size")
    m = as_mask(mask, name="to_block_mask's mask")
    if m is not None:
        m.check(shape, torch.device(device))
    mask_mod = translate(m, shape, device=torch.device(device), dtype=torch.float32).mask_mod
    return _block_mask(m, shape, device=torch.device(device), block_size=block_size, mask_mod=mask_mod)


def from_block_mask(block_mask: "BlockMask", *, B: Optional[int] = None, H: Optional[int] = None) -> Mask:
    """A multihead mask from torch's ``BlockMask``: its ``mask_mod`` as `multihead.masks.mask_mod`,
    carrying the block mask's tiles as its `multihead.masks.BlockPlan` (so no tile state is
    recomputed). ``B``/``H`` give the call's batch and heads when the block mask broadcasts
    over them (made with B=None or H=None).

    >>> import torch
    >>> from torch.nn.attention.flex_attention import create_block_mask
    >>> from multihead.backends import flex
    >>> bm = create_block_mask(lambda b, h, q, kv: kv <= q, None, None, 256, 256, device="cpu")
    >>> m = flex.from_block_mask(bm, B=2, H=4)
    >>> m.tile_state(0, 128, 128, 256, (2, 4, 256, 256))
    'empty'
    """
    if not isinstance(block_mask, _flex().BlockMask):
        raise TypeError(f"from_block_mask takes a torch.nn.attention.flex_attention.BlockMask, "
                        f"got {type(block_mask).__name__}")
    bb, bh, lq, lk = (int(n) for n in block_mask.shape)
    batch = bb if B is None else check_positive_int(B, "B")
    heads = bh if H is None else check_positive_int(H, "H")
    for given, have, name in ((batch, bb, "B"), (heads, bh, "H")):
        if have not in (1, given):
            raise ValueError(f"{name}={given} does not match the block mask's {name}={have}; "
                             f"pass the {name} it was made for, or make it with {name}=None")
    bq, bk = (int(n) for n in block_mask.BLOCK_SIZE)
    nq, nk = math.ceil(lq / bq), math.ceil(lk / bk)
    flexmod = _flex()
    partial = flexmod._ordered_to_dense(block_mask.kv_num_blocks, block_mask.kv_indices, nk)
    states = partial.to(torch.uint8)
    if block_mask.full_kv_num_blocks is not None:
        full = flexmod._ordered_to_dense(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, nk)
        states = torch.where(full.bool(), 2, states).to(torch.uint8)
    plan = _masks.BlockPlan((batch, heads, lq, lk), bq, bk, states[..., :nq, :nk])
    return _masks.mask_mod(block_mask.mask_mod).with_plan(plan)
