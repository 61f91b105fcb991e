#!/usr/bin/env bash
# Monitor of the production 50k run (the 50K launch plan): scripts/monitor_run.sh on the production out_dir.
#
#   bash scripts/monitor_production_50k.sh [--once] [--interval N] [RUN_OR_OUT_DIR]
#
# Default target: OUT_DIR (env), else artifacts/m7c_125m_2xa100_prod (train.out_dir of
# configs/m7c_125m_2xa100_production.yaml). Alerts and knobs: scripts/monitor_run.sh.
set -euo pipefail

HERE=$(dirname "${BASH_SOURCE[0]}")
args=()
target=""
while [ "$#" -gt 0 ]; do
  case "$1" in
    --interval | --window) args+=("$1" "${2:?$1 needs a value}"); shift ;;
    -*) args+=("$1") ;;
    *) target=$1 ;;
  esac
  shift
done
exec bash "$HERE/monitor_run.sh" "${args[@]}" "${target:-${OUT_DIR:-artifacts/m7c_125m_2xa100_prod}}"
