"""Numerics in float16/bfloat16, masking by selection, and rows with no visible key.

Every test runs on every backend of ``multihead.backends.names()`` and on the module.

Legend: B batch, H query heads, Lq/Lk lengths, D head dim, Dv value dim.
"""

from __future__ import annotations

import math

import pytest
import torch

import multihead
from multihead import backends, masks
from oracle import (FLOOR_ULPS, LOW_PRECISION, attention_or_refusal, eps, judge, module_or_refusal, naive_attention,
                    one_thread, row_sum_bound, score_size)

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

D = 64
SIGNS = torch.tensor([1.0, -1.0, 1.0, -1.0, -1.0, 1.0])  # the sign of each token's features


def huge_logit_tokens(dtype):
    """(1, 1, 6, 64) tokens of ±40 in every feature: q·k = ±102400 (beyond float16's 65504),
    scaled by 1/√64 to ±12800, so each query splits its weight evenly over the tokens of its sign."""
    return (40 * SIGNS[:, None] * torch.ones(6, D)).to(dtype)[None, None]


def same_sign_mean(v, keep=None):
    """What the huge logits give: the mean of v over the (visible) tokens of the query's sign."""
    same = SIGNS[:, None] == SIGNS[None, :]
    if keep is not None:
        same = same & keep
    w = same.double() / same.sum(-1, keepdim=True).clamp(min=1)
    return w @ v.double()


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("backend", backends.names())
def test_logits_beyond_half_range_stay_finite_and_correct(backend, dtype):
    """Scores are formed and softmaxed in float32: q·kᵀ = ±102400 overflows float16 (the naive
    float16 product is ±inf and its softmax NaN) but every backend gives the exact answer."""
    x = huge_logit_tokens(dtype)
    v = torch.randn(1, 1, 6, 8, generator=torch.Generator().manual_seed(0)).to(dtype)
    for mask in (None, masks.causal()):
        keep = None if mask is None else torch.ones(6, 6, dtype=torch.bool).tril()
        out = multihead.attention(x, x, v, mask, backend=backend)
        want = same_sign_mean(v, keep)
        assert torch.isfinite(out).all()
        # the weights are exactly 1/n: only the final rounding to dtype differs
        assert (out.double() - want).abs().max() <= FLOOR_ULPS * eps(dtype) * v.abs().max().item()
    if dtype == torch.float16:  # what computing the scores in float16 would give
        assert not torch.isfinite(x[0, 0] @ x[0, 0].T).all()
    w = multihead.attention_weights(x, x)
    assert torch.isfinite(w).all() and ((w.double().sum(-1) - 1).abs() <= row_sum_bound(dtype, 6)).all()


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("backend", backends.names())
def test_module_with_logits_beyond_half_range(backend, dtype):
    """The module with identity projections on the tokens above: out = x exactly."""
    mha = multihead.MultiHeadAttention(D, 1, bias=False, backend=backend)
    with torch.no_grad():
        for lin in (mha.q_proj, mha.k_proj, mha.v_proj, mha.out_proj):
            lin.weight.copy_(torch.eye(D))
    mha = mha.to(dtype)
    x = huge_logit_tokens(dtype)[0]
    for m in (mha, mha.to_per_head()):
        out = module_or_refusal(backend, m, x)
        if out is None:  # a backend that cannot run with trainable parameters here says so
            continue
        assert torch.isfinite(out).all()
        assert (out.double() - x.double()).abs().max() <= FLOOR_ULPS * eps(dtype) * 40


@pytest.mark.parametrize("dtype", [*LOW_PRECISION, torch.float32])
@pytest.mark.parametrize("backend", backends.names())
def test_mask_is_selection_not_a_huge_negative(backend, dtype):
    """A bias of -1e4 on every score together with a keep mask: masking by adding a large
    negative (finfo.min) would overflow to -inf and make the row NaN, and a constant bias must
    not change the softmax. Selection gives the unbiased result on visible rows, 0 on blind rows."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 5, 8, generator=g).to(dtype) for _ in range(3))
    keep = torch.rand(2, 1, 5, 5, generator=g) < 0.6
    keep[0, 0, 2] = False  # a row with no visible key
    keep[:, :, 3] = True
    bias = torch.full((5, 5), -1e4, dtype=dtype)
    biased = multihead.attention(q, k, v, masks.bias(bias) & masks.keep(keep), backend=backend)
    plain = multihead.attention(q, k, v, keep, backend=backend)
    assert torch.isfinite(biased).all()
    assert (biased[0, :, 2] == 0).all()
    want = naive_attention(q.double(), k.double(), v.double(), keep.expand(2, 2, 5, 5), None, 8 ** -0.5,
                           torch.float64)
    for out in (biased, plain):
        # scores are formed in float32 at least: the -1e4 shift costs float32 ulps of 1e4 in each score
        shift_error = 2 * eps(torch.float32) * 1e4 * v.abs().max().item()
        assert (out.double() - want).abs().max() <= 2 * eps(dtype) * v.abs().max().item() + shift_error


def blind_row_setup(dtype=torch.float32):
    """q, k, v (2, 2, 4, 8) and a keep mask whose row (batch 0, query 1) sees no key; bias -inf on
    (batch 1, query 2) makes that row blind too."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 2, 4, 8, generator=g).to(dtype).requires_grad_(True) for _ in range(3))
    keep = torch.ones(2, 1, 4, 4, dtype=torch.bool)
    keep[0, 0, 1] = False
    bias = torch.zeros(2, 1, 4, 4, dtype=dtype)
    bias[1, 0, 2] = -math.inf
    bias.requires_grad_(True)
    blind = torch.zeros(2, 2, 4, dtype=torch.bool)
    blind[0, :, 1] = True
    blind[1, :, 2] = True
    return (q, k, v), masks.keep(keep) & masks.bias(bias), bias, blind


