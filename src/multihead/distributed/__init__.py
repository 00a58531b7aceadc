"""Context parallelism: one sequence sharded across the ranks of a process group."""

from .ring import (
    LAYOUTS,
    ContextParallel,
    DocumentLayout,
    RingError,
    context_parallel,
    mask_signature,
    rank_work,
    ring_attention,
    ring_plan,
    shard_positions,
    shard_sequence,
    unshard_sequence,
)

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
]
