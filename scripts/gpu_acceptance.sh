#!/usr/bin/env bash
# The GPU acceptance (bench/gpu_acceptance.py), into artifacts/gpu_acceptance_<timestamp>/: acceptance.jsonl (a line
# per item as it finishes), acceptance.json, summary.md (each number beside its goal).
#   bash scripts/gpu_acceptance.sh            # on a CUDA machine: the first pass, under 10 minutes on one H100: the
#                                             # runbook (bootstrap, smoke, train, .HALT, resume, monitor), environment,
#                                             # CUDA tests, NSA vs SDPA, M7C tokens/s, decode, dense MFU
#   bash scripts/gpu_acceptance.sh --full     # every item with its long limit (about an hour)
# Runs with the machine's python (a .venv when there is one) and needs no network: `PYTHONPATH=.` is set here.
# Without CUDA it says so and runs what a CPU can check: launch counts per layer and every Triton kernel compiled
# ahead of time for sm_80/sm_90; exits with their status (0 when they pass).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/common.sh
SCRIPT_TAG=gpu_acceptance
source scripts/lib/common.sh
PY=$(any_python)
OUT="${ARTIFACTS_DIR:-artifacts}/gpu_acceptance_$(now_stamp)"
mkdir -p "$OUT"

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
  log "CUDA: $("$PY" -c 'import torch; print(torch.cuda.get_device_name(0))') -> $OUT"
  "$PY" bench/gpu_acceptance.py --out "$OUT" "$@"
else
  log "no CUDA device here: launch counts and kernels compiled ahead of time for sm_80/sm_90 -> $OUT"
  "$PY" bench/gpu_acceptance.py --out "$OUT" --device cpu --full --only launches kernel_compile
fi
