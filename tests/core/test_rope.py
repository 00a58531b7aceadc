"""RoPE against the formula written independently (complex rotation, explicit 2x2 rotations),
its relative-position property, and the module with rope=True (MHA, GQA, refusals, trace)."""

import cmath
import math

import pytest
import torch
import torch.nn.functional as F

import multihead as mh
from multihead.rope import RoPE

F32_EPS = torch.finfo(torch.float32).eps


def rope_complex_f64(x: torch.Tensor, positions, base: float = 10000.0) -> torch.Tensor:
    """The formula with complex numbers, in float64: coordinate j and j + D/2 are the real and
    imaginary parts of z_j, which is multiplied by exp(i * p * base^(-2j/D))."""
    x = x.double()
    D = x.shape[-1]
    half = D // 2
    z = torch.complex(x[..., :half], x[..., half:])
    rot = torch.tensor(
        [[cmath.exp(1j * p * base ** (-2 * j / D)) for j in range(half)] for p in positions],
        dtype=torch.complex128,
    )
    z = z * rot
    return torch.cat((z.real, z.imag), dim=-1)


def rope_pairs_f64(x: torch.Tensor, positions, base: float = 10000.0) -> torch.Tensor:
    """The formula as one explicit 2x2 rotation per pair (j, j + D/2), looping in float64."""
    x = x.double()
    D = x.shape[-1]
    half = D // 2
    out = torch.empty_like(x)
    for t, p in enumerate(positions):
        for j in range(half):
            a = p * base ** (-2 * j / D)
            c, s = math.cos(a), math.sin(a)
            x1, x2 = x[..., t, j], x[..., t, j + half]
            out[..., t, j] = c * x1 - s * x2
            out[..., t, j + half] = s * x1 + c * x2
    return out


@pytest.mark.parametrize("offset", [0, 37])
@pytest.mark.parametrize("base", [10000.0, 500.0])
def test_rope_equals_complex_rotation_float64(offset, base):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 9, 16, dtype=torch.float64)
    got = RoPE(16, base)(x, offset)
    want = rope_complex_f64(x, range(offset, offset + 9), base)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_rope_float32_equals_explicit_pair_rotation():
    torch.manual_seed(1)
    x = torch.randn(1, 2, 6, 8, dtype=torch.float32)
    positions = range(1000, 1006)  # large angles: the table must be accurate there too
    got = RoPE(8)(x, 1000).double()
    want = rope_pairs_f64(x, positions)
    # each output is c*x1 -+ s*x2 with c, s rounded to fp32 and two fp32 products and a sum:
    # |error| <= ~3 eps (|x1| + |x2|); allow 4 eps
    x1, x2 = x[..., :4].double(), x[..., 4:].double()
    bound = 4 * F32_EPS * torch.cat((x1.abs() + x2.abs(),) * 2, dim=-1)
    assert ((got - want).abs() <= bound).all()


def test_rope_keeps_norm_of_each_pair():
    torch.manual_seed(2)
    x = torch.randn(2, 2, 5, 12, dtype=torch.float64)
    y = RoPE(12)(x, 3)
    pair_norm = lambda t: t[..., :6] ** 2 + t[..., 6:] ** 2  # noqa: E731
    torch.testing.assert_close(pair_norm(y), pair_norm(x), rtol=1e-13, atol=1e-13)


def test_scores_depend_only_on_position_difference():
    torch.manual_seed(3)
    rope = RoPE(32)
    q = torch.randn(1, 1, 1, 32, dtype=torch.float64)
    k = torch.randn(1, 1, 1, 32, dtype=torch.float64)

    def score(p, s):
        return float((rope(q, p) * rope(k, s)).sum())

    for p, s in [(5, 2), (40, 1), (7, 7), (3, 9)]:
        for shift in (1, 13, 500):
            assert score(p + shift, s + shift) == pytest.approx(score(p, s), rel=0, abs=1e-10)
    # and the difference does matter (the property is not trivially a constant)
    assert abs(score(5, 2) - score(6, 2)) > 1e-3


