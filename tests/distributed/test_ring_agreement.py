"""Ring attention with ranks that disagree (issue 11, defect 8): every rank raises, none dies.

Before the fix, shards of different lengths or byte sizes killed one process by SIGABRT inside
gloo and left its peers with garbage; float16 on one rank and bfloat16 on another, or a causal
flag on one rank only, gave wrong results on every rank, silently. Now one all_gather of a
fixed-size descriptor runs before the ring (and before the backward ring) and every rank raises
the same ValueError naming the ranks that differ, the field, both values and the fix.

One launch of 3 worker processes (gloo on loopback) runs every case of :data:`DISAGREE` in turn,
each with one rank (the case's odd rank) differing from the other two, a majority to tell it
by; then a rank rejecting its own arguments, a call that must work, and the backward cases,
the last of which breaks the group. Each case's outcome is written as soon as it is known, so
a rank that dies leaves the ones it finished; every ring wait is bounded by ``timeout`` and the
launch by a deadline, so old code fails these tests instead of hanging them (on f400da4 the
first case kills rank 2 by SIGABRT). By hand: ``python tests/distributed/test_ring_agreement.py RANK 3
file:///tmp/ring/rendezvous /tmp/ring`` for RANK = 0, 1, 2. The in-process tests at the end check the descriptor's encoding
and the messages for 4 ranks with ties, without processes.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from multihead import masks
from multihead.distributed import agreement as mhd
from multihead.distributed import ring_attention, shard_sequence, unshard_sequence
from multihead.distributed.ring import _Spec
from oracle import judge, naive_attention
from test_distributed import SRC, _rendezvous

WORLD = 3
RING_TIMEOUT = 10.0  # seconds a rank waits for a peer (in old code, instead of hanging)
ALONE_TIMEOUT = 2.0  # the same, where one rank is expected to give up: ranks 0 and 1 run backward alone
BASE = dict(B=2, H=4, Hkv=2, n=4, D=8, Dv=8, dtype=torch.float32, causal=False, layout=None,
            padding=False, scale=None, grad=True)

# name: (the odd rank, BASE changes on every rank, changes on the odd rank, the field named, the
# odd rank's value, the others' value, as the message shows them)
DISAGREE = {
    "shard_lengths": (2, dict(causal=True), dict(n=2), "key/value shard length Lk", "2", "4"),  # zigzag
    "float16_vs_bfloat16": (1, dict(dtype=torch.float16), dict(dtype=torch.bfloat16), "dtype", "torch.bfloat16", "torch.float16"),
    "float32_vs_float64": (0, {}, dict(dtype=torch.float64), "dtype", "torch.float64", "torch.float32"),
    "key_padding_on_one_rank": (2, {}, dict(padding=True), "key padding", "yes", "no"),
    "causal_flag": (2, dict(causal=True), dict(causal=False), "causal", "False", "True"),
    "query_heads": (2, {}, dict(H=8), "query heads H", "8", "4"),
    "kv_heads": (1, {}, dict(Hkv=4), "key/value heads Hkv", "4", "2"),
    "head_dim": (2, {}, dict(D=4), "head dim D", "4", "8"),
    "value_head_dim": (2, {}, dict(Dv=6), "value head dim Dv", "6", "8"),
    "scale": (2, {}, dict(scale=0.3), "scale", "0.3", repr(1 / math.sqrt(8))),
    "layout": (2, dict(causal=True), dict(layout="contiguous"), "layout", "'contiguous'", "'zigzag'"),
    "autograd": (2, {}, dict(grad=False), "autograd", "does not record the graph", "records the graph"),
}


def _setup(case: str, rank: int) -> dict:
    odd, everywhere, on_odd = DISAGREE[case][:3] if case in DISAGREE else (None, {}, {})
    return {**BASE, **everywhere, **(on_odd if rank == odd else {})}


def _call(s: dict, rank: int, seed: int = 0, timeout: float = RING_TIMEOUT):
    """q, k, v shards (requiring grad) of a setup, and ring_attention's output on them."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    L = s["n"]
    q = torch.randn(s["B"], s["H"], L, s["D"], generator=g).to(s["dtype"]).requires_grad_(True)
    k = torch.randn(s["B"], s["Hkv"], L, s["D"], generator=g).to(s["dtype"]).requires_grad_(True)
    v = torch.randn(s["B"], s["Hkv"], L, s["Dv"], generator=g).to(s["dtype"]).requires_grad_(True)
    mask = masks.key_padding(torch.ones(s["B"], L, dtype=torch.bool)) if s["padding"] else None
    with torch.set_grad_enabled(s["grad"]):
        out = ring_attention(q, k, v, mask, causal=s["causal"], layout=s["layout"], scale=s["scale"], timeout=timeout)
    return (q, k, v), out


