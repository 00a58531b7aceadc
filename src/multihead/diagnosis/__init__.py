"""``multihead.diagnosis``: find the first wrong step of your own multi-head attention module.

    >>> import torch.nn as nn, multihead
    >>> d = multihead.diagnose(nn.MultiheadAttention(8, 2, batch_first=True))
    >>> d.status
    'matches'

The verb is :func:`multihead.diagnose` (:func:`.run.diagnose`, imported on first use); this
package, the noun, holds the work. Its rooms, in the order the work flows: :mod:`.anatomy` (the
projections, head count and call of the module), :mod:`.probes` (inputs that make bugs
visible), :mod:`.record` (every tensor the forward makes, with its line), :mod:`.reference`
(the definition, traced, by stage), :mod:`.layouts` (the layouts a correct step may have),
:mod:`.locate` (the first wrong step and why), :mod:`.verdict` (:class:`Diagnosis`, the oracle's
bound), :mod:`.words` (en/zh) and :mod:`.render` (text, JSON, HTML).
"""

from __future__ import annotations

from .anatomy import MAX_PARAMETERS, NotAttention
from .locate import Finding
from .run import diagnose
from .verdict import Convention, Diagnosis

__all__ = ["diagnose", "Diagnosis", "Finding", "Convention", "NotAttention", "MAX_PARAMETERS"]

