"""The flex backend (torch's FlexAttention): its translation of every mask kind it accepts,
its block masks, the compiled path and its compile cache, its refusals and ``auto``'s rule.

* Translation: ``flex.flex_forward(..., compiled=False)`` runs torch's unfused FlexAttention on the
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
from ref64 import (alibi_bias64, attention64, attention64_mods, causal_keep, chunked_keep, documents_keep, grid_keep,
                   random_qkv, window_keep, window_sinks_keep)

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
        m.check((q.shape[0], q.shape[1], q.shape[2], k.shape[2]), q.device, dtype=q.dtype)
    return flex.flex_forward(q, k, v, m, scale=q.shape[-1] ** -0.5 if scale is None else scale, compiled=False)


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


@pytest.mark.parametrize("lengths, gqa", [((200, 200), True), ((100, 260), False), ((300, 140), True)],
                         ids=["square gqa", "Lq<Lk", "Lq>Lk gqa"])
def test_translation_matches_the_definition_float64(lengths, gqa, hop_directly):
    """Lengths that are not multiples of the 128-key tiles, queries ending on the last key and not."""
    Lq, Lk = lengths
    B, H = 2, 4
    q, k, v = random_qkv(B=B, H=H, Hkv=2 if gqa else H, Lq=Lq, Lk=Lk, D=16, seed=1)
    for name, mask, keep, bias in _cases(B, H, Lq, Lk, torch.Generator().manual_seed(2)):
        want, _ = attention64(q, k, v, keep, bias)
        assert_close64(eager(q, k, v, mask), want), name


def _kinds(B, H, L, g):
    """(name, mask, keep, bias, score_fn, sink) for the issue-13 kinds, each from its definition
    in ref64 (loops over the documents, index grids for the functions)."""
    ids = torch.tensor([0] * 100 + [1] * 120 + [2] * (L - 220))
    ids2 = torch.stack([ids, torch.tensor([0] * 50 + [1] * (L - 100) + [-1] * 50)])  # -1: padding tokens
    table = torch.randn(H, 2 * L, generator=g, dtype=torch.float64)
    sink = torch.randn(H, generator=g, dtype=torch.float64)
    sparse = torch.rand(L, L, generator=g) < 0.01  # rows with no visible key: only the sink is left

    def rel(s, b, h, q, kv):  # a learned relative-position table, read at q - kv
        return s + table[h, q - kv + L]

    def cap(s, b, h, q, kv):
        return 5.0 * torch.tanh(s / 5.0)

    def stripes(b, h, q, kv):
        return ((q - kv) % 3 == 0) | (h == b)

    causal = causal_keep(L, L)
    slopes = masks.alibi_slopes(H).double()
    return [
        ("documents & causal", masks.documents(ids) & masks.causal(), documents_keep(ids, causal="bottom_right"),
         None, None, None),
        ("documents per row & window", masks.documents(ids2) & masks.window(30),
         documents_keep(ids2, window=(30, 0, "bottom_right")), None, None, None),
        ("seqlens & causal & chunked_local", masks.from_seqlens([100, L - 100]) & masks.causal() & masks.chunked_local(64),
         documents_keep(torch.tensor([0] * 100 + [1] * (L - 100)), causal="bottom_right", chunk=(64, "bottom_right")),
         None, None, None),
        ("chunked_local & causal", masks.chunked_local(48) & masks.causal(), chunked_keep(L, L, 48) & causal,
         None, None, None),
        ("window sinks", masks.window(40, sinks=4), window_sinks_keep(L, L, 40, 0, 4), None, None, None),
        ("mask_mod", masks.mask_mod(stripes), grid_keep(stripes, B, H, L, L), None, None, None),
        ("score_mod & causal", masks.score_mod(rel) & masks.causal(), causal, None, rel, None),
        ("softcap & causal", masks.softcap(5.0) & masks.causal(), causal, None, cap, None),
        ("alibi & causal", masks.alibi(slopes) & masks.causal(), causal, alibi_bias64(slopes, L, L), None, None),
        ("sink & causal", masks.sink(sink) & masks.causal(), causal, None, None, sink),
        ("sink & sparse keep", masks.sink(sink) & masks.keep(sparse), sparse, None, None, sink),
        ("sink & bias & score_mod & window", masks.sink(sink) & masks.bias(table[:, :L].unsqueeze(1).expand(H, L, L))
         & masks.score_mod(rel) & masks.window(100), window_keep(L, L, 100, 0), table[:, :L].unsqueeze(1), rel, sink),
    ]


@pytest.mark.parametrize("L", [300, 256], ids=["L=300", "L=256 (the sink key opens a tile)"])
def test_new_kinds_match_their_definition_float64(L, hop_directly):
    B, H = 2, 4
    q, k, v = random_qkv(B=B, H=H, Hkv=2, Lq=L, D=16, seed=11)
    for name, mask, keep, bias, score_fn, sink in _kinds(B, H, L, torch.Generator().manual_seed(12)):
        want, _ = attention64_mods(q, k, v, keep, bias, score_fn=score_fn, sink=sink)
        assert_close64(eager(q, k, v, mask), want), name


def test_documents_with_their_own_key_ids_and_a_sink_float64(hop_directly):
    """A decode-like step over packed documents: 3 new tokens per document after cached ones,
    bottom-right per document, ALiBi aligned per document, a sink."""
    q_ids = torch.tensor([0, 0, 0, 1, 1, 1])
    kv_ids = torch.tensor([0] * 130 + [1] * 70)
    q, k, v = random_qkv(B=1, H=2, Lq=6, Lk=200, D=16, seed=13)
    sink = torch.tensor([0.5, -1.0], dtype=torch.float64)
    keep = documents_keep(q_ids, kv_ids, causal="bottom_right")
    got = eager(q, k, v, masks.documents(q_ids, kv_ids) & masks.causal() & masks.sink(sink))
    assert_close64(got, attention64_mods(q, k, v, keep, sink=sink)[0])


def test_rows_with_no_visible_key_give_zero():
    q, k, v = random_qkv(B=1, H=2, Lq=140, Lk=60, D=16, seed=3)
    out = eager(q, k, v, masks.causal())  # bottom-right: the first 80 queries see no key
    assert torch.equal(out[:, :, :80], torch.zeros_like(out[:, :, :80]))
    want, _ = attention64(q, k, v, causal_keep(140, 60))
    assert_close64(out, want)


def test_empty_sequences():
    q, k, v = random_qkv(B=1, H=2, Lq=5, Lk=7, D=16)
    out = flex.flex_forward(q, k[:, :, :0], v[:, :, :0], None, scale=0.25)
    assert torch.equal(out, torch.zeros(1, 2, 5, 16, dtype=torch.float64))
    out, lse = flex.flex_forward(q[:, :, :0], k, v, None, scale=0.25, return_lse=True)
    assert out.shape == (1, 2, 0, 16) and lse.shape == (1, 2, 0)


def test_lse_of_the_unfused_path_is_the_log_sum_exp_of_the_final_scores():
    q, k, v = random_qkv(B=1, H=2, Lq=70, Lk=90, D=16, seed=4)
    bias = torch.randn(70, 90, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    _, lse = flex.flex_forward(q, k, v, masks.bias(bias) & masks.causal(), scale=0.25, compiled=False, return_lse=True)
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


def test_block_mask_of_nn_multihead_attention_3d_mask_is_read_from_its_tensor():
    heads3d = torch.ones(2 * 2, 256, 256, dtype=torch.bool)  # True = blocked: nothing visible ...
    heads3d[3, 200, 10] = False                               # ... but one key of one head
    bm = flex.to_block_mask(masks.from_torch(heads3d), 2, 2, 256, 256, device=torch.device("cpu"))
    assert _states(bm) == [[0, 0], [1, 0]]


def test_a_plan_the_mask_carries_is_the_block_mask():
    fn = masks.mask_mod(lambda b, h, q, kv: (kv <= q) & (kv > q - 130 * (h + 1)))  # per-head windows
    plan = masks.block_plan(fn, (1, 2, 384, 384))
    bm = flex.to_block_mask(fn.with_plan(plan), 1, 2, 384, 384, device=torch.device("cpu"))
    assert bm.kv_num_blocks.shape == (1, 2, 3)  # per head, as the plan has it
    for h in range(2):
        full = flex._flex()._ordered_to_dense(bm.full_kv_num_blocks, bm.full_kv_indices, 3)[0, h].int()
        assert (bm.to_dense()[0, h].int() + full).tolist() == plan.states[0, h].tolist()


def test_from_block_mask_keeps_torch_mask_mod_and_tiles(hop_directly):
    flexmod = flex._flex()

    def causal_fn(b, h, q, kv):
        return kv <= q

    bm = flexmod.create_block_mask(causal_fn, None, None, 300, 300, device="cpu")
    m = flex.from_block_mask(bm, B=2, H=4)
    shape = (2, 4, 300, 300)
    assert m.plan is not None and m.plan.shape == shape
    assert [m.tile_state(i * 128, min(300, i * 128 + 128), j * 128, min(300, j * 128 + 128), shape)
            for i in range(3) for j in range(3)] == [
        "partial", "empty", "empty", "full", "partial", "empty",
        "partial", "partial", "partial"]  # torch counts the rows past L=300 of the last tile as masked
    q, k, v = random_qkv(B=2, H=4, Lq=300, D=16, seed=14)
    want = attention64(q, k, v, causal_keep(300, 300))[0]
    assert_close64(multihead.attention(q, k, v, m, backend="reference"), want)
    assert_close64(eager(q, k, v, m), want)
    again = flex.to_block_mask(m, 2, 4, 300, 300, device=torch.device("cpu"))  # round trip: the same tiles
    assert torch.equal(again.to_dense(), bm.to_dense())


def test_from_block_mask_bad_input():
    flexmod = flex._flex()
    with pytest.raises(TypeError, match="from_block_mask takes a torch.nn.attention.flex_attention.BlockMask"):
        flex.from_block_mask(torch.ones(2, 2, dtype=torch.bool))
    bm = flexmod.create_block_mask(lambda b, h, q, kv: kv <= q, 2, None, 128, 128, device="cpu")
    with pytest.raises(ValueError, match="B=3 does not match the block mask's B=2"):
        flex.from_block_mask(bm, B=3)


# ---------------------------------------------------------------- the compiled path (CPU inference)
SCALE = 16 ** -0.5


def _combo(seed, L=200):
    """q, k, v (B=2, H=4, Hkv=2, L, D=16, float32), the mask's parts, and the dense keep/bias
    of the definition: documents & causal & key_padding & bias & softcap & sink (a mask_mod of
    three parts, a score_mod of two, and the sink key), new values for each seed."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = random_qkv(B=2, H=4, Hkv=2, Lq=L, D=16, dtype=torch.float32, seed=seed)
    cut = 40 + seed  # document boundaries move with the seed; the shapes stay
    ids = torch.tensor([0] * cut + [1] * (120 - cut) + [2] * (L - 120))
    pad = torch.rand(2, L, generator=g) < 0.9
    bias = torch.randn(4, L, L, generator=g)
    sink = torch.randn(4, generator=g)
    keep = documents_keep(ids, causal="bottom_right").expand(2, 4, L, L) & pad[:, None, None, :]
    return q, k, v, _combo_mask(ids, pad, bias, sink), keep, bias, sink


