#!/usr/bin/env bash
# Installs cortex-bot into ./.venv (created with Python 3.11+ if missing). Idempotent.
#   scripts/install.sh          the bot and everything it needs to run
#   scripts/install.sh postgres plus the PostgreSQL driver (asyncpg, pgvector)
#   scripts/install.sh dev      plus what the tests and benchmarks need (PostgreSQL included, and Debian's
#                               Chromium for the web page's browser test, through apt-get as root or sudo)
set -euo pipefail
cd "$(dirname "$0")/.."

extra="${1:-}"
venv="${CORTEXBOT_VENV:-.venv}"

find_python() {
  for candidate in "${PYTHON:-}" python3.13 python3.12 python3.11 python3; do
    [ -n "$candidate" ] || continue
    if command -v "$candidate" >/dev/null 2>&1 &&
       "$candidate" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
      echo "$candidate"; return 0
    fi
  done
  echo "cortex-bot needs Python 3.11 or newer; install it or set PYTHON=/path/to/python3.11" >&2
  return 1
}

if [ ! -x "$venv/bin/python" ]; then
  python=$(find_python)
  echo "creating virtualenv $venv with $($python --version)" >&2
  "$python" -m venv "$venv"
fi

case "$extra" in
  "") spec="." ;;
  dev|postgres) spec=".[$extra]" ;;
  *) echo "unknown extra '$extra': use dev or postgres" >&2; exit 2 ;;
esac
# Editable, so a checkout that is edited and re-run needs no reinstall. Done once per pyproject.toml (and
# extra): an installed bot starts without a package index (CORTEXBOT_REINSTALL=1 forces it).
digest=$(cat pyproject.toml | { sha256sum 2>/dev/null || shasum -a 256; } | cut -d' ' -f1)
stamp="$venv/.cortexbot-installed-${extra:-base}"
if [ "${CORTEXBOT_REINSTALL:-}" != 1 ] && [ -x "$venv/bin/cortexbot" ] && [ -f "$stamp" ] &&
   [ "$(cat "$stamp")" = "$digest" ]; then
  echo "cortex-bot is installed in $venv (pyproject.toml unchanged)" >&2
else
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e "$spec"
  case "$extra" in  # what this install covers
    dev) covered="dev postgres base" ;;
    postgres) covered="postgres base" ;;
    *) covered="base" ;;
  esac
  for part in $covered; do echo "$digest" > "$venv/.cortexbot-installed-$part"; done
fi

# The page test drives a real browser: Debian's Chromium (Playwright never downloads one here).
if [ "$extra" = dev ] && ! command -v chromium >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    as_root=""
    [ "$(id -u)" -eq 0 ] || as_root="sudo -n"
    echo "installing Debian's chromium for the browser test" >&2
    if ! { $as_root apt-get update -qq && DEBIAN_FRONTEND=noninteractive $as_root apt-get install -y -qq chromium; } \
        >/dev/null 2>&1; then
      echo "could not install chromium (needs root or sudo): the browser test will say so" >&2
    fi
  else
    echo "no apt-get: install Chromium yourself for the browser test (it looks for 'chromium' on PATH)" >&2
  fi
fi
