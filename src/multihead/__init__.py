"""multihead: multi-head attention you can read, trace and trust.

>>> import torch, multihead as mh
>>> mha = mh.MultiHeadAttention(d_in=16, num_heads=2, causal=True)
>>> x = torch.randn(1, 4, 16)                       # (B, L, d_in)
>>> out, weights = mha(x, return_weights=True)
>>> out.shape, weights.shape                        # weights: (B, H, Lq, Lk)
(torch.Size([1, 4, 16]), torch.Size([1, 2, 4, 4]))
>>> weights[0, 0, 0].tolist()                       # causal: the first query sees only itself
[1.0, 0.0, 0.0, 0.0]

Public surface:

* :func:`attention`, :func:`attention_weights`, :func:`explain_dispatch` -- functional core;
  :func:`merge` combines attention over disjoint key sets (``attention(..., return_lse=True)``)
* :mod:`multihead.masks` -- one mask convention: True = may attend
* :class:`MultiHeadAttention`, :class:`PerHeadAttention` -- modules
* :class:`multihead.nn.MultiheadAttention` -- a drop-in for ``torch.nn.MultiheadAttention``
* :func:`trace` -- record the steps of a real forward pass
* :func:`explain_module` -- the step-by-step walkthrough of your own module or trace (text,
  Markdown, JSON, HTML, inline in Jupyter); :mod:`multihead.explain` is the package that draws
  it (and ``multihead explain``, the command); both loaded on first use
* :func:`diagnose` -- find the first wrong step of your own attention module (loaded on first use)
* :class:`KVCache`, :class:`StaticKVCache`, :class:`KVCaches`, :class:`RoPE` -- step-by-step
  decoding (eager and compiled, one cache per layer) and rotary position embeddings
"""

from . import backends, masks, nn, steps
from .cache import KVCache, KVCaches, StaticKVCache
from .paged import PagedKVCache
from .ragged import RaggedKVCache
from .config import AttentionConfig
from .functional import attention, attention_weights, explain_dispatch, merge
from .module import MultiHeadAttention
from .per_head import PerHeadAttention
from .rope import RoPE
from . import trace as _trace
from .trace import Trace, trace

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from . import explain
    from .explain.explanation import explain_module
    from .diagnosis import diagnose
    from .explain.real_model import explain_model

__version__ = "0.1.0"  # the one place the version is written (pyproject.toml reads it)

__all__ = [
    "attention",
    "attention_weights",
    "explain_dispatch",
    "merge",
    "masks",
    "backends",
    "nn",
    "steps",
    "MultiHeadAttention",
    "PerHeadAttention",
    "AttentionConfig",
    "trace",
    "Trace",
    "KVCache",
    "StaticKVCache",
    "KVCaches",
    "RaggedKVCache",
    "PagedKVCache",
    "RoPE",
    "explain",
    "explain_module",
    "diagnose",
    "explain_model",
]


def __getattr__(name: str) -> Any:
    """``multihead.explain`` (the package), ``explain_module``, ``explain_model`` and ``diagnose`` (a
    function; its package is :mod:`multihead.diagnosis`),
    imported on first use (``import multihead`` stays light: the walkthrough's renderers load only
    when asked for). This front door sits above the explain and diagnose packages, so these
    imports point the one way."""
    if name == "explain":
        import importlib

        return importlib.import_module(".explain", __name__)
    if name == "diagnose":        # the first wrong step of your own module: multihead.diagnose(mha)
        from .diagnosis import diagnose

        return diagnose
    if name == "explain_module":  # your own module's walkthrough: multihead.explain_module(mha, x)
        from .explain.explanation import explain_module

        return explain_module
    if name == "explain_model":   # a real model's page: multihead.explain_model("smollm2", "The cat sat.")
        from .explain.real_model import explain_model

        return explain_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _trace_html(tr: Trace) -> str:
    """A trace's cell in Jupyter: the walkthrough page in an iframe (:mod:`multihead.explain.notebook`,
    imported at the first display)."""
    from .explain.notebook import trace_html

    return trace_html(tr)


_trace.html_renderer = _trace_html
