"""Extreme-tile strategies for the tiled backends: scores far outside exp's range in chosen tiles.

A tiled backend (online softmax) keeps a per-row shift while it walks the key tiles; a wrong
shift underflows or overflows whole tiles, and the damage depends on which tile holds what.
With tiles of 1 to 6 keys and queries, a few dozen keys give several tiles, and Hypothesis
draws, per (query tile, key tile), an offset far below or far above exp's range (±90 is
past float32's, ±800 past float64's), added as a bias tensor or built into the scores q·k
themselves (the kernel adds a bias in base 2 and exponentiates with a floor, plain scores
without one), optionally with an identity score_mod (score mods keep the tiles in base e), key
padding that empties the first tiles, rows whose
only visible keys are in the last tile, an optional causal mask, and optionally a random
permutation of the keys (any tile order). Outputs and the gradients of q, k, v and the bias are
held to the float64 oracle's rule (:func:`oracle.judge`), in float64, float32 and bfloat16.
The named tests below are the shapes of the defects found so far, written out.

Run deeper with ``pytest tests/backends/test_tiles.py --hypothesis-profile=long``.

Legend: B batch, H query heads, Hkv key/value heads, Lq/Lk lengths, D head dim, Dv value dim.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

import multihead
from multihead import backends
from multihead.backends import tiles as _tiles, chunked
from multihead.backends.chunked import chunked_attention
from multihead.backends import native
from oracle import MaskPart, combine, one_thread, tile_kernel_as, torch_threads
from test_properties import Case, Oracle, assert_agrees, forward_backward, oracle_run

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

def _with_kernel(which: str):
    def attend(*args, **kwargs):
        with tile_kernel_as(which):
            return chunked_attention(*args, **kwargs)
    return attend


#: the tiled backends: name -> attention(q, k, v, mask, block_q=, block_k=); the chunked backend's
#: two tile kernels (the native one takes float32/bfloat16/float16 and no Python score_mod: the
#: cases it would hand to the torch tiles are run once)
TILED = {"chunked, native": _with_kernel("native"), "chunked, torch tiles": _with_kernel("torch tiles")}

#: bias offsets of a tile: 0, near and far past float32's exp range (~±87), past float64's (~±709)
OFFSETS = [0.0, 0.0, -50.0, -90.0, -200.0, -800.0, 50.0, 90.0, 200.0, 800.0]


#: a score_mod that changes nothing: with it the tile kernel keeps its scores in base e
IDENTITY_MOD = multihead.masks.score_mod(lambda score, b, h, q_idx, kv_idx: score)


def run_case(case: Case, block_q: int, block_k: int, path: str = "panels", natural: bool = False) -> None:
    """Every tiled backend on ``case`` with tiles of ``block_q`` x ``block_k``, against the oracle,
    computed the way :data:`PATHS` names; ``natural`` (or a path that says so): with
    :data:`IDENTITY_MOD` (tiles in base e)."""
    oracle = Oracle(lambda dt, sizes=None: oracle_run(case, dt, sizes), head_dim=case.D)
    panel_scores, threads, base_e = PATHS[path]
    natural = natural or base_e
    for name, fn in TILED.items():
        if name == "chunked, native" and (natural or case.dtype == torch.float64 or native.module() is None):
            continue

        def call(leaves, fn=fn):
            q, k, v, parts = case.assemble(leaves)
            mask = combine(parts)
            if natural:
                mask = IDENTITY_MOD if mask is None else multihead.masks.as_mask(mask) & IDENTITY_MOD
            return fn(q, k, v, mask, scale=case.scale, block_q=block_q, block_k=block_k)

        with panel_budget(panel_scores), torch_threads(threads):
            out, grads = forward_backward(call, case.leaves(), case.grad_out)
        assert out.dtype == case.dtype
        assert_agrees(f"{name} tiles {block_q}x{block_k} ({path})", out, grads, oracle, case.dtype)


#: how the tiles are computed: (_tiles.PANEL_SCORES, torch threads, base e). "panels": the
#: calling thread merges tiles into panels; "tiles": one tile at a time; "threads": 3 threads
#: share the query blocks (each single-threaded, so this module's one-thread rule still holds);
#: "base e": panels, with :data:`IDENTITY_MOD` (the others are in base 2)
PATHS = {"panels": (None, 1, False), "tiles": (1, 1, False), "threads": (None, 3, False), "base e": (None, 1, True)}


@contextlib.contextmanager
def panel_budget(scores):
    """:data:`_tiles.PANEL_SCORES` set to ``scores`` (None: left as it is)."""
    if scores is None:
        yield
        return
    before, _tiles.PANEL_SCORES = _tiles.PANEL_SCORES, scores
    try:
        yield
    finally:
        _tiles.PANEL_SCORES = before


def make_case(dtype, B, H, Hkv, Lq, Lk, D, Dv, parts, seed=0) -> Case:
    g = torch.Generator().manual_seed(seed)

    def values(*shape):  # float32-representable (so the float64 case can estimate its naive error)
        return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype)

    q, k, v = values(B, H, Lq, D), values(B, Hkv, Lk, D), values(B, Hkv, Lk, Dv)
    return Case(B, H, Hkv, Lq, Lk, D, Dv, dtype, False, None, q, k, v, values(B, H, Lq, Dv), parts)


def tile_offsets(offsets, Lq, Lk, block_q, block_k) -> torch.Tensor:
    """(Lq, Lk): ``offsets[i // block_q][j // block_k]`` for query i and key j."""
    t = torch.tensor(offsets, dtype=torch.float32)
    return t.repeat_interleave(block_q, 0)[:Lq].repeat_interleave(block_k, 1)[:, :Lk]


# --------------------------------------------------------------------------- the strategy
@st.composite
def extreme_tiles(draw):
    dtype = draw(st.sampled_from([torch.float64, torch.float32, torch.bfloat16]))
    block_q, block_k = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    key_tiles, query_tiles = draw(st.integers(2, 6)), draw(st.integers(1, 4))
    Lk = key_tiles * block_k - draw(st.integers(0, block_k - 1))  # the last tile may be short
    Lq = query_tiles * block_q - draw(st.integers(0, block_q - 1))
    Hkv = draw(st.integers(1, 2))
    H, B = Hkv * draw(st.integers(1, 2)), draw(st.integers(1, 2))
    D, Dv = draw(st.integers(1, 8)), draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    offsets = draw(st.lists(st.lists(st.sampled_from(OFFSETS), min_size=key_tiles, max_size=key_tiles),
                            min_size=query_tiles, max_size=query_tiles))
    in_scores = draw(st.booleans())  # the offsets in q·k (base-2 tiles) or in a bias (base e)
    parts = []
    if not in_scores:
        shape = draw(st.sampled_from(["full", "per_batch", "keys_only"]))
        base = torch.randn(B, H, Lq, Lk, generator=gen) + tile_offsets(offsets, Lq, Lk, block_q, block_k)
        bias = {"full": base, "per_batch": base[:, :1], "keys_only": base[:1, :1, :1]}[shape]
        parts.append(MaskPart("bias", tensor=bias.to(draw(st.sampled_from([dtype, torch.float32])))))
    # key padding over the first keys: whole tiles or not, at most all but one key
    padded = draw(st.sampled_from([0, block_k, 2 * block_k, draw(st.integers(0, Lk - 1))]))
    if 0 < padded < Lk:
        parts.append(MaskPart("key_padding", tensor=(torch.arange(Lk) >= padded).expand(B, Lk)))
    if draw(st.booleans()):  # some rows see only keys of the last tile (or only the last key)
        rows = torch.rand(Lq, 1, generator=gen) < 0.5
        first = (Lk - 1) // block_k * block_k if draw(st.booleans()) else Lk - 1
        parts.append(MaskPart("keep", tensor=~rows | (torch.arange(Lk) >= first)))
    if draw(st.booleans()):
        parts.append(MaskPart("causal", align=draw(st.sampled_from(["bottom_right", "top_left"]))))
    case = make_case(dtype, B, H, Hkv, Lq, Lk, D, Dv, parts, seed=seed)
    if in_scores:
        case = offsets_in_scores(case, offsets, block_q, block_k)
    if draw(st.booleans()):  # the same problem with its keys in a random order: any tile order
        case = permute_keys(case, torch.randperm(Lk, generator=gen))
    return case, block_q, block_k, offsets, draw(st.sampled_from(list(PATHS))), draw(st.booleans())


def offsets_in_scores(case: Case, offsets, block_q: int, block_k: int) -> Case:
    """The case with ``offsets[i // block_q][j // block_k]`` added to the score of query i and key
    j through q and k alone: one more head dimension per query tile, 1 in q for that tile's
    queries and offset / scale in k (the scale of the longer head dimension), so no bias part
    is needed (the tiles that no bias or score mod touches keep their scores in base 2)."""
    tiles = len(offsets)
    D = case.D + tiles
    scale = 1 / math.sqrt(D)
    one_hot = torch.nn.functional.one_hot(torch.arange(case.Lq) // block_q, tiles).float()  # (Lq, tiles)
    per_key = tile_offsets(offsets, tiles * block_q, case.Lk, block_q, block_k)[::block_q].T / scale  # (Lk, tiles)
    q = torch.cat([case.q.float(), one_hot.expand(case.B, case.H, -1, -1)], dim=-1).to(case.dtype)
    k = torch.cat([case.k.float(), per_key.expand(case.B, case.Hkv, -1, -1)], dim=-1).to(case.dtype)
    return replace(case, D=D, q=q, k=k)


def permute_keys(case: Case, perm: torch.Tensor) -> Case:
    """The same attention with the keys in the order ``perm`` (a causal mask stays as it is, on
    the new key positions; the oracle is told the same problem)."""
    def along_keys(t):
        return t if t.shape[-1] == 1 else t[..., perm]

    parts = [p if p.tensor is None else replace(p, tensor=along_keys(p.tensor)) for p in case.parts]
    return Case(case.B, case.H, case.Hkv, case.Lq, case.Lk, case.D, case.Dv, case.dtype, False, None,
                case.q, case.k[:, :, perm], case.v[:, :, perm], case.grad_out, parts)


@settings(max_examples=60)
@given(drawn=extreme_tiles())
def test_tiled_backends_match_float64_oracle_on_extreme_tiles(drawn):
    case, block_q, block_k, offsets, path, natural = drawn
    note(f"{case.dtype} B={case.B} H={case.H} Hkv={case.Hkv} Lq={case.Lq} Lk={case.Lk} D={case.D} "
         f"tiles {block_q}x{block_k} offsets={offsets} masks={[p.kind for p in case.parts]} path={path} "
         f"identity score_mod={natural}")
    run_case(case, block_q, block_k, path, natural)


# --------------------------------------------------------------------------- named shapes
DTYPES = [torch.float64, torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("padded_tiles", [1, 2])
@pytest.mark.parametrize("path", list(PATHS))
def test_empty_first_tiles_then_scores_far_below_zero(dtype, padded_tiles, path):
    """Issue 11, defect 2: the first tiles a row visits show it no key, and every score it can see
    is far below 0 (-200, past float32's exp range; -800 past float64's)."""
    Lq, Lk, bq, bk = 7, 20, 3, 4
    offset = -800.0 if dtype == torch.float64 else -200.0
    parts = [MaskPart("key_padding", tensor=(torch.arange(Lk) >= padded_tiles * bk).expand(2, Lk)),
             MaskPart("bias", tensor=offset + torch.randn(2, 1, Lq, Lk, generator=torch.Generator().manual_seed(1)))]
    run_case(make_case(dtype, 2, 4, 2, Lq, Lk, 5, 3, parts), bq, bk, path)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", list(PATHS))
def test_visible_keys_only_in_the_last_tile(dtype, path):
    """Every row sees nothing until the last tiles, and only scores far below 0 there."""
    Lq, Lk, bq, bk = 6, 17, 2, 4  # the last tile holds key 16 alone
    keep = torch.zeros(Lq, Lk, dtype=torch.bool)
    keep[:, 16] = True
    keep[::2, 12:] = True
    offset = -800.0 if dtype == torch.float64 else -120.0
    parts = [MaskPart("keep", tensor=keep), MaskPart("bias", tensor=torch.full((Lk,), offset))]
    run_case(make_case(dtype, 1, 2, 1, Lq, Lk, 4, 4, parts), bq, bk, path)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", list(PATHS))
def test_scores_far_above_in_a_later_tile_while_a_row_of_its_block_sees_nothing_there(dtype, path):
    """Row 0 sees keys only in tile 0 (scores near -200); row 1 of its query block sees a tile
    later whose scores are far above its shift, so that tile is redone: row 0's shift must
    stay where it is (a redo that takes 0 as the max of a row that sees nothing there would
    rescale row 0's sum by exp(-200) = 0 in float32; -800 and exp(-800) in float64)."""
    Lq, Lk, bq, bk = 2, 8, 2, 4
    low, big = (-800.0, 800.0) if dtype == torch.float64 else (-200.0, 100.0)
    keep = torch.ones(Lq, Lk, dtype=torch.bool)
    keep[0, 4:] = False
    bias = torch.zeros(Lq, Lk)
    bias[0, :4] = low
    bias[1, 4:] = big
    parts = [MaskPart("keep", tensor=keep), MaskPart("bias", tensor=bias)]
    run_case(make_case(dtype, 1, 1, 1, Lq, Lk, 3, 3, parts), bq, bk, path)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", list(PATHS))
def test_first_tile_far_above_the_rest(dtype, path):
    """The first tile sets a shift far above every later score: later tiles underflow to 0,
    which is exact (their weights are below rounding)."""
    Lq, Lk, bq, bk = 5, 12, 5, 3
    bias = torch.zeros(Lk)
    bias[:3] = 300.0
    bias[9:] = 290.0  # within exp's range of the first tile's scores again
    run_case(make_case(dtype, 1, 2, 2, Lq, Lk, 4, 2, [MaskPart("bias", tensor=bias)]), bq, bk, path)


# --------------------------------------------------------------------------- the scale
def scale_inputs(dtype):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(2, 2, 5, 8, generator=g).to(dtype) for _ in range(3)]


@pytest.mark.parametrize("backend", backends.names())
def test_scale_beyond_float32_range_is_refused_by_name(backend):
    """Issue 11, defect 11: scale=1e38 overflowed the float32 scores to inf and gave NaN; every
    backend refuses a scale above 2**64 at the public edge, naming it and the usable range."""
    q, k, v = scale_inputs(torch.float32)
    for bad in (1e38, 2.0 ** 64 * 1.01):
        with pytest.raises(ValueError, match=r"scale must be at most 2\*\*64"):
            multihead.attention(q, k, v, scale=bad, backend=backend)
    with pytest.raises(ValueError, match=r"scale must be at most 2\*\*64"):
        multihead.attention_weights(q, k, scale=1e38)
    with pytest.raises(ValueError, match=r"scale must be at most 2\*\*64"):
        chunked_attention(q, k, v, scale=1e38)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("backend", backends.names())
def test_largest_scale_gives_the_exact_hard_maximum(backend, dtype):
    """At scale = 2**64 the scores (about 1e19) are far beyond exp's range but finite: each row's
    weights are exactly one-hot on its largest q·k, so the output is exactly that key's value."""
    q, k, v = scale_inputs(dtype)
    out = multihead.attention(q, k, v, scale=2.0 ** 64, backend=backend)
    best = (q.double() @ k.double().transpose(-1, -2)).argmax(-1)  # no ties in these draws
    expect = torch.gather(v, 2, best.unsqueeze(-1).expand(-1, -1, -1, v.shape[-1]))
    assert torch.equal(out, expect)
    weights = multihead.attention_weights(q, k, scale=2.0 ** 64)
    assert torch.equal(weights, torch.nn.functional.one_hot(best, k.shape[2]).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_exp_floor_is_exp_above_it_zero_at_or_below_and_keeps_nan(dtype):
    """The kernel's exp: bit-equal to torch.exp above the floor (-80), exactly 0 at or below it
    and for -inf (a hidden score), NaN and +inf as IEEE says."""
    x = torch.tensor([0.0, -1.5, -79.9, -80.0, -80.5, -100.0, -800.0, float("-inf"), float("nan"), float("inf"), 3.0],
                     dtype=dtype)
    got = _tiles._exp_(x.clone())
    above = x > _tiles.EXP_FLOOR
    assert torch.equal(got[above], torch.exp(x[above]))
    assert torch.equal(got[x <= _tiles.EXP_FLOOR], torch.zeros_like(got[x <= _tiles.EXP_FLOOR]))
    assert torch.isnan(got[8]) and got[9] == float("inf")


def test_one_thread_computes_tile_by_tile_as_the_workers_do():
    """At one torch thread the torch tiles' products have a tile's rows, as each worker's do at two
    or more: a BLAS may round a row by where it falls in a taller product (MKL's AVX2 kernels do:
    merged panels at one thread gave other bits than two workers' tiles under
    MKL_ENABLE_INSTRUCTIONS=AVX2), so 1 and N threads give the same bits on every CPU."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 300, 16, generator=g) for _ in range(3))
    shape = (1, 4, 300, 300)
    mask = multihead.masks.as_mask(multihead.masks.causal())
    rest, biases = multihead.masks.split_additive(mask, shape)
    tiles = _tiles.Tiles(q, k, v, rest, biases, (), scale=0.25, block_q=32, block_k=48, mask_shape=shape)

    def products(threads, workers):
        with torch_threads(threads):
            return sorted((k0, r0, r1) for plan in tiles.plans(workers) for k0, _, r0, r1, *_ in plan)

    assert products(1, 1) == products(2, 2) == products(8, 3)
    assert len({r1 - r0 for _, r0, r1 in products(1, 1)}) <= 2  # a tile's rows (and the last block's)
