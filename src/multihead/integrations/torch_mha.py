"""State-dict codecs between ``nn.MultiheadAttention``'s parameter names and
:class:`multihead.MultiHeadAttention`'s, and the load hooks built on them.

    >>> import torch.nn as nn, multihead
    >>> sd = torch_to_multihead(nn.MultiheadAttention(16, 4).state_dict())
    >>> multihead.MultiHeadAttention(16, 4).load_state_dict(sd)
    <All keys matched successfully>

=========================================  ==================================================
nn.MultiheadAttention (and multihead.nn)   multihead.MultiHeadAttention
=========================================  ==================================================
in_proj_weight (3E, E) = [W_q; W_k; W_v]   q_proj.weight, k_proj.weight, v_proj.weight
q_proj_weight, k_proj_weight,              q_proj.weight, k_proj.weight, v_proj.weight
v_proj_weight (when kdim or vdim != E)
in_proj_bias (3E,) = [b_q; b_k; b_v]       q_proj.bias, k_proj.bias, v_proj.bias
out_proj.weight, out_proj.bias             out_proj.weight, out_proj.bias (unchanged)
bias_k, bias_v (add_bias_kv=True)          none: left as they are, so a strict load names them
=========================================  ==================================================

Only keys are renamed and tensors split or stacked; shapes are left to ``load_state_dict`` to
check (a grouped-query module's K/V rows cannot come from nn.MultiheadAttention, and says so as
a size mismatch). Keys under other prefixes are untouched, so the hooks work for a submodule
of a larger model's checkpoint. This module imports nothing from multihead.

Legend: E embed_dim (the query size and the projections' output size).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch

__all__ = [
    "torch_to_multihead",
    "multihead_to_torch",
    "load_torch_state_dict",
    "load_multihead_state_dict",
]

_PROJ = ("q", "k", "v")

#: a state_dict: parameter names to tensors
StateDict = dict[str, torch.Tensor]


def _rename_torch_keys(sd: StateDict, prefix: str) -> None:
    """In place: nn.MultiheadAttention's projection keys under ``prefix`` -> MultiHeadAttention's."""
    packed = sd.pop(prefix + "in_proj_weight", None)
    ws: Sequence[Optional[torch.Tensor]]
    if packed is not None:
        ws = packed.chunk(3)
    else:
        ws = [sd.pop(f"{prefix}{p}_proj_weight", None) for p in _PROJ]
    for p, w in zip(_PROJ, ws):
        if w is not None:
            sd[f"{prefix}{p}_proj.weight"] = w
    bias = sd.pop(prefix + "in_proj_bias", None)
    if bias is not None:
        for p, b in zip(_PROJ, bias.chunk(3)):
            sd[f"{prefix}{p}_proj.bias"] = b


def _rename_multihead_keys(sd: StateDict, prefix: str, packed: Optional[bool]) -> None:
    """In place: MultiHeadAttention's projection keys under ``prefix`` -> nn.MultiheadAttention's.

    ``packed``: True for ``in_proj_weight``, False for the three ``*_proj_weight``, None to
    decide as nn.MultiheadAttention does (stacked when the three weights are all (E, E))."""
    names = [f"{prefix}{p}_proj.weight" for p in _PROJ]
    if not all(n in sd for n in names):
        return
    ws = [sd.pop(n) for n in names]
    if packed is None:
        e = ws[0].shape[0]
        packed = all(tuple(w.shape) == (e, e) for w in ws)
    if packed:
        sd[prefix + "in_proj_weight"] = torch.cat(ws)
    else:
        for p, w in zip(_PROJ, ws):
            sd[f"{prefix}{p}_proj_weight"] = w
    bias_names = [f"{prefix}{p}_proj.bias" for p in _PROJ]
    if all(n in sd for n in bias_names):
        sd[prefix + "in_proj_bias"] = torch.cat([sd.pop(n) for n in bias_names])


def _checked(state_dict: object, name: str) -> StateDict:
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"{name} takes a state_dict (a mapping of names to tensors), got {type(state_dict).__name__}")
    return dict(state_dict)


def torch_to_multihead(state_dict: Mapping[str, torch.Tensor], prefix: str = "") -> StateDict:
    """A copy of an ``nn.MultiheadAttention`` state_dict (keys under ``prefix``) with
    :class:`multihead.MultiHeadAttention`'s keys: ``in_proj_weight`` split into ``q_proj.weight``,
    ``k_proj.weight``, ``v_proj.weight`` (or the separate ``*_proj_weight`` renamed), likewise
    the biases. Tensors are shared (views), not copied."""
    sd = _checked(state_dict, "torch_to_multihead")
    _rename_torch_keys(sd, prefix)
    return sd


def multihead_to_torch(
    state_dict: Mapping[str, torch.Tensor], prefix: str = "", *, packed: Optional[bool] = None
) -> StateDict:
    """A copy of a :class:`multihead.MultiHeadAttention` state_dict with ``nn.MultiheadAttention``'s
    keys. ``packed=None`` stacks the projections into ``in_proj_weight`` when all three are
    (E, E), i.e. when nn.MultiheadAttention would (kdim == vdim == embed_dim); True/False forces it."""
    if packed is not None and not isinstance(packed, bool):
        raise TypeError(f"packed must be None, True or False, got {packed!r}")
    sd = _checked(state_dict, "multihead_to_torch")
    _rename_multihead_keys(sd, prefix, packed)
    return sd


def load_torch_state_dict(
    module: torch.nn.Module, state_dict: StateDict, prefix: str, local_metadata: dict[str, Any], strict: bool,
    missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str],
) -> None:
    """Load pre-hook that lets a :class:`multihead.MultiHeadAttention` load an
    ``nn.MultiheadAttention`` state_dict: ``mha.register_load_state_dict_pre_hook(load_torch_state_dict)``.
    A state_dict already in MultiHeadAttention's keys passes unchanged."""
    _rename_torch_keys(state_dict, prefix)


def load_multihead_state_dict(
    module: torch.nn.Module, state_dict: StateDict, prefix: str, local_metadata: dict[str, Any], strict: bool,
    missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str],
) -> None:
    """Load pre-hook that lets :class:`multihead.nn.MultiheadAttention` load a
    :class:`multihead.MultiHeadAttention` state_dict, stacked as the module's own layout is."""
    _rename_multihead_keys(state_dict, prefix, bool(module._qkv_same_embed_dim))
