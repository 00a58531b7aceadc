import pytest
import torch

import multihead as mh
from multihead import masks
from ref64 import attention64, causal_keep

BACKENDS = ["reference", "sdpa", "auto"]


def module(*args, seed=0, dtype=torch.float64, **kw):
    torch.manual_seed(seed)
    return mh.MultiHeadAttention(*args, dtype=dtype, **kw)


def manual_forward(mha, query, key, value, keep=None, bias=None):
    """The layer written out by hand in float64 with the oracle, from the module's own weights."""
    c = mha.config
    B, Lq, _ = query.shape
    Lk = key.shape[1]
    q = (query @ mha.q_proj.weight.T + (mha.q_proj.bias if c.bias else 0)).view(B, Lq, c.num_heads, c.head_dim).transpose(1, 2)
    k = (key @ mha.k_proj.weight.T + (mha.k_proj.bias if c.bias else 0)).view(B, Lk, c.num_kv_heads, c.head_dim).transpose(1, 2)
    v = (value @ mha.v_proj.weight.T + (mha.v_proj.bias if c.bias else 0)).view(B, Lk, c.num_kv_heads, c.head_dim).transpose(1, 2)
    o, w = attention64(q, k, v, keep, bias)
    o = o.transpose(1, 2).reshape(B, Lq, c.d_out)
    return o @ mha.out_proj.weight.T + (mha.out_proj.bias if c.bias else 0), w


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(d_out=12),
        dict(num_kv_heads=1),
        dict(num_kv_heads=2, bias=False),
        dict(causal=True),
    ],
)
def test_self_attention_matches_hand_written_layer(backend, kw):
    mha = module(6, 4, **{"d_out": 8, **kw}, backend=backend)
    x = torch.randn(2, 5, 6, dtype=torch.float64)
    keep = causal_keep(5, 5) if kw.get("causal") else None
    expect, _ = manual_forward(mha, x, x, x, keep)
    assert (mha(x) - expect).abs().max() < 1e-12


@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_attention_with_other_lengths_and_dims(backend):
    mha = module(6, 2, 8, kdim=5, vdim=3, backend=backend)
    q, k, v = torch.randn(2, 4, 6, dtype=torch.float64), torch.randn(2, 7, 5, dtype=torch.float64), torch.randn(2, 7, 3, dtype=torch.float64)
    kp = torch.ones(2, 7, dtype=torch.bool)
    kp[1, 5:] = False
    out = mha(q, k, v, mask=masks.key_padding(kp))
    expect, _ = manual_forward(mha, q, k, v, kp[:, None, None, :])
    assert out.shape == (2, 4, 8) and (out - expect).abs().max() < 1e-12


def test_key_and_value_default_to_query_and_key():
    mha = module(6, 2)
    x, mem = torch.randn(1, 3, 6, dtype=torch.float64), torch.randn(1, 5, 6, dtype=torch.float64)
    assert torch.allclose(mha(x), mha(x, x, x), rtol=0, atol=1e-14)
    assert torch.allclose(mha(x, mem), mha(x, mem, mem), rtol=0, atol=1e-14)
    assert not torch.allclose(mha(x, mem), mha(x))


def test_projections_are_the_submodules_own_calls():
    """The contract that replaces "one product with [W_q; W_k; W_v]": every projection is a call
    of its submodule, in every grad mode, so hooks, parametrizations and replaced submodules
    (adapters) are what runs; nothing derived from the weights is kept between calls."""
    mha = module(6, 2)
    x, mem = torch.randn(2, 3, 6, dtype=torch.float64), torch.randn(2, 4, 6, dtype=torch.float64)
    seen = []
    for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
        getattr(mha, name).register_forward_hook(lambda mod, args, out, name=name: seen.append((name, args[0].shape[1])))
    for ctx in (torch.enable_grad, torch.no_grad, torch.inference_mode):
        for inputs, lk in (((x,), 3), ((x, mem), 4)):
            seen.clear()
            with ctx():
                mha(*inputs)
            assert seen == [("q_proj", 3), ("k_proj", lk), ("v_proj", lk), ("out_proj", 3)], ctx
    # a replaced projection (here an "adapter" that adds a tanh) is what the next call runs
    with torch.no_grad():
        mha(x)
        linear_q = mha.q_proj
        mha.q_proj = torch.nn.Sequential(linear_q, torch.nn.Tanh())
        adapted = mha(x)
        q = torch.tanh(linear_q(x)).view(2, 3, 2, 3).transpose(1, 2)
        k, v = (p(x).view(2, 3, 2, 3).transpose(1, 2) for p in (mha.k_proj, mha.v_proj))
        o, _ = attention64(q, k, v)
        assert (adapted - mha.out_proj(o.transpose(1, 2).reshape(2, 3, 6))).abs().max() < 1e-12


