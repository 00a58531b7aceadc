"""multihead: multi-head attention you can read, trace and trust.

Public surface:

* :func:`attention`, :func:`attention_weights`, :func:`explain_dispatch` -- functional core
* :mod:`multihead.masks` -- one mask convention: True = may attend
* :class:`MultiHeadAttention`, :class:`PerHeadAttention` -- modules
* :class:`multihead.nn.MultiheadAttention` -- a drop-in for ``torch.nn.MultiheadAttention``
* :func:`trace` -- record the steps of a real forward pass
* :class:`KVCache`, :class:`StaticKVCache`, :class:`KVCaches`, :class:`RoPE` -- step-by-step
  decoding (eager and compiled, one cache per layer) and rotary position embeddings
"""

from . import backends, masks, nn
from .cache import KVCache, KVCaches, StaticKVCache
from .config import AttentionConfig
from .functional import attention, attention_weights, explain_dispatch
from .module import MultiHeadAttention
from .per_head import PerHeadAttention
from .rope import RoPE
from .trace import Trace, trace

__version__ = "0.1.0"

__all__ = [
    "attention",
    "attention_weights",
    "explain_dispatch",
    "masks",
    "backends",
    "nn",
    "MultiHeadAttention",
    "PerHeadAttention",
    "AttentionConfig",
    "trace",
    "Trace",
    "KVCache",
    "StaticKVCache",
    "KVCaches",
    "RoPE",
]
