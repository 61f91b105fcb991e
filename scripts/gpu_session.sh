#!/usr/bin/env bash
# Issue 50's calls on a lent GPU machine, one call per argument, so that a 15-minute lease is spent measuring, not
# typing (docs/BENCHMARKS.md "The NSA speed harness"). Each call stays under the device tool's 10-minute limit:
#   bash scripts/gpu_session.sh 1   # harness: environment, correctness, ceilings, attention (the issue's ratios)
#   bash scripts/gpu_session.sh 2   # harness: the whole M7C model's decode step (4 compiles, ~5 min)
#   bash scripts/gpu_session.sh 3   # harness: M7C training at 2k / 8k / 32k, NSA and its dense twin (~7 min)
#   bash scripts/gpu_session.sh 4   # harness: the dense ~1B model's MFU compiled; then the acceptance's runbook item
# Results go to $OUT (the device tool brings back only what lands there; default artifacts/gpu_session): the
# harness's gpu_nsa_speed_<card>_<date>.json, merged across calls, and acceptance/ for call 4.
# fla's wheel, fetched here with `pip download fla-core==0.5.2 --no-deps -d .whl` and carried (carry: [".whl"]: the
# folder is git-ignored), is unpacked into a folder on PYTHONPATH first; without it the fla arm reports its absence.
# The machine's own python3 runs everything (PYTHON=... to change it); no venv, no network.
# TINY=1: the same calls on this CPU at tiny sizes, in Triton's interpreter (the check before a GPU is lent).
# DRY_RUN=1: print the commands only.
set -euo pipefail
cd "$(dirname "$0")/.."

CALL=${1:-}
case "$CALL" in 1 | 2 | 3 | 4) ;; *)
  echo "usage: bash scripts/gpu_session.sh 1|2|3|4 (see the header for what each call measures)" >&2
  exit 2 ;;
esac
if [ -x .venv/bin/python ] && [ "${TINY:-0}" = 1 ]; then DEFAULT_PY=.venv/bin/python; else DEFAULT_PY=python3; fi
PY=${PYTHON:-$DEFAULT_PY}
OUT=${OUT:-artifacts/gpu_session}
SITE=${SITE:-/tmp/gpu_session_site}
if [ "${TINY:-0}" = 1 ]; then
  DEVICE=(--device cpu --tiny)
  export TRITON_INTERPRET=1
else
  DEVICE=()
fi

status=0
# step CMD...: print it (DRY_RUN=1), or run it; a failing step is remembered and the next one still runs
step() {
  if [ "${DRY_RUN:-0}" = 1 ]; then
    printf '%s\n' "$*"
    return 0
  fi
  echo "[gpu_session] $*"
  "$@" || status=$?
}

if [ "${DRY_RUN:-0}" != 1 ]; then
  mkdir -p "$OUT"
  shopt -s nullglob
  wheels=(.whl/*.whl)
  if [ "${#wheels[@]}" -gt 0 ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    echo "[gpu_session] unpacked ${wheels[*]} into $SITE"
  else
    echo "[gpu_session] no wheels in .whl/: the fla arm will report that fla is not installed"
  fi
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
fi

harness=("$PY" bench/gpu_nsa_speed.py --out "$OUT" "${DEVICE[@]}")
case "$CALL" in
  1) step "${harness[@]}" --only environment correctness ceilings attention ;;
  2) step "${harness[@]}" --only decode ;;
  3) step "${harness[@]}" --only train ;;
  4)
    step "${harness[@]}" --only mfu
    step "$PY" bench/gpu_acceptance.py --out "$OUT/acceptance" "${DEVICE[@]}" --only runbook
    ;;
esac
exit "$status"
