"""The bad-input battery: every public entry point, fed every kind of mistake.

A user mistake must raise ValueError or TypeError whose message names the argument (and the
fix), before torch sees the tensors: never an IndexError/RuntimeError from three calls deep.
Inputs that are not mistakes but edge cases (empty sequences, NaN/inf values, a bias of another
float dtype) must give a defined result. The cases are tables, so ``pytest --collect-only -q``
counts them. The "meta" device stands in for a second device (a GPU) on a CPU-only machine.

Legend: B batch, H query heads, Hkv key/value heads, Lq/Lk lengths, D head dim, Dv value dim.
"""

from __future__ import annotations

import io
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

import multihead
from multihead import backends, masks
from multihead.cli import main as cli_main
from multihead.interop import to_torch
from multihead.per_head import from_per_head, to_per_head
from oracle import FLOOR_ULPS, attention_or_refusal, module_or_refusal, one_thread

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

B, H, HKV, LQ, LK, D, DV = 2, 4, 2, 5, 6, 8, 3


def qkv(dtype=torch.float32, **sizes):
    s = dict(B=B, H=H, Hkv=HKV, Lq=LQ, Lk=LK, D=D, Dv=DV) | sizes
    g = torch.Generator().manual_seed(0)
    return (torch.randn(s["B"], s["H"], s["Lq"], s["D"], generator=g, dtype=dtype),
            torch.randn(s["B"], s["Hkv"], s["Lk"], s["D"], generator=g, dtype=dtype),
            torch.randn(s["B"], s["Hkv"], s["Lk"], s["Dv"], generator=g, dtype=dtype))


Q, K, V = qkv()
META = torch.device("meta")


def mha(**kwargs):
    torch.manual_seed(0)
    return multihead.MultiHeadAttention(16, 4, **kwargs)


X = torch.randn(B, LQ, 16)
Y = torch.randn(B, LK, 16)


@dataclass
class Bad:
    """``call()`` must raise ``error`` with a message matching ``match`` (the argument's name)."""

    id: str
    call: Callable
    error: type
    match: str


def _replace(args: tuple, i: int, value) -> tuple:
    return args[:i] + (value,) + args[i + 1:]


