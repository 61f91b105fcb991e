#!/usr/bin/env bash
# One GPU acceptance command (issue 13): everything a CUDA GPU can tell us about this project, in
# under 10 minutes on one H100, into artifacts/gpu_acceptance_<timestamp>/ (acceptance.json, summary.md).
#   bash scripts/gpu_acceptance.sh            # on a CUDA machine: tests, attention, training, decode, MFU
# Without CUDA it says so and runs what a CPU can check: launch counts per layer, every Triton kernel
# compiled ahead of time for sm_80/sm_90, the kernel tests in Triton's interpreter and the FlexAttention
# branch tests (forward, CPU); exits with their status (0 when they pass).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/common.sh
SCRIPT_TAG=gpu_acceptance
source scripts/lib/common.sh
PY=$(any_python)
OUT="${ARTIFACTS_DIR:-artifacts}/gpu_acceptance_$(now_stamp)"
mkdir -p "$OUT"

if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
  log "CUDA: $("$PY" -c 'import torch; print(torch.cuda.get_device_name(0))') -> $OUT"
  "$PY" bench/gpu_acceptance.py --out "$OUT"
else
  log "no CUDA device here: launch counts, kernels compiled ahead of time for sm_80/sm_90, and the kernel tests in Triton's interpreter -> $OUT"
  "$PY" bench/gpu_acceptance.py --out "$OUT" --device cpu --only launches kernel_compile cuda_tests
fi
