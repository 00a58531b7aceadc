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


# ---------------------------------------------------------------------------- from_config, the one build path
REBUILDS = {
    "plain": dict(),
    "gqa causal": dict(num_kv_heads=2, causal=True),
    "cross, no bias, d_out": dict(kdim=5, vdim=3, d_out=12, bias=False),
    "dropout, backend": dict(dropout=0.25, backend="reference"),
    "rope": dict(rope=True, rope_base=300.0, causal=True),
    "rope linear": dict(rope=True, rope_scaling=mh.rope.RoPEScaling("linear", 4.0)),
    "rope llama3": dict(rope=True, num_kv_heads=1, rope_scaling=mh.rope.RoPEScaling("llama3", 8.0, 1.0, 4.0, 64)),
    "RoPE object": dict(rope=mh.RoPE(2, 500.0, scaling=mh.rope.RoPEScaling("linear", 2.0))),
}


@pytest.mark.parametrize("kw", list(REBUILDS.values()), ids=list(REBUILDS))
def test_from_config_rebuilds_an_identical_module(kw):
    """The config carries everything a module needs: from_config(mha.config, mha.state_dict())
    has the same config, repr, weights (copies) and outputs, bit for bit, in float64."""
    mha = module(8, 4, **kw).eval()
    twin = mh.MultiHeadAttention.from_config(mha.config, mha.state_dict()).eval()
    assert twin.config == mha.config and repr(twin) == repr(mha)
    assert list(twin.state_dict()) == list(mha.state_dict())
    for name, t in mha.state_dict().items():
        got = twin.state_dict()[name]
        assert torch.equal(got, t) and got.dtype == torch.float64 and got.data_ptr() != t.data_ptr(), name
    if mha.config.rope:
        assert twin.rope.base == mha.rope.base and twin.rope.scaling == mha.rope.scaling == mha.config.rope_scaling
        assert torch.equal(twin.rope.inv_freq, mha.rope.inv_freq)
    c = mha.config
    q = torch.randn(2, 70, c.d_in, dtype=torch.float64)  # 70 > 64: past llama3's original context
    k = q if c.rope else torch.randn(2, 6, c.kdim, dtype=torch.float64)
    v = q if c.rope else torch.randn(2, 6, c.vdim, dtype=torch.float64)
    assert torch.equal(twin(q, k, v), mha(q, k, v))


def test_config_rope_scaling_is_used_and_validated():
    from multihead.rope import RoPE, RoPEScaling

    linear = RoPEScaling("linear", 4.0)
    m = mh.MultiHeadAttention(16, 2, rope=True, rope_scaling=linear)
    assert m.config.rope_scaling == linear and m.rope.scaling == linear
    assert torch.equal(m.rope.inv_freq, RoPE(8).inv_freq / 4.0)
    assert "rope_scaling=RoPEScaling('linear', factor=4)" in repr(m)
    c = m.config
    assert c.to_dict()["rope_scaling"] == {"kind": "linear", "factor": 4.0, "low_freq_factor": None,
                                            "high_freq_factor": None, "original_max_position_embeddings": None}
    assert mh.AttentionConfig(**c.to_dict()) == c  # a dict of fields (e.g. from JSON) reads back
    with pytest.raises(ValueError, match=r"rope_scaling=RoPEScaling\('linear', factor=4\) rescales rotary embeddings, but rope=False"):
        mh.AttentionConfig(d_in=16, num_heads=2, rope_scaling=linear)
    with pytest.raises(TypeError, match=r"rope_scaling must be a multihead\.rope\.RoPEScaling or None, got str"):
        mh.MultiHeadAttention(16, 2, rope=True, rope_scaling="linear")
    with pytest.raises(ValueError, match=r"RoPEScaling kind must be one of"):
        mh.AttentionConfig(d_in=16, num_heads=2, rope=True, rope_scaling={"kind": "yarn", "factor": 2.0})
    rope = RoPE(8, 300.0, scaling=linear)
    with pytest.raises(ValueError, match=r"rope_base=500.0; pass the base in one place"):
        mh.MultiHeadAttention(16, 2, rope=rope, rope_base=500.0)
    with pytest.raises(ValueError, match=r"rope_scaling=RoPEScaling\('linear', factor=2\); pass the scaling in one place"):
        mh.MultiHeadAttention(16, 2, rope=rope, rope_scaling=RoPEScaling("linear", 2.0))
    agreeing = mh.MultiHeadAttention(16, 2, rope=rope, rope_base=300.0, rope_scaling=linear)
    assert agreeing.rope is rope and agreeing.config.rope_scaling == linear


def test_constructor_arguments_are_the_config_fields():
    """The field list is spelled once: the constructor takes exactly the config's fields, with its
    defaults, plus device and dtype; from_config passes them back."""
    import dataclasses
    import inspect

    params = inspect.signature(mh.MultiHeadAttention.__init__).parameters
    fields = dataclasses.fields(mh.AttentionConfig)
    assert list(params) == ["self", *(f.name for f in fields), "device", "dtype"]
    for f in fields:
        default = inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
        assert params[f.name].default == default, f.name


@pytest.mark.parametrize("kw", list(REBUILDS.values())[:4], ids=list(REBUILDS)[:4])
def test_weight_shapes_are_the_state_dict_layout(kw):
    mha = module(8, 4, **kw)
    assert {k: tuple(t.shape) for k, t in mha.state_dict().items()} == mha.config.weight_shapes()
    assert list(mha.state_dict()) == list(mha.config.weight_shapes())


