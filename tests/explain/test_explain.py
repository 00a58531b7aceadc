"""``multihead explain``: the walkthrough of a real forward pass, its checks, languages and formats."""

from __future__ import annotations

import io
import json
import os
import re
import runpy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import multihead
from multihead.cli import main
from multihead.explain import checks as ck
from multihead.explain import cost
from multihead.explain.example import ExampleConfig, build_example, trace_example
from multihead.explain.walkthrough import WIDTH, _width, example_walkthrough

# the walkthrough: (2,3,4) -> (2,3,8) for Q, K, V -> (2,3,2,4) -> (2,2,3,4) -> scores (2,2,3,3)
# -> ... -> (2,2,3,4) -> (2,3,2,4) -> (2,3,8) -> (2,3,8)
DEFAULT_STEPS = [("input", (2, 3, 4))]
DEFAULT_STEPS += [(f"project {r}", (2, 3, 8)) for r in "QKV"]
for _r in "QKV":
    DEFAULT_STEPS += [(f"split heads {_r}", (2, 3, 2, 4)), (f"move heads forward {_r}", (2, 2, 3, 4))]
DEFAULT_STEPS += [(n, (2, 2, 3, 3)) for n in ("scores QKᵀ", "scale", "causal mask", "softmax")]
DEFAULT_STEPS += [("weights × V", (2, 2, 3, 4)), ("move heads back", (2, 3, 2, 4)),
                  ("merge heads", (2, 3, 8)), ("output projection", (2, 3, 8))]

ROOT = Path(__file__).resolve().parents[2]
NEG_INF = float("-inf")


