"""Attention masks, with one convention everywhere: ``True`` = this query may attend to this key.

=======================  ================================  ==============================
who                      boolean mask means                float mask means
=======================  ================================  ==============================
multihead (this module)  True = may attend                 added to the scores
torch SDPA               True = may attend                 added to the scores
nn.MultiheadAttention    True = **blocked** (opposite)     added to the scores
=======================  ================================  ==============================

Convert nn.MultiheadAttention's masks once, with `from_torch`.

Every mask here is a small object that knows how to build its tensors for given lengths, so
structure (causal, a window, documents) is kept until a backend decides how to use it. Masks
compose with ``&``:

* keep & keep  -> a key is visible only where both allow it;
* bias & keep  -> the bias where allowed, no attention elsewhere;
* bias & bias  -> the sum of the biases.

A plain bool tensor passed as ``mask`` means `keep`; a float tensor means `bias`.

Alignment when Lq != Lk (example Lq=2, Lk=5; rows are queries, columns keys)::

    causal(align="bottom_right")      causal(align="top_left")
        1 1 1 1 0                         1 0 0 0 0
        1 1 1 1 1                         1 1 0 0 0

Bottom-right puts the last query on the last key: it is what a decode step over a KV cache
needs (the new tokens come after the cached ones). Top-left is SDPA's ``is_causal`` rule.
Query i (0-based) sees key j when ``j <= i + offset``, with offset ``Lk - Lq`` (bottom-right)
or 0 (top-left). When Lq > Lk bottom-right leaves the first ``Lq - Lk`` queries with no key:
those rows give output 0 and weights 0.

A row that no key is left to attend to gives output 0 and weights 0 in every backend.

What one attention call computes with a mask (the parts in the order written with ``&``)::

    s = scale · q kᵀ                                          (B, H, Lq, Lk)
    s = s + (sum of the additive parts: bias tensors, alibi)
    s = mod(s) for each score-mod part in written order       (score_mod, softcap)
    s = -inf wherever a selecting part says False             (causal, window, keep, key_padding,
                                                               documents, chunked_local, mask_mod)
    w_ij = exp(s_ij) / (Σ_j exp(s_ij) + exp(sink_h))          (the sink term only with a sink part)
    out = w v                                                 (a row with no visible key: 0)

The kinds:

=========================  ================  ================================================
constructor                what it does      defined as
=========================  ================  ================================================
`causal`, `window`         selects           ``j <= d_i`` / ``d_i - left <= j <= d_i + right``
                                             with ``d_i`` query i's diagonal key (above)
``window(.., sinks=n)``    selects           the window, plus the first n keys (of the
                                             document) up to ``d_i + right``: StreamingLLM's
                                             sink tokens
`documents`,               selects           same document id (packed sequences; ids < 0 are
`from_seqlens`,                              padding, in no document); causal, window,
`from_cu_seqlens`                            chunked_local and alibi align *per document*
`chunked_local`            selects           keys in the same chunk of ``chunk`` keys as d_i
                                             (Llama 4's ``attention_chunk`` is
                                             ``causal() & chunked_local(chunk)``)
`mask_mod`                 selects           ``fn(b, h, q_idx, kv_idx) -> bool`` (FlexAttention)
`keep`, `key_padding`      selects           bool tensors
`bias`, `alibi`            adds              a float tensor; ``-slope_h · |j - d_i|``
`score_mod`, `softcap`     modifies scores   ``fn(score, b, h, q_idx, kv_idx)``;
                                             ``cap · tanh(s / cap)`` (Gemma 2)
`sink`                     adds to the       a learned logit per head (gpt-oss's ``s_aux``)
                           denominator
=========================  ================  ================================================

Packed sequences. ``documents(ids)`` takes per-token document ids, (B, L) or (L,) integers;
each document's tokens form one contiguous run (any order of runs, any id values; ids below 0
are padding tokens, which see nothing and are seen by no one). ``documents(q_ids, kv_ids)``
gives the queries' and the keys' ids apart (a decode step over a cache of packed documents,
or cross attention). The mask keeps a copy of the ids: changing the given tensor afterwards
changes no mask built from it (build a new one). Within each document, causal/window/chunked_local/alibi place the
diagonal as they do for a whole sequence: bottom-right aligns the document's last query with
its last key (as flash-attn's varlen kernels do per sequence), top-left its first with its first.
When queries and keys are the same tokens this is plain causal attention inside each document,
and the output of every document equals running that document alone.

Programmable masks and scores (FlexAttention's signatures). The index arguments are int64
tensors that broadcast as b (B, 1, 1, 1), h (1, H, 1, 1), q_idx (1, 1, bq, 1), kv_idx
(1, 1, 1, bk): absolute positions in the call, whatever the documents. They are evaluated one
tile at a time (`Mask.block`, `Mask.apply_block`); no (Lq, Lk) tensor is built except by the
backends that materialise the scores anyway (reference, sdpa). Both functions are tried once on
a 2 x 3 tile in `Mask.check` (at the public edge, before any work): a mask_mod must return a
bool tensor broadcastable to (B, H, bq, bk), a score_mod a tensor of the score's shape and
dtype. ``score_mod(fn)`` finds the tensors ``fn`` reads (its closure, defaults and the globals
it names, and the parameters of a module) as `Mask.tensors`, so a kernel can differentiate
into them; pass ``tensors=`` to name them yourself.

Block-wise use (the ``chunked`` backend): `Mask.key_span` says which keys a run of queries
can see at all (the hull of what causal, window, documents, chunked_local and a given plan leave),
so whole blocks outside it are never computed; `Mask.tile_state` says whether one tile is
"empty", "full" or "partial" for the selecting parts (a kernel skips empty tiles and needs no
keep tensor for full ones); `Mask.block` builds the keep and bias tensors of one tile only,
never the full (Lq, Lk) mask, and no keep at all where the selecting parts allow the whole tile.
A mask_mod's tile states come from a `BlockPlan` (like FlexAttention's ``BlockMask``), computed
once per shape from the function and kept on the object, so a mask shared by several layers
plans once; it is made again when a tensor the function reads has changed (compared by value); `block_plan` makes one for any mask and `Mask.with_plan` attaches it.

Details Contract A leaves open, as decided here: index tensors are int64; `Mask.apply_block`
and `Mask.tensors` exist on every mask (all its score mods in written order; nothing without
any); `Mask.tile_state` takes an optional ``device=`` (where a mask_mod plans, default its
captured tensors' device or the CPU) and `Mask.check` an optional ``dtype=`` (the dtype the
score mods are probed in); sink tokens are ``window(left, sinks=n)``; ``chunked_local`` is not
causal by itself; a mask has at most one documents part and one sink part.

Legend: B batch, H query heads, Lq/Lk query/key lengths, bq/bk a tile's query/key counts.

The package, one concept a file; each imports only the files above it in this list:

==================  ==========================================================================
`geometry`          rows, diagonals and key intervals: the arithmetic every structural kind and
                    kernel shares (no mask classes)
`core`              the algebra (`Mask`, ``&``, `as_mask`, `keep`, `bias`) and what kernels read
                    (`Mask.role`, intervals, tile states, `BlockPlan`, `as_4d`, `tile_of`)
`plans`             `block_plan`: a mask's tile states over a grid, computed once
`structural`        causal, window, chunked_local, documents: each kind beside its constructor
`tensors`           key_padding (keep and bias, what a plain tensor means, are in `core`)
`programmable`      mask_mod and score_mod: FlexAttention's functions, evaluated per tile
`scores`            the built-in score kinds: softcap, sink, alibi
`convert`           foreign conventions in: nn.MultiheadAttention's (`from_torch`), Hugging Face's
==================  ==========================================================================

docs/masks.md ("Adding a mask kind") walks through a new kind.
"""