# --------------------------------------------------------------------------- functional
def _functional_cases():
    """Each mistake, for attention, attention_weights (q, k only) and explain_dispatch."""
    base = (Q, K, V)
    mistakes = [
        ("q list", 0, Q.tolist(), TypeError, r"q must be a torch\.Tensor.*torch\.as_tensor"),
        ("q numpy", 0, Q.numpy(), TypeError, r"q must be a torch\.Tensor.*torch\.as_tensor"),
        ("k list", 1, K.tolist(), TypeError, r"k must be a torch\.Tensor.*torch\.as_tensor"),
        ("k numpy", 1, K.numpy(), TypeError, r"k must be a torch\.Tensor.*torch\.as_tensor"),
        ("v numpy", 2, V.numpy(), TypeError, r"v must be a torch\.Tensor.*torch\.as_tensor"),
        ("q int64", 0, Q.long(), TypeError, r"q must have a floating dtype"),
        ("q bool", 0, Q > 0, TypeError, r"q must have a floating dtype"),
        ("k int32", 1, K.int(), TypeError, r"k must have a floating dtype"),
        ("v uint8", 2, V.to(torch.uint8), TypeError, r"v must have a floating dtype"),
        ("q rank 3", 0, Q[0], ValueError, r"q must have 4 dimensions"),
        ("q rank 5", 0, Q[None], ValueError, r"q must have 4 dimensions"),
        ("k rank 3", 1, K[0], ValueError, r"k must have 4 dimensions"),
        ("v rank 2", 2, V[0, 0], ValueError, r"v must have 4 dimensions"),
        ("k batch", 1, K[:1], ValueError, r"q has B=2, k has B=1"),
        ("v batch", 2, V[:1], ValueError, r"q has B=2, v has B=1"),
        ("k head dim", 1, K[..., :5], ValueError, r"q has D=8, k has D=5"),
        ("H not a multiple of Hkv", 1, torch.randn(B, 3, LK, D), ValueError, r"Hq=4, Hkv=3.*multiple"),
        ("v heads", 2, torch.randn(B, 1, LK, DV), ValueError, r"k has Hkv=2 heads but v has 1"),
        ("v length", 2, torch.randn(B, HKV, LK + 1, DV), ValueError, r"k has Lk=6 keys but v has 7"),
        ("k float64", 1, K.double(), TypeError, r"k has dtype torch\.float64 but q"),
        ("v float16", 2, V.half(), TypeError, r"v has dtype torch\.float16 but q"),
        ("k on another device", 1, K.to(META), ValueError, r"k is on meta but q is on cpu"),
        ("v on another device", 2, V.to(META), ValueError, r"v is on meta but q is on cpu"),
    ]
    for name, i, value, error, match in mistakes:
        yield Bad(f"attention: {name}", lambda i=i, value=value: multihead.attention(*_replace(base, i, value)),
                  error, match)
        yield Bad(f"explain_dispatch: {name}",
                  lambda i=i, value=value: multihead.explain_dispatch(*_replace(base, i, value)), error, match)
        if i < 2 and "v " not in name and "v:" not in name:
            yield Bad(f"attention_weights: {name}",
                      lambda i=i, value=value: multihead.attention_weights(*_replace(base[:2], i, value)), error, match)

    mask_mistakes = [
        ("int mask", torch.ones(LQ, LK, dtype=torch.int64), TypeError, r"mask has dtype torch\.int64.*True = "),
        ("uint8 mask", torch.ones(LQ, LK, dtype=torch.uint8), TypeError, r"mask has dtype torch\.uint8"),
        ("list mask", [[True] * LK] * LQ, TypeError, r"mask must be None.*torch\.as_tensor"),
        ("numpy mask", np.ones((LQ, LK), dtype=bool), TypeError, r"mask must be None.*torch\.as_tensor"),
        ("string mask", "causal", TypeError, r"mask must be None"),
        ("keep wrong Lk", torch.ones(LQ, LK + 1, dtype=torch.bool), ValueError, r"mask \(keep mask\) has shape \(5, 7\)"),
        ("keep wrong Lq", torch.ones(LQ + 1, LK, dtype=torch.bool), ValueError, r"mask \(keep mask\) has shape"),
        ("keep batch mismatch", torch.ones(3, 1, LQ, LK, dtype=torch.bool), ValueError, r"mask \(keep mask\).*\(3, 1, 5, 6\)"),
        ("keep heads mismatch", torch.ones(B, 3, LQ, LK, dtype=torch.bool), ValueError, r"mask \(keep mask\)"),
        ("keep rank 5", torch.ones(1, B, H, LQ, LK, dtype=torch.bool), ValueError, r"mask \(keep mask\)"),
        ("bias batch mismatch", torch.zeros(3, H, LQ, LK), ValueError, r"mask \(bias\) has shape"),
        ("bias wrong Lk", torch.zeros(LQ, LK - 1), ValueError, r"mask \(bias\) has shape"),
        ("key_padding batch mismatch", masks.key_padding(torch.ones(3, LK, dtype=torch.bool)), ValueError,
         r"mask \(key padding\) has shape \(3, 6\).*\(2, 6\)"),
        ("key_padding wrong Lk", masks.key_padding(torch.ones(B, LK + 2, dtype=torch.bool)), ValueError,
         r"mask \(key padding\)"),
        ("keep on another device", torch.ones(LQ, LK, dtype=torch.bool, device=META), ValueError,
         r"mask \(keep mask\) is on meta"),
        ("bias on another device", torch.zeros(LQ, LK, device=META), ValueError, r"mask \(bias\) is on meta"),
        ("key_padding on another device", masks.key_padding(torch.ones(B, LK, dtype=torch.bool, device=META)),
         ValueError, r"mask \(key padding\) is on meta"),
        ("combined mask, one part on another device",
         masks.causal() & masks.keep(torch.ones(LQ, LK, dtype=torch.bool, device=META)), ValueError, r"is on meta"),
        ("nn.MultiheadAttention 3-D mask of the wrong B*H",
         masks.from_torch(attn_mask=torch.zeros(B * H + 1, LQ, LK, dtype=torch.bool)), ValueError,
         r"mask \(nn\.MultiheadAttention 3-D attn_mask\).*\(B\*H, Lq, Lk\)"),
        ("nn.MultiheadAttention 3-D mask on another device",
         masks.from_torch(attn_mask=torch.zeros(B * H, LQ, LK, dtype=torch.bool, device=META)), ValueError,
         r"mask is on meta"),
    ]
    for name, mask, error, match in mask_mistakes:
        yield Bad(f"attention: {name}", lambda mask=mask: multihead.attention(Q, K, V, mask), error, match)
        yield Bad(f"attention_weights: {name}", lambda mask=mask: multihead.attention_weights(Q, K, mask), error, match)
        yield Bad(f"explain_dispatch: {name}", lambda mask=mask: multihead.explain_dispatch(Q, K, V, mask), error, match)

    for scale in (0, 0.0, -1.0, math.nan, math.inf, -math.inf):
        yield Bad(f"attention: scale={scale}", lambda s=scale: multihead.attention(Q, K, V, scale=s), ValueError,
                  r"scale must be positive and finite")
        yield Bad(f"attention_weights: scale={scale}", lambda s=scale: multihead.attention_weights(Q, K, scale=s),
                  ValueError, r"scale must be positive and finite")
    for scale in ("0.5", torch.tensor(0.5), True, [0.5]):
        yield Bad(f"attention: scale of type {type(scale).__name__}",
                  lambda s=scale: multihead.attention(Q, K, V, scale=s), TypeError, r"scale must be a positive number")
    for p in (-0.1, 1.0, 1.5, math.nan, math.inf):
        yield Bad(f"attention: dropout_p={p}", lambda p=p: multihead.attention(Q, K, V, dropout_p=p), ValueError,
                  r"dropout_p must be in \[0, 1\)")
        yield Bad(f"explain_dispatch: dropout_p={p}", lambda p=p: multihead.explain_dispatch(Q, K, V, dropout_p=p),
                  ValueError, r"dropout_p must be in \[0, 1\)")
    for p in ("0.1", None, True):
        yield Bad(f"attention: dropout_p of type {type(p).__name__}",
                  lambda p=p: multihead.attention(Q, K, V, dropout_p=p), TypeError, r"dropout_p must be a number")
    for backend in ("nope", "", None, 3, "Reference"):
        yield Bad(f"attention: backend={backend!r}", lambda b=backend: multihead.attention(Q, K, V, backend=b),
                  ValueError, r"unknown backend .*known backends")


