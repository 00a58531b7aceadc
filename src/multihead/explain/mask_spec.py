"""The ``--mask`` specs of ``multihead explain``: short texts for the example's mask parts.

    >>> from multihead.explain.mask_spec import parse_mask
    >>> parse_mask(("documents:3,2", "softcap:5"), tokens=5, keys=5, heads=2)
    from_seqlens([3, 2]) & softcap(5)

One spec is one part; several specs (repeated ``--mask``, or one joined with ``&``) combine with
``&`` in the order written, after the module's causal mask (``--causal``), which then aligns per
document. The kinds (:data:`SPECS`):

* ``documents:3,2``: packed documents of these lengths, summing to the tokens
  (:func:`multihead.masks.from_seqlens`; self-attention only)
* ``window:2``: each query sees itself and the 2 keys before it (``window:2:1``: 1 sink token too)
* ``chunked_local:2``: keys of the query's own chunk of 2 tokens
* ``alibi``: ALiBi's per-head linear bias (:func:`multihead.masks.alibi_slopes`)
* ``softcap:5``: scores squashed to ``5·tanh(s/5)``
* ``sink:0.5``: a sink logit of 0.5 for every head in the softmax's denominator

A bad spec raises ValueError naming ``name`` (the command line passes ``--mask``) and the fix.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch

from .. import masks

__all__ = ["SPECS", "parse_mask", "split_specs"]

#: each kind and the form of its spec, as ``--help`` lists them
SPECS = {
    "documents": "documents:3,2 (lengths summing to --tokens)",
    "window": "window:LEFT[:SINKS]",
    "chunked_local": "chunked_local:CHUNK",
    "alibi": "alibi",
    "softcap": "softcap:CAP (> 0)",
    "sink": "sink:LOGIT",
}


def split_specs(specs: Sequence[str]) -> tuple[str, ...]:
    """The single-part specs of ``specs`` (each may join several with ``&``), stripped."""
    return tuple(part.strip() for spec in specs for part in spec.split("&") if part.strip())


def _ints(text: str, what: str, bad: Callable[[str], ValueError]) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise bad(f"{what} must be integers separated by commas, got {text!r}") from None
    return values


def _number(text: str, what: str, bad: Callable[[str], ValueError]) -> float:
    try:
        value = float(text)
    except ValueError:
        raise bad(f"{what} must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise bad(f"{what} must be finite, got {text!r}")
    return value


def _part(spec: str, *, tokens: int, keys: int, heads: int, name: str) -> masks.Mask:
    kind, _, arg = spec.partition(":")

    def bad(why: str) -> ValueError:
        return ValueError(f"{name} {spec!r}: {why}")

    def no_arg() -> None:
        if arg:
            raise bad(f"{kind} takes no value; write {kind}")

    def need_arg(form: str) -> None:
        if not arg:
            raise bad(f"{kind} needs a value; write {form}")

    if kind == "documents":
        need_arg("documents:3,2 (the document lengths)")
        lengths = _ints(arg, "the document lengths", bad)
        if any(n < 1 for n in lengths):
            raise bad(f"every document length must be >= 1, got {lengths}")
        if keys != tokens:
            raise bad(f"documents pack self-attention; drop --keys (got {keys} keys for {tokens} tokens)")
        if sum(lengths) != tokens:
            raise bad(f"the lengths sum to {sum(lengths)} but --tokens is {tokens}; make them sum to {tokens}")
        return masks.from_seqlens(lengths)
    if kind == "window":
        need_arg("window:2 (keys before the query) or window:2:1 (and 1 sink token)")
        values = _ints(arg.replace(":", ","), "window's left and sinks", bad)
        if len(values) > 2 or any(v < 0 for v in values):
            raise bad("write window:LEFT or window:LEFT:SINKS with integers >= 0")
        return masks.window(values[0], sinks=values[1] if len(values) == 2 else 0)
    if kind == "chunked_local":
        need_arg("chunked_local:2 (the chunk length)")
        chunk = _ints(arg, "the chunk", bad)
        if len(chunk) != 1 or chunk[0] < 1:
            raise bad(f"the chunk must be one integer >= 1, got {arg!r}")
        return masks.chunked_local(chunk[0])
    if kind == "alibi":
        no_arg()
        return masks.alibi(masks.alibi_slopes(heads))
    if kind == "softcap":
        need_arg("softcap:5 (the cap, > 0)")
        cap = _number(arg, "the cap", bad)
        if cap <= 0:
            raise bad(f"the cap must be > 0 (scores are squashed into (-cap, cap)), got {arg}")
        f32 = torch.finfo(torch.float32)
        if not f32.tiny <= cap <= f32.max:
            raise bad(f"the cap must lie within float32's range ({f32.tiny:g} to {f32.max:g}), got {arg}")
        return masks.softcap(cap)
    if kind == "sink":
        need_arg("sink:0.5 (the sink logit of every head)")
        logit = _number(arg, "the sink logit", bad)
        if abs(logit) > torch.finfo(torch.float32).max:
            raise bad(f"the sink logit must lie within float32's range (±{torch.finfo(torch.float32).max:g}), got {arg}")
        return masks.sink(torch.full((heads,), logit))
    raise bad(f"unknown kind {kind!r}; the kinds are {', '.join(SPECS)} (e.g. documents:3,2 or softcap:5)")


def parse_mask(specs: Sequence[str], *, tokens: int, keys: int, heads: int, name: str = "mask") -> Optional[masks.Mask]:
    """The mask of ``specs`` for an example of ``tokens`` queries, ``keys`` keys and ``heads``
    heads: its parts joined by ``&`` in order, or None for no spec."""
    if isinstance(specs, str) or not all(isinstance(s, str) for s in specs):
        raise TypeError(f"{name} must be a sequence of spec strings (e.g. ('documents:3,2',)), got {specs!r}")
    parts = [_part(p, tokens=tokens, keys=keys, heads=heads, name=name) for p in split_specs(specs)]
    if not parts:
        return None
    mask = parts[0]
    for p in parts[1:]:
        mask = mask & p
    return mask
