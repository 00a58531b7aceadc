"""ALiBi with per-sequence slopes (B, H), flash-attn's ``alibi_slopes`` of shape (batch, nheads):
the bias ``-slopes[b, h] · |j - (i + Lk - Lq)|`` (flash-attn's rule, bottom-right), written out
here as a dense float tensor, against every backend; and each row against running that sequence
alone with its (H,) slopes. Float64: the same products, 1e-12."""

import pytest
import torch

import multihead as mh
from multihead import masks
from multihead.backends import names
from oracle import one_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures(one_thread.__name__)
F64 = 1e-12


def flash_alibi_bias(slopes, lq, lk):
    """(B, H, Lq, Lk): -slopes[b, h] * |j - (i + lk - lq)|."""
    i = torch.arange(lq)[:, None] + lk - lq
    j = torch.arange(lk)[None]
    return -slopes[:, :, None, None] * (j - i).abs().to(slopes.dtype)


@pytest.mark.parametrize("backend", [b for b in ("reference", "sdpa", "chunked", "flex") if b in names()])
@pytest.mark.parametrize("causal", [False, True])
def test_per_sequence_slopes_equal_the_dense_bias_and_each_row_alone(backend, causal):
    torch.manual_seed(0)
    B, H, Lq, Lk, D = 3, 4, 5, 9, 8
    train = backend != "flex"  # torch's flex_attention has no CPU backward
    q = torch.randn(B, H, Lq, D, dtype=torch.float64, requires_grad=train)
    k, v = (torch.randn(B, 2, Lk, D, dtype=torch.float64, requires_grad=train) for _ in range(2))
    slopes = torch.rand(B, H, dtype=torch.float64)
    m = masks.alibi(slopes) & masks.causal() if causal else masks.alibi(slopes)
    got = mh.attention(q, k, v, m, backend=backend)
    dense = flash_alibi_bias(slopes, Lq, Lk)
    ref_mask = masks.bias(dense) & masks.causal() if causal else masks.bias(dense)
    want = mh.attention(q, k, v, ref_mask, backend="reference")
    torch.testing.assert_close(got, want, rtol=0, atol=F64)
    if train:
        g = torch.randn_like(got)
        for a, b in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g)):
            torch.testing.assert_close(a, b, rtol=0, atol=F64)
    for b in range(B):
        mb = masks.alibi(slopes[b]) & masks.causal() if causal else masks.alibi(slopes[b])
        alone = mh.attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], mb, backend=backend)
        torch.testing.assert_close(got[b:b + 1], alone, rtol=0, atol=F64)


def test_per_sequence_slopes_of_the_wrong_shape_are_refused():
    q = torch.randn(2, 4, 3, 8)
    with pytest.raises(ValueError, match=r"slopes for 3 sequences \(B, H\) but the call has B=2"):
        mh.attention(q, q, q, masks.alibi(torch.rand(3, 4)))
    with pytest.raises(ValueError, match="has 5 slopes but the call has H=4"):
        mh.attention(q, q, q, masks.alibi(torch.rand(2, 5)))
    with pytest.raises(ValueError, match=r"\(B, H\), one per sequence and head"):
        masks.alibi(torch.rand(2, 4, 1))
