"""The tutorials' claim made executable: per-head products, concatenated, equal one product
with the concatenated matrices."""

import pytest
import torch

import multihead as mh
from multihead import masks


def pair(dtype, **kw):
    torch.manual_seed(0)
    mha = mh.MultiHeadAttention(8, 4, dtype=dtype, **kw)
    return mha, mha.to_per_head()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize(
    "kw", [dict(), dict(causal=True), dict(bias=False), dict(num_kv_heads=2), dict(num_kv_heads=1, causal=True), dict(d_out=12)]
)
def test_per_head_equals_fused(dtype, tol, kw):
    mha, per = pair(dtype, **kw)
    x = torch.randn(3, 6, 8, dtype=dtype)
    assert (mha(x) - per(x)).abs().max() <= tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_per_head_cross_attention_and_masks(dtype, tol):
    torch.manual_seed(1)
    mha = mh.MultiHeadAttention(8, 2, kdim=5, vdim=3, dtype=dtype)
    per = mha.to_per_head()
    q, k, v = torch.randn(2, 4, 8, dtype=dtype), torch.randn(2, 7, 5, dtype=dtype), torch.randn(2, 7, 3, dtype=dtype)
    m = masks.key_padding(torch.rand(2, 7) > 0.3) & masks.window(2, 2)
    assert (mha(q, k, v, mask=m) - per(q, k, v, mask=m)).abs().max() <= tol


def test_per_head_keeps_settings_and_has_independent_heads():
    mha, per = pair(torch.float32, causal=True, dropout=0.1, bias=False)
    assert per.config.causal and per.config.dropout == 0.1 and not per.config.bias
    assert len(per.heads) == 4 and per.heads[0].q.weight.shape == (2, 8)
    assert per.heads[1].q.bias is None


@pytest.mark.parametrize("kw", [dict(), dict(bias=False, causal=True), dict(kdim=5, vdim=3)])
def test_round_trip_is_exact(kw):
    mha, per = pair(torch.float32, **kw)
    back = mh.MultiHeadAttention.from_per_head(per)
    for (name, a), (_, b) in zip(mha.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name
    assert back.config == mha.config


def test_gqa_round_trip_regroups_identical_copies():
    mha, per = pair(torch.float64, num_kv_heads=2)
    # each head carries its own copy of the shared K/V projection
    assert torch.equal(per.heads[0].k.weight, per.heads[1].k.weight)
    assert not torch.equal(per.heads[1].k.weight, per.heads[2].k.weight)
    back = mh.MultiHeadAttention.from_per_head(per, num_kv_heads=2)
    assert back.k_proj.weight.shape == (4, 8)
    for (name, a), (_, b) in zip(mha.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name
    full = mh.MultiHeadAttention.from_per_head(per)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    assert (full(x) - mha(x)).abs().max() < 1e-12


def test_regrouping_refuses_heads_that_differ():
    mha, per = pair(torch.float32)
    with pytest.raises(ValueError, match="heads 0..1 should share one K projection, but head 1's differs"):
        mh.MultiHeadAttention.from_per_head(per, num_kv_heads=2)
    with pytest.raises(ValueError, match="num_heads must be a multiple of num_kv_heads"):
        mh.MultiHeadAttention.from_per_head(per, num_kv_heads=3)
    with pytest.raises(TypeError, match="takes a PerHeadAttention"):
        mh.MultiHeadAttention.from_per_head(mha)


# ---------------------------------------------------------------------------- codecs: (config, weights)
@pytest.mark.parametrize(
    "kw", [dict(), dict(num_kv_heads=2, causal=True), dict(num_kv_heads=1, bias=False), dict(kdim=5, vdim=3, d_out=12),
           dict(dropout=0.25)]
)
def test_per_head_codecs_round_trip_exactly(kw):
    """(config, weights) -> PerHeadAttention -> (config, weights): the same config and weights,
    bit for bit, and the rebuilt module gives the same outputs as the original, bit for bit."""
    from multihead.per_head import from_per_head, to_per_head

    mha, _ = pair(torch.float64, **kw)
    mha.eval()
    per = to_per_head(mha.config, mha.state_dict()).eval()
    config, weights = from_per_head(per, num_kv_heads=mha.config.num_kv_heads)
    assert config == mha.config and list(weights) == list(mha.state_dict())
    for name, t in mha.state_dict().items():
        assert torch.equal(weights[name], t), name
    back = mh.MultiHeadAttention.from_config(config, weights).eval()
    q = torch.randn(2, 5, 8, dtype=torch.float64)
    k = torch.randn(2, 6, mha.config.kdim, dtype=torch.float64)
    v = torch.randn(2, 6, mha.config.vdim, dtype=torch.float64)
    assert torch.equal(back(q, k, v), mha(q, k, v))
    assert torch.equal(per(q, k, v), mha.to_per_head()(q, k, v))  # the wrapper is the codec
    assert (per(q, k, v) - mha(q, k, v)).abs().max() < 1e-12


def test_per_head_wrappers_keep_the_training_mode():
    mha, _ = pair(torch.float32, dropout=0.1)
    assert mha.to_per_head().training and not mha.eval().to_per_head().training
    assert not mh.MultiHeadAttention.from_per_head(mha.to_per_head()).training


def test_to_per_head_codec_names_weights_that_do_not_fit():
    from multihead.per_head import to_per_head

    config = mh.AttentionConfig(d_in=8, num_heads=4, num_kv_heads=2)
    full = mh.MultiHeadAttention(8, 4).state_dict()  # K/V for 4 heads, not 2
    with pytest.raises(ValueError, match=r"weights\['k_proj\.weight'\] has shape \(8, 8\) but this config needs \(kv_dim, kdim\) = \(4, 8\)"):
        to_per_head(config, full)
    with pytest.raises(ValueError, match=r"rope=False"):
        to_per_head(mh.AttentionConfig(d_in=8, num_heads=2, rope=True), full)
