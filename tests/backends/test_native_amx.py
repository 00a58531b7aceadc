"""The native kernel's bfloat16 forward on AMX tiles (``amx_forward.cpp``, issue 22) against the
torch tiles, its oracle, and against the native kernel's brgemm forward.

Every mask kind the native kernel reads (native_cases.KINDS), with grouped heads, Lq != Lk,
lengths that leave tails of a 16-row group and of a 64-key step, and blocks of 32 x 64 (several of
each) or chunked's defaults, is held to the oracle's rule (:func:`oracle.judge`): the error against
the torch tiles in float64 at most twice the torch tiles' own from the same bfloat16 inputs, plus
the floor. Also: the AMX forward really ran (``native.CALLS``); its reference maximum moving lazily
(scores rising along the row, scores past 2^22, ±inf and NaN as the brgemm forward gives them);
the same bits at 1, 3 and 8 threads; inputs through their strides; out written in bfloat16 being
the float32 out's own rounding; ATen's brgemm (SDPA, the native backward) right after it on the
same threads; shapes it does not take left to brgemm, and ``native.AMX`` switching it off.
``make sanitize`` runs this file against an AddressSanitizer/UBSan build.

Legend: B batch, H query heads, Hkv kv heads, Lq/Lk lengths, D head dim, Dv value dim.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from multihead import masks
from multihead.backends import native
from multihead.backends.chunked import chunked_attention
from native_cases import B, H, KINDS, build_mask, inputs
from oracle import judge, naive_attention, score_size, tile_kernel_as, torch_threads

pytestmark = pytest.mark.skipif(not native.amx_tiles(),
                                reason=f"no AMX forward here: {native.amx_forward_why_not(torch.bfloat16, 64, 64)}")

D, DV = 64, 32


@contextlib.contextmanager
def amx(on: bool):
    """The native kernel's bfloat16 forward on AMX tiles (on) or by brgemm (off) inside the block."""
    before = native.AMX
    native.AMX = on
    try:
        with tile_kernel_as("native"):
            yield
    finally:
        native.AMX = before


def _ran_amx(fn):
    """fn()'s result, and how many forwards ran on AMX tiles meanwhile."""
    before = native.CALLS["forward on AMX tiles"]
    result = fn()
    return result, native.CALLS["forward on AMX tiles"] - before


def _out_lse_grads(q, k, v, mask, grad, blocks):
    """(out, lse, {q, k, v grads}) by chunked (the tile kernel as the caller set it)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = chunked_attention(*leaves, mask, block_q=blocks[0], block_k=blocks[1], return_lse=True)
    grads = torch.autograd.grad(out, leaves, grad.to(out.dtype))
    return out.detach(), lse.detach(), dict(zip("qkv", grads))


@pytest.mark.parametrize("lq,lk", [(23, 23), (100, 77), (77, 150), (130, 300)])
@pytest.mark.parametrize("kind", KINDS)
def test_amx_forward_matches_the_torch_tiles_within_the_rule(kind, lq, lk):
    """out and lse of the AMX forward, and the gradients the native backward forms from them,
    within the rule against the torch tiles in float64; the AMX forward ran."""
    q, k, v, g = inputs(torch.bfloat16, lq, lk, d=D, dv=DV)
    mask = build_mask(kind, lq, lk, g)
    grad = torch.randn(B, H, lq, DV, generator=g)
    bias = None if mask is None else masks.as_mask(mask).materialize((B, H, lq, lk), device=q.device,
                                                                     dtype=torch.float64).bias
    added = 0.0 if bias is None else bias.abs().max().item()
    with tile_kernel_as("torch tiles"):
        exact = _out_lse_grads(q.double(), k.double(), v.double(), mask, grad, (32, 64))
        same = _out_lse_grads(q, k, v, mask, grad, (32, 64))
    with amx(True):
        got, ran = _ran_amx(lambda: _out_lse_grads(q, k, v, mask, grad, (32, 64)))
    assert ran == 1
    size = score_size(q, k, None, None, D ** -0.5) + added
    parts = {"out": lambda r: r[0], "lse": lambda r: r[1], **{n: (lambda r, n=n: r[2][n]) for n in "qkv"}}
    for name, pick in parts.items():
        want = pick(exact)
        seen = torch.isfinite(want) if name == "lse" else torch.ones_like(want, dtype=torch.bool)
        if name == "lse":  # rows with no visible key: -inf in both
            assert torch.equal(pick(got)[~seen], want[~seen].float())
        verdict = judge(f"AMX {kind} {name}", pick(got)[seen], want[seen], lambda dt: pick(same)[seen],
                        torch.bfloat16, head_dim=D, score_size=size)
        assert verdict.ok, str(verdict)


@pytest.mark.parametrize("kind", ["causal", "documents", "padding", "everything"])
def test_amx_forward_with_chunked_defaults_within_the_rule_and_beside_brgemm(kind):
    """chunked's default blocks (256 x 256) over a few of them, D = 128, Dv = 64: the AMX forward
    within the rule against the torch tiles in float64, and no further from it than twice the
    brgemm forward's error plus the floor (the same inputs, products and rounding of p)."""
    lq = lk = 600
    q, k, v, g = inputs(torch.bfloat16, lq, lk, seed=2, d=128, dv=64)
    mask = build_mask(kind, lq, lk, g)
    with tile_kernel_as("torch tiles"):
        exact = chunked_attention(q.double(), k.double(), v.double(), mask)
        same = chunked_attention(q, k, v, mask)
    with amx(True), torch.no_grad():
        got, ran = _ran_amx(lambda: chunked_attention(q, k, v, mask))
    with amx(False), torch.no_grad():
        brgemm, ran_off = _ran_amx(lambda: chunked_attention(q, k, v, mask))
    assert (ran, ran_off) == (1, 0)
    size = score_size(q, k, None, None, 128 ** -0.5)
    for name, naive in (("torch tiles", same), ("brgemm", brgemm)):
        verdict = judge(f"AMX {kind} vs {name}", got, exact, lambda dt, n=naive: n, torch.bfloat16, head_dim=128,
                        score_size=size)
        assert verdict.ok, str(verdict)


