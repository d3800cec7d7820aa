#!/usr/bin/env bash
# Quick start: install (if needed) and chat with the default persona in the terminal.
# Extra arguments go to `cortexbot chat` (e.g. --persona NAME --user NAME). The chat runs in the folder
# this was started from: its config.toml is the one picked up, and exports are saved there.
set -euo pipefail
started_in=$(pwd)
cd "$(dirname "$0")/.."
scripts/install.sh
venv="${CORTEXBOT_VENV:-.venv}"
case "$venv" in /*) ;; *) venv="$(pwd)/$venv" ;; esac
cd "$started_in"
exec "$venv/bin/cortexbot" chat "$@"