def _combo_mask(ids, pad, bias, sink):
    return (masks.documents(ids) & masks.causal() & masks.key_padding(pad) & masks.bias(bias)
            & masks.softcap(3.0) & masks.sink(sink))


def _naive_mods(q, k, v, keep, bias, sink, dt):
    """The definition computed in ``dt`` (float32: the naive same-precision reference)."""
    q, k, v = q.to(dt), k.to(dt).repeat_interleave(2, 1), v.to(dt).repeat_interleave(2, 1)
    s = q @ k.transpose(-1, -2) * SCALE + bias.to(dt)
    s = 3.0 * torch.tanh(s / 3.0)
    s = s.masked_fill(~keep, -math.inf)
    col = sink.to(dt).view(1, 4, 1, 1).expand(*s.shape[:3], 1)
    w = torch.softmax(torch.cat([s, col], dim=-1), dim=-1)[..., :-1]
    return w @ v


def _judge_combo(q, k, v, keep, bias, sink, out):
    def naive(dt):
        return _naive_mods(q, k, v, keep, bias, sink, dt)

    verdict = judge("flex compiled", out, naive(torch.float64), naive, torch.float32,
                    score_size=score_size(q.double(), k.double().repeat_interleave(2, 1), keep, bias.double(), SCALE),
                    head_dim=16)
    assert verdict.ok, str(verdict)


