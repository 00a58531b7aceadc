"""Ring attention across real processes: outputs and gradients equal single-process attention.

Each process costs a torch import, so the tests launch 4 worker processes once (gloo on
loopback, meeting through a file store in the test's folder). They run every case of :data:`CASES` on three rings: all 4
ranks, and the subgroups (0, 1) and (2, 3) side by side; then a hung rank and a crashed rank.
The parent compares the gathered shards with ``multihead.attention`` on the whole sequence.
By hand: ``python tests/distributed/test_distributed.py RANK 4 file:///tmp/ring/rendezvous /tmp/ring`` for RANK = 0..3.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch

import multihead as mh
from multihead import masks
from multihead.distributed import (
    ring_attention,
    shard_positions,
    shard_sequence,
    unshard_sequence,
)
from multihead.distributed.layouts import _segments
from multihead.distributed.plan import _block_pairs

SRC = Path(__file__).resolve().parents[2] / "src"

# name: (B, H, Hkv, L per rank, D, Dv, causal, layout, padding, dtype, via the causal mask object)
CASES = {
    "plain": (2, 4, 4, 6, 8, 8, False, "contiguous", False, torch.float32, False),
    "gqa_padding": (2, 4, 2, 6, 8, 8, False, "contiguous", True, torch.float32, False),
    "causal_zigzag_mqa_padding": (2, 4, 1, 6, 8, 6, True, "zigzag", True, torch.float32, False),
    "causal_contiguous_gqa": (1, 4, 2, 5, 8, 8, True, "contiguous", False, torch.float32, False),
    "causal_mask_object": (2, 2, 2, 4, 4, 4, True, "zigzag", True, torch.float32, True),
    "float64_causal_gqa_padding": (2, 4, 2, 6, 8, 8, True, "zigzag", True, torch.float64, False),
    "bfloat16_causal_gqa_padding": (2, 4, 2, 6, 8, 8, True, "zigzag", True, torch.bfloat16, False),
}
#: cases whose tokens are packed documents (masks.documents; the ids travel with the keys)
DOCUMENT_CASES = {
    "documents_causal_zigzag_padding": (2, 4, 2, 6, 8, 8, True, "zigzag", True, torch.float64, False),
    "documents_contiguous_gqa": (1, 4, 2, 5, 8, 8, False, "contiguous", False, torch.float64, False),
}
CASES.update(DOCUMENT_CASES)
MODULE_CASE = dict(B=2, d_in=16, heads=4, kv_heads=2, per_rank=4)


def _case_tensors(name: str, world: int):
    """Full-sequence q, k, v, keep, dout for a case (the same on every process)."""
    B, H, Hkv, n, D, Dv, causal, layout, padding, dtype, _ = CASES[name]
    L = n * world * (2 if layout == "zigzag" else 1)
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + world)
    q = torch.randn(B, H, L, D, generator=g, dtype=dtype)
    k = torch.randn(B, Hkv, L, D, generator=g, dtype=dtype)
    v = torch.randn(B, Hkv, L, Dv, generator=g, dtype=dtype)
    dout = torch.randn(B, H, L, Dv, generator=g, dtype=dtype)
    keep = None
    if padding:
        keep = torch.rand(B, L, generator=g) > 0.3
        keep[0, :] = True
        keep[-1, : L - 2] = False  # most queries of the last batch row see no key under causal
    return q, k, v, keep, dout


def _case_ids(name: str, L: int):
    """(1, L) document ids of a DOCUMENT_CASES case (uneven documents whose boundaries fall
    inside shards and chunks), else None."""
    if name not in DOCUMENT_CASES:
        return None
    cuts = torch.tensor([L // 3, L // 2 + 1, L - 2])
    return torch.bucketize(torch.arange(L), cuts, right=True).view(1, L)


def _full_mask(name, keep, L=None):
    causal = CASES[name][6]
    m = None if keep is None else masks.key_padding(keep)
    ids = None if L is None else _case_ids(name, L)
    if ids is not None:
        m = masks.documents(ids) if m is None else masks.documents(ids) & m
    if causal:
        m = masks.causal() if m is None else masks.causal() & m
    return m


def _module_setup(world: int):
    c = MODULE_CASE
    torch.manual_seed(1234)
    mha = mh.MultiHeadAttention(c["d_in"], c["heads"], num_kv_heads=c["kv_heads"], causal=True)
    L = c["per_rank"] * 2 * world
    g = torch.Generator().manual_seed(99 + world)
    x = torch.randn(c["B"], L, c["d_in"], generator=g)
    dout = torch.randn(c["B"], L, c["d_in"], generator=g)
    keep = torch.rand(c["B"], L, generator=g) > 0.25
    return mha, x, dout, keep


# ------------------------------------------------------------------------------ worker side
RINGS = {"world4": (0, 1, 2, 3), "group01": (0, 1), "group23": (2, 3)}  # ring name: its global ranks


def _run_cases(group, rank: int, world: int) -> dict:
    """Every case on one ring; ``rank``/``world`` are the rank and size within ``group``."""
    from multihead import distributed as mhd

    results = {}
    for name, spec in CASES.items():
        causal, layout, via_mask = spec[6], spec[7], spec[10]
        q, k, v, keep, dout = _case_tensors(name, world)
        shard = lambda t: shard_sequence(t, rank, world, layout).clone().requires_grad_(True)  # noqa: E731
        qs, ks, vs = shard(q), shard(k), shard(v)
        m = None if keep is None else masks.key_padding(shard_sequence(keep, rank, world, layout, dim=-1))
        ids = _case_ids(name, q.shape[2])
        if ids is not None:
            docs = masks.documents(shard_sequence(ids, rank, world, layout, dim=-1))
            m = docs if m is None else docs & m
        if via_mask:  # causal given as a mask object instead of causal=True
            out = ring_attention(qs, ks, vs, masks.causal() & m, layout=layout, group=group)
        else:
            out = ring_attention(qs, ks, vs, m, causal=causal, layout=layout, group=group)
        out.backward(shard_sequence(dout, rank, world, layout))
        results[name] = {"out": out.detach(), "dq": qs.grad, "dk": ks.grad, "dv": vs.grad}

    mha, x, dout, keep = _module_setup(world)
    xs = shard_sequence(x, rank, world, "zigzag").clone().requires_grad_(True)
    cp = mhd.context_parallel(mha, group)
    out = cp(xs, mask=masks.key_padding(shard_sequence(keep, rank, world, "zigzag", dim=-1)))
    out.backward(shard_sequence(dout, rank, world, "zigzag"))
    results["module"] = {"out": out.detach(), "dx": xs.grad, **{n: p.grad for n, p in mha.named_parameters()}}
    return results


def _fail_on_second_block(mhd, action):
    """Make this process's second attention block run ``action`` (sleep and/or raise)."""
    real_block, calls = mhd._attend_block, {"n": 0}

    def flaky_block(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            action()
        return real_block(*args, **kwargs)

    mhd._attend_block = flaky_block
    return lambda: setattr(mhd, "_attend_block", real_block)


def _failure_report(group, rank: int, world: int, timeout: float) -> dict:
    q, k, v, _, dout = _case_tensors("plain", world)
    qs, ks, vs = (shard_sequence(t, rank, world).clone().requires_grad_(True) for t in (q, k, v))
    start = time.monotonic()
    report = {"error": None}
    try:
        ring_attention(qs, ks, vs, group=group, timeout=timeout).backward(shard_sequence(dout, rank, world))
    except Exception as e:  # noqa: BLE001 - recorded and checked by the parent
        report = {"error": type(e).__name__, "message": str(e)}
    report["seconds"] = time.monotonic() - start
    return report


def _worker(rank: int, world: int, rendezvous: str, outdir: Path) -> None:
    import torch.distributed as dist

    from multihead.distributed import ring as mhd

    assert world == 4, "the worker runs the 4-rank ring and two 2-rank subgroups"
    dist.init_process_group(
        "gloo", init_method=rendezvous, rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=30),
    )
    pair = dist.new_group([0, 1]), dist.new_group([2, 3])  # every rank takes part in creating both
    mine = pair[rank // 2]
    results = {"world4": _run_cases(None, rank, 4), ("group01", "group23")[rank // 2]: _run_cases(mine, rank % 2, 2)}
    torch.save(results, outdir / f"rank{rank}.pt")

    # Failures, last since they break groups. 1) In ring (2, 3) rank 3 hangs for 5 s mid-ring:
    # rank 2 must give up after its 3 s timeout.
    if rank in (2, 3):
        restore = None
        if rank == 3:
            def hang():
                time.sleep(5)
                raise RuntimeError("injected hang on rank 3")

            restore = _fail_on_second_block(mhd, hang)
        report = _failure_report(mine, rank % 2, 2, timeout=3.0)
        (outdir / f"hang{rank}.json").write_text(json.dumps(report))
        if restore:
            restore()
    dist.barrier()
    # 2) In the 4-rank ring, rank 1 raises mid-ring and its process exits: the others must raise.
    if rank == 1:
        def crash():
            raise RuntimeError("injected failure on rank 1")

        _fail_on_second_block(mhd, crash)
    report = _failure_report(None, rank, 4, timeout=10.0)
    (outdir / f"crash{rank}.json").write_text(json.dumps(report))
    sys.stdout.flush()
    os._exit(3 if rank == 1 else 0)  # skip process-group teardown: the group is broken on purpose


# ------------------------------------------------------------------------------ parent side
def _rendezvous(outdir: Path) -> str:
    """Where the ranks meet: a file in the test's own folder (torch's FileStore), not a TCP port,
    so that rings started at once by parallel test workers (pytest-xdist) cannot collide, and no
    port picked here can be taken by another process before rank 0 listens on it."""
    return (outdir / "rendezvous").as_uri()


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Start the 4 worker processes once; their shards, failure reports and logs."""
    outdir = tmp_path_factory.mktemp("ring")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(r), "4", _rendezvous(outdir), str(outdir)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for r in range(4)
    ]
    deadline = time.monotonic() + 120
    logs = {}
    try:
        for r, p in enumerate(procs):
            logs[r] = p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
    finally:
        for r, p in enumerate(procs):
            if p.poll() is None:  # only when the bounded wait above failed
                p.kill()
                logs[r] = p.communicate()[0]
    for r in range(4):
        if not (outdir / f"rank{r}.pt").exists():
            pytest.fail(f"rank {r} did not finish the cases; its output:\n{logs.get(r, '')[-3000:]}")
    shards = [torch.load(outdir / f"rank{r}.pt") for r in range(4)]
    reports = {}
    for f in outdir.glob("*.json"):
        reports[f.stem] = json.loads(f.read_text())
    return {"shards": shards, "reports": reports, "procs": procs, "logs": logs}


def _gather(launched, ring, case, key, layout):
    return unshard_sequence([launched["shards"][r][ring][case][key] for r in RINGS[ring]], layout)


TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-12, atol=1e-12)}


def _attention_and_grads(case, q, k, v, keep, dout):
    """``multihead.attention`` on the whole sequence: {"out", "dq", "dk", "dv"}."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = mh.attention(q, k, v, _full_mask(case, keep, q.shape[2]))
    out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


@pytest.mark.parametrize("ring", list(RINGS))
@pytest.mark.parametrize("case", list(CASES))
def test_ring_matches_single_process_attention(launched, ring, case):
    world = len(RINGS[ring])
    layout, dtype = CASES[case][7], CASES[case][9]
    q, k, v, keep, dout = _case_tensors(case, world)
    expected = _attention_and_grads(case, q, k, v, keep, dout)
    if dtype in TOL:
        for key, want in expected.items():
            got = _gather(launched, ring, case, key, layout)
            assert got.dtype == dtype
            torch.testing.assert_close(got, want, **TOL[dtype], msg=lambda m: f"{case} {key} ({ring}): {m}")
    else:  # low precision: error against float64 at most 2x that of the single-process path
        exact = _attention_and_grads(case, *(t.double() for t in (q, k, v)), keep, dout.double())
        for key, want in expected.items():
            got = _gather(launched, ring, case, key, layout)
            assert got.dtype == dtype
            ring_err = (got.double() - exact[key]).abs().max().item()
            ref_err = (want.double() - exact[key]).abs().max().item()
            assert ring_err <= 2 * ref_err + 1e-6, f"{case} {key} ({ring}): {ring_err:.3g} vs reference {ref_err:.3g}"
    if keep is not None and CASES[case][6]:  # the case has rows with no visible key: they give 0
        empty = ~(keep[:, None, :] & torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril()).any(-1)
        assert empty.any()
        assert (_gather(launched, ring, case, "out", layout).transpose(1, 2)[empty] == 0).all()


@pytest.mark.parametrize("ring", list(RINGS))
def test_context_parallel_module_matches_module(launched, ring):
    world = len(RINGS[ring])
    mha, x, dout, keep = _module_setup(world)
    x = x.clone().requires_grad_(True)
    ref = mha(x, mask=masks.key_padding(keep))
    ref.backward(dout)
    tol = TOL[torch.float32]
    torch.testing.assert_close(_gather(launched, ring, "module", "out", "zigzag"), ref.detach(), **tol)
    torch.testing.assert_close(_gather(launched, ring, "module", "dx", "zigzag"), x.grad, **tol)
    for n, p in mha.named_parameters():  # each rank holds its shard's share: the sum is the whole
        total = sum(launched["shards"][r][ring]["module"][n] for r in RINGS[ring])
        torch.testing.assert_close(total, p.grad, **tol, msg=lambda m: f"grad of {n}: {m}")


def test_hung_rank_makes_its_peer_time_out(launched):
    reports = launched["reports"]
    peer, hung = reports["hang2"], reports["hang3"]
    assert peer["error"] == "RingError", peer
    assert "rank 0 of 2" in peer["message"] and "timeout=3 s" in peer["message"]
    assert "check the other ranks' logs" in peer["message"]
    assert 3.0 <= peer["seconds"] < 15.0, peer  # waited for its timeout, then gave up
    assert hung["message"] == "injected hang on rank 3"


def test_crashed_rank_makes_the_others_raise(launched):
    reports, procs = launched["reports"], launched["procs"]
    assert reports["crash1"]["message"] == "injected failure on rank 1"
    assert procs[1].returncode == 3
    for r in (0, 2, 3):
        report = reports[f"crash{r}"]
        assert report["error"] == "RingError", report
        assert f"rank {r} of 4" in report["message"] and "check the other ranks' logs" in report["message"]
        assert report["seconds"] < 10.0, report  # a dead peer is noticed well before the timeout
        assert procs[r].returncode == 0, launched["logs"][r][-3000:]


# ------------------------------------------------------------------------------ in-process
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_layouts_round_trip(layout, world):
    L = 2 * world * 3
    x = torch.randn(2, 3, L, 5)
    shards = [shard_sequence(x, r, world, layout) for r in range(world)]
    assert all(s.shape == (2, 3, L // world, 5) for s in shards)
    assert torch.equal(unshard_sequence(shards, layout), x)
    keep = torch.rand(2, L) > 0.5
    assert torch.equal(unshard_sequence([shard_sequence(keep, r, world, layout, dim=-1) for r in range(world)], layout, dim=-1), keep)
    pos = torch.arange(L)[:, None]
    for r in range(world):
        assert torch.equal(shard_positions(r, world, L, layout), shard_sequence(pos, r, world, layout)[:, 0])


def test_zigzag_shards_hold_an_early_and_a_late_chunk():
    assert shard_positions(0, 2, 8, "zigzag").tolist() == [0, 1, 6, 7]
    assert shard_positions(1, 2, 8, "zigzag").tolist() == [2, 3, 4, 5]
    assert shard_positions(1, 2, 8, "contiguous").tolist() == [4, 5, 6, 7]


def _causal_work(rank, world, n, layout):
    """Score entries a rank computes over a causal ring pass (visible pairs of segments)."""
    q_segs = _segments(rank, world, n, layout)
    total = 0
    for step in range(world):
        k_segs = _segments((rank - step) % world, world, n, layout)
        total += sum(qs[2] * ks[2] for qs, ks, _ in _block_pairs(q_segs, k_segs, True))
    return total


def test_zigzag_balances_causal_work():
    world, n = 4, 8
    zigzag = [_causal_work(r, world, n, "zigzag") for r in range(world)]
    contiguous = [_causal_work(r, world, n, "contiguous") for r in range(world)]
    assert len(set(zigzag)) == 1  # every rank does the same work
    assert contiguous == [n * n * (r + 1) for r in range(world)]  # rank r computes r+1 blocks
    assert sum(zigzag) < sum(contiguous)  # fully masked chunk pairs are skipped


def test_bad_arguments_name_the_fix():
    x = torch.randn(1, 2, 10, 4)
    with pytest.raises(ValueError, match="pad the sequence to a multiple of 8"):
        shard_sequence(x, 0, 4, "zigzag")
    with pytest.raises(ValueError, match="layout must be one of"):
        shard_sequence(x, 0, 2, "striped")
    with pytest.raises(ValueError, match="rank must be in"):
        shard_sequence(x, 2, 2)
    q = torch.randn(1, 2, 4, 4)
    with pytest.raises(ValueError, match="cannot\\s+travel with the key blocks"):
        ring_attention(q, q, q, masks.bias(torch.zeros(4, 4)))  # (window, sink travel since issue 27)
    with pytest.raises(ValueError, match="cannot\\s+travel"):
        ring_attention(q, q, q, torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="causal ring attention needs q and k cut from one sequence"):
        ring_attention(q, q[:, :, :2], q[:, :, :2], causal=True)
    with pytest.raises(ValueError, match="key padding"):
        ring_attention(q, q, q, masks.key_padding(torch.ones(1, 8, dtype=torch.bool)))
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_attention(q, q, q)



# ------------------------------------------------------------------------------ ContextParallel with RoPE
# Issue 11, defect 9: ContextParallel re-implemented the module's forward and dropped RoPE
# (0.108 off mha(x)). Now it runs the module's own steps with the shard's global positions.
# name: (layout, causal, dtype, key padding); 2 ranks (gloo), launched once for all cases
CP_ROPE_CASES = {
    f"{layout}_{'causal' if causal else 'full'}_{str(dtype)[6:]}": (layout, causal, dtype, causal)
    for layout in ("contiguous", "zigzag") for causal in (False, True) for dtype in (torch.float32, torch.float64)
}


def _cp_rope_case(name: str):
    """The module (rope=True, GQA), full-sequence x, dout and keep (or None) of a case."""
    layout, causal, dtype, padding = CP_ROPE_CASES[name]
    torch.manual_seed(zlib.crc32(name.encode()))
    mha = mh.MultiHeadAttention(16, 4, num_kv_heads=2, causal=causal, rope=True, dtype=dtype)
    L = 8
    x = torch.randn(2, L, 16, dtype=dtype)
    dout = torch.randn(2, L, 16, dtype=dtype)
    keep = None
    if padding:
        keep = torch.ones(2, L, dtype=torch.bool)
        keep[1, :3] = False  # left padding of the second sequence
    return mha, x, dout, keep


def _cp_rope_worker(rank: int, rendezvous: str, outdir: str) -> None:
    import torch.distributed as dist

    from multihead.distributed import ContextParallel

    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    results = {}
    for name, (layout, _, _, _) in CP_ROPE_CASES.items():
        mha, x, dout, keep = _cp_rope_case(name)
        xs = shard_sequence(x, rank, 2, layout).clone().requires_grad_(True)
        mask = None if keep is None else masks.key_padding(shard_sequence(keep, rank, 2, layout, dim=-1))
        out = ContextParallel(mha, layout=layout)(xs, mask=mask)
        out.backward(shard_sequence(dout, rank, 2, layout))
        results[name] = {"out": out.detach(), "dx": xs.grad, **{n: p.grad for n, p in mha.named_parameters()}}
    torch.save(results, Path(outdir) / f"cp{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def cp_rope_shards(tmp_path_factory):
    """Run every CP_ROPE_CASES case on a 2-rank ring; each rank's results."""
    outdir = tmp_path_factory.mktemp("cp_rope")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_distributed as t; t._cp_rope_worker(int(sys.argv[1]), {_rendezvous(outdir)!r}, sys.argv[2])"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r), str(outdir)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=120)[0])
    finally:
        for p in procs:
            if p.poll() is None:  # only when the bounded wait above failed
                p.kill()
                p.communicate()
    for r in range(2):
        if not (outdir / f"cp{r}.pt").exists():
            pytest.fail(f"rank {r} did not finish the ContextParallel cases; its output:\n{logs[r][-3000:] if r < len(logs) else ''}")
    return [torch.load(outdir / f"cp{r}.pt") for r in range(2)]


@pytest.mark.parametrize("case", list(CP_ROPE_CASES))
def test_context_parallel_keeps_rope(cp_rope_shards, case):
    layout, _, dtype, _ = CP_ROPE_CASES[case]
    mha, x, dout, keep = _cp_rope_case(case)
    x = x.clone().requires_grad_(True)
    ref = mha(x, mask=None if keep is None else masks.key_padding(keep))
    ref.backward(dout)
    tol = TOL[dtype]
    gather = lambda key: unshard_sequence([cp_rope_shards[r][case][key] for r in range(2)], layout)  # noqa: E731
    torch.testing.assert_close(gather("out"), ref.detach(), **tol)
    torch.testing.assert_close(gather("dx"), x.grad, **tol)
    for n, p in mha.named_parameters():  # each rank holds its shard's share: the sum is the whole
        torch.testing.assert_close(cp_rope_shards[0][case][n] + cp_rope_shards[1][case][n], p.grad, **tol,
                                   msg=lambda m: f"grad of {n}: {m}")


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_rope_at_shard_positions_is_the_shard_of_rope_on_the_whole_sequence(layout):
    from multihead.rope import RoPE

    rope, world, L = RoPE(8), 3, 12
    x = torch.randn(2, 4, L, 8, dtype=torch.float64)
    whole = rope(x)
    for r in range(world):
        got = rope(shard_sequence(x, r, world, layout), positions=shard_positions(r, world, L, layout))
        assert torch.equal(got, shard_sequence(whole, r, world, layout))
    with pytest.raises(ValueError, match=r"positions must have shape \(L,\) = \(12,\)"):
        rope(x, positions=torch.arange(5))
    with pytest.raises(TypeError, match="positions must be an integer torch.Tensor"):
        rope(x, positions=torch.arange(12.0))
    with pytest.raises(ValueError, match="positions must be >= 0"):
        rope(x, positions=torch.arange(12) - 1)


def test_context_parallel_with_rope_asks_for_a_process_group():
    from multihead.distributed import ContextParallel

    cp = ContextParallel(mh.MultiHeadAttention(16, 4, rope=True))
    with pytest.raises(RuntimeError, match="init_process_group"):
        cp(torch.randn(1, 4, 16))

if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
