"""Ragged and paged KV caches: rows of different lengths decoded in one call.

Two independent references:
* each row against decoding that sequence alone with a one-row `KVCache` (float64, 1e-12);
* the whole batch against `kvcache_reference`, written here from flash-attn's
  ``flash_attn_with_kvcache`` semantics (new keys written at ``cache_seqlens[b]``, row b of the
  batch reading cache row ``cache_batch_idx[b]``, a paged cache read through ``block_table``,
  rotary at positions ``cache_seqlens[b] + i``, bottom-right causal per row) and FlexDecoding's
  paged attention (logical token t of a row = physical block ``block_table[b, t // S]``, offset
  ``t % S``), one row and one head at a time in float64 loops.

Float64 decoding and the references differ only in the order of the same roundings (a few
ulps), hence 1e-12."""


import pytest
import torch
import torch.nn.functional as F

import multihead as mh
from oracle import one_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

F64 = 1e-12
D_MODEL, HEADS = 32, 4


def make(kv_heads=2, rope=True, backend="auto", seed=0):
    torch.manual_seed(seed)
    return mh.MultiHeadAttention(D_MODEL, HEADS, num_kv_heads=kv_heads, causal=True, rope=rope,
                                 backend=backend, dtype=torch.float64).eval()


def new_cache(kind, max_len=24, lengths=None, block_size=4, num_blocks=40):
    if kind == "paged":
        return mh.PagedKVCache(max_len, block_size=block_size, num_blocks=num_blocks, lengths=lengths)
    return mh.RaggedKVCache(max_len, lengths=lengths)


def alone(m, prompt, steps):
    """One sequence decoded by itself with a one-row KVCache: (prompt outputs, step outputs)."""
    cache = mh.KVCache(64)
    with torch.no_grad():
        first = m(prompt[None], cache=cache)[0]
        rest = [m(s[None, None], cache=cache)[0, 0] for s in steps]
    return first, torch.stack(rest) if rest else None


