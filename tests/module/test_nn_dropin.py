"""multihead.nn.MultiheadAttention against torch.nn.MultiheadAttention with the same weights.

Everything is float64 with O(1) values and E <= 12, where the two implementations differ only
by reordered roundings (each about E * eps64 * |x| ~ 1e-14): TOL = 1e-12 leaves two orders of
magnitude and still catches any real difference (a mask, a head or a layout off gives O(1)).
Rows with no visible key are excluded from comparisons except in the test about them.
"""

from __future__ import annotations

import copy
import doctest
import io
import itertools
import warnings

import pytest
import torch
import torch.nn as nn

import multihead as mh
import multihead.integrations.torch_mha
import multihead.nn
from multihead.integrations.torch_mha import (
    multihead_to_torch,
    torch_to_multihead,
)
from multihead.nn import MultiheadAttention, swap_in
from oracle import one_thread

pytestmark = [
    pytest.mark.usefixtures(one_thread.__name__),
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors"),  # torch's own, from its fast path
]

F64 = torch.float64
TOL = 1e-12
E, H, L, S, N = 8, 2, 4, 5, 3


def randomize(module: nn.Module, seed: int = 0) -> nn.Module:
    """Every parameter drawn from N(0, 0.5²): the zero-initialised biases must matter too."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return module


def pair(**kw):
    """(torch's module, ours) with identical random weights, ours loaded from torch's state_dict."""
    ref = randomize(nn.MultiheadAttention(E, H, dtype=F64, **kw))
    ours = MultiheadAttention(E, H, dtype=F64, **kw)
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


def assert_close(a, b, what=""):
    if a is None or b is None:
        assert a is None and b is None, what
        return
    assert a.shape == b.shape, (what, a.shape, b.shape)
    err = (a - b).abs().max().item()
    assert err <= TOL, f"{what}: max error {err:.3g}"


def layout(x, mode):
    """x (N, T, F) batch-first -> the layout ``mode`` calls for."""
    if mode == "seq_first":
        return x.transpose(0, 1).contiguous()
    if mode == "unbatched":
        return x[0]
    return x


def make_inputs(mode, proj, seed=0):
    g = torch.Generator().manual_seed(seed)
    kdim, vdim = (5, 3) if proj == "kdim_vdim" else (E, E)
    q = torch.randn(N, L, E, generator=g, dtype=F64)
    k = torch.randn(N, S, kdim, generator=g, dtype=F64)
    v = torch.randn(N, S, vdim, generator=g, dtype=F64)
    q, k, v = (layout(t, mode) for t in (q, k, v))
    if proj == "self":
        k = v = q
    elif proj == "kv_shared":
        v = k
    return q, k, v


def make_masks(kind, mode, seed=0):
    """(attn_mask, key_padding_mask) in torch's convention; key 0 is always visible, so every
    row has a key (torch gives NaN for a row without one)."""
    g = torch.Generator().manual_seed(seed)
    n = 1 if mode == "unbatched" else N
    lk = L if kind.startswith("self") else S
    attn = kpm = None
    kind = kind.removeprefix("self:")
    if kind.startswith("bool") or kind.startswith("float"):
        shape = (n * H, L, lk) if kind.endswith("3d") else (L, lk)
        if kind.startswith("bool"):
            attn = torch.rand(shape, generator=g) > 0.6
            attn[..., 0] = False
        else:
            attn = torch.randn(shape, generator=g, dtype=F64)
            attn[..., 1] = float("-inf")
    if "kpm" in kind:
        pad = torch.rand(n, lk, generator=g) > 0.5
        pad[:, 0] = False
        kpm = pad if "kpm_bool" in kind else torch.where(pad, -2.0, 0.5).to(F64)
        if mode == "unbatched":
            kpm = kpm[0]
    return attn, kpm


MASKS = ["none", "bool2d", "float2d", "bool3d", "float3d", "kpm_bool", "kpm_float", "bool2d+kpm_bool", "float3d+kpm_float"]
WEIGHTS = [(True, True), (True, False), (False, True)]  # (need_weights, average_attn_weights)


@pytest.mark.parametrize("extras", [{}, {"bias": False}, {"add_bias_kv": True}, {"add_zero_attn": True},
                                    {"add_bias_kv": True, "add_zero_attn": True}], ids=str)
@pytest.mark.parametrize("proj", ["self", "kv_shared", "kdim_vdim"])
@pytest.mark.parametrize("mode", ["batch_first", "seq_first", "unbatched"])
def test_matches_torch_in_every_shared_mode(mode, proj, extras):
    kw = dict(extras, batch_first=(mode == "batch_first"))
    if proj == "kdim_vdim":
        kw.update(kdim=5, vdim=3)
    ref, ours = pair(**kw)
    ref.eval(), ours.eval()
    q, k, v = make_inputs(mode, proj)
    for mask_kind, (need, avg) in itertools.product(MASKS, WEIGHTS):
        attn, kpm = make_masks(("self:" if proj == "self" else "") + mask_kind, mode)
        what = f"{mode} {proj} {extras} {mask_kind} need_weights={need} average={avg}"
        call = dict(key_padding_mask=kpm, attn_mask=attn, need_weights=need, average_attn_weights=avg)
        with torch.enable_grad():  # keeps torch's own inference fast path out of the comparison
            expect, expect_w = ref(q, k, v, **call)
            out, w = ours(q, k, v, **call)
        assert_close(out, expect, what)
        assert_close(w, expect_w, what + " (weights)")


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("proj", ["self", "kdim_vdim"])
def test_training_dropout_draws_what_torch_draws_on_cpu(proj, need_weights):
    """Both draw the dropout mask on the (N, H, L, S) weights in the same order on CPU, so one
    seed gives the same output (and the same dropped weights) in training."""
    kw = dict(dropout=0.4, batch_first=True, add_bias_kv=True)
    if proj == "kdim_vdim":
        kw.update(kdim=5, vdim=3)
    ref, ours = pair(**kw)
    q, k, v = make_inputs("batch_first", proj)
    attn, kpm = make_masks(("self:" if proj == "self" else "") + "bool2d+kpm_bool", "batch_first")
    call = dict(attn_mask=attn, key_padding_mask=kpm, need_weights=need_weights, average_attn_weights=False)
    torch.manual_seed(7)
    expect, expect_w = ref(q, k, v, **call)
    torch.manual_seed(7)
    out, w = ours(q, k, v, **call)
    assert_close(out, expect, "training output")
    assert_close(w, expect_w, "dropped weights")
    torch.manual_seed(8)
    assert (ours(q, k, v, **call)[0] - out).abs().max() > 1e-3  # dropout is on: another seed differs


def test_training_weights_are_those_applied():
    """need_weights in training returns the weights after dropout: out_proj(weights @ V) is the output."""
    ref, ours = pair(dropout=0.5, batch_first=True)
    x = make_inputs("batch_first", "self")[0]
    out, w = ours(x, x, x, average_attn_weights=False)
    assert (w == 0).any() and w.max() > 1.0  # dropped and rescaled weights
    v = torch.nn.functional.linear(x, ours.in_proj_weight[2 * E:], ours.in_proj_bias[2 * E:])
    o = (w @ v.view(N, L, H, E // H).transpose(1, 2)).transpose(1, 2).reshape(N, L, E)
    assert_close(ours.out_proj(o), out, "out from the returned weights")


@pytest.mark.parametrize("lk", [L, S])
@pytest.mark.parametrize("with_kpm", [False, True])
@pytest.mark.parametrize("need_weights", [True, False])
def test_is_causal_follows_torch_2_13(need_weights, with_kpm, lk):
    """is_causal=True: the causal attn_mask gives torch's result on every path; with
    need_weights=False and no key_padding_mask torch reads only the hint (top-left causal), and
    so do we -- shown by a hint that lies (an attn_mask that blocks nothing)."""
    ref, ours = pair(batch_first=True)
    ref.eval(), ours.eval()
    g = torch.Generator().manual_seed(3)
    q = torch.randn(N, L, E, generator=g, dtype=F64)
    kv = torch.randn(N, lk, E, generator=g, dtype=F64)
    kpm = torch.zeros(N, lk, dtype=torch.bool)
    kpm[0, -1] = True
    call = dict(need_weights=need_weights, key_padding_mask=kpm if with_kpm else None, is_causal=True)
    causal = torch.ones(L, lk, dtype=torch.bool).triu(1)  # True = blocked, top-left aligned
    lie = torch.zeros(L, lk, dtype=torch.bool)
    with torch.enable_grad():
        for attn in (causal, lie):
            expect, expect_w = ref(q, kv, kv, attn_mask=attn, **call)
            out, w = ours(q, kv, kv, attn_mask=attn, **call)
            assert_close(out, expect, f"is_causal, attn_mask {'causal' if attn is causal else 'blocking nothing'}")
            assert_close(w, expect_w, "is_causal weights")
    with pytest.raises(RuntimeError, match="Need attn_mask"):
        ref(q, kv, kv, **call)
    with pytest.raises(ValueError, match="is_causal=True needs attn_mask"):
        ours(q, kv, kv, **call)


def test_row_with_no_visible_key_gives_zero_where_torch_gives_nan():
    """Documented difference: where torch returns NaN we return attention 0 (so out = out_proj.bias)
    and weights 0; every other row is torch's."""
    ref, ours = pair(batch_first=True)
    ref.eval(), ours.eval()
    x = make_inputs("batch_first", "self")[0]
    for attn, kpm in (
        (torch.zeros(L, L, dtype=torch.bool).index_fill_(0, torch.tensor([1]), True), None),  # query 1 blocked
        (torch.zeros(L, L, dtype=F64).index_fill_(0, torch.tensor([1]), float("-inf")), None),
        (None, torch.zeros(N, L, dtype=torch.bool).index_fill_(0, torch.tensor([1]), True)),  # batch 1 all padding
    ):
        with torch.enable_grad():
            expect, expect_w = ref(x, x, x, attn_mask=attn, key_padding_mask=kpm, average_attn_weights=False)
            out, w = ours(x, x, x, attn_mask=attn, key_padding_mask=kpm, average_attn_weights=False)
        empty = expect.isnan().any(-1)  # (N, L): the rows torch cannot define
        assert empty.any() and not out.isnan().any() and not w.isnan().any()
        assert_close(out[empty], ours.out_proj.bias.expand(int(empty.sum()), E), "empty rows give out_proj.bias")
        assert (w.permute(0, 2, 1, 3)[empty] == 0).all()
        assert_close(out[~empty], expect[~empty], "the other rows")
        assert_close(w.permute(0, 2, 1, 3)[~empty], expect_w.permute(0, 2, 1, 3)[~empty], "their weights")


@pytest.mark.parametrize("kw", [{}, {"kdim": 5, "vdim": 3, "add_bias_kv": True}, {"add_zero_attn": True, "bias": False}], ids=str)
@pytest.mark.parametrize("need_weights", [True, False])
def test_gradients_equal_torch(kw, need_weights):
    ref, ours = pair(batch_first=False, **kw)
    proj = "kdim_vdim" if "kdim" in kw else "kv_shared"
    inputs = [t.detach().clone().requires_grad_() for t in make_inputs("seq_first", proj)]
    if proj == "kv_shared":
        inputs = inputs[:2]
    attn, kpm = make_masks("float2d+kpm_float", "seq_first")
    outs = []
    for m in (ref, ours):
        xs = [t.detach().clone().requires_grad_() for t in inputs]
        q, k, v = (xs[0], xs[1], xs[1]) if len(xs) == 2 else xs
        out, w = m(q, k, v, attn_mask=attn, key_padding_mask=kpm, need_weights=need_weights)
        loss = (out * torch.linspace(-1, 1, out.numel(), dtype=F64).view_as(out)).sum()
        if w is not None:
            loss = loss + (w ** 2).sum()
        loss.backward()
        outs.append(([x.grad for x in xs], {n: p.grad for n, p in m.named_parameters()}))
    (gx_ref, gp_ref), (gx, gp) = outs
    for a, b in zip(gx, gx_ref):
        assert_close(a, b, "input grad")
    assert gp.keys() == gp_ref.keys()
    for name in gp:
        assert_close(gp[name], gp_ref[name], f"grad of {name}")


# --------------------------------------------------------------------------- transformer layers
def counting_forward(monkeypatch):
    """Count calls of the drop-in's forward (a patched method: no hooks, so torch's path choice is unchanged)."""
    calls = []
    original = MultiheadAttention.forward

    def forward(self, *args, **kwargs):
        calls.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(MultiheadAttention, "forward", forward)
    return calls


def stock_and_swapped(build):
    torch.manual_seed(0)
    stock = randomize(build(), seed=1)
    swapped = swap_in(copy.deepcopy(stock))
    kinds = {type(m) for m in swapped.modules()}
    assert MultiheadAttention in kinds and nn.MultiheadAttention not in kinds
    swapped.load_state_dict(stock.state_dict(), strict=True)
    return stock, swapped


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("batch_first", [True, False])
def test_transformer_encoder_layer_with_the_drop_in(batch_first, norm_first, monkeypatch):
    """Training and eval (autograd on) run the drop-in's forward; eval under no_grad with
    batch_first takes torch's fused fast path on the drop-in's parameters (the forward is not
    called, as for nn.MultiheadAttention). Each equals the stock layer."""
    stock, swapped = stock_and_swapped(lambda: nn.TransformerEncoderLayer(
        E, H, dim_feedforward=16, dropout=0.0, batch_first=batch_first, norm_first=norm_first, dtype=F64))
    calls = counting_forward(monkeypatch)
    src = layout(make_inputs("batch_first", "self")[0], "batch_first" if batch_first else "seq_first")
    causal = nn.Transformer.generate_square_subsequent_mask(L, dtype=F64)
    pad = torch.zeros(N, L, dtype=F64)
    pad[1, -1] = float("-inf")  # a float padding mask, as the float causal mask (torch warns on mixed types)
    for train, grad, mask, kpm, is_causal in [
        (True, True, None, None, False), (True, True, causal, pad, False), (False, True, causal, None, True),
        (False, True, None, pad, False), (False, False, None, pad, False), (False, False, causal, None, False),
    ]:
        stock.train(train), swapped.train(train)
        calls.clear()
        with torch.set_grad_enabled(grad):
            expect = stock(src, src_mask=mask, src_key_padding_mask=kpm, is_causal=is_causal)
            out = swapped(src, src_mask=mask, src_key_padding_mask=kpm, is_causal=is_causal)
        assert_close(out, expect, f"train={train} grad={grad} mask={mask is not None} kpm={kpm is not None}")
        fast = not train and not grad and batch_first
        assert len(calls) == (0 if fast else 1), (train, grad, len(calls))


def test_transformer_decoder_layer_with_the_drop_in(monkeypatch):
    stock, swapped = stock_and_swapped(lambda: nn.TransformerDecoderLayer(
        E, H, dim_feedforward=16, dropout=0.0, batch_first=True, dtype=F64))
    calls = counting_forward(monkeypatch)
    g = torch.Generator().manual_seed(2)
    tgt, memory = torch.randn(N, L, E, generator=g, dtype=F64), torch.randn(N, S, E, generator=g, dtype=F64)
    causal = nn.Transformer.generate_square_subsequent_mask(L, dtype=F64)
    mem_pad = torch.zeros(N, S, dtype=torch.bool)
    mem_pad[0, -2:] = True
    for train in (True, False):
        stock.train(train), swapped.train(train)
        calls.clear()
        expect = stock(tgt, memory, tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=mem_pad)
        out = swapped(tgt, memory, tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=mem_pad)
        assert_close(out, expect, f"decoder layer train={train}")
        assert len(calls) == 2  # self_attn and multihead_attn


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("mode", ["encoder", "encoder causal", "norm_first", "decoder", "unbatched"])
def test_layers_trained_with_dropout_draw_torchs_masks_at_the_same_seed(mode, batch_first):
    """Bad habit: train a swap_in-ed layer with dropout > 0 and compare with torch at one seed.
    The layer's dropout1 after the attention draws its mask over the attention output in memory
    order (torch's CPU dropout keeps the input's strides), so the drop-in returns torch's layout:
    (L, N, E) in memory, a transposed view when batch_first. Old code: 0.47 off."""
    if mode == "decoder":
        make = lambda: nn.TransformerDecoderLayer(E, H, dim_feedforward=16, dropout=0.3, batch_first=batch_first,
                                                  dtype=F64)
    else:
        make = lambda: nn.TransformerEncoderLayer(E, H, dim_feedforward=16, dropout=0.3, batch_first=batch_first,
                                                  norm_first=mode == "norm_first", dtype=F64)
    stock, swapped = stock_and_swapped(make)
    stock.train(), swapped.train()
    where = "unbatched" if mode == "unbatched" else "batch_first" if batch_first else "seq_first"
    q = make_inputs(where, "self")[0]
    memory = layout(torch.randn(N, S, E, dtype=F64), where)
    causal = nn.Transformer.generate_square_subsequent_mask(L, dtype=F64)
    outs = []
    for m in (stock, swapped):
        torch.manual_seed(11)
        if mode == "decoder":
            out = m(q, memory, tgt_mask=causal, tgt_is_causal=True)
        elif mode == "encoder causal":
            out = m(q, src_mask=causal, is_causal=True)
        else:
            out = m(q)
        out.pow(2).sum().backward()
        outs.append((out.detach(), {n: p.grad for n, p in m.named_parameters()}))
    assert_close(outs[1][0], outs[0][0], f"{mode} training output")
    for name, gr in outs[0][1].items():
        assert_close(outs[1][1][name], gr, f"grad of {name}")
    torch.manual_seed(12)
    assert (swapped(q, memory) if mode == "decoder" else swapped(q)).sub(outs[1][0]).abs().max() > 1e-3  # dropout on


@pytest.mark.parametrize("mode", ["batch_first", "seq_first", "unbatched"])
def test_output_has_torchs_memory_layout(mode):
    """What a following dropout's mask depends on: the strides of the output, not only its values."""
    ref, ours = pair(batch_first=mode == "batch_first")
    q, k, v = make_inputs(mode, "self")
    for need_weights in (True, False):
        expect, out = ref(q, k, v, need_weights=need_weights)[0], ours(q, k, v, need_weights=need_weights)[0]
        assert out.stride() == expect.stride(), (mode, need_weights, out.stride(), expect.stride())


def test_nn_transformer_with_the_drop_in_trains_like_stock():
    """A whole nn.Transformer (encoder with the nested-tensor fast path in inference, decoder)
    with every attention swapped: same outputs in train and eval, same gradients."""
    stock, swapped = stock_and_swapped(lambda: nn.Transformer(
        E, H, num_encoder_layers=2, num_decoder_layers=1, dim_feedforward=16, dropout=0.0,
        batch_first=True, dtype=F64))
    g = torch.Generator().manual_seed(4)
    src, tgt = torch.randn(N, S, E, generator=g, dtype=F64), torch.randn(N, L, E, generator=g, dtype=F64)
    src_pad = torch.zeros(N, S, dtype=torch.bool)
    src_pad[1, -2:] = True
    tgt_mask = nn.Transformer.generate_square_subsequent_mask(L, dtype=F64)
    call = dict(tgt_mask=tgt_mask, src_key_padding_mask=src_pad, memory_key_padding_mask=src_pad)
    grads = []
    for m in (stock, swapped):
        m.train()
        out = m(src, tgt, **call)
        out.pow(2).sum().backward()
        grads.append((out.detach(), {n: p.grad for n, p in m.named_parameters()}))
    assert_close(grads[1][0], grads[0][0], "train output")
    for name, gr in grads[0][1].items():
        assert_close(grads[1][1][name], gr, f"grad of {name}")
    for m in (stock, swapped):
        m.eval()
    with torch.no_grad():
        expect, out = stock(src, tgt, **call), swapped(src, tgt, **call)
    assert_close(out, expect, "eval output (nested-tensor encoder path)")


# --------------------------------------------------------------------------- state dicts
@pytest.mark.parametrize("kw", [{}, {"kdim": 5, "vdim": 3}, {"add_bias_kv": True, "add_zero_attn": True}, {"bias": False}], ids=str)
def test_state_dicts_load_both_ways_strict(kw):
    """An nn.MultiheadAttention checkpoint (saved to bytes, as on disk) loads strict into the
    drop-in, with the same keys in the same order; the drop-in's loads strict into torch's."""
    ref = randomize(nn.MultiheadAttention(E, H, dtype=F64, **kw))
    buf = io.BytesIO()
    torch.save(ref.state_dict(), buf)
    buf.seek(0)
    ours = MultiheadAttention(E, H, dtype=F64, **kw)
    ours.load_state_dict(torch.load(buf), strict=True)
    assert list(ours.state_dict()) == list(ref.state_dict())
    back = nn.MultiheadAttention(E, H, dtype=F64, **kw)
    back.load_state_dict(randomize(ours, seed=5).state_dict(), strict=True)
    proj = "kdim_vdim" if "kdim" in kw else "kv_shared"
    q, k, v = make_inputs("seq_first", proj)
    with torch.enable_grad():
        assert_close(ours(q, k, v)[0], back(q, k, v)[0], "after loading the drop-in's weights into torch's")


def test_encoder_layer_checkpoint_loads_into_the_swapped_layer():
    stock = randomize(nn.TransformerEncoderLayer(E, H, dim_feedforward=16, dropout=0.0, dtype=F64))
    buf = io.BytesIO()
    torch.save(stock.state_dict(), buf)
    buf.seek(0)
    fresh = nn.TransformerEncoderLayer(E, H, dim_feedforward=16, dropout=0.0, dtype=F64)
    fresh.self_attn = MultiheadAttention(E, H, dtype=F64)
    fresh.load_state_dict(torch.load(buf), strict=True)
    x = make_inputs("seq_first", "self")[0]
    assert_close(fresh(x), stock(x), "encoder layer after loading the stock checkpoint")


def test_from_torch_and_swap_in_copy_settings_weights_and_mode():
    ref = randomize(nn.MultiheadAttention(E, H, dropout=0.25, kdim=5, vdim=3, add_bias_kv=True,
                                          batch_first=True, dtype=F64)).eval()
    ours = MultiheadAttention.from_torch(ref)
    for name in ("embed_dim", "num_heads", "head_dim", "kdim", "vdim", "dropout", "batch_first",
                 "_qkv_same_embed_dim", "add_zero_attn"):
        assert getattr(ours, name) == getattr(ref, name), name
    assert not ours.training
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), ref.state_dict().values()))
    with pytest.raises(TypeError, match="from_torch takes an nn.MultiheadAttention"):
        MultiheadAttention.from_torch(ours)
    with pytest.raises(TypeError, match="for one layer use MultiheadAttention.from_torch"):
        swap_in(ref)


