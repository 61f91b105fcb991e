#!/usr/bin/env bash
# TensorBoard on a run's tb/ directory, from .venv, with the SSH port-forward hint (the M7C runbook).
#
#   bash scripts/run_tensorboard.sh [LOGDIR | OUT_DIR | RUN_DIR]
#     default: the newest run under artifacts/train_runs that trained (python -m train.runs newest),
#     else artifacts/m7c_125m/tb
#   PORT=6007 bash scripts/run_tensorboard.sh artifacts/m7c_125m_2xa100_prod
#
# An out_dir means its tb/; a run dir (run.info) means its out_dir's tb/. PORT (6006) and HOST
# (localhost: reach it through `ssh -L`) choose where it listens; DRY_RUN=1 prints the command.
set -euo pipefail

SCRIPT_TAG=tensorboard
# shellcheck source=scripts/lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
cd_repo

PORT=${PORT:-6006}
HOST=${HOST:-localhost}
[[ "$PORT" =~ ^[0-9]+$ ]] || die "PORT=$PORT must be a port number" 2
if [ "$#" -ge 1 ]; then
  LOGDIR=$1
else  # the run the runners launched most recently that trained (train/observe/runs.py); else the runbook's out_dir
  LOGDIR=$("$(any_python)" -m train.runs newest "${ARTIFACTS_DIR:-artifacts}" 2>/dev/null) || LOGDIR=artifacts/m7c_125m/tb
fi

if [ -f "$LOGDIR/run.info" ]; then
  out=$(sed -n 's/^out_dir: //p' "$LOGDIR/run.info" | tail -n 1)
  [ -n "$out" ] || die "$LOGDIR/run.info names no out_dir" 2
  LOGDIR="$out/tb"
elif [ -d "$LOGDIR/tb" ]; then
  LOGDIR="$LOGDIR/tb"
fi
if [ ! -d "$LOGDIR" ]; then
  warn "$LOGDIR does not exist yet: TensorBoard will show it once the trainer writes events"
fi

VENV=${VENV:-.venv}
TB="$VENV/bin/tensorboard"
[ -x "$TB" ] || die "tensorboard not found in $VENV: run bash scripts/prime_bootstrap.sh"
CMD=("$TB" --logdir "$LOGDIR" --port "$PORT" --host "$HOST")

log "logdir: $LOGDIR"
log "on your laptop: ssh -L $PORT:localhost:$PORT ${USER:-$(id -un 2>/dev/null || echo user)}@$(hostname 2>/dev/null || echo host)"
log "then open http://localhost:$PORT"
log "command: $(quote_cmd "${CMD[@]}")"
if [ "${DRY_RUN:-0}" = 1 ]; then
  exit 0
fi
exec "${CMD[@]}"
