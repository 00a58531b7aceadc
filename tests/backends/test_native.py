"""The native tile kernel (issue 22) against the torch tiles, its oracle, and the float64 truth.

Every mask kind the native kernel reads (the structural kinds in both alignments, windows with
sinks, documents with their own key ids, chunked_local, key padding, ALiBi per document, softcap,
sinks, bias tensors with broadcasting), with grouped heads, Lq != Lk and tiles of a few queries
and keys (tails everywhere), is computed by the native kernel in float32 and bfloat16 and held to
the oracle's rule (:func:`oracle.judge`): its error against the torch tiles in float64 at most
twice the torch tiles' own error from the same inputs, plus the floor. The tests also check that
the native kernel really ran (its plan), the same bits at 1, 3 and 8 threads, inputs read through
their strides, NaN as SDPA propagates it, 64-bit indexing, and the build's cache and fallback.
``make sanitize`` runs this file against an AddressSanitizer/UBSan build of the kernel.

Legend: B batch, H query heads, Hkv kv heads, Lq/Lk lengths, D head dim, Dv value dim.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import multihead
from multihead import masks
from multihead.backends import tiles as _tiles, chunked, native
from multihead.backends.chunked import chunked_attention
from native_cases import B, D, DV, H, HKV, KINDS, build_mask, inputs as _inputs
from oracle import judge, naive_attention, score_size, tile_kernel_as, torch_threads

pytestmark = pytest.mark.skipif(native.module() is None, reason=f"no native kernel here: {native.status()}")


def _run(which, q, k, v, mask, grad, blocks=(5, 7)):
    """(out, {q, k, v grads}) by the chunked backend with the ``which`` tile kernel."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    with tile_kernel_as(which):
        out = chunked_attention(*leaves, mask, block_q=blocks[0], block_k=blocks[1])
    grads = torch.autograd.grad(out, leaves, grad.to(out.dtype))
    return out.detach(), dict(zip("qkv", grads))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lq,lk", [(23, 23), (17, 30), (30, 19)])
@pytest.mark.parametrize("kind", KINDS)
def test_native_matches_the_torch_tiles_within_the_rule(kind, lq, lk, dtype):
    """Output and gradients (the native backward, from the native forward's out and lse) within the
    rule against the torch tiles run in float64; the native kernel runs both (not a fallback)."""
    q, k, v, g = _inputs(dtype, lq, lk)
    mask = build_mask(kind, lq, lk, g)
    grad = torch.randn(B, H, lq, DV, generator=g)
    rest, biases = masks.split_additive(masks.as_mask(mask), (B, H, lq, lk))
    plan, why = _tiles.Tiles(q, k, v, rest, biases, masks.as_mask(mask).score_mods if mask is not None else (),
                             scale=D ** -0.5, block_q=5, block_k=7, mask_shape=(B, H, lq, lk)).native_plan
    assert plan is not None, why
    bias = None if mask is None else masks.as_mask(mask).materialize((B, H, lq, lk), device=q.device,
                                                                     dtype=torch.float64).bias
    added = 0.0 if bias is None else bias.abs().max().item()  # ALiBi and bias tensors, for the floor
    exact = _run("torch tiles", q.double(), k.double(), v.double(), mask, grad)
    same = _run("torch tiles", q, k, v, mask, grad)
    before = native.CALLS["backward"]
    got = _run("native", q, k, v, mask, grad)
    assert got[0].dtype == dtype and native.CALLS["backward"] == before + 1
    for name in ("out", "q", "k", "v"):
        pick = (lambda r: r[0]) if name == "out" else (lambda r, n=name: r[1][n])
        verdict = judge(f"native {kind} {name}", pick(got), pick(exact), lambda dt: pick(same), dtype, head_dim=D,
                        score_size=score_size(q, k, None, None, D ** -0.5) + added)
        assert verdict.ok, str(verdict)


