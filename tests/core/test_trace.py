"""multihead.trace(): the steps of the real forward pass, their shapes, views, values and checks."""

from __future__ import annotations

import json

import pytest
import torch

import multihead
from multihead import masks, steps
from multihead.backends import reference
from multihead.trace import Trace, _layout_checks, current

NEG_INF = float("-inf")

# the tutorial's example: batch 2, 3 tokens, d_in 4, d_out 8, 2 heads, causal
DEFAULT_STEPS = [
    ("input", (2, 3, 4)),
    ("project Q", (2, 3, 8)),
    ("project K", (2, 3, 8)),
    ("project V", (2, 3, 8)),
    ("split heads Q", (2, 3, 2, 4)),
    ("move heads forward Q", (2, 2, 3, 4)),
    ("split heads K", (2, 3, 2, 4)),
    ("move heads forward K", (2, 2, 3, 4)),
    ("split heads V", (2, 3, 2, 4)),
    ("move heads forward V", (2, 2, 3, 4)),
    ("scores QKᵀ", (2, 2, 3, 3)),
    ("scale", (2, 2, 3, 3)),
    ("causal mask", (2, 2, 3, 3)),
    ("softmax", (2, 2, 3, 3)),
    ("weights × V", (2, 2, 3, 4)),
    ("move heads back", (2, 3, 2, 4)),
    ("merge heads", (2, 3, 8)),
    ("output projection", (2, 3, 8)),
]


def _labels_shapes(t: Trace):
    return [(s.label, s.shape) for s in t.steps]


def _module(**kw):
    torch.manual_seed(0)
    defaults = dict(causal=True, backend="reference")
    defaults.update(kw)
    return multihead.MultiHeadAttention(4, 2, 8, **defaults)


def test_self_attention_steps_and_shapes_in_order():
    mha = _module()
    x = torch.randn(2, 3, 4)
    with multihead.trace() as t:
        y = mha(x)
    assert _labels_shapes(t) == DEFAULT_STEPS
    assert all(len(s.axes) == len(s.shape) for s in t.steps)
    views = {s.label: s.view for s in t.steps}
    for role in "QKV":
        assert views[f"split heads {role}"] and views[f"move heads forward {role}"]
    assert views["move heads back"]
    assert not views["merge heads"]  # reshape after transpose copies
    assert not views["scores QKᵀ"]
    assert torch.equal(t.steps[-1].tensor, y.detach())
    assert t.config["head_dim"] == 4 and t.config["num_heads"] == 2
    assert all(s.dtype == "float32" for s in t.steps)
    assert t.all_checks_hold


def test_step_values_are_the_forward_pass_values():
    mha = _module()
    x = torch.randn(2, 3, 4)
    with multihead.trace() as t:
        mha(x)
    q = t.step("move heads forward Q").tensor.double()
    k = t.step("move heads forward K").tensor.double()
    v = t.step("move heads forward V").tensor.double()
    # the tutorial's computation in float64 from the recorded Q, K, V
    scores = q @ k.transpose(2, 3)
    blocked = torch.triu(torch.ones(3, 3, dtype=torch.bool), diagonal=1)
    weights = torch.softmax((scores / 2).masked_fill(blocked, NEG_INF), dim=-1)
    torch.testing.assert_close(t.step("scores QKᵀ").tensor.double(), scores, rtol=0, atol=1e-6)
    torch.testing.assert_close(t.step("softmax").tensor.double(), weights, rtol=0, atol=1e-6)
    masked = t.step("causal mask").tensor
    assert (masked[..., blocked] == NEG_INF).all()
    assert torch.equal(t.step("causal mask").extras["keep"].expand(2, 2, 3, 3)[0, 0], ~blocked)
    torch.testing.assert_close(t.step("weights × V").tensor.double(), weights @ v, rtol=0, atol=1e-6)
    # split heads is the same numbers: token 0 of K cut into two heads of 4
    k_flat = t.step("project K").tensor
    assert torch.equal(t.step("split heads K").tensor[0, 0].flatten(), k_flat[0, 0])


def test_cross_attention_steps():
    mha = _module()
    x, memory = torch.randn(2, 3, 4), torch.randn(2, 5, 4)
    with multihead.trace() as t:
        mha(x, memory)
    shapes = dict(_labels_shapes(t))
    assert shapes["project Q"] == (2, 3, 8)
    assert shapes["project K"] == shapes["project V"] == (2, 5, 8)
    assert shapes["move heads forward K"] == (2, 2, 5, 4)
    assert shapes["scores QKᵀ"] == (2, 2, 3, 5)
    assert shapes["weights × V"] == (2, 2, 3, 4)
    assert shapes["output projection"] == (2, 3, 8)
    assert t.step("project K").note == "K and V: one product with [W_k; W_v]"
    keep = t.step("causal mask").extras["keep"]
    # bottom-right aligned: the last query sees every key, the first sees Lk - Lq + 1 of them
    assert keep.expand(3, 5).sum(dim=-1).tolist() == [3, 4, 5]
    assert t.all_checks_hold


