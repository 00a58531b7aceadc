"""The flex backend (torch's FlexAttention): its translation of every mask kind it accepts,
its block masks, the compiled path and its compile cache, its refusals and ``auto``'s rule.

* Translation: ``flex.run(..., compiled=False)`` runs torch's unfused FlexAttention on the
  mask_mod/score_mod/BlockMask the backend builds, in float64 on the CPU, against the
  independent float64 reference of ``ref64`` built from each kind's definition (1e-12).
* The compiled path (torch inductor, CPU inference): one small case per compile, judged by the
  oracle's rule (``oracle.judge``) in float32, and called again with new values of the same
  shapes: dynamo's counters show no new graph. A CPU compile takes 5-40 s, so the file compiles
  as few graphs as it can (module-scoped).
* On CUDA (where this machine has one) the compiled path trains too: outputs and gradients
  against the oracle (these parameters are absent on a machine without CUDA).

Legend: B batch, H query heads, Hkv key/value heads, Lq/Lk query/key lengths, D head dim.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch._dynamo.utils import counters

import multihead
from multihead import backends, masks
from multihead.backends import flex
from oracle import judge, naive_attention, score_size
from ref64 import attention64, causal_keep, random_qkv, window_keep

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
TOL = 1e-12


@pytest.fixture
def hop_directly(monkeypatch):
    """torch's unfused FlexAttention called without dynamo's eager tracing (its debug switch): the
    same dense evaluation of our mask_mod/score_mod, without a trace per new mask structure."""
    monkeypatch.setattr(flex._flex(), "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)


def eager(q, k, v, mask, scale=None):
    """The backend's translation run by torch's unfused FlexAttention (no compile)."""
    m = masks.as_mask(mask)
    if m is not None:
        m.check((q.shape[0], q.shape[1], q.shape[2], k.shape[2]), q.device)
    return flex.run(q, k, v, m, scale=q.shape[-1] ** -0.5 if scale is None else scale, compiled=False)


def assert_close64(got, want, tol=TOL):
    assert got.shape == want.shape
    err = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    assert err <= tol, f"max error {err:.3e} > {tol:.0e}"


# ---------------------------------------------------------------- translation, float64, vs the definition
def _cases(B, H, Lq, Lk, g):
    """(name, multihead mask, dense keep or None, dense bias or None), each from its definition."""
    pad = torch.rand(B, Lk, generator=g) < 0.8
    pad[:, 0] = True
    keep = torch.rand(B, 1, Lq, Lk, generator=g) < 0.7
    bias = torch.randn(H, Lq, Lk, generator=g, dtype=torch.float64)
    bias[0, 3] = -math.inf  # a row that only the bias blinds
    heads3d = torch.rand(B * H, Lq, Lk, generator=g) < 0.4  # nn.MultiheadAttention's (True = blocked)
    causal = causal_keep(Lq, Lk)
    return [
        ("none", None, None, None),
        ("causal", masks.causal(), causal, None),
        ("causal top_left", masks.causal("top_left"), causal_keep(Lq, Lk, "top_left"), None),
        ("window", masks.window(37), window_keep(Lq, Lk, 37, 0), None),
        ("window two-sided", masks.window(20, 9, align="top_left"), window_keep(Lq, Lk, 20, 9, "top_left"), None),
        ("padding & causal", masks.key_padding(pad) & masks.causal(), pad[:, None, None, :] & causal, None),
        ("keep", masks.keep(keep), keep, None),
        ("bias & causal", masks.bias(bias) & masks.causal(), causal, bias),
        ("bias & bias & window", masks.bias(bias) & masks.window(50) & masks.bias(bias[:1] * 2),
         window_keep(Lq, Lk, 50, 0), bias + 2 * bias[:1]),
        ("torch 3-D", masks.from_torch(heads3d), ~heads3d.view(B, H, Lq, Lk), None),
        ("torch float 3-D", masks.from_torch(heads3d.double() * -2.5), None, heads3d.view(B, H, Lq, Lk).double() * -2.5),
    ]


@pytest.mark.parametrize("lengths", [(200, 200), (100, 260), (300, 140)], ids=["square", "Lq<Lk", "Lq>Lk"])
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
def test_translation_matches_the_definition_float64(lengths, gqa, hop_directly):
    """Lengths that are not multiples of the 128-key tiles, queries ending on the last key and not."""
    Lq, Lk = lengths
    B, H = 2, 4
    q, k, v = random_qkv(B=B, H=H, Hkv=2 if gqa else H, Lq=Lq, Lk=Lk, D=16, seed=1)
    for name, mask, keep, bias in _cases(B, H, Lq, Lk, torch.Generator().manual_seed(2)):
        want, _ = attention64(q, k, v, keep, bias)
        assert_close64(eager(q, k, v, mask), want), name


def test_rows_with_no_visible_key_give_zero():
    q, k, v = random_qkv(B=1, H=2, Lq=140, Lk=60, D=16, seed=3)
    out = eager(q, k, v, masks.causal())  # bottom-right: the first 80 queries see no key
    assert torch.equal(out[:, :, :80], torch.zeros_like(out[:, :, :80]))
    want, _ = attention64(q, k, v, causal_keep(140, 60))
    assert_close64(out, want)


def test_empty_sequences():
    q, k, v = random_qkv(B=1, H=2, Lq=5, Lk=7, D=16)
    out = flex.run(q, k[:, :, :0], v[:, :, :0], None, scale=0.25)
    assert torch.equal(out, torch.zeros(1, 2, 5, 16, dtype=torch.float64))
    out, lse = flex.run(q[:, :, :0], k, v, None, scale=0.25, return_lse=True)
    assert out.shape == (1, 2, 0, 16) and lse.shape == (1, 2, 0)


def test_lse_of_the_unfused_path_is_the_log_sum_exp_of_the_final_scores():
    q, k, v = random_qkv(B=1, H=2, Lq=70, Lk=90, D=16, seed=4)
    bias = torch.randn(70, 90, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    _, lse = flex.run(q, k, v, masks.bias(bias) & masks.causal(), scale=0.25, compiled=False, return_lse=True)
    s = (q @ k.transpose(-1, -2)) * 0.25 + bias
    s = s.masked_fill(~causal_keep(70, 90), -math.inf)
    assert_close64(lse, torch.logsumexp(s, dim=-1))


# ---------------------------------------------------------------- block masks
def _dense_tiles(keep, block):
    """(nq, nk) 0 empty / 1 partial / 2 full of a dense (Lq, Lk) keep, tile by tile."""
    lq, lk = keep.shape
    out = []
    for q0 in range(0, lq, block):
        row = []
        for k0 in range(0, lk, block):
            t = keep[q0:q0 + block, k0:k0 + block]
            row.append(2 if t.all() else 1 if t.any() else 0)
        out.append(row)
    return out


def _states(bm, b=0):
    """(nq, nk) 0/1/2 of a BlockMask: to_dense marks partial and full blocks, full ones add 1."""
    full = flex._flex()._ordered_to_dense(bm.full_kv_num_blocks, bm.full_kv_indices, bm.full_kv_indices.shape[-1])
    return (bm.to_dense()[b, 0].int() + full[b, 0].int()).tolist()


@pytest.mark.parametrize("mask, keep", [
    (masks.causal(), causal_keep(300, 520)),
    (masks.causal("top_left"), causal_keep(300, 520, "top_left")),
    (masks.window(100, 30), window_keep(300, 520, 100, 30)),
    (masks.causal() & masks.window(150), causal_keep(300, 520) & window_keep(300, 520, 150, 0)),
], ids=["causal", "causal top_left", "window", "causal & window"])
def test_block_mask_tiles_are_those_of_the_dense_mask(mask, keep):
    bm = flex.to_block_mask(mask, 1, 1, 300, 520, device=torch.device("cpu"), block_size=64)
    assert bm.shape == (1, 1, 300, 520) and bm.BLOCK_SIZE == (64, 64)
    assert _states(bm) == _dense_tiles(keep, 64)


def test_block_mask_of_a_tensor_mask_reads_its_tiles():
    keep = torch.zeros(2, 1, 256, 384, dtype=torch.bool)
    keep[0, :, :128, :128] = True          # tile (0, 0): full in batch 0, empty in batch 1 -> partial
    keep[:, :, 128:, 256:] = True          # tile (1, 2): full everywhere
    keep[1, :, 130, 140] = True            # tile (1, 1): one key -> partial
    bm = flex.to_block_mask(masks.keep(keep), 2, 1, 256, 384, device=torch.device("cpu"))
    assert _states(bm) == [[1, 0, 0], [0, 1, 2]]


def test_block_mask_is_accepted_by_flex_attention_with_its_mask_mod():
    q, k, v = random_qkv(B=1, H=2, Lq=256, Lk=256, D=16, seed=6)
    bm = flex.to_block_mask(masks.window(40), 1, 2, 256, 256, device=torch.device("cpu"))
    out = flex._flex().flex_attention(q, k, v, block_mask=bm)
    assert_close64(out, attention64(q, k, v, window_keep(256, 256, 40, 0))[0])


@pytest.mark.parametrize("args, error, words", [
    ((masks.causal(), 0, 1, 8, 8), ValueError, "B must be positive"),
    ((masks.causal(), 1, 1, 8, 2.5), TypeError, "Lk must be an int"),
    (("causal", 1, 1, 8, 8), TypeError, "to_block_mask's mask must be None, a multihead.masks mask"),
    ((masks.key_padding(torch.ones(2, 9, dtype=torch.bool)), 2, 1, 8, 8), ValueError, "key padding"),
])
def test_to_block_mask_bad_input(args, error, words):
    with pytest.raises(error, match=words):
        flex.to_block_mask(*args, device=torch.device("cpu"))


def test_to_block_mask_bad_block_size():
    with pytest.raises(ValueError, match="block_size must be positive"):
        flex.to_block_mask(masks.causal(), 1, 1, 8, 8, device=torch.device("cpu"), block_size=0)


# ---------------------------------------------------------------- the compiled path (CPU inference)
@pytest.fixture(scope="module")
def compiled_case():
    """One compile: causal & key padding & bias (a mask_mod of two parts and a score_mod),
    B=2, H=4, Hkv=2 (GQA), L=200, float32, through the backend with flex.COMPILE on."""
    g = torch.Generator().manual_seed(7)
    pad = torch.ones(2, 200, dtype=torch.bool)
    pad[1, 150:] = False

    def make(seed):
        q, k, v = random_qkv(B=2, H=4, Hkv=2, Lq=200, D=16, dtype=torch.float32, seed=seed)
        bias = torch.randn(4, 200, 200, generator=g)
        return q, k, v, bias

    saved = flex.COMPILE
    flex.COMPILE = True
    try:
        yield make
    finally:
        flex.COMPILE = saved


def _judge_compiled(q, k, v, bias, pad, out):
    keep = causal_keep(200, 200) & pad[:, None, None, :]
    keep = keep.expand(2, 4, 200, 200)
    bias4 = bias.expand(2, 4, 200, 200)
    scale = 16 ** -0.5

    def naive(dt):
        return naive_attention(q, k, v, keep, bias4, scale, dt)

    verdict = judge("flex compiled", out, naive(torch.float64), naive, torch.float32,
                    score_size=score_size(q.double(), k.double().repeat_interleave(2, 1), keep, bias4.double(), scale),
                    head_dim=16)
    assert verdict.ok, str(verdict)


def test_compiled_inference_matches_the_oracle_and_does_not_recompile(compiled_case):
    pad = torch.ones(2, 200, dtype=torch.bool)
    pad[1, 150:] = False
    q, k, v, bias = compiled_case(8)
    mask = masks.causal() & masks.key_padding(pad) & masks.bias(bias)
    with torch.no_grad():
        out = multihead.attention(q, k, v, mask, backend="flex")
    _judge_compiled(q, k, v, bias, pad, out)
    graphs = counters["stats"]["unique_graphs"]
    frames = dict(counters["frames"])
    for seed in (9, 10):  # new values, new tensors, same shapes: the compiled kernel is reused
        q, k, v, bias = compiled_case(seed)
        pad = torch.rand(2, 200, generator=torch.Generator().manual_seed(seed)) < 0.9
        pad[:, 0] = True
        mask = masks.causal() & masks.key_padding(pad) & masks.bias(bias)
        with torch.no_grad():
            out = multihead.attention(q, k, v, mask, backend="flex")
        _judge_compiled(q, k, v, bias, pad, out)
    assert counters["stats"]["unique_graphs"] == graphs, "a call of the same shapes compiled again"
    assert dict(counters["frames"]) == frames
    with torch.inference_mode():  # inference tensors: torch's guards compile once more for them
        out = multihead.attention(q, k, v, mask, backend="flex")
    _judge_compiled(q, k, v, bias, pad, out)


# ---------------------------------------------------------------- refusals and auto
def _call(q, k, v, mask=None, dropout_p=0.0, need_weights=False, compiling=None):
    return backends.Call(q, k, v, masks.as_mask(mask), dropout_p, need_weights, compiling)


def test_refusals_name_the_reason_and_the_alternative():
    q, k, v = random_qkv(B=1, H=2, Lq=8, D=16, dtype=torch.float32)
    why = flex._refuses
    assert "no dropout" in why(_call(q, k, v, dropout_p=0.1))
    assert "attention weights" in why(_call(q, k, v, need_weights=True))
    assert "training on the CPU" in why(_call(q.requires_grad_(), k, v)) and "backend='chunked'" in why(_call(q, k, v))
    with torch.no_grad():
        assert why(_call(q, k, v)) is None  # inference: accepted
    q = q.detach()
    bias = torch.zeros(8, 8, requires_grad=True)
    assert "training on the CPU" in why(_call(q, k, v, masks.bias(bias)))  # a bias that learns trains too
    q64, k64, v64 = random_qkv(B=1, H=2, Lq=8, D=16)
    saved = flex.COMPILE
    try:
        flex.COMPILE = True
        assert "float32, float16 or bfloat16, not torch.float64" in why(_call(q64, k64, v64))
        flex.COMPILE = False
        assert why(_call(q64, k64, v64)) is None  # torch's unfused path takes float64
    finally:
        flex.COMPILE = saved
    meta = [t.to("meta") for t in (q, k, v)]
    assert "runs on cpu and cuda, not meta" in why(_call(*meta))


def test_asked_by_name_it_raises_what_it_refuses():
    q, k, v = random_qkv(B=1, H=2, Lq=8, D=16, dtype=torch.float32, grad=True)
    with pytest.raises(ValueError, match="backend 'flex' cannot run this call: training on the CPU"):
        multihead.attention(q, k, v, masks.causal(), backend="flex")
    with pytest.raises(ValueError, match="backend 'flex' cannot run this call: torch's flex_attention has no dropout"):
        multihead.attention(q.detach(), k.detach(), v.detach(), dropout_p=0.5, backend="flex")


def test_auto_does_not_pick_flex_on_the_cpu_and_says_why():
    q, k, v = random_qkv(B=1, H=2, Lq=8, D=16, dtype=torch.float32)
    with torch.no_grad():
        d = multihead.explain_dispatch(q, k, v, masks.causal())
    assert d.backend == "sdpa"
    assert "benchmarks/bench_flex.py" in d.refused["flex"] and "flex.AUTO_CPU = False" in d.refused["flex"]


def test_explain_dispatch_says_how_flex_runs():
    q, k, v = random_qkv(B=1, H=2, Lq=300, D=16, dtype=torch.float32)
    pad = torch.ones(1, 300, dtype=torch.bool)
    with torch.no_grad():
        how = flex._describe(_call(q, k, v, masks.causal() & masks.key_padding(pad)))
    assert how.startswith("compiled with torch.compile (inductor) on cpu")
    assert "causal -> mask_mod" in how and "padding -> mask_mod" in how
    # 3 x 3 tiles of 128: the 3 above the diagonal are skipped, the 3 on it need the mask
    assert "block mask of 128x128 tiles: 6 of 9 computed, 3 of them without the mask_mod" in how


@pytest.mark.parametrize("device", DEVICES)
def test_backend_name_is_registered_and_typed(device):
    assert "flex" in backends.names()
    assert "flex" in backends.BackendName.__args__
    assert backends.AUTO_ORDER.index("sdpa") < backends.AUTO_ORDER.index("flex") < backends.AUTO_ORDER.index("chunked")
