"""``attention(..., return_lse=True)`` and ``merge``: the log-sum-exp on the public API, and the
exact combination of attention over disjoint key sets (xFormers ``merge_attentions``).

Everything is held to float64 (1e-12) against attention written from its definition here:
lse_i = log Σ_j exp(s_ij) over the visible keys (-inf for a row with none), and the merge of
parts against one call over all the keys, forward and gradients, including rows that have no
key in some parts and rows that have none in any.

Legend: B batch, H query heads, Lq/Lk lengths, D head dim, S parts.
"""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from multihead import masks
from ref64 import attention64, causal_keep, random_qkv

NEG_INF = float("-inf")
TOL = 1e-12


def lse64(q, k, keep=None, bias=None, scale=None):
    """log Σ_j exp(s_ij) over the visible keys, (B, H, Lq), -inf for a row with none."""
    q, k = q.double(), k.double()
    g = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(g, dim=1)
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if bias is not None:
        s = s + bias.double()
    if keep is not None:
        s = s.masked_fill(~keep, NEG_INF)
    return torch.logsumexp(s, dim=-1)


def close(a, b, tol=TOL):
    """Equal within ``tol``, -inf meeting -inf counting as equal."""
    both_inf = (a == NEG_INF) & (b == NEG_INF)
    return bool(((a - b).abs().masked_fill(both_inf, 0.0) <= tol).all())


def padded_causal(B, Lq, Lk, pad):
    """keep (B, 1, Lq, Lk): causal (bottom-right) and the first ``pad[b]`` keys of row b padding."""
    real = torch.arange(Lk).expand(B, Lk) >= torch.tensor(pad).view(B, 1)
    return causal_keep(Lq, Lk) & real[:, None, None, :], real


