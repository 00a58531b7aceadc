"""The Hugging Face integration passes Gemma 2's ``softcap`` and gpt-oss's ``s_aux`` (learned
sinks) through as multihead masks: tiny random models built here (no downloads), in float64,
match transformers' eager attention, with sliding-window layers, padding and output_attentions.

Eager Gemma 2 upcasts its softmax to float32 (a float64 model included); the comparisons run it
with that upcast left out (``float64_softmax``), so both sides are float64 and agree to 1e-12.
gpt-oss's experts have no float64 kernel on CPU: its models here have the MLP blocks replaced by
zero (the attention, its sinks and its sliding layers are what is compared).

Legend: B batch, L tokens, H query heads, Hkv key/value heads, D head dim.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import multihead  # noqa: E402
from multihead import masks  # noqa: E402
from multihead.integrations import transformers as mh_tf  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def registered():
    mh_tf.register()


@pytest.fixture(autouse=True)
def float64_softmax(monkeypatch):
    """torch's softmax without a float32 ``dtype=`` for float64 inputs (eager Gemma 2's upcast)."""
    plain = torch.nn.functional.softmax

    def softmax(x, dim=None, *args, dtype=None, **kwargs):
        if x.dtype == torch.float64 and dtype == torch.float32:
            dtype = None
        return plain(x, dim, *args, dtype=dtype, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "softmax", softmax)


class _NoMLP(torch.nn.Module):
    def forward(self, x):
        return torch.zeros_like(x), None


def _gemma2(impl):
    config = transformers.Gemma2Config(
        vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8, sliding_window=3,
        attn_logit_softcapping=1.5, final_logit_softcapping=None, max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return transformers.Gemma2Model._from_config(config, attn_implementation=impl).double().eval()


def _gpt_oss(impl):
    config = transformers.GptOssConfig(
        vocab_size=61, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=3, num_local_experts=2, num_experts_per_tok=1,
        max_position_embeddings=32, layer_types=["sliding_attention", "full_attention"],
    )
    torch.manual_seed(0)
    model = transformers.GptOssModel._from_config(config, attn_implementation=impl)
    for layer in model.layers:
        layer.mlp = _NoMLP()
    model = model.double().eval()
    with torch.no_grad():
        for layer in model.layers:  # random sinks: the default zeros would hide a missing term less
            layer.self_attn.sinks.copy_(torch.randn(4, dtype=torch.float64) * 2)
    return model


@pytest.mark.parametrize("build", [_gemma2, _gpt_oss], ids=["gemma2", "gpt_oss"])
@pytest.mark.parametrize("padded", [False, True])
def test_tiny_model_on_multihead_matches_eager(build, padded):
    eager, ours = build("eager"), build("multihead")
    ours.load_state_dict(eager.state_dict())
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones(2, 9, dtype=torch.long)
    if padded:
        attention_mask[1, :3] = 0  # left padding: its rows see no key and differ by definition
    with torch.no_grad():
        want = eager(input_ids=ids, attention_mask=attention_mask).last_hidden_state
        got = ours(input_ids=ids, attention_mask=attention_mask).last_hidden_state
    real = attention_mask.bool()
    assert (got - want)[real].abs().max() <= 1e-12


@pytest.mark.parametrize("build", [_gemma2, _gpt_oss], ids=["gemma2", "gpt_oss"])
def test_output_attentions_match_eager(build):
    eager, ours = build("eager"), build("multihead")
    ours.load_state_dict(eager.state_dict())
    ids = torch.randint(0, 61, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = eager(input_ids=ids, output_attentions=True).attentions
        got = ours(input_ids=ids, output_attentions=True).attentions
    for w, g in zip(want, got):
        assert (g - w).abs().max() <= 1e-12


def test_gradients_reach_the_sinks_as_in_eager():
    eager, ours = _gpt_oss("eager"), _gpt_oss("multihead")
    ours.load_state_dict(eager.state_dict())
    ids = torch.randint(0, 61, (1, 6), generator=torch.Generator().manual_seed(3))
    for model in (eager, ours):
        model(input_ids=ids).last_hidden_state.square().sum().backward()
    for le, lo in zip(eager.layers, ours.layers):
        assert (le.self_attn.sinks.grad - lo.self_attn.sinks.grad).abs().max() <= 1e-12


class _Layer(torch.nn.Module):
    num_key_value_groups = 1
    is_causal = True


def test_softcap_comes_before_a_float_mask_bias_as_in_eager():
    """Eager caps q·kᵀ·scaling, then adds the mask: a bias in the mask is not capped."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g, dtype=torch.float64) * 3 for _ in range(3))
    bias = torch.randn(1, 1, 4, 4, generator=g, dtype=torch.float64) * 4
    bias[..., 0, 3] = torch.finfo(torch.float64).min
    want, _ = eager_attention_forward(_Layer(), q, k, v, bias, scaling=0.5, softcap=2.0)
    got, _ = mh_tf.attention_forward(_Layer(), q, k, v, bias, scaling=0.5, softcap=2.0)
    assert (got - want).abs().max() <= 1e-12


def test_to_mask_builds_the_kinds():
    m = mh_tf.to_mask(None, 3, 3, is_causal=True, softcap=30.0)
    assert [p.kind for p in m.parts] == ["softcap", "causal"]
    out, _ = mh_tf.attention_forward(_Layer(), *(torch.randn(1, 2, 3, 4) for _ in range(3)), None,
                                     s_aux=torch.zeros(2))
    assert out.shape == (1, 3, 2, 4)
    q = torch.randn(1, 2, 3, 4)
    assert "cannot apply softcap" in multihead.explain_dispatch(q, q, q, masks.softcap(30.0)).refused["sdpa"]