def test_offset_equals_positions_of_a_longer_sequence():
    torch.manual_seed(4)
    x = torch.randn(2, 3, 20, 8)
    rope = RoPE(8)
    torch.testing.assert_close(rope(x[:, :, 12:], 12), rope(x)[:, :, 12:], rtol=0, atol=0)


def test_table_grows_on_demand_and_is_cached():
    rope = RoPE(8)
    cos_a, _ = rope.cos_sin(4)
    table_a = rope._tables[(torch.device("cpu"), torch.float32)][0]
    cos_b, sin_b = rope.cos_sin(3, offset=1000)
    table_b = rope._tables[(torch.device("cpu"), torch.float32)][0]
    assert table_b.shape[0] >= 1003 > table_a.shape[0]
    torch.testing.assert_close(cos_b, torch.cos(torch.outer(torch.arange(1000, 1003.0, dtype=torch.float64),
                                                            rope.inv_freq).repeat(1, 2)).float(), rtol=0, atol=1e-7)
    rope.cos_sin(5, offset=10)
    assert rope._tables[(torch.device("cpu"), torch.float32)][0] is table_b  # no rebuild when it fits
    torch.testing.assert_close(cos_a, table_b[:4], rtol=0, atol=0)


@pytest.mark.parametrize(
    "kwargs, err",
    [
        ({"head_dim": 7}, ValueError),
        ({"head_dim": 0}, ValueError),
        ({"head_dim": 8, "base": 1.0}, ValueError),
        ({"head_dim": 8, "base": float("inf")}, ValueError),
        ({"head_dim": 8, "base": "big"}, TypeError),
    ],
)
def test_rope_rejects_bad_settings(kwargs, err):
    with pytest.raises(err):
        RoPE(**kwargs)


def test_rope_rejects_wrong_head_dim():
    with pytest.raises(ValueError, match="head_dim=8"):
        RoPE(8)(torch.randn(1, 1, 2, 6))


# ---------------------------------------------------------------- the module with rope=True