@pytest.mark.parametrize("dropout_p", [0.0, 0.4])
@pytest.mark.parametrize("dtype", [torch.float32, *LOW_PRECISION])
@pytest.mark.parametrize("backend", backends.names())
def test_row_with_no_visible_key_gives_zero_and_finite_grads(backend, dtype, dropout_p):
    (q, k, v), mask, bias, blind = blind_row_setup(dtype)
    torch.manual_seed(0)
    out = attention_or_refusal(backend, q, k, v, mask, dropout_p=dropout_p)
    if out is None:
        return
    assert torch.isfinite(out).all()
    assert (out[blind] == 0).all()
    out.sum().backward()
    for t in (q, k, v, bias):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[blind] == 0).all()  # the blind query influences nothing
    w = multihead.attention_weights(q.detach(), k.detach(), mask)
    assert (w[blind] == 0).all()
    assert ((w[~blind].double().sum(-1) - 1).abs() <= row_sum_bound(dtype, 4)).all()


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("backend", backends.names())
def test_module_row_with_no_visible_key(backend, training):
    """In training (dropout 0.4) and evaluation: the blind row's attention is 0, so its output is
    out_proj's bias; the weights returned are 0 there; every gradient is finite."""
    torch.manual_seed(0)
    mha = multihead.MultiHeadAttention(8, 2, dropout=0.4, backend=backend).train(training)
    x = torch.randn(2, 4, 8, requires_grad=True)
    padding = torch.ones(2, 4, dtype=torch.bool)
    padding[1] = False  # batch 1: every key is padding
    mask = masks.key_padding(padding) & masks.causal()
    for module in (mha, mha.to_per_head()):
        out = module_or_refusal(backend, module, x, mask=mask)
        if out is None:
            continue
        assert torch.isfinite(out).all()
        assert torch.equal(out[1], mha.out_proj.bias.expand(4, 8))
        out.square().sum().backward()
        assert torch.isfinite(x.grad).all() and (x.grad[1] == 0).all()
        assert all(torch.isfinite(p.grad).all() for p in module.parameters())
        x.grad = None
    _, weights = mha(x, mask=mask, return_weights=True)
    assert (weights[1] == 0).all()
    assert torch.isfinite(weights).all()


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("backend", backends.names())
def test_float32_bias_is_not_rounded_to_half_inputs(backend, dtype):
    """Issue 11, defect 6. BLOOM-style ALiBi (slope x key position, up to 0.71 x 2047 here: 16 new
    tokens after 2032 cached ones) as a float32 bias with float16/bfloat16 q, k, v, causal: every
    backend adds it at float32. Rounded to the inputs' dtype it moves scores by up to half an ulp
    of 1447 (0.5 in float16, 4 in bfloat16): the sdpa backend was wrong by 0.41 and 1.9;
    the naive same-precision reference keeps the bias in float32 (see oracle)."""
    g = torch.Generator().manual_seed(6)
    B, H, Lq, Lk, Dh = 1, 2, 16, 2048, 16
    q, k, v = (torch.randn(B, H, n, Dh, generator=g).to(dtype) for n in (Lq, Lk, Lk))
    slopes = torch.tensor([2 ** -0.5, 2 ** -4.5]).view(H, 1, 1)  # BLOOM's for 2 of 12 heads, roughly
    alibi = (slopes * torch.arange(Lk)).expand(H, Lq, Lk).float()  # float32, as HF builds it
    keep = torch.ones(Lq, Lk, dtype=torch.bool).tril(Lk - Lq).expand(B, H, Lq, Lk)
    bias = alibi.expand(B, H, Lq, Lk)
    out = multihead.attention(q, k, v, masks.bias(alibi) & masks.causal(), backend=backend)
    want = naive_attention(q, k, v, keep, bias, Dh ** -0.5, torch.float64)
    verdict = judge("output", out, want, lambda dt: naive_attention(q, k, v, keep, bias, Dh ** -0.5, dt), dtype,
                    head_dim=Dh, score_size=score_size(q, k, keep, bias, Dh ** -0.5))
    assert verdict.ok, str(verdict)


