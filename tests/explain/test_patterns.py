"""Head-pattern labels (explain/patterns.py) on constructed weight matrices, one per label, and on
the real models' heads (against scores recomputed here with plain loops).

Each constructed head puts a weight ``a`` on its pattern's target key and spreads the rest
uniformly over the other visible keys; the label must follow the threshold exactly (a = 0.5 is
labelled, just below is not), and the mask decides which rows count.
"""

import math

import pytest
import torch

from multihead.explain.patterns import PATTERNS, label_heads, pattern, pattern_name, pattern_scores

L = 8
CAUSAL = torch.ones(L, L, dtype=torch.bool).tril()
FULL = torch.ones(L, L, dtype=torch.bool)
TARGETS = {"first": lambda i: 0, "previous": lambda i: i - 1, "self": lambda i: i, "next": lambda i: i + 1,
           "last": lambda i: L - 1}


def head(target, a: float, keep: torch.Tensor) -> torch.Tensor:
    """(L, L) float64: weight a on key target(i) where that key is visible, the rest uniform over
    the other visible keys (all on the target when it is the only one)."""
    w = torch.zeros(L, L, dtype=torch.float64)
    for i in range(L):
        seen = [j for j in range(L) if keep[i, j]]
        t = target(i)
        if t in seen and len(seen) > 1:
            w[i, t] = a
            for j in seen:
                if j != t:
                    w[i, j] = (1 - a) / (len(seen) - 1)
        else:
            for j in seen:
                w[i, j] = 1 / len(seen)
    return w


def loop_scores(w, keep):
    """The module docstring's table, written as loops."""
    rows = range(L)
    visible = [sum(bool(keep[i, j]) for j in rows) for i in rows]

    def positional(target, valid):
        vals = [float(w[i, target(i)]) for i in rows
                if valid(i) and visible[i] >= 2 and keep[i, target(i)]]
        return sum(vals) / len(vals) if vals else 0.0

    ent = [-sum(float(p) * math.log(float(p)) for p in w[i] if p > 0) / math.log(visible[i])
           for i in rows if visible[i] >= 2]
    return {
        "first": positional(lambda i: 0, lambda i: i >= 1),
        "previous": positional(lambda i: i - 1, lambda i: i >= 1),
        "self": positional(lambda i: i, lambda i: True),
        "next": positional(lambda i: i + 1, lambda i: i <= L - 2),
        "last": positional(lambda i: L - 1, lambda i: i <= L - 2),
        "broad": sum(ent) / len(ent),
    }


# next and last token have no eligible row under a causal mask (tested below)
CASES = [(k, m) for k in TARGETS for m in ("encoder", "causal") if not (m == "causal" and k in ("next", "last"))]


@pytest.mark.parametrize("key,kind", CASES)
def test_each_positional_pattern_is_labelled_at_its_threshold(key, kind):
    keep = FULL if kind == "encoder" else CAUSAL
    at = head(TARGETS[key], 0.9, keep)
    scores = pattern_scores(at, keep)
    assert scores[key].item() == pytest.approx(0.9, abs=1e-6)
    assert label_heads(scores) is pattern(key)
    # the threshold: 0.5 on the target is labelled (when no other pattern is further above its
    # own), just under is not
    just = pattern_scores(head(TARGETS[key], 0.5, keep), keep)
    assert just[key].item() == pytest.approx(0.5, abs=1e-7)
    under = pattern_scores(head(TARGETS[key], 0.45, keep), keep)
    assert label_heads(under) is not pattern(key), {k: v.item() for k, v in under.items()}
    zeros = {p.key: torch.tensor(0.0) for p in PATTERNS}
    assert label_heads({**zeros, key: torch.tensor(0.5)}) is pattern(key)
    assert label_heads({**zeros, key: torch.tensor(0.5 - 1e-6)}) is None


@pytest.mark.parametrize("keep", [FULL, CAUSAL], ids=["encoder", "causal"])
def test_uniform_rows_are_broad_and_scores_follow_the_definition(keep):
    w = keep.double() / keep.sum(-1, keepdim=True)
    scores = pattern_scores(w, keep)
    assert scores["broad"].item() == pytest.approx(1.0, abs=1e-6)
    assert label_heads(scores) is pattern("broad")
    torch.manual_seed(0)
    logits = torch.randn(L, L, dtype=torch.float64) * 3
    rand = logits.masked_fill(~keep, -math.inf).softmax(-1)
    got = pattern_scores(rand, keep)
    want = loop_scores(rand, keep)
    for k in want:
        assert got[k].item() == pytest.approx(want[k], abs=1e-6), k


def test_a_causal_mask_makes_next_and_last_inapplicable_and_row_0_uninformative():
    # row 0 of a causal head sees only itself (weight 1 on key 0): it counts for no pattern
    w = head(TARGETS["previous"], 1.0, CAUSAL)
    scores = pattern_scores(w, CAUSAL)
    assert scores["next"].item() == 0 and scores["last"].item() == 0
    assert scores["previous"].item() == pytest.approx(1.0)
    assert scores["first"].item() == pytest.approx(1 / (L - 1))   # only row 1's previous is key 0
    assert scores["self"].item() == 0.0                            # row 0's self-weight does not count


def test_ties_go_to_the_pattern_furthest_above_its_threshold_and_batches_nest():
    first, prev = head(TARGETS["first"], 0.95, FULL), head(TARGETS["previous"], 0.6, FULL)
    stacked = torch.stack([torch.stack([first, prev]), torch.stack([prev, first])])   # (2, 2, L, L)
    labels = label_heads(pattern_scores(stacked))
    assert [[p.key for p in row] for row in labels] == [["first", "previous"], ["previous", "first"]]
    # a head at 0.6 on both the first and previous key of row 1 only: first wins row-wise elsewhere
    both = head(TARGETS["first"], 0.55, FULL)
    assert label_heads(pattern_scores(both)) is pattern("first")


def test_names_and_bad_input():
    assert pattern_name(pattern("first"), "en", ["[CLS]", "a", "[SEP]"]) == "first token ([CLS])"
    assert pattern_name(pattern("last"), "zh", ["<s>", "a", "</s>"]) == "最后一个 token (</s>)"
    assert pattern_name(None, "en") == "no clear pattern"
    assert {p.code for p in PATTERNS} == set("fpsnlb")
    with pytest.raises(ValueError, match="L >= 2"):
        pattern_scores(torch.ones(1, 1))
    with pytest.raises(TypeError, match="keep must be a bool"):
        pattern_scores(torch.ones(3, 3) / 3, torch.ones(3, 3))
    with pytest.raises(ValueError, match="does not broadcast"):
        pattern_scores(torch.ones(3, 3) / 3, torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="pattern must be one of"):
        pattern("cls")
