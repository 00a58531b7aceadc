"""The execution-context matrix: every backend, the module and the cache, in the contexts users run.

The other test files mostly run in one context (grad on, one or two threads). Defects hide in
the others: worker threads that do not inherit ``inference_mode``, a cache of weights that
``no_grad`` makes stale, reductions whose order depends on the thread count, autocast handing
over mixed dtypes. Here each path runs under

* grad mode (forward and backward), ``torch.no_grad()``, ``torch.inference_mode()``;
* CPU autocast to bfloat16, with the backward inside the autocast block as training loops do;
* ``torch.use_deterministic_algorithms(True)``, where repeated runs must agree bit for bit;
* 1, 2, 3 and 8 torch threads (more threads than this machine's cores is allowed);

and is compared with the float64 oracle under the rule of :mod:`oracle`. Inside autocast the
inputs are float32 but the attention computes in bfloat16 (autocast's rule for attention), so it
is judged as a bfloat16 computation. The chunked backend runs with 16-row, 16-key tiles here,
so that calls of a few dozen tokens split into several query blocks and key blocks (the
multi-block paths are the ones that ran into trouble). A ``torch.compile(fullgraph=True)``
subset checks graph capture and values on repeated calls.

Legend: B batch, H query heads, Hkv key/value heads, Lq/Lk lengths, D head dim.
"""

from __future__ import annotations

import contextlib
import functools
import pytest
import torch
from torch._dynamo.utils import counters

import multihead
from multihead import masks
from multihead.backends import chunked
from fixed_cases import MASK_KINDS, fixed_case
from oracle import combine, deterministic_algorithms, judge, torch_threads
from test_properties import (Case, ModuleCase, Oracle, assert_agrees, forward_backward, module_oracle,
                             oracle_run)

BACKENDS = ("reference", "sdpa", "chunked", "auto")


#: name -> (context factory, whether autograd records in it, the dtype the attention computes in)
CONTEXTS = {
    "grad": (contextlib.nullcontext, True, None),
    "no_grad": (torch.no_grad, False, None),
    "inference_mode": (torch.inference_mode, False, None),
    "autocast_bf16": (lambda: torch.autocast("cpu", dtype=torch.bfloat16), True, torch.bfloat16),
    "deterministic": (deterministic_algorithms, True, None),
    "threads_1": (lambda: torch_threads(1), True, None),
    "threads_2": (lambda: torch_threads(2), True, None),
    "threads_3": (lambda: torch_threads(3), True, None),
    "threads_8": (lambda: torch_threads(8), True, None),
}


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """16 x 16 tiles for the chunked backend, and ``auto`` free to pick it at these sizes."""
    monkeypatch.setattr(chunked, "BLOCK_ROWS", 16)
    monkeypatch.setattr(chunked, "BLOCK_K", 16)
    monkeypatch.setattr(chunked, "AUTO_MIN_SCORES", 0)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


# --------------------------------------------------------------------------- functional
@functools.lru_cache(maxsize=None)
def _oracle(kind: str) -> Oracle:
    """The oracle of ``fixed_case(kind)``, computed once for all backends and contexts."""
    case = fixed_case(kind)
    oracle = Oracle(lambda dt, sizes=None: oracle_run(case, dt, sizes), head_dim=case.D)
    for dt in (torch.float32, torch.bfloat16):
        oracle.at(dt)
    return oracle


def _run_attention(case: Case, backend: str, context: str):
    make, records, _ = CONTEXTS[context]

    def fn(leaves):
        q, k, v, parts = case.assemble(leaves)
        return multihead.attention(q, k, v, combine(parts), backend=backend)

    with make():
        if records:
            return forward_backward(fn, case.leaves(), case.grad_out)
        return fn({n: t.detach() for n, t in case.leaves().items()}).detach(), {}


