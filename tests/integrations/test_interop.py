import pytest
import torch
import torch.nn as nn

import multihead as mh
from multihead import masks


def torch_mha(E=8, H=2, seed=0, **kw):
    torch.manual_seed(seed)
    return nn.MultiheadAttention(E, H, dtype=torch.float64, **kw).eval()


def run_torch(m, q, k, v, **kw):
    """Call nn.MultiheadAttention on batch-first tensors whatever its batch_first, per-head weights."""
    if not m.batch_first:
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    out, w = m(q, k, v, need_weights=True, average_attn_weights=False, **kw)
    return (out if m.batch_first else out.transpose(0, 1)), w


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_self_attention_matches_torch(batch_first, bias):
    m = torch_mha(batch_first=batch_first, bias=bias)
    ours = mh.MultiHeadAttention.from_torch(m)
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    expect, expect_w = run_torch(m, x, x, x)
    out, w = ours(x, return_weights=True)
    assert (out - expect).abs().max() < 1e-12 and (w - expect_w).abs().max() < 1e-12
    assert (ours(x) - expect).abs().max() < 1e-12


def test_cross_attention_with_kdim_vdim_matches_torch():
    m = torch_mha(E=8, H=4, kdim=5, vdim=3, batch_first=True)
    ours = mh.MultiHeadAttention.from_torch(m)
    q, k, v = torch.randn(2, 4, 8, dtype=torch.float64), torch.randn(2, 6, 5, dtype=torch.float64), torch.randn(2, 6, 3, dtype=torch.float64)
    expect, expect_w = run_torch(m, q, k, v)
    out, w = ours(q, k, v, return_weights=True)
    assert (out - expect).abs().max() < 1e-12 and (w - expect_w).abs().max() < 1e-12


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")
@pytest.mark.parametrize("mask_kind", ["bool", "float", "bool3d"])
def test_masks_convert_from_torch_convention(mask_kind):
    m = torch_mha(H=2, batch_first=True)
    ours = mh.MultiHeadAttention.from_torch(m)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    pad = torch.tensor([[False, False, False, True, True], [False] * 5])  # True = padding (torch)
    if mask_kind == "bool":
        attn = torch.ones(5, 5, dtype=torch.bool).triu(1)  # True = blocked (torch)
    elif mask_kind == "float":
        attn = torch.randn(5, 5, dtype=torch.float64)
    else:
        attn = torch.rand(4, 5, 5) > 0.6
        attn[..., 0] = False
    expect, expect_w = run_torch(m, x, x, x, attn_mask=attn, key_padding_mask=pad)
    mask = masks.from_torch(attn_mask=attn, key_padding_mask=pad)
    out, w = ours(x, mask=mask, return_weights=True)
    assert (out - expect).abs().max() < 1e-12 and (w - expect_w).abs().max() < 1e-12
    assert (ours(x, mask=mask) - expect).abs().max() < 1e-12


def test_fully_masked_rows_nan_in_torch_zero_here():
    m = torch_mha(batch_first=True)
    ours = mh.MultiHeadAttention.from_torch(m)
    x = torch.randn(1, 3, 8, dtype=torch.float64)
    attn = torch.zeros(3, 3, dtype=torch.bool)
    attn[1] = True  # query 1 may attend nothing
    expect, expect_w = run_torch(m.train(), x, x, x, attn_mask=attn)  # train mode: torch's math path
    out, w = ours(x, mask=masks.from_torch(attn_mask=attn), return_weights=True)
    assert torch.isnan(expect_w[0, :, 1]).all()  # upstream behaviour documented in interop.py
    assert torch.equal(w[0, :, 1], torch.zeros_like(w[0, :, 1]))
    # the row's attention output is 0, so the layer output is W_O's bias there
    assert torch.allclose(out[0, 1], m.out_proj.bias, rtol=0, atol=1e-15)
    rows = [0, 2]
    assert (out[0, rows] - expect[0, rows]).abs().max() < 1e-12


@pytest.mark.parametrize("kw", [dict(), dict(kdim=5, vdim=3), dict(bias=False)])
def test_to_torch_round_trip(kw):
    torch.manual_seed(0)
    ours = mh.MultiHeadAttention(8, 2, dtype=torch.float64, **kw)
    m = ours.to_torch(batch_first=True)
    q = torch.randn(2, 4, 8, dtype=torch.float64)
    k = torch.randn(2, 6, ours.config.kdim, dtype=torch.float64)
    v = torch.randn(2, 6, ours.config.vdim, dtype=torch.float64)
    expect, _ = run_torch(m, q, k, v)
    assert (ours(q, k, v) - expect).abs().max() < 1e-12
    back = mh.MultiHeadAttention.from_torch(m)
    for (name, a), (_, b) in zip(ours.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(
    "kw,match",
    [(dict(d_out=12), "d_out=12 differs from d_in=8"), (dict(num_kv_heads=1), "num_kv_heads=1"), (dict(causal=True), "causal=True")],
)
def test_to_torch_refuses_what_torch_cannot_express(kw, match):
    ours = mh.MultiHeadAttention(8, 2, **kw)
    with pytest.raises(ValueError, match=match):
        ours.to_torch()


def test_from_torch_refuses_unsupported_options():
    with pytest.raises(ValueError, match="add_bias_kv"):
        mh.MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2, add_bias_kv=True))
    with pytest.raises(ValueError, match="add_zero_attn"):
        mh.MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2, add_zero_attn=True))
    with pytest.raises(TypeError, match="takes an nn.MultiheadAttention"):
        mh.MultiHeadAttention.from_torch(nn.Linear(2, 2))