# --------------------------------------------------------------------------- masks
def _mask_cases():
    yield from [
        Bad("keep(list)", lambda: masks.keep([[True]]), TypeError, r"keep\(\).*torch\.as_tensor"),
        Bad("keep(numpy)", lambda: masks.keep(np.ones((2, 2), dtype=bool)), TypeError, r"keep\(\).*torch\.as_tensor"),
        Bad("keep(int tensor)", lambda: masks.keep(torch.ones(2, 2, dtype=torch.int64)), TypeError,
            r"keep\(\) takes a bool tensor.*t\.bool\(\)"),
        Bad("keep(uint8 tensor)", lambda: masks.keep(torch.ones(2, 2, dtype=torch.uint8)), TypeError,
            r"keep\(\) takes a bool tensor"),
        Bad("keep(float tensor)", lambda: masks.keep(torch.ones(2, 2)), TypeError, r"keep\(\).*masks\.bias\(\)"),
        Bad("bias(list)", lambda: masks.bias([[0.0]]), TypeError, r"bias\(\).*torch\.as_tensor"),
        Bad("bias(numpy)", lambda: masks.bias(np.zeros((2, 2))), TypeError, r"bias\(\).*torch\.as_tensor"),
        Bad("bias(bool tensor)", lambda: masks.bias(torch.ones(2, 2, dtype=torch.bool)), TypeError,
            r"bias\(\).*masks\.keep\(\)"),
        Bad("bias(int tensor)", lambda: masks.bias(torch.ones(2, 2, dtype=torch.int32)), TypeError, r"bias\(\)"),
        Bad("key_padding(list)", lambda: masks.key_padding([[True, False]]), TypeError,
            r"key_padding\(\).*torch\.as_tensor"),
        Bad("key_padding(numpy)", lambda: masks.key_padding(np.ones((2, 3), dtype=bool)), TypeError,
            r"key_padding\(\).*torch\.as_tensor"),
        Bad("key_padding(uint8)", lambda: masks.key_padding(torch.ones(2, 3, dtype=torch.uint8)), TypeError,
            r"key_padding\(\).*masks\.from_torch"),
        Bad("key_padding(float)", lambda: masks.key_padding(torch.ones(2, 3)), TypeError, r"key_padding\(\)"),
        Bad("key_padding(rank 1)", lambda: masks.key_padding(torch.ones(3, dtype=torch.bool)), ValueError,
            r"key_padding\(\) takes a \(B, Lk\) tensor"),
        Bad("key_padding(rank 3)", lambda: masks.key_padding(torch.ones(2, 1, 3, dtype=torch.bool)), ValueError,
            r"key_padding\(\) takes a \(B, Lk\) tensor"),
        Bad("causal(align='left')", lambda: masks.causal("left"), ValueError, r"align must be one of"),
        Bad("causal(align=None)", lambda: masks.causal(None), ValueError, r"align must be one of"),
        Bad("window(-1)", lambda: masks.window(-1), ValueError, r"window left must be >= 0"),
        Bad("window(2, -3)", lambda: masks.window(2, -3), ValueError, r"window right must be >= 0"),
        Bad("window(1.5)", lambda: masks.window(1.5), TypeError, r"window left must be an int or None"),
        Bad("window(True)", lambda: masks.window(True), TypeError, r"window left must be an int or None"),
        Bad("window(2, '1')", lambda: masks.window(2, "1"), TypeError, r"window right must be an int or None"),
        Bad("window(align='x')", lambda: masks.window(2, align="x"), ValueError, r"align must be one of"),
        Bad("mask & int", lambda: masks.causal() & 3, TypeError, r"the right operand of & must be None"),
        Bad("int & mask", lambda: 3 & masks.causal(), TypeError, r"the left operand of & must be None"),
        Bad("mask & list", lambda: masks.causal() & [[True]], TypeError, r"right operand of &.*torch\.as_tensor"),
        Bad("mask & numpy", lambda: masks.causal() & np.ones((2, 2), dtype=bool), TypeError,
            r"right operand of &.*torch\.as_tensor"),
        Bad("mask & int tensor", lambda: masks.causal() & torch.ones(2, 2, dtype=torch.int64), TypeError,
            r"right operand of & has dtype torch\.int64"),
        Bad("uint8 tensor & mask", lambda: torch.ones(2, 2, dtype=torch.uint8) & masks.causal(), TypeError,
            r"left operand of & has dtype torch\.uint8"),
        Bad("from_torch(attn_mask=list)", lambda: masks.from_torch(attn_mask=[[True]]), TypeError,
            r"attn_mask must be a torch\.Tensor.*torch\.as_tensor"),
        Bad("from_torch(attn_mask=numpy)", lambda: masks.from_torch(attn_mask=np.ones((2, 2), dtype=bool)), TypeError,
            r"attn_mask must be a torch\.Tensor.*torch\.as_tensor"),
        Bad("from_torch(attn_mask=int 2-D)", lambda: masks.from_torch(attn_mask=torch.ones(2, 2, dtype=torch.int64)),
            TypeError, r"attn_mask must be bool or float"),
        Bad("from_torch(attn_mask=uint8 3-D)", lambda: masks.from_torch(attn_mask=torch.ones(4, 2, 2, dtype=torch.uint8)),
            TypeError, r"attn_mask must be bool or float"),
        Bad("from_torch(key_padding_mask=list)", lambda: masks.from_torch(key_padding_mask=[[True]]), TypeError,
            r"key_padding_mask must be a torch\.Tensor.*torch\.as_tensor"),
        Bad("from_torch(key_padding_mask=int)",
            lambda: masks.from_torch(key_padding_mask=torch.ones(2, 3, dtype=torch.int64)), TypeError,
            r"key_padding_mask must be bool or float"),
        Bad("from_torch(key_padding_mask=rank 3)",
            lambda: masks.from_torch(key_padding_mask=torch.ones(2, 1, 3, dtype=torch.bool)), ValueError,
            r"key_padding_mask must be \(B, Lk\)"),
    ]


