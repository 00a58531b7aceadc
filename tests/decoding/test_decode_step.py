"""The decided decode step (`multihead.decode_step`) is the general path, bit for bit, and
steps aside whenever anything it decided may have changed (issue 12 item 1).

Every comparison is exact (``torch.equal``): the step runs the module's own core steps on the
same tensors, so any difference is a bug, not rounding. "General" is the same module and cache
with ``decode_step.ENABLED = False``.
"""

from __future__ import annotations

import copy
import gc
import pickle
import weakref

import pytest
import torch
import torch.nn as nn
from torch.nn.utils import parametrize

import multihead
from multihead import backends, decode_step

D, H = 16, 4


def _module(seed=0, dtype=torch.float32, **kw) -> multihead.MultiHeadAttention:
    torch.manual_seed(seed)
    return multihead.MultiHeadAttention(D, H, causal=True, dtype=dtype, **kw).eval()


def _tokens(n, seed=1, dtype=torch.float32, batch=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, n, D, generator=g).to(dtype)


def _generate(mha, prompt, steps, *, enabled=True, cache=None, grad_mode=torch.no_grad):
    """(outputs of every decode step, the cache): prefill, then ``steps`` one-token steps, each
    fed a token made from the previous output (so an error would compound)."""
    old = decode_step.ENABLED
    decode_step.ENABLED = enabled
    try:
        cache = multihead.KVCache(prompt.shape[1] + steps + 2) if cache is None else cache
        outs = []
        with grad_mode():
            y = mha(prompt, cache=cache)
            x = torch.tanh(y[:, -1:, :D])
            for _ in range(steps):
                y = mha(x, cache=cache)
                outs.append(y)
                x = torch.tanh(y[..., :D])  # (d_out may differ from d_in)
        return outs, cache
    finally:
        decode_step.ENABLED = old


def _count_general(monkeypatch):
    """A list that grows by one for every call that runs the general path's projection step."""
    seen = []
    orig = multihead.MultiHeadAttention._project

    def spy(self, *a, **k):
        seen.append(1)
        return orig(self, *a, **k)

    monkeypatch.setattr(multihead.MultiHeadAttention, "_project", spy)
    return seen


CONFIGS = {
    "plain": dict(),
    "no bias": dict(bias=False),
    "gqa": dict(num_kv_heads=2),
    "mqa": dict(num_kv_heads=1),
    "rope": dict(rope=True),
    "rope gqa no bias": dict(rope=True, num_kv_heads=2, bias=False),
    "d_out": dict(d_out=24),
}


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
def test_decided_steps_equal_the_general_path_bit_for_bit(name, dtype, grad_mode, monkeypatch):
    mha, prompt = _module(dtype=dtype, **CONFIGS[name]), _tokens(5, dtype=dtype)
    general, cache_g = _generate(mha, prompt, 6, enabled=False, grad_mode=grad_mode)
    seen = _count_general(monkeypatch)
    fast, cache_f = _generate(mha, prompt, 6, grad_mode=grad_mode)
    assert len(seen) == 1, "only the prefill takes the general path; every step is the decided one"
    for a, b in zip(fast, general):
        assert a.dtype == dtype and torch.equal(a, b)
    assert len(cache_f) == len(cache_g) == 11
    assert torch.equal(cache_f.keys, cache_g.keys) and torch.equal(cache_f.values, cache_g.values)


