"""Attention backends behind one signature, in a small registry.

Every backend is a function ``fn(q, k, v, mask, *, scale, dropout_p) -> out`` (and, if it can
give the log-sum-exp, ``lse_fn(...)`` with the same arguments ``-> (out, lse)``, lse (B, H, Lq)
float, -inf for a row with no visible key) with
q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), ``mask`` a `multihead.masks.Mask`
or None, and out (B, H, Lq, Dv). Inputs arrive validated. Each backend also says, for a given
call, why it cannot take it (or None when it can), and may say why ``"auto"`` should not pick it
although it could (too slow or too much memory for this call: ``auto_declines``). ``"auto"``
picks the first backend in `AUTO_ORDER` that neither refuses nor declines the call, and
`explain_dispatch` reports every reason, and how the chosen backend will run the call when it
can say (``describe``); a backend named explicitly runs unless it refuses.

Legend: B batch, H query heads, Hkv key/value heads, Lq/Lk query/key lengths, D head dim,
Dv value head dim.
"""

from __future__ import annotations

from .registry import AUTO_ORDER as AUTO_ORDER, _REGISTRY as _REGISTRY, resolve_traced as resolve_traced, why_not as why_not
from .registry import (Backend, BackendName, Call, Dispatch, explain_dispatch_call, get, names, register,
                       resolve)
from . import reference, sdpa, chunked, flex  # each registers itself (names in AUTO_ORDER)

__all__ = ["BackendName", "Backend", "Call", "register", "get", "names", "resolve", "explain_dispatch_call", "Dispatch"]
