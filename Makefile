# Quickstart targets: each creates ./.venv and installs what it needs on first use.
# torch comes from TORCH_SPEC: the CPU wheel pinned here; GPU users override it,
# e.g. `make test TORCH_SPEC=torch==2.13.0 PIP_EXTRA="--index-url https://download.pytorch.org/whl/cu128"`.
# Everything else is installed at the versions the suite was run with (constraints.txt).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PIP_EXTRA ?=
BIN := $(VENV)/bin
export OMP_NUM_THREADS ?= 1

.PHONY: demo test test-all lint clean

$(VENV)/.installed: pyproject.toml Makefile constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)" $(PIP_EXTRA)
	$(BIN)/python -m pip install -q -e ".[dev]" -c constraints.txt
	touch $@

demo: $(VENV)/.installed
	$(BIN)/autotp demo

# Two workers keep both cores busy (a rank-0 solve, a one-process test and a spawn leave one idle); the tests that
# measure time then run alone.  WORKERS=0: all in one process.
WORKERS ?= 2
PARALLEL = -n $(WORKERS) --dist worksteal

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q $(PARALLEL) -m "not slow and not serial"
	$(BIN)/python -m pytest -q -m "serial and not slow"

test-all: $(VENV)/.installed  # the default suite and the slow tier (scale checks, benchmark scripts, more rank counts)
	$(BIN)/python -m pytest -q $(PARALLEL) -m "not serial"
	$(BIN)/python -m pytest -q -m serial

lint: $(VENV)/.installed  # ruff check, ruff format --check, then mypy strict on the typed core (scripts/check.sh)
	PYTHON=$(BIN)/python scripts/check.sh

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