@pytest.mark.parametrize("name", ["plain", "gqa", "rope gqa no bias", "d_out"])
@pytest.mark.parametrize("batch", [2, 3])
@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
def test_batched_steps_are_decided_and_equal_the_general_path(name, batch, grad_mode, monkeypatch):
    """B > 1 (every row one new token): decided once, then the general path's three products."""
    mha, prompt = _module(**CONFIGS[name]), _tokens(5, batch=batch)
    general, cache_g = _generate(mha, prompt, 6, enabled=False, grad_mode=grad_mode)
    seen = []
    orig = multihead.MultiHeadAttention._defaults
    monkeypatch.setattr(multihead.MultiHeadAttention, "_defaults", lambda self, *a: seen.append(1) or orig(self, *a))
    fast, cache_f = _generate(mha, prompt, 6, grad_mode=grad_mode)
    assert len(seen) == 1, "only the prefill takes the general path; every step is the decided one"
    assert mha._decode_step is not None and not mha._decode_step._stacked
    for a, b in zip(fast, general):
        assert a.shape == (batch, 1, mha.config.d_out) and torch.equal(a, b)
    assert torch.equal(cache_f.keys, cache_g.keys) and torch.equal(cache_f.values, cache_g.values)


def test_steps_equal_a_full_causal_forward():
    """The decided steps against the module's own full forward over the whole sequence (float64)."""
    mha, prompt = _module(dtype=torch.float64, rope=True, num_kv_heads=2), _tokens(4, dtype=torch.float64)
    xs = _tokens(5, seed=7, dtype=torch.float64)
    cache = multihead.KVCache(16)
    with torch.no_grad():
        mha(prompt, cache=cache)
        steps = [mha(xs[:, i:i + 1], cache=cache) for i in range(5)]
        full = mha(torch.cat([prompt, xs], dim=1))
    assert mha._decode_step is not None
    torch.testing.assert_close(torch.cat(steps, dim=1), full[:, 4:], rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------- guards
def _one_step(mha, cache, x):
    with torch.no_grad():
        return mha(x, cache=cache)


def _ready(**kw):
    """A module whose decode step has been decided for a cache, the cache rewound to a fixed
    length so that each call appends the same token position, and that token."""
    mha = _module(**kw)
    cache = multihead.KVCache(12)
    prompt, x = _tokens(4), _tokens(1, seed=5)
    with torch.no_grad():
        mha(prompt, cache=cache)
        mha(x, cache=cache)
    assert mha._decode_step is not None
    return mha, cache, x


def _again(mha, cache, x, *, enabled=True):
    cache.length = 4
    old = decode_step.ENABLED
    decode_step.ENABLED = enabled
    try:
        return _one_step(mha, cache, x)
    finally:
        decode_step.ENABLED = old


def test_in_place_weight_edits_are_seen_by_the_next_step():
    mha, cache, x = _ready()
    before = _again(mha, cache, x)
    with torch.no_grad():
        mha.v_proj.weight.mul_(2.0)
        mha.out_proj.bias.add_(1.0)
    after = _again(mha, cache, x)
    assert not torch.equal(after, before)
    assert torch.equal(after, _again(mha, cache, x, enabled=False))


def test_rebinding_a_parameter_sends_the_step_to_the_general_path(monkeypatch):
    mha, cache, x = _ready()
    before = _again(mha, cache, x)
    mha.k_proj.weight.data = torch.randn_like(mha.k_proj.weight)  # no longer a row of the block
    twin, twin_cache = copy.deepcopy(mha), copy.deepcopy(cache)
    for lin in (twin.q_proj, twin.k_proj, twin.v_proj):  # three separate products, as mha makes now
        for p in lin.parameters():
            p.data = p.data.clone()
    seen = _count_general(monkeypatch)
    got = _again(mha, cache, x)
    assert seen, "the general path ran"
    assert not torch.equal(got, before)
    assert torch.equal(got, _again(twin, twin_cache, x, enabled=False))  # the new weight, as a fresh module uses it


def test_load_state_dict_between_steps_is_seen():
    mha, cache, x = _ready()
    other = _module(seed=3)
    mha.load_state_dict(other.state_dict())
    assert torch.equal(_again(mha, cache, x), _again(mha, cache, x, enabled=False))


@pytest.mark.parametrize("where", ["q_proj", "out_proj", "module", "global"])
def test_a_hook_added_after_the_step_was_decided_fires(where):
    mha, cache, x = _ready()
    fired = []

    def hook(mod, args, out):
        fired.append(type(mod).__name__)
        return out * 2

    if where == "global":
        handle = nn.modules.module.register_module_forward_hook(hook)
    else:
        handle = (mha if where == "module" else getattr(mha, where)).register_forward_hook(hook)
    try:
        got = _again(mha, cache, x)
        want = _again(mha, cache, x, enabled=False)
    finally:
        handle.remove()
    assert fired and torch.equal(got, want)
    assert not torch.equal(got, _again(mha, cache, x))  # the hook changed the output; without it, the step again


def test_a_parametrization_added_after_the_step_was_decided_is_used():
    mha, cache, x = _ready()

    class Scale(nn.Module):
        def forward(self, w):
            return w * 0.5

    parametrize.register_parametrization(mha.q_proj, "weight", Scale())
    got = _again(mha, cache, x)
    assert torch.equal(got, _again(mha, cache, x, enabled=False))
    parametrize.remove_parametrizations(mha.q_proj, "weight", leave_parametrized=False)


def test_a_forward_replaced_on_the_instance_or_a_subclass_runs():
    mha, cache, x = _ready()
    calls = []
    original = mha.forward

    def replaced(*a, **k):
        calls.append(1)
        return original(*a, **k) + 1

    mha.forward = replaced
    got = _again(mha, cache, x)
    del mha.forward
    assert calls and torch.equal(got, _again(mha, cache, x) + 1)

    class Sub(multihead.MultiHeadAttention):
        def forward(self, *a, **k):
            return super().forward(*a, **k) * 3

    sub = Sub(D, H, causal=True).eval()
    sub.load_state_dict(mha.state_dict())
    c2 = multihead.KVCache(12)
    with torch.no_grad():
        sub(_tokens(4), cache=c2)
        sub(x, cache=c2)
    assert torch.equal(_again(sub, c2, x), _again(mha, cache, x) * 3)


def test_a_trace_records_the_steps_of_a_decided_step():
    mha, cache, x = _ready()
    cache.length = 4
    with torch.no_grad(), multihead.trace() as tr:
        got = mha(x, cache=cache)
    kinds = {s.kind.id for s in tr.steps}
    assert {"project", "cache_append", "output_projection"} <= kinds
    assert torch.equal(got, _again(mha, cache, x))


def test_autocast_and_grad_mode_take_the_general_path():
    mha, prompt, x = _module(), _tokens(4), _tokens(1, seed=5)
    outs = []
    for enabled in (True, False):
        old = decode_step.ENABLED
        decode_step.ENABLED = enabled
        try:
            cache = multihead.KVCache(12)
            with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
                mha(prompt, cache=cache)
                outs.append(torch.cat([mha(x, cache=cache) for _ in range(3)], dim=1))
        finally:
            decode_step.ENABLED = old
    assert outs[0].dtype == torch.bfloat16 and torch.equal(outs[0], outs[1])  # what autocast dictates
    mha, cache, x = _ready()
    cache.length = 4
    with pytest.raises(ValueError, match="for inference"):
        mha(x, cache=cache)  # grad on, parameters require grad: the cache refuses, as always


def test_training_with_dropout_takes_the_general_path():
    mha, cache, x = _ready(dropout=0.5)
    mha.train()
    torch.manual_seed(11)
    got = _again(mha, cache, x)
    torch.manual_seed(11)
    want = _again(mha, cache, x, enabled=False)
    assert torch.equal(got, want)
    mha.eval()
    assert not torch.equal(got, _again(mha, cache, x))  # dropout was applied in training


def test_a_full_cache_raises_as_always():
    mha, cache, x = _ready()
    cache.length = cache.max_len
    with pytest.raises(ValueError, match="is full"):
        _one_step(mha, cache, x)


def test_other_inputs_and_wrong_inputs_take_the_general_path():
    mha, cache, x = _ready()
    cache.length = 4
    with pytest.raises(TypeError, match="query is torch.float64"):
        _one_step(mha, cache, x.double())
    with pytest.raises(ValueError, match="features but d_in"):
        _one_step(mha, cache, torch.randn(1, 1, D + 1))
    two = multihead.KVCache(12)
    with torch.no_grad():
        mha(_tokens(4, batch=2), cache=two)
        got = mha(_tokens(1, seed=5, batch=2), cache=two)  # B = 2: three products, decided too
    assert got.shape == (2, 1, D)


@pytest.mark.parametrize("backend", ["reference", "chunked"])
def test_a_backend_without_takes_plain_decides_nothing_and_runs_as_before(backend, monkeypatch):
    mha, prompt = _module(backend=backend), _tokens(4)
    general, _ = _generate(mha, prompt, 3, enabled=False)
    seen = _count_general(monkeypatch)
    fast, _ = _generate(mha, prompt, 3)
    assert mha._decode_step is None and len(seen) == 4  # the prefill and every step: the general path
    assert all(torch.equal(a, b) for a, b in zip(fast, general))


def test_queries_of_the_wrong_rank_get_the_edges_errors():
    mha, cache, x = _ready()
    cache.length = 4
    with pytest.raises(ValueError, match="batch-first"):
        _one_step(mha, cache, x[0])
    with pytest.raises(ValueError, match=r"query must be \(B, Lq, d_in\)"):
        _one_step(mha, cache, torch.tensor(1.0))


def test_cache_tools_and_several_caches_stay_exact():
    mha = _module(rope=True)
    caches = [multihead.KVCache(16), multihead.KVCache(16)]
    twins = [multihead.KVCache(16), multihead.KVCache(16)]
    prompts = [_tokens(3, seed=1), _tokens(5, seed=2)]
    x = _tokens(1, seed=9)

    def both(fn):
        out = []
        for enabled, cs in ((True, caches), (False, twins)):
            old = decode_step.ENABLED
            decode_step.ENABLED = enabled
            try:
                with torch.no_grad():
                    out.append(fn(cs))
            finally:
                decode_step.ENABLED = old
        assert torch.equal(out[0], out[1])

    both(lambda cs: torch.cat([mha(p, cache=c) for p, c in zip(prompts, cs)], dim=1))
    for _ in range(3):  # alternating between two caches
        both(lambda cs: torch.cat([mha(x, cache=c) for c in cs], dim=1))
    for c in caches + twins:
        c.crop(4)
    both(lambda cs: torch.cat([mha(x, cache=c) for c in cs], dim=1))
    for c in caches + twins:
        c.reset()
    both(lambda cs: torch.cat([mha(p, cache=c) for p, c in zip(prompts, cs)], dim=1))
    both(lambda cs: torch.cat([mha(x, cache=c) for c in cs], dim=1))


def test_conversions_and_copies_decide_again():
    mha, cache, x = _ready()
    mha.double()
    assert mha._decode_step is None
    c2 = multihead.KVCache(12)
    with torch.no_grad():
        mha(_tokens(4).double(), cache=c2)
        a = mha(x.double(), cache=c2)
    twin = copy.deepcopy(mha)
    assert twin._decode_step is None
    clone = pickle.loads(pickle.dumps(mha))
    c3, c4 = multihead.KVCache(12), multihead.KVCache(12)
    with torch.no_grad():
        twin(_tokens(4).double(), cache=c3)
        clone(_tokens(4).double(), cache=c4)
        assert torch.equal(twin(x.double(), cache=c3), a) and torch.equal(clone(x.double(), cache=c4), a)


def test_the_step_keeps_no_cache_alive():
    mha, cache, x = _ready()
    buffers = weakref.ref(cache.key)
    del cache
    gc.collect()
    assert buffers() is None


def test_a_backend_registered_first_is_used_at_the_next_step():
    mha, cache, x = _ready()
    ran = []
    sdpa = backends.get("sdpa")

    def fn(q, k, v, mask, *, scale, dropout_p):
        ran.append(k.shape[2])
        return sdpa.fn(q, k, v, mask, scale=scale, dropout_p=dropout_p)

    mine = backends.Backend(name="mine-first", fn=fn, refuses=lambda call: None, summary="test")
    backends.register(mine, auto_rank=0)
    try:
        got = _again(mha, cache, x)
    finally:
        backends.AUTO_ORDER.remove("mine-first")
        del backends._REGISTRY["mine-first"]
    assert ran == [5] and torch.equal(got, _again(mha, cache, x))


@pytest.mark.parametrize("heads,kv_heads,lq,lk,takes", [
    (8, 8, 1, 256, True), (8, 2, 1, 1 << 16, True), (16, 16, 4, 1 << 14, True), (1, 1, 1, 1, True),
    (32, 8, 1, 1 << 20, False), (16, 16, 64, 1 << 16, False)])
def test_sdpa_takes_plain_only_what_it_neither_refuses_nor_declines_and_for_fewer_keys_too(
        heads, kv_heads, lq, lk, takes):
    """Backend.takes_plain's contract, for sdpa: True means auto's full reasons (refusals, then the
    planned budget) find nothing, and it stays True with fewer keys (what a decided step relies on
    for a cache's max_len). CPU tensors expanded from one row: sizes of any length, no memory."""
    def call(keys):
        q = torch.empty(1, heads, 1, 64).expand(1, heads, lq, 64)
        kv = torch.empty(1, kv_heads, 1, 64).expand(1, kv_heads, keys, 64)
        return backends.Call(q, kv, kv, None, 0.0)

    sdpa = backends.get("sdpa")
    assert sdpa.takes_plain(call(lk)) is takes
    for keys in (lk, lk // 2, 1):
        if sdpa.takes_plain(call(keys)):
            assert backends.why_not(sdpa, call(keys)) is None
    if takes:
        assert all(sdpa.takes_plain(call(keys)) for keys in (lk // 2, 1))
    else:  # False only means "ask the full reasons": they plan torch's flash kernel, no dense tensors
        assert backends.why_not(sdpa, call(lk)) is None
        assert backends.resolve("auto", call(lk)).name == backends.explain_dispatch_call(call(lk)).backend


@pytest.mark.parametrize("threads", [1, 3, 8])
def test_decided_steps_equal_the_general_path_at_any_thread_count(threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        mha, prompt = _module(num_kv_heads=2), _tokens(5)
        general, _ = _generate(mha, prompt, 4, enabled=False)
        fast, _ = _generate(mha, prompt, 4)
    finally:
        torch.set_num_threads(old)
    assert mha._decode_step is not None
    assert all(torch.equal(a, b) for a, b in zip(fast, general))


def test_a_compiled_module_never_takes_the_decided_step():
    from torch._dynamo.utils import counters

    mha = _module()
    prompt, x = _tokens(4), _tokens(1, seed=5)
    cache = multihead.KVCache(12)
    with torch.no_grad():  # an eager decided step exists before compiling
        mha(prompt, cache=cache)
        mha(x, cache=cache)
    assert mha._decode_step is not None
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(mha, fullgraph=True, backend="eager")
    # the eager reference with three products, as the compiled module makes them (it never reads the block)
    three = copy.deepcopy(mha)
    for lin in (three.q_proj, three.k_proj, three.v_proj):
        for p in lin.parameters():
            p.data = p.data.clone()
    for _ in range(2):
        static, ref = multihead.StaticKVCache(12), multihead.StaticKVCache(12)
        with torch.no_grad():
            compiled(prompt, cache=static)
            got = compiled(x, cache=static)
            three(prompt, cache=ref)
            want = three(x, cache=ref)
        assert torch.equal(got, want)
        with torch.no_grad():  # a decided eager step between compiled calls changes no guard of dynamo's
            mha(x, cache=cache)
            cache.length = 5
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] <= 2
