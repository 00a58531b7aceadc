"""``multihead.attention`` takes SDPA's other layouts, compared with SDPA itself:

* 3-D (N, L, E) and >4-D (N, ..., H, L, E) inputs, leading axes broadcast between q, k, v and a
  tensor mask: against ``F.scaled_dot_product_attention`` on the same tensors (values and
  gradients, float64);
* jagged nested tensors: against torch's nested SDPA where it runs (no mask), and, for a
  causal mask (which torch's nested SDPA refuses), against SDPA run on each sequence alone.

The same float64 products in another order: 1e-12."""

import pytest
import torch
import torch.nn.functional as F

import multihead as mh
from multihead import masks
from oracle import one_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures(one_thread.__name__)
F64 = 1e-12


@pytest.mark.parametrize("backend", ["reference", "sdpa", "chunked"])
@pytest.mark.parametrize("case", ["3d", "5d", "5d-broadcast", "6d-broadcast"])
def test_leading_axes_equal_sdpa(case, backend):
    torch.manual_seed(0)
    shapes = {
        "3d": ((3, 5, 8), (3, 7, 8), (3, 7, 6), (3, 5, 7)),
        "5d": ((2, 3, 4, 5, 8), (2, 3, 4, 7, 8), (2, 3, 4, 7, 6), (3, 1, 5, 7)),
        "5d-broadcast": ((2, 3, 4, 5, 8), (1, 3, 4, 7, 8), (2, 1, 4, 7, 6), (2, 1, 1, 5, 7)),
        "6d-broadcast": ((2, 1, 3, 2, 5, 8), (1, 2, 3, 2, 7, 8), (1, 1, 1, 2, 7, 8), (5, 7)),
    }[case]
    q, k, v = (torch.randn(s, dtype=torch.float64, requires_grad=True) for s in shapes[:3])
    bias = torch.randn(shapes[3], dtype=torch.float64)
    for mask in (None, bias, bias > -0.5):
        got = mh.attention(q, k, v, mask, backend=backend)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=F64)
        g = torch.randn_like(want)
        for a, b in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g)):
            torch.testing.assert_close(a, b, rtol=0, atol=F64)


def test_leading_axes_lse_and_structured_masks():
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 3, 2, 6, 8, dtype=torch.float64) for _ in range(3))
    out, lse = mh.attention(q, k, v, masks.causal(), return_lse=True)
    scores = (q @ k.transpose(-1, -2)) * 8 ** -0.5
    scores = scores.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(lse, scores.logsumexp(-1), rtol=0, atol=F64)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=0, atol=F64)
    o3, l3 = mh.attention(q[0, 0], k[0, 0], v[0, 0], return_lse=True)  # 3-D: (N, L, E)
    assert o3.shape == (2, 6, 8) and l3.shape == (2, 6)


def nested(seqs):
    """Sequences (L_i, H, D) as a jagged (B, H, j, D) nested tensor, SDPA's layout."""
    return torch.nested.as_nested_tensor(seqs, layout=torch.jagged).transpose(1, 2)


def test_nested_equals_torch_nested_sdpa_values_and_grads():
    torch.manual_seed(2)
    lq, lk = [3, 6, 2], [4, 2, 5]
    qs = [torch.randn(n, 2, 8, dtype=torch.float64, requires_grad=True) for n in lq]
    ks = [torch.randn(n, 2, 8, dtype=torch.float64, requires_grad=True) for n in lk]
    vs = [torch.randn(n, 2, 8, dtype=torch.float64, requires_grad=True) for n in lk]
    got = mh.attention(nested(qs), nested(ks), nested(vs))
    want = F.scaled_dot_product_attention(nested(qs), nested(ks), nested(vs))
    assert got.is_nested
    gs = [torch.randn(n, 2, 8, dtype=torch.float64) for n in lq]
    for a, b, g in zip(got.unbind(), want.unbind(), gs):
        torch.testing.assert_close(a, b, rtol=0, atol=F64)
    leaves = qs + ks + vs
    ga = torch.autograd.grad([t.transpose(0, 1) for t in got.unbind()], leaves, gs)
    gb = torch.autograd.grad([t.transpose(0, 1) for t in want.unbind()], leaves, gs)
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, rtol=0, atol=F64)


def test_nested_causal_equals_sdpa_per_sequence():
    torch.manual_seed(3)
    seqs = [torch.randn(n, 2, 8, dtype=torch.float64) for n in (5, 1, 7)]
    got = mh.attention(nested(seqs), nested(seqs), nested(seqs), masks.causal())
    for s, o in zip(seqs, got.unbind()):
        x = s.transpose(0, 1)[None]
        torch.testing.assert_close(o[None], F.scaled_dot_product_attention(x, x, x, is_causal=True), rtol=0, atol=F64)


def test_bad_layouts_are_refused_by_name():
    q = torch.randn(2, 3, 4, 5, 8)
    with pytest.raises(ValueError, match="q must have 4 dimensions"):  # mixed ranks: the 4-D rule
        mh.attention(q, q[0], q[0])
    with pytest.raises(ValueError, match="do not broadcast"):
        mh.attention(q, torch.randn(3, 3, 4, 5, 8), torch.randn(3, 3, 4, 5, 8))
    with pytest.raises(ValueError, match=r"mask has shape \(3, 5, 5\)"):
        mh.attention(q, q, q, torch.zeros(3, 5, 5))
    s = nested([torch.randn(3, 2, 8)])
    with pytest.raises(TypeError, match="k must be a jagged nested tensor"):
        mh.attention(s, torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8))
    with pytest.raises(TypeError, match="a nested input takes a multihead.masks mask"):
        mh.attention(s, s, s, torch.ones(3, 3, dtype=torch.bool))
