import pytest
import torch
import torch.nn.functional as F

import multihead as mh
from multihead import masks
from oracle import attention_or_refusal, judge, naive_attention, score_size
from ref64 import attention64, causal_keep, window_keep, random_qkv

BACKENDS = [n for n in mh.backends.names() if n != "auto"] + ["auto"]


def qkv(Lq=5, D=8, **kw):
    return random_qkv(Lq=Lq, D=D, **kw)


CASES = {
    "self": dict(),
    "cross": dict(Lq=3, Lk=7),
    "gqa": dict(H=6, Hkv=2, Lq=4, Lk=6),
    "mqa": dict(H=4, Hkv=1),
    "dv": dict(D=8, Dv=5, Lq=3, Lk=4),
    "one": dict(Lq=1, Lk=1, B=1, H=1),
}


def dense_mask(kind, B, H, Lq, Lk, g):
    """(multihead mask, dense keep, dense bias) for one mask kind."""
    if kind == "none":
        return None, None, None
    if kind == "causal":
        return masks.causal(), causal_keep(Lq, Lk), None
    if kind == "causal_top_left":
        return masks.causal("top_left"), causal_keep(Lq, Lk, "top_left"), None
    if kind == "window":
        return masks.window(2, 1), window_keep(Lq, Lk, 2, 1), None
    if kind == "padding":
        kp = torch.rand(B, Lk, generator=g) > 0.3
        kp[:, 0] = True
        return masks.key_padding(kp), kp[:, None, None, :], None
    if kind == "keep":
        k = torch.rand(B, 1, Lq, Lk, generator=g) > 0.4
        return k, k, None
    if kind == "bias":
        b = torch.randn(B, H, Lq, Lk, generator=g, dtype=torch.float64)
        return b, None, b
    if kind == "bias&causal&padding":
        b = torch.randn(1, H, Lq, Lk, generator=g, dtype=torch.float64)
        kp = torch.rand(B, Lk, generator=g) > 0.3
        return masks.bias(b) & masks.causal() & masks.key_padding(kp), causal_keep(Lq, Lk) & kp[:, None, None, :], b
    raise AssertionError(kind)


MASK_KINDS = ["none", "causal", "causal_top_left", "window", "padding", "keep", "bias", "bias&causal&padding"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_every_backend_matches_float64_oracle(backend, case, kind):
    q, k, v = qkv(**CASES[case])
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    m, keep, bias = dense_mask(kind, B, H, Lq, Lk, torch.Generator().manual_seed(1))
    out = mh.attention(q, k, v, m, backend=backend)
    expect, _ = attention64(q, k, v, keep, bias)
    assert out.shape == expect.shape
    assert (out - expect).abs().max() <= 1e-12


@pytest.mark.parametrize("kind", MASK_KINDS)
def test_sdpa_backend_matches_torch_sdpa(kind):
    q, k, v = qkv(H=4, Hkv=2, Lq=6, Lk=6, dtype=torch.float32)
    m, keep, bias = dense_mask(kind, 2, 4, 6, 6, torch.Generator().manual_seed(3))
    attn_mask = None
    if keep is not None or bias is not None:
        attn_mask = torch.zeros(2, 4, 6, 6)
        if bias is not None:
            attn_mask = attn_mask + bias.float()
        if keep is not None:
            attn_mask = attn_mask.masked_fill(~keep, float("-inf"))
    expect = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=True)
    out = mh.attention(q, k, v, m, backend="sdpa")
    torch.testing.assert_close(out, expect, rtol=0, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_low_precision_error_within_twice_naive(dtype, backend, causal):
    """The tolerance rule of tests/oracle.py: at most 2x the error of the naive same-precision reference."""
    q, k, v = qkv(B=2, H=4, Lq=33, Lk=33, D=16, dtype=dtype, seed=7)
    keep = causal_keep(33, 33).expand(2, 4, 33, 33) if causal else None
    out = mh.attention(q, k, v, masks.causal() if causal else None, backend=backend)
    assert out.dtype == dtype
    expect = naive_attention(q, k, v, keep, None, 16 ** -0.5, torch.float64)
    verdict = judge("output", out, expect, lambda dt: naive_attention(q, k, v, keep, None, 16 ** -0.5, dt), dtype,
                    head_dim=16, score_size=score_size(q, k, keep, None, 16 ** -0.5))
    assert verdict.ok, str(verdict)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "auto"])
