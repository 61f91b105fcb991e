#!/usr/bin/env bash
# Run the NSA correctness suite (causality, reference equality, decode) on CUDA when present, else CPU.
#   scripts/run_gpu_causality_test.sh          # causality + reference + branches + decode + model + GPU tests
#   scripts/run_gpu_causality_test.sh --full   # every NSA test, including parameters/stats and the demo
# Ends with "causality: <passed>/<run> passed, <skipped> skipped"; exits non-zero on any failure.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3

TESTS=(tests/nsa/test_nsa_causality.py tests/nsa/test_nsa_reference.py tests/nsa/test_nsa_branches.py
       tests/nsa/test_nsa_decode.py tests/nsa/test_nsa_model.py tests/nsa/test_nsa_gpu.py)
if [ "${1:-}" = "--full" ]; then
  TESTS=(tests/nsa/test_nsa_*.py tests/nsa/test_demo.py)
fi

if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  export NSA_TEST_DEVICE=cuda
else
  export NSA_TEST_DEVICE=cpu
fi
echo "device: $NSA_TEST_DEVICE ($PY)"

REPORT=$(mktemp -t nsa_causality.XXXXXX.xml)
"$PY" -m pytest "${TESTS[@]}" -q -p no:cacheprovider --junitxml="$REPORT"
status=$?
"$PY" scripts/junit_summary.py "$REPORT" causality
rm -f "$REPORT"
exit $status
