"""Determinism: the same seed gives bit-identical results, dropout included, on every backend
and the module; ``torch.use_deterministic_algorithms(True)`` breaks no backend.

Legend: B batch, H query heads, Hkv key/value heads, Lq/Lk lengths, D head dim.
"""

from __future__ import annotations

import pytest
import torch

import multihead
from multihead import backends, masks
from oracle import attention_or_refusal, module_or_refusal, one_thread
from oracle import deterministic_algorithms as oracle_deterministic_algorithms

pytestmark = pytest.mark.usefixtures(one_thread.__name__)


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 9, 16, generator=g)
    k = torch.randn(2, 2, 11, 16, generator=g)
    v = torch.randn(2, 2, 11, 8, generator=g)
    bias = torch.randn(2, 1, 9, 11, generator=g)
    return q, k, v, bias


MASKS = {
    "none": lambda bias: None,
    "causal": lambda bias: masks.causal(),
    "window & padding": lambda bias: masks.window(3, 1) & masks.key_padding(torch.arange(11).expand(2, 11) < 10),
    "bias & causal": lambda bias: masks.bias(bias) & masks.causal("top_left"),
}


def functional_run(backend, mask_name, dropout_p, seed):
    """Output and gradients of one call after seeding torch's generator with ``seed``; None when
    the backend declines the call (and says so)."""
    q, k, v, bias = (t.requires_grad_(True) for t in inputs())
    torch.manual_seed(seed)
    out = attention_or_refusal(backend, q, k, v, MASKS[mask_name](bias), dropout_p=dropout_p)
    if out is None:
        return None
    out.backward(torch.ones_like(out))
    return [out.detach(), q.grad, k.grad, v.grad, bias.grad]


def module_run(backend, seed, training, return_weights=False):
    torch.manual_seed(0)
    mha = multihead.MultiHeadAttention(16, 4, num_kv_heads=2, dropout=0.3, causal=True, backend=backend)
    mha.train(training)
    x = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    torch.manual_seed(seed)
    out = module_or_refusal(backend, mha, x, return_weights=return_weights)
    if out is None:
        return None
    if return_weights:
        out, weights = out
    out.square().sum().backward()
    grads = [x.grad] + [p.grad for p in mha.parameters()]
    return [out.detach(), *grads] + ([weights.detach()] if return_weights else [])


def assert_bit_identical(a, b):
    if a is None or b is None:  # a declined call is declined every time
        assert a is None and b is None
        return
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            assert torch.equal(x, y), (x - y).abs().max()


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("backend", backends.names())
def test_same_seed_gives_bit_identical_results(backend, mask_name, dropout_p):
    first = functional_run(backend, mask_name, dropout_p, seed=7)
    assert_bit_identical(first, functional_run(backend, mask_name, dropout_p, seed=7))
    if dropout_p and first is not None:  # and the seed matters: another seed drops other weights
        assert not torch.equal(first[0], functional_run(backend, mask_name, dropout_p, seed=8)[0])


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("backend", backends.names())
def test_module_same_seed_gives_bit_identical_results(backend, training):
    first = module_run(backend, seed=3, training=training)
    assert_bit_identical(first, module_run(backend, seed=3, training=training))
    if training and first is not None:
        assert not torch.equal(first[0], module_run(backend, seed=4, training=training)[0])


def test_module_return_weights_same_seed():
    first = module_run("auto", seed=5, training=True, return_weights=True)
    assert_bit_identical(first, module_run("auto", seed=5, training=True, return_weights=True))


@pytest.fixture(name="deterministic_algorithms")
def _deterministic_algorithms_fixture():
    """torch.use_deterministic_algorithms(True) for one test, restored afterwards."""
    before = torch.are_deterministic_algorithms_enabled()
    with oracle_deterministic_algorithms():
        yield
    assert torch.are_deterministic_algorithms_enabled() == before


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("backend", backends.names())
def test_deterministic_algorithms_mode_runs_every_backend(backend, mask_name, dropout_p, deterministic_algorithms):
    """Forward and backward run in deterministic mode, repeat bit for bit, and give what they
    give outside it (the same seed draws the same dropout mask)."""
    inside = functional_run(backend, mask_name, dropout_p, seed=11)
    assert_bit_identical(inside, functional_run(backend, mask_name, dropout_p, seed=11))
    torch.use_deterministic_algorithms(False)
    assert_bit_identical(inside, functional_run(backend, mask_name, dropout_p, seed=11))


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("backend", backends.names())
def test_deterministic_algorithms_mode_runs_the_module(backend, training, deterministic_algorithms):
    first = module_run(backend, seed=3, training=training)
    assert_bit_identical(first, module_run(backend, seed=3, training=training))
    assert first is None or all(torch.isfinite(t).all() for t in first)


def test_return_weights_does_not_change_the_output():
    """return_weights=True runs the reference code: with the reference backend and the same seed
    the output (dropout included) is bit for bit the one without it."""
    plain = module_run("reference", seed=5, training=True)
    with_weights = module_run("reference", seed=5, training=True, return_weights=True)
    assert_bit_identical(plain, with_weights[:-1])
