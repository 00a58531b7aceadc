"""Context parallelism: one sequence sharded across the ranks of a process group.

Two ways to attend over it, one room each: the ring (`ring_attention`: key/value blocks travel
round the ranks; the masks that can travel with them) and all-to-all (`ulysses_attention`:
sequence shards traded for whole heads; every mask kind), and `hybrid_attention` of the two.
`ContextParallel` runs a `multihead.MultiHeadAttention` with the ring as its attention step.

    layouts           how a sequence is cut (contiguous, zigzag, DocumentLayout) and put back
    plan              which (query, key) segment pairs each rank attends at each ring step; each
                      rank's causal work (the balance a layout gives)
    transport         the ring's sends and collectives, bounded waits, RingError
    agreement         the ranks compare their calls before any transfer
    ring_masks        the masks a ring carries, split and placed by position
    blocks            one ring step: the tile kernel on one segment pair, merged
    ring              ring_attention (forward and backward rings)
    ulysses           ulysses_attention, hybrid_groups, hybrid_attention
    context_parallel  ContextParallel, context_parallel

>>> from multihead.distributed import shard_sequence, unshard_sequence
>>> import torch
>>> x = torch.arange(8.0)[:, None]
>>> shard_sequence(x, 0, 2, "zigzag")[:, 0].tolist()
[0.0, 1.0, 6.0, 7.0]
"""

from .agreement import mask_signature
from .context_parallel import ContextParallel, context_parallel
from .layouts import LAYOUTS, DocumentLayout, shard_positions, shard_sequence, unshard_sequence
from .plan import rank_work, ring_plan
from .ring import ring_attention
from .transport import RingError
from .ulysses import hybrid_attention, hybrid_groups, ulysses_attention

__all__ = [
    "LAYOUTS",
    "DocumentLayout",
    "rank_work",
    "ring_plan",
    "RingError",
    "mask_signature",
    "ring_attention",
    "shard_sequence",
    "unshard_sequence",
    "shard_positions",
    "ContextParallel",
    "context_parallel",
    "ulysses_attention",
    "hybrid_groups",
    "hybrid_attention",
]