# --------------------------------------------------------------------------- module, per-head, interop
def _module_cases():
    construct = [
        ("d_in=0", dict(d_in=0), ValueError, r"d_in must be positive"),
        ("d_in=-4", dict(d_in=-4), ValueError, r"d_in must be positive"),
        ("d_in=16.0", dict(d_in=16.0), TypeError, r"d_in must be an int"),
        ("num_heads=0", dict(num_heads=0), ValueError, r"num_heads must be positive"),
        ("num_heads=True", dict(num_heads=True), TypeError, r"num_heads must be an int"),
        ("d_out not divisible by num_heads", dict(d_out=18), ValueError, r"d_out=18 is not divisible by num_heads=4"),
        ("num_heads not a multiple of num_kv_heads", dict(num_kv_heads=3), ValueError,
         r"num_heads=4, num_kv_heads=3: num_heads must be a multiple of num_kv_heads"),
        ("num_kv_heads=0", dict(num_kv_heads=0), ValueError, r"num_kv_heads must be positive"),
        ("kdim=0", dict(kdim=0), ValueError, r"kdim must be positive"),
        ("vdim='8'", dict(vdim="8"), TypeError, r"vdim must be an int"),
        ("dropout=1.0", dict(dropout=1.0), ValueError, r"dropout must be in \[0, 1\)"),
        ("dropout=-0.1", dict(dropout=-0.1), ValueError, r"dropout must be in \[0, 1\)"),
        ("dropout=nan", dict(dropout=math.nan), ValueError, r"dropout must be in \[0, 1\)"),
        ("bias='yes'", dict(bias="yes"), TypeError, r"bias must be True or False"),
        ("causal=1", dict(causal=1), TypeError, r"causal must be True or False"),
        ("backend='nope'", dict(backend="nope"), ValueError, r"unknown backend 'nope'"),
    ]
    for name, kwargs, error, match in construct:
        args = dict(d_in=16, num_heads=4) | kwargs
        yield Bad(f"MultiHeadAttention({name})", lambda a=args: multihead.MultiHeadAttention(**a), error, match)
        if "num_kv_heads" not in kwargs and "backend" not in kwargs:
            yield Bad(f"PerHeadAttention({name})", lambda a=args: multihead.PerHeadAttention(**a), error, match)

    cross = mha(kdim=12, vdim=10)
    forward = [
        ("query list", lambda m: m(X.tolist()), TypeError, r"query must be a torch\.Tensor.*torch\.as_tensor"),
        ("query numpy", lambda m: m(X.numpy()), TypeError, r"query must be a torch\.Tensor.*torch\.as_tensor"),
        ("query int", lambda m: m(X.long()), TypeError, r"query must have a floating dtype"),
        ("query bool", lambda m: m(X > 0), TypeError, r"query must have a floating dtype"),
        ("query without batch axis", lambda m: m(X[0]), ValueError, r"query has shape \(5, 16\).*unsqueeze\(0\)"),
        ("query rank 4", lambda m: m(X[None]), ValueError, r"query must be \(B, Lq, d_in\)"),
        ("query features", lambda m: m(X[..., :15]), ValueError, r"query has 15 features but d_in=16"),
        ("query float64", lambda m: m(X.double()), TypeError, r"query is torch\.float64 but the module's weights"),
        ("query on another device", lambda m: m(X.to(META)), ValueError, r"query is on meta but the module is on cpu"),
        ("key list", lambda m: m(X, Y.tolist()), TypeError, r"key must be a torch\.Tensor.*torch\.as_tensor"),
        ("key features", lambda m: m(X, Y[..., :3]), ValueError, r"key has 3 features but kdim=16"),
        ("key batch", lambda m: m(X, Y[:1]), ValueError, r"key has batch 1 but query has 2"),
        ("key int", lambda m: m(X, Y.int()), TypeError, r"key must have a floating dtype"),
        ("key float64", lambda m: m(X, Y.double()), TypeError, r"key is torch\.float64 on cpu but query"),
        ("key on another device", lambda m: m(X, Y.to(META)), TypeError, r"key is torch\.float32 on meta"),
        ("value rank 2", lambda m: m(X, Y, Y[0]), ValueError, r"value must be \(B, Lk, vdim\)"),
        ("value length", lambda m: m(X, Y, Y[:, :2]), ValueError, r"key has 6 tokens but value has 2"),
        ("value numpy", lambda m: m(X, Y, Y.numpy()), TypeError, r"value must be a torch\.Tensor.*torch\.as_tensor"),
        ("mask batch mismatch", lambda m: m(X, mask=torch.ones(3, 1, LQ, LQ, dtype=torch.bool)), ValueError,
         r"mask \(keep mask\) has shape \(3, 1, 5, 5\)"),
        ("key padding of the query length in cross-attention",
         lambda m: m(X, Y, mask=masks.key_padding(torch.ones(B, LQ, dtype=torch.bool))), ValueError,
         r"mask \(key padding\) has shape \(2, 5\) but must be \(B, Lk\) = \(2, 6\)"),
        ("int mask", lambda m: m(X, mask=torch.ones(LQ, LQ, dtype=torch.int64)), TypeError, r"mask has dtype torch\.int64"),
        ("uint8 mask", lambda m: m(X, mask=torch.ones(LQ, LQ, dtype=torch.uint8)), TypeError, r"mask has dtype torch\.uint8"),
        ("mask on another device", lambda m: m(X, mask=torch.ones(LQ, LQ, dtype=torch.bool, device=META)), ValueError,
         r"mask \(keep mask\) is on meta"),
    ]
    for name, call, error, match in forward:
        yield Bad(f"MultiHeadAttention forward: {name}", lambda c=call: c(mha()), error, match)
        yield Bad(f"PerHeadAttention forward: {name}", lambda c=call: c(mha().to_per_head()), error, match)
    yield Bad("MultiHeadAttention forward: key=None with kdim != d_in", lambda: cross(X), ValueError, r"key is required")
    yield Bad("MultiHeadAttention forward: value=None with vdim != kdim",
              lambda: cross(X, torch.randn(B, LK, 12)), ValueError, r"value is required")
    yield Bad("PerHeadAttention forward: key features (kdim=12)",
              lambda: cross.to_per_head()(X, torch.randn(B, LK, 5), torch.randn(B, LK, 10)), ValueError,
              r"key has 5 features but kdim=12")

    yield from [
        Bad("to_per_head(a string, weights)", lambda: to_per_head("mha", {}), TypeError,
            r"to_per_head takes a multihead\.AttentionConfig and its weights"),
        Bad("to_per_head(a module, weights)", lambda: to_per_head(mha(), mha().state_dict()), TypeError,
            r"to_per_head takes a multihead\.AttentionConfig .*got MultiHeadAttention; for a module call mha\.to_per_head\(\)"),
        Bad("from_per_head(a MultiHeadAttention)", lambda: from_per_head(mha()), TypeError,
            r"from_per_head takes a PerHeadAttention"),
        Bad("from_per_head(num_kv_heads=3)", lambda: from_per_head(mha().to_per_head(), num_kv_heads=3), ValueError,
            r"num_heads=4, num_kv_heads=3"),
        Bad("from_per_head(num_kv_heads=0)", lambda: from_per_head(mha().to_per_head(), num_kv_heads=0), ValueError,
            r"num_kv_heads must be positive"),
        Bad("from_per_head(num_kv_heads='2')", lambda: from_per_head(mha().to_per_head(), num_kv_heads="2"), TypeError,
            r"num_kv_heads must be an int"),
        Bad("from_per_head(num_kv_heads=2) of heads with their own K/V",
            lambda: multihead.MultiHeadAttention.from_per_head(mha().to_per_head(), num_kv_heads=2), ValueError,
            r"num_kv_heads=2: heads 0\.\.1 should share one K projection"),
        Bad("from_torch(a MultiHeadAttention)", lambda: multihead.MultiHeadAttention.from_torch(mha()), TypeError,
            r"from_torch takes an nn\.MultiheadAttention"),
        Bad("from_torch(add_bias_kv=True)",
            lambda: multihead.MultiHeadAttention.from_torch(torch.nn.MultiheadAttention(16, 4, add_bias_kv=True)),
            ValueError, r"add_bias_kv=True"),
        Bad("from_torch(add_zero_attn=True)",
            lambda: multihead.MultiHeadAttention.from_torch(torch.nn.MultiheadAttention(16, 4, add_zero_attn=True)),
            ValueError, r"add_zero_attn=True"),
        Bad("to_torch(a string, weights)", lambda: to_torch("mha", {}), TypeError,
            r"to_torch takes a multihead\.AttentionConfig and its weights"),
        Bad("to_torch of a GQA module", lambda: mha(num_kv_heads=2).to_torch(), ValueError, r"num_kv_heads=2"),
        Bad("to_torch of a causal module", lambda: mha(causal=True).to_torch(), ValueError, r"causal=True"),
        Bad("to_torch with d_out != d_in", lambda: mha(d_out=8).to_torch(), ValueError, r"d_out=8 differs from d_in=16"),
    ]


