"""How the suite is run: `make test`'s phase driver (.ci/phases.py) and the test selection of
tests/conftest.py.

The driver is run with a stand-in for make (a script that fails the targets it is told to), so
these tests check what it reports and its exit status, not the phases themselves."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import stat
import sys
from pathlib import Path

import pytest

import conftest

TESTS = Path(__file__).resolve().parents[1]  # tests/, where conftest's tables name files from
ROOT = TESTS.parent


def _load_phases():
    spec = importlib.util.spec_from_file_location("ci_phases", ROOT / ".ci" / "phases.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


FAKE_MAKE = """\
#!{python}
# A stand-in for make: exits with the code FAKE_FAIL gives its target ("docs:2,install:1"), and
# for test-suite writes a JUnit file of 3 tests (1 failed, 1 skipped) where FAKE_REPORTS says.
# It notes its target and the TEST_WORKERS and OMP_NUM_THREADS it was given in FAKE_LOG.DIR/TARGET;
# FAKE_WAIT="test-suite:test-isa-default" makes test-suite wait (at most 60 s, else exit 3) until
# test-isa-default has started.
import os, pathlib, sys, time
target = sys.argv[-1]
notes = pathlib.Path(os.environ["FAKE_LOG"] + ".dir")
notes.mkdir(exist_ok=True)
(notes / target).write_text(os.environ.get("TEST_WORKERS", "-") + " " + os.environ.get("OMP_NUM_THREADS", "-"))
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(target + "\\n")
for wait in os.environ.get("FAKE_WAIT", "").split(","):
    if wait.startswith(target + ":"):
        deadline = time.monotonic() + 60
        while not (notes / wait.split(":")[1]).exists():
            if time.monotonic() > deadline:
                sys.exit(3)
            time.sleep(0.05)
codes = dict(x.split(":") for x in os.environ.get("FAKE_FAIL", "").split(",") if x)
if target == "test-suite":
    reports = pathlib.Path(os.environ["FAKE_REPORTS"])
    reports.mkdir(parents=True, exist_ok=True)
    (reports / "suite.xml").write_text(
        '<testsuites><testsuite name="pytest" tests="3" failures="1" errors="0" skipped="1"/></testsuites>')
