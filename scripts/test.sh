#!/usr/bin/env bash
# Installs everything the tests need into ./.venv, then checks the code (ruff, mypy) and runs the whole
# test suite. Extra arguments go to pytest (e.g. -k window, -x).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh dev
export OPENBLAS_NUM_THREADS=1
.venv/bin/ruff check .
.venv/bin/mypy
exec .venv/bin/python -m pytest -q "$@"