def test_multihead_module_loads_torch_state_dict_through_the_hook():
    """MultiHeadAttention registers the pre-hook itself: nn.MultiheadAttention checkpoints load
    strict, at the top level and as a submodule; its own state_dict still loads."""
    for kw in ({}, {"kdim": 5, "vdim": 3}):
        ref = randomize(nn.MultiheadAttention(E, H, batch_first=True, dtype=F64, **kw)).eval()
        mha = mh.MultiHeadAttention(E, H, dtype=F64, **kw)
        mha.load_state_dict(ref.state_dict(), strict=True)
        q, k, v = make_inputs("batch_first", "kdim_vdim" if kw else "kv_shared")
        with torch.enable_grad():
            assert_close(mha(q, k, v), ref(q, k, v)[0], f"MultiHeadAttention {kw} from torch's state_dict")
        mha.load_state_dict(mha.state_dict(), strict=True)  # its own keys pass through

    outer_ref = nn.Sequential(nn.Linear(E, E, dtype=F64), randomize(nn.MultiheadAttention(E, H, dtype=F64)))
    outer = nn.Sequential(nn.Linear(E, E, dtype=F64), mh.MultiHeadAttention(E, H, dtype=F64))
    outer.load_state_dict(outer_ref.state_dict(), strict=True)
    assert torch.equal(outer[1].k_proj.weight, outer_ref[1].in_proj_weight[E:2 * E])

    with_bias_kv = nn.MultiheadAttention(E, H, add_bias_kv=True, dtype=F64)
    with pytest.raises(RuntimeError, match="bias_k"):  # no MultiHeadAttention equivalent: named
        mha = mh.MultiHeadAttention(E, H, dtype=F64)
        mha.load_state_dict(with_bias_kv.state_dict(), strict=True)