print("ran", target)
sys.exit(int(codes.get(target, 0)))
"""


@pytest.fixture
def driver(tmp_path, monkeypatch):
    """Run .ci/phases.py's main with the stand-in make: (exit status, printed lines, targets run)."""
    phases = _load_phases()
    make = tmp_path / "make"
    make.write_text(FAKE_MAKE.format(python=sys.executable))
    make.chmod(make.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "targets.log"
    monkeypatch.setenv("MAKE", str(make))
    monkeypatch.setenv("FAKE_LOG", str(log))
    monkeypatch.setenv("FAKE_REPORTS", str(tmp_path / "reports"))
    monkeypatch.setattr(phases, "REPORTS", tmp_path / "reports")
    # the AVX2 emulation runs whatever this CPU is
    monkeypatch.setattr(phases, "PHASES", [dataclasses.replace(p, skip_unless=None) for p in phases.PHASES])

    def run(fail: str = "", argv: list[str] | None = None, capsys=None, wait: str = ""):
        monkeypatch.setenv("FAKE_FAIL", fail)
        monkeypatch.setenv("FAKE_WAIT", wait)
        rc = phases.main(argv or [])
        out = capsys.readouterr().out
        targets = log.read_text().split() if log.exists() else []
        log.unlink(missing_ok=True)
        return rc, out.splitlines(), targets

    run.phases = phases
    run.notes = Path(str(log) + ".dir")
    return run


def _in_group_order(targets: list[str], phases) -> bool:
    """The targets ran group by group (a phase and those beside it), in any order inside a group."""
    at = 0
    for group in phases._groups(phases.PHASES):
        names = sorted(p.target for p in group)
        if sorted(targets[at:at + len(names)]) != names:
            return False
        at += len(names)
    return at == len(targets)


def test_every_phase_runs_in_order_and_a_clean_run_exits_0(driver, capsys):
    rc, lines, targets = driver(capsys=capsys)
    assert rc == 0
    assert _in_group_order(targets, driver.phases)
    for p in driver.phases.PHASES:
        assert any(line.startswith(f"=== phase {p.name}: ") for line in lines), p.name  # said before it starts
        assert sum(line.startswith(f"phase {p.name} ... ok (") and line.endswith("s)") for line in lines) == 2
    assert lines[-2:] == ["make test: every phase ok", "tests: 1 passed, 1 failed, 1 skipped"]


def test_a_failed_phase_does_not_stop_the_others_and_the_exit_status_says_so(driver, capsys):
    rc, lines, targets = driver(fail="docs:2,test-isa-default:5", capsys=capsys)
    assert rc == 1
    assert _in_group_order(targets, driver.phases)  # everything after docs ran too
    assert any(line.startswith("phase docs ... FAILED (exit 2, ") for line in lines)
    assert any(line.startswith("phase isa-default ... FAILED (exit 5, ") for line in lines)  # pytest: no tests ran
    assert "make test FAILED: docs, isa-default" in lines


def test_a_failed_install_skips_what_needs_it_and_counts_it_failed(driver, capsys):
    rc, lines, targets = driver(fail="install:1", capsys=capsys)
    assert rc == 1 and targets == ["install"]
    for p in driver.phases.PHASES[1:]:
        assert f"phase {p.name} ... FAILED (not run: the install failed)" in lines


def test_a_phase_skipped_here_says_why_and_does_not_fail(driver, capsys, monkeypatch):
    phases = driver.phases
    monkeypatch.setattr(phases, "PHASES", [dataclasses.replace(p, skip_unless=(lambda: "not an AVX-512 CPU"))
                                           if p.name == "isa-avx2" else p for p in phases.PHASES])
    rc, lines, targets = driver(capsys=capsys)
    assert rc == 0 and "test-isa-avx2" not in targets
    assert "phase isa-avx2 ... skipped (not an AVX-512 CPU)" in lines


def test_phases_can_be_named_and_an_unknown_one_is_refused(driver, capsys):
    rc, lines, targets = driver(argv=["suite", "docs"], capsys=capsys)
    assert rc == 0 and targets == ["docs", "test-suite"]  # in the driver's order
    assert driver.phases.main(["doc"]) == 2
    assert "unknown phase doc: choose among install, weights" in capsys.readouterr().err


def test_phases_beside_another_run_at_the_same_time_on_one_thread_and_print_after_it(driver, capsys):
    """The ISA passes start with the suite (which waits for one of them to have started, or fails),
    each in one process on one torch thread, and their output is printed once the suite is done."""
    phases = driver.phases
    by_name = {p.name: p for p in phases.PHASES}
    assert by_name["isa-default"].beside and by_name["isa-avx2"].beside and not by_name["suite"].beside
    rc, lines, targets = driver(argv=["suite", "isa-default", "isa-avx2"], capsys=capsys,
                                wait="test-suite:test-isa-default,test-suite:test-isa-avx2")
    assert rc == 0, lines
    assert sorted(targets) == ["test-isa-avx2", "test-isa-default", "test-suite"]
    assert (driver.notes / "test-suite").read_text() == "- -"  # the suite: every core, as the Makefile says
    for target in ("test-isa-default", "test-isa-avx2"):
        assert (driver.notes / target).read_text() == "0 1", target
    suite_done = lines.index(next(line for line in lines if line.startswith("phase suite ... ok (")))
    for name, target in (("isa-default", "test-isa-default"), ("isa-avx2", "test-isa-avx2")):
        assert any(line.startswith(f"=== phase {name}: ") for line in lines[:suite_done])  # said before it starts
        assert f"ran {target}" in lines[suite_done:]  # its output, after the suite's
        assert any(line.startswith(f"phase {name} ... ok (") for line in lines[suite_done:])


def test_a_phase_run_alone_is_not_beside_anything(driver, capsys):
    rc, lines, targets = driver(argv=["isa-default"], capsys=capsys)
    assert rc == 0 and targets == ["test-isa-default"]
    assert (driver.notes / "test-isa-default").read_text() == "- -"


def test_the_isa_passes_collect_every_file_that_can_hold_a_numerics_test(tmp_path):
    """--numerics-files leaves out a test file only when it is not in NUMERICS and marks no test
    ``numerics`` itself: the ISA passes run every numerics test without importing the other files."""
    config = type("Config", (), {"getoption": staticmethod(lambda name: name == "numerics_files")})()
    for file in sorted(TESTS.rglob("test_*.py")):
        rel = file.relative_to(TESTS).as_posix()
        kept = rel in conftest.NUMERICS or "mark.numerics" in file.read_text(encoding="utf-8")
        assert conftest.pytest_ignore_collect(file, config) is (None if kept else True), rel
    for rel in conftest.NUMERICS:
        assert conftest.pytest_ignore_collect(TESTS / rel, config) is None, rel
    marked = tmp_path / "test_marked.py"
    marked.write_text("import pytest\n\n@pytest.mark.numerics\ndef test_x():\n    pass\n")
    assert conftest.pytest_ignore_collect(marked, config) is None  # outside tests/: only its text is read
    plain = tmp_path / "test_plain.py"
    plain.write_text("def test_x():\n    pass\n")
    assert conftest.pytest_ignore_collect(plain, config) is True
    off = type("Config", (), {"getoption": staticmethod(lambda name: False)})()
    assert conftest.pytest_ignore_collect(plain, off) is None  # without the option, every file


def _test_functions(file: str) -> set[str]:
    tree = ast.parse((TESTS / file).read_text(encoding="utf-8"))
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}


