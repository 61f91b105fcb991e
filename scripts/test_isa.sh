#!/usr/bin/env bash
# The suite as an older or simpler CPU would run it: bash scripts/test_isa.sh avx2|novec [pytest args...]
#   avx2   ATen's and inductor's AVX2 kernels (an AVX2-only CPU such as the acceptance machine's AMD EPYC), MKL, oneDNN,
#          OpenBLAS and NumPy's dispatch held to AVX2 as well
#   novec  no vector extension: ATen's default kernels, inductor's scalar C++ (-march=x86-64), MKL SSE4.2, OpenBLAS
#          Nehalem, NumPy's baseline
# avx2 turns inductor's vector kernels back on (TORCHINDUCTOR_VEC_ISA_OK=1; tests/conftest.py turns them off for the
# default suite's speed): their width is the point. Each with its own inductor and Triton caches (a kernel compiled
# for one vector width is never reused for another).
# A test that compares two different code paths bit for bit fails here when its result depends on the vector width.
set -euo pipefail
cd "$(dirname "$0")/.."
SCRIPT_TAG=test_isa
source scripts/lib/common.sh
require_venv
isa=${1:-}
case "$isa" in
  avx2) export ATEN_CPU_CAPABILITY=avx2 TORCHINDUCTOR_VEC_ISA_OK=1 TORCHINDUCTOR_CPP_MARCH=haswell MKL_ENABLE_INSTRUCTIONS=AVX2 \
          ONEDNN_MAX_CPU_ISA=AVX2 OPENBLAS_CORETYPE=Haswell NPY_DISABLE_CPU_FEATURES="X86_V4 AVX512_ICL AVX512_SPR" ;;
  novec) export ATEN_CPU_CAPABILITY=default TORCHINDUCTOR_CPP_MARCH=x86-64 MKL_ENABLE_INSTRUCTIONS=SSE4_2 \
          ONEDNN_MAX_CPU_ISA=SSE41 OPENBLAS_CORETYPE=Nehalem NPY_DISABLE_CPU_FEATURES="X86_V3 X86_V4 AVX512_ICL AVX512_SPR" ;;
  *) die "usage: bash scripts/test_isa.sh avx2|novec [pytest args...]" 2 ;;
esac
shift
caches="${TMPDIR:-/tmp}/nsa_test_isa_$isa"
export TORCHINDUCTOR_CACHE_DIR="$caches/inductor" TRITON_CACHE_DIR="$caches/triton" OMP_NUM_THREADS=1
log "suite with $isa kernels (ATEN_CPU_CAPABILITY=$ATEN_CPU_CAPABILITY, caches under $caches)"
exec "$PY" -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder "$@"