@pytest.mark.parametrize("inputs,stacked", [("self", "QKV"), ("shared memory", "KV"), ("key and value", "")])
def test_trace_checks_that_one_stacked_product_equals_the_separate_ones(inputs, stacked):
    mha = module(6, 2)
    x, mem, val = (torch.randn(2, n, 6, dtype=torch.float64) for n in (3, 4, 4))
    args = {"self": (x,), "shared memory": (x, mem), "key and value": (x, mem, val)}[inputs]
    with mh.trace() as t:
        out = mha(*args)
    assert torch.equal(out, mha(*args))  # tracing changes nothing
    for role in "QKV":
        step = t.step(f"project {role}")
        if role in stacked:
            assert step.checks == {"equals its own separate product": True}
            assert step.note == ("one product with the concatenated weights [W_q; W_k; W_v]" if stacked == "QKV"
                                 else "K and V: one product with [W_k; W_v]")
        else:
            assert step.checks == {} and step.note == ""


def test_fused_weights_follow_in_place_updates():
    mha = module(6, 2)
    x = torch.randn(2, 3, 6, dtype=torch.float64)
    with torch.no_grad():
        before = mha(x)
        mha.k_proj.weight.mul_(2.0)
        after = mha(x)
        fresh = module(6, 2)
        fresh.load_state_dict(mha.state_dict())
        assert not torch.allclose(before, after)
        assert torch.equal(after, fresh(x))


def test_training_step_reaches_every_projection():
    mha = module(6, 2, num_kv_heads=1, dtype=torch.float32)
    x = torch.randn(2, 3, 6)
    mha(x).square().mean().backward()
    for name, p in mha.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_state_dict_uses_linear_names():
    mha = module(6, 2, num_kv_heads=1)
    assert set(mha.state_dict()) == {f"{p}.{t}" for p in ("q_proj", "k_proj", "v_proj", "out_proj") for t in ("weight", "bias")}
    assert mha.k_proj.weight.shape == (3, 6) and mha.out_proj.weight.shape == (6, 6)


@pytest.mark.parametrize("causal", [False, True])
def test_return_weights_are_the_applied_per_head_weights(causal):
    mha = module(6, 3, causal=causal)
    x = torch.randn(2, 4, 6, dtype=torch.float64)
    out, w = mha(x, return_weights=True)
    expect, expect_w = manual_forward(mha, x, x, x, causal_keep(4, 4) if causal else None)
    assert w.shape == (2, 3, 4, 4)
    assert (w - expect_w).abs().max() < 1e-14 and (out - expect).abs().max() < 1e-12


def test_return_weights_in_training_are_after_dropout():
    mha = module(6, 2, dropout=0.5, dtype=torch.float32).train()
    x = torch.randn(1, 16, 6)
    torch.manual_seed(3)
    out, w = mha(x, return_weights=True)
    assert (w == 0).float().mean() > 0.3  # dropped
    # recompute the output from these weights: they are the ones that were applied
    B, L = 1, 16
    v = mha.v_proj(x).view(B, L, 2, 3).transpose(1, 2)
    o = (w @ v).transpose(1, 2).reshape(B, L, 6)
    assert torch.allclose(mha.out_proj(o), out, atol=1e-6)


def test_dropout_only_in_training():
    mha = module(6, 2, dropout=0.4, dtype=torch.float32)
    plain = module(6, 2, dtype=torch.float32)
    plain.load_state_dict(mha.state_dict())
    x = torch.randn(2, 5, 6)
    mha.eval()
    assert torch.equal(mha(x), mha(x))
    assert torch.allclose(mha(x), plain(x), atol=1e-6)
    mha.train()
    assert not torch.allclose(mha(x), plain(x))


def test_gqa_module_equals_full_heads_with_repeated_kv_weights():
    gqa = module(8, 4, num_kv_heads=2)
    full = module(8, 4)
    D = 2
    with torch.no_grad():
        full.q_proj.load_state_dict(gqa.q_proj.state_dict())
        full.out_proj.load_state_dict(gqa.out_proj.state_dict())
        for src, dst in ((gqa.k_proj, full.k_proj), (gqa.v_proj, full.v_proj)):
            dst.weight.copy_(src.weight.view(2, D, 8).repeat_interleave(2, 0).reshape(8, 8))
            dst.bias.copy_(src.bias.view(2, D).repeat_interleave(2, 0).reshape(8))
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    assert (gqa(x) - full(x)).abs().max() < 1e-12


def test_backends_agree_inside_the_module():
    x = torch.randn(2, 9, 16)
    outs = {}
    for b in BACKENDS:
        mha = module(16, 4, causal=True, backend=b, dtype=torch.float32)
        outs[b] = mha(x, mask=masks.window(3))
    assert torch.allclose(outs["reference"], outs["sdpa"], atol=2e-6)
    assert torch.allclose(outs["reference"], outs["auto"], atol=2e-6)