@pytest.mark.parametrize("kind", ["none", "causal", "bias&causal&padding"])
def test_gradcheck_float64(backend, kind):
    q, k, v = qkv(B=1, H=2, Hkv=1, Lq=3, Lk=4, D=3, grad=True, seed=5)
    m, keep, bias = dense_mask(kind, 1, 2, 3, 4, torch.Generator().manual_seed(2))
    if attention_or_refusal(backend, q, k, v, m) is None:  # a backend that cannot train here says so
        return
    if bias is not None:
        bias = bias.clone().requires_grad_(True)

        def f(q, k, v, bias):
            return mh.attention(q, k, v, masks.bias(bias) & masks.keep(keep), backend=backend)

        assert torch.autograd.gradcheck(f, (q, k, v, bias))
    else:
        assert torch.autograd.gradcheck(lambda q, k, v: mh.attention(q, k, v, m, backend=backend), (q, k, v))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_fully_masked_rows_give_zero_output_and_finite_grads(backend, dtype):
    q, k, v = qkv(B=2, H=2, Lq=4, Lk=5, dtype=dtype, grad=True)
    keep = torch.ones(2, 1, 4, 5, dtype=torch.bool)
    keep[0, :, 1] = False  # row 1 of batch 0: no key at all
    keep[1, :, 3] = False
    out = attention_or_refusal(backend, q, k, v, keep)
    if out is None:  # a backend that cannot train here says so
        return
    assert torch.equal(out[0, :, 1], torch.zeros_like(out[0, :, 1]))
    assert torch.equal(out[1, :, 3], torch.zeros_like(out[1, :, 3]))
    assert out[0, :, 0].abs().sum() > 0
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[0, :, 1], torch.zeros_like(q.grad[0, :, 1]))


def test_fully_masked_by_minus_inf_bias_gives_zero():
    q, k, v = qkv(B=1, H=1, Lq=2, Lk=3)
    bias = torch.zeros(2, 3, dtype=torch.float64)
    bias[0] = float("-inf")
    for backend in BACKENDS:
        out = mh.attention(q, k, v, bias, backend=backend)
        assert torch.equal(out[0, 0, 0], torch.zeros(8, dtype=torch.float64)), backend
        w = mh.attention_weights(q, k, bias)
        assert torch.equal(w[0, 0, 0], torch.zeros(3, dtype=torch.float64))


def test_bottom_right_with_more_queries_than_keys_leaves_first_rows_empty():
    q, k, v = qkv(B=1, H=1, Lq=5, Lk=2)
    for backend in BACKENDS:
        out = mh.attention(q, k, v, masks.causal(), backend=backend)
        assert torch.equal(out[0, 0, :3], torch.zeros(3, 8, dtype=torch.float64))
        assert out[0, 0, 3:].abs().sum() > 0


