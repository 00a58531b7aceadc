"""RoPE's peer variants against the peers' own rotary functions (transformers):

* GPT-J's interleaved layout and partial ``rotary_dim``: ``modeling_gptj.apply_rotary_pos_emb``
  with its ``create_sinusoidal_positions`` tables, given to our RoPE as ``tables=``;
* GPT-NeoX's partial rotation (rotate-half on the first ``rotary_dim`` coordinates):
  ``modeling_gpt_neox.apply_rotary_pos_emb``;
* per-row (B, L) positions: Llama's ``apply_rotary_pos_emb`` with cos/sin gathered per row;
* ``from_hf`` of a StableLM layer (``partial_rotary_factor``, ``rotary_ndims``) against the
  layer itself, both given the model's own cos/sin.

Given the same tables the two sides run the same float64 products (the peers' in another
order), so they agree to 1e-12. Our own tables (float64 angles) against the peers' float32 ones
are compared with the float32 bound of tests/integrations/test_hf_rope.py."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.models.gpt_neox import modeling_gpt_neox  # noqa: E402
from transformers.models.gptj import modeling_gptj  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

import multihead as mh  # noqa: E402
from multihead.rope import RoPE  # noqa: E402
from oracle import one_thread  # noqa: E402

pytestmark = pytest.mark.usefixtures(one_thread.__name__)
F64 = 1e-12


def gptj_tables(L, rotary_dim):
    """GPT-J's own (sin, cos), each (L, rotary_dim / 2), float32 as it builds them."""
    sincos = modeling_gptj.create_sinusoidal_positions(L, rotary_dim)
    return torch.split(sincos, rotary_dim // 2, dim=-1)


@pytest.mark.parametrize("rotary_dim", [16, 8])
def test_interleaved_and_partial_equal_gptj(rotary_dim):
    B, H, L, D = 2, 3, 9, 16
    torch.manual_seed(0)
    x = torch.randn(B, H, L, D, dtype=torch.float64)
    sin, cos = (t.double() for t in gptj_tables(32, rotary_dim))
    rope = RoPE(D, interleaved=True, rotary_dim=rotary_dim, tables=(cos, sin))
    pos = torch.arange(L)
    # GPT-J: (B, L, H, D), the first rotary_dim coordinates rotated, the rest passed (its attention's split)
    xt = x.transpose(1, 2)
    rot = modeling_gptj.apply_rotary_pos_emb(xt[..., :rotary_dim], sin[pos][None], cos[pos][None])
    want = torch.cat([rot, xt[..., rotary_dim:]], -1).transpose(1, 2)
    torch.testing.assert_close(rope(x), want, rtol=0, atol=F64)
    # our own float64 tables agree with GPT-J's float32 ones to float32's rounding of the angle
    ours = RoPE(D, interleaved=True, rotary_dim=rotary_dim)
    c, s = ours.cos_sin(32, dtype=torch.float64)
    angle = torch.arange(32.0, dtype=torch.float64)[:, None]
    bound = (angle + 1) * 4 * torch.finfo(torch.float32).eps
    assert ((c[:, ::2] - cos).abs() <= bound).all() and ((s[:, ::2] - sin).abs() <= bound).all()


@pytest.mark.parametrize("rotary_dim", [16, 4])
def test_partial_rotate_half_equals_gpt_neox(rotary_dim):
    B, H, L, D = 2, 2, 7, 16
    torch.manual_seed(1)
    q, k = torch.randn(2, B, H, L, D, dtype=torch.float64)
    rope = RoPE(D, 500.0, rotary_dim=rotary_dim)
    cos, sin = rope.cos_sin(L, offset=3, dtype=torch.float64)  # (L, rotary_dim), rotate-half layout
    want_q, want_k = modeling_gpt_neox.apply_rotary_pos_emb(q, k, cos[None].expand(B, L, -1), sin[None].expand(B, L, -1))
    torch.testing.assert_close(rope(q, 3), want_q, rtol=0, atol=F64)
    torch.testing.assert_close(rope(k, 3), want_k, rtol=0, atol=F64)
    assert torch.equal(rope(q)[..., rotary_dim:], q[..., rotary_dim:])  # the pass-through part is untouched


@pytest.mark.parametrize("interleaved", [False, True])
def test_per_row_positions_equal_llama_gathered_per_row(interleaved):
    B, H, L, D = 3, 2, 5, 8
    torch.manual_seed(2)
    q, k = torch.randn(2, B, H, L, D, dtype=torch.float64)
    pos = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11], [2, 2, 0, 5, 1]])
    rope = RoPE(D, interleaved=interleaved)
    got = rope(q, positions=pos)
    for b in range(B):  # each row alone, with its own (L,) positions
        torch.testing.assert_close(got[b:b + 1], rope(q[b:b + 1], positions=pos[b]), rtol=0, atol=0)
    if not interleaved:  # Llama's rotate-half rotation with cos/sin gathered at position_ids (B, L)
        cos, sin = rope.cos_sin(12, dtype=torch.float64)
        want, _ = modeling_llama.apply_rotary_pos_emb(q, k, cos[pos], sin[pos])
        torch.testing.assert_close(got, want, rtol=0, atol=F64)