# --------------------------------------------------------------------------- trace
def _trace_cases():
    def step_of_unknown_name():
        with multihead.trace() as t:
            mha()(X)
        t.step("no such step")

    yield Bad("trace(keep_values='yes')", lambda: multihead.trace(keep_values="yes"), TypeError,
              r"keep_values must be True or False")
    yield Bad("trace(True) (positional)", lambda: multihead.trace(True), TypeError, r"root must be the nn.Module.*keep_values is keyword-only")
    yield Bad("trace(root=not a module)", lambda: multihead.trace("model"), TypeError, r"root must be the nn.Module being traced \(or None\), got str$")
    yield Bad("Trace.step(unknown name)", step_of_unknown_name, KeyError, r"no step named 'no such step'; steps are")


BAD = [*_functional_cases(), *_mask_cases(), *_module_cases(), *_trace_cases()]


@pytest.mark.parametrize("case", BAD, ids=[c.id for c in BAD])
def test_mistake_is_reported_by_name(case):
    with pytest.raises(case.error, match=case.match) as info:
        case.call()
    assert type(info.value) in (ValueError, TypeError, KeyError), type(info.value)


# --------------------------------------------------------------------------- CLI
CLI_MISTAKES = [
    [],
    ["bogus"],
    ["explain", "--unknown-flag"],
    ["explain", "--batch", "0"],
    ["explain", "--batch", "two"],
    ["explain", "--tokens", "-3"],
    ["explain", "--heads", "0"],
    ["explain", "--d-in", "1.5"],
    ["explain", "--kv-heads", "x"],
    ["explain", "--seed", "-1"],
    ["explain", "--dropout", "1.0"],
    ["explain", "--dropout", "-0.5"],
    ["explain", "--dropout", "lots"],
    ["explain", "--lang", "fr"],
    ["explain", "--format", "pdf"],
    ["explain", "--model", "gpt2"],
    ["explain", "--layer", "-1"],
    ["explain", "--batch"],
    # sizes the walkthrough cannot show (issue 11, defect 10): refused with the cap, before any work
    ["explain", "--tokens", "100000"],
    ["explain", "--keys", "100000"],
    ["explain", "--tokens", "65", "--format", "html", "--out", "{tmp}/w.html"],
    ["explain", "--keys", "65", "--format", "png", "--out", "{tmp}/h.png"],
    ["explain", "--batch", "17"],
    ["explain", "--heads", "17", "--d-out", "17"],
    ["explain", "--d-in", "1000000000"],
    ["explain", "--d-out", "2048"],
    ["explain", "--batch", "16", "--heads", "8", "--d-out", "16", "--tokens", "200"],
    ["explain", "--batch", "16", "--heads", "16", "--d-out", "16", "--tokens", "64", "--format", "html",
     "--out", "{tmp}/w.html"],
    ["explain", "--seed", str(2 ** 64)],
    # an --out that cannot be written: the OS's reason, one line (the --model ones before loading it)
    ["explain", "--out", "{tmp}/missing/w.txt"],
    ["explain", "--out", "{tmp}/missing/w.html", "--format", "html", "--model", "minilm"],
    ["explain", "--out", str(Path(__file__)) + "/w.html", "--format", "html"],  # under a regular file
    ["explain", "--out", "-", "--format", "png"],  # binary PNG to a text stream
    *([["explain", "--out", "/sys/w.html", "--format", "html"],  # no file can be created in sysfs
       ["explain", "--out", "/sys/h.png", "--format", "png"],
       ["explain", "--out", "/sys/h.png", "--format", "png", "--model", "minilm"]] if Path("/sys/kernel").is_dir() else []),
    *([["explain", "--out", "/dev/full", "--format", "html"],  # the disk fills while writing
       ["explain", "--out", "/dev/full", "--format", "png"]] if Path("/dev/full").exists() else []),
    # options that do not apply are refused, not ignored
    ["explain", "--text", "hello"],
    ["explain", "--layer", "1"],
    ["explain", "--head", "0"],
    ["explain", "--tokens", "5", "--model", "minilm"],
    ["explain", "--no-causal", "--model", "minilm"],
    ["explain", "--no-values", "--model", "minilm"],
    ["explain", "--seed", "1", "--model", "minilm"],
    ["explain", "--per-head", "--format", "html", "--out", "{tmp}/w.html"],
    ["explain", "--cost", "--format", "png", "--out", "{tmp}/h.png"],
    ["explain", "--no-values", "--format", "html", "--out", "{tmp}/w.html"],
    ["explain", "--lang", "zh", "--format", "png", "--out", "{tmp}/h.png"],
]