def _grads_with_tensors(which, q, k, v, bias, sink, grad, mask):
    """(out, {q, k, v, bias, sink grads}) by chunked with the ``which`` tile kernel; ``mask(bias,
    sink)`` builds the mask from leaves of the bias tensor and the sink logits (in q's compute
    dtype for float64 inputs)."""
    wide = q.dtype == torch.float64
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    extra = [t.detach().clone().to(torch.float64 if wide else torch.float32).requires_grad_(True) for t in (bias, sink)]
    with tile_kernel_as(which):
        out = chunked_attention(*leaves, mask(*extra), block_q=5, block_k=7)
    grads = torch.autograd.grad(out, leaves + extra, grad.to(out.dtype))
    return out.detach(), dict(zip(("q", "k", "v", "bias", "sink"), grads))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(B, H, 17, 30), (1, H, 1, 30), (B, 1, 17, 1), (1, 1, 17, 30), (B, 1, 1, 30)])
def test_native_backward_gives_bias_and_sink_gradients_within_the_rule(shape, dtype):
    """The native backward (it runs: ``native.CALLS``) forms dq, dk, dv, the bias tensor's gradient
    (full, or broadcast over the batch, the heads, the queries or the keys) and the sink logits'
    within the rule against the torch tiles in float64, under a window with sinks, ALiBi, softcap
    and grouped heads, Lq != Lk."""
    lq, lk = 17, 30
    q, k, v, g = _inputs(dtype, lq, lk, seed=4)
    bias, sink = torch.randn(shape, generator=g), torch.randn(H, generator=g)
    grad = torch.randn(B, H, lq, DV, generator=g)
    slopes = masks.alibi_slopes(H)

    def mask(b, z):
        return masks.window(9, 2, sinks=1) & masks.bias(b) & masks.alibi(slopes) & masks.softcap(5.0) & masks.sink(z)

    exact = _grads_with_tensors("torch tiles", q.double(), k.double(), v.double(), bias, sink, grad, mask)
    same = _grads_with_tensors("torch tiles", q, k, v, bias, sink, grad, mask)
    before = native.CALLS["backward"]
    got = _grads_with_tensors("native", q, k, v, bias, sink, grad, mask)
    assert native.CALLS["backward"] == before + 1
    size = score_size(q, k, None, None, D ** -0.5) + bias.abs().max().item() + float(slopes.max()) * max(lq, lk)
    for name in ("q", "k", "v", "bias", "sink"):
        verdict = judge(f"native grad {name}", got[1][name], exact[1][name], lambda dt, n=name: same[1][n], dtype,
                        head_dim=D, score_size=size)
        assert verdict.ok, str(verdict)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_backward_with_the_default_blocks_within_the_rule(dtype):
    """chunked's default blocks give the backward tiles of its own (_tiles.NATIVE_BACKWARD_BLOCKS):
    gradients within the rule against the torch tiles in float64, at L past a few of its tiles."""
    q, k, v, g = _inputs(dtype, 300, 330)
    grad = torch.randn(B, H, 300, DV, generator=g)
    mask = masks.causal() & masks.alibi(masks.alibi_slopes(H))
    exact = _run("torch tiles", q.double(), k.double(), v.double(), mask, grad, blocks=(None, None))
    same = _run("torch tiles", q, k, v, mask, grad, blocks=(None, None))
    before = native.CALLS["backward"]
    got = _run("native", q, k, v, mask, grad, blocks=(None, None))
    assert native.CALLS["backward"] == before + 1
    size = score_size(q, k, None, None, D ** -0.5) + float(masks.alibi_slopes(H).max()) * 330
    for name in "qkv":
        verdict = judge(f"native default blocks grad {name}", got[1][name], exact[1][name],
                        lambda dt, n=name: same[1][n], dtype, head_dim=D, score_size=size)
        assert verdict.ok, str(verdict)