from __future__ import annotations

from .convert import from_torch
from .core import (
    ROLES,
    BlockPlan,
    Mask,
    MaskLike,
    MaskTensors,
    as_mask,
    bias,
    keep,
    split_additive,
)
from .core import AllOf as AllOf, Bias as Bias, Keep as Keep
from .core import Shape as Shape, as_4d as as_4d, tile_of as tile_of
from .geometry import ALIGNMENTS, TILE_STATES, UNLIMITED
from .geometry import interval_cover as interval_cover
from .plans import PLAN_BLOCK as PLAN_BLOCK, block_plan
from .programmable import MaskMod as MaskMod, ScoreMod as ScoreMod, mask_mod, score_mod
from .scores import ALiBi as ALiBi, Sink as Sink, Softcap as Softcap, alibi, alibi_slopes, sink, softcap
from .scores import MAX_HEADS as MAX_HEADS
from .structural import Causal as Causal, ChunkedLocal as ChunkedLocal, Documents as Documents, Window as Window
from .structural import MAX_TOKENS as MAX_TOKENS, causal, chunked_local, documents, from_cu_seqlens, from_seqlens, window
from .tensors import KeyPadding as KeyPadding, key_padding

__all__ = [
    "Mask",
    "MaskLike",
    "MaskTensors",
    "BlockPlan",
    "causal",
    "window",
    "key_padding",
    "keep",
    "bias",
    "documents",
    "from_seqlens",
    "from_cu_seqlens",
    "chunked_local",
    "mask_mod",
    "score_mod",
    "softcap",
    "sink",
    "alibi",
    "alibi_slopes",
    "block_plan",
    "as_mask",
    "from_torch",
    "split_additive",
    "ALIGNMENTS",
    "ROLES",
    "TILE_STATES",
    "UNLIMITED",
]