# ------------------------------------------------------------------------------ worker side
def _outcome(fn) -> dict:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - recorded and checked by the parent
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": None}


def _full_sequence(rank: int):
    """The agreeing case with uneven queries: rank 2 holds 2 queries, the others 4; 4 keys each."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, 10, 8, generator=g)
    k, v = torch.randn(2, 2, 12, 8, generator=g), torch.randn(2, 2, 12, 8, generator=g)
    dout = torch.randn(2, 4, 10, 8, generator=g)
    rows = [slice(0, 4), slice(4, 8), slice(8, 10)][rank]
    return q, k, v, dout, rows


def _worker(rank: int, world: int, rendezvous: str, outdir: Path) -> None:
    import torch.distributed as dist

    assert world == WORLD, f"the cases are written for {WORLD} ranks"
    dist.init_process_group(
        "gloo", init_method=rendezvous, rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=30),
    )

    def record(name, outcome):
        (outdir / f"{name}.{rank}.json").write_text(json.dumps(outcome))

    for case in DISAGREE:
        record(case, _outcome(lambda: _call(_setup(case, rank), rank)))

    # rank 2's own arguments are rejected (a mask the ring cannot carry): the others must not wait
    def rejected():
        q = torch.randn(2, 4, 4, 8)
        ring_attention(q, q, q, masks.bias(torch.zeros(4, 4)) if rank == 2 else None, timeout=RING_TIMEOUT)

    record("rejected_arguments", _outcome(rejected))

    # after all that, the group still works, and ranks may hold different numbers of queries
    def uneven_queries():
        q, k, v, dout, rows = _full_sequence(rank)
        qs = q[:, :, rows].clone().requires_grad_(True)
        ks, vs = (shard_sequence(t, rank, world).clone().requires_grad_(True) for t in (k, v))
        out = ring_attention(qs, ks, vs, timeout=RING_TIMEOUT)
        out.backward(dout[:, :, rows])
        torch.save({"out": out.detach(), "dq": qs.grad, "dk": ks.grad, "dv": vs.grad}, outdir / f"uneven.{rank}.pt")

    record("uneven_queries", _outcome(uneven_queries))

    # ranks 0 and 1 run backward while rank 2 starts its next forward call of the same shapes
    def backward_meets_forward():
        _, out = _call(BASE, rank, seed=1)
        if rank == 2:
            _call(BASE, rank, seed=2)
        else:
            out.backward(torch.ones_like(out))

    record("backward_meets_forward", _outcome(backward_meets_forward))

    # last, since it breaks the group: ranks 0 and 1 run backward and rank 2 never does
    _, out = _call(BASE, rank, seed=3, timeout=ALONE_TIMEOUT)
    if rank == 2:  # stay alive, out of the ring, until ranks 0 and 1 have given up
        deadline = time.monotonic() + ALONE_TIMEOUT + 30
        while time.monotonic() < deadline and not all((outdir / f"backward_alone.{r}.json").exists() for r in (0, 1)):
            time.sleep(0.05)
        record("backward_alone", {"error": None})
    else:
        start = time.monotonic()
        outcome = _outcome(lambda: out.backward(torch.ones_like(out)))
        record("backward_alone", {**outcome, "seconds": time.monotonic() - start})
    sys.stdout.flush()
    os._exit(0)  # skip process-group teardown: the group is broken on purpose


# ------------------------------------------------------------------------------ parent side
@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Start the 3 worker processes once; their outcomes, exit codes and logs."""
    outdir = tmp_path_factory.mktemp("agreement")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(SRC), str(Path(__file__).resolve().parents[1] / "_support"),
                                                                    os.environ.get("PYTHONPATH", "")]))
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(r), str(WORLD), _rendezvous(outdir), str(outdir)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for r in range(WORLD)
    ]
    deadline = time.monotonic() + 120
    logs = {}
    try:
        for r, p in enumerate(procs):
            logs[r] = p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
    except subprocess.TimeoutExpired:
        pass
    finally:
        for r, p in enumerate(procs):
            if p.poll() is None:  # only when the bounded wait above failed
                p.kill()
                logs[r] = p.communicate()[0] + "\n[killed by the test: past the deadline]"
    outcomes = {}
    for f in outdir.glob("*.json"):
        case, rank = f.stem.rsplit(".", 1)
        outcomes.setdefault(case, {})[int(rank)] = json.loads(f.read_text())
    return {"outcomes": outcomes, "codes": [p.returncode for p in procs], "logs": logs, "outdir": outdir}


