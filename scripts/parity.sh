#!/usr/bin/env bash
# The main job: a parity report on the embedded default model: Needle 2 at the published `base` size (45M params,
# seeded random weights); `--family v1` runs Needle v1 (26.3M).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/needle-twin parity "$@"
