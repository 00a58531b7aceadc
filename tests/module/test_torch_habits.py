"""Habits from torch.nn.MultiheadAttention, met at MultiHeadAttention's edge.

Each test is a bad habit as a torch user writes it: torch's keyword arguments get a TypeError
that names the multihead way (and the way it names gives torch's result), and a bool mask in
torch's polarity (True = blocked) warns once. The drop-in's dropout is in test_nn_dropin.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import multihead
import multihead._torch_habits
from multihead import masks
from oracle import one_thread

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

E, H, L = 8, 2, 5


def modules():
    """(torch's nn.MultiheadAttention, multihead's MultiHeadAttention) with the same weights, float64."""
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        ref.in_proj_bias.normal_()
        ref.out_proj.bias.normal_()
    ours = multihead.MultiHeadAttention(d_in=E, num_heads=H, dtype=torch.float64)
    ours.load_state_dict(ref.state_dict())   # torch's keys load through the hook
    return ref, ours


@pytest.fixture
def fresh_warning(monkeypatch):
    """The inverted-mask warning is once per process: each test starts before it."""
    monkeypatch.setattr(multihead._torch_habits, "_warned_inverted_mask", False)
    monkeypatch.setattr(multihead._torch_habits, "_checked_device_mask", False)


@pytest.mark.parametrize("name, value, fix", [
    ("attn_mask", torch.ones(L, L).triu(1).bool(), "mask=masks.from_torch(attn_mask=attn_mask)"),
    ("key_padding_mask", torch.zeros(1, L, dtype=torch.bool), "mask=masks.from_torch(key_padding_mask=pad)"),
    ("is_causal", True, "mask=masks.causal()"),
    ("need_weights", True, "return_weights=True"),
    ("average_attn_weights", False, "weights.mean(dim=1)"),
])
def test_torch_arguments_get_a_type_error_naming_the_multihead_way(name, value, fix):
    _, ours = modules()
    x = torch.randn(1, L, E, dtype=torch.float64)
    with pytest.raises(TypeError) as info:
        ours(x, **{name: value})
    message = str(info.value)
    assert f"{name}= -> " in message and fix in message
    assert "multihead.nn.MultiheadAttention" in message   # the drop-in with torch's signature
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) atn_mask; it takes query, key, value"):
        ours(x, atn_mask=value)


def test_the_named_fixes_give_torchs_result():
    """What the messages say to write equals nn.MultiheadAttention called the torch way."""
    ref, ours = modules()
    x = torch.randn(2, L, E, dtype=torch.float64)
    blocked = torch.ones(L, L).triu(1).bool()
    pad = torch.tensor([[False] * L, [False] * 3 + [True] * 2])
    expect, expect_w = ref(x, x, x, attn_mask=blocked, key_padding_mask=pad, average_attn_weights=False)
    out, w = ours(x, mask=masks.from_torch(attn_mask=blocked, key_padding_mask=pad), return_weights=True)
    torch.testing.assert_close(out, expect, rtol=0, atol=1e-12)
    torch.testing.assert_close(w, expect_w, rtol=0, atol=1e-12)
    causal, _ = ref(x, x, x, attn_mask=blocked, is_causal=True, need_weights=False)
    torch.testing.assert_close(ours(x, mask=masks.causal()), causal, rtol=0, atol=1e-12)


def test_torchs_blocked_mask_passed_as_multiheads_warns_once(fresh_warning):
    """mha(x, mask=ones(L, L).triu(1).bool()) is torch's causal mask read as "True = may attend":
    it runs (a legal mask) but every query sees only later keys; one warning names the fix,
    pointing at the caller's line."""
    _, ours = modules()
    x = torch.randn(1, L, E, dtype=torch.float64)
    torch_causal = torch.ones(L, L).triu(1).bool()
    with pytest.warns(UserWarning, match=r"masks\.from_torch\(attn_mask=m\)") as record:
        wrong = ours(x, mask=torch_causal)
    assert [w.filename for w in record] == [__file__]
    right = ours(x, mask=masks.from_torch(attn_mask=torch_causal))
    assert (wrong - right).abs().max() > 0.1   # the silent error the warning is about
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours(x, mask=torch_causal[None, None].expand(1, H, L, L))   # once per process


@pytest.mark.parametrize("mask", [
    torch.ones(L, L).tril().bool(),                  # multihead's causal, as a tensor
    torch.ones(1, H, L, L, dtype=torch.bool),        # everything visible
    ~torch.eye(L, dtype=torch.bool) | torch.eye(L, dtype=torch.bool).roll(1, 0),  # self hidden for some rows only
    torch.zeros(L, L),                               # float: added, no polarity
], ids=["tril", "ones", "partly", "float"])
def test_masks_that_see_their_own_key_do_not_warn(mask, fresh_warning):
    _, ours = modules()
    x = torch.randn(1, L, E, dtype=torch.float64)
    if mask.dtype == torch.bool:
        mask = mask.clone()
        mask.diagonal(dim1=-2, dim2=-1)[..., 0] = True   # at least one query sees its own key
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours(x, mask=mask)
    assert not multihead._torch_habits._warned_inverted_mask


def test_cross_attention_masks_are_not_judged(fresh_warning):
    """Lq != Lk: no diagonal of self-attention to read."""
    ours = multihead.MultiHeadAttention(d_in=E, num_heads=H)
    q, kv = torch.randn(1, 3, E), torch.randn(1, 4, E)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours(q, kv, kv, mask=torch.zeros(3, 4, dtype=torch.bool).index_fill(1, torch.tensor([3]), True))
