#!/usr/bin/env bash
# Regenerate tests/data/v3/ goldens with upstream's own code (cactus-needle 3.2.8).
# Builds .upstream-venv/ (once) with the pinned reference stack, CPU wheels from PyPI,
# then runs tools/upstream_goldens.py in it. Extra arguments go to the .py
# (e.g. --only mqa, --out DIR). The product never imports upstream; only this tool does.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.upstream-venv
PINS=(cactus-needle==3.2.8 jax==0.10.2 jaxlib==0.10.2 flax==0.12.8 numpy==2.4.6
      safetensors==0.8.0 sentencepiece==0.2.3 ml_dtypes)
stamp=$VENV/.pins
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "${PINS[*]}" ]; then
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q "${PINS[@]}"
    echo "${PINS[*]}" > "$stamp"
fi
export NEEDLE_TELEMETRY=0 DO_NOT_TRACK=1 JAX_PLATFORMS=cpu
export UPSTREAM_GOLDENS_COMMAND="tools/upstream_goldens.sh${*:+ $*}"
exec "$VENV/bin/python" tools/upstream_goldens.py "$@"
