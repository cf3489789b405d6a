#!/usr/bin/env bash
# The test suite: ruff, then pytest (unit tests, fixtures, parity suite, CLI).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -n 2 "$@"
