#!/usr/bin/env bash
# Fresh machine -> test run: virtualenv, install with test extras, Debian's
# chromium for the explorer's browser test, lint, then pytest.
# Extra arguments go to pytest (e.g. `-m slow` for the long checks).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q -e '.[test]'
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
    || echo "warning: could not install chromium; browser tests will be skipped" >&2
fi
ruff check .
ruff format --check .
python scripts/check_layers.py
python -m pytest "$@"