def test_grouped_query_attention_repeats_kv_heads():
    torch.manual_seed(0)
    mha = multihead.MultiHeadAttention(8, 4, 8, num_kv_heads=2, backend="reference")
    x = torch.randn(2, 3, 8)
    with multihead.trace() as t:
        mha(x)
    labels = [s.label for s in t.steps]
    assert labels.index("repeat kv heads K") < labels.index("scores QKᵀ")
    shapes = dict(_labels_shapes(t))
    assert shapes["project K"] == (2, 3, 4)  # Hkv * D = 2 * 2
    assert shapes["split heads K"] == (2, 3, 2, 2)
    assert shapes["repeat kv heads K"] == shapes["repeat kv heads V"] == (2, 4, 3, 2)
    k_small = t.step("move heads forward K").tensor
    assert torch.equal(t.step("repeat kv heads K").tensor, k_small.repeat_interleave(2, dim=1))
    assert "mask" not in " ".join(labels)  # not causal: no mask step
    assert t.all_checks_hold


def _qkv(lk=5):
    torch.manual_seed(1)
    return torch.randn(2, 2, 3, 4), torch.randn(2, 2, lk, 4), torch.randn(2, 2, lk, 4)


def _mask_cases():
    pad = torch.tensor([[True, True, True, False, False], [True, True, True, True, True]])
    keep_t = torch.rand(3, 5, generator=torch.Generator().manual_seed(2)) > 0.3
    keep_t[:, 0] = True
    bias_t = torch.linspace(-1, 1, 15).view(3, 5)
    return {
        "causal": (masks.causal(), ["causal mask"]),
        "window": (masks.window(1), ["window mask"]),
        "key_padding": (masks.key_padding(pad), ["padding mask"]),
        "keep": (masks.keep(keep_t), ["keep mask"]),
        "bias": (masks.bias(bias_t), ["add bias"]),
        "causal & padding & bias": (masks.causal() & masks.key_padding(pad) & masks.bias(bias_t),
                                     ["add bias", "causal & padding mask"]),
    }


def _expected_weights(q, k, mask):
    """softmax of the scaled scores with the mask applied, in float64, from the mask's tensors."""
    scores = (q.double() @ k.double().transpose(-2, -1)) / 2
    mt = mask.materialize((2, 2, 3, k.shape[2]), device=q.device, dtype=torch.float64)
    if mt.bias is not None:
        scores = scores + mt.bias
    if mt.keep is not None:
        scores = scores.masked_fill(~mt.keep, NEG_INF)
    return torch.softmax(scores, dim=-1).nan_to_num(0.0)


@pytest.mark.parametrize("kind", list(_mask_cases()))
def test_each_mask_kind_through_attention(kind):
    mask, mask_steps = _mask_cases()[kind]
    q, k, v = _qkv()
    with multihead.trace() as t:
        out = multihead.attention(q, k, v, mask, backend="reference")
    assert [s.label for s in t.steps] == ["scores QKᵀ", "scale", *mask_steps, "softmax", "weights × V"]
    assert all(s.shape == (2, 2, 3, 5) for s in t.steps[:-1])
    weights = t.step("softmax").tensor
    torch.testing.assert_close(weights.double(), _expected_weights(q, k, mask), rtol=0, atol=1e-6)
    torch.testing.assert_close(out, t.step("weights × V").tensor)
    if mask_steps[-1].endswith("mask"):
        step = t.step(mask_steps[-1])
        keep = step.extras["keep"].expand(step.shape)
        assert (step.tensor[~keep] == NEG_INF).all()
        assert (weights[~keep] == 0).all()
    assert t.all_checks_hold


@pytest.mark.parametrize("kind", list(_mask_cases()))
def test_each_mask_kind_through_the_module(kind):
    mask, mask_steps = _mask_cases()[kind]
    mha = _module(causal=False)
    x, memory = torch.randn(2, 3, 4), torch.randn(2, 5, 4)
    with multihead.trace() as t:
        mha(x, memory, mask=mask)
    labels = [s.label for s in t.steps]
    i = labels.index("scale")
    assert labels[i + 1: i + 1 + len(mask_steps)] == mask_steps
    assert labels[i + 1 + len(mask_steps)] == "softmax"
    q = t.step("move heads forward Q").tensor
    k = t.step("move heads forward K").tensor
    torch.testing.assert_close(t.step("softmax").tensor.double(), _expected_weights(q, k, mask), rtol=0, atol=1e-6)
    assert t.all_checks_hold