def test_gqa_query_head_reads_kv_head_i_div_g():
    q, k, v = qkv(B=1, H=6, Hkv=3, Lq=4, Lk=4)
    out = mh.attention(q, k, v)
    for i in range(6):
        single = mh.attention(q[:, i:i + 1], k[:, i // 2:i // 2 + 1], v[:, i // 2:i // 2 + 1])
        assert torch.allclose(out[:, i:i + 1], single, rtol=0, atol=1e-14)


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v = qkv(D=9)
    assert torch.allclose(mh.attention(q, k, v), mh.attention(q, k, v, scale=1 / 3), rtol=0, atol=1e-15)
    assert not torch.allclose(mh.attention(q, k, v), mh.attention(q, k, v, scale=1.0))
    expect, _ = attention64(q, k, v, scale=0.7)
    assert (mh.attention(q, k, v, scale=0.7) - expect).abs().max() < 1e-12


def test_attention_weights_match_oracle_and_rows_sum_to_one():
    q, k, v = qkv(H=4, Hkv=2, Lq=5, Lk=7)
    w = mh.attention_weights(q, k, masks.causal())
    _, expect = attention64(q, k, v, causal_keep(5, 7))
    assert (w - expect).abs().max() < 1e-14
    assert torch.allclose(w.sum(-1), torch.ones(2, 4, 5, dtype=torch.float64), rtol=0, atol=1e-14)


def test_unknown_backend_lists_the_known_ones():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="unknown backend 'flash9'; known backends: auto, .*reference.*sdpa"):
        mh.attention(q, k, v, backend="flash9")


def test_dropout_zeroes_weights_and_rescales_reference():
    q, k, v = qkv(B=1, H=1, Lq=64, Lk=64, D=4)
    v = torch.ones_like(v)
    torch.manual_seed(0)
    out = mh.attention(q, k, v, dropout_p=0.5, backend="reference")
    # with v = 1 each output is the sum of the kept weights / (1 - p): mean 1, not all equal
    assert abs(out.mean().item() - 1.0) < 0.1 and out.std().item() > 0.05
    torch.manual_seed(0)
    again = mh.attention(q, k, v, dropout_p=0.5, backend="reference")
    assert torch.equal(out, again)


def test_explain_dispatch_names_the_choice():
    q, k, v = qkv()
    d = mh.explain_dispatch(q, k, v)
    assert d.backend == "sdpa"
    assert set(d.refused) == set(mh.backends.AUTO_ORDER) - {"sdpa"}
    assert all(isinstance(why, str) and why for why in d.refused.values())
    assert "backend: sdpa" in str(d)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_sequences_give_defined_results(backend):
    q, k, v = qkv(Lq=3, Lk=4, grad=True)
    out = attention_or_refusal(backend, q, k[:, :, :0], v[:, :, :0])
    if out is None:  # a backend that cannot train here says so; it must still run without gradients
        with torch.no_grad():
            out = mh.attention(q, k[:, :, :0], v[:, :, :0], backend=backend)
        assert out.shape == (2, 4, 3, 8) and torch.equal(out, torch.zeros_like(out))
        return
    assert out.shape == (2, 4, 3, 8) and torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))
    out = mh.attention(q[:, :, :0], k, v, backend=backend)
    assert out.shape == (2, 4, 0, 8)


