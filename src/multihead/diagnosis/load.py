"""Load the module a command line names: ``FILE.py:Name``, with ``NAME=VALUE`` arguments.

    >>> from multihead.diagnosis.load import parse_assignments
    >>> parse_assignments(["d_model=64", "name='x'", "causal=True"], "--init")
    {'d_model': 64, 'name': 'x', 'causal': True}

``Name`` is an ``nn.Module`` class (built with the ``--init`` arguments), a function returning a
module (called with them), or a module instance. Values are Python literals (numbers, strings,
True/False/None, tuples); anything else is taken as a string. Every mistake raises a
ValueError naming the flag and what to write instead (the command line prints it as one line).
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any, Sequence

import torch.nn as nn

__all__ = ["parse_assignments", "load_module"]


def parse_assignments(items: Sequence[str], flag: str) -> dict[str, Any]:
    """``["a=1", "b='x'"]`` as ``{"a": 1, "b": "x"}``."""
    out: dict[str, Any] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name.isidentifier():
            raise ValueError(f"{flag} takes NAME=VALUE (e.g. {flag} d_model=64), got {item!r}")
        try:
            out[name] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            out[name] = text
    return out


def load_module(spec: str, init: dict[str, Any]) -> nn.Module:
    """The module ``FILE.py:Name`` names (see the module docstring)."""
    path_text, sep, name = spec.rpartition(":")
    if not sep or not path_text or not name:
        raise ValueError(f"name the module as FILE.py:Class (e.g. my_attention.py:MultiHeadAttention), got {spec!r}")
    path = Path(path_text)
    if not path.is_file():
        raise ValueError(f"{path_text}: no such file")
    module_name = f"_multihead_diagnose_{path.stem}"
    loader = importlib.util.spec_from_file_location(module_name, path)
    if loader is None or loader.loader is None:
        raise ValueError(f"{path_text} is not a Python file")
    code = importlib.util.module_from_spec(loader)
    sys.modules[module_name] = code  # dataclasses and pickling look their module up here
    try:
        loader.loader.exec_module(code)
    except Exception as e:
        raise ValueError(f"{path_text} raised on import: {type(e).__name__}: {e}") from None
    if not hasattr(code, name):
        found = sorted(n for n, v in vars(code).items() if inspect.isclass(v) and issubclass(v, nn.Module)
                       and v.__module__ == module_name)
        raise ValueError(f"{path_text} has no {name!r}; its nn.Module classes: {', '.join(found) or 'none'}")
    target = getattr(code, name)
    if isinstance(target, nn.Module):
        if init:
            raise ValueError(f"{name} is a module instance: --init does not apply; drop it")
        return target
    if not callable(target):
        raise ValueError(f"{name} in {path_text} is a {type(target).__name__}, not an nn.Module class or factory")
    signature = inspect.signature(target)
    missing = [p.name for p in list(signature.parameters.values())
               if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in init]
    if missing:
        raise ValueError(f"{name}(...) needs {', '.join(repr(m) for m in missing)}: pass --init {missing[0]}=VALUE")
    try:
        module = target(**init)
    except Exception as e:
        raise ValueError(f"{name}(**{init}) raised {type(e).__name__}: {e}") from None
    if not isinstance(module, nn.Module):
        raise ValueError(f"{name}(...) returned a {type(module).__name__}, not an nn.Module")
    return module