def test_from_config_without_weights_builds_a_fresh_module_on_the_device_and_dtype():
    config = mh.AttentionConfig(d_in=8, num_heads=2, num_kv_heads=1, causal=True)
    m = mh.MultiHeadAttention.from_config(config, dtype=torch.float64, device="meta")
    assert m.config == config and m.q_proj.weight.dtype == torch.float64 and m.q_proj.weight.is_meta
    fresh = mh.MultiHeadAttention.from_config(config)
    assert fresh.training and torch.isfinite(fresh.k_proj.weight).all() and fresh.k_proj.weight.shape == (4, 8)
    # with weights: their dtype by default, or cast to dtype=
    weights = module(8, 2, num_kv_heads=1, causal=True).state_dict()
    assert mh.MultiHeadAttention.from_config(config, weights).q_proj.weight.dtype == torch.float64
    as32 = mh.MultiHeadAttention.from_config(config, weights, dtype=torch.float32)
    assert torch.equal(as32.v_proj.weight, weights["v_proj.weight"].float())


def test_from_config_names_bad_input():
    mha = module(16, 4)
    config, sd = mha.config, mha.state_dict()
    cases = [
        (lambda: mh.MultiHeadAttention.from_config("c"), TypeError, r"config must be a multihead\.AttentionConfig.*got str"),
        (lambda: mh.MultiHeadAttention.from_config(config.to_dict()), TypeError, r"got dict; for a dict of its fields pass AttentionConfig\(\*\*d\)"),
        (lambda: mh.MultiHeadAttention.from_config(config, list(sd.values())), TypeError, r"weights must be a mapping of state_dict names"),
        (lambda: mh.MultiHeadAttention.from_config(config, {k: t for k, t in sd.items() if k != "k_proj.bias"}), ValueError,
         r"weights lacks k_proj\.bias \(shape \(16,\)\)"),
        (lambda: mh.MultiHeadAttention.from_config(config, module(16, 4, bias=False).state_dict()), ValueError,
         r"lacks q_proj\.bias \(shape \(16,\)\), k_proj\.bias.*this config has bias=True"),
        (lambda: mh.MultiHeadAttention.from_config(config, sd | {"scale": torch.ones(())}), ValueError,
         r"weights has unexpected keys scale; this config's weights are: q_proj\.weight \(16, 16\)"),
        (lambda: mh.MultiHeadAttention.from_config(config, torch.nn.MultiheadAttention(16, 4).state_dict()), ValueError,
         r"weights lacks q_proj\.weight \(shape \(16, 16\)\), .* and has unexpected keys in_proj_weight, in_proj_bias; "
         r"it is an nn\.MultiheadAttention state_dict: convert it with multihead\.integrations\.torch_mha\.torch_to_multihead"),
        (lambda: mh.MultiHeadAttention.from_config(mh.AttentionConfig(d_in=16, num_heads=4, bias=False), sd), ValueError,
         r"unexpected keys q_proj\.bias.*this config has bias=False"),
        (lambda: mh.MultiHeadAttention.from_config(mh.AttentionConfig(d_in=16, num_heads=4, num_kv_heads=2), sd), ValueError,
         r"weights\['k_proj\.weight'\] has shape \(16, 16\) but this config needs \(kv_dim, kdim\) = \(8, 16\)"),
        (lambda: mh.MultiHeadAttention.from_config(config, sd | {"out_proj.bias": torch.zeros(8)}), ValueError,
         r"weights\['out_proj\.bias'\] has shape \(8,\) but this config needs \(d_out,\) = \(16,\)"),
        (lambda: mh.MultiHeadAttention.from_config(config, sd | {"q_proj.weight": [[0.0] * 16] * 16}), TypeError,
         r"weights\['q_proj\.weight'\] must be a torch\.Tensor of shape \(16, 16\), got list"),
        (lambda: mh.MultiHeadAttention.from_config(config, sd | {"v_proj.weight": torch.zeros(16, 16, dtype=torch.long)}),
         TypeError, r"weights\['v_proj\.weight'\] must have a floating dtype, got torch\.int64"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()


# ---------------------------------------------------------------------------- nn conventions
def test_reset_parameters_after_meta_device_init_is_nn_linears_init():
    """Built on the meta device, moved with to_empty (uninitialised memory), reset_parameters gives
    each projection exactly what nn.Linear.reset_parameters draws from the same seed: finite,
    within ±1/sqrt(fan_in), filling that range; then the module computes the hand-written layer."""
    mha = mh.MultiHeadAttention(32, 4, 16, num_kv_heads=2, kdim=24, vdim=40, device="meta", dtype=torch.float64)
    assert mha.q_proj.weight.is_meta
    mha = mha.to_empty(device="cpu")
    torch.manual_seed(3)
    mha.reset_parameters()
    torch.manual_seed(3)
    for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
        got = getattr(mha, name)
        ref = torch.nn.Linear(got.in_features, got.out_features, device="meta", dtype=torch.float64).to_empty(device="cpu")
        ref.reset_parameters()
        bound = got.in_features ** -0.5
        for p, want in ((got.weight, ref.weight), (got.bias, ref.bias)):
            assert torch.equal(p, want), name
            assert torch.isfinite(p).all() and p.abs().max() <= bound and p.abs().max() > 0.8 * bound, name
    q, k, v = torch.randn(2, 5, 32, dtype=torch.float64), torch.randn(2, 7, 24, dtype=torch.float64), torch.randn(2, 7, 40, dtype=torch.float64)
    expect, _ = manual_forward(mha, q, k, v)
    out = mha(q, k, v)
    assert out.shape == (2, 5, 16) and (out - expect).abs().max() < 1e-12


def test_batch_first_is_true_and_read_only():
    mha = mh.MultiHeadAttention(8, 2)
    assert mha.batch_first is True
    with pytest.raises(AttributeError):
        mha.batch_first = False