@pytest.mark.parametrize("d,dv", [(32, 16), (96, 48), (256, 80)])
def test_head_dims_of_every_width_within_the_rule(d, dv):
    """One, three and eight 32-wide chunks of q and k; one, three (the four-tile pass left unused)
    and five (one pass and a tail) 16-wide groups of v: within the rule against the torch tiles in
    float64, causal with ALiBi, blocks of 32 x 64."""
    q, k, v, g = inputs(torch.bfloat16, 90, 140, seed=9, d=d, dv=dv)
    mask = masks.causal() & masks.alibi(masks.alibi_slopes(H))
    with tile_kernel_as("torch tiles"):
        exact = chunked_attention(q.double(), k.double(), v.double(), mask, block_q=32, block_k=64)
        same = chunked_attention(q, k, v, mask, block_q=32, block_k=64)
    with amx(True), torch.no_grad():
        got, ran = _ran_amx(lambda: chunked_attention(q, k, v, mask, block_q=32, block_k=64))
    assert ran == 1
    size = score_size(q, k, None, None, d ** -0.5) + float(masks.alibi_slopes(H).max()) * 140
    verdict = judge(f"AMX d={d} dv={dv}", got, exact, lambda dt: same, torch.bfloat16, head_dim=d, score_size=size)
    assert verdict.ok, str(verdict)


def test_a_reference_maximum_that_moves_lazily_keeps_the_rule():
    """Head 0: scores rising along every row by ~50 in log2 units a 64-key step, ~400 over the row
    (the reference maximum must move every step: left behind by more than 2^7 an exponential
    overflows); head 1: rows whose scores pass 2^22 (the row path). Each head within the rule
    against the torch tiles in float64, causal, at chunked's defaults."""
    L = 520
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 2, L, D, generator=g)
    k = torch.randn(1, 2, L, D, generator=g)
    q[:, 0, :, 0] = 40.0
    k[:, 0, :, 0] = torch.linspace(0, 60, L)  # score s_ij grows by 40 * 60 / 520 / 8 a key
    q[:, 1, 300:] *= 3000.0
    v = torch.randn(1, 2, L, DV, generator=g)
    q, k, v = (t.bfloat16() for t in (q, k, v))
    with tile_kernel_as("torch tiles"):
        exact = chunked_attention(q.double(), k.double(), v.double(), masks.causal(), return_lse=True)
        same = chunked_attention(q, k, v, masks.causal(), return_lse=True)
    with amx(True), torch.no_grad():
        got, ran = _ran_amx(lambda: chunked_attention(q, k, v, masks.causal(), return_lse=True))
    assert ran == 1
    for h in (0, 1):
        size = score_size(q[:, h:h + 1], k[:, h:h + 1], None, None, D ** -0.5)
        for i, name in enumerate(("out", "lse")):
            verdict = judge(f"lazy maximum, head {h}, {name}", got[i][:, h], exact[i][:, h], lambda dt: same[i][:, h],
                            torch.bfloat16, head_dim=D, score_size=size)
            assert verdict.ok, str(verdict)


