"""`multihead explain --ring P` and `multihead.distributed.ring_plan` (issue 27 item 3).

The drawing and counts are compared with the mask's definition written here directly (causal
i >= j, documents by id, a window by distance), with the ring's own per-rank work
(`rank_work`) and with the ring's forward pass itself, run for every rank in one process over a
simulated transport that hands each rank the block the real ring would: the pairs it attends
are recorded and must be the plan's, and its output must equal float64 attention.
"""

from __future__ import annotations

import io
import json

import pytest
import torch

import multihead.distributed.ring as D
from multihead import masks
from multihead.cli import main
from multihead.distributed import DocumentLayout, rank_work, ring_plan, shard_positions
from multihead.explain.mask_spec import parse_mask
from multihead.explain.ring_view import RingView


def _ids(docs):
    return torch.cat([torch.full((n,), i) for i, n in enumerate(docs)])


# (P, L, specs, causal, layout, the keep of the definition: (i, j) -> bool over (L, L) grids)
CASES = {
    "causal-zigzag": (2, 8, (), True, None, lambda i, j, L: i >= j),
    "causal-contiguous-4": (4, 16, (), True, "contiguous", lambda i, j, L: i >= j),
    "causal-zigzag-3": (3, 12, (), True, "zigzag", lambda i, j, L: i >= j),
    "documents-balanced": (2, 24, ("documents:8,4,12",), True, "documents",
                           lambda i, j, L: (i >= j) & (_ids([8, 4, 12])[i] == _ids([8, 4, 12])[j])),
    "documents-balanced-4": (4, 32, ("documents:8,8,16",), True, "documents",
                             lambda i, j, L: (i >= j) & (_ids([8, 8, 16])[i] == _ids([8, 8, 16])[j])),
    "documents-contiguous": (2, 24, ("documents:8,4,12",), True, "contiguous",
                             lambda i, j, L: (i >= j) & (_ids([8, 4, 12])[i] == _ids([8, 4, 12])[j])),
    "window-bidirectional": (2, 16, ("window:3",), False, None, lambda i, j, L: (i - j >= 0) & (i - j <= 3)),
    "causal-window-zigzag": (2, 16, ("window:2",), True, None, lambda i, j, L: (i - j >= 0) & (i - j <= 2)),
}


def _mask(specs, causal, L):
    part = parse_mask(specs, tokens=L, keys=L, heads=2)
    if not causal:
        return part
    return masks.causal() if part is None else masks.causal() & part


def _view(case) -> tuple[RingView, torch.Tensor]:
    P, L, specs, causal, layout, rule = CASES[case]
    i, j = torch.meshgrid(torch.arange(L), torch.arange(L), indexing="ij")
    return RingView(P, L, mask=_mask(specs, causal, L), layout=layout, heads=2), rule(i, j, L)


@pytest.mark.parametrize("case", sorted(CASES))
def test_counts_are_the_definitions_keep_summed_per_rank_block(case):
    view, keep = _view(case)
    P = view.P
    for s in range(P):
        for r in range(P):
            rows = shard_positions(r, P, view.L, view.layout)
            cols = shard_positions((r - s) % P, P, view.L, view.layout)
            assert view.visible[s][r] == int(keep[rows][:, cols].sum()), (s, r)
    assert sum(map(sum, view.visible)) == int(keep.sum())


@pytest.mark.parametrize("case", sorted(CASES))
def test_drawing_marks_every_visible_block_with_the_rank_that_holds_its_queries(case):
    view, keep = _view(case)
    P, b, n = view.P, view.block, view.L // view.block
    owner = [int(view.rank_of[x * b]) for x in range(n)]
    for s in range(P):
        cells = view.cells(s)
        for x in range(n):
            for y in range(n):
                if (owner[x] - owner[y]) % P != s:
                    want = " "
                elif bool(keep[x * b:(x + 1) * b, y * b:(y + 1) * b].any()):
                    want = str(owner[x])
                else:
                    want = "."
                assert cells[x][y] == want, (s, x, y)


@pytest.mark.parametrize("case", ["causal-zigzag", "causal-contiguous-4", "causal-zigzag-3", "documents-balanced",
                                  "documents-balanced-4", "documents-contiguous"])
def test_per_rank_totals_are_the_rings_rank_work(case):
    view, _ = _view(case)
    P, L, specs, _, _, _ = CASES[case]
    docs = [int(x) for x in specs[0].split(":")[1].split(",")] if specs else None
    layout = view.layout
    want = rank_work(layout, P) if isinstance(layout, DocumentLayout) else rank_work(layout, P, seq_len=L, documents=docs)
    assert [sum(view.visible[s][r] for s in range(P)) for r in range(P)] == want
    if not specs:  # causal alone: the plan's blocks hold exactly the visible scores, the triangles cut
        assert view.work == view.visible


def test_the_balanced_documents_layout_is_balanced_where_contiguous_is_not():
    assert RingView(2, 24, mask=_mask(("documents:8,4,12",), True, 24), layout="documents").imbalance_percent() == 0
    assert RingView(2, 24, mask=_mask(("documents:8,4,12",), True, 24), layout="contiguous").imbalance_percent() == 26