def run_cli(*argv, stdout=None):
    out, err = stdout or io.StringIO(), io.StringIO()
    rc = main(["explain", *argv], stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


def _headings(text: str) -> list[str]:
    return [line for line in text.splitlines() if re.match(r"^\s*\d+\. ", line)]


def _block_after(text: str, heading: str, caption: str, rows: int) -> list[list[float]]:
    """The numbers of the ``rows`` lines that follow ``caption`` in the step ``heading``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"^\s*\d+\. {re.escape(heading)}\s", line))
    at = next(i for i in range(start, len(lines)) if lines[i].strip().startswith(caption))
    matrix = []
    for line in lines[at + 1: at + 1 + rows]:
        cells = line.split("|")[0].split()[1:]  # drop the row label and any row sum
        matrix.append([float(c) for c in cells])
    return matrix


# ----------------------------------------------------------------------------- the default walkthrough
def test_default_run_shows_every_step_in_order_and_all_checks_hold():
    rc, out, err = run_cli()
    assert rc == 0 and err == ""
    heads = _headings(out)
    assert len(heads) == len(DEFAULT_STEPS)
    for line, (label, shape) in zip(heads, DEFAULT_STEPS):
        name = {"input": "input x"}.get(label, label)
        assert re.match(rf"^\s*\d+\. {re.escape(name)}\s", line), line
        sizes = tuple(int(n) for n in re.findall(r"=(\d+)", line.split(name, 1)[1]))
        assert sizes == shape, line
    assert "backend: reference" in out
    assert 'backend="reference"' in out  # the code it ran
    n = len(trace_example().checks) + 8  # the forward's own checks and explain's recomputations
    assert f"checks ({n}/{n} hold)" in out
    assert out.rstrip().endswith("every check holds")
    assert "FAIL" not in out
    assert all(_width(line) <= WIDTH for line in out.splitlines())


def test_python_dash_m_runs_the_walkthrough(monkeypatch, capsys):
    """``python -m multihead explain``, run in-process (runpy does what ``-m`` does)."""
    monkeypatch.setattr(sys, "argv", ["multihead", "explain", "--no-values"])
    monkeypatch.delitem(sys.modules, "multihead.__main__", raising=False)
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("multihead", run_name="__main__", alter_sys=True)
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    assert len(_headings(out)) == len(DEFAULT_STEPS)
    assert "\033[" not in out  # not a terminal: no colour


def test_printed_numbers_are_the_traced_tensors():
    rc, out, _ = run_cli()
    t = trace_example()
    scores = _block_after(out, "scores QKᵀ", "batch 0, head 0", 3)
    torch.testing.assert_close(torch.tensor(scores), t.step("scores QKᵀ").tensor[0, 0], rtol=0, atol=5e-5)
    mask01 = _block_after(out, "causal mask", "mask, 1 = may attend", 3)
    assert mask01 == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    masked = _block_after(out, "causal mask", "masked scores", 3)
    assert masked[0][1:] == [NEG_INF, NEG_INF] and masked[1][2] == NEG_INF
    torch.testing.assert_close(torch.tensor(masked), t.step("causal mask").tensor[0, 0], rtol=0, atol=5e-5)
    weights = _block_after(out, "softmax", "batch 0, head 0", 3)
    torch.testing.assert_close(torch.tensor(weights), t.step("softmax").tensor[0, 0], rtol=0, atol=5e-5)
    sums = [float(line.split("|")[1]) for line in out.splitlines() if re.match(r"^\s+q\d .*\|", line)]
    assert sums == [1.0, 1.0, 1.0]
    y = _block_after(out, "output projection", "batch 0", 3)
    torch.testing.assert_close(torch.tensor(y), t.steps[-1].tensor[0], rtol=0, atol=5e-5)


def test_numbers_are_what_the_tutorials_code_computes():
    """Seed 42, x first, then W_key, W_query, W_value (bias-free nn.Linear): the tutorial's draws."""
    torch.manual_seed(42)
    x = torch.randn(2, 3, 4)
    w_key, w_query, w_value = (nn.Linear(4, 8, bias=False) for _ in range(3))
    with torch.no_grad():
        keys = w_key(x).view(2, 3, 2, 4).transpose(1, 2)
        queries = w_query(x).view(2, 3, 2, 4).transpose(1, 2)
        values = w_value(x).view(2, 3, 2, 4).transpose(1, 2)
        scores = queries @ keys.transpose(2, 3)
        mask = torch.triu(torch.ones(3, 3), diagonal=1).bool()
        weights = torch.softmax(scores.masked_fill(mask, NEG_INF) / 4 ** 0.5, dim=-1)
        context = (weights @ values).transpose(1, 2).reshape(2, 3, 8)
    t = trace_example()
    torch.testing.assert_close(t.step("input").tensor, x, rtol=0, atol=0)
    torch.testing.assert_close(t.step("scores QKᵀ").tensor, scores, rtol=0, atol=1e-6)
    torch.testing.assert_close(t.step("softmax").tensor, weights, rtol=0, atol=1e-6)
    torch.testing.assert_close(t.step("merge heads").tensor, context, rtol=0, atol=1e-6)


def test_build_example_is_deterministic_and_leaves_the_global_rng_alone():
    state = torch.random.get_rng_state()
    (m1, (x1,)), (m2, (x2,)) = build_example(), build_example()
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(x1, x2) and torch.equal(m1.q_proj.weight, m2.q_proj.weight)
    assert isinstance(m1, multihead.MultiHeadAttention) and m1.config.backend == "reference"
    mha, inputs = build_example(ExampleConfig(keys=5, dropout=0.1))
    assert [tuple(i.shape) for i in inputs] == [(2, 3, 4), (2, 5, 4)] and mha.training


# ----------------------------------------------------------------------------- trace == CLI
CONFIGS = {
    "default": ([], ExampleConfig()),
    "cross": (["--keys", "5"], ExampleConfig(keys=5)),
    "gqa": (["--heads", "4", "--kv-heads", "2"], ExampleConfig(heads=4, kv_heads=2)),
    "dropout": (["--dropout", "0.3", "--no-causal"], ExampleConfig(dropout=0.3, causal=False)),
}

_STEP_KEYS = ("name", "pattern", "shape", "axes", "view", "checks")


@pytest.mark.parametrize("case", list(CONFIGS))
def test_trace_of_mha_equals_the_cli_json(case):
    argv, config = CONFIGS[case]
    rc, out, _ = run_cli(*argv, "--format", "json")
    assert rc == 0
    data = json.loads(out)
    mha, inputs = build_example(config)
    torch.manual_seed(config.seed)
    with multihead.trace() as t:
        mha(*inputs)
    expected = t.to_dict()
    assert [{k: d[k] for k in _STEP_KEYS} for d in data["steps"]] == [{k: d[k] for k in _STEP_KEYS} for d in expected["steps"]]
    assert data["config"] == expected["config"]
    assert data["all_checks_hold"] is True and all(c["ok"] for c in data["checks"])


def test_a_users_own_module_gives_the_same_steps():
    torch.manual_seed(7)
    mha = multihead.MultiHeadAttention(4, 2, 8, causal=True, backend="reference")  # with biases
    with multihead.trace() as t:
        mha(torch.randn(2, 3, 4))
    data = json.loads(run_cli("--format", "json", "--no-values")[1])
    assert [(d["name"], d["shape"]) for d in data["steps"]] == [(s.label, list(s.shape)) for s in t.steps]


# ----------------------------------------------------------------------------- formats, languages
def test_json_is_valid_with_values_and_without():
    rc, out, _ = run_cli("--format", "json")
    data = json.loads(out)
    scores = next(d for d in data["steps"] if d["name"] == "scores QKᵀ")
    t = trace_example()
    torch.testing.assert_close(torch.tensor(scores["values"][0]["matrix"]), t.step("scores QKᵀ").tensor[0, 0],
                               rtol=0, atol=1e-6)
    masked = next(d for d in data["steps"] if d["name"] == "causal mask")
    assert masked["values"][0]["matrix"] == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert masked["values"][1]["matrix"][0][1] == "-inf"
    assert data["example"]["seed"] == 42 and data["lang"] == "en"
    plain = json.loads(run_cli("--format", "json", "--no-values")[1])
    assert all("values" not in d for d in plain["steps"])
    assert "title" in plain["steps"][0] and "meaning" in plain["steps"][0]


def test_markdown_is_a_table_of_the_steps():
    rc, out, _ = run_cli("--format", "markdown")
    assert rc == 0
    rows = [line for line in out.splitlines() if re.match(r"^\| \d+ \|", line)]
    assert len(rows) == len(DEFAULT_STEPS)
    assert "| 5 | split heads Q | (b=2, t=3, h=2, d=4) | `b t (h d) -> b t h d` | yes |" in rows
    assert "| 17 | merge heads | (b=2, t=3, d_out=8) | `b t h d -> b t (h d)` | no |" in rows
    assert out.count("- [x] ") == len(trace_example().checks) + 8 and "- [ ] " not in out
    assert all(_width(line) <= WIDTH for line in out.splitlines())


ZH_TERMS = ["查询", "键", "值", "分头", "转置", "注意力分数", "缩放", "因果掩码", "拼接", "输出投影"]
EN_TITLES = ["input x", "project Q", "split heads", "move heads forward", "scores QKᵀ", "scale", "causal mask",
             "softmax", "weights × V", "move heads back", "merge heads", "output projection"]
EN_CHECKS = ["same data after view", "rows sum to 1", "masked weights", "blocked scores", "equals",
             "heads concatenated", "separate product", "per-head"]


@pytest.mark.parametrize("fmt", ["text", "markdown"])
def test_chinese_walkthrough(fmt):
    rc, out, _ = run_cli("--lang", "zh", "--format", fmt, "--per-head", "--cost")
    assert rc == 0
    for term in ZH_TERMS:
        assert term in out
    titles = _headings(out) if fmt == "text" else [l for l in out.splitlines() if l.startswith("|")]
    assert len(titles) >= len(DEFAULT_STEPS)
    for line in titles:
        for en in EN_TITLES:
            assert en not in line, line
    check_lines = out.split("检查")[-1]
    for en in EN_CHECKS:
        assert en not in check_lines
    assert "所有检查均通过" in out or fmt == "markdown"
    assert all(_width(line) <= WIDTH for line in out.splitlines())


def test_chinese_covers_gqa_dropout_and_other_masks():
    rc, out, _ = run_cli("--lang", "zh", "--heads", "4", "--kv-heads", "1", "--dropout", "0.2", "--no-values")
    assert rc == 0 and "复制键/值头" in out and "随机失活" in out
    from multihead import steps

    assert steps.MASK.title({"kinds": ("causal", "padding")}, "zh") == "因果 & 填充掩码"
    with pytest.raises(KeyError, match="MASK_KINDS"):
        steps.MASK.title({"kinds": ("a kind nobody translated",)}, "zh")


def test_colour_only_on_a_terminal(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.delenv("NO_COLOR", raising=False)
    assert "\033[1m" in run_cli(stdout=Tty())[1]
    assert "\033[" not in run_cli()[1]
    monkeypatch.setenv("NO_COLOR", "1")
    assert "\033[" not in run_cli(stdout=Tty())[1]


def test_out_writes_the_file(tmp_path):
    target = tmp_path / "walk.md"
    rc, out, _ = run_cli("--format", "markdown", "--out", str(target))
    assert rc == 0 and out == ""
    assert target.read_text(encoding="utf-8").startswith("# multihead explain")


# ----------------------------------------------------------------------------- bad options
@pytest.mark.parametrize("argv, needle", [
    (["--heads", "3"], "--heads 3 does not divide --d-out 8"),
    (["--heads", "4", "--kv-heads", "3"], "--kv-heads 3 does not divide --heads 4"),
    (["--tokens", "-1"], "--tokens must be a positive integer"),
    (["--d-out", "0"], "--d-out must be a positive integer"),
    (["--batch", "two"], "--batch must be an integer"),
    (["--format", "xml"], "invalid choice: 'xml'"),
    (["--lang", "fr"], "invalid choice: 'fr'"),
    (["--dropout", "1.5"], "--dropout must be in [0, 1)"),
])
def test_bad_options_exit_2_with_one_line(argv, needle):
    rc, out, err = run_cli(*argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("multihead: error: ") and needle in err
    assert "Traceback" not in err


# ----------------------------------------------------------------------------- sizes, --out, --version
@pytest.mark.parametrize("option", ["--tokens", "--keys"])
def test_sizes_the_walkthrough_cannot_show_are_refused_with_their_cap(option, tmp_path, monkeypatch):
    """``--tokens 100000`` died in the allocator with a 40-line traceback and exit 1, and
    ``--keys 100000`` printed a walkthrough of 100000 keys (issue 11, defect 10)."""
    monkeypatch.chdir(tmp_path)  # before --out - meant stdout, it wrote a file named "-"
    for fmt in ("text", "json", "html"):
        rc, out, err = run_cli(option, "100000", "--format", fmt, "--out", "-")
        assert rc == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err
        from multihead.explain.example import LIMITS

        limits = LIMITS[fmt]
        assert f"{option} 100000 is more than --format {fmt} shows: at most {limits.tokens} ({limits.why})" in err


CAPS = [
    (["--tokens", "256"], None),
    (["--tokens", "257"], "--tokens 257"),
    (["--keys", "64", "--format", "html", "--out", "-"], None),
    (["--keys", "65", "--format", "html", "--out", "-"], "--keys 65"),
    (["--batch", "16", "--heads", "16", "--d-out", "16", "--tokens", "128", "--keys", "128"], None),  # 2**22 scores
    (["--batch", "16", "--heads", "16", "--d-out", "16", "--tokens", "128", "--keys", "129"], "4,227,072 attention"),
    (["--batch", "16", "--heads", "16", "--d-out", "16", "--tokens", "32", "--format", "png", "--out", "-"], None),
    (["--batch", "16", "--heads", "16", "--d-out", "16", "--tokens", "33", "--format", "png", "--out", "-"],
     "= 278,784 attention scores per step, more than --format png shows: at most 262,144"),
    (["--d-in", "1024", "--d-out", "1024", "--heads", "16"], None),
    (["--d-in", "1025"], "--d-in 1025 is more than the walkthrough shows: at most 1024"),
    (["--seed", str(2 ** 64 - 1)], None),
    (["--lang", "en", "--format", "png", "--out", "-"], None),  # a given option that applies is fine
    (["--values", "--per-head", "--cost"], None),
]


@pytest.mark.parametrize("argv, refused", CAPS, ids=[" ".join(a) for a, _ in CAPS])
def test_the_caps_are_exact(argv, refused, monkeypatch):
    """Sizes up to each cap reach the walkthrough (stubbed here: the check comes before any work)."""
    ran = []
    monkeypatch.setattr(multihead.cli, "_explain", lambda args, stdout: ran.append(args) or 0)
    rc, out, err = run_cli(*argv)
    if refused is None:
        assert (rc, err, len(ran)) == (0, "", 1)
    else:
        assert rc == 2 and not ran and err.count("\n") == 1 and refused in err


def test_the_caps_are_in_the_help(capsys):
    from multihead.explain.example import LIMITS, MAX_BATCH, MAX_FEATURES, MAX_HEADS

    assert main(["explain", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for fmt, limits in LIMITS.items():
        assert fmt in text and f"{limits.tokens} for" in text and f"{limits.scores:,}" in text
    for flag, most in (("--batch", MAX_BATCH), ("--heads", MAX_HEADS), ("--d-in and --d-out", MAX_FEATURES)):
        assert f"{flag} at most {most}" in text


def _os_reason(directory: Path) -> str:
    """What the OS says when a file is created in ``directory``."""
    try:
        (directory / "probe").open("w").close()
    except OSError as e:
        return e.strerror
    raise AssertionError(f"{directory} is writable")


def test_unwritable_out_is_one_line_before_any_work(tmp_path, monkeypatch):
    """An --out that cannot be written is refused, with the OS's reason, before the forward pass
    or the model runs (html/png printed a PermissionError traceback after the work; text reported
    it only after the work; issue 11, defect 10)."""
    from multihead.explain import real_model, walkthrough

    def no_work(*args, **kwargs):
        raise AssertionError("the work ran before --out was checked")

    for module, name in ((walkthrough, "example_walkthrough"), (real_model, "attention_for_text")):  # html runs walkthrough.example_walkthrough too
        monkeypatch.setattr(module, name, no_work)
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    places = {tmp_path / "missing": "the directory {dir} does not exist; create it first",
              a_file: "{dir}: " + _os_reason(a_file)}
    if Path("/sys/kernel").is_dir():  # sysfs: no regular file can be created there, even by root
        places[Path("/sys")] = "/sys: " + _os_reason(Path("/sys"))
    runs = [[f] for f in ("text", "markdown", "json", "html", "png")]
    runs += [["text", "--model", "minilm"], ["html", "--model", "minilm"], ["png", "--model", "minilm"]]
    for directory, reason in places.items():
        for fmt, *model in runs:
            target = directory / ("x." + fmt)
            rc, out, err = run_cli("--format", fmt, *model, "--out", str(target))
            assert rc == 2 and out == "" and err.count("\n") == 1, (target, fmt, model, err)
            assert err.startswith(f"multihead: error: cannot write --out {target}: ")
            assert err.rstrip().endswith(reason.format(dir=directory)), err


def test_out_dash_writes_to_stdout(tmp_path, monkeypatch):
    """``--out -`` is stdout (it wrote a file named "-"), for every format; png as bytes."""
    monkeypatch.chdir(tmp_path)
    for fmt in ("text", "markdown", "json"):
        assert run_cli("--format", fmt, "--out", "-") == run_cli("--format", fmt)
    for fmt in ("html", "png"):
        target = tmp_path / f"w.{fmt}"
        rc, out, _ = run_cli("--format", fmt, "--out", str(target))
        assert rc == 0 and out.startswith(f"wrote {target}")
        stdout = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
        assert main(["explain", "--format", fmt, "--out", "-"], stdout=stdout, stderr=io.StringIO()) == 0
        stdout.flush()
        assert stdout.buffer.getvalue() == target.read_bytes()  # and no "wrote ..." line
        target.unlink()
    assert list(tmp_path.iterdir()) == []


def test_version_comes_from_the_package_metadata(monkeypatch):
    import importlib.metadata

    out, err = io.StringIO(), io.StringIO()
    assert main(["--version"], stdout=out, stderr=err) == 0
    assert (out.getvalue(), err.getvalue()) == (f"multihead {importlib.metadata.version('multihead')}\n", "")

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)  # a source tree, not installed
    out = io.StringIO()
    assert main(["--version"], stdout=out) == 0 and out.getvalue() == f"multihead {multihead.__version__}\n"


def test_explain_does_not_import_the_cli():
    """Imports point one way (cli -> explain): explain/* raises UsageError, a ValueError of its own."""
    import subprocess

    code = ("import sys, multihead.explain.walkthrough, multihead.explain.visual, multihead.explain.real_model, "
            "multihead.explain.visual_png; print('multihead.cli' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": str(Path(multihead.__file__).parents[1])}  # this checkout's code
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert done.stdout.strip() == "False"
    from multihead.explain import UsageError

    assert issubclass(UsageError, ValueError) and multihead.cli.UsageError is UsageError


# ----------------------------------------------------------------------------- checks
@pytest.mark.parametrize("argv", [
    [], ["--keys", "5"], ["--keys", "2", "--tokens", "4"], ["--heads", "4", "--kv-heads", "2"],
    ["--heads", "4", "--kv-heads", "1", "--keys", "6"], ["--dropout", "0.5"], ["--no-causal"],
    ["--batch", "3", "--tokens", "9", "--d-in", "5", "--d-out", "12", "--heads", "3", "--seed", "0"],
])
def test_every_check_holds(argv):
    w = example_walkthrough(multihead.cli.parse_options(argv).example, per_head=True)
    assert w.checks and all(c.ok for c in w.checks), [c for c in w.checks if not c.ok]


def test_a_wrong_forward_pass_fails_its_checks_and_exits_1(monkeypatch):
    from multihead.backends import reference

    good = reference.safe_softmax
    monkeypatch.setattr(reference, "safe_softmax", lambda s: good(s) * 1.001)
    rc, out, _ = run_cli("--no-values")
    assert rc == 1
    assert "FAIL  softmax: rows sum to 1" in out
    assert "FAIL  softmax: equals softmax in float64" in out
    # the steps after it are recomputed from the wrong weights, so they hold: the fault is located
    assert "ok    weights × V: equals weights × V in float64" in out
    assert "FAIL  output projection: output equals the tutorial's plain code in float64" in out
    assert re.search(r"\d+ check\(s\) FAILED", out)


def _corrupt(t: torch.Tensor, by: float = 1e-3) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[t.numel() // 2] += by
    return t


def test_check_functions_fail_on_corrupted_tensors():
    t = trace_example(ExampleConfig(dropout=0.3))
    mha, inputs = build_example(ExampleConfig(dropout=0.3))
    s = {st.label: st.tensor for st in t.steps}
    q, k, v = s["move heads forward Q"], s["move heads forward K"], s["move heads forward V"]
    assert ck.check_scores(q, k, s["scores QKᵀ"]) and not ck.check_scores(q, k, _corrupt(s["scores QKᵀ"]))
    assert ck.check_scale(s["scores QKᵀ"], s["scale"], 4)
    assert not ck.check_scale(s["scores QKᵀ"], _corrupt(s["scale"], 1e-6), 4)
    keep = t.step("causal mask").extras["keep"]
    assert ck.check_mask(s["scale"], s["causal mask"], keep)
    assert not ck.check_mask(s["scale"], _corrupt(s["causal mask"], 1e-6), keep)
    assert ck.check_causal_keep(keep, 3, 3) and not ck.check_causal_keep(keep.transpose(-2, -1), 3, 3)
    assert ck.check_softmax(s["causal mask"], s["softmax"])
    assert not ck.check_softmax(s["causal mask"], _corrupt(s["softmax"], 1e-5))
    assert ck.check_dropout(s["softmax"], s["dropout"], 0.3)
    kept = (s["dropout"] != 0).nonzero()[0].tolist()
    wrong = s["dropout"].clone()
    wrong[tuple(kept)] *= 1.001
    assert not ck.check_dropout(s["softmax"], wrong, 0.3)
    assert ck.check_weighted_sum(s["dropout"], v, s["weights × V"])
    assert not ck.check_weighted_sum(s["softmax"], v, s["weights × V"])  # dropout left out
    assert ck.check_output_projection(s["merge heads"], s["output projection"], mha.out_proj)
    assert not ck.check_output_projection(s["merge heads"], _corrupt(s["output projection"]), mha.out_proj)
    keep_drop = s["dropout"] != 0
    assert ck.check_forward(mha, inputs, s["output projection"], dropout_keep=keep_drop)[0]
    assert not ck.check_forward(mha, inputs, _corrupt(s["output projection"], 1e-4), dropout_keep=keep_drop)[0]


def test_close_to_float64_tolerance_is_derived_from_float32_error():
    torch.manual_seed(3)
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    ok, err, tol = ck.close_to_float64(a @ b, lambda x, y: x @ y, a, b)
    exact = a.double() @ b.double()
    plain_err = float(((a @ b).double() - exact).abs().max())
    assert ok and err == pytest.approx(plain_err)
    assert 2 * plain_err < tol < 2 * plain_err + 1e-4
    assert not ck.close_to_float64(a @ b + tol * 1.5, lambda x, y: x @ y, a, b)[0]


# ----------------------------------------------------------------------------- --per-head, --cost
def test_per_head_prints_the_difference_from_the_fused_path():
    rc, out, _ = run_cli("--per-head", "--no-values")
    assert rc == 0
    m = re.search(r"max \|fused - per-head\| = (\S+)\s+\(tolerance (\S+)\)", out)
    mha, (x,) = build_example()
    with torch.no_grad():
        diff = float((mha(x) - mha.to_per_head()(x)).abs().max())
    assert float(m.group(1)) == pytest.approx(diff, rel=1e-2, abs=1e-12)
    assert float(m.group(1)) <= float(m.group(2))
    assert "ok    output projection: per-head reference equals the fused module" in out


def test_cost_matches_the_flop_counter_and_the_formula():
    from torch.utils.flop_counter import FlopCounterMode

    for config in (ExampleConfig(), ExampleConfig(keys=5, heads=4, kv_heads=2, d_out=16, batch=3)):
        mha, inputs = build_example(config)
        with FlopCounterMode(display=False) as counter:  # untraced: the trace's checks do products too
            mha(*inputs)
        with multihead.trace() as t:
            mha(*inputs)
        costs = {c.label: c for c in cost.trace_cost(t)}
        matmuls = ["project Q", "project K", "project V", "scores QKᵀ", "weights × V", "output projection"]
        assert sum(costs[n].flops for n in matmuls) == counter.get_total_flops()
        B, Lq, Lk, H, D = config.batch, config.tokens, config.key_tokens, config.heads, config.head_dim
        assert costs["scores QKᵀ"].flops == costs["weights × V"].flops == 2 * B * H * Lq * Lk * D
        assert costs["split heads Q"].bytes == costs["move heads back"].bytes == 0  # views move nothing
        formula = cost.attention_cost(B, Lq, Lk, config.d_in, config.d_out, H, config.num_kv_heads)
        assert sum(c.flops for c in costs.values()) == formula.total


def test_attention_cost_does_not_depend_on_the_head_count():
    table = cost.head_count_table(2, 128, 128, 64, 64)
    assert [a.heads for a in table] == [1, 2, 4, 8, 16, 32]
    assert {a.attention for a in table} == {4 * 2 * 128 * 128 * 64}
    assert {a.projections for a in table} == {4 * 2 * 2 * 128 * 64 * 64}
    assert [a.score_elements for a in table] == [2 * h * 128 * 128 for h in (1, 2, 4, 8, 16, 32)]
    rc, out, _ = run_cli("--cost", "--no-values")
    assert rc == 0 and "4·B·Lq·Lk·d_model = 576 FLOPs" in out
    data = json.loads(run_cli("--cost", "--format", "json", "--no-values")[1])
    assert data["cost"]["total_flops"] == sum(s["flops"] for s in data["cost"]["steps"])


# ----------------------------------------------------------------------------- the soft lookup example
def test_soft_lookup_example(capsys):
    ns = runpy.run_path(str(ROOT / "examples" / "soft_lookup.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "value = 0.6·10 + 0.4·5 + 0·2 = 8" in out
    assert ns["weighted_lookup"](ns["FRUIT_WEIGHTS"], ns["VALUES"]) == pytest.approx(8.0, abs=1e-12)
    # the attention part against an independent computation
    q = torch.tensor(ns["FRUIT_QUERY"], dtype=torch.float64)
    k = torch.tensor(list(ns["KEYS"].values()), dtype=torch.float64)
    v = torch.tensor(list(ns["VALUES"].values()), dtype=torch.float64)
    weights = torch.softmax(k @ q / 2 ** 0.5, dim=0)
    _, w_dict, value = ns["soft_lookup"](ns["FRUIT_QUERY"], ns["KEYS"], ns["VALUES"])
    assert list(w_dict.values()) == pytest.approx(weights.tolist(), abs=1e-12)
    assert value == pytest.approx(float(weights @ v), abs=1e-12)
    w_lib, out_lib = ns["with_multihead"](ns["FRUIT_QUERY"], ns["KEYS"], ns["VALUES"])
    torch.testing.assert_close(w_lib, weights, rtol=0, atol=1e-12)
    assert float(out_lib) == pytest.approx(float(weights @ v), abs=1e-12)
    printed = [float(x) for x in re.findall(r"value = (\d+\.\d+)$", out, flags=re.M)]
    assert printed == [round(float(weights @ v), 4)] * 2
    # the fruit query favours the fruits, as the analogy says
    assert w_dict["apple"] > w_dict["banana"] > w_dict["chair"] and w_dict["chair"] < 0.05
