#!/usr/bin/env bash
# M7C training runner (the M7C runbook): one command from a bootstrapped checkout to a running, resumable
# training job. Run it inside tmux (docs/RUNBOOK.md):
#
#   tmux new -s m7c
#   bash scripts/train_m7c_prime.sh
#
# What it does:
#   1. requires .venv (bash scripts/prime_bootstrap.sh), exports the M7C runbook's NCCL settings and
#      PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (the caller's values win);
#   2. picks the config from the largest GPU's memory (>= 75 GB: 80g, >= 35 GB: 40g, else 24g;
#      no GPU: configs/m7c_cpu.yaml) and the launcher (torchrun over every visible GPU when
#      there are 2 or more, python otherwise);
#   3. runs the launch's own start checks (python -m train.start_checks, the trainer's code): data source,
#      stale .HALT, a live trainer on the out_dir, and for a resume the checkpoint's architecture,
#      train.steps, tokenizer and global batch on this GPU count; a refusal exits 2 before anything is written;
#   4. creates artifacts/train_runs/m7c_<timestamp>/ with run.info (this launch's facts only), smoke.log, train.log;
#   5. smoke, once per out_dir: SMOKE_STEPS (50) synthetic steps of configs/train_showcase.yaml with the same
#      launcher into <run dir>/smoke, skipped when resuming from a checkpoint; a failing smoke stops everything (exit 1);
#   6. trains; the trainer resumes from the newest complete checkpoint of the config's out_dir
#      (train.resume=auto), keeping its global batch on another GPU count, and run.info records which one.
# Exit status: 0 finished or gracefully stopped; 1 set-up / smoke failure; 2 bad input (config, data,
# stale .HALT, a checkpoint that cannot continue); otherwise the trainer's (3 anomaly halt; 4 a file could not be
# written: a full disk, not relaunched; 137 killed, ...).
# A crash is recorded as such: run.info final_status and metrics.json say `crashed (exit N at step S)`.
#
# Knobs (environment):
#   CONFIG=path.yaml        force a config instead of choosing by VRAM
#   DATASET=SOURCE          --data.source: fineweb_edu | synthetic | text:GLOB | jsonl:GLOB | parquet:GLOB | bin:DIR | hf:NAME
#   EXTRA_ARGS="--k=v ..."  overrides appended to the training command (no spaces inside a value)
#   SMOKE_STEPS=50          smoke length; 0 skips the smoke
#   SMOKE_ARGS="--k=v ..."  overrides appended to the smoke command
#   ARTIFACTS_DIR=artifacts where train_runs/ goes
#   NVIDIA_SMI=nvidia-smi   the nvidia-smi to ask (tests use a fake)
#   DRY_RUN=1               print the selected config and the commands, then exit 0
#   NSA_DDP_COMPRESS, NSA_DDP_BUCKET_MB, NSA_DDP_DISABLE_GC  see scripts/lib/env_overrides.sh
#   VENV=.venv              the virtual environment
set -euo pipefail

SCRIPT_TAG=train_m7c
# shellcheck source=scripts/lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
# shellcheck source=scripts/lib/env_overrides.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/env_overrides.sh"
cd_repo

require_venv
export_nccl_defaults
export PYTHONUNBUFFERED=1

SMOKE_STEPS=${SMOKE_STEPS:-50}
[[ "$SMOKE_STEPS" =~ ^[0-9]+$ ]] || die "SMOKE_STEPS=$SMOKE_STEPS must be a non-negative integer"
SMOKE_CONFIG=configs/train_showcase.yaml
ARTIFACTS_DIR=${ARTIFACTS_DIR:-artifacts}

# ---- config and launcher -------------------------------------------------------------------------
detect_gpus
select_m7c_config
if [ -d "$CONFIG" ]; then die "CONFIG=$CONFIG is a directory; give a YAML file (e.g. configs/m7c_cpu.yaml)" 2; fi
[ -f "$CONFIG" ] || die "config $CONFIG not found" 2

NPROC=$GPU_COUNT
launcher_for "$NPROC"
if [ "$NPROC" -ge 2 ]; then
  export NSA_DDP_COMPRESS="${NSA_DDP_COMPRESS:-bf16}"  # the M7C runbook: bf16 gradient compression by default
fi