@pytest.mark.parametrize("on", [True, False])
def test_bf16_causal_passes_the_float32_scores_rule(on):
    """Issue 22 item 5 on both bfloat16 forwards (AMX tiles, brgemm): inputs x3, causal, L=1024,
    against float64 within 2x the error of the reference that keeps scores, softmax and sums in
    float32 (which bfloat16-rounded products fail, test_numerics)."""
    L, Dh = 1024, 64
    g = torch.Generator().manual_seed(22)
    q, k, v = ((3 * torch.randn(1, 2, L, Dh, generator=g)).bfloat16() for _ in range(3))
    keep = torch.ones(L, L, dtype=torch.bool).tril().expand(1, 2, L, L)
    with amx(on), torch.no_grad():
        out, ran = _ran_amx(lambda: chunked_attention(q, k, v, masks.causal()))
    assert ran == int(on)
    want = naive_attention(q, k, v, keep, None, Dh ** -0.5, torch.float64)
    verdict = judge(f"bf16 forward, AMX {on}", out, want, lambda dt: naive_attention(q, k, v, keep, None, Dh ** -0.5, dt),
                    torch.bfloat16, head_dim=Dh, score_size=score_size(q, k, keep, None, Dh ** -0.5))
    assert verdict.ok, str(verdict)


def test_nan_and_infinities_come_out_as_the_brgemm_forward_gives_them():
    """A NaN query, a NaN key, an infinite query (+inf and -inf scores) and a row of -inf scores:
    the AMX forward gives NaN exactly where the brgemm forward does, and its values elsewhere
    within a bfloat16 rounding of them."""
    q, k, v, _ = inputs(torch.bfloat16, 150, 150, seed=3, d=D, dv=DV)
    q[0, 1, 4, 3] = float("nan")
    k[1, 0, 90, 0] = float("nan")
    q[0, 2, 70, 5] = float("inf")
    q[1, 3, 100, :] = float("-inf")
    k[1, 1, :, :] = k[1, 1, :, :].abs()  # q row (1, 3, 100) of -inf meets only positive keys: all -inf
    with amx(True), torch.no_grad():
        got, ran = _ran_amx(lambda: chunked_attention(q, k, v, masks.causal(), return_lse=True))
    with amx(False), torch.no_grad():
        want = chunked_attention(q, k, v, masks.causal(), return_lse=True)
    assert ran == 1
    # out: as in the 64-bit test, within 2^-7 max |v|; lse (float32, no rounding of p in it): the
    # exponentials' 2^-13 and float32 sums, far within 2^-7 of its size
    for a, b, size in zip(got, want, (v[~v.isnan()].float().abs().max(), None)):
        assert torch.equal(a.isnan(), b.isnan())
        fine = ~b.isnan()
        assert torch.equal(a[fine].isinf(), b[fine].isinf())
        both = fine & ~b.isinf()
        size = b[both].float().abs().max() if size is None else size
        assert (a[both].float() - b[both].float()).abs().max() <= 2 ** -7 * size


def test_same_bits_at_every_thread_count():
    """Each output row is one thread's, in a fixed order: 1, 3 and 8 threads give the same bits."""
    q, k, v, _ = inputs(torch.bfloat16, 300, 300, d=D, dv=DV)
    mask = masks.causal() & masks.alibi(masks.alibi_slopes(H))
    results = []
    for threads in (1, 3, 8):
        with torch_threads(threads), amx(True):
            results.append(chunked_attention(q, k, v, mask, block_q=32, block_k=64, return_lse=True))
            results.append(chunked_attention(q, k, v, masks.causal(), return_lse=True))
    for i in range(2, len(results)):
        want = results[i % 2]
        assert torch.equal(results[i][0], want[0]) and torch.equal(results[i][1], want[1])