def _outcomes(launched, case: str) -> dict:
    got = launched["outcomes"].get(case, {})
    missing = [r for r in range(WORLD) if r not in got]
    if missing:
        pytest.fail(f"{case}: no outcome from rank(s) {missing}; exit codes {launched['codes']}; "
                    f"rank {missing[0]}'s output:\n{launched['logs'].get(missing[0], '')[-3000:]}")
    return got


def _ranks(ranks) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def test_no_rank_dies_by_a_signal(launched):
    codes = launched["codes"]
    bad = [r for r, code in enumerate(codes) if code != 0]
    how = lambda code: f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"  # noqa: E731
    worst = min(bad, key=lambda r: (codes[r] is None or codes[r] >= 0, r), default=None)  # a signal first
    assert not bad, "; ".join(f"rank {r} ended with {how(codes[r])}" for r in bad) + (
        f"; rank {worst}'s output:\n{launched['logs'][worst][-3000:]}")


@pytest.mark.parametrize("case", list(DISAGREE))
def test_disagreeing_ranks_all_raise_a_value_error_naming_the_odd_rank(launched, case):
    odd, _, _, field, odd_value, common_value = DISAGREE[case]
    others = [r for r in range(WORLD) if r != odd]
    for r, outcome in _outcomes(launched, case).items():
        assert outcome["error"] == "ValueError", f"{case}, rank {r}: {outcome}"
        message = outcome["message"]
        assert message.startswith(f"ring_attention, rank {r} of {WORLD}: the ranks disagree"), message
        assert f"rank {odd} differs from the others" in message, message
        assert f"  {field}: rank {odd} has {odd_value}; {_ranks(others)} have {common_value}. Fix: " in message, message


def test_a_rank_that_rejects_its_arguments_makes_the_others_raise(launched):
    got = _outcomes(launched, "rejected_arguments")
    assert got[2]["error"] == "ValueError" and "cannot travel with the key blocks" in got[2]["message"], got[2]
    for r in (0, 1):
        assert got[r]["error"] == "ValueError", got[r]
        assert got[r]["message"] == (
            f"ring_attention, rank {r} of 3: rank 2 rejected its arguments, so the ring ran on no rank; "
            "the error on rank 2 says what to fix there"
        )


def test_ranks_may_hold_different_numbers_of_queries(launched):
    """Queries never travel: without causal masking the ranks may hold 4, 4 and 2 of them. This
    runs after every disagreement above, so it also shows the group survived them."""
    for r, outcome in _outcomes(launched, "uneven_queries").items():
        assert outcome["error"] is None, f"rank {r}: {outcome}"
    shards = [torch.load(launched["outdir"] / f"uneven.{r}.pt") for r in range(WORLD)]
    q, k, v, dout, _ = _full_sequence(0)

    def naive(dtype):
        qq, kk, vv = (t.to(dtype).requires_grad_(True) for t in (q, k, v))
        out = naive_attention(qq, kk, vv, None, None, 1 / math.sqrt(8), dtype)
        out.backward(dout.to(dtype))
        return {"out": out.detach(), "dq": qq.grad, "dk": kk.grad, "dv": vv.grad}

    exact, naive32 = naive(torch.float64), naive(torch.float32)
    for key in ("out", "dq", "dk", "dv"):
        if key in ("out", "dq"):  # query rows: rank order is sequence order
            got = torch.cat([s[key] for s in shards], dim=2)
        else:
            got = unshard_sequence([s[key] for s in shards])
        verdict = judge(key, got, exact[key], lambda dt, key=key: naive32[key], torch.float32)
        assert verdict.ok, str(verdict)