OVERRIDES=()
if [ -n "${DATASET:-}" ]; then OVERRIDES+=("--data.source=$DATASET"); fi
read_overrides ENV_ARGS
OVERRIDES+=("${ENV_ARGS[@]}")
mapfile -t EXTRA < <(split_words "${EXTRA_ARGS:-}")
OVERRIDES+=("${EXTRA[@]}")
mapfile -t SMOKE_EXTRA < <(split_words "${SMOKE_ARGS:-}")

TRAIN_CMD=("${LAUNCH[@]}" "$CONFIG" "${OVERRIDES[@]}")

if [ "${DRY_RUN:-0}" = 1 ]; then
  echo "config: $CONFIG ($CONFIG_REASON)"
  echo "gpus: $GPU_COUNT | $(gpu_summary)"
  echo "launch: $(quote_cmd "${TRAIN_CMD[@]}")"
  if [ "$SMOKE_STEPS" -gt 0 ]; then
    echo "smoke: $(quote_cmd "${LAUNCH[@]}" "$SMOKE_CONFIG" "--train.out_dir=RUN_DIR/smoke" "--train.steps=$SMOKE_STEPS" "${SMOKE_EXTRA[@]}")"
  else
    echo "smoke: skipped (SMOKE_STEPS=0)"
  fi
  env_snapshot | sed 's/^/env: /'
  exit 0
fi

# ---- the launch's own start checks, before anything is written or smoked -------------------------
config_facts "$CONFIG" "${OVERRIDES[@]}"
OUT_DIR=$CFG_OUT_DIR
run_start_checks "$CONFIG" "$(( NPROC > 1 ? NPROC : 1 ))" "${OVERRIDES[@]}"
if [ -n "$START_PROBLEM" ]; then die "$START_PROBLEM" 2; fi
OUT_DIR_EXISTED=0
if [ -e "$OUT_DIR" ]; then OUT_DIR_EXISTED=1; fi
lock_out_dir "$OUT_DIR"
RESUME_FROM=$(resume_note "$OUT_DIR" "$CFG_RESUME")
RESUMING=0
if [ "$CFG_RESUME" != none ] && [ -n "$(newest_checkpoint "$OUT_DIR")" ]; then RESUMING=1; fi
if [ "$CFG_RESUME" != auto ] && [ "$CFG_RESUME" != none ]; then RESUMING=1; fi

RUN_DIR=$(new_run_dir m7c)
RUN_INFO="$RUN_DIR/run.info"
SMOKE_CMD=("${LAUNCH[@]}" "$SMOKE_CONFIG" "--train.out_dir=$RUN_DIR/smoke" "--train.steps=$SMOKE_STEPS"
  "--train.resume=none" "${SMOKE_EXTRA[@]}")

{
  echo "# M7C run record (scripts/train_m7c_prime.sh); key: value lines"
  kv run_dir "$RUN_DIR"
  kv started "$(now_iso)"
  kv host "$(hostname 2>/dev/null || echo unknown)"
  kv config "$CONFIG"
  kv config_reason "$CONFIG_REASON"
  kv config_sha256 "$(sha256sum "$CONFIG" | cut -d' ' -f1)"
  kv out_dir "$OUT_DIR"
  kv steps "$CFG_STEPS"
  kv data_source "$CFG_SOURCE"
  kv gpu_count "$GPU_COUNT"
  kv gpus "$(gpu_summary)"
  kv max_vram_mib "$GPU_MAX_MIB"
  kv nproc "$NPROC"
  kv git_sha "$(git_sha)"
  kv git_branch "$(git_branch)"
  kv git_dirty "$(git_dirty)"
  kv torch "$(torch_version)"
  kv python "$(python_version)"
  kv resume_from "$RESUME_FROM"
  printf '%s\n' "$START_LINES" | sed -n 's/^resume: keeping/batch_split: keeping/p'
  kv smoke_cmd "$(quote_cmd "${SMOKE_CMD[@]}")"
  kv train_cmd "$(quote_cmd "${TRAIN_CMD[@]}")"
  env_snapshot | sed 's/^/env: /'
} >"$RUN_INFO"

log "run dir: $RUN_DIR"
log "config: $CONFIG ($CONFIG_REASON)"
log "out_dir: $OUT_DIR | resume: $RESUME_FROM"
while IFS= read -r line; do
  case "$line" in "resume: keeping"* | "resume: note"* | *"global batch"*) log "$line" ;; esac
done <<<"$START_LINES"
log "gpus: $GPU_COUNT | launch: $(quote_cmd "${TRAIN_CMD[@]}")"