@pytest.fixture
def compiling(monkeypatch):
    monkeypatch.setattr(flex, "COMPILE", True)


def test_compiled_inference_matches_the_oracle_and_does_not_recompile(compiling):
    """One compile (torch inductor, CPU), then new values of the same shapes: no new graph."""
    q, k, v, mask, keep, bias, sink = _combo(0)
    with torch.no_grad():
        out = multihead.attention(q, k, v, mask, backend="flex")
    _judge_combo(q, k, v, keep, bias, sink, out)
    graphs = counters["stats"]["unique_graphs"]
    frames = dict(counters["frames"])
    for seed in (1, 2):  # new tensors, new documents, new values: the compiled kernel is reused
        q, k, v, mask, keep, bias, sink = _combo(seed)
        with torch.no_grad():
            out = multihead.attention(q, k, v, mask, backend="flex")
        _judge_combo(q, k, v, keep, bias, sink, out)
    assert counters["stats"]["unique_graphs"] == graphs, "a call of the same shapes compiled again"
    assert dict(counters["frames"]) == frames


def test_a_second_length_compiles_again(compiling):
    """A new length compiles once more, with static shapes: torch 2.13's dynamic-shape CPU
    kernel for a causal mask_mod fails to build ("'cur_qSplitSize3' was not declared")."""
    for L in (128, 256):
        q, k, v = random_qkv(B=1, H=2, Lq=L, D=16, dtype=torch.float32, seed=L)
        with torch.no_grad():
            out = multihead.attention(q, k, v, masks.causal(), backend="flex")
        keep = causal_keep(L, L).expand(1, 2, L, L)

        def naive(dt):
            return naive_attention(q, k, v, keep, None, SCALE, dt)

        verdict = judge(f"flex compiled, L={L}", out, naive(torch.float64), naive, torch.float32,
                        score_size=score_size(q.double(), k.double(), keep, None, SCALE), head_dim=16)
        assert verdict.ok, str(verdict)


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
    for learned in (masks.score_mod(lambda s, b, h, qi, kv: s * w[h], tensors=[w := torch.ones(2, requires_grad=True)]),
                    masks.sink(torch.zeros(2, requires_grad=True)),
                    masks.alibi(torch.ones(2, requires_grad=True))):
        assert "training on the CPU" in why(_call(q, k, v, learned)), learned
    meta = [t.to("meta") for t in (q, k, v)]
    assert "runs on cpu and cuda, not meta" in why(_call(*meta))