def test_sdpa_is_one_fused_step_naming_its_kernel():
    mha = _module(backend="sdpa")
    with multihead.trace() as t:
        mha(torch.randn(2, 3, 4))
    fused = [s for s in t.steps if s.name.startswith("fused attention")]
    assert len(fused) == 1 and fused[0].shape == (2, 2, 3, 4)
    assert "scaled_dot_product_attention" in fused[0].note and "kernel" in fused[0].note
    assert not any(s.name in ("scores QKᵀ", "softmax") for s in t.steps)


def test_config_names_the_backend_that_ran():
    torch.manual_seed(0)
    mha = multihead.MultiHeadAttention(4, 2, 8)  # backend="auto"
    with multihead.trace() as t:
        mha(torch.randn(1, 3, 4))
    assert t.config["backend"] == multihead.explain_dispatch(*_qkv()).backend == "sdpa"
    with multihead.trace() as t:
        mha(torch.randn(1, 3, 4), return_weights=True)
    assert t.config["backend"] == "reference"


def test_tracing_off_records_nothing_and_calls_no_trace_code(monkeypatch):
    assert current() is None
    idle = multihead.trace()  # made but never entered
    calls = []
    monkeypatch.setattr(Trace, "record", lambda self, *a, **k: calls.append(a))
    monkeypatch.setattr(Trace, "set_config", lambda self, **k: calls.append(k))
    mha = _module()
    mha(torch.randn(2, 3, 4))
    multihead.attention(*_qkv(), masks.causal(), backend="reference")
    assert calls == [] and len(idle) == 0


def test_only_the_innermost_trace_records_and_exit_restores():
    mha = _module()
    x = torch.randn(2, 3, 4)
    with multihead.trace() as outer:
        with multihead.trace() as inner:
            mha(x)
        assert current() is outer
        mha(x)
    assert current() is None
    assert len(inner) == len(outer) == len(DEFAULT_STEPS)


def test_keep_values_false_keeps_no_tensors():
    with multihead.trace(keep_values=False) as t:
        _module()(torch.randn(2, 3, 4))
    assert _labels_shapes(t) == DEFAULT_STEPS
    assert all(s.tensor is None and s.extras == {} for s in t.steps)
    assert t.all_checks_hold


def test_to_json_and_str():
    with multihead.trace() as t:
        _module()(torch.randn(2, 3, 4))
    data = json.loads(t.to_json())
    assert set(data) == {"config", "steps"}
    assert [(d["name"], tuple(d["shape"])) for d in data["steps"]] == DEFAULT_STEPS
    assert data["steps"][4]["pattern"] == "b t (h d) -> b t h d"
    assert data["steps"][4]["axes"] == ["b", "t", "h", "d"]
    assert data["steps"][4]["view"] is True
    assert data["steps"][13]["checks"] == {"rows sum to 1": True, "masked weights are exactly 0": True}
    text = str(t)
    for label, _ in DEFAULT_STEPS:
        assert label in text
    n = len(t.checks)
    assert f"checks: {n}/{n} hold" in text


def test_layout_checks_fail_on_wrong_data():
    x = torch.randn(2, 3, 8)
    split = x.view(2, 3, 2, 4)
    assert _layout_checks(steps.SPLIT_HEADS, split, x, True) == {"same data after view": True}
    copied = split.clone()
    assert _layout_checks(steps.SPLIT_HEADS, copied, x, False) == {"same data after view": False}
    moved = split.transpose(1, 2)
    wrong = moved.clone()
    wrong[0, 0, 0, 0] += 1
    assert _layout_checks(steps.MOVE_HEADS_FORWARD, wrong, split, True) == {"same data after transpose": False}
    merged = moved.transpose(1, 2).reshape(2, 3, 8)
    bad = merged.clone()
    bad[1, 2, 7] = 0.5
    assert _layout_checks(steps.MERGE_HEADS, merged, moved.transpose(1, 2), False)["heads concatenated back to d_out"]
    assert not _layout_checks(steps.MERGE_HEADS, bad, moved.transpose(1, 2), False)["heads concatenated back to d_out"]


def test_softmax_checks_fail_on_wrong_weights():
    scores = torch.tensor([[0.5, NEG_INF, 0.1], [NEG_INF, NEG_INF, NEG_INF]])
    good = reference.safe_softmax(scores)
    assert all(reference._softmax_checks(good, scores).values())
    off = good.clone()
    off[0, 0] += 1e-3
    assert reference._softmax_checks(off, scores)["rows sum to 1"] is False
    leak = good.clone()
    leak[0, 1] = 1e-6
    assert reference._softmax_checks(leak, scores)["masked weights are exactly 0"] is False
