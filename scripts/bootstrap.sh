#!/usr/bin/env bash
# Create .venv (once) and install needle-twin with everything its tests and reports use.
# torch is pinned to the CPU build 2.13.0 here, inside pyproject's range (the versions the tests pass on).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=.venv/.needle-twin-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/bootstrap.sh -nt "$stamp" ] || [ scripts/constraints.txt -nt "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -c scripts/constraints.txt "torch==2.13.0"
    .venv/bin/python -m pip install -q -c scripts/constraints.txt -e ".[all,test]"
    touch "$stamp"
fi