@pytest.mark.parametrize("backend", ["reference", "chunked"])
def test_return_lse_matches_the_definition(backend):
    q, k, v = random_qkv(B=2, H=4, Hkv=2, Lq=9, Lk=11, D=6, seed=1)
    keep, real = padded_causal(2, 9, 11, [0, 5])  # row b=1: the first queries see no key
    bias = torch.randn(1, 4, 9, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    m = masks.causal() & masks.key_padding(real) & masks.bias(bias)
    out, lse = mh.attention(q, k, v, m, backend=backend, return_lse=True)
    expect_out, _ = attention64(q, k, v, keep, bias)
    expect_lse = lse64(q, k, keep, bias)
    assert (expect_lse == NEG_INF).any()  # the case has rows with no visible key
    assert lse.shape == (2, 4, 9) and lse.dtype == torch.float64
    assert (out - expect_out).abs().max() <= TOL
    assert close(lse, expect_lse)


def test_return_lse_is_differentiable():
    q, k, v = random_qkv(B=1, H=2, Lq=5, Lk=6, D=3, seed=3, grad=True)
    lse = mh.attention(q, k, v, masks.causal(), backend="chunked", return_lse=True)[1]
    dq, dk, dv = torch.autograd.grad(lse.sum(), (q, k, v))
    eq, ek = torch.autograd.grad(lse64(q, k, causal_keep(5, 6)).sum(), (q, k))
    assert (dq - eq).abs().max() <= TOL and (dk - ek).abs().max() <= TOL
    assert torch.equal(dv, torch.zeros_like(v))  # the lse does not depend on the values


def _split(k, v, keep, index_sets):
    """The parts' (k, v, keep) for disjoint key index sets."""
    return [(k[:, :, ix], v[:, :, ix], keep[..., ix]) for ix in index_sets]


# contiguous parts, uneven sizes, and interleaved (non-contiguous) parts
KEY_SETS = {
    "three_ranges": [list(range(0, 2)), list(range(2, 9)), list(range(9, 13))],
    "interleaved": [list(range(0, 13, 3)), list(range(1, 13, 3)), list(range(2, 13, 3))],
    "one_part": [list(range(13))],
}


@pytest.mark.parametrize("sets", list(KEY_SETS))
@pytest.mark.parametrize("stacked", [False, True], ids=["lists", "stacked"])
def test_merge_of_parts_equals_one_call_forward_and_gradients(sets, stacked):
    """Rows that see no key in some parts (causal: early queries see nothing of the later
    ranges; padding empties part of row b=1) and rows that see none at all (b=1's first rows)."""
    q, k, v = random_qkv(B=2, H=2, Lq=13, Lk=13, D=4, seed=4, grad=True)
    keep, real = padded_causal(2, 13, 13, [0, 4])
    dout = torch.randn(2, 2, 13, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    dlse = torch.randn(2, 2, 13, dtype=torch.float64, generator=torch.Generator().manual_seed(6))

    def loss(out, lse):  # the lse of an empty row is -inf: leave it out of the loss
        return (out * dout).sum() + (lse.masked_fill(lse == NEG_INF, 0.0) * dlse).sum()

    full_out, full_lse = mh.attention(q, k, v, masks.keep(keep), backend="chunked", return_lse=True)
    full_grads = torch.autograd.grad(loss(full_out, full_lse), (q, k, v))
    parts = [mh.attention(q, kp, vp, masks.keep(kk), backend="chunked", return_lse=True)
             for kp, vp, kk in _split(k, v, keep, KEY_SETS[sets])]
    outs, lses = [p[0] for p in parts], [p[1] for p in parts]
    if len(parts) > 1:
        assert any(((l == NEG_INF) & (full_lse != NEG_INF)).any() for l in lses)  # empty in a part only
    if stacked:
        out, lse = mh.merge(torch.stack(outs), torch.stack(lses))
    else:
        out, lse = mh.merge(outs, lses)
    assert (full_lse == NEG_INF).any()
    assert (out - full_out).abs().max() <= TOL and close(lse, full_lse)
    assert torch.equal(out[full_lse == NEG_INF], torch.zeros_like(out[full_lse == NEG_INF]))
    grads = torch.autograd.grad(loss(out, lse), (q, k, v))
    for name, g, f in zip("qkv", grads, full_grads):
        assert torch.isfinite(g).all(), name
        assert (g - f).abs().max() <= TOL, name


def test_merge_against_the_definition_with_sdpa_free_parts():
    """The merge rule itself, on given parts: out = Σ exp(lse_s - lse) out_s, lse = log Σ exp(lse_s)."""
    g = torch.Generator().manual_seed(7)
    outs = [torch.randn(2, 3, 5, 4, dtype=torch.float64, generator=g) for _ in range(3)]
    lses = [torch.randn(2, 3, 5, dtype=torch.float64, generator=g) * 30 for _ in range(3)]
    lses[1][0, 0, 0] = NEG_INF  # a part without a key in that row
    out, lse = mh.merge(outs, lses)
    expect_lse = torch.logsumexp(torch.stack(lses), dim=0)
    expect = sum(torch.exp(l - expect_lse).unsqueeze(-1) * o for o, l in zip(outs, lses))
    assert (out - expect).abs().max() <= TOL and (lse - expect_lse).abs().max() <= TOL


def test_merge_of_rows_with_no_key_anywhere_gives_zero_and_minus_inf_with_finite_gradients():
    outs = [torch.randn(1, 1, 2, 3, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    lses = [torch.full((1, 1, 2), NEG_INF, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    out, lse = mh.merge(outs, lses)
    assert torch.equal(out, torch.zeros(1, 1, 2, 3, dtype=torch.float64))
    assert (lse == NEG_INF).all()
    out.sum().backward()
    for t in outs + lses:
        assert torch.equal(t.grad, torch.zeros_like(t))


def test_merge_keeps_the_outputs_dtype_and_computes_in_float32():
    outs = [torch.randn(1, 2, 3, 4).bfloat16() for _ in range(2)]
    lses = [torch.randn(1, 2, 3) for _ in range(2)]
    out, lse = mh.merge(outs, lses)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32


def test_merge_bad_inputs_name_the_argument_and_the_fix():
    o, l = torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3)
    with pytest.raises(ValueError, match="one lse per output"):
        mh.merge([o, o], [l])
    with pytest.raises(ValueError, match="outputs is empty"):
        mh.merge([], [])
    with pytest.raises(TypeError, match="outputs must be a list or tuple of tensors"):
        mh.merge(o.numpy(), [l])
    with pytest.raises(ValueError, match=r"lses\[1\] has shape \(1, 2, 4\).*outputs\[1\]\.shape\[:-1\]"):
        mh.merge([o, o], [l, torch.zeros(1, 2, 4)])
    with pytest.raises(ValueError, match=r"outputs\[1\] is \(1, 2, 3, 5\)"):
        mh.merge([o, torch.zeros(1, 2, 3, 5)], [l, l])
    with pytest.raises(TypeError, match=r"lses\[0\] must be a float tensor"):
        mh.merge([o], [l.long()])


def test_return_lse_refused_by_name_where_a_backend_cannot_give_it():
    q, k, v = random_qkv(B=1, H=2, Lq=4, D=4)
    with pytest.raises(ValueError, match="'sdpa' cannot run this call: it does not return the log-sum-exp"):
        mh.attention(q, k, v, backend="sdpa", return_lse=True)
    with pytest.raises(TypeError, match="return_lse must be True or False"):
        mh.attention(q, k, v, return_lse=1)
    d = mh.explain_dispatch(q, k, v, need_lse=True)
    assert "log-sum-exp" in d.refused["sdpa"]
    out, lse = mh.attention(q, k, v, return_lse=True)  # auto routes to a backend that gives it
    assert (out - attention64(q, k, v)[0]).abs().max() <= TOL and close(lse, lse64(q, k))
