"""The chunked backend's tiles with the programmable mask kinds (issue 13, Contract A's kernel
side): score mods per tile in written order after the additive parts, with gradients into the
tensors they capture; sinks through the lse; alibi; documents, chunked-local and block plans,
whose empty tiles are skipped and whose full tiles need no keep mask.

Every case is held in float64 at 1e-12 to attention written out from its definition here
(scores, additive parts, mods in order, -inf where hidden, softmax with the sink term), forward
and gradients (autograd through the definition), with tiles of a few queries and keys so that
each call has many tiles of every kind (empty, full, partial) and the threads share them.

Legend: B batch, H query heads, Hkv kv heads, L length, D head dim.
"""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from multihead import masks
from multihead.backends import tiles as _tiles, chunked
from multihead.backends.chunked import chunked_attention
from oracle import parametrize_tile_kernels, tile_kernel, torch_threads  # noqa: F401 (fixture)
from ref64 import causal_keep, random_qkv

pytestmark = pytest.mark.usefixtures(tile_kernel.__name__)


def pytest_generate_tests(metafunc):
    parametrize_tile_kernels(metafunc)

NEG_INF = float("-inf")
TOL = 1e-12


def definition(q, k, v, *, keep=None, bias=None, mods=(), sink=None):
    """out (B, H, Lq, Dv) and lse (B, H, Lq) from the definition, in float64 autograd:
    s = q kᵀ/√D + bias; s = mod(s) for each mod in order; s = -inf where not keep;
    w = exp(s) / (Σ exp(s) + exp(sink)); a row with no key gives 0."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if bias is not None:
        s = s + bias
    for mod in mods:
        s = mod(s)
    if keep is not None:
        s = s.masked_fill(~keep, NEG_INF)
    parts = [s] if sink is None else [s, sink.view(1, -1, 1, 1).expand(*s.shape[:-1], 1)]
    full = torch.cat(parts, dim=-1)
    lse = torch.logsumexp(full, dim=-1)
    alive = lse > NEG_INF
    w = torch.exp(s - torch.where(alive, lse, torch.zeros_like(lse)).unsqueeze(-1)) * alive.unsqueeze(-1)
    return w @ v, lse


def compare(got, want, tensors, what):
    """got/want: (out, lse); their gradients for one loss on every tensor of ``tensors``."""
    (go, gl), (wo, wl) = got, want
    assert (go - wo).abs().max() <= TOL, f"{what}: out"
    both = (gl == NEG_INF) & (wl == NEG_INF)
    assert ((gl - wl).abs().masked_fill(both, 0.0) <= TOL).all(), f"{what}: lse"
    gen = torch.Generator().manual_seed(99)
    dout = torch.randn(go.shape, dtype=go.dtype, generator=gen)
    dlse = torch.randn(gl.shape, dtype=gl.dtype, generator=gen)

    def loss(o, l):
        return (o * dout).sum() + (l.masked_fill(l == NEG_INF, 0.0) * dlse).sum()

    g1 = torch.autograd.grad(loss(go, gl), tensors, allow_unused=True)
    g2 = torch.autograd.grad(loss(wo, wl), tensors, allow_unused=True)
    for i, (a, b) in enumerate(zip(g1, g2)):
        a = torch.zeros_like(tensors[i]) if a is None else a
        b = torch.zeros_like(tensors[i]) if b is None else b
        assert (a - b).abs().max() <= TOL, f"{what}: gradient of input {i}"


def run(q, k, v, m, threads=1, **kw):
    with torch_threads(threads):
        return chunked_attention(q, k, v, m, block_q=3, block_k=4, return_lse=True, **kw)


THREADS = [1, 3]


@pytest.mark.parametrize("threads", THREADS)
def test_score_mod_with_a_captured_learned_table_gets_its_gradient(threads):
    """A relative-position bias table captured by the user's function, as FlexAttention's docs
    write it: its gradient comes out of the chunked backward (through autograd.grad per tile)."""
    B, H, L = 2, 4, 11
    q, k, v = random_qkv(B=B, H=H, Hkv=2, Lq=L, D=4, seed=1, grad=True)
    table = torch.randn(H, 2 * L - 1, dtype=torch.float64, generator=torch.Generator().manual_seed(2), requires_grad=True)

    def rel(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + L - 1]

    i, j = torch.arange(L).view(L, 1), torch.arange(L).view(1, L)
    dense_rel = lambda s: s + table[:, i - j + L - 1].unsqueeze(0)  # noqa: E731
    m = masks.causal() & masks.score_mod(rel)
    got = run(q, k, v, m, threads)
    compare(got, definition(q, k, v, keep=causal_keep(L, L), mods=[dense_rel]), (q, k, v, table), "score_mod")


@pytest.mark.parametrize("order", ["mod_then_cap", "cap_then_mod"])
def test_score_mods_apply_in_written_order_after_the_bias(order):
    B, H, L = 1, 2, 10
    q, k, v = random_qkv(B=B, H=H, Lq=L, D=4, seed=3, grad=True)
    q = (q * 4).detach().requires_grad_(True)  # large scores: the cap bites
    bias = torch.randn(1, H, L, L, dtype=torch.float64, generator=torch.Generator().manual_seed(4), requires_grad=True)
    scale2 = lambda s, b, h, qi, ki: s * 2.0 - 1.0  # noqa: E731
    cap = 3.0
    capped = lambda s: cap * torch.tanh(s / cap)  # noqa: E731
    doubled = lambda s: s * 2.0 - 1.0  # noqa: E731
    if order == "mod_then_cap":
        m, mods = masks.bias(bias) & masks.score_mod(scale2) & masks.softcap(cap), [doubled, capped]
    else:
        m, mods = masks.softcap(cap) & masks.bias(bias) & masks.score_mod(scale2), [capped, doubled]
    compare(run(q, k, v, m), definition(q, k, v, bias=bias, mods=mods), (q, k, v, bias), order)


@pytest.mark.parametrize("threads", THREADS)
def test_sink_goes_through_the_lse_and_its_logits_get_gradients(threads):
    B, H, L = 2, 4, 9
    q, k, v = random_qkv(B=B, H=H, Hkv=1, Lq=L, Lk=L + 3, D=4, seed=5, grad=True)
    sink = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64, requires_grad=True)
    real = torch.arange(L + 3).expand(B, L + 3) >= torch.tensor([[0], [L + 3]])  # row b=1: no key at all
    m = masks.key_padding(real) & masks.sink(sink) & masks.causal()
    keep = causal_keep(L, L + 3) & real[:, None, None, :]
    got = run(q, k, v, m, threads)
    assert torch.equal(got[0][1], torch.zeros_like(got[0][1]))  # no key: out 0, lse = the sink
    compare(got, definition(q, k, v, keep=keep, sink=sink), (q, k, v, sink), "sink")


def test_alibi_with_causal_matches_its_bias():
    B, H, L = 1, 4, 13
    q, k, v = random_qkv(B=B, H=H, Lq=L, D=4, seed=6, grad=True)
    slopes = masks.alibi_slopes(H).double()
    i, j = torch.arange(L).view(L, 1), torch.arange(L).view(1, L)
    bias = (-slopes.view(1, H, 1, 1) * (j - i).abs()).to(torch.float64)
    got = run(q, k, v, masks.causal() & masks.alibi(slopes))
    compare(got, definition(q, k, v, keep=causal_keep(L, L), bias=bias), (q, k, v), "alibi")


def test_packed_documents_equal_each_document_alone_and_skip_other_documents_tiles():
    """Item 1's promise on the kernel: packed output and gradients equal each document alone,
    and only tiles that touch a query's own document are computed."""
    lengths = [5, 8, 3, 8]
    L, H = sum(lengths), 2
    q, k, v = random_qkv(B=1, H=H, Lq=L, D=4, seed=7, grad=True)
    m = masks.from_seqlens(lengths) & masks.causal()
    with _tiles.counting() as counts:
        got = run(q, k, v, m)
    computed = counts["forward"]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    alone = [definition(q[:, :, a:a + n], k[:, :, a:a + n], v[:, :, a:a + n], keep=causal_keep(n, n))
             for a, n in zip(starts, lengths)]
    want = (torch.cat([o for o, _ in alone], dim=2), torch.cat([l for _, l in alone], dim=2))
    compare(got, want, (q, k, v), "documents")
    # tiles of 3 queries x 4 keys that some query sees a key of its own document in
    visible = set()
    for a, n in zip(starts, lengths):
        for i in range(a, a + n):
            for j in range(a, i + 1):
                visible.add((i // 3, j // 4))
    assert computed == len(visible) < (L // 3 + 1) * (L // 4 + 1) // 2


def test_chunked_local_and_window_sinks_match_their_definition():
    L, H, chunk = 14, 2, 5
    q, k, v = random_qkv(B=1, H=H, Lq=L, D=4, seed=8, grad=True)
    i, j = torch.arange(L).view(L, 1), torch.arange(L).view(1, L)
    compare(run(q, k, v, masks.chunked_local(chunk) & masks.causal()),
            definition(q, k, v, keep=(i // chunk == j // chunk) & (j <= i)), (q, k, v), "chunked_local")
    compare(run(q, k, v, masks.window(3, sinks=2)),
            definition(q, k, v, keep=((j <= i) & (j >= i - 3)) | ((j < 2) & (j <= i))), (q, k, v), "window sinks")


def test_mask_mod_with_a_block_plan_skips_empty_tiles_and_evaluates_only_partial_ones():
    """The plan's empty tiles are never computed and its full ones never call the function."""
    L, H = 16, 2
    q, k, v = random_qkv(B=1, H=H, Lq=L, D=4, seed=9, grad=True)
    calls = []

    def banded(b, h, q_idx, kv_idx):
        calls.append((int(q_idx.min()), int(q_idx.max()) + 1, int(kv_idx.min()), int(kv_idx.max()) + 1))
        return (kv_idx <= q_idx) & (kv_idx > q_idx - 6)

    shape = (1, H, L, L)
    plan = masks.block_plan(masks.mask_mod(banded), shape, block_q=4, block_k=4)
    m = masks.mask_mod(banded).with_plan(plan)
    calls.clear()
    with torch_threads(2), _tiles.counting() as counts:  # the query blocks shared among threads, one tile per call (with one
        got = chunked_attention(q, k, v, m, block_q=4, block_k=4, return_lse=True)  # thread: panels)
    states = plan.states[0, 0]
    assert counts["forward"] == int((states != 0).sum())
    for q0, q1, k0, k1 in calls:  # the function saw partial tiles only
        assert states[q0 // 4, k0 // 4] == 1 and q1 - q0 <= 4 and k1 - k0 <= 4
    i, j = torch.arange(L).view(L, 1), torch.arange(L).view(1, L)
    compare(got, definition(q, k, v, keep=(j <= i) & (j > i - 6)), (q, k, v), "mask_mod plan")


def test_the_public_api_runs_the_new_kinds_on_chunked_and_auto_can_route_them():
    L, H = 12, 2
    q, k, v = random_qkv(B=1, H=H, Lq=L, D=4, seed=10)
    sink = torch.zeros(H, dtype=torch.float64)
    m = masks.causal() & masks.softcap(5.0) & masks.sink(sink)
    out = mh.attention(q, k, v, m, backend="chunked")
    want, _ = definition(q, k, v, keep=causal_keep(L, L), mods=[lambda s: 5.0 * torch.tanh(s / 5.0)], sink=sink)
    assert (out - want).abs().max() <= TOL
    assert mh.explain_dispatch(q, k, v, m).backend in ("chunked", "reference")
