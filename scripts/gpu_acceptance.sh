#!/usr/bin/env bash
# One GPU acceptance command (issue 13): everything a CUDA GPU can tell us about this project, in
# under 10 minutes on one H100, into artifacts/gpu_acceptance_<timestamp>/ (acceptance.json, summary.md).
#   bash scripts/gpu_acceptance.sh            # on a CUDA machine: tests, attention, training, decode, MFU
# Without CUDA it says so, runs the Triton kernel tests in the interpreter (TRITON_INTERPRET=1) and the
# FlexAttention branch tests (forward, CPU), and
# exits with their status (0 when they pass).
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
  log "no CUDA device here: only the Triton kernel tests, in Triton's interpreter on the CPU -> $OUT"
  rc=0
  TRITON_INTERPRET=1 "$PY" -m pytest -q -p no:cacheprovider tests/nsa/test_triton_selection.py tests/nsa/test_flex_branches.py 2>&1 \
    | tee "$OUT/kernel_tests.log" || rc=$?
  "$PY" - "$OUT" "$rc" <<'PYEOF'
import json, sys, time
from pathlib import Path
out, rc = Path(sys.argv[1]), int(sys.argv[2])
tail = [l for l in (out / "kernel_tests.log").read_text().splitlines() if " passed" in l or " failed" in l or " skipped" in l]
report = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "cuda": False,
          "items": {"kernel_tests_interpreter": {"ok": rc == 0, "exit": rc, "result": tail[-1] if tail else None}}}
(out / "acceptance.json").write_text(json.dumps(report, indent=1))
(out / "summary.md").write_text(f"# GPU acceptance, {report['date']}\n\nno CUDA device: GPU items not run.\n\n"
                                f"## Triton kernel tests (interpreter): {'ok' if rc == 0 else 'FAILED'}\n- {tail[-1] if tail else 'no result'}\n")
PYEOF
  exit "$rc"
fi