def test_drop_in_loads_multihead_module_state_dict():
    for kw in ({}, {"kdim": 5, "vdim": 3}):
        mha = randomize(mh.MultiHeadAttention(E, H, dtype=F64, **kw))
        ours = copy.deepcopy(MultiheadAttention(E, H, batch_first=True, dtype=F64, **kw))  # the hook survives a copy
        ours.load_state_dict(mha.state_dict(), strict=True)
        q, k, v = make_inputs("batch_first", "kdim_vdim" if kw else "kv_shared")
        assert_close(ours(q, k, v, need_weights=False)[0], mha(q, k, v), f"drop-in {kw} from MultiHeadAttention")


def test_state_dict_codecs_round_trip_exactly():
    for kw in ({}, {"kdim": 5, "vdim": 3}, {"bias": False}):
        sd = randomize(nn.MultiheadAttention(E, H, dtype=F64, **kw)).state_dict()
        converted = torch_to_multihead(sd)
        assert not any(k.startswith("in_proj") or k.endswith("_proj_weight") for k in converted)
        back = multihead_to_torch(converted)
        assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    sd = {"enc.attn.in_proj_weight": torch.zeros(3 * E, E), "enc.other": torch.ones(1)}
    out = torch_to_multihead(sd, prefix="enc.attn.")
    assert set(out) == {"enc.attn.q_proj.weight", "enc.attn.k_proj.weight", "enc.attn.v_proj.weight", "enc.other"}
    assert set(sd) == {"enc.attn.in_proj_weight", "enc.other"}  # the input is not modified
    with pytest.raises(TypeError, match="state_dict"):
        torch_to_multihead([1, 2])


