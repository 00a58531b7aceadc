"""The decode step's shortcuts change nothing a user can see (issue 12 item 1).

The module calls a plain ``nn.Linear`` projection as ``F.linear`` on its current weights when its
``__call__`` would run nothing but ``forward``; every hook (the projection's own, or global ones),
a ``forward`` replaced on the instance and an ``nn.Linear`` subclass still run as module calls.
The trace is looked up once per forward and handed down; the auto backend chosen without a trace
is the one ``explain_dispatch`` names. Values are compared with the module's steps written out in
float64, or exactly where the claim is "the same call".
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import multihead
from multihead import backends
from multihead.masks import causal, key_padding

from ref64 import attention64, causal_keep


def _module(seed: int = 0) -> multihead.MultiHeadAttention:
    torch.manual_seed(seed)
    return multihead.MultiHeadAttention(8, 2, causal=True).double()


def _by_hand(mha, x, q_fn=None):
    """The module's forward written out with the projections called as modules (float64)."""
    q = (q_fn or mha.q_proj)(x).view(*x.shape[:2], 2, 4).transpose(1, 2)
    k, v = (p(x).view(*x.shape[:2], 2, 4).transpose(1, 2) for p in (mha.k_proj, mha.v_proj))
    o, _ = attention64(q, k, v, causal_keep(x.shape[1], x.shape[1]))
    return mha.out_proj(o.transpose(1, 2).reshape(*x.shape[:2], 8))


def test_global_forward_hooks_fire_for_every_projection():
    mha, x = _module(), torch.randn(2, 3, 8, dtype=torch.float64)
    seen = []

    def pre(mod, args):
        if isinstance(mod, nn.Linear):
            seen.append("pre")
            return (args[0] * 2,)

    def post(mod, args, out):
        if isinstance(mod, nn.Linear):
            seen.append("post")

    handles = [nn.modules.module.register_module_forward_pre_hook(pre),
               nn.modules.module.register_module_forward_hook(post)]
    try:
        with torch.no_grad():
            got = mha(x)
    finally:
        for h in handles:
            h.remove()
    assert seen == ["pre", "post"] * 4
    with torch.no_grad():
        doubled = [lambda t, p=p: p(2 * t) for p in (mha.q_proj, mha.k_proj, mha.v_proj)]
        q = doubled[0](x).view(2, 3, 2, 4).transpose(1, 2)
        k, v = (f(x).view(2, 3, 2, 4).transpose(1, 2) for f in doubled[1:])
        o, _ = attention64(q, k, v, causal_keep(x.shape[1], x.shape[1]))
        want = mha.out_proj(2 * o.transpose(1, 2).reshape(2, 3, 8))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_replaced_forward_and_linear_subclass_run_as_modules():
    mha, x = _module(), torch.randn(2, 3, 8, dtype=torch.float64)

    class Scaled(nn.Linear):
        def forward(self, t):
            return 3 * super().forward(t)

    with torch.no_grad():
        plain_q = mha.q_proj
        mha.q_proj.forward = lambda t, lin=plain_q: torch.tanh(F.linear(t, lin.weight, lin.bias))
        torch.testing.assert_close(mha(x), _by_hand(mha, x), rtol=1e-12, atol=1e-12)
        sub = Scaled(8, 8, dtype=torch.float64)
        sub.load_state_dict(nn.Linear(8, 8, dtype=torch.float64).state_dict())
        mha.q_proj = sub
        torch.testing.assert_close(mha(x), _by_hand(mha, x), rtol=1e-12, atol=1e-12)


def test_backward_hook_on_a_projection_fires():
    mha, x = _module(), torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    grads = []
    mha.v_proj.register_full_backward_hook(lambda mod, gin, gout: grads.append(gout[0].clone()))
    mha(x).sum().backward()
    assert len(grads) == 1 and grads[0].shape == (2, 3, 8)


def test_fast_projection_is_the_modules_own_call_bitwise():
    """F.linear on the current weights is what nn.Linear.forward runs: bitwise equal outputs."""
    mha, x = _module(), torch.randn(2, 5, 8, dtype=torch.float64)
    with torch.no_grad():
        fast = mha(x)
        mha.out_proj.register_forward_hook(lambda mod, args, out: None)  # forces the module call
        assert torch.equal(mha(x), fast)


def test_auto_backend_without_a_trace_is_what_explain_dispatch_names():
    torch.manual_seed(0)
    calls = [
        (torch.randn(1, 2, 1, 4), torch.randn(1, 2, 9, 4), torch.randn(1, 2, 9, 4), None, 0.0),
        (torch.randn(2, 2, 64, 4), torch.randn(2, 1, 64, 4), torch.randn(2, 1, 64, 4), causal(), 0.0),
        (torch.randn(1, 1, 512, 4), torch.randn(1, 1, 512, 4), torch.randn(1, 1, 512, 4), causal(), 0.0),
        (torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4),
         key_padding(torch.tensor([[True, True, False, True, False]])), 0.5),
        (torch.randn(1, 2, 3, 4, dtype=torch.float64), torch.randn(1, 2, 5, 4, dtype=torch.float64),
         torch.randn(1, 2, 5, 6, dtype=torch.float64), None, 0.0),
    ]
    for q, k, v, mask, p in calls:
        want = multihead.explain_dispatch(q, k, v, mask, dropout_p=p).backend
        assert backends.resolve("auto", backends.Call(q, k, v, mask, p)).name == want
        with multihead.trace(keep_values=False) as t:
            multihead.attention(q, k, v, mask, dropout_p=p)
        assert t.config["backend"] == want and t.config["dispatch"]["backend"] == want


def test_trace_records_every_step_of_a_cached_decode_step():
    torch.manual_seed(0)
    mha = multihead.MultiHeadAttention(8, 2, causal=True).eval()
    cache = multihead.KVCache(8)
    with torch.no_grad():
        mha(torch.randn(1, 4, 8), cache=cache)
        with multihead.trace() as t:
            y = mha(torch.randn(1, 1, 8), cache=cache)
    labels = [s.label for s in t.steps]
    for role in "QKV":
        assert f"split heads {role}" in labels and f"move heads forward {role}" in labels
    for label in ("input", "project Q", "append to the cache K", "append to the cache V",
                  "move heads back", "merge heads", "output projection"):
        assert label in labels, label
    assert labels.index("merge heads") < labels.index("output projection")
    assert torch.equal(t.step("output projection").tensor, y)
    assert t.config["backend"] == "sdpa" and t.all_checks_hold