def test_asked_by_name_it_raises_what_it_refuses():
    q, k, v = random_qkv(B=1, H=2, Lq=8, D=16, dtype=torch.float32, grad=True)
    with pytest.raises(ValueError, match="backend 'flex' cannot run this call: training on the CPU"):
        multihead.attention(q, k, v, masks.causal(), backend="flex")
    with pytest.raises(ValueError, match="backend 'flex' cannot run this call: torch's flex_attention has no dropout"):
        multihead.attention(q.detach(), k.detach(), v.detach(), dropout_p=0.5, backend="flex")


def test_auto_declines_flex_below_the_size_where_tiles_pay():
    q, k, v = random_qkv(B=1, H=2, Lq=8, D=16, dtype=torch.float32)
    with torch.no_grad():
        d = multihead.explain_dispatch(q, k, v, masks.documents(torch.tensor([0] * 4 + [1] * 4)))
    assert d.backend == "sdpa" and "below chunked.AUTO_MIN_SCORES" in d.refused["flex"]


def _long(dtype=torch.float32, grad=False):
    """q, k, v of Lq = Lk = 2048 (Lq·Lk = chunked.AUTO_MIN_SCORES): only planned, never run."""
    return [torch.zeros(1, 2, 2048, 16, dtype=dtype, requires_grad=grad) for _ in range(3)]