@pytest.mark.parametrize("argv", CLI_MISTAKES, ids=[" ".join(a) or "(no arguments)" for a in CLI_MISTAKES])
def test_cli_mistake_is_one_line_and_exit_2(argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a stray file would land here, and is checked for below
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    out, err = io.StringIO(), io.StringIO()
    assert cli_main(argv, stdout=out, stderr=err) == 2
    lines = err.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("multihead: error: "), lines
    assert out.getvalue() == ""
    if argv[1:]:  # the message names the option (or the value) that was wrong
        assert argv[1] in lines[0] or argv[-1] in lines[0], lines[0]
    assert list(tmp_path.iterdir()) == []


CLI_CONFIG_MISTAKES = [
    ["explain", "--heads", "3"],  # d_out 8 is not divisible by 3 heads
    ["explain", "--heads", "4", "--kv-heads", "3"],  # 4 heads are not a multiple of 3 kv heads
    ["explain", "--d-out", "6", "--heads", "4"],
]


@pytest.mark.parametrize("argv", CLI_CONFIG_MISTAKES, ids=[" ".join(a) for a in CLI_CONFIG_MISTAKES])
def test_cli_configuration_mistake_is_one_line_and_exit_2(argv):
    """Options that parse but describe no valid module (caught when the example is built)."""
    out, err = io.StringIO(), io.StringIO()
    assert cli_main(argv, stdout=out, stderr=err) == 2
    lines = err.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("multihead: error: "), lines
    assert "heads" in lines[0]


# --------------------------------------------------------------------------- edge cases with a defined result
EMPTY = [(0, LK), (LQ, 0), (0, 0)]


def _empty_masks(Lq, Lk):
    return [None, masks.causal(), masks.causal("top_left") & masks.window(2, None),
            masks.key_padding(torch.ones(B, Lk, dtype=torch.bool)), torch.zeros(Lq, Lk, dtype=torch.bool),
            torch.zeros(B, H, Lq, Lk)]


@pytest.mark.parametrize("backend", backends.names())
@pytest.mark.parametrize("Lq,Lk", EMPTY)
def test_empty_sequences_give_empty_or_zero_output_and_zero_grads(backend, Lq, Lk):
    for mask in _empty_masks(Lq, Lk):
        for dropout_p in (0.0, 0.5):
            q, k, v = (t.requires_grad_(True) for t in qkv(Lq=Lq, Lk=Lk))
            out = attention_or_refusal(backend, q, k, v, mask, dropout_p=dropout_p)
            if out is None:
                continue
            assert out.shape == (B, H, Lq, DV)
            assert (out == 0).all()
            out.sum().backward()
            for t in (q, k, v):
                assert t.grad is not None and t.grad.shape == t.shape and (t.grad == 0).all()
    w = multihead.attention_weights(*qkv(Lq=Lq, Lk=Lk)[:2], masks.causal())
    assert w.shape == (B, H, Lq, Lk)


@pytest.mark.parametrize("backend", ["auto", "reference", "chunked"])
@pytest.mark.parametrize("Lq,Lk", EMPTY)
def test_empty_sequences_give_the_lse_of_no_keys(backend, Lq, Lk):
    """Issue 21, defect 4: return_lse with Lk = 0 raised IndexError (amax) on reference and auto.
    No key: lse -inf, or the sink's logit with a sink; output 0, gradients 0."""
    sink = torch.tensor([0.5, -1.0, 2.0, 0.0])
    for mask, want in ((None, torch.full((H,), -math.inf)), (masks.sink(sink), sink)):
        q, k, v = (t.requires_grad_(True) for t in qkv(Lq=Lq, Lk=Lk))
        out, lse = multihead.attention(q, k, v, mask, backend=backend, return_lse=True)
        assert out.shape == (B, H, Lq, DV) and (out == 0).all()
        assert lse.shape == (B, H, Lq) and torch.equal(lse, want.view(1, H, 1).expand(B, H, Lq))
        out.sum().backward()
        assert all((t.grad == 0).all() for t in (q, k, v))


@pytest.mark.parametrize("mask", [None, masks.causal()], ids=["no mask", "causal"])
def test_attention_weights_of_no_heads_or_no_rows_is_empty(mask):
    """heads=[] / rows=[] select nothing, as q[:, []] does: the empty slice of the full weights
    (heads=[] raised "got Hq=0, Hkv=0", a message naming no argument; issue 11, defect 11)."""
    full = multihead.attention_weights(Q, K, mask)
    none = torch.tensor([], dtype=torch.int64)
    for heads, rows, want in (([], None, full[:, []]), (none, [1, 3], full[:, []][:, :, [1, 3]]),
                              (None, [], full[:, :, []]), ([0, 3], none, full[:, [0, 3]][:, :, []]),
                              ([], [], full[:, []][:, :, []])):
        got = multihead.attention_weights(Q, K, mask, heads=heads, rows=rows)
        assert got.shape == want.shape and got.dtype == Q.dtype and torch.equal(got, want)


@pytest.mark.parametrize("Lq,Lk", EMPTY)
@pytest.mark.parametrize("training", [False, True])
def test_empty_sequences_in_the_modules(Lq, Lk, training):
    for backend in backends.names():
        m = mha(causal=True, dropout=0.5, backend=backend).train(training)
        x = torch.randn(B, Lq, 16, requires_grad=True)
        y = torch.randn(B, Lk, 16, requires_grad=True)
        for module in (m, m.to_per_head()):
            out = module_or_refusal(backend, module, x, y)
            if out is None:
                continue
            assert out.shape == (B, Lq, 16)
            # no key: attention gives 0, so the output is out_proj's bias
            assert torch.equal(out, m.out_proj.bias.expand_as(out))
            out.sum().backward()
            assert (x.grad == 0).all() and (y.grad == 0).all()
            x.grad = y.grad = None
    out, weights = m(x, y, return_weights=True)
    assert weights.shape == (B, H, Lq, Lk)


@pytest.mark.parametrize("backend", backends.names())
@pytest.mark.parametrize("poison", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_nan_and_inf_propagate_without_raising(backend, poison, where):
    """A NaN/inf never raises and never crosses into another batch element or another key/value
    head group. In q it stays in its own query row. Within its (batch, head) group a NaN in k or v
    reaches every query that sees that key: the IEEE result (for v even the rows that do not see
    it, as 0 * NaN = NaN in weights @ V; see test_masked_nan_key_stays_out_of_blind_rows)."""
    q, k, v = qkv(Lk=LQ)
    target = {"q": q, "k": k, "v": v}[where]
    target[1, 0, 3, 0] = poison  # batch 1, head 0 (for k/v: kv head 0, read by query heads 0 and 1), position 3
    out = multihead.attention(q, k, v, masks.causal(), backend=backend)
    reached = ~torch.isfinite(out).all(-1)  # (B, H, Lq)
    group = torch.zeros(B, H, LQ, dtype=torch.bool)
    if where == "q":
        group[1, 0, 3] = True
    else:
        group[1, :H // HKV] = True
    assert not reached[~group].any()
    if poison != poison:  # NaN: every query that sees key 3 (causal: queries 3 and 4) is NaN
        sees = group.clone()
        if where != "q":
            sees[1, :, :3] = False
        assert reached[sees].all()


@pytest.mark.parametrize("poison", [math.nan, math.inf])
def test_masked_nan_key_stays_out_of_blind_rows(poison):
    """The reference masks scores by selection (masked_fill with -inf), so a NaN/inf in a masked
    key's k reaches no query that cannot see it. (torch SDPA adds -inf to the scores instead,
    and NaN + -inf = NaN: there a NaN key poisons every query of its head; docs/guarantees.md.)"""
    q, k, v = qkv(Lk=LQ)
    k[1, 0, 3, 0] = poison
    padding = torch.ones(B, LQ, dtype=torch.bool)
    padding[1, 3] = False  # key 3 of batch 1 is padding: no query sees it
    for mask in (masks.causal(), masks.key_padding(padding)):
        out = multihead.attention(q, k, v, mask, backend="reference")
        sees = torch.zeros(B, H, LQ, dtype=torch.bool)
        if mask.parts[0].kind == "causal":
            sees[1, :H // HKV, 3:] = True
        assert torch.isfinite(out[~sees]).all()


@pytest.mark.parametrize("backend", backends.names())
def test_bias_of_another_float_dtype_is_cast(backend):
    """A float64 or float16 bias with float32 q equals the bias cast to float32 (not an error)."""
    bias32 = torch.randn(B, 1, LQ, LK)
    want = multihead.attention(Q, K, V, bias32, backend=backend)
    for dtype in (torch.float64, torch.float16, torch.bfloat16):
        bias = bias32.to(dtype)
        got = multihead.attention(Q, K, V, bias, backend=backend)
        assert torch.equal(got, multihead.attention(Q, K, V, bias.float(), backend=backend))
        assert got.dtype == torch.float32
    assert torch.isfinite(want).all()


@pytest.mark.parametrize("backend", backends.names())
@pytest.mark.parametrize("shape", [(), (LK,), (1, LK), (LQ, 1), (1, 1, 1, 1)])
def test_masks_of_few_dimensions_broadcast(backend, shape):
    """A keep or bias tensor of fewer than 2 dimensions (a scalar, a (Lk,) row) broadcasts like any
    other (it reached torch SDPA as is and failed with an IndexError)."""
    g = torch.Generator().manual_seed(3)
    keep = torch.rand(shape, generator=g) < 0.7
    bias = torch.randn(shape, generator=g)
    for mask in (keep, bias, masks.keep(keep) & masks.bias(bias)):
        got = multihead.attention(Q, K, V, mask, backend=backend)
        dense = mask if isinstance(mask, masks.Mask) else mask.expand(B, H, LQ, LK).clone()
        want = multihead.attention(Q, K, V, dense, backend="reference")
        # two float32 paths, each a few ulps of max|v| from the exact result (tests/oracle.py)
        atol = 2 * FLOOR_ULPS * torch.finfo(torch.float32).eps * V.abs().max().item()
        torch.testing.assert_close(got, want, rtol=0, atol=atol)



# --------------------------------------------------------------------------- boundary values
# Issue 21, defect 3: window(0, sys.maxsize) wrapped int64 (2.3 off on every backend), window(10**20),
# chunked_local(10**20) and window(1, sinks=10**20) failed deep inside torch with OverflowError,
# softcap(1e39) became inf in float32 and every output NaN. Every public constructor taking a
# number gets the boundary values; each either refuses by name (ValueError/TypeError naming what
# was wrong) or gives a mask whose outputs are finite and agree between the backends.
BOUNDARY = [0, 1, -1, sys.maxsize, 2**63, 10**20, 1e38, 1e39, math.inf, -math.inf, math.nan, "9" * 100_000]


def _tensor_or(v, heads=2):
    """A float64 (heads,) tensor of ``v`` where v is a number, else ``v`` itself (a wrong type)."""
    return torch.full((heads,), float(v), dtype=torch.float64) if isinstance(v, (int, float)) else v


CONSTRUCTORS = {  # what the refusal must name
    "window left": (lambda v: masks.window(v), "window"),
    "window right": (lambda v: masks.window(0, v), "window"),
    "window sinks": (lambda v: masks.window(1, sinks=v), "sinks"),
    "chunked_local chunk": (lambda v: masks.chunked_local(v), "chunk"),
    "softcap cap": (lambda v: masks.softcap(v), "cap"),
    "sink logits": (lambda v: masks.sink(_tensor_or(v)), "sink"),
    "alibi slopes": (lambda v: masks.alibi(_tensor_or(v)), "alibi"),
    "alibi slopes list": (lambda v: masks.alibi([v, v]), "alibi"),
    "alibi_slopes heads": (lambda v: masks.alibi(masks.alibi_slopes(v)), "heads"),
    "from_seqlens lengths": (lambda v: masks.from_seqlens([v, 2]), "lengths"),
    "from_cu_seqlens": (lambda v: masks.from_cu_seqlens([0, v]), "cu_seqlens"),
}


@pytest.mark.parametrize("value", BOUNDARY, ids=[repr(v)[:12] for v in BOUNDARY])
@pytest.mark.parametrize("what", list(CONSTRUCTORS))
def test_boundary_values_refuse_by_name_or_give_finite_agreeing_outputs(what, value):
    make, names = CONSTRUCTORS[what]
    try:
        m = make(value)
    except (ValueError, TypeError) as e:
        assert names in str(e), str(e)
        return
    for dtype in (torch.float32, torch.float64):
        q, k, v = qkv(dtype, B=1, H=2, Hkv=2, Lq=5, Lk=7)
        if what.startswith("from_"):  # the lengths must be the call's
            n = sum(len(p.q_ids[0]) for p in m.parts)
            if n > 64:
                return
            q, k, v = qkv(dtype, B=1, H=2, Hkv=2, Lq=n, Lk=n)
        try:
            ref = multihead.attention(q, k, v, m, backend="reference")
        except (ValueError, TypeError) as e:  # refused at the call: named there
            assert names in str(e) or "mask" in str(e), str(e)
            continue
        got = multihead.attention(q, k, v, m, backend="chunked")
        assert not ref.isnan().any() and not got.isnan().any()
        if ref.numel():
            assert (got.double() - ref.double()).abs().max() <= (1e-12 if dtype == torch.float64 else 1e-5)


@pytest.mark.parametrize("big", [sys.maxsize, 2**62, 10**20])
def test_window_sides_past_any_length_are_unlimited(big):
    """``sys.maxsize`` is a common way to say unlimited: it means None, on every backend."""
    q, k, v = qkv(torch.float64, B=1, H=2, Hkv=2, Lq=6, Lk=9)
    for left, right in ((0, big), (big, 0), (big, big)):
        want = masks.window(None if left == big else left, None if right == big else right)
        got = masks.window(left, right)
        assert (got.left, got.right) == (want.left, want.right)
        for backend in ("reference", "chunked", "sdpa"):
            assert torch.equal(multihead.attention(q, k, v, got, backend=backend),
                               multihead.attention(q, k, v, want, backend=backend)), backend


def test_softcap_and_sink_that_overflow_the_scores_dtype_are_refused():
    q, k, v = qkv(torch.float32, B=1, H=2, Hkv=2, Lq=3, Lk=3)
    for m, name in ((masks.softcap(1e39), "softcap"), (masks.softcap(1e-46), "softcap"),
                    (masks.sink(torch.tensor([1e39, 0.0], dtype=torch.float64)), "sink"),
                    (masks.alibi(torch.tensor([1e39, 1.0], dtype=torch.float64)), "alibi")):
        with pytest.raises(ValueError, match=name):
            multihead.attention(q, k, v, m)
        out = multihead.attention(q.double(), k.double(), v.double(), m)  # float64 holds them
        assert not out.isnan().any()


CLI_BOUNDARY = [
    ["explain", "--mask", "window:99999999999999999999"],
    ["explain", "--mask", "window:1:99999999999999999999"],
    ["explain", "--mask", "chunked_local:99999999999999999999"],
    ["explain", "--mask", f"window:{sys.maxsize}"],
]


@pytest.mark.parametrize("argv", CLI_BOUNDARY, ids=[" ".join(a) for a in CLI_BOUNDARY])
def test_cli_counts_past_any_length_mean_unlimited(argv):
    """Issue 21, defect 6: these raised OverflowError tracebacks; a count past any length is
    unlimited, so the walkthrough runs and its own checks hold."""
    out, err = io.StringIO(), io.StringIO()
    assert cli_main(argv + ["--no-values"], stdout=out, stderr=err) == 0, err.getvalue()


CLI_BOUNDARY_MISTAKES = [
    ["explain", "--mask", "sink:1e308"],
    ["explain", "--mask", "softcap:1e39"],
    ["explain", "--mask", "softcap:1e-50"],
    ["explain", "--mask", "sink:nan"],
    ["explain", "--tokens", str(sys.maxsize)],
    ["explain", "--tokens", "99999999999999999999"],
    ["explain", "--heads", str(2**63)],
    ["explain", "--seed", "-1"],
    ["explain", "--dropout", "nan"],
    ["explain", "--dropout", "1e39"],
    ["explain", "--layer", "99999999999999999999", "--model", "minilm"],
    ["explain", "--text", "a " * 50_000, "--model", "minilm"],
]


@pytest.mark.parametrize("argv", CLI_BOUNDARY_MISTAKES, ids=[" ".join(a)[:60] for a in CLI_BOUNDARY_MISTAKES])
def test_cli_boundary_values_are_one_line_and_exit_2(argv):
    out, err = io.StringIO(), io.StringIO()
    assert cli_main(argv, stdout=out, stderr=err) == 2
    lines = err.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("multihead: error: "), lines
    assert any(a[:40] in lines[0] for a in argv[1:]), lines[0]


def test_cli_model_directory_with_a_broken_config_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    out, err = io.StringIO(), io.StringIO()
    assert cli_main(["explain", "--model", str(tmp_path)], stdout=out, stderr=err) == 2
    lines = err.getvalue().splitlines()
    assert len(lines) == 1 and "config.json" in lines[0], lines


@pytest.mark.parametrize("backend", backends.names())
def test_a_batch_of_one_beside_a_batch_of_b_is_refused_with_the_fix(backend):
    """Issue 21, defect 9: SDPA and flex broadcast k, v of batch 1 against q of batch B; 4-D
    inputs here must share B, and the refusal names the view that makes it so, which then runs."""
    q, k, v = qkv(torch.float64, B=3)
    k1, v1 = k[:1], v[:1]
    with pytest.raises(ValueError, match=r"k\.expand\(3, -1, -1, -1\)"):
        multihead.attention(q, k1, v1, backend=backend)
    got = attention_or_refusal(backend, q, k1.expand(3, -1, -1, -1), v1.expand(3, -1, -1, -1))
    if got is not None:
        want = multihead.attention(q, k1.repeat(3, 1, 1, 1), v1.repeat(3, 1, 1, 1), backend="reference")
        assert (got - want).abs().max() <= 1e-12
