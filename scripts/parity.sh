#!/usr/bin/env bash
# The main job: a parity report on the embedded default Needle model (26.3M params).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/needle-twin parity "$@"
