#!/usr/bin/env bash
# Static checks, for CI beside the tests: ruff (lint, then the formatter's check), then mypy -- strict on the typed
# core (options, plan, placement, planning/; pyproject.toml's [tool.mypy] says which files and how). PYTHON: the interpreter whose environment has
# the dev extra (default: the .venv `make` installs).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
"$PYTHON" -m ruff check autotp examples tests benchmarks scripts
"$PYTHON" -m ruff format --check autotp examples tests benchmarks scripts
"$PYTHON" -m mypy
