#!/usr/bin/env bash
# One prepared check for a machine with a CUDA GPU, under 8 minutes: the parity suite's CUDA cells for every
# family (float32 with TF32 off and on, bfloat16), the quant report on CUDA, and the generation benchmarks at
# tiny sizes. Writes benchmarks/results/DATE-device-check.json (the performance table's schema) and every report
# under benchmarks/results/DATE-device-check/. Exit 0 when every step passed, 1 when one failed, 2 without CUDA.
set -uo pipefail
cd "$(dirname "$0")/.."

usage() {
  cat <<'EOF'
usage: bash scripts/device-check.sh [--python PY] [--out DIR] [--skip-bench]
  --python PY    the interpreter with needle-twin's dependencies (default: .venv/bin/python, else python3)
  --out DIR      where results go (default: benchmarks/results)
  --skip-bench   leave out the generation benchmarks
Needs a CUDA build of torch that sees a GPU; JAX runs on the GPU when it sees one, else on the CPU.
Budgets: float32 with TF32 off and bfloat16 are the families' own profiles (parity_tests/<family>/tolerances.py);
float32 with TF32 on is judged at rel 2e-2, atol 1e-3, KL 1e-3, gradients 5e-2: TF32 keeps 10 mantissa bits
(spacing 2^-10 = 9.8e-4) in every matmul, the bf16 profiles' order of error, not float32's.
EOF
}

PY=""
OUT="benchmarks/results"
BENCH=1
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --python) [ $# -ge 2 ] || { echo "error: --python needs a path, e.g. --python .venv/bin/python" >&2; exit 2; }
              PY="$2"; shift 2 ;;
    --out) [ $# -ge 2 ] || { echo "error: --out needs a directory, e.g. --out benchmarks/results" >&2; exit 2; }
           OUT="$2"; shift 2 ;;
    --skip-bench) BENCH=0; shift ;;
    *) echo "error: unknown argument '$1'; see bash scripts/device-check.sh --help" >&2; exit 2 ;;
  esac
done
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
command -v "$PY" >/dev/null 2>&1 || { echo "error: no interpreter '$PY'; pass --python PATH" >&2; exit 2; }

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
  echo "error: no CUDA device visible to torch ($PY); run this on a GPU machine with a CUDA build of torch" >&2
  exit 2
fi

STAMP="$(date -u +%Y-%m-%d)"
DETAIL="$OUT/$STAMP-device-check"
mkdir -p "$DETAIL"
LOG="$DETAIL/steps.tsv"
: >"$LOG"
JAX=$("$PY" -c 'import jax; print("gpu" if any(d.platform == "gpu" for d in jax.devices()) else "cpu")' 2>/dev/null \
      || echo cpu)
echo "device check: torch on cuda, JAX on $JAX; results under $DETAIL"

# step NAME SECONDS CMD...: run one step with a time limit, log name, exit code and wall seconds.
step() {
  local name="$1" limit="$2"; shift 2
  local t0 rc ms
  t0=$(date +%s%N)
  timeout "$limit" "$@" >"$DETAIL/$name.log" 2>&1
  rc=$?
  ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  printf '%s\t%s\t%d.%03d\n' "$name" "$rc" $((ms / 1000)) $((ms % 1000)) | tee -a "$LOG"
}

TF32_ON=(--precision default --rtol 2e-2 --atol 1e-3 --kl-max 1e-3 --grad-rtol 5e-2)
declare -A CKPT=([v1]=tests/data/needle-v1-tiny.pkl [v2]=tests/data/needle-v2-tiny.pkl
                 [v3]=tests/data/v3/needle-v3-tiny.safetensors)
for fam in v1 v2 v3; do
  dev=(--torch-device cuda --jax-platform "$JAX" --generate 0)
  step "parity-$fam-float32" 90 "$PY" cli.py parity "${CKPT[$fam]}" "${dev[@]}" --json "$DETAIL/parity-$fam-float32.json" --force
  step "parity-$fam-float32-tf32" 90 "$PY" cli.py parity "${CKPT[$fam]}" "${dev[@]}" "${TF32_ON[@]}" \
    --json "$DETAIL/parity-$fam-float32-tf32.json" --force
  step "parity-$fam-bfloat16" 90 "$PY" cli.py parity "${CKPT[$fam]}" "${dev[@]}" --dtype bfloat16 \
    --json "$DETAIL/parity-$fam-bfloat16.json" --force
done
# The main job's model on the GPU: Needle 3 at upstream's default size.
step "parity-v3-default-float32" 150 "$PY" cli.py parity --torch-device cuda --jax-platform "$JAX" --generate 0 \
  --json "$DETAIL/parity-v3-default-float32.json" --force
# The pytest suite's own CUDA cells (parametrised by device; CPU cells deselected).
step "pytest-cuda-cells" 150 "$PY" -m pytest -q -p no:xdist -k cuda parity_tests/test_parity.py

step "quant-v2-cuda" 90 "$PY" cli.py quant tests/data/needle-v2-tiny.pkl --cact tests/data/needle-v2-tiny.q4.cact \
  --device cuda --json "$DETAIL/quant-v2.json" --force
step "quant-v3-cuda" 90 "$PY" cli.py quant tests/data/v3/needle-v3-tiny.safetensors \
  --cact tests/data/v3/needle-v3-tiny.cact --device cuda --json "$DETAIL/quant-v3.json" --force

if [ "$BENCH" = 1 ]; then
  step "bench-torch-v2" 120 "$PY" benchmarks/bench_torch_v2.py --dtype bfloat16 float32 --batch 1 --repeats 1 \
    --new-tokens 16 --prompt-len 32 --kinds this --no-emulate --json "$DETAIL/bench-torch-v2.json"
  step "bench-generate-v1" 120 "$PY" benchmarks/bench_generate.py --dtype bfloat16 --batch 1 --repeats 1 \
    --new-tokens 16 --src-len 32
fi

"$PY" - "$LOG" "$OUT/$STAMP-device-check.json" "$STAMP" <<'EOF'
import json, subprocess, sys
log, out, stamp = sys.argv[1:]
import torch
gpu = torch.cuda.get_device_name(0)
rows = []
for line in open(log):
    name, rc, wall = line.rstrip("\n").split("\t")
    rows.append({"benchmark": f"device check: {name}", "setting": gpu,
                 "verdict": "pass" if rc == "0" else ("timeout" if rc == "124" else f"exit {rc}"),
                 "wall_s": float(wall)})
doc = {"schema": "needle-twin/bench-result", "version": 1, "date": stamp, "command": "bash scripts/device-check.sh",
       "machine": {"description": gpu, "cpu_flags": [], "absent_flags": []}, "rows": rows}
open(out, "w").write(json.dumps(doc, indent=1) + "\n")
print(f"wrote {out}")
sys.exit(0 if all(r["verdict"] == "pass" for r in rows) else 1)
EOF
