"""KVCache: decoding with a cache equals a full causal forward over the whole sequence
(prefill then decode, token by token, in chunks; MHA and GQA; with and without RoPE), the
buffers are allocated once, GQA caches hold Hkv heads, and misuse raises clear errors."""

import pytest
import torch

import multihead as mh
from multihead import masks

# fp32 decode vs full forward: the bound
F32_ATOL = 1e-5


def make(num_kv_heads=4, rope=False, backend="auto", dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return mh.MultiHeadAttention(
        32, 4, num_kv_heads=num_kv_heads, causal=True, rope=rope, backend=backend, dtype=dtype
    ).eval()


def decode(m, x, chunks, max_len=64, **kwargs):
    """Run x (B, L, d) through m in the given chunk sizes, with one cache; return the outputs."""
    cache = mh.KVCache(max_len)
    outs, start = [], 0
    with torch.no_grad():
        for n in chunks:
            outs.append(m(x[:, start:start + n], cache=cache, **kwargs))
            start += n
    assert start == x.shape[1] and len(cache) == start
    return torch.cat(outs, dim=1), cache


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
@pytest.mark.parametrize("chunks", [[7] + [1] * 9, [1] * 16, [5, 3, 1, 7]], ids=["prefill-decode", "token-by-token", "chunks"])
def test_cached_decoding_equals_full_causal_forward(chunks, num_kv_heads, rope):
    m = make(num_kv_heads, rope)
    x = torch.randn(3, 16, 32)
    with torch.no_grad():
        full = m(x)
    got, _ = decode(m, x, chunks)
    torch.testing.assert_close(got, full, rtol=0, atol=F32_ATOL)


@pytest.mark.parametrize("rope", [False, True])
def test_cached_decoding_equals_reference_backend_float64(rope):
    m = make(2, rope, backend="reference", dtype=torch.float64)
    x = torch.randn(2, 12, 32, dtype=torch.float64)
    with torch.no_grad():
        full = m(x)
    m_sdpa = make(2, rope, backend="sdpa", dtype=torch.float64)
    m_sdpa.load_state_dict(m.state_dict())
    for model in (m, m_sdpa):
        got, _ = decode(model, x, [4, 1, 1, 3, 1, 1, 1])
        torch.testing.assert_close(got, full, rtol=0, atol=1e-12)


def test_decode_with_key_padding_mask_over_the_whole_cache():
    m = make(2, rope=True, dtype=torch.float64)
    x = torch.randn(2, 10, 32, dtype=torch.float64)
    keep = torch.ones(2, 10, dtype=torch.bool)
    keep[0, :3] = False  # left padding of the first sequence
    with torch.no_grad():
        full = m(x, mask=masks.key_padding(keep))
        cache = mh.KVCache(10)
        outs = [m(x[:, :6], cache=cache, mask=masks.key_padding(keep[:, :6]))]
        for t in range(6, 10):
            outs.append(m(x[:, t:t + 1], cache=cache, mask=masks.key_padding(keep[:, :t + 1])))
    torch.testing.assert_close(torch.cat(outs, 1)[:, 3:], full[:, 3:], rtol=0, atol=1e-12)


def test_decode_step_weights_are_the_last_row_of_the_full_weights():
    m = make(2, rope=True, dtype=torch.float64)
    x = torch.randn(1, 9, 32, dtype=torch.float64)
    with torch.no_grad():
        _, full_w = m(x, return_weights=True)
        cache = mh.KVCache(16)
        m(x[:, :8], cache=cache)
        _, step_w = m(x[:, 8:], cache=cache, return_weights=True)
    assert step_w.shape == (1, 4, 1, 9)
    torch.testing.assert_close(step_w, full_w[:, :, 8:], rtol=0, atol=1e-12)


def test_buffers_are_allocated_once_and_returned_as_views():
    m = make(2)
    cache = mh.KVCache(32)
    assert cache.key is None and cache.nbytes == 0
    x = torch.randn(2, 20, 32)
    with torch.no_grad():
        m(x[:, :5], cache=cache)
        kp, vp = cache.key.data_ptr(), cache.value.data_ptr()
        for t in range(5, 20):
            m(x[:, t:t + 1], cache=cache)
            assert (cache.key.data_ptr(), cache.value.data_ptr()) == (kp, vp)
        cache.reset()
        assert len(cache) == 0
        m(x[:, :3], cache=cache)  # same layout after a reset: the buffers are reused
    assert (cache.key.data_ptr(), cache.value.data_ptr()) == (kp, vp)
    k, v = cache.append(torch.zeros(2, 2, 1, 8), torch.ones(2, 2, 1, 8))
    assert k.data_ptr() == kp and v.data_ptr() == vp and k.shape == (2, 2, 4, 8)
    assert torch.equal(cache.keys[:, :, 3], torch.zeros(2, 2, 8)) and torch.equal(cache.values[:, :, 3], torch.ones(2, 2, 8))


def test_gqa_cache_holds_only_the_kv_heads():
    x = torch.randn(2, 6, 32)
    sizes = {}
    for hkv in (4, 2, 1):
        _, cache = decode(make(hkv), x, [6], max_len=50)
        assert cache.key.shape == (2, hkv, 50, 8) and cache.value.shape == (2, hkv, 50, 8)
        sizes[hkv] = cache.nbytes
    assert sizes[4] == 2 * 2 * 4 * 50 * 8 * 4  # 2 buffers x B x Hkv x max_len x D x 4 bytes
    assert sizes[2] * 4 == sizes[4] * 2 and sizes[1] * 4 == sizes[4]  # ratio Hkv / H


def test_cache_contents_are_the_rotated_keys_and_values():
    m = make(2, rope=True, dtype=torch.float64)
    x = torch.randn(1, 5, 32, dtype=torch.float64)
    _, cache = decode(m, x, [2, 1, 2])
    with torch.no_grad():
        k = m.k_proj(x).view(1, 5, 2, 8).transpose(1, 2)
        v = m.v_proj(x).view(1, 5, 2, 8).transpose(1, 2)
    # the module uses one fused product for Q, K, V: float64 rounding differs from separate products
    torch.testing.assert_close(cache.keys, m.rope(k), rtol=0, atol=1e-13)
    torch.testing.assert_close(cache.values, v, rtol=0, atol=1e-13)


def test_cache_full_raises():
    m = make()
    cache = mh.KVCache(4)
    with torch.no_grad():
        m(torch.randn(1, 3, 32), cache=cache)
        with pytest.raises(ValueError, match="KVCache is full.*at least 5"):
            m(torch.randn(1, 2, 32), cache=cache)
    assert len(cache) == 3  # a refused append leaves the cache as it was


def test_cache_refuses_a_layout_change_until_reset():
    cache = mh.KVCache(8)
    cache.append(torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8))
    for k, v in [
        (torch.randn(3, 2, 1, 8), torch.randn(3, 2, 1, 8)),  # batch
        (torch.randn(2, 4, 1, 8), torch.randn(2, 4, 1, 8)),  # heads
        (torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4)),  # head dim
    ]:
        with pytest.raises(ValueError, match=r"holds \(B, Hkv, D, Dv\)"):
            cache.append(k, v)
    with pytest.raises(ValueError, match="float32"):
        cache.append(torch.randn(2, 2, 1, 8, dtype=torch.float64), torch.randn(2, 2, 1, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="meta"):
        cache.append(torch.empty(2, 2, 1, 8, device="meta"), torch.empty(2, 2, 1, 8, device="meta"))
    cache.reset()
    cache.append(torch.randn(3, 1, 2, 4, dtype=torch.float64), torch.randn(3, 1, 2, 4, dtype=torch.float64))
    assert cache.key.shape == (3, 1, 8, 4) and cache.key.dtype == torch.float64 and len(cache) == 2


def test_append_validates_its_arguments():
    cache = mh.KVCache(8)
    with pytest.raises(ValueError, match="k must have 4 dimensions"):
        cache.append(torch.randn(2, 1, 8), torch.randn(2, 1, 8))
    with pytest.raises(ValueError, match="must match"):
        cache.append(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 2, 8))
    with pytest.raises(TypeError, match="v has dtype"):
        cache.append(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8, dtype=torch.float64))
    with pytest.raises(TypeError, match="k must have a floating dtype"):
        cache.append(torch.ones(1, 2, 3, 8, dtype=torch.long), torch.randn(1, 2, 3, 8))
    with pytest.raises(ValueError, match="no_grad"):
        cache.append(torch.randn(1, 1, 1, 8, requires_grad=True), torch.randn(1, 1, 1, 8))
    for bad, err in ((0, ValueError), (2.5, TypeError), (True, TypeError)):
        with pytest.raises(err, match="max_len"):
            mh.KVCache(bad)


