#!/usr/bin/env bash
# Live monitor of a training run: progress and ETA, loss, tokens/s, val loss, downstream task scores
# (train.eval_tasks), GPU memory and utilisation, heartbeat age, NSA gate health, latest checkpoint,
# HALT / anomaly flags and alerts.
# The analysis lives in scripts/monitor_frame.py (standard library + train/core/artifacts.py); this loop only redraws.
#
#   bash scripts/monitor_run.sh [--once] [--interval N] [--window N] [RUN_OR_OUT_DIR]
#
# RUN_OR_OUT_DIR: a run dir (artifacts/train_runs/m7c_*, whose run.info names the out_dir) or a
# trainer out_dir; default: the run under artifacts/train_runs that trained most recently (python -m train.runs).
# Environment: INTERVAL (10 s), WINDOW (20 rows), STALE_S (300), NVIDIA_SMI, ARTIFACTS_DIR. Alerts are the
# trainer's own (train/observe/alerts.py, from the heartbeat) plus stale / NaN / watchdog; none is recomputed here.
# Read-only: it never touches the run. Ctrl-C leaves.
set -euo pipefail

SCRIPT_TAG=monitor
# shellcheck source=scripts/lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
cd_repo

usage() { echo "usage: bash scripts/monitor_run.sh [--once] [--interval N] [--window N] [RUN_OR_OUT_DIR]"; }

ONCE=0
INTERVAL=${INTERVAL:-10}
TARGET=""
FRAME_ARGS=()
while [ "$#" -gt 0 ]; do
  case "$1" in
    --once) ONCE=1 ;;
    --interval) INTERVAL=${2:?--interval needs a value}; shift ;;
    --interval=*) INTERVAL=${1#*=} ;;
    --window) FRAME_ARGS+=(--window "${2:?--window needs a value}"); shift ;;
    --window=*) FRAME_ARGS+=(--window "${1#*=}") ;;
    -h | --help) usage; exit 0 ;;
    -*) usage >&2; die "unknown option $1" 2 ;;
    *)
      [ -z "$TARGET" ] || die "give one run dir or out_dir (got '$TARGET' and '$1')" 2
      TARGET=$1
      ;;
  esac
  shift
done
[[ "$INTERVAL" =~ ^[0-9]+([.][0-9]+)?$ ]] || die "--interval must be a number of seconds, got '$INTERVAL'" 2

PYBIN=$(any_python)
# monitor_frame.py and train/observe/runs.py need only the standard library and this checkout (a python3 without
# the .venv works too)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -z "$TARGET" ]; then  # the run that is training (a failed launch beside it does not win): train/observe/runs.py
  TARGET=$("$PYBIN" -m train.runs newest "${ARTIFACTS_DIR:-artifacts}" 2>/dev/null) \
    || die "no run given and none under ${ARTIFACTS_DIR:-artifacts}/train_runs; usage: bash scripts/monitor_run.sh RUN_OR_OUT_DIR" 2
fi
if [ "$ONCE" = 1 ]; then
  [ -e "$TARGET" ] || die "$TARGET does not exist (give a run dir or a trainer out_dir)" 2
  exec "$PYBIN" scripts/monitor_frame.py "${FRAME_ARGS[@]}" "$TARGET"
fi

while true; do
  if [ -e "$TARGET" ]; then
    frame=$("$PYBIN" scripts/monitor_frame.py "${FRAME_ARGS[@]}" "$TARGET" 2>&1) || true
  else
    frame="== $TARGET does not exist yet: waiting for the run to start ($(date '+%H:%M:%S'))"
  fi
  if [ -t 1 ]; then printf '\033[H\033[2J'; else printf '\n'; fi
  printf '%s\n' "$frame"
  printf '(refresh every %ss; Ctrl-C to leave)\n' "$INTERVAL"
  sleep "$INTERVAL"
done