def test_auto_picks_flex_on_the_cpu_for_documents_where_sdpa_declines(monkeypatch):
    """Where sdpa's dense mask is over its budget, packed documents go to flex for inference
    (measured faster than chunked in benchmarks/bench_flex.py); other masks, training, other
    dtypes and flex.AUTO_CPU = False go on to chunked, each with its reason."""
    monkeypatch.setattr(multihead.backends.sdpa, "DENSE_MASK_BUDGET_BYTES", 2**20)
    docs = masks.from_seqlens([512] * 4) & masks.causal()
    with torch.no_grad():
        d = multihead.explain_dispatch(*_long(), docs)
        assert d.backend == "flex" and "over sdpa.DENSE_MASK_BUDGET_BYTES" in d.refused["sdpa"]
        assert d.how.startswith("compiled with torch.compile (inductor) on cpu; documents & causal -> mask_mod")
        assert d.refused["chunked"] == "'flex' comes first in the auto order"
        d = multihead.explain_dispatch(*_long(), masks.window(256))
        assert d.backend == "chunked" and "packed documents only" in d.refused["flex"]
        d = multihead.explain_dispatch(*_long(torch.bfloat16), docs)
        assert d.backend == "chunked" and "float32 only" in d.refused["flex"]
        d = multihead.explain_dispatch(*_long(), docs, compiling=True)
        assert "inside torch.compile it was not measured" in d.refused["flex"]
        monkeypatch.setattr(flex, "AUTO_CPU", False)
        d = multihead.explain_dispatch(*_long(), docs)
        assert d.backend == "chunked" and d.refused["flex"] == "flex.AUTO_CPU = False"
    d = multihead.explain_dispatch(*_long(grad=True), docs)
    assert d.backend == "chunked" and "training on the CPU" in d.refused["flex"]


def test_auto_with_a_score_mod_on_the_cpu_says_why_not_flex():
    q, k, v = _long()
    with torch.no_grad():
        d = multihead.explain_dispatch(q, k, v, masks.softcap(20.0) & masks.causal())
    assert d.backend == "chunked" and "packed documents only" in d.refused["flex"]
    assert "cannot apply softcap(20)" in d.refused["sdpa"]


def test_explain_dispatch_says_how_flex_runs():
    q, k, v = random_qkv(B=1, H=2, Lq=300, D=16, dtype=torch.float32)
    pad = torch.ones(1, 300, dtype=torch.bool)
    with torch.no_grad():
        how = flex._describe(_call(q, k, v, masks.causal() & masks.key_padding(pad)))
    assert how.startswith("compiled with torch.compile (inductor) on cpu")
    assert "causal -> mask_mod" in how and "padding -> mask_mod" in how
    # 3 x 3 tiles of 128: the 3 above the diagonal are skipped, the 3 on it need the mask
    assert "block mask of 128x128 tiles: 6 of 9 computed, 3 of them without the mask_mod" in how


def test_backend_name_is_registered_and_typed():
    assert "flex" in backends.names()
    assert "flex" in backends.BackendName.__args__
    assert backends.AUTO_ORDER.index("sdpa") < backends.AUTO_ORDER.index("flex") < backends.AUTO_ORDER.index("chunked")