def test_module_refuses_cache_where_it_makes_no_sense():
    x = torch.randn(1, 3, 32)
    cache = mh.KVCache(8)
    with torch.no_grad():
        with pytest.raises(TypeError, match="multihead.KVCache"):
            make()(x, cache={"k": None})
        with pytest.raises(ValueError, match="cross-attention"):
            make()(x, torch.randn(1, 5, 32), cache=cache)
        with pytest.raises(ValueError, match="causal=True"):
            mh.MultiHeadAttention(32, 4)(x, cache=cache)
    with pytest.raises(ValueError, match="no_grad"):
        make()(x, cache=cache)  # parameters require grad: decoding belongs under no_grad
    assert len(cache) == 0 and cache.key is None


def test_trace_records_the_append():
    m = make(2, rope=True)
    cache = mh.KVCache(8)
    with torch.no_grad():
        m(torch.randn(1, 3, 32), cache=cache)
        with mh.trace() as t:
            m(torch.randn(1, 1, 32), cache=cache)
    labels = [s.label for s in t.steps]
    assert labels.index("rotary position embedding K") < labels.index("append to the cache K")
    step = t.step("append to the cache V")
    assert step.shape == (1, 2, 4, 8) and "4 of max_len=8" in step.note
    assert "positions 3..3" in t.step("rotary position embedding Q").note