def test_inputs_are_read_through_their_strides():
    """Transposed (B, L, H, D) views, a kv head broadcast by a zero stride, a sliced last axis
    and keys stored transposed give the bits of the same values laid out contiguously."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, 140, H, 2 * D, generator=g).bfloat16().transpose(1, 2)[..., ::2]
    k = torch.randn(B, 1, 140, D, generator=g).bfloat16().expand(B, 2, 140, D)
    v = torch.randn(B, 140, 2, DV, generator=g).bfloat16().transpose(1, 2)
    kt = k.contiguous().transpose(-1, -2).contiguous().transpose(-1, -2)  # last-axis stride 140
    assert not q.is_contiguous() and k.stride(1) == 0 and not v.is_contiguous() and kt.stride(-1) != 1
    with amx(True), torch.no_grad():
        (got, got_t), ran = _ran_amx(lambda: (chunked_attention(q, k, v, masks.causal()),
                                              chunked_attention(q, kt, v, masks.causal())))
        want = chunked_attention(q.contiguous(), k.contiguous(), v.contiguous(), masks.causal())
    assert ran == 2
    assert torch.equal(got, want) and torch.equal(got_t, want)


def test_lengths_past_2_to_the_31_scores_use_64_bit_indices():
    """Lq·Lk = 2^32 (a window keeps it cheap): the AMX forward equals the brgemm forward within a
    bfloat16 rounding of the output (the same products; p rounded the same way)."""
    L = 65536
    g = torch.Generator().manual_seed(5)
    q, k = (torch.randn(1, 1, L, 32, generator=g).bfloat16() for _ in range(2))
    v = torch.randn(1, 1, L, 16, generator=g).bfloat16()
    with amx(True), torch.no_grad():
        got, ran = _ran_amx(lambda: chunked_attention(q, k, v, masks.window(3)))
    with amx(False), torch.no_grad():
        want = chunked_attention(q, k, v, masks.window(3))
    assert ran == 1
    # both round each p to bfloat16 (2^-9 relative) and their out to bfloat16 (2^-9 of |out| <=
    # max |v|); their exponentials differ by under 2^-13: together under 2^-7 max |v|
    assert (got.float() - want.float()).abs().max() <= 2 ** -7 * v.float().abs().max()


def test_bfloat16_out_is_the_float32_outs_rounding():
    """Without a gradient to read it, the AMX forward writes out in bfloat16; those are the bits
    of its float32 out (what it returns when a backward will run) rounded as torch rounds it."""
    q, k, v, _ = inputs(torch.bfloat16, 200, 200, d=D, dv=DV)
    with amx(True):
        with torch.no_grad():
            inference = chunked_attention(q, k, v, masks.causal())
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        training = chunked_attention(*leaves, masks.causal())
    assert torch.equal(inference, training.detach())


def test_atens_brgemm_is_right_after_the_amx_forward_on_the_same_threads():
    """The AMX forward loads its own tile configuration: SDPA's bfloat16 flash kernel and the
    native backward (both through ATen's brgemm) give the same bits after it as before."""
    q, k, v, g = inputs(torch.bfloat16, 300, 300, d=D, dv=DV)
    kk, vv = (t.repeat_interleave(2, 1) for t in (k, v))
    grad = torch.randn(B, H, 300, DV, generator=g)
    with amx(False):
        before = (F.scaled_dot_product_attention(q, kk, vv, is_causal=True), _out_lse_grads(q, k, v, masks.causal(), grad, (256, 256))[2])
    with amx(True):
        for _ in range(2):
            with torch.no_grad():
                _, ran = _ran_amx(lambda: chunked_attention(q, k, v, masks.causal()))
            assert ran == 1
            after = F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
            assert torch.equal(after, before[0])
    with amx(False):  # the brgemm forward and the native backward, right after the AMX forward
        grads = _out_lse_grads(q, k, v, masks.causal(), grad, (256, 256))[2]
    for n in "qkv":
        assert torch.equal(grads[n], before[1][n])


@pytest.mark.parametrize("d,dv,blocks", [(48, 32, (32, 64)), (64, 8, (32, 64)), (64, 32, (30, 64)), (64, 32, (32, 48))])
def test_shapes_it_does_not_take_run_the_brgemm_forward(d, dv, blocks):
    """Head dims not multiples of 32 (q, k) and 16 (v), blocks not multiples of 16 x 64: the brgemm
    forward runs them (the AMX count stays), and explain's reason says which."""
    q, k, v, _ = inputs(torch.bfloat16, 70, 70, d=d, dv=dv)
    with amx(True), torch.no_grad():
        _, ran = _ran_amx(lambda: chunked_attention(q, k, v, masks.causal(), block_q=blocks[0], block_k=blocks[1]))
    assert ran == 0
    why = native.amx_forward_why_not(torch.bfloat16, d, dv, blocks)
    assert why is not None and ("head dims" in why if (d % 32 or dv % 16) else "blocks" in why)


def test_native_amx_false_switches_it_off_and_explain_says_so(monkeypatch):
    q, k, v, _ = inputs(torch.bfloat16, 70, 70, d=D, dv=DV)
    with amx(False), torch.no_grad():
        _, ran = _ran_amx(lambda: chunked_attention(q, k, v, masks.causal()))
        assert ran == 0 and "switched off" in native.amx_forward_why_not(torch.bfloat16, D, DV, (256, 256))
    monkeypatch.setenv("MULTIHEAD_NATIVE_AMX", "0")
    assert not native.amx_tiles()
    monkeypatch.delenv("MULTIHEAD_NATIVE_AMX")
    assert native.amx_tiles() and native.amx_forward_why_not(torch.bfloat16, D, DV, (256, 256)) is None
    assert native.amx_forward_why_not(torch.float32, D, DV) is not None
