#!/usr/bin/env bash
# Installs everything the tests need into ./.venv, then checks the code (ruff, mypy) and runs the whole
# test suite on a few worker processes (pytest-xdist: one per core, at most 4; CORTEXBOT_TEST_WORKERS
# overrides, 0 runs it in this process). Extra arguments go to pytest (e.g. -k window, -x).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh dev
venv="${CORTEXBOT_VENV:-.venv}"  # (where install.sh put it)
export OPENBLAS_NUM_THREADS=1
# The tests start the bot as a process a few hundred times: each reads the project's compiled modules instead of
# compiling them again (a shell that sets PYTHONDONTWRITEBYTECODE made every start compile them all).
unset PYTHONDONTWRITEBYTECODE
"$venv/bin/ruff" check .
# mypy (half a minute of one core on a clean clone) runs beside the tests, whose workers spend much of their time
# waiting on servers and processes; its output and verdict come after theirs, and either failing fails the run.
mypy_log=$(mktemp)
"$venv/bin/mypy" > "$mypy_log" 2>&1 &
mypy_pid=$!
trap 'kill "$mypy_pid" 2>/dev/null || true; rm -f "$mypy_log"' EXIT
cores=$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2)
workers="${CORTEXBOT_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}"
# Whole files go to one worker (--dist loadfile): a module's fixtures (a loaded embedder, an MCP server)
# start once, and each worker starts its own PostgreSQL and Synapse on free loopback ports.
status=0
"$venv/bin/python" -m pytest -q -n "$workers" --dist loadfile "$@" || status=$?
mypy_status=0
wait "$mypy_pid" || mypy_status=$?
cat "$mypy_log"
if [ "$mypy_status" -ne 0 ]; then
  echo "mypy failed (exit status $mypy_status)" >&2
  [ "$status" -ne 0 ] || status=$mypy_status
fi
exit "$status"