# ---------------------------------------------------------------- which SDPA kernel, and its memory
def _math_kernel_call(case):
    """(q, k, v, mask, dropout_p, the reason explain_dispatch gives) for a call that PyTorch's CPU
    SDPA runs on its math kernel (torch 2.13's select_sdp_backend_cpp), all float64, B=1 H=2 L=32."""
    q, k, v = qkv(B=1, H=2, Lq=32, D=8, seed=3)
    if case == "dv":
        return q, k, v[..., :5], None, 0.0, "Dv = 5 differs from D = 8"
    if case == "bias_grad":
        bias = torch.randn(32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
        return q, k, v, masks.bias(bias.requires_grad_(True)), 0.0, "the bias requires grad"
    if case == "dropout":
        return q, k, v, None, 0.25, "dropout_p = 0.25 > 0"
    if case == "strided":  # q viewed from a (B, H, D, Lq) tensor: its last dimension has stride Lq
        q = q.transpose(-1, -2).contiguous().transpose(-1, -2)
        return q, k, v, None, 0.0, "q not contiguous in the last dimension (stride != 1)"
    raise AssertionError(case)


def test_auto_declines_sdpa_where_torch_would_run_its_math_kernel_at_long_length():
    """Issue 11, defect 7: at L = 20000 with Dv != D, torch's CPU SDPA falls back to its math kernel,
    whose (L, L) scores take 1.6 GB each; auto budgeted only the mask and picked sdpa. explain_dispatch
    only plans the call: nothing (L, L) is built here."""
    L = 20000
    q, k, v = qkv(B=1, H=1, Lq=L, D=64, Dv=32, dtype=torch.float32)
    d = mh.explain_dispatch(q, k, v)
    assert d.backend == "chunked"
    scores = L * L * 4 * mh.backends.sdpa.MATH_SCORE_COPIES / 2**20
    assert (f"torch would run its math kernel for this call (Dv = 32 differs from D = 64) with dense scores of "
            f"{scores:.0f} MiB, over sdpa.DENSE_MASK_BUDGET_BYTES = 256 MiB") == d.refused["sdpa"]
    d = mh.explain_dispatch(q, k, k)  # Dv == D: the flash kernel, nothing dense
    assert d.backend == "sdpa" and d.how == "torch's flash attention kernel, no mask"
    assert mh.explain_dispatch(q.to("meta"), k.to("meta"), v.to("meta")).backend == "sdpa"  # meta allocates nothing


@pytest.mark.parametrize("case", ["dv", "bias_grad", "dropout", "strided"])
def test_auto_budgets_the_math_kernels_scores(case, monkeypatch):
    """Each CPU condition for the math kernel: explain_dispatch says so and what its scores take;
    over the budget auto passes the call on, and the output still matches the oracle."""
    q, k, v, mask, p, why = _math_kernel_call(case)
    scores = 2 * 32 * 32 * 8 * (mh.backends.sdpa.MATH_SCORE_COPIES + (case == "bias_grad") + (p > 0))
    d = mh.explain_dispatch(q, k, v, mask, dropout_p=p)
    assert d.backend == "sdpa" and d.how.startswith(f"torch's math kernel ({why}) with dense scores of {scores // 1024} KiB")
    with mh.trace() as t:  # the kernel torch really runs, with the real mask
        mh.attention(q, k, v, mask, dropout_p=p, backend="sdpa")
    assert "math kernel" in t.steps[-1].note
    monkeypatch.setattr(mh.backends.sdpa, "DENSE_MASK_BUDGET_BYTES", scores - 1)
    monkeypatch.setattr(mh.backends.chunked, "AUTO_MIN_SCORES", 0)
    d = mh.explain_dispatch(q, k, v, mask, dropout_p=p)
    assert d.backend == ("reference" if p > 0 else "chunked")  # chunked declines dropout
    assert d.refused["sdpa"].startswith(f"torch would run its math kernel for this call ({why}) with dense scores of "
                                        f"{scores // 1024} KiB")
    if p == 0:
        bias = None if mask is None else mask.parts[0].tensor.detach()
        expect, _ = attention64(q, k, v, bias=bias)
        assert (mh.attention(q, k, v, mask) - expect).abs().max() <= 1e-12
    with torch.no_grad():  # no autograd: a bias that requires grad reaches SDPA as a plain tensor
        assert (mh.explain_dispatch(q, k, v, mask, dropout_p=p).backend == "sdpa") == (case == "bias_grad")


def test_auto_budgets_the_math_kernel_when_flash_is_turned_off(monkeypatch):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = qkv(B=1, H=2, Lq=32, D=8)
    monkeypatch.setattr(mh.backends.sdpa, "DENSE_MASK_BUDGET_BYTES", 0)
    monkeypatch.setattr(mh.backends.chunked, "AUTO_MIN_SCORES", 0)
    assert mh.explain_dispatch(q, k, v).backend == "sdpa"
    with sdpa_kernel([SDPBackend.MATH]):
        d = mh.explain_dispatch(q, k, v)
        assert d.backend == "chunked"
        assert "math kernel for this call (the flash kernel is turned off" in d.refused["sdpa"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_explain_dispatch_names_the_kernel_torch_runs(case, kind):
    """The kernel explain_dispatch plans for (from a zero-stride stand-in for the mask) is the one
    torch runs with the real mask, and a float bias with half inputs stays float32."""
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = qkv(**CASES[case], dtype=dtype)
        m, _, _ = dense_mask(kind, q.shape[0], q.shape[1], q.shape[2], k.shape[2], torch.Generator().manual_seed(1))
        d = mh.explain_dispatch(q, k, v, m)
        with mh.trace() as t:
            mh.attention(q, k, v, m, backend="sdpa")
        kernel = d.how.split(" kernel")[0].removeprefix("torch's ")
        assert f", {kernel} kernel, " in t.steps[-1].note, (d.how, t.steps[-1].note)
        if kind.startswith("bias"):
            assert "float32 mask" in d.how and "torch.float32 mask tensor" in t.steps[-1].note
