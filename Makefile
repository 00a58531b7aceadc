# Two commands for a new user: `make demo` and `make test`. Both create .venv when missing.
# `make bench` writes docs/benchmarks.md (about 20 min); `make bench BENCH_ARGS=--quick` takes a few minutes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo -n)

.PHONY: demo test bench clean browser

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(STAMP): $(VENV)/bin/python pyproject.toml constraints.txt
	$(PIP) install -q -c constraints.txt -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/multihead explain

# tests/test_browser.py drives Debian's chromium with Playwright (no browser download); it skips,
# saying why, only when chromium cannot be installed here.
browser:
	@command -v chromium >/dev/null 2>&1 || ($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq chromium fonts-wqy-microhei) \
		|| echo "could not install chromium: tests/test_browser.py will skip"

test: $(STAMP) browser
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m benchmarks $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .hypothesis
