"""KV caches: decoding with a cache equals a full causal forward over the whole sequence
(prefill then decode, token by token, in chunks; MHA and GQA; with and without RoPE; eager
KVCache and compile-friendly StaticKVCache), the generation tools (crop, reorder, select, left
padding, one cache per layer) equal a full recomputation, the static cache compiles once, the
buffers are allocated once, GQA caches hold Hkv heads, and misuse raises clear errors.

A full recomputation in float64 and a cached decode differ only by the order of the same
roundings (a few ulps of values of size ~1), hence the 1e-12 bound of issue 12."""

import pytest
import torch
from torch._dynamo.utils import counters

import multihead as mh
from multihead import masks
from oracle import one_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

# fp32 decode vs full forward: the bound
F32_ATOL = 1e-5
F64_ATOL = 1e-12
CACHES = {"KVCache": mh.KVCache, "StaticKVCache": mh.StaticKVCache}


def make(num_kv_heads=4, rope=False, backend="auto", dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return mh.MultiHeadAttention(
        32, 4, num_kv_heads=num_kv_heads, causal=True, rope=rope, backend=backend, dtype=dtype
    ).eval()


def decode(m, x, chunks, max_len=64, kind=mh.KVCache, **kwargs):
    """Run x (B, L, d) through m in the given chunk sizes, with one cache; return the outputs."""
    cache = kind(max_len)
    outs, start = [], 0
    with torch.no_grad():
        for n in chunks:
            outs.append(m(x[:, start:start + n], cache=cache, **kwargs))
            start += n
    assert start == x.shape[1] and len(cache) == start
    return torch.cat(outs, dim=1), cache


@pytest.mark.parametrize("kind", list(CACHES))
@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
@pytest.mark.parametrize("chunks", [[7] + [1] * 9, [1] * 16, [5, 3, 1, 7]], ids=["prefill-decode", "token-by-token", "chunks"])
def test_cached_decoding_equals_full_causal_forward(chunks, num_kv_heads, rope, kind):
    m = make(num_kv_heads, rope)
    x = torch.randn(3, 16, 32)
    with torch.no_grad():
        full = m(x)
    got, _ = decode(m, x, chunks, kind=CACHES[kind])
    torch.testing.assert_close(got, full, rtol=0, atol=F32_ATOL)


@pytest.mark.parametrize("kind", list(CACHES))
@pytest.mark.parametrize("rope", [False, True])
def test_cached_decoding_equals_reference_backend_float64(rope, kind):
    m = make(2, rope, backend="reference", dtype=torch.float64)
    x = torch.randn(2, 12, 32, dtype=torch.float64)
    with torch.no_grad():
        full = m(x)
    m_sdpa = make(2, rope, backend="sdpa", dtype=torch.float64)
    m_sdpa.load_state_dict(m.state_dict())
    for model in (m, m_sdpa):
        got, _ = decode(model, x, [4, 1, 1, 3, 1, 1, 1], kind=CACHES[kind])
        torch.testing.assert_close(got, full, rtol=0, atol=F64_ATOL)


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


@pytest.mark.parametrize("kind", list(CACHES))
def test_decode_step_weights_are_the_last_row_of_the_full_weights(kind):
    m = make(2, rope=True, dtype=torch.float64)
    x = torch.randn(1, 9, 32, dtype=torch.float64)
    with torch.no_grad():
        _, full_w = m(x, return_weights=True)
        cache = CACHES[kind](16)
        m(x[:, :8], cache=cache)
        _, step_w = m(x[:, 8:], cache=cache, return_weights=True)
    if kind == "StaticKVCache":  # weights over the whole buffer: the keys not yet written get exactly 0
        assert step_w.shape == (1, 4, 1, 16) and torch.equal(step_w[..., 9:], torch.zeros(1, 4, 1, 7, dtype=torch.float64))
        step_w = step_w[..., :9]
    assert step_w.shape == (1, 4, 1, 9)
    torch.testing.assert_close(step_w, full_w[:, :, 8:], rtol=0, atol=F64_ATOL)


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


@pytest.mark.parametrize("kind", list(CACHES))
def test_cache_full_raises(kind):
    m = make()
    cache = CACHES[kind](4)
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


@pytest.mark.parametrize("kind", list(CACHES))
@pytest.mark.parametrize("then", list(GRAD_MODES))
@pytest.mark.parametrize("first", list(GRAD_MODES))
def test_cache_works_in_any_mix_of_grad_modes(first, then, kind):
    """Issue 11, defect 4: a cache filled under inference_mode crashed the next append under
    no_grad ("Inplace update to inference tensor outside InferenceMode")."""
    m = make(2, rope=True, dtype=torch.float64).requires_grad_(False)  # frozen: grad mode may decode too
    x = torch.randn(2, 10, 32, dtype=torch.float64)
    with torch.no_grad():
        full = m(x)
    cache = CACHES[kind](16)
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


# --------------------------------------------------------------------------- generation tools
class Stack(torch.nn.Module):
    """Two pre-norm-free residual attention layers: a model with one cache per layer."""

    def __init__(self, rope: bool):
        super().__init__()
        self.blocks = torch.nn.ModuleList([make(2, rope, dtype=torch.float64, seed=s) for s in (0, 1)])

    def forward(self, x, caches=None):
        for i, block in enumerate(self.blocks):
            x = x + block(x, cache=None if caches is None else caches[i])
        return x


def generate(forward, cache, prompt, keep, script, seed=1):
    """Prefill ``prompt`` (B, P, d) with ``forward(x, cache)``, then run ``script``: ("step", n)
    feeds n new tokens, ("crop", drop) forgets the last ``drop`` tokens, ("reorder" | "select",
    rows) applies the tool. After every forward each row's outputs are compared with ``forward``
    over that row's history alone (its real tokens only, no cache): a full recomputation."""
    g = torch.Generator().manual_seed(seed)
    hist = prompt
    real = torch.ones(prompt.shape[:2], dtype=torch.bool) if keep is None else keep

    def check(got, n):
        for b in range(hist.shape[0]):
            alone = forward(hist[b][real[b]][None], None)[0]
            torch.testing.assert_close(got[b][real[b, -n:]], alone[-int(real[b, -n:].sum()):], rtol=0, atol=F64_ATOL)

    with torch.no_grad():
        check(forward(prompt, cache), prompt.shape[1])
        for op, arg in script:
            if op == "step":
                x = torch.randn(hist.shape[0], arg, prompt.shape[2], generator=g, dtype=prompt.dtype)
                hist, real = torch.cat([hist, x], 1), torch.cat([real, torch.ones(x.shape[:2], dtype=torch.bool)], 1)
                check(forward(x, cache), arg)
            elif op == "crop":
                cache.crop(len(cache) - arg)
                hist, real = hist[:, :-arg], real[:, :-arg]
            else:
                rows = torch.tensor(arg)
                getattr(cache, op)(rows)
                hist, real = hist[rows], real[rows]
            assert len(cache) == hist.shape[1]


SCRIPTS = {
    # speculative decoding: 4 drafted tokens verified in one call, 3 rejected, decoding goes on
    "speculative": [("step", 1), ("step", 4), ("crop", 3), ("step", 1), ("step", 2), ("crop", 1), ("step", 1)],
    # beam search: beams permuted and duplicated between steps
    "beam": [("step", 1), ("reorder", [2, 0, 0]), ("step", 1), ("reorder", [1, 2, 0]), ("step", 1), ("step", 1)],
    # finished sequences leave the batch
    "finished": [("step", 1), ("select", [2, 0]), ("step", 1), ("select", [1]), ("step", 1)],
}


def left_padded(lengths, P=7, d=32, seed=0):
    """(B, P, d) prompts and their (B, P) keep, left-padded to P (the padding rows are noise)."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randn(len(lengths), P, d, generator=g, dtype=torch.float64)
    keep = torch.arange(P)[None, :] >= P - torch.tensor(lengths)[:, None]
    return prompt, keep


@pytest.mark.parametrize("kind", list(CACHES))
@pytest.mark.parametrize("rope", [False, True])
def test_left_padded_batch_decodes_like_each_sequence_alone(rope, kind):
    """Prompts of 5, 2 and 7 tokens left-padded to 7: with keep= the cache masks the padding
    keys and gives each row its own positions, in the prefill and in every step, without a
    mask from the caller."""
    m = make(2, rope, dtype=torch.float64)
    prompt, keep = left_padded([5, 2, 7])
    generate(lambda x, c: m(x, cache=c), CACHES[kind](20, keep=keep), prompt, keep, [("step", 1)] * 5 + [("step", 2)])


@pytest.mark.parametrize("kind", list(CACHES))
def test_padding_anywhere_in_the_prompt_decodes_like_the_sequence_alone(kind):
    """Right padding and a holed row too: a row's rotary positions count its real tokens only.
    (RoPE scores see relative positions, so with left padding alone a row's positions shifted
    by its padding would go unnoticed; a gap between real tokens shows it.)"""
    m = make(2, rope=True, dtype=torch.float64)
    keep = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 1, 1]], dtype=torch.bool)
    prompt = torch.randn(3, 7, 32, dtype=torch.float64)
    generate(lambda x, c: m(x, cache=c), CACHES[kind](20, keep=keep), prompt, keep,
             [("step", 1)] * 3 + [("step", 2)] + SCRIPTS["beam"][1:3])


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
@pytest.mark.parametrize("script", list(SCRIPTS))
@pytest.mark.parametrize("kind", list(CACHES))
@pytest.mark.parametrize("rope", [False, True])
def test_crop_reorder_select_equal_a_full_recomputation(rope, kind, script, padded):
    m = make(2, rope, dtype=torch.float64)
    prompt, keep = left_padded([5, 2, 7]) if padded else (torch.randn(3, 6, 32, dtype=torch.float64), None)
    generate(lambda x, c: m(x, cache=c), CACHES[kind](20, keep=keep), prompt, keep, SCRIPTS[script])


@pytest.mark.parametrize("kind", list(CACHES))
@pytest.mark.parametrize("rope", [False, True])
def test_one_cache_per_layer_shares_one_length_and_the_tools(rope, kind):
    model = Stack(rope)
    prompt, keep = left_padded([5, 2, 7])
    caches = CACHES[kind].layers(2, 20, keep=keep)
    assert caches.num_layers == 2 and len(caches) == 0 and all(isinstance(c, CACHES[kind]) for c in caches)
    script = SCRIPTS["speculative"][:3] + SCRIPTS["beam"][1:3] + SCRIPTS["finished"][1:3]
    generate(lambda x, c: model(x, caches=c), caches, prompt, keep, script)
    assert [len(c) for c in caches] == [len(caches)] * 2 and caches[0].key.shape[0] == 2
    caches.reset()
    assert len(caches) == 0 and all(c.keep is None for c in caches)
    x = torch.randn(1, 4, 32, dtype=torch.float64)
    with torch.no_grad():  # reused for a new, unpadded batch of another size
        torch.testing.assert_close(model(x, caches=caches), model(x), rtol=0, atol=F64_ATOL)


def test_layers_of_different_lengths_are_refused_by_the_container():
    model = Stack(rope=False)
    caches = mh.KVCache.layers(2, 8)
    with torch.no_grad():
        model.blocks[0](torch.randn(1, 3, 32, dtype=torch.float64), cache=caches[0])  # layer 1 never ran
    with pytest.raises(ValueError, match=r"different lengths \[3, 0\]"):
        len(caches)
    with pytest.raises(ValueError, match="n=2 but the caches hold 0 tokens"):
        caches.crop(2)
    caches.crop(0)
    assert len(caches) == 0
    with pytest.raises(TypeError, match="one per layer"):
        mh.KVCaches([])
    with pytest.raises(ValueError, match="num_layers"):
        mh.KVCache.layers(0, 8)


# --------------------------------------------------------------------------- torch.compile
def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
def test_static_cache_compiles_once_for_every_cache_length(padded):
    """fullgraph=True with dynamic=False (no symbolic lengths to lean on): the prefill and the
    decode step compile once each; 20 more steps, and a beam reorder between them, add no graph
    and no break; every output equals a full recomputation."""
    m = make(2, rope=True, dtype=torch.float64)
    prompt, keep = left_padded([5, 2, 7]) if padded else (torch.randn(3, 7, 32, dtype=torch.float64), None)
    torch._dynamo.reset()
    counters.clear()
    f = torch.compile(m, fullgraph=True, backend="aot_eager", dynamic=False)
    script = [("step", 1)] * 12 + [("reorder", [1, 2, 0])] + [("step", 1)] * 10
    seen = []  # unique graphs after each compiled call: prefill, step 1, step 2, ...

    def forward(x, cache):
        if cache is None:
            return m(x)  # the recomputation, eager
        out = f(x, cache=cache)
        seen.append(_graphs())
        return out

    cache = mh.StaticKVCache(40, keep=keep)
    generate(forward, cache, prompt, keep, script)
    assert len(seen) == 23 and seen[2] <= 2 and seen[-1] == seen[2], seen  # then 20 steps, nothing new
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert len(cache) == 7 + 22


def test_compiled_rope_decode_with_kvcache_does_not_break_the_graph():
    """The rotary step built its trace note (an f-string of the cache length) even with no trace
    recording; under torch.compile the length becomes symbolic after the first decode step and
    fullgraph=True raised "Unsupported: BUILD_STRING type error". Now the note is built only
    when recording."""
    m = make(2, rope=True, dtype=torch.float64)
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    torch._dynamo.reset()
    counters.clear()
    f = torch.compile(m, fullgraph=True, backend="aot_eager")
    cache = mh.KVCache(16)
    with torch.no_grad():
        got = torch.cat([f(x[:, :5], cache=cache)] + [f(x[:, t:t + 1], cache=cache) for t in range(5, 9)], 1)
        full = m(x)
    torch.testing.assert_close(got, full, rtol=0, atol=F64_ATOL)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kind", list(CACHES))
def test_generation_tools_validate_their_arguments(kind):
    cache = CACHES[kind](8)
    with pytest.raises(ValueError, match="no batch yet"):
        cache.reorder(torch.tensor([0]))
    k, v = torch.randn(2, 1, 3, 4), torch.randn(2, 1, 3, 4)
    cache.append(k, v)
    for bad, err, match in [
        ([1, 0], TypeError, "index must be a 1-D torch.LongTensor"),
        (torch.tensor([1.0, 0.0]), TypeError, r"got torch.float32; convert it with index.long\(\)"),
        (torch.tensor([True, False]), TypeError, r"index.nonzero\(\).squeeze\(1\)"),
        (torch.tensor([[1, 0]]), ValueError, "index must be 1-D"),
        (torch.tensor([1, 0, 0]), ValueError, "index has 3 entries but the cache holds B=2 rows.*select"),
        (torch.tensor([0, 2]), ValueError, r"index has 2, but the cache holds B=2 rows: use row indices 0 .. 1"),
        (torch.tensor([-1, 0]), ValueError, "index has -1"),
        (torch.tensor([1, 0], device="meta"), ValueError, "index is on meta but the cache is on cpu"),
    ]:
        with pytest.raises(err, match=match):
            cache.reorder(bad)
    with pytest.raises(ValueError, match="batch_index is empty"):
        cache.select(torch.tensor([], dtype=torch.long))
    with pytest.raises(ValueError, match="batch_index has 5"):
        cache.select(torch.tensor([5]))
    for n, err, match in [(4, ValueError, "n=4 but the cache holds 3 tokens.*0 <= n <= 3"),
                          (-1, ValueError, "n must be non-negative"), (1.5, TypeError, "n must be an int")]:
        with pytest.raises(err, match=match):
            cache.crop(n)
    assert len(cache) == 3 and torch.equal(cache.keys[:, :, :3], k) and torch.equal(cache.values[:, :, :3], v)


@pytest.mark.parametrize("kind", list(CACHES))
def test_keep_is_validated_at_construction_and_against_the_batch(kind):
    cls = CACHES[kind]
    with pytest.raises(TypeError, match=r"keep must be a bool.*attention_mask.bool\(\)"):
        cls(8, keep=torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"keep must have shape \(B, P\)"):
        cls(8, keep=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="max_len >= 9"):
        cls(8, keep=torch.ones(1, 9, dtype=torch.bool))
    m = make(2, dtype=torch.float64)
    with torch.no_grad():
        with pytest.raises(ValueError, match="built with keep for B=2 rows but the new entries have B=3"):
            m(torch.randn(3, 4, 32, dtype=torch.float64), cache=cls(8, keep=torch.ones(2, 4, dtype=torch.bool)))
        with pytest.raises(ValueError, match="keep is on meta but the new entries are on cpu"):
            m(torch.randn(2, 4, 32, dtype=torch.float64), cache=cls(8, keep=torch.ones(2, 4, dtype=torch.bool, device="meta")))