finish() {
  info "$RUN_INFO" end "$(now_iso)"
  info "$RUN_INFO" exit_code "$1"
  if [ -n "${2:-}" ]; then info "$RUN_INFO" failure "$2"; fi
}

# ---- smoke: once per out_dir (a resume found a checkpoint, so the stack trained here before) -------
if [ "$SMOKE_STEPS" -gt 0 ] && [ "$RESUMING" = 1 ]; then
  info "$RUN_INFO" smoke "skipped (resuming: this out_dir trained before)"
  log "smoke: skipped (resuming from a checkpoint of this out_dir)"
elif [ "$SMOKE_STEPS" -gt 0 ]; then
  log "smoke: $SMOKE_STEPS synthetic steps of $SMOKE_CONFIG -> $RUN_DIR/smoke.log"
  info "$RUN_INFO" smoke_start "$(now_iso)"
  smoke_rc=0
  "${SMOKE_CMD[@]}" 2>&1 | log_to "$RUN_DIR/smoke.log" >/dev/null || smoke_rc=$?
  smoke_status=$(metrics_field "$RUN_DIR/smoke" status)
  if [ "$smoke_rc" -ne 0 ] || [ "$smoke_status" != finished ]; then
    tail -n 5 "$RUN_DIR/smoke.log" >&2 || true
    info "$RUN_INFO" smoke "FAILED (exit $smoke_rc, status ${smoke_status:-none})"
    finish 1 "smoke test failed"
    die "smoke test failed (exit $smoke_rc, status ${smoke_status:-none}): see $RUN_DIR/smoke.log; training not started"
  fi
  rm -f "$RUN_DIR"/smoke/checkpoint_step*.pt "$RUN_DIR/smoke/latest.pt"  # weights of a smoke are noise
  info "$RUN_INFO" smoke "ok ($SMOKE_STEPS steps, last loss $(metrics_field "$RUN_DIR/smoke" last_loss))"
  log "smoke: ok"
else
  info "$RUN_INFO" smoke "skipped (SMOKE_STEPS=0)"
  log "smoke: skipped (SMOKE_STEPS=0)"
fi

# ---- training ------------------------------------------------------------------------------------
info "$RUN_INFO" train_start "$(now_iso)"
log "training -> $RUN_DIR/train.log (stop gracefully: touch $OUT_DIR/.HALT or Ctrl-C)"
run_training_through_outages "$RUN_DIR" "$OUT_DIR" "$RUN_INFO"
train_rc=$TRAIN_RC
case "$train_rc" in
  0)
    finish 0
    log "done: $(metrics_field "$OUT_DIR" status) at step $(metrics_field "$OUT_DIR" step); run record $RUN_INFO"
    ;;
  4)  # a full disk: not relaunched (it would fail again); the checkpoints before it are intact
    finish 4 "a file could not be written: $(write_failure_line "$RUN_DIR")"
    die "training stopped: a file could not be written ($(write_failure_line "$RUN_DIR")); free disk space, then rerun the same command to resume" 4
    ;;
  75)  # the data stayed unreachable through DATA_OUTAGE_RESUMES resumes; the checkpoint of the last stop is intact
    finish 75 "data outage: $(data_outage_line "$RUN_DIR")"
    die "training stopped: the data stayed unreachable ($(data_outage_line "$RUN_DIR")) through ${DATA_OUTAGE_RESUMES:-6} resumes; rerun the same command to resume from $(newest_checkpoint "$OUT_DIR")" 75
    ;;
  3)
    finish 3 "anomaly halt: $(cat "$OUT_DIR/.anomaly_type" 2>/dev/null || echo see train.log)"
    die "training halted on an anomaly ($(cat "$OUT_DIR/.anomaly_type" 2>/dev/null || echo see train.log)); last good checkpoint kept in $OUT_DIR" 3
    ;;
  *)
    status_line=$(sed -n 's/^final_status: //p' "$RUN_INFO" | tail -n 1)
    finish "$train_rc" "trainer exited $train_rc"
    drop_lock_only_out_dir "$OUT_DIR" "$OUT_DIR_EXISTED"
    ckpt=$(newest_checkpoint "$OUT_DIR")
    die "training ${status_line:-failed (exit $train_rc)}: see $RUN_DIR/train.log; ${ckpt:+rerun the same command to resume from $ckpt}${ckpt:-no checkpoint yet: a rerun starts fresh}" "$train_rc"
    ;;
esac