@pytest.mark.parametrize("context", list(CONTEXTS))
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_in_every_context_matches_float64_oracle(backend, kind, context):
    case, oracle = fixed_case(kind), _oracle(kind)
    out, grads = _run_attention(case, backend, context)
    computed = CONTEXTS[context][2] or case.dtype
    assert out.dtype == computed, f"{context}: output {out.dtype}, want {computed}"
    for name, g in grads.items():  # gradients come back in each leaf's own dtype
        assert g.dtype == case.leaves()[name].dtype
    assert_agrees(f"{backend} under {context}", out, grads, oracle, computed)


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_deterministic_mode_repeats_bit_for_bit_at_every_thread_count(backend, kind):
    """Under deterministic algorithms the output and every gradient are bitwise equal from run to run."""
    case = fixed_case(kind)
    with deterministic_algorithms():
        for threads in (1, 3, 8):
            with torch_threads(threads):
                first = _run_attention(case, backend, "grad")
                again = _run_attention(case, backend, "grad")
            assert torch.equal(first[0], again[0]), f"{threads} threads: outputs differ"
            for name in first[1]:
                assert torch.equal(first[1][name], again[1][name]), f"{threads} threads: grad {name} differs"


def test_mixing_contexts_across_calls_gives_the_same_results():
    """One call after another in different modes: each equals the same call made alone."""
    case = fixed_case("padding_bias")
    alone = {c: _run_attention(case, "chunked", c)[0] for c in ("grad", "no_grad", "inference_mode")}
    for order in (("inference_mode", "grad", "no_grad"), ("no_grad", "inference_mode", "grad")):
        for c in order:
            assert torch.equal(_run_attention(case, "chunked", c)[0], alone[c]), (order, c)


# --------------------------------------------------------------------------- module
def _module_case(cross: str, causal: bool) -> ModuleCase:
    Lq, Lk = 37, (37 if cross == "self" else 29)
    kdim = 24 if cross == "self" else 20
    return ModuleCase(d_in=24, H=4, Hkv=2, head_dim=6, kdim=kdim, vdim=kdim if cross != "kvv" else 12,
                      bias=True, causal=causal, B=2, Lq=Lq, Lk=Lk, cross=cross, dtype=torch.float32,
                      seed=sum(map(ord, cross)) + causal, parts=[])


MODULE_CASES = [("self", True), ("kv", False), ("kvv", False)]


@functools.lru_cache(maxsize=None)
def _module_oracle(cross: str, causal: bool) -> Oracle:
    """The oracle of ``_module_case(cross, causal)``: every backend builds the same weights."""
    case = _module_case(cross, causal)
    params = dict(case.build().named_parameters())
    oracle = Oracle(lambda dt, sizes=None: module_oracle(case, params, dt, sizes),
                    head_dim=case.head_dim + case.d_in + case.kdim)
    for dt in (torch.float32, torch.bfloat16):
        oracle.at(dt)
    return oracle


