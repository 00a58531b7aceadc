"""The former name of `multihead.decoding` (kept so that ``from multihead import decode_step``,
``decode_step.DecodeStep`` and ``decode_step.ENABLED = False`` keep working): this module makes
itself that module, so a flag set through either name is the one the module reads.

    >>> from multihead import decode_step, decoding
    >>> decode_step is decoding
    True
"""

import sys

from . import decoding

sys.modules[__name__] = decoding