@pytest.mark.parametrize("which,bias_grad", [("native", False), ("native", True), ("torch tiles", False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_are_the_same_bits_at_every_thread_count(which, bias_grad, dtype):
    """Issue 22: dq, dk, dv (and, natively, a bias gradient broadcast over the batch and heads) are
    the same bits at 1, 2, 3 and 8 threads: every sum is owned by one work item (native: dQ in
    lanes of key blocks, or with a bias gradient in a query pass of its own) or one of a fixed
    number of lanes (torch tiles; they used to add per-thread partial sums of dK, dV, and their
    forward redid the rows of whole panels, whose size followed the thread count)."""
    q, k, v, g = _inputs(dtype, 300, 260)
    grad = torch.randn(B, H, 300, DV, generator=g).to(dtype)
    bias = torch.randn(1, 1, 300, 260, generator=g)
    results = []
    for threads in (1, 2, 3, 8):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        b = bias.clone().requires_grad_(bias_grad)
        # ALiBi under a causal mask makes the torch tiles' forward redo panels (scores far above a
        # row's first tiles), which once redid the rows of whole panels, merged by thread count
        mask = masks.causal() & masks.bias(b) & masks.alibi(masks.alibi_slopes(H))
        with torch_threads(threads), tile_kernel_as(which):
            out = chunked_attention(*leaves, mask, block_q=32, block_k=48)
            results.append(torch.autograd.grad(out, leaves + ([b] if bias_grad else []), grad))
    for got in results[1:]:
        for name, x, y in zip("qkvb", got, results[0]):
            assert torch.equal(x, y), f"d{name} differs between thread counts"


def test_backward_nan_reaches_the_gradients_sdpa_makes_nan():
    """A NaN query: the native backward's NaN gradients are where the torch tiles' are (its row of
    dq, the dk and dv of the keys that row sees), and SDPA's backward makes them NaN too; every
    other gradient is SDPA's value."""
    q, k, v, g = _inputs(torch.float32, 20, 20)
    q[0, 1, 4, 3] = float("nan")
    grad = torch.randn(B, H, 20, DV, generator=g)
    got = _run("native", q, k, v, masks.causal(), grad, blocks=(4, 6))[1]
    tiles = _run("torch tiles", q, k, v, masks.causal(), grad, blocks=(4, 6))[1]
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(leaves[0], *(t.repeat_interleave(H // HKV, 1) for t in leaves[1:]),
                                         is_causal=True)
    want = dict(zip("qkv", torch.autograd.grad(out, leaves, grad)))
    for name in "qkv":
        nan = got[name].isnan()
        assert nan.any() and torch.equal(nan, tiles[name].isnan()) and want[name][nan].isnan().all()
        fine = ~want[name].isnan()
        assert (got[name][fine] - want[name][fine]).abs().max() < 1e-5


def test_float64_keeps_the_torch_tiles_and_passes_gradcheck():
    """float64 inputs run the torch tiles forward and backward (the native kernel takes float32,
    bfloat16, float16): gradcheck through them, and ``native.CALLS`` does not move."""
    g = torch.Generator().manual_seed(9)
    q = torch.randn(1, 2, 6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 7, 4, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 7, 3, generator=g, dtype=torch.float64, requires_grad=True)
    before = dict(native.CALLS)
    with tile_kernel_as("native"):
        assert torch.autograd.gradcheck(lambda *t: chunked_attention(*t, masks.causal("top_left"), block_q=2,
                                                                     block_k=3), (q, k, v))
    assert dict(native.CALLS) == before


def test_explain_dispatch_names_the_backward_kernel(monkeypatch):
    """The backward runs natively, or on the torch tiles where a bias broadcast over both the
    queries and the keys needs a gradient, and explain_dispatch and the trace say which."""
    monkeypatch.setattr(chunked, "AUTO_MIN_SCORES", 0)
    q, k, v, _ = _inputs(torch.float32, 8, 8)
    with tile_kernel_as("native"):
        assert "backward: native kernel" in multihead.explain_dispatch(q, k, v, masks.causal() & masks.softcap(5.0)).how
        scalar = torch.zeros(1, H, 1, 1, requires_grad=True)
        how = multihead.explain_dispatch(q, k, v, masks.causal() & masks.bias(scalar)).how
        assert "backward: torch tiles (a bias broadcast over the queries and the keys" in how
        before = native.CALLS["backward"]
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = chunked_attention(*leaves, masks.causal() & masks.bias(scalar))
        out.sum().backward()
        assert native.CALLS["backward"] == before and scalar.grad is not None
        for mask, kernel in ((masks.causal(), "native"), (masks.causal() & masks.bias(scalar), "torch tiles")):
            with multihead.trace() as t:
                multihead.attention(*leaves, mask, backend="chunked")
            assert t.steps[0].params["backward_kernel"] == kernel
            assert f"backward by the {kernel} kernel" in t.steps[0].note
        with multihead.trace() as t, torch.no_grad():
            multihead.attention(q, k, v, masks.causal(), backend="chunked")
        assert t.steps[0].params["backward_kernel"] is None and "backward" not in t.steps[0].note


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["causal", "window", "documents"])
def test_partly_seen_tiles_by_panels_within_the_rule(kind, dtype):
    """Tiles of 256 x 256 that rows see in part (the diagonal's, a window's edges, documents') are
    computed by panels of rows over the keys the panel sees; with a value dim past one packed chunk
    (80 > 64) and tails, the output stays within the rule against the torch tiles in float64."""
    lq, dh, dv = 300, 96, 80
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 2, lq, dh, generator=g).to(dtype)
    k = torch.randn(1, 2, lq, dh, generator=g).to(dtype)
    v = torch.randn(1, 2, lq, dv, generator=g).to(dtype)
    ids = torch.cat([torch.zeros(70), torch.ones(150), torch.full((80,), 2)]).long()[None]
    mask = {"causal": masks.causal(), "window": masks.window(100),
            "documents": masks.documents(ids, ids) & masks.causal()}[kind]
    with tile_kernel_as("native"):
        got = chunked_attention(q, k, v, mask, block_q=256, block_k=256)
    with tile_kernel_as("torch tiles"):
        exact = chunked_attention(q.double(), k.double(), v.double(), mask, block_q=256, block_k=256)
        same = chunked_attention(q, k, v, mask, block_q=256, block_k=256)
    verdict = judge(f"native panels {kind}", got, exact, lambda dt: same, dtype, head_dim=dh,
                    score_size=score_size(q, k, None, None, dh ** -0.5))
    assert verdict.ok, str(verdict)


def test_bf16_causal_passes_the_float32_scores_rule():
    """Issue 22 item 5 on the native kernel: bfloat16 inputs x4, causal, against float64 within 2x
    the float32-scores reference (which bfloat16-rounded products fail, test_numerics)."""
    L, Dh = 256, 64
    g = torch.Generator().manual_seed(22)
    q, k, v = ((4 * torch.randn(1, 2, L, Dh, generator=g)).bfloat16() for _ in range(3))
    keep = torch.ones(L, L, dtype=torch.bool).tril().expand(1, 2, L, L)
    with tile_kernel_as("native"):
        out = multihead.attention(q, k, v, masks.causal(), backend="chunked")
    want = naive_attention(q, k, v, keep, None, Dh ** -0.5, torch.float64)
    verdict = judge("native bf16", out, want, lambda dt: naive_attention(q, k, v, keep, None, Dh ** -0.5, dt),
                    torch.bfloat16, head_dim=Dh, score_size=score_size(q, k, keep, None, Dh ** -0.5))
    assert verdict.ok, str(verdict)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_bits_at_every_thread_count(dtype):
    """Each output row is one thread's, in a fixed key order: 1, 3 and 8 threads give the same bits."""
    q, k, v, g = _inputs(dtype, 300, 300)
    mask = masks.causal() & masks.alibi(masks.alibi_slopes(H))
    results = []
    for threads in (1, 3, 8):
        with torch_threads(threads), tile_kernel_as("native"):
            results.append(chunked_attention(q, k, v, mask, block_q=32, block_k=48, return_lse=True))
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])


@pytest.mark.parametrize("threads", [2, 3])
def test_the_work_is_shared_by_the_threads(threads):
    """The kernel's at::parallel_for runs on every thread torch is set to: ATen's parallel_for is a
    header template, serial in code compiled without OpenMP (the kernel once ran on one thread at
    any thread count)."""
    with torch_threads(threads):
        assert native.module().parallel_threads(64) == threads


def test_inputs_are_read_through_their_strides():
    """Transposed (B, L, H, D) views, a kv head broadcast by a zero stride and a sliced last axis
    give the bits of the same values laid out contiguously."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, 40, H, 2 * D, generator=g).transpose(1, 2)[..., ::2]  # last-axis stride 2
    k = torch.randn(B, 1, 40, D, generator=g).expand(B, HKV, 40, D)  # overlapping: stride 0 on heads
    v = torch.randn(B, 40, HKV, DV, generator=g).transpose(1, 2)
    assert not q.is_contiguous() and k.stride(1) == 0 and not v.is_contiguous()
    with tile_kernel_as("native"):
        got = chunked_attention(q, k, v, masks.causal(), block_q=8, block_k=16)
        want = chunked_attention(q.contiguous(), k.contiguous(), v.contiguous(), masks.causal(), block_q=8, block_k=16)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_read_the_inputs_and_the_output_gradient_through_their_strides(dtype):
    """The backward reads q, k and dO in place where their layout is already the products' (unit
    last-axis stride, rows D apart, D a multiple of 16) and packs copies otherwise: transposed
    (B, L, H, D) views, a kv head broadcast by a zero stride and a transposed output gradient give
    the bits of the same values laid out contiguously."""
    g = torch.Generator().manual_seed(5)
    d = 16
    q = torch.randn(B, 40, H, d, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(B, 1, 40, d, generator=g).to(dtype).expand(B, HKV, 40, d)
    v = torch.randn(B, 40, HKV, d, generator=g).to(dtype).transpose(1, 2)
    grad = torch.randn(B, 40, H, d, generator=g).to(dtype).transpose(1, 2)
    assert q.stride(2) != d and k.stride(1) == 0 and grad.stride(2) != d

    def grads(q, k, v, grad):
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        with tile_kernel_as("native"):
            out = chunked_attention(*leaves, masks.causal(), block_q=8, block_k=16)
        return torch.autograd.grad(out, leaves, grad)

    before = native.CALLS["backward"]
    got = grads(q, k, v, grad)
    want = grads(q.contiguous(), k.contiguous(), v.contiguous(), grad.contiguous())
    assert native.CALLS["backward"] == before + 2
    for name, x, y in zip("qkv", got, want):
        assert torch.equal(x, y), f"d{name} differs between strided and contiguous inputs"


def test_nan_propagates_to_the_rows_that_read_it_as_in_sdpa():
    """A NaN query gives a NaN output row, a NaN key every row that sees it, and only those (SDPA
    makes these NaN too, and more: every row of its blocks that meet the key); every other row is
    SDPA's value."""
    q, k, v, _ = _inputs(torch.float32, 20, 20)
    q[0, 1, 4, 3] = float("nan")
    k[1, 0, 9, 0] = float("nan")
    with tile_kernel_as("native"):
        got = chunked_attention(q, k, v, masks.causal(), block_q=4, block_k=6)
    kk, vv = (t.repeat_interleave(H // HKV, 1) for t in (k, v))
    want = F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
    reads = torch.zeros(B, H, 20, dtype=torch.bool)
    reads[0, 1, 4] = True  # the NaN query
    reads[1, :H // HKV, 9:] = True  # the rows of kv head 0 that see key 9 (causal)
    assert torch.equal(got.isnan().any(-1), reads) and got[reads].isnan().all()
    assert want.isnan().any(-1)[reads].all()
    fine = ~want.isnan()
    assert (got[fine] - want[fine]).abs().max() < 1e-5


def test_lengths_past_2_to_the_31_scores_use_64_bit_indices():
    """Lq·Lk = 2^32 (a window keeps it cheap): the native kernel equals the torch tiles."""
    L = 65536
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 1, L, 4, generator=g) for _ in range(3))
    mask = masks.window(3)
    with tile_kernel_as("native"):
        got = chunked_attention(q, k, v, mask)
    with tile_kernel_as("torch tiles"):
        want = chunked_attention(q, k, v, mask)
    assert (got - want).abs().max() < 1e-5


def test_mixed_dtypes_are_refused_by_name():
    q = torch.randn(1, 1, 4, 4)
    with pytest.raises((TypeError, ValueError), match="dtype"):
        chunked_attention(q, q.bfloat16(), q)


def test_the_cache_key_follows_the_cpu_and_an_incomplete_build_is_never_loaded(monkeypatch, tmp_path):
    """Another CPU's flags give another cache directory; a directory without its ``complete``
    marker (an interrupted build) is rebuilt, never imported."""
    key = native._key()
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert native._key() != key
    monkeypatch.undo()
    calls = []
    monkeypatch.setenv("MULTIHEAD_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "_build", lambda final, name: calls.append(("build", final)) or "built")
    monkeypatch.setattr(native, "_import", lambda path, name: calls.append(("import", path)) or "imported")
    final = tmp_path / native._key()
    final.mkdir()
    (final / f"multihead_native_{native._key()}.so").write_bytes(b"half-written")
    native._module.cache_clear()
    try:
        assert native.module() == "built" and calls[-1][0] == "build"
        (final / "complete").write_text("done\n")
        native._module.cache_clear()
        assert native.module() == "imported" and calls[-1][0] == "import"
    finally:
        native._module.cache_clear()


def test_without_the_kernel_chunked_runs_the_torch_tiles_and_warns_once(monkeypatch):
    """A failed build: the torch tiles give the result, one warning names the cause and the fix."""
    monkeypatch.setattr(native, "module", lambda: None)
    monkeypatch.setattr(native, "_FAILED", "no C++ compiler ('c++' is not on PATH); install one")
    monkeypatch.setattr(native, "_WARNED", False)
    q, k, v, _ = _inputs(torch.float32, 12, 12)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tile_kernel_as("native"):
            got = chunked_attention(q, k, v, masks.causal())
            chunked_attention(q, k, v, masks.causal())
    messages = [str(w.message) for w in caught if "torch tiles" in str(w.message)]
    assert len(messages) == 1 and "compiler" in messages[0] and "install" in messages[0]
    with tile_kernel_as("torch tiles"):
        assert torch.equal(got, chunked_attention(q, k, v, masks.causal()))
    monkeypatch.setattr(chunked, "AUTO_MIN_SCORES", 0)  # auto runs chunked for this call
    how = multihead.explain_dispatch(q, k, v, masks.causal() & masks.softcap(5.0)).how
    assert "torch tiles" in how and "compiler" in how


def test_explain_dispatch_names_the_kernel_and_the_cpu_features(monkeypatch):
    monkeypatch.setattr(chunked, "AUTO_MIN_SCORES", 0)  # auto runs chunked for these calls
    q, k, v, _ = _inputs(torch.bfloat16, 8, 8)
    with tile_kernel_as("native"):
        how = multihead.explain_dispatch(q, k, v, masks.causal() & masks.softcap(5.0)).how
        assert "native kernel" in how and "brgemm" in how
        how = multihead.explain_dispatch(q, k, v, masks.causal() & masks.score_mod(lambda s, b, h, i, j: s)).how
        assert "torch tiles (a score_mod part" in how
    with tile_kernel_as("torch tiles"):
        assert "switched off" in multihead.explain_dispatch(q, k, v, masks.causal() & masks.softcap(5.0)).how


def test_auto_runs_masks_sdpa_would_densify_on_the_native_kernel(monkeypatch):
    """Issue 22 item 6, the measured rule (sdpa.NATIVE_FIRST; figures in docs/benchmarks.md): a
    window at L=4096 goes to chunked where its native kernel runs (SDPA would need a dense mask),
    to sdpa with the native kernel off; plain causal in float32 with gradients stays on SDPA's
    is_causal kernel (plain causal's own rule: the next test)."""
    q = torch.randn(1, 2, 4096, 8)
    d = multihead.explain_dispatch(q, q, q, masks.window(512))
    assert d.backend == "chunked" and "native kernel" in d.refused["sdpa"]
    g = q.clone().requires_grad_(True)
    assert multihead.explain_dispatch(g, g, g, masks.causal()).backend == "sdpa"
    with tile_kernel_as("torch tiles"):
        assert multihead.explain_dispatch(q, q, q, masks.window(512)).backend == "sdpa"
    monkeypatch.setattr(multihead.backends.sdpa, "NATIVE_FIRST", False)
    assert multihead.explain_dispatch(q, q, q, masks.window(512)).backend == "sdpa"


@pytest.mark.parametrize("dtype, grad, L, d, backend", [
    (torch.float32, False, 2048, 8, "chunked"), (torch.float32, False, 2047, 8, "sdpa"),
    (torch.float32, True, 4096, 8, "sdpa"), (torch.bfloat16, True, 2048, 8, "chunked"),
    (torch.bfloat16, True, 2047, 8, "sdpa"), (torch.bfloat16, False, 4096, 8, "sdpa"),
    (torch.bfloat16, False, 2048, 64, "chunked where AMX"), (torch.bfloat16, False, 2047, 64, "sdpa"),
    (torch.float16, False, 4096, 64, "sdpa"),
])
def test_auto_runs_plain_causal_on_the_native_kernel_where_it_was_measured_faster(monkeypatch, dtype, grad, L, d,
                                                                                  backend):
    """Issue 22 item 6 for plain causal (sdpa.PLAIN_CAUSAL_MIN_LENGTH; figures in docs/benchmarks.md):
    float32 inference, bfloat16 training and (where its forward runs on AMX tiles: head dims of 32k)
    bfloat16 inference from 2048 tokens go to the native kernel, the rest stays on SDPA's causal
    kernel; auto's output is then chunked's, bit for bit (the kernel's accuracy is held to the oracle
    by the tests above), and with the native kernel off or NATIVE_FIRST = False sdpa keeps every case."""
    if backend == "chunked where AMX":
        backend = "chunked" if native.amx_tiles() else "sdpa"
    q, k, v = (torch.randn(1, 2, L, d, dtype=dtype).requires_grad_(grad) for _ in range(3))
    d = multihead.explain_dispatch(q, k, v, masks.causal())
    assert d.backend == backend
    if backend == "chunked":
        assert "measured faster than SDPA's causal kernel" in d.refused["sdpa"]
        got = multihead.attention(q, k, v, masks.causal())
        assert torch.equal(got, multihead.attention(q, k, v, masks.causal(), backend="chunked"))
        with tile_kernel_as("torch tiles"):
            assert multihead.explain_dispatch(q, k, v, masks.causal()).backend == "sdpa"
        monkeypatch.setattr(multihead.backends.sdpa, "NATIVE_FIRST", False)
        assert multihead.explain_dispatch(q, k, v, masks.causal()).backend == "sdpa"