# --------------------------------------------------------------------------- parameters
@pytest.mark.parametrize("kw", [{}, {"kdim": 5, "vdim": 3, "add_bias_kv": True}], ids=str)
def test_initial_values_equal_torch_and_reset_parameters_after_meta_init(kw):
    """Under one seed the constructor draws what nn.MultiheadAttention's draws; a module built on
    the meta device, materialised with to_empty and reset_parameters() under that seed, too."""
    torch.manual_seed(11)
    ref = nn.MultiheadAttention(E, H, **kw)
    torch.manual_seed(11)
    ours = MultiheadAttention(E, H, **kw)
    with torch.device("meta"):
        lazy = MultiheadAttention(E, H, **kw)
    assert all(p.is_meta for p in lazy.parameters())
    lazy.to_empty(device="cpu")
    torch.manual_seed(11)
    lazy.reset_parameters()
    for sd in (ours.state_dict(), lazy.state_dict()):
        assert list(sd) == list(ref.state_dict())
        assert all(torch.equal(sd[k], v) for k, v in ref.state_dict().items())


def test_parameters_are_the_only_source_of_truth():
    """An in-place change to in_proj_weight (an optimiser step) is what the next call uses."""
    ref, ours = pair(batch_first=True)
    x = make_inputs("batch_first", "self")[0]
    for m in (ref, ours):
        m.eval()
        with torch.no_grad():
            m(x, x, x)
            m.in_proj_weight.mul_(-0.5)
            m.out_proj.bias.add_(1.0)
    with torch.enable_grad():
        assert_close(ours(x, x, x)[0], ref(x, x, x)[0], "after an in-place weight change")