# ---------------------------------------------------------------- the flash-attn reference
def _rotate64(x, pos, base=10000.0):
    """x (L, Hx, D) rotated (rotate-half layout) for positions pos (L,)."""
    D = x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = pos.double()[:, None] * inv[None]  # (L, D/2)
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    half = torch.cat([-x[..., D // 2:], x[..., : D // 2]], -1)
    return x * cos + half * sin


def kvcache_reference(q, k_new, v_new, k_cache, v_cache, cache_seqlens, *, cache_batch_idx=None,
                      block_table=None, rotary=False, scale=None):
    """flash_attn_with_kvcache's semantics in plain float64 loops.

    q (B, n, H, D), k_new/v_new (B, n, Hkv, D); k_cache/v_cache (B_cache, L, Hkv, D), or with
    block_table (num_blocks, S, Hkv, D) and block_table (B, max_blocks). Writes k_new/v_new into
    the cache in place at cache_seqlens[b] (per row), returns out (B, n, H, D)."""
    B, n, H, D = q.shape
    Hkv = k_new.shape[2]
    scale = D ** -0.5 if scale is None else scale
    out = torch.zeros_like(q)
    for b in range(B):
        s = int(cache_seqlens[b])
        pos = torch.arange(s, s + n)
        qb, kb = (_rotate64(q[b], pos), _rotate64(k_new[b], pos)) if rotary else (q[b], k_new[b])
        for i in range(n):
            t = s + i
            if block_table is None:
                row = b if cache_batch_idx is None else int(cache_batch_idx[b])
                k_cache[row, t], v_cache[row, t] = kb[i], v_new[b, i]
            else:
                S = k_cache.shape[1]
                blk = int(block_table[b, t // S])
                k_cache[blk, t % S], v_cache[blk, t % S] = kb[i], v_new[b, i]
        if block_table is None:
            row = b if cache_batch_idx is None else int(cache_batch_idx[b])
            K, V = k_cache[row, : s + n], v_cache[row, : s + n]
        else:
            S = k_cache.shape[1]
            K = torch.stack([k_cache[int(block_table[b, t // S]), t % S] for t in range(s + n)])
            V = torch.stack([v_cache[int(block_table[b, t // S]), t % S] for t in range(s + n)])
        for h in range(H):
            g = h // (H // Hkv)
            for i in range(n):
                seen = s + i + 1  # bottom-right causal: query i sees keys 0 .. s + i
                sc = (qb[i, h] @ K[:seen, g].T) * scale
                out[b, i, h] = torch.softmax(sc, -1) @ V[:seen, g]
    return out


def project(m, x):
    """The module's q (B, n, H, D), k, v (B, n, Hkv, D), before rotary, in flash's layout."""
    D = D_MODEL // HEADS
    q, k, v = (F.linear(x, lin.weight, lin.bias) for lin in (m.q_proj, m.k_proj, m.v_proj))
    return q.unflatten(-1, (-1, D)), k.unflatten(-1, (-1, D)), v.unflatten(-1, (-1, D))


def finish(m, o):
    """(B, n, H, D) -> the module's output (B, n, d)."""
    return F.linear(o.flatten(-2), m.out_proj.weight, m.out_proj.bias)


# ---------------------------------------------------------------- each row as if alone
@pytest.mark.parametrize("kind", ["ragged", "paged"])
@pytest.mark.parametrize("backend", ["reference", "sdpa", "chunked"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_each_row_equals_decoding_it_alone(kind, backend, kv_heads):
    m = make(kv_heads, backend=backend)
    lengths = torch.tensor([5, 2, 7])
    torch.manual_seed(1)
    prompts = torch.randn(3, 7, D_MODEL, dtype=torch.float64)
    steps = torch.randn(3, 4, D_MODEL, dtype=torch.float64)
    cache = new_cache(kind, lengths=lengths)
    with torch.no_grad():
        first = m(prompts, cache=cache)
        outs = torch.stack([m(steps[:, t:t + 1], cache=cache)[:, 0] for t in range(4)], 1)
    assert cache.lengths.tolist() == [9, 6, 11] and len(cache) == 11
    for b, n in enumerate(lengths.tolist()):
        want_first, want_steps = alone(m, prompts[b, :n], steps[b])
        torch.testing.assert_close(first[b, :n], want_first, rtol=0, atol=F64)
        torch.testing.assert_close(outs[b], want_steps, rtol=0, atol=F64)


@pytest.mark.parametrize("kind", ["ragged", "paged"])
def test_rows_added_by_the_first_write_and_chunked_steps(kind):
    m = make()
    torch.manual_seed(2)
    x = torch.randn(2, 9, D_MODEL, dtype=torch.float64)
    cache = new_cache(kind)  # no lengths: the first write brings both rows, every token real
    with torch.no_grad():
        got = torch.cat([m(x[:, a:b], cache=cache) for a, b in ((0, 3), (3, 4), (4, 9))], 1)
        full = m(x)
    torch.testing.assert_close(got, full, rtol=0, atol=F64)


# ---------------------------------------------------------------- against flash-attn's semantics
@pytest.mark.parametrize("kind", ["ragged", "paged"])
@pytest.mark.parametrize("rope", [False, True])
def test_batch_equals_the_kvcache_reference(kind, rope):
    m = make(2, rope=rope)
    torch.manual_seed(3)
    lengths = [3, 6, 1]
    P = max(lengths)
    x = torch.randn(3, P, D_MODEL, dtype=torch.float64)
    cache = new_cache(kind, lengths=torch.tensor(lengths), block_size=4)
    with torch.no_grad():
        m(x, cache=cache)
    # the reference's cache holds the same prompts (written by the reference itself, row by row)
    Hkv, D = 2, D_MODEL // HEADS
    k_ref = torch.zeros(3, 24, Hkv, D, dtype=torch.float64)
    v_ref = torch.zeros_like(k_ref)
    with torch.no_grad():
        q, k, v = project(m, x)
        for b, n in enumerate(lengths):
            kvcache_reference(q[b:b + 1, :n], k[b:b + 1, :n], v[b:b + 1, :n], k_ref[b:b + 1], v_ref[b:b + 1],
                              [0], rotary=rope)
        seqlens = list(lengths)
        for step in range(3):
            xs = torch.randn(3, 1 + step, D_MODEL, dtype=torch.float64)  # 1, 2 then 3 new tokens per row
            got = m(xs, cache=cache)
            q, k, v = project(m, xs)
            if kind == "paged":  # the same logical rows, read through the cache's own block table
                table = cache.block_table
                S = cache.block_size
                pool_k = torch.zeros(cache.num_blocks, S, Hkv, D, dtype=torch.float64)
                pool_v = torch.zeros_like(pool_k)
                for b in range(3):
                    for t in range(seqlens[b]):
                        blk = int(table[b, t // S])
                        pool_k[blk, t % S], pool_v[blk, t % S] = k_ref[b, t], v_ref[b, t]
                want = kvcache_reference(q, k, v, pool_k, pool_v, seqlens, block_table=table, rotary=rope)
                for b in range(3):  # keep the dense reference cache in step
                    kvcache_reference(q[b:b + 1], k[b:b + 1], v[b:b + 1], k_ref[b:b + 1], v_ref[b:b + 1],
                                      [seqlens[b]], rotary=rope)
            else:
                want = kvcache_reference(q, k, v, k_ref, v_ref, seqlens, rotary=rope)
            torch.testing.assert_close(got, finish(m, want), rtol=0, atol=F64)
            seqlens = [s + 1 + step for s in seqlens]
            assert cache.lengths.tolist() == seqlens


@pytest.mark.parametrize("kind", ["ragged", "paged"])
def test_batch_index_routes_rows_like_cache_batch_idx(kind):
    """cache.use(idx): the call's row b writes and reads cache row idx[b]; other rows untouched."""
    m = make(2, rope=True)
    torch.manual_seed(4)
    lengths = [4, 2, 5]
    x = torch.randn(3, 5, D_MODEL, dtype=torch.float64)
    cache = new_cache(kind, lengths=torch.tensor(lengths))
    Hkv, D = 2, D_MODEL // HEADS
    k_ref = torch.zeros(3, 24, Hkv, D, dtype=torch.float64)
    v_ref = torch.zeros_like(k_ref)
    with torch.no_grad():
        m(x, cache=cache)
        q, k, v = project(m, x)
        for b, n in enumerate(lengths):
            kvcache_reference(q[b:b + 1, :n], k[b:b + 1, :n], v[b:b + 1, :n], k_ref[b:b + 1], v_ref[b:b + 1],
                              [0], rotary=True)
        idx = torch.tensor([2, 0])
        xs = torch.randn(2, 1, D_MODEL, dtype=torch.float64)
        got = m(xs, cache=cache.use(idx))
        q, k, v = project(m, xs)
        want = kvcache_reference(q, k, v, k_ref, v_ref, [lengths[2], lengths[0]], cache_batch_idx=idx, rotary=True)
    torch.testing.assert_close(got, finish(m, want), rtol=0, atol=F64)
    assert cache.lengths.tolist() == [5, 2, 6]
    # a new sequence joins: add() a row, prefill it alone, then decode all three rows again together
    with torch.no_grad():
        new = cache.add(torch.tensor([3]))
        p = torch.randn(1, 3, D_MODEL, dtype=torch.float64)
        m(p, cache=cache.use(new))
        cache.use(torch.tensor([0, 2, 3]))
        y = m(torch.randn(3, 1, D_MODEL, dtype=torch.float64), cache=cache)
    assert cache.lengths.tolist() == [6, 2, 7, 4] and y.shape == (3, 1, D_MODEL)


# ---------------------------------------------------------------- finishing early, blocks reused
def test_paged_blocks_are_freed_and_reused_and_rows_stay_exact():
    m = make(2, rope=True)
    torch.manual_seed(5)
    lengths = torch.tensor([4, 8, 4])
    prompts = torch.randn(3, 8, D_MODEL, dtype=torch.float64)
    steps = torch.randn(3, 8, D_MODEL, dtype=torch.float64)
    # 3 rows of up to 16 tokens would need 12 blocks of 4; the pool has 7, enough once row 1 leaves
    cache = mh.PagedKVCache(16, block_size=4, num_blocks=7, lengths=lengths)
    outs = {0: [], 2: []}
    with torch.no_grad():
        m(prompts, cache=cache)
        assert cache.free_blocks == 7 - 4
        for t in range(2):
            y = m(steps[:, t:t + 1], cache=cache)
            outs[0].append(y[0, 0]), outs[2].append(y[2, 0])
        held = set(cache.block_table[1].tolist()) - {-1}
        cache.select(torch.tensor([0, 2]))  # row 1 finished: its blocks are free again
        assert cache.free_blocks == 7 - 4
        reused = set()
        for t in range(2, 8):
            y = m(steps[[0, 2], t:t + 1], cache=cache)
            outs[0].append(y[0, 0]), outs[2].append(y[1, 0])
            reused |= set(cache.block_table.flatten().tolist()) & held
        assert reused, "the rows that grew took none of the freed blocks"
        before = cache.block_table
        with pytest.raises(ValueError, match="needs 2 more blocks for this write but 1 are free"):
            m(steps[[0, 2], :3], cache=cache)  # both rows cross a block boundary; the pool has one left
        assert torch.equal(cache.block_table, before) and cache.lengths.tolist() == [12, 12]
    for b in (0, 2):
        _, want = alone(m, prompts[b, : int(lengths[b])], steps[b])
        torch.testing.assert_close(torch.stack(outs[b]), want, rtol=0, atol=F64)


@pytest.mark.parametrize("kind", ["ragged", "paged"])
def test_reorder_duplicates_and_crop(kind):
    """Beam search: a duplicated row continues as its source; crop keeps a prefix of every row."""
    m = make(2)
    torch.manual_seed(6)
    x = torch.randn(2, 6, D_MODEL, dtype=torch.float64)
    cache = new_cache(kind, lengths=torch.tensor([6, 3]))
    with torch.no_grad():
        m(x, cache=cache)
        cache.reorder(torch.tensor([1, 1]))
        s = torch.randn(1, 1, D_MODEL, dtype=torch.float64).expand(2, 1, D_MODEL)
        y = m(s, cache=cache)
        want = alone(m, x[1, :3], s[0])[1]
        torch.testing.assert_close(y[:, 0], want.expand(2, -1), rtol=0, atol=F64)
        cache.crop(2)
        assert cache.lengths.tolist() == [2, 2]
        y = m(s, cache=cache)
        torch.testing.assert_close(y[0, 0], alone(m, x[1, :2], s[0])[1][0], rtol=0, atol=F64)


def test_paged_memory_follows_the_tokens_held():
    cache = mh.PagedKVCache(1024, block_size=16, num_blocks=8)
    dense = mh.RaggedKVCache(1024)
    k = torch.zeros(4, 2, 3, 8)
    with torch.no_grad():
        cache.append(k, k)
        dense.append(k, k)
    assert cache.nbytes == 2 * 8 * 2 * 16 * 8 * 4 and dense.nbytes == 2 * 4 * 2 * 1024 * 8 * 4
    assert cache.free_blocks == 4


# ---------------------------------------------------------------- bad input, before any work
def test_bad_lengths_batch_index_and_block_tables():
    with pytest.raises(TypeError, match="lengths"):
        mh.RaggedKVCache(8, lengths=torch.tensor([2.0, 3.0]))
    with pytest.raises(ValueError, match="lengths"):
        mh.RaggedKVCache(8, lengths=torch.tensor([[2, 3]]))
    with pytest.raises(ValueError, match=r"lengths\[1\] = 9.*max_len"):
        mh.PagedKVCache(8, block_size=4, num_blocks=4, lengths=torch.tensor([2, 9]))
    with pytest.raises(ValueError, match="at least 1"):
        mh.RaggedKVCache(8, lengths=torch.tensor([0]))
    m = make(2)
    cache = mh.PagedKVCache(8, block_size=2, num_blocks=8, lengths=torch.tensor([3, 2]))
    with torch.no_grad():
        with pytest.raises(ValueError, match="B=3"):
            m(torch.randn(3, 3, D_MODEL, dtype=torch.float64), cache=cache)
        with pytest.raises(ValueError, match="prompt has 3 tokens"):
            m(torch.randn(2, 2, D_MODEL, dtype=torch.float64), cache=cache)
        m(torch.randn(2, 3, D_MODEL, dtype=torch.float64), cache=cache)
        with pytest.raises(ValueError, match="max_len=8"):
            m(torch.randn(2, 6, D_MODEL, dtype=torch.float64), cache=cache)
    assert cache.lengths.tolist() == [3, 2]  # the refused writes changed nothing
    fresh = mh.PagedKVCache(4, block_size=2, num_blocks=8)
    with torch.no_grad(), pytest.raises(ValueError, match="max_len=4"):
        m(torch.randn(2, 5, D_MODEL, dtype=torch.float64), cache=fresh)
    assert fresh.num_rows == 0 and fresh.free_blocks == 8  # a refused first write brought no rows
    with pytest.raises(ValueError, match="twice"):
        cache.use(torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="batch_index"):
        cache.use(torch.tensor([2]))
    table = cache.block_table
    freed = cache.block_table.clone()
    free = sorted(set(range(8)) - set(table.flatten().tolist()))
    freed[1, 0] = free[0]
    with pytest.raises(ValueError, match=r"block_table\[1, 0\].*free block"):
        cache.set_block_table(freed)
    out_of_range = table.clone()
    out_of_range[0, 1] = 8
    with pytest.raises(ValueError, match=r"block_table\[0, 1\] = 8 is out of range"):
        cache.set_block_table(out_of_range)
    with pytest.raises(ValueError, match="shape"):
        cache.set_block_table(table[:1])
    with pytest.raises(TypeError, match="block_table"):
        cache.set_block_table(table.float())
    assert torch.equal(cache.block_table, table)
    swapped = table[[1, 0]]  # rows exchange blocks: refused (row 0 needs 2 blocks, row 1 has 1)
    with pytest.raises(ValueError, match="needs only|out of range"):
        cache.set_block_table(swapped)


def test_set_block_table_exchanges_rows_blocks():
    """Two rows exchange their blocks: each then continues the other's sequence."""
    m = make(2, rope=False)
    torch.manual_seed(7)
    x = torch.randn(2, 4, D_MODEL, dtype=torch.float64)
    cache = mh.PagedKVCache(8, block_size=2, num_blocks=6, lengths=torch.tensor([4, 4]))
    with torch.no_grad():
        m(x, cache=cache)
        cache.set_block_table(cache.block_table[[1, 0]])
        s = torch.randn(2, 1, D_MODEL, dtype=torch.float64)
        y = m(s, cache=cache)
    for b in range(2):
        torch.testing.assert_close(y[b, 0], alone(m, x[1 - b], s[b])[1][0], rtol=0, atol=F64)


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("kind", ["ragged", "paged"])
def test_one_cache_per_layer_in_both_grad_modes(kind, grad_mode):
    """KVCaches of ragged/paged caches: two layers, crop and select applied to both; each row of
    the stack equals that sequence through the two layers alone."""
    torch.manual_seed(8)
    blocks = [make(2, seed=s) for s in (0, 1)]
    lengths = torch.tensor([4, 2])
    extra = {"block_size": 2, "num_blocks": 16} if kind == "paged" else {}
    cls = mh.PagedKVCache if kind == "paged" else mh.RaggedKVCache
    caches = cls.layers(2, 16, lengths=lengths, **extra)
    x = torch.randn(2, 4, D_MODEL, dtype=torch.float64)
    s = torch.randn(2, 1, D_MODEL, dtype=torch.float64)

    def stack(h, cs):
        for block, c in zip(blocks, cs):
            h = block(h, cache=c)
        return h

    with grad_mode():
        stack(x, caches)
        y = stack(s, caches)
        for b, n in enumerate(lengths.tolist()):
            alone_caches = mh.KVCache.layers(2, 16)
            stack(x[b:b + 1, :n], alone_caches)
            torch.testing.assert_close(y[b], stack(s[b:b + 1], alone_caches)[0], rtol=0, atol=F64)
        caches.select(torch.tensor([1]))
        assert [c.lengths.tolist() for c in caches] == [[3], [3]]
    with pytest.raises(TypeError, match="lengths="):
        cls.layers(2, 16, keep=torch.ones(1, 2, dtype=torch.bool), **extra)