GRAD_MODES = {"grad_frozen_weights": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


@pytest.mark.parametrize("then", list(GRAD_MODES))
@pytest.mark.parametrize("first", list(GRAD_MODES))
def test_cache_works_in_any_mix_of_grad_modes(first, then):
    """Issue 11, defect 4: a cache filled under inference_mode crashed the next append under
    no_grad ("Inplace update to inference tensor outside InferenceMode")."""
    m = make(2, rope=True, dtype=torch.float64).requires_grad_(False)  # frozen: grad mode may decode too
    x = torch.randn(2, 10, 32, dtype=torch.float64)
    with torch.no_grad():
        full = m(x)
    cache = mh.KVCache(16)
    modes = [first, then, first, then, then, first, first]  # prefill of 4 tokens, then one token each
    outs, start = [], 0
    for i, mode in enumerate(modes):
        n = 4 if i == 0 else 1
        with GRAD_MODES[mode]():
            outs.append(m(x[:, start:start + n], cache=cache))
        start += n
    torch.testing.assert_close(torch.cat(outs, 1), full[:, :start], rtol=0, atol=1e-12)
    torch.testing.assert_close(cache.keys, m.rope(m.k_proj(x[:, :start]).view(2, start, 2, 8).transpose(1, 2)), rtol=0, atol=1e-12)


def test_inference_buffers_are_copied_once_then_written_in_place():
    cache = mh.KVCache(8)
    k, v = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    with torch.inference_mode():
        cache.append(k[:, :, :3], v[:, :, :3])
    assert cache.key.is_inference()
    with torch.no_grad():
        cache.append(k[:, :, 3:4], v[:, :, 3:4])  # copies the buffers into ordinary tensors
        assert not cache.key.is_inference() and not cache.value.is_inference()
        ptrs = cache.key.data_ptr(), cache.value.data_ptr()
        keys, values = cache.append(k[:, :, 4:], v[:, :, 4:])
    assert (cache.key.data_ptr(), cache.value.data_ptr()) == ptrs
    assert torch.equal(keys, k) and torch.equal(values, v)
    with torch.inference_mode():  # ordinary buffers are written in place under inference_mode too
        cache.reset()
        cache.append(k, v)
    assert (cache.key.data_ptr(), cache.value.data_ptr()) == ptrs and torch.equal(cache.keys, k)