def emulated_low_precision_attention(q, k, v, keep, scale: float, *, round_scores: bool):
    """A fused path's numerics on any CPU (issue 22 item 5): bfloat16 operands with float32
    accumulation, as AMX and AVX512-BF16 compute a product, each probability rounded to
    bfloat16 for p v (as flash kernels do), the softmax in float32, the output rounded once.
    ``round_scores``: q kᵀ also comes back rounded to bfloat16, as torch's bfloat16 ``mm`` on the
    CPU returns it (what the torch tiles did with bfloat16 products on).

    q (B, H, Lq, D), k/v (B, H, Lk, D) bfloat16, keep (B, H, Lq, Lk) -> (B, H, Lq, D) bfloat16."""
    s = q.float() @ k.float().transpose(-1, -2)  # exact products of bfloat16 numbers, float32 sums
    if round_scores:
        s = s.bfloat16().float()
    s = (s * scale).masked_fill(~keep, -math.inf)
    e = torch.exp(s - s.amax(-1, keepdim=True))
    p = e.bfloat16().float()  # unnormalised probabilities in bfloat16 for the p v product
    return ((p @ v.float()) / e.sum(-1, keepdim=True)).bfloat16()


def test_bf16_rounded_products_fail_the_rule():
    """Issue 22 item 5: the stricter low-precision rule (oracle: a float32-scores reference from the
    same bfloat16 inputs). Inputs x4, causal, D=64: bfloat16 products rounded to bfloat16 before
    the softmax (the torch tiles' old path) fail it; bfloat16 operands into float32 scores (AMX,
    AVX512-BF16, SDPA's fused kernel, the native kernel) and the chunked backend pass it."""
    g = torch.Generator().manual_seed(22)
    B, H, L, Dh = 1, 2, 256, 64
    q, k, v = ((4 * torch.randn(B, H, L, Dh, generator=g)).bfloat16() for _ in range(3))
    keep = torch.ones(L, L, dtype=torch.bool).tril().expand(B, H, L, L)
    scale = Dh ** -0.5
    want = naive_attention(q, k, v, keep, None, scale, torch.float64)

    def verdict(what, got):
        return judge(what, got, want, lambda dt: naive_attention(q, k, v, keep, None, scale, dt), torch.bfloat16,
                     head_dim=Dh, score_size=score_size(q, k, keep, None, scale))

    rounded = verdict("bf16 products rounded", emulated_low_precision_attention(q, k, v, keep, scale, round_scores=True))
    assert not rounded.ok, f"the rounded scores should fail the rule: {rounded}"
    assert rounded.error > 2 * rounded.bound
    fused = verdict("bf16 operands, float32 scores", emulated_low_precision_attention(q, k, v, keep, scale, round_scores=False))
    assert fused.ok, str(fused)
    chunked = verdict("chunked", multihead.attention(q, k, v, masks.causal(), backend="chunked"))
    assert chunked.ok, str(chunked)


# --------------------------------------------------------------------------- the default scale
def test_every_way_of_writing_one_over_sqrt_d_counts_as_the_default_scale():
    # 1 / math.sqrt(D) (default_scale), D ** -0.5 (transformers' scaling) and 1 / D ** 0.5 differ
    # in the last bit for some D (8, 32 and 128 among them); all three are "1/√D"
    from multihead._numerics import default_scale, is_default_scale

    differ = [d for d in range(1, 1025) if d ** -0.5 != default_scale(d)]
    assert {8, 32, 128} <= set(differ)
    for d in range(1, 1025):
        for written in (default_scale(d), d ** -0.5, 1 / d ** 0.5):
            assert is_default_scale(written, d), (d, written)
        assert not is_default_scale(default_scale(d) * (1 + 1e-12), d)
        assert not is_default_scale(default_scale(d + 1), d)


@pytest.mark.parametrize("head_dim", [8, 128])
def test_the_scale_step_calls_transformers_scaling_the_default(head_dim):
    # the reference backend's trace said "given; 1/√D would be ..." for scale=D ** -0.5, the
    # value every transformers attention layer passes, because it differs from 1/math.sqrt(D)
    # in the last bit for these D
    q, k, v = (torch.randn(1, 2, 3, head_dim) for _ in range(3))
    with multihead.trace() as t:
        multihead.attention(q, k, v, scale=head_dim ** -0.5, backend="reference")
    step = next(s for s in t.steps if s.label == "scale")
    assert step.params["default"] is True
    assert "1/√D when D" in step.note
    with multihead.trace() as t:
        multihead.attention(q, k, v, scale=0.3, backend="reference")
    assert next(s for s in t.steps if s.label == "scale").params["default"] is False