def test_backward_meeting_a_forward_raises_on_every_rank(launched):
    for r, outcome in _outcomes(launched, "backward_meets_forward").items():
        assert outcome["error"] == "ValueError", f"rank {r}: {outcome}"
        assert "rank 2 differs from the others" in outcome["message"]
        assert "  pass: rank 2 has forward; ranks 0, 1 have backward. Fix: backward runs its own ring" in outcome["message"]


def test_backward_on_some_ranks_only_times_out(launched):
    got = _outcomes(launched, "backward_alone")
    for r in (0, 1):
        assert got[r]["error"] == "RingError", got[r]
        assert "the check that the ranks agree (before the backward ring) failed" in got[r]["message"]
        assert f"timeout={ALONE_TIMEOUT:g} s" in got[r]["message"]
        assert ALONE_TIMEOUT <= got[r]["seconds"] < ALONE_TIMEOUT + 10, got[r]
    assert got[2]["error"] is None


# ------------------------------------------------------------------------------ in-process
def test_descriptor_encoding_is_the_documented_one():
    spec = _Spec(None, True, "zigzag", 0.25)
    q = torch.zeros(2, 4, 6, 8, dtype=torch.bfloat16)
    k, v = torch.zeros(2, 2, 6, 8, dtype=torch.bfloat16), torch.zeros(2, 2, 6, 5, dtype=torch.bfloat16)
    keep = torch.ones(2, 6, dtype=torch.bool)
    got = mhd._describe(spec, q, k, v, keep, "backward", True)
    cpu = ord("c") | ord("p") << 8 | ord("u") << 16
    assert got == [0x52494E47_0001, 1, 2, 4, 2, 6, 8, 5, 1, cpu, 1, 1, 1, 0x3FD0_0000_0000_0000, 1]
    assert len(got) == len(mhd._FIELDS)
    no_causal = mhd._describe(_Spec(None, False, "zigzag", 0.25), q, k, v, None, "forward", False)
    assert no_causal[10:13] == [0, 0, -1] and no_causal[1] == 0 and no_causal[-1] == 0  # layout unused


class _FakeRing:
    """Stands in for the ring: its all_gather returns a fixed table (row = group rank)."""

    def __init__(self, rank, table):
        self.rank, self.size, self.table = rank, len(table), table

    def all_gather(self, values, *, what):
        assert values == self.table[self.rank]
        return self.table


def _table(changes: dict) -> list[list[int]]:
    """Descriptors of 4 ranks making the same call, with {rank: {field index: value}} changed."""
    q, k = torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8)
    rows = [mhd._describe(_Spec(None, True, "zigzag", 0.5), q, k, k, None, "forward", True) for _ in range(4)]
    for r, fields in changes.items():
        for i, value in fields.items():
            rows[r][i] = value
    return rows


def _message(changes: dict, rank: int = 1) -> str:
    with pytest.raises(ValueError) as info:
        mhd._agree(_FakeRing(rank, _table(changes)), _table(changes)[rank])
    return str(info.value)


def test_a_tie_names_the_ranks_that_differ_from_rank_0():
    message = _message({2: {5: 2}, 3: {5: 2, 8: 3}})  # Lk 4, 4, 2, 2; rank 3 also float64
    assert message.startswith("ring_attention, rank 1 of 4: the ranks disagree")
    assert "ranks 2, 3 differ from the others" in message
    assert "  key/value shard length Lk: ranks 2, 3 have 2; ranks 0, 1 have 4. Fix: " in message
    assert "  dtype: rank 3 has torch.float64; ranks 0, 1, 2 have torch.float32. Fix: " in message


def test_forward_meeting_backward_is_reported_alone():
    message = _message({0: {1: 1, 5: 9, 11: 0}})
    assert "  pass: rank 0 has backward; ranks 1, 2, 3 have forward. Fix: " in message
    assert message.count("Fix: ") == 1


def test_a_differing_causal_flag_hides_the_layout_it_implies():
    message = _message({3: {11: 0, 12: -1}})
    assert "  causal: rank 3 has False; ranks 0, 1, 2 have True. Fix: " in message
    assert "layout" not in message.split("Fix")[0] and message.count("Fix: ") == 1


def test_agreeing_ranks_and_a_single_rank_pass():
    assert mhd._agree(_FakeRing(2, _table({})), _table({})[2]) == _table({})  # the table: each rank's lengths
    assert mhd._agree(_FakeRing(0, _table({})[:1]), _table({})[0]) is None


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