@pytest.mark.parametrize("context", list(CONTEXTS))
@pytest.mark.parametrize("cross,causal", MODULE_CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_module_in_every_context_matches_float64_oracle(backend, cross, causal, context):
    case = _module_case(cross, causal)
    mha = case.build(backend=backend)
    params = dict(mha.named_parameters())
    oracle = _module_oracle(cross, causal)
    make, records, computed = CONTEXTS[context]
    leaves, grad_out = case.inputs(case.dtype)
    with make():
        if records:
            out, grads = forward_backward(lambda lv: mha(*case.args(lv)), {**leaves, **params}, grad_out)
        else:
            out, grads = mha(*case.args({n: t.detach() for n, t in leaves.items()})), {}
    computed = computed or case.dtype
    assert out.dtype == computed
    assert_agrees(f"module {backend} {cross} under {context}", out, grads, oracle, computed)


def test_module_in_mixed_contexts_and_after_an_edit_between_them():
    """inference_mode, no_grad and grad calls in turn, with the weights edited in between:
    every call equals a freshly built module with the current weights."""
    case = _module_case("self", True)
    mha = case.build()
    x = case.inputs(case.dtype)[0]["query"].detach()

    def fresh():
        twin = case.build()
        twin.load_state_dict(mha.state_dict())
        with torch.no_grad():
            return twin(x)

    for step, context in enumerate(("inference_mode", "no_grad", "grad", "inference_mode", "no_grad")):
        with CONTEXTS[context][0]():
            got = mha(x)
        assert torch.equal(got.detach(), fresh()), (step, context)
        with torch.no_grad():
            mha.q_proj.weight.mul_(1.5)
            mha.v_proj.bias.add_(0.25)


# --------------------------------------------------------------------------- cache
@pytest.mark.parametrize("context", [c for c in CONTEXTS if c != "grad"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_cached_decoding_in_every_context_matches_float64_oracle(backend, context):
    """Prefill 9 tokens, then decode the rest one at a time: the outputs are the full causal
    forward's (float64 oracle). Contexts in which autograd records run under no_grad inside
    (the cache is for inference; grad mode itself is refused, see the next test)."""
    case = _module_case("self", True)
    mha = case.build(backend=backend)
    oracle = _module_oracle("self", True)
    make, records, computed = CONTEXTS[context]
    x = case.inputs(case.dtype)[0]["query"].detach()
    cache = multihead.KVCache(max_len=case.Lq)
    with make(), (torch.no_grad() if records else contextlib.nullcontext()):
        pieces = [mha(x[:, :9], cache=cache)]
        pieces += [mha(x[:, i:i + 1], cache=cache) for i in range(9, case.Lq)]
    out = torch.cat(pieces, dim=1)
    verdict = judge(f"cached decode {backend} under {context}", out, oracle.out, lambda dt: oracle.at(dt)[0],
                    computed or case.dtype, terms=oracle.terms_out, score_size=oracle.score_size,
                    head_dim=oracle.head_dim)
    assert verdict.ok, str(verdict)


def test_cache_refuses_grad_mode_by_name():
    case = _module_case("self", True)
    mha = case.build()
    x = case.inputs(case.dtype)[0]["query"].detach()
    with pytest.raises(ValueError, match="no_grad"):
        mha(x[:, :4], cache=multihead.KVCache(max_len=8))


# --------------------------------------------------------------------------- torch.compile
def _compiled(fn, backend="aot_eager"):
    torch._dynamo.reset()
    counters.clear()
    return torch.compile(fn, fullgraph=True, backend=backend)


def _graph_breaks() -> int:
    return sum(counters["graph_break"].values())


@pytest.mark.parametrize("context", ["grad", "no_grad", "inference_mode"])
@pytest.mark.parametrize("backend", ["reference", "sdpa", "auto"])
def test_compiled_attention_matches_float64_oracle_on_repeated_calls(backend, context):
    """fullgraph=True: one graph, no break, and the compiled calls agree with the oracle every time."""
    case = fixed_case("causal_cross")
    oracle = Oracle(lambda dt, sizes=None: oracle_run(case, dt, sizes), head_dim=case.D)
    mask = combine(case.parts)
    f = _compiled(lambda q, k, v: multihead.attention(q, k, v, mask, backend=backend))
    make, records, _ = CONTEXTS[context]
    for _ in range(3):
        with make():
            if records:
                out, grads = forward_backward(lambda lv: f(lv["q"], lv["k"], lv["v"]), case.leaves(), case.grad_out)
            else:
                out, grads = f(case.q, case.k, case.v), {}
        assert_agrees(f"compiled {backend} under {context}", out, grads, oracle, case.dtype)
    assert _graph_breaks() == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] <= 2  # the forward (and, in grad mode, nothing more)


@pytest.mark.parametrize("context", ["grad", "no_grad", "inference_mode"])
def test_compiled_module_matches_float64_oracle_on_repeated_calls(context):
    case = _module_case("self", True)
    mha = case.build(backend="auto")
    params = dict(mha.named_parameters())
    oracle = Oracle(lambda dt, sizes=None: module_oracle(case, params, dt, sizes),
                    head_dim=case.head_dim + case.d_in + case.kdim)
    f = _compiled(mha)
    make, records, _ = CONTEXTS[context]
    leaves, grad_out = case.inputs(case.dtype)
    for _ in range(3):
        with make():
            if records:
                out, grads = forward_backward(lambda lv: f(lv["query"]), {**leaves, **params}, grad_out)
            else:
                out, grads = f(leaves["query"].detach()), {}
        assert_agrees(f"compiled module under {context}", out, grads, oracle, case.dtype)
    assert _graph_breaks() == 0, dict(counters["graph_break"])


@pytest.mark.parametrize("context", ["grad", "no_grad"])
def test_compiled_packed_rope_training_call_has_no_graph_break(context):
    """Issue 21, defect 5: ``positions=`` with a packed mask failed to compile with fullgraph=True
    (``int(positions.min())`` and ``int(positions.max())`` read on the host). In float64 the
    compiled calls equal the eager module's, for new positions on every call, and a negative
    position is still refused, by an op in the graph."""
    torch.manual_seed(0)
    mha = multihead.MultiHeadAttention(16, 4, causal=True, rope=True, dtype=torch.float64)
    f = _compiled(mha)
    make = torch.no_grad if context == "no_grad" else contextlib.nullcontext
    for lengths in ([4, 6], [7, 3], [2, 5, 3]):
        x = torch.randn(2, 10, 16, dtype=torch.float64, requires_grad=context == "grad")
        pos = torch.cat([torch.arange(n) for n in lengths])
        m = masks.from_seqlens(lengths)
        with make():
            got, want = f(x, mask=m, positions=pos), mha(x, mask=m, positions=pos)
        assert (got - want).abs().max() <= 1e-12
        if context == "grad":
            g1, = torch.autograd.grad(got.square().sum(), x)
            g2, = torch.autograd.grad(want.square().sum(), x)
            assert (g1 - g2).abs().max() <= 1e-12
    assert _graph_breaks() == 0, dict(counters["graph_break"])
    with pytest.raises(RuntimeError, match="positions must be >= 0"):
        f(x.detach(), mask=m, positions=pos - 1)


def test_compiled_module_with_inductor_matches_float64_oracle():
    """The default compiler backend too (one small case: inductor compiles take seconds here)."""
    case = _module_case("self", True)
    mha = case.build(backend="sdpa")
    params = dict(mha.named_parameters())
    oracle = Oracle(lambda dt, sizes=None: module_oracle(case, params, dt, sizes),
                    head_dim=case.head_dim + case.d_in + case.kdim)
    x = case.inputs(case.dtype)[0]["query"].detach()
    f = _compiled(mha, backend="inductor")
    for _ in range(2):
        with torch.no_grad():
            out = f(x)
        assert_agrees("module compiled by inductor", out, {}, oracle, case.dtype)
    assert _graph_breaks() == 0, dict(counters["graph_break"])


def test_chunked_is_routed_around_under_compile_and_explain_dispatch_says_so(monkeypatch):
    """Where eager ``auto`` picks chunked (sdpa's dense-mask budget set to 0 here), the compiled
    call runs the next backend in one graph (no break) with the oracle's values, and
    ``explain_dispatch(compiling=True)`` names the reason; chunked asked for by name refuses."""
    from multihead.backends import sdpa
    monkeypatch.setattr(sdpa, "DENSE_MASK_BUDGET_BYTES", 0)
    case = fixed_case("window")
    mask = combine(case.parts)
    assert multihead.explain_dispatch(case.q, case.k, case.v, mask).backend == "chunked"
    under = multihead.explain_dispatch(case.q, case.k, case.v, mask, compiling=True)
    assert under.backend == "reference" and "torch.compile" in under.refused["chunked"]
    with pytest.raises(Exception, match="torch.compile"):
        _compiled(lambda q, k, v: multihead.attention(q, k, v, mask, backend="chunked"), backend="eager")(
            case.q, case.k, case.v)
    f = _compiled(lambda q, k, v: multihead.attention(q, k, v, mask))
    with torch.no_grad():
        out = f(case.q, case.k, case.v)
    assert_agrees("compiled auto at a chunked size", out, {}, _oracle("window"), case.dtype)
    assert _graph_breaks() == 0, dict(counters["graph_break"])


@pytest.mark.parametrize("cross,causal", MODULE_CASES)
def test_exported_module_matches_float64_oracle(cross, causal):
    """``torch.export.export`` of the module (self-, cross-attention, GQA): the exported program
    gives the module's values (within the oracle's rule)."""
    case = _module_case(cross, causal)
    mha = case.build(backend="auto").eval()
    leaves = {n: t.detach() for n, t in case.inputs(case.dtype)[0].items()}
    program = torch.export.export(mha, case.args(leaves))
    with torch.no_grad():
        out = program.module()(*case.args(leaves))
    assert_agrees(f"exported module {cross}", out, {}, _module_oracle(cross, causal), case.dtype)
