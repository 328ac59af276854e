#!/usr/bin/env bash
# Fresh machine -> working demo: virtualenv, install, then the export path on
# an embedded sample (local Ray, a local Lance table, bucketed MDS + report).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q -e .
python -m prx_data.demo "$@"
