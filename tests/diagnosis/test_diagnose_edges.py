"""multihead.diagnose at its edges: refusals, bad input, the renderers and the command line."""

from __future__ import annotations

import io
import json
import math
import pathlib

import pytest
import torch
import torch.nn as nn

import diagnose_corpus as corpus
import multihead
from multihead.cli import main
from multihead.diagnosis import MAX_PARAMETERS, NotAttention, diagnose

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "examples" / "my_attention.py"


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def test_not_attention_is_refused_in_one_line_naming_what_was_looked_for():
    with pytest.raises(NotAttention) as e:
        diagnose(Mlp())
    message = str(e.value)
    assert "\n" not in message and "q/k/v projections" in message and "fc1 (32, 8)" in message


def test_huge_module_is_refused_with_the_limit():
    class Huge(corpus.Separate):
        pass

    m = Huge()
    m.extra = nn.Parameter(torch.empty(0).new_empty((MAX_PARAMETERS + 1,), device="meta"))
    with pytest.raises(ValueError, match=f"more than diagnose runs \\({MAX_PARAMETERS:,}\\)"):
        diagnose(m)


def test_forward_needing_an_argument_says_what_to_pass():
    class NeedsPositions(corpus.Textbook):
        def forward(self, x, positions):
            return self.run(x, x, x, None) + 0 * positions.sum()

    with pytest.raises(ValueError, match=r"needs 'positions'.*kwargs=\{'positions': \.\.\.\}.*--arg positions=VALUE"):
        diagnose(NeedsPositions(fused=True))
    d = diagnose(NeedsPositions(fused=True), kwargs={"positions": torch.zeros(3)})
    assert d.ok, d.text()


def test_forward_that_raises_shows_its_error_and_the_probe():
    class Broken(corpus.Fused):
        def weighted(self, w, v):
            raise RuntimeError("my own error")

    d = diagnose(Broken(fused=True))
    assert d.status == "bug" and d.finding.rule == "raised"
    assert "RuntimeError: my own error" in d.text() and "self-attention" in d.finding.probe
    assert d.text().startswith("Broken: the forward raised on the way to: weights × V")
    assert d.finding.where.function == "weighted" and "my own error" in d.finding.where.code


def test_float64_module_runs_in_float64_and_x_is_checked():
    m = corpus.Separate().double()
    d = diagnose(m, torch.zeros(1, 3, corpus.D_MODEL, dtype=torch.float64))
    assert d.ok and d.bound < 1e-12, (d.error, d.bound)  # the bound is float64's
    with pytest.raises(ValueError, match="takes 12 features"):
        diagnose(m, torch.zeros(1, 3, 5))
    with pytest.raises(TypeError, match="x must be an example input tensor"):
        diagnose(m, [1, 2])
    with pytest.raises(TypeError, match="torch.nn.Module"):
        diagnose("not a module")
    with pytest.raises(ValueError, match="num_heads must be positive"):
        diagnose(m, num_heads=0)
    with pytest.raises(ValueError, match="num_heads=5 does not divide the query projection's width 12"):
        diagnose(m, num_heads=5)
    with pytest.raises(TypeError, match="batch_first must be True, False or None"):
        diagnose(m, batch_first="yes")
    with pytest.raises(TypeError, match="kwargs must be a dict"):
        diagnose(m, kwargs=[1])


def test_bfloat16_module_is_judged_at_its_precision():
    torch.manual_seed(0)
    d = diagnose(nn.MultiheadAttention(corpus.D_MODEL, corpus.HEADS, batch_first=True).to(torch.bfloat16))
    assert d.ok and d.error <= d.bound, d.text()
    bad = diagnose(corpus.mutant("softmax_query_axis", "bf-separate").to(torch.bfloat16))
    assert bad.finding.step.id == "softmax", bad.text()


def test_module_on_meta_or_split_devices_is_refused():
    with pytest.raises(ValueError, match="meta device"):
        diagnose(corpus.Separate().to("meta"))


def test_head_count_found_by_trial_when_no_attribute_says_it():
    class Anonymous(corpus.Separate):
        pass

    m = Anonymous(heads=4)
    del m.num_heads
    m.split = lambda t, length, batch: t.view(batch, length, 4, 3).transpose(1, 2)  # type: ignore[method-assign]
    d = diagnose(m)
    assert d.ok and d.facts["heads"] == 4, d.text()


