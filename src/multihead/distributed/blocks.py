"""One ring step's work: the tile kernel on one (query segment, key segment) pair, merged into
the rank's running output and log-sum-exp (and the pair's share of the gradients).

Legend: B batch, H query heads, Hkv key/value heads, n/m the segment's query/key tokens,
D head dim, Dv value head dim.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import masks as _masks
from .._numerics import compute_dtype
from ..backends import tiles as _tiles
from ..backends import chunked as _chunked
from .ring_masks import _Placed

# Each ring step is the tile kernel (multihead.backends.tiles) on one (query segment, key
# segment) pair, with the pair's mask in local coordinates: key padding from the keep tensor
# that travels with the keys, and causal on the diagonal pairs (equal global positions). The
# partial results are combined with the kernel's merge, the rule of the module docstring.
def _block(k, v, keep, ids) -> list[torch.Tensor]:
    """What travels round the ring: k, v, and the key padding and document ids when given."""
    return [k, v] + ([] if keep is None else [keep]) + ([] if ids is None else [ids])


def _unblock(block, has_keep: bool, has_ids: bool):
    """(keep, ids) of a received :func:`_block`, each None when not sent."""
    rest = iter(block[2:])
    return (next(rest) if has_keep else None), (next(rest) if has_ids else None)


def _block_tiles(q, k, v, keep, diagonal: bool, scale: float, ids=None, kinds=(),
                 placed: Optional[_Placed] = None, at=(0, 0)) -> _tiles.Tiles:
    """The tile kernel's problem for q (B, H, n, D) against one key segment k (B, Hkv, m, D),
    v (B, Hkv, m, Dv), with key padding ``keep`` (B, m) or None, document ids ``(q ids (B|1, n),
    k ids (B|1, m))`` or None, causal when ``diagonal`` (the segments hold the same positions,
    so causal per document is causal by position there), the softcap parts of ``kinds``, and
    the window, chunked_local and ALiBi of ``placed`` at the pair's global query and key starts
    ``at`` (ALiBi adds before the softcap modifies, as in ``multihead.attention``)."""
    mask = None if keep is None else _masks.key_padding(keep)
    if ids is not None:
        docs = _masks.documents(ids[0], ids[1])
        mask = docs if mask is None else docs & mask
    if diagonal:
        mask = _masks.causal() if mask is None else _masks.causal() & mask
    select, adds = (None, []) if placed is None else placed.at(at[0], q.shape[2], at[1], compute_dtype(q.dtype))
    if select is not None:
        mask = select if mask is None else mask & select
    mods = list(adds) + [part for part in kinds if isinstance(part, _masks.Softcap)]
    groups = q.shape[1] // k.shape[1]
    return _tiles.Tiles(q, k, v, mask, (), mods, scale=scale, block_q=_chunked.default_block_q(groups),
                        block_k=_chunked.BLOCK_K, mask_shape=(q.shape[0], q.shape[1], q.shape[2], k.shape[2]))


def _attend_block(q, k, v, keep, diagonal, scale, out, lse, ids=None, kinds=(), placed=None, at=(0, 0)):
    """Merge attention of q to one key segment into the running ``out`` and ``lse``, in place.

    q (B, H, n, D), k (B, Hkv, m, D), v (B, Hkv, m, Dv) as the caller has them; out
    (B, H, n, Dv) and lse (B, H, n) in the compute dtype accumulate over segments (lse = -inf:
    no visible key yet).
    """
    tiles = _block_tiles(q, k, v, keep, diagonal, scale, ids, kinds, placed, at)
    block_out, block_lse = tiles.forward()
    merged_out, merged_lse = _tiles.merge([out, tiles.ungroup_rows(block_out)], [lse, tiles.ungroup_lse(block_lse)])
    out.copy_(merged_out)
    lse.copy_(merged_lse)


def _attend_block_backward(q, k, v, keep, diagonal, scale, out, lse, dout, dq, dk, dv, ids=None, kinds=(),
                           placed=None, at=(0, 0)):
    """Add this key segment's share of the gradients into dq (B, H, n, D) (local) and dk
    (B, Hkv, m, D), dv (B, Hkv, m, Dv) (the segment's), in place; out, lse, dout are the
    whole sequence's (compute dtype), so p = exp(s - lse) are the final softmax weights."""
    tiles = _block_tiles(q, k, v, keep, diagonal, scale, ids, kinds, placed, at)
    dqs, dks, dvs, _, _ = tiles.backward(tiles.group_rows(out), tiles.group_lse(lse), tiles.group_rows(dout), None)
    dq += tiles.ungroup_rows(dqs)
    dk += dks.view(dk.shape)
    dv += dvs.view(dv.shape)
