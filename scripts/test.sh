#!/usr/bin/env bash
# Installs everything the tests need into ./.venv, then checks the code (ruff, mypy) and runs the whole
# test suite on a few worker processes (pytest-xdist: one per core, at most 4; CORTEXBOT_TEST_WORKERS
# overrides, 0 runs it in this process). Extra arguments go to pytest (e.g. -k window, -x).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh dev
venv="${CORTEXBOT_VENV:-.venv}"  # (where install.sh put it)
export OPENBLAS_NUM_THREADS=1
"$venv/bin/ruff" check .
"$venv/bin/mypy"
cores=$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2)
workers="${CORTEXBOT_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}"
# Whole files go to one worker (--dist loadfile): a module's fixtures (a loaded embedder, an MCP server)
# start once, and each worker starts its own PostgreSQL and Synapse on free loopback ports.
exec "$venv/bin/python" -m pytest -q -n "$workers" --dist loadfile "$@"