# ---------------------------------------------------------------------------- codecs: (config, weights)
CODECS = ("interop", "hf", "per_head")

# Run in a fresh interpreter with the package's __init__ skipped (it imports everything): only what
# the codecs themselves import is loaded. Each codec is called, since a converter may import lazily.
_CODECS_ALONE = r"""
import sys, types
pkg = types.ModuleType("multihead")
pkg.__path__ = [sys.argv[1]]
sys.modules["multihead"] = pkg
import torch, torch.nn as nn
from multihead import hf, interop, per_head

def check(step):
    loaded = sorted(k for k in sys.modules if k.startswith("multihead."))
    assert "multihead.module" not in loaded, f"{step} imported multihead.module; loaded: {loaded}"

pair = interop.from_torch(nn.MultiheadAttention(8, 2))
check("interop.from_torch")
config, weights = pair
interop.to_torch(config, weights)
check("interop.to_torch")
config, weights = per_head.from_per_head(per_head.to_per_head(config, weights))
check("per_head.to_per_head/from_per_head")

class Self(nn.Module):  # the layout of a BertSelfAttention
    def __init__(self):
        super().__init__()
        self.num_attention_heads = 2
        self.query, self.key, self.value = (nn.Linear(8, 8) for _ in range(3))

hf.from_hf(Self(), output_dense=nn.Linear(8, 8))
check("hf.from_hf")
print("codecs ran without multihead.module")
"""


def test_codecs_do_not_import_the_module():
    """The converters exchange (AttentionConfig, weights): neither importing them nor running them
    loads multihead.module (the module imports them, for its thin wrappers, never the reverse)."""
    import ast
    import pathlib
    import subprocess
    import sys

    package = pathlib.Path(mh.__file__).parent
    for name in CODECS:
        tree = ast.parse((package / f"{name}.py").read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = node.module or ""
                assert not (node.level == 1 and target == "module") and target != "multihead.module", (
                    f"{name}.py line {node.lineno} imports the module"
                )
    done = subprocess.run([sys.executable, "-c", _CODECS_ALONE, str(package)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "codecs ran without multihead.module" in done.stdout


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("kw", [dict(), dict(kdim=5, vdim=3), dict(bias=False), dict(dropout=0.25)])
def test_from_torch_and_to_torch_codecs_round_trip_exactly(batch_first, kw):
    """nn.MultiheadAttention -> (config, weights) -> nn.MultiheadAttention: the same state_dict and
    the same outputs, bit for bit; the module built from the pair equals the wrapper's and its own
    rebuild from (mha.config, mha.state_dict())."""
    from multihead import interop

    m = torch_mha(E=8, H=2, batch_first=batch_first, **kw)
    config, weights = interop.from_torch(m)
    assert config == mh.AttentionConfig(d_in=8, num_heads=2, kdim=kw.get("kdim"), vdim=kw.get("vdim"),
                                        bias=kw.get("bias", True), dropout=kw.get("dropout", 0.0))
    assert list(weights) == list(config.weight_shapes())
    mha = mh.MultiHeadAttention.from_config(config, weights).eval()
    back = interop.to_torch(config, mha.state_dict(), batch_first=batch_first).eval()
    assert back.batch_first == batch_first and list(back.state_dict()) == list(m.state_dict())
    for name, t in m.state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name
    q = torch.randn(2, 4, 8, dtype=torch.float64)
    k, v = torch.randn(2, 6, config.kdim, dtype=torch.float64), torch.randn(2, 6, config.vdim, dtype=torch.float64)
    assert torch.equal(run_torch(back, q, k, v)[0], run_torch(m, q, k, v)[0])
    wrapped = mh.MultiHeadAttention.from_torch(m)
    twin = mh.MultiHeadAttention.from_config(mha.config, mha.state_dict()).eval()
    assert wrapped.config == twin.config == config and not wrapped.training  # the wrapper keeps m's mode
    assert torch.equal(wrapped(q, k, v), mha(q, k, v)) and torch.equal(twin(q, k, v), mha(q, k, v))
    via_wrapper = mha.to_torch(batch_first=batch_first)
    assert not via_wrapper.training and all(torch.equal(via_wrapper.state_dict()[n], t) for n, t in back.state_dict().items())


def test_to_torch_codec_names_weights_that_do_not_fit():
    from multihead import interop

    config = mh.AttentionConfig(d_in=8, num_heads=2)
    with pytest.raises(ValueError, match=r"weights lacks q_proj\.weight \(shape \(8, 8\)\)"):
        interop.to_torch(config, {})
    weights = mh.MultiHeadAttention(8, 2, kdim=4).state_dict()
    with pytest.raises(ValueError, match=r"weights\['k_proj\.weight'\] has shape \(8, 4\) but this config needs \(kv_dim, kdim\) = \(8, 8\)"):
        interop.to_torch(config, weights)
    with pytest.raises(ValueError, match="num_kv_heads=1"):
        interop.to_torch(mh.AttentionConfig(d_in=8, num_heads=2, num_kv_heads=1), {})