def test_the_one_diagnosis_in_every_format():
    d = diagnose(corpus.mutant("merge_no_transpose", "bf-separate"))
    data = json.loads(d.to_json())
    assert data["status"] == "bug" and data["finding"]["step"] == "merge_heads"
    assert data["finding"]["line"] == d.finding.where.line and set(data["finding"]["text"]) == {"en", "zh"}
    assert data["finding"]["diagram"] and data["finding"]["text"]["zh"] in d.text("zh")
    html = d._repr_html_()
    assert html.startswith('<div class="multihead-diagnosis"') and "<script" not in html
    assert "merge heads" in html and "拼接各头" in d.html("zh")
    with pytest.raises(ValueError, match="lang must be"):
        d.text("fr")


def test_matches_reports_error_and_bound():
    d = multihead.diagnose(multihead.MultiHeadAttention(corpus.D_MODEL, corpus.HEADS))
    data = d.to_dict()
    assert data["status"] == "matches" and data["finding"] is None and 0 <= data["error"] <= data["bound"]
    assert math.isfinite(data["bound"]) and "matches the definition" in str(d) and "与定义一致" in d.text("zh")


@pytest.mark.parametrize("how", ["Module.compile", "torch.compile"])
def test_compiled_module_is_diagnosed_eagerly(how):
    m = corpus.mutant("scale_by_d", "bf-fused")
    if how == "Module.compile":
        m.compile()
    else:
        m = torch.compile(m)
    d = diagnose(m)
    assert d.finding.step.id == "scale" and d.finding.params["guess"] == "1/D", d.text()


def test_module_modes_are_restored():
    m = corpus.Separate().train()
    m.drop.eval()
    diagnose(m)
    assert m.training and not m.drop.training


# ---------------------------------------------------------------------------- the command line
def _cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    rc = main(["diagnose", *argv], stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


def test_cli_names_the_step_and_line():
    rc, out, err = _cli(f"{EXAMPLE}:MyAttention")
    assert rc == 0 and err == ""
    assert out.startswith("MyAttention: first wrong step: split heads Q\n  at my_attention.py:20:")
    rc, out, _ = _cli(f"{EXAMPLE}:MyAttention", "--check", "--format", "json")
    assert rc == 1 and json.loads(out)["finding"]["step"] == "split_heads"
    rc, out, _ = _cli(f"{EXAMPLE}:MyAttention", "--lang", "zh", "--init", "d_model=12", "--init", "num_heads=3")
    assert rc == 0 and "第一个出错的步骤" in out and "3 个头" in out


def test_cli_writes_html(tmp_path):
    target = tmp_path / "report.html"
    rc, out, _ = _cli(f"{EXAMPLE}:MyAttention", "--format", "html", "--out", str(target))
    assert rc == 0 and out == "" and 'class="multihead-diagnosis"' in target.read_text(encoding="utf-8")


@pytest.mark.parametrize("argv, words", [
    (["nofile.py:X"], "nofile.py: no such file"),
    ([f"{EXAMPLE}"], "FILE.py:Class"),
    ([f"{EXAMPLE}:Nope"], "its nn.Module classes: MyAttention"),
    ([f"{EXAMPLE}:MyAttention", "--init", "oops"], "--init takes NAME=VALUE"),
    ([f"{EXAMPLE}:MyAttention", "--init", "width=3"], "unexpected keyword"),
    ([f"{EXAMPLE}:math"], "not an nn.Module class or factory"),
    ([f"{EXAMPLE}:MyAttention", "--heads", "0"], "--heads must be a positive integer"),
])
def test_cli_user_mistakes_are_one_line_and_exit_2(argv, words):
    rc, out, err = _cli(*argv)
    assert rc == 2 and out == "" and words in err and err.count("\n") == 1, err


def test_cli_refuses_a_non_attention_module(tmp_path):
    path = tmp_path / "mlp.py"
    path.write_text("import torch.nn as nn\nclass Mlp(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                    "        self.fc = nn.Linear(4, 4)\n    def forward(self, x):\n        return self.fc(x)\n")
    rc, _, err = _cli(f"{path}:Mlp")
    assert rc == 2 and "not an attention module" in err and err.count("\n") == 1


def test_diagnose_is_a_function_and_its_package_a_module_of_another_name():
    """One name per thing: ``multihead.diagnose`` is the verb (a function, not a package made
    callable by swapping its class), ``multihead.diagnosis`` the package; importing the package
    does not shadow the function."""
    import types

    import multihead
    import multihead.diagnosis

    assert isinstance(multihead.diagnose, types.FunctionType)
    assert multihead.diagnose is multihead.diagnosis.diagnose
    assert type(multihead.diagnosis) is types.ModuleType and not callable(multihead.diagnosis)
