"""The diagnosis of every corpus case (tests/diagnose_corpus.py) is a test.

Mutants: each one classic bug, in two of the four variants (batch- or sequence-first, separate
or fused projections); the diagnosis must be "bug" with the step (and, where the corpus names
one, the rule) the bug is in, pointing at a line of the corpus. Correct implementations in
other styles: "matches the definition", the conventions they differ in named, and the measured
error within the oracle's bound. The seeds, written afresh from their descriptions: 000, 001
and a causal 002 match (001 with the -1e9 convention); 003 and a non-causal 002 have the known
cross-attention defect (keys reshaped with the query's length), found and named.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

import diagnose_corpus as corpus
from multihead.diagnosis import diagnose


def _quiet(module):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. nn.MultiheadAttention's fast-path notes
        return diagnose(module)


@pytest.mark.parametrize("name, variant", corpus.mutant_cases(), ids=[f"{n}-{v}" for n, v in corpus.mutant_cases()])
def test_mutant_is_found_at_its_step(name, variant):
    methods, _, step, rule, _ = corpus.MUTANTS[name]
    d = _quiet(corpus.mutant(name, variant))
    assert d.status == "bug" and not d.ok, d.text()
    assert d.finding is not None and d.finding.step.id == step, d.text()
    if rule is not None:
        assert d.finding.rule == rule, d.text()
    if d.finding.where is not None:
        assert d.finding.where.file == corpus.__file__, d.finding.where
    # the sentence is written in both languages from the same facts
    texts = d.to_dict()["finding"]["text"]
    assert texts["en"] in d.text("en") and texts["zh"] in d.text("zh") and texts["en"] != texts["zh"]


#: mutants whose line is in the method the bug was put in (the others point where it shows)
_AT_THE_BUG = [c for c in corpus.mutant_cases() if c[0] not in (
    "scale_missing", "mask_not_assigned", "out_missing", "value_with_key_weights")]


@pytest.mark.parametrize("name, variant", _AT_THE_BUG[::3], ids=[f"{n}-{v}" for n, v in _AT_THE_BUG[::3]])
def test_finding_points_at_the_line_of_the_bug(name, variant):
    methods = corpus.MUTANTS[name][0]
    d = _quiet(corpus.mutant(name, variant))
    assert d.finding.where is not None
    lines = set()
    for fn in methods.values():
        body, first = inspect.getsourcelines(fn)
        lines |= set(range(first, first + len(body)))
    assert d.finding.where.line in lines, d.text()


@pytest.mark.parametrize("name", list(corpus.CORRECT), ids=list(corpus.CORRECT))
def test_correct_implementation_matches(name):
    build, conventions = corpus.CORRECT[name]
    torch.manual_seed(0)
    d = _quiet(build())
    assert d.status == "matches" and d.finding is None, d.text()
    assert [c.key for c in d.conventions] == list(conventions), d.text()
    assert 0 <= d.error <= d.bound, (d.error, d.bound)


def test_enough_cases():
    variants = {v for _, v in corpus.mutant_cases()}
    assert len(corpus.MUTANTS) >= 25 and variants == set(corpus.VARIANTS)
    assert len(corpus.CORRECT) >= 10


@pytest.mark.parametrize("seed", [corpus.Seed003, lambda: corpus.Seed002(is_causal=False)], ids=["seed 003", "seed 002"])
def test_seed_cross_attention_defect_is_named(seed):
    torch.manual_seed(0)
    d = _quiet(seed())
    f = d.finding
    assert d.status == "bug" and f is not None
    assert (f.step.id, f.role, f.rule) == ("split_heads", "K", "kv_query_length"), d.text()
    assert "cross-attention" in f.probe and "Lk=7" in f.probe
    assert "Lq=5" in d.text("en") and "Lk=7" in d.text("en") and "查询的长度" in d.text("zh")
    assert "交叉注意力，B=2，Lq=5，Lk=7" in d.text("zh")


def test_seed_001_names_the_finite_fill_convention():
    torch.manual_seed(0)
    d = _quiet(corpus.Seed001())
    assert d.ok and [c.key for c in d.conventions] == ["row_uniform"]
    assert "-1e9" in d.text("en") and "不是错误" in d.text("zh")
