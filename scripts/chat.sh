#!/usr/bin/env bash
# Quick start: install (if needed) and chat with the default persona in the terminal.
# Extra arguments go to `cortexbot chat` (e.g. --persona NAME --user NAME).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
exec "${CORTEXBOT_VENV:-.venv}/bin/cortexbot" chat "$@"
