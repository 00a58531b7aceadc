"""The Hugging Face integration takes a flex-attention ``BlockMask`` as ``attention_mask`` (what
transformers' flex path passes): against torch's own ``flex_attention`` with the same block
mask (its definition of what a BlockMask means) and a dense float64 reference built from the
mask_mod, one element at a time."""

import pytest
import torch

pytest.importorskip("transformers")
flex_attention_mod = pytest.importorskip("torch.nn.attention.flex_attention")

import multihead as mh  # noqa: E402
from multihead.integrations import transformers as mh_tf  # noqa: E402
from oracle import one_thread  # noqa: E402

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

DOC = torch.tensor([0] * 70 + [1] * 90 + [2] * 96)  # 256 tokens, three documents


def doc_causal(b, h, q, kv):
    return (DOC[q] == DOC[kv]) & (kv <= q)


class Layer(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 2


@pytest.mark.parametrize("broadcast", [True, False])
def test_block_mask_equals_flex_attention_and_the_dense_reference(broadcast):
    torch.manual_seed(0)
    B, H, Hkv, L, D = 2, 4, 2, 256, 16
    q = torch.randn(B, H, L, D, dtype=torch.float64)
    k, v = (torch.randn(B, Hkv, L, D, dtype=torch.float64) for _ in range(2))
    bm = flex_attention_mod.create_block_mask(doc_causal, None if broadcast else B, None if broadcast else H, L, L,
                                              device="cpu", BLOCK_SIZE=64)
    layer = Layer().eval()
    with torch.no_grad():
        got, weights = mh_tf.attention_forward(layer, q, k, v, bm)
        want = flex_attention_mod.flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    assert weights is None
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=0, atol=1e-12)
    i = torch.arange(L)
    keep = doc_causal(0, 0, i[:, None], i[None, :])
    dense = mh.attention(q, k, v, keep, backend="reference")
    torch.testing.assert_close(got, dense.transpose(1, 2), rtol=0, atol=1e-12)


def test_a_block_mask_for_other_heads_is_refused_by_name():
    bm = flex_attention_mod.create_block_mask(doc_causal, 1, 3, 256, 256, device="cpu")
    q = torch.randn(1, 4, 256, 16)
    with pytest.raises(ValueError, match="H=4 does not match the block mask's H=3"):
        mh_tf.attention_forward(Layer(), q, q[:, :2], q[:, :2], bm)