def test_module_with_interleaved_partial_rope_round_trips_its_config_and_decodes():
    m = mh.MultiHeadAttention(32, 2, causal=True, rope=True, rope_interleaved=True, rope_dim=8,
                              dtype=torch.float64).eval()
    assert m.rope.interleaved and m.rope.rotary_dim == 8
    twin = mh.MultiHeadAttention.from_config(m.config, m.state_dict())
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    cache = mh.KVCache(8)
    with torch.no_grad():
        full = m(x)
        torch.testing.assert_close(twin(x), full, rtol=0, atol=0)
        steps = torch.cat([m(x[:, :3], cache=cache)] + [m(x[:, t:t + 1], cache=cache) for t in range(3, 6)], 1)
    torch.testing.assert_close(steps, full, rtol=0, atol=F64)


def test_bad_rope_variants_are_refused_by_name():
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        RoPE(16, rotary_dim=5)
    with pytest.raises(ValueError, match="rotary_dim must be even and <= head_dim=16"):
        RoPE(16, rotary_dim=18)
    with pytest.raises(ValueError, match=r"tables' cos must be \(Lmax, rotary_dim / 2\)"):
        RoPE(16, tables=(torch.zeros(4, 16), torch.zeros(4, 16)))
    with pytest.raises(ValueError, match="they hold 4 positions"):
        RoPE(16, tables=(torch.zeros(4, 8), torch.zeros(4, 8)))(torch.zeros(1, 1, 5, 16))
    with pytest.raises(ValueError, match=r"positions must have shape \(L,\) = \(3,\) or \(B, L\) = \(1, 3\)"):
        RoPE(16)(torch.zeros(1, 1, 3, 16), positions=torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="rope_dim must be even"):
        mh.MultiHeadAttention(32, 2, rope=True, rope_dim=3)
    with pytest.raises(ValueError, match="rope=False"):
        mh.MultiHeadAttention(32, 2, rope_interleaved=True)


def test_from_hf_stablelm_partial_rotary_equals_the_layer():
    from transformers.models.stablelm import modeling_stablelm

    config = transformers.StableLmConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                         intermediate_size=96, num_hidden_layers=1, vocab_size=11,
                                         partial_rotary_factor=0.25, max_position_embeddings=64)
    config._attn_implementation = "sdpa"
    torch.manual_seed(3)
    attn = modeling_stablelm.StableLmAttention(config, layer_idx=0).double().eval()
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.2)
    mha = mh.MultiHeadAttention.from_hf(attn)
    assert mha.config.rope_dim == attn.rotary_ndims == 4
    L = 10
    x = torch.randn(2, L, 64, dtype=torch.float64)
    rotary = modeling_stablelm.StableLmRotaryEmbedding(config)
    cos, sin = (t.double() for t in rotary(x, torch.arange(L)[None]))  # (1, L, 4): the model's own
    mha.rope = RoPE(16, rotary_dim=4, tables=(cos[0, :, :2], sin[0, :, :2]))
    blocked = ~torch.ones(L, L, dtype=torch.bool).tril()
    bias = torch.zeros(1, 1, L, L, dtype=torch.float64).masked_fill(blocked, torch.finfo(torch.float64).min)
    with torch.no_grad():
        want, _ = attn(x, position_embeddings=(cos, sin), attention_mask=bias)
        got = mha(x)
    torch.testing.assert_close(got, want, rtol=0, atol=F64)