# ---------------------------------------------------------------- CUDA: compiled, trained
@pytest.mark.parametrize("device", DEVICES)
def test_compiled_training_matches_the_oracle_where_flex_trains(device, compiling):
    """On CUDA: the output and the gradients of q, k, v, the bias and the sink logits (torch's
    captured-buffer gradients), each judged by the oracle's rule against the definition on the
    CPU. On the CPU, where torch has no flex backward, the same call is refused by name."""
    q, k, v, _, keep, bias, sink = _combo(4, L=256)
    ids = torch.tensor([0] * 44 + [1] * 76 + [2] * 136)
    pad = torch.rand(2, 256, generator=torch.Generator().manual_seed(4)) < 0.9
    keep = documents_keep(ids, causal="bottom_right").expand(2, 4, 256, 256) & pad[:, None, None, :]
    grad_out = torch.randn(2, 4, 256, 16, generator=torch.Generator().manual_seed(5))
    leaves = [t.detach().to(device).requires_grad_(True) for t in (q, k, v, bias, sink)]
    qd, kd, vd, bd, sd = leaves
    mask = _combo_mask(ids.to(device), pad.to(device), bd, sd)
    if device == "cpu":
        with pytest.raises(ValueError, match="backend 'flex' cannot run this call: training on the CPU"):
            multihead.attention(qd, kd, vd, mask, backend="flex")
        return
    out = multihead.attention(qd, kd, vd, mask, backend="flex")
    (out * grad_out.to(device)).sum().backward()

    def naive(dt, with_grads=False):
        ts = [t.detach().to(dt).requires_grad_(True) for t in (q, k, v, bias, sink)]
        o = _naive_mods(*ts[:3], keep, ts[3], ts[4], dt)
        if not with_grads:
            return o.detach()
        (o * grad_out.to(dt)).sum().backward()
        return [o.detach()] + [t.grad for t in ts]

    size = score_size(q.double(), k.double().repeat_interleave(2, 1), keep, bias.double(), SCALE)
    oracle, low = naive(torch.float64, True), naive(torch.float32, True)
    got = [out] + [t.grad for t in leaves]
    for i, name in enumerate(["out", "dq", "dk", "dv", "dbias", "dsink"]):
        verdict = judge(f"flex on {device}: {name}", got[i].cpu(), oracle[i], lambda dt, i=i: low[i] if dt == torch.float32
                        else naive(dt, True)[i], torch.float32, score_size=size, head_dim=16)
        assert verdict.ok, str(verdict)


def test_inside_the_callers_torch_compile_fullgraph():
    """The caller compiles (aot_eager: dynamo and AOTAutograd without generating C++), the backend
    calls flex_attention as is inside that graph: no graph break, the oracle's values."""
    q, k, v = random_qkv(B=2, H=2, Lq=200, D=16, dtype=torch.float32, seed=15)
    pad = torch.ones(2, 200, dtype=torch.bool)
    pad[0, 120:] = False
    mask = masks.causal() & masks.key_padding(pad)

    def f(q, k, v):
        return multihead.attention(q, k, v, mask, backend="flex")

    with torch.no_grad():
        out = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v)
    keep = (causal_keep(200, 200) & pad[:, None, None, :]).expand(2, 2, 200, 200)

    def naive(dt):
        return naive_attention(q, k, v, keep, None, SCALE, dt)

    verdict = judge("flex inside torch.compile", out, naive(torch.float64), naive, torch.float32,
                    score_size=score_size(q.double(), k.double(), keep, None, SCALE), head_dim=16)
    assert verdict.ok, str(verdict)


def test_a_trace_records_the_fused_step_with_flex_and_its_tiles():
    q, k, v = random_qkv(B=1, H=2, Lq=300, D=16, dtype=torch.float32, seed=16)
    with torch.no_grad(), multihead.trace() as tr:
        multihead.attention(q, k, v, masks.causal(), backend="flex")
    params = tr.step(multihead.steps.FUSED_ATTENTION).params
    assert params["backend"] == "flex" and params["kernel"] == "torch flex_attention unfused"  # tests run unfused
    assert (params["tiles_computed"], params["tiles_total"], params["lk"]) == (6, 9, 300)