def manual_rope_mha(m: mh.MultiHeadAttention, x: torch.Tensor, causal: bool) -> torch.Tensor:
    """The module's computation in float64 from its weights, with the independent complex RoPE."""
    c = m.config
    B, L, _ = x.shape
    x = x.double()
    w = {n: getattr(m, n) for n in ("q_proj", "k_proj", "v_proj", "out_proj")}
    lin = lambda t, n: F.linear(t, w[n].weight.double(), w[n].bias.double())  # noqa: E731
    q = lin(x, "q_proj").view(B, L, c.num_heads, c.head_dim).transpose(1, 2)
    k = lin(x, "k_proj").view(B, L, c.num_kv_heads, c.head_dim).transpose(1, 2)
    v = lin(x, "v_proj").view(B, L, c.num_kv_heads, c.head_dim).transpose(1, 2)
    q, k = rope_complex_f64(q, range(L), c.rope_base), rope_complex_f64(k, range(L), c.rope_base)
    k, v = k.repeat_interleave(c.groups, 1), v.repeat_interleave(c.groups, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(c.head_dim)
    if causal:
        s = s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    o = (s.softmax(-1) @ v).transpose(1, 2).reshape(B, L, c.d_out)
    return lin(o, "out_proj")


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
@pytest.mark.parametrize("causal", [False, True])
def test_module_rope_equals_manual_float64(num_kv_heads, causal):
    torch.manual_seed(5)
    m = mh.MultiHeadAttention(32, 4, num_kv_heads=num_kv_heads, causal=causal, rope=True, rope_base=1000.0).double()
    x = torch.randn(2, 11, 32, dtype=torch.float64)
    torch.testing.assert_close(m(x), manual_rope_mha(m, x, causal), rtol=0, atol=1e-12)
    ref = m(x, return_weights=True)[0]  # the reference backend takes the same path
    torch.testing.assert_close(ref, manual_rope_mha(m, x, causal), rtol=0, atol=1e-12)


def test_module_rope_changes_the_output():
    torch.manual_seed(6)
    plain = mh.MultiHeadAttention(16, 2, causal=True).double()
    rotary = mh.MultiHeadAttention(16, 2, causal=True, rope=True).double()
    rotary.load_state_dict(plain.state_dict())
    x = torch.randn(1, 6, 16, dtype=torch.float64)
    # position 0 is not rotated, so the first token agrees; later ones do not
    torch.testing.assert_close(rotary(x)[:, 0], plain(x)[:, 0], rtol=0, atol=1e-12)
    assert (rotary(x)[:, 1:] - plain(x)[:, 1:]).abs().max() > 1e-3


def test_module_rope_bfloat16_error_within_twice_plain_bfloat16():
    torch.manual_seed(7)
    m64 = mh.MultiHeadAttention(64, 4, num_kv_heads=2, causal=True, rope=True).double()
    x = torch.randn(2, 64, 64, dtype=torch.float64)
    exact = m64(x)
    m16 = mh.MultiHeadAttention(64, 4, num_kv_heads=2, causal=True, rope=True).to(torch.bfloat16)
    m16.load_state_dict(m64.state_dict())
    got = m16(x.bfloat16()).double()
    # the plain computation in bf16: every op of the manual formula rounded to bf16
    mb = mh.MultiHeadAttention(64, 4, num_kv_heads=2, causal=True, rope=True, backend="reference").to(torch.bfloat16)
    mb.load_state_dict(m64.state_dict())
    plain = mb(x.bfloat16()).double()
    err, plain_err = (got - exact).abs().max(), (plain - exact).abs().max()
    assert err <= 2 * plain_err + 1e-3


def test_rope_object_is_used_and_checked():
    rope = RoPE(8, base=300.0)
    m = mh.MultiHeadAttention(16, 2, rope=rope)
    assert m.rope is rope and m.config.rope and m.config.rope_base == 300.0
    with pytest.raises(ValueError, match="head_dim=8"):
        mh.MultiHeadAttention(16, 4, rope=rope)


def test_rope_refusals_in_the_module():
    with pytest.raises(ValueError, match="even head_dim"):
        mh.MultiHeadAttention(6, 2, rope=True)  # head_dim 3
    with pytest.raises(ValueError, match="self-attention"):
        mh.MultiHeadAttention(8, 2, kdim=4, rope=True)
    with pytest.raises(TypeError, match="rope must be True or False"):
        mh.AttentionConfig(d_in=8, num_heads=2, rope="yes")
    with pytest.raises(ValueError, match="rope_base"):
        mh.MultiHeadAttention(8, 2, rope=True, rope_base=-3)
    m = mh.MultiHeadAttention(8, 2, rope=True)
    with pytest.raises(ValueError, match="rope=True, which is for self-attention"):
        m(torch.randn(1, 3, 8), torch.randn(1, 4, 8))


def test_trace_records_the_rotation():
    torch.manual_seed(8)
    m = mh.MultiHeadAttention(16, 2, num_kv_heads=1, rope=True).double()
    x = torch.randn(1, 5, 16, dtype=torch.float64)
    with mh.trace() as t:
        m(x)
    labels = [s.label for s in t.steps]
    i = labels.index("rotary position embedding Q")
    assert labels[i + 1] == "rotary position embedding K"
    assert labels.index("move heads forward V") < i
    q = F.linear(x, m.q_proj.weight, m.q_proj.bias).view(1, 5, 2, 8).transpose(1, 2)
    torch.testing.assert_close(t.steps[i].tensor, rope_complex_f64(q, range(5)), rtol=0, atol=1e-12)
    assert t.steps[i + 1].shape == (1, 1, 5, 8)


def test_conversions_refuse_rope():
    m = mh.MultiHeadAttention(16, 2, rope=True)
    with pytest.raises(ValueError, match="rope=True"):
        m.to_torch()
    with pytest.raises(ValueError, match="rope=False"):
        m.to_per_head()