class _SimulatedRing:
    """Every rank's view of the ring in one process: ``shift`` at step s hands rank r the block
    rank r - s - 1 owns, as the real transport does after s + 1 shifts."""

    def __init__(self, rank, size, blocks):
        self.rank, self.size, self.blocks = rank, size, blocks

    def shift(self, tensors, *, tag, what, step, length=None):
        got = self.blocks[(self.rank - step - 1) % self.size]
        return type("Done", (), {"wait": lambda _self: got})()


@pytest.mark.parametrize("case", ["causal-zigzag", "causal-zigzag-3", "documents-balanced-4", "window-bidirectional",
                                  "causal-window-zigzag"])
def test_the_ring_forward_attends_exactly_the_plans_pairs_and_matches_float64(case, monkeypatch):
    view, keep = _view(case)
    P, L, specs, causal, _, _ = CASES[case]
    torch.manual_seed(0)
    B, H, Dh = 1, 2, 4
    q, k, v = (torch.randn(B, H, L, Dh, dtype=torch.float64) for _ in range(3))
    ids = _ids([int(x) for x in specs[0].split(":")[1].split(",")]) if specs and specs[0].startswith("documents") else None
    pos = [shard_positions(r, P, L, view.layout) for r in range(P)]
    calls: list = []
    real = D._attend_block
    monkeypatch.setattr(D, "_attend_block", lambda q_, k_, *a, **kw: (calls.append(
        (a[-1], q_.shape[-2], k_.shape[-2], a[2])), real(q_, k_, *a, **kw))[1])
    blocks = [D._block(k[..., p, :], v[..., p, :], None, None if ids is None else ids[p][None]) for p in pos]
    outs = []
    for r in range(P):
        part = None if not specs or ids is not None else parse_mask(specs, tokens=L // P, keys=L // P, heads=H)
        shard_mask = masks.documents(ids[pos[r]][None]) if ids is not None else part
        has_causal, kp, sid, kinds = D._split_mask(shard_mask, (B, H, L // P, L // P), q.device)
        spec = D._Spec(_SimulatedRing(r, P, blocks), causal or has_causal, view.layout, Dh ** -0.5, sid, kinds)
        spec.place(B, H, L // P, q.device)  # the whole sequence's window rows (no documents: nothing gathered)
        calls.clear()
        outs.append(D._RingAttention.apply(q[..., pos[r], :], k[..., pos[r], :], v[..., pos[r], :], kp, spec))
        want = [((qg, kg), qn, kn, diag) for s in range(P) for (_, qg, qn), (_, kg, kn), diag in view.plan[s][r]]
        assert calls == want, r
    out = torch.empty_like(q)
    for r in range(P):
        out[..., pos[r], :] = outs[r]
    scores = (q @ k.transpose(-1, -2)) * Dh ** -0.5
    ref = torch.softmax(scores.masked_fill(~keep, float("-inf")), -1) @ v
    assert torch.allclose(out, ref, rtol=0, atol=1e-12)


def test_ring_plan_refuses_what_the_ring_refuses():
    with pytest.raises(ValueError, match="world_size"):
        ring_plan(0, 8)
    with pytest.raises(ValueError, match="multiple of 6"):
        ring_plan(3, 8, causal=True)
    with pytest.raises(ValueError, match="ulysses"):
        ring_plan(2, 8, mask=masks.from_seqlens([4, 4]) & masks.bias(torch.zeros(8, 8)))


def _cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    code = main(["explain", *argv], stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def test_cli_draws_the_views_grids_in_english_chinese_and_json():
    view = RingView(2, 24, mask=_mask(("documents:8,4,12",), True, 24), layout="documents", heads=2)
    argv = ("--ring", "2", "--tokens", "24", "--mask", "documents:8,4,12", "--layout", "documents")
    code, text, err = _cli(*argv)
    assert (code, err) == (0, "")
    assert text.strip() == view.text("en")
    for s in range(2):
        assert view.grid(s) in text
    code, zh, _ = _cli(*argv, "--lang", "zh")
    assert code == 0 and "进程 0" in zh and view.grid(1) in zh
    code, js, _ = _cli(*argv, "--format", "json")
    assert code == 0 and json.loads(js) == json.loads(view.to_json())


@pytest.mark.parametrize("argv, says", [
    (("--ring", "0", "--tokens", "8"), "--ring must be a positive integer"),
    (("--ring", "11", "--tokens", "8"), "at most 10"),
    (("--ring", "3", "--tokens", "8"), "not a multiple of 6"),
    (("--ring", "2", "--tokens", "8", "--layout", "documents"), "documents mask"),
    (("--ring", "2", "--tokens", "6", "--mask", "documents:3,3", "--layout", "documents"), "multiple of P"),
    (("--ring", "2", "--tokens", "8192"), "in [1, 4096]"),
    (("--layout", "zigzag"), "add --ring"),
    (("--ring", "2", "--tokens", "8", "--model", "minilm"), "--model does not apply"),
    (("--ring", "2", "--tokens", "8", "--format", "html"), "text or json"),
])
def test_cli_bad_ring_values_are_one_line_and_exit_2(argv, says):
    code, out, err = _cli(*argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and says in err, err