@pytest.mark.parametrize("file", sorted(conftest.NUMERICS))
def test_every_numerics_name_is_a_test_of_its_file(file):
    """A renamed test would silently leave the ISA passes: each name in conftest.NUMERICS exists."""
    names = conftest.NUMERICS[file]
    assert (TESTS / file).is_file(), file
    missing = set(names or ()) - _test_functions(file)
    assert not missing, f"{file}: conftest.NUMERICS names tests that are not there: {sorted(missing)}"


def test_slow_family_files_and_markers_are_declared():
    """Every marker conftest gives is declared in pyproject.toml (an undeclared one would only warn)."""
    import tomllib

    declared = {m.split(":")[0] for m in tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
                ["tool"]["pytest"]["ini_options"]["markers"]}
    given = {*conftest.FAMILY_OF_FILE.values(), "compile", "real_model", "numerics"}
    assert given <= declared, given - declared
    for file in conftest.FAMILY_OF_FILE:
        assert (TESTS / file).is_file(), file


def test_xdist_workers_share_the_cores(monkeypatch):
    """Under pytest-xdist each worker's torch gets cores // workers intra-op threads (at least 1)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2:
        pytest.skip("runs only under pytest-xdist (make test, make test-fast)")
    import torch

    assert conftest.WORKER_THREADS == max(1, conftest._cores() // workers)
    assert torch.get_num_threads() <= conftest.WORKER_THREADS


def _isa_default_env() -> dict[str, str]:
    """The variables the Makefile's scalar ISA pass sets (its test-isa-default recipe)."""
    recipe = (ROOT / "Makefile").read_text(encoding="utf-8").split("\ntest-isa-default:", 1)[1].splitlines()[1]
    return dict(word.split("=", 1) for word in recipe.split() if "=" in word and word.split("=", 1)[0].isupper())


def test_the_scalar_isa_pass_runs_bf16_sdpa():
    """Issue 21, defect 8: under ATEN_CPU_CAPABILITY=default alone, torch 2.13's bf16 SDPA raises
    "pack_vnni2 is only supported when avx512 is supported" on CPUs with AMX (it packs for
    oneDNN's AMX kernel with code the scalar build lacks). The pass's own environment must run it;
    on CPUs without AMX this holds with or without the fix."""
    import subprocess

    env = _isa_default_env()
    assert env.get("ATEN_CPU_CAPABILITY") == "default", env
    code = ("import torch, torch.nn.functional as F; q = torch.randn(1, 2, 64, 16, dtype=torch.bfloat16); "
            "print(F.scaled_dot_product_attention(q, q, q).dtype)")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "torch.bfloat16", done.stderr[-2000:]