def test_module_mask_combines_with_causal():
    mha = module(6, 2, causal=True)
    x = torch.randn(2, 4, 6, dtype=torch.float64)
    kp = torch.tensor([[True, True, False, True], [True] * 4])
    expect, _ = manual_forward(mha, x, x, x, causal_keep(4, 4) & kp[:, None, None, :])
    assert (mha(x, mask=masks.key_padding(kp)) - expect).abs().max() < 1e-12


def test_unbatched_input_asks_for_the_batch_axis():
    mha = module(6, 2)
    with pytest.raises(ValueError, match=r"add the batch axis with query.unsqueeze\(0\)"):
        mha(torch.randn(3, 6, dtype=torch.float64))


def test_value_required_when_vdim_differs():
    mha = module(6, 2, kdim=5, vdim=4)
    with pytest.raises(ValueError, match=r"value is required: vdim=4 differs from kdim=5"):
        mha(torch.randn(1, 3, 6, dtype=torch.float64), torch.randn(1, 2, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="key is required"):
        mha(torch.randn(1, 3, 6, dtype=torch.float64))


@pytest.mark.parametrize(
    "kw,err,match",
    [
        (dict(d_in=6, num_heads=4), ValueError, "d_out=6 is not divisible by num_heads=4"),
        (dict(d_in=8, num_heads=4, num_kv_heads=3), ValueError, "num_heads=4, num_kv_heads=3: num_heads must be a multiple"),
        (dict(d_in=0, num_heads=1), ValueError, "d_in must be positive"),
        (dict(d_in=8, num_heads=2, dropout=1.0), ValueError, r"dropout must be in \[0, 1\)"),
        (dict(d_in=8, num_heads=2, backend="fast"), ValueError, "unknown backend 'fast'"),
        (dict(d_in=8.0, num_heads=2), TypeError, "d_in must be an int"),
    ],
)
def test_bad_construction(kw, err, match):
    with pytest.raises(err, match=match):
        mh.MultiHeadAttention(**kw)


def test_forward_checks_sizes_dtypes():
    mha = module(6, 2)
    x = torch.randn(2, 3, 6, dtype=torch.float64)
    with pytest.raises(ValueError, match="query has 5 features but d_in=6"):
        mha(torch.randn(2, 3, 5, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"query is torch.float32 but the module's weights are torch.float64"):
        mha(x.float())
    with pytest.raises(ValueError, match="key has batch 1 but query has 2"):
        mha(x, torch.randn(1, 3, 6, dtype=torch.float64))
    with pytest.raises(ValueError, match="does not broadcast"):
        mha(x, mask=torch.ones(4, 4, dtype=torch.bool))


def test_extra_repr_shows_the_config():
    r = repr(module(8, 4, num_kv_heads=2, causal=True))
    assert "num_heads=4" in r and "num_kv_heads=2" in r and "head_dim=2" in r and "causal=True" in r


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("backend,blocks", [("reference", None), ("sdpa", None), ("chunked", None), ("chunked", 4)])
def test_module_runs_under_inference_mode_with_every_backend(backend, blocks, mode, monkeypatch):
    """With every backend, and for several query and key blocks of the chunked backend."""
    from multihead.backends import chunked

    if blocks is not None:
        monkeypatch.setattr(chunked, "BLOCK_ROWS", blocks)
        monkeypatch.setattr(chunked, "BLOCK_K", blocks)
    mha = module(16, 2, causal=True, num_kv_heads=1, backend=backend)
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    kp = torch.rand(2, 12) > 0.2
    kp[:, -1] = True
    expect, _ = manual_forward(mha, x, x, x, causal_keep(12, 12) & kp[:, None, None, :])
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the chunked backend shares its blocks among threads only with 2 or more
    try:
        with getattr(torch, mode)():
            out = mha(x, mask=masks.key_padding(kp))
    finally:
        torch.set_num_threads(threads)
    assert out.is_inference() == (mode == "inference_mode")
    assert (out - expect).abs().max() < 1e-12


# ------------------------------------------------------------------------------ torch.compile
@pytest.mark.parametrize("mode", ["enable_grad", "no_grad", "inference_mode"])
def test_compiled_module_repeats_without_graph_breaks_or_recompiles(mode):
    """fullgraph=True on repeated calls, weights changed in place between them (the fused-weight
    cache used to fail the second no_grad call with "Data pointer comparison")."""
    from torch._dynamo.utils import counters

    mha = module(8, 2, causal=True, dtype=torch.float32).eval()
    x = torch.randn(2, 5, 8)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(mha, fullgraph=True, backend="eager")  # dynamo alone: what breaks graphs
    try:
        for step in range(3):
            with getattr(torch, mode)():
                got, want = compiled(x), mha(x)
            assert torch.equal(got, want), step
            mha.q_proj.weight.data.mul_(1.5)  # the next call must see it
        assert dict(counters["graph_break"]) == {}
        assert counters["stats"]["unique_graphs"] == 1
    finally:
        torch._dynamo.reset()
