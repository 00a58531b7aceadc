"""What one ``multihead explain`` run is asked to do, as typed values.

    >>> from multihead.explain.options import Options
    >>> from multihead.explain.example import ExampleConfig
    >>> Options(format="markdown", lang="zh", example=ExampleConfig(heads=4)).example.head_dim
    2

The command line (:mod:`multihead.cli`) builds one from its flags and hands it to the
``run`` functions of :mod:`.walkthrough`, :mod:`.visual` and :mod:`.real_model`; Python callers
can build one themselves. A wrong value raises ValueError or TypeError naming the field; which
options may be combined (``--text`` only with ``--model``, ...) is the command line's business.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .._checks import check_positive_int
from ..steps import LANGS
from .example import ExampleConfig

__all__ = ["FORMATS", "Options"]

#: the output formats: the first three are text (the walkthrough or the model report), the
#: last two pictures that need a file (``out``)
FORMATS = ("text", "json", "markdown", "html", "png")


def _check_choice(value: object, name: str, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


def _check_flag(value: object, name: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def _check_index(value: object, name: str) -> None:
    if value is not None:
        check_positive_int(value, name, allow_zero=True)


@dataclass(frozen=True)
class Options:
    """One ``multihead explain`` request.

    format: one of :data:`FORMATS`. lang: "en" or "zh". out: the file to write, "-" or None for
    stdout. values / per_head / cost: what the text walkthrough adds (the numbers, the per-head
    comparison, FLOPs and bytes). example: the module and inputs the walkthrough builds
    (ignored with ``model``). model: a pretrained model to explain instead (its name or a
    directory), with text (the sentence, None = the default one), layer, head and token
    (indices, None = the default) and neuron (the neuron view).
    """

    format: str = "text"
    lang: str = "en"
    out: Optional[str] = None
    values: bool = True
    per_head: bool = False
    cost: bool = False
    example: ExampleConfig = field(default_factory=ExampleConfig)
    model: Optional[str] = None
    text: Optional[str] = None
    layer: Optional[int] = None
    head: Optional[int] = None
    token: Optional[int] = None
    neuron: bool = False

    def __post_init__(self) -> None:
        _check_choice(self.format, "format", FORMATS)
        _check_choice(self.lang, "lang", LANGS)
        for name in ("values", "per_head", "cost", "neuron"):
            _check_flag(getattr(self, name), name)
        for name in ("out", "model", "text"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{name} must be a string or None, got {type(value).__name__}")
        for name in ("layer", "head", "token"):
            _check_index(getattr(self, name), name)
        if not isinstance(self.example, ExampleConfig):
            raise TypeError(f"example must be an ExampleConfig, got {type(self.example).__name__}")
