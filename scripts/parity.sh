#!/usr/bin/env bash
# The main job: a parity report on the embedded default model: Needle 3 at upstream's default config (127.2M params,
# seeded random weights); `--family v2` runs Needle 2 'base' (45M), `--family v1` Needle v1 (26.3M).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/needle-twin parity "$@"