# --------------------------------------------------------------------------- bad input
def test_bad_constructor_arguments_are_named():
    with pytest.raises(AssertionError):  # torch's own refusal
        nn.MultiheadAttention(10, 3)
    for args, kw, exc, match in [
        ((10, 3), {}, ValueError, "embed_dim=10 is not divisible by num_heads=3"),
        ((0, 2), {}, ValueError, "embed_dim must be positive"),
        ((8, 0), {}, ValueError, "num_heads must be positive"),
        ((8.0, 2), {}, TypeError, "embed_dim must be an int"),
        ((8, 2), {"kdim": 0}, ValueError, "kdim must be positive"),
        ((8, 2), {"dropout": 1.5}, ValueError, "dropout must be in"),
        ((8, 2), {"batch_first": "yes"}, TypeError, "batch_first must be True or False"),
    ]:
        with pytest.raises(exc, match=match):
            MultiheadAttention(*args, **kw)


def _bad_calls():
    x = torch.randn(N, L, E, dtype=F64)
    kv = torch.randn(N, S, E, dtype=F64)
    with warnings.catch_warnings():  # built at collection, outside the filterwarnings marks
        warnings.filterwarnings("ignore", "The PyTorch API of nested tensors")
        nested = torch.nested.nested_tensor(list(x))
    return [
        ("attn_mask 2-D of a wrong shape", (x, kv, kv), {"attn_mask": torch.zeros(L, L, dtype=torch.bool)},
         ValueError, r"attn_mask must be \(L, S\) = \(4, 5\) or \(N\*num_heads, L, S\) = \(6, 4, 5\)"),
        ("attn_mask 3-D without the heads", (x, kv, kv), {"attn_mask": torch.zeros(N, L, S, dtype=torch.bool)},
         ValueError, "attn_mask must be"),
        ("attn_mask 4-D", (x, kv, kv), {"attn_mask": torch.zeros(N, H, L, S, dtype=torch.bool)},
         ValueError, "attn_mask must be"),
        ("attn_mask of ints", (x, kv, kv), {"attn_mask": torch.zeros(L, S, dtype=torch.long)},
         TypeError, "attn_mask must be bool"),
        ("key_padding_mask of a wrong shape", (x, kv, kv), {"key_padding_mask": torch.zeros(N, L, dtype=torch.bool)},
         ValueError, r"key_padding_mask must be \(N, S\) = \(3, 5\)"),
        ("key_padding_mask of ints", (x, kv, kv), {"key_padding_mask": torch.zeros(N, S, dtype=torch.int32)},
         TypeError, "key_padding_mask must be bool"),
        ("unbatched key_padding_mask 2-D", (x[0], kv[0], kv[0]), {"key_padding_mask": torch.zeros(1, S, dtype=torch.bool)},
         ValueError, "key_padding_mask must be"),
        ("is_causal without attn_mask", (x, kv, kv), {"is_causal": True}, ValueError, "is_causal=True needs attn_mask"),
        ("query with the wrong feature size", (x[..., :6], kv, kv), {}, ValueError, "query has 6 features but embed_dim=8"),
        ("key and value of different lengths", (x, kv, kv[:, :4]), {}, ValueError, "key .* and value .* must have the same"),
        ("4-D query", (x[None], kv[None], kv[None]), {}, ValueError, "query must be"),
        ("2-D key for a 3-D query", (x, kv[0], kv[0]), {}, ValueError, "key has 2 dimensions but query has 3"),
        ("batch sizes differ", (x, kv[:2], kv[:2]), {}, ValueError, "query has batch 3 but key has 2"),
        ("float32 query into a float64 module", (x.float(), kv.float(), kv.float()), {}, TypeError, "query is torch.float32"),
        ("query of ints", (x.long(), kv, kv), {}, TypeError, "query must have a floating dtype"),
        ("query not a tensor", (x.tolist(), kv, kv), {}, TypeError, "query must be a torch.Tensor"),
        ("nested query outside torch's fast path", (nested,) * 3, {},
         TypeError, "query is a NestedTensor"),
    ]


@pytest.mark.parametrize("case", _bad_calls(), ids=lambda c: c[0])
def test_bad_forward_input_is_named_where_torch_also_rejects(case):
    _, args, kw, exc, match = case
    ref, ours = pair(batch_first=True)
    with pytest.raises(Exception):  # nn.MultiheadAttention refuses it too (AssertionError, RuntimeError...)
        with torch.enable_grad():
            ref(*args, **kw)
    with pytest.raises(exc, match=match):
        ours(*args, **kw)


@pytest.mark.parametrize("module", [multihead.nn, multihead.integrations.torch_mha], ids=lambda m: m.__name__)
def test_docstring_examples_run(module):
    result = doctest.testmod(module, extraglobs={"torch": torch, "nn": nn, "multihead": mh}, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
