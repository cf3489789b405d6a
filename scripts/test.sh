#!/usr/bin/env bash
# The test suite: ruff, then pytest (unit tests, fixtures, parity suite, CLI).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/ruff check .
# Two workers on a 2-core machine, one thread each: a torch or XLA pool of two threads per worker only spins against
# the other worker.
# --dist loadgroup keeps each xdist_group on one worker, so the compiled-generation tests that share a torch.compile
# graph build it once (tests/v2/test_torch_generate.py).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export XLA_FLAGS="${XLA_FLAGS:---xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1}"
exec .venv/bin/python -m pytest -n 2 --dist loadgroup "$@"
