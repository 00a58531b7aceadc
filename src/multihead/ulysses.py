"""The path `multihead.distributed.ulysses` had in 0.2 (all-to-all context parallelism), kept so that
code written against it runs: the same functions, one copy.

    >>> import multihead.ulysses, multihead.distributed
    >>> multihead.ulysses.ulysses_attention is multihead.distributed.ulysses_attention
    True
"""

from .distributed.ulysses import hybrid_attention, hybrid_groups, ulysses_attention

__all__ = ["ulysses_attention", "hybrid_groups", "hybrid_attention"]
