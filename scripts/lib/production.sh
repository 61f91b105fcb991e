# shellcheck shell=bash
# Production launch (the 50K launch plan) shared by scripts/production_50k_launch.sh and
# scripts/run_2xa100_production.sh: set-up, pre-flight and the torchrun launch.
#
# Knobs (environment):
#   CONFIG=configs/m7c_125m_2xa100_production.yaml   the production config
#   EXPECT_STEPS=50000        the step count the config must have (assertion)
#   EXTRA_ARGS="--k=v ..."    overrides appended to the launch (after the NSA_* env overrides)
#   SKIP_CAUSALITY=1          skip the NSA correctness suite (tests; never for a real launch)
#   CAUSALITY_SCRIPT=scripts/run_gpu_causality_test.sh, CAUSALITY_ARGS=""   the suite and its args
#   ALLOW_BUSY_GPUS=1         launch although other processes hold GPU memory (reported, never killed)
#   IDLE_MEM_MIB=1024         a GPU using more memory than this counts as busy
#   DRY_RUN=1                 run every pre-flight check and write launch_info.txt, but do not launch
#   ARTIFACTS_DIR, NVIDIA_SMI, VENV, NSA_DDP_*, NCCL_*        as in scripts/train_m7c_prime.sh
#
# Layout: artifacts/train_runs/m7c_prod50k_<timestamp>/ holds run.info (read by the monitor and
# handoff), launch_info.txt (the audit record), preflight.log, causality.log and train.log.

prod_log() {
  log "$@"
  if [ -n "${RUN_DIR:-}" ]; then printf '%s\n' "$*" >>"$RUN_DIR/preflight.log"; fi
}

prod_fail() {
  if [ -n "${RUN_DIR:-}" ]; then
    printf 'FAILED: %s\n' "$1" >>"$RUN_DIR/preflight.log"
    info "$RUN_DIR/run.info" preflight "FAILED: $1"
    info "$RUN_DIR/run.info" end "$(now_iso)"
    info "$RUN_DIR/run.info" exit_code "${2:-1}"
  fi
  die "$1" "${2:-1}"
}

# prod_setup: venv, environment defaults, GPUs, config and launch command (no side effects on disk)
prod_setup() {
  require_venv
  export_production_defaults
  export PYTHONUNBUFFERED=1
  ARTIFACTS_DIR=${ARTIFACTS_DIR:-artifacts}
  CONFIG=${CONFIG:-configs/m7c_125m_2xa100_production.yaml}
  EXPECT_STEPS=${EXPECT_STEPS:-50000}
  [ -f "$CONFIG" ] || die "config $CONFIG not found"
  detect_gpus
  [ "$GPU_COUNT" -ge 1 ] || die "no NVIDIA GPU visible (${NVIDIA_SMI:-nvidia-smi}): the production run needs GPUs; for CPU use bash scripts/train_m7c_prime.sh"
  NPROC=$GPU_COUNT
  # torchrun over every visible GPU (also for one: same code path, same environment)
  torchrun_launch "$NPROC"
  read_overrides ENV_ARGS
  mapfile -t EXTRA < <(split_words "${EXTRA_ARGS:-}")
  OVERRIDES=("${ENV_ARGS[@]}" "${EXTRA[@]}")
  TRAIN_CMD=("${LAUNCH[@]}" "$CONFIG" "${OVERRIDES[@]}")
}

# prod_gpus_idle: report what runs on the GPUs; busy GPUs stop the launch (nothing is ever killed)
prod_gpus_idle() {
  local apps status busy=0 line idx used
  local idle_mib=${IDLE_MEM_MIB:-1024}
  apps=$("$NVIDIA_SMI" --query-compute-apps=gpu_uuid,pid,process_name,used_memory --format=csv,noheader,nounits 2>/dev/null || true)
  status=$("$NVIDIA_SMI" --query-gpu=index,name,memory.used,memory.total,utilization.gpu --format=csv,noheader,nounits 2>/dev/null || true)
  if [ -n "$status" ]; then
    while IFS= read -r line; do
      [ -n "${line//[[:space:]]/}" ] || continue
      prod_log "gpu status: $line (index, name, MiB used, MiB total, util %)"
      idx=$(printf '%s' "$line" | cut -d, -f1 | tr -d ' ')
      used=$(printf '%s' "$line" | cut -d, -f3 | tr -d ' ')
      if [[ "$used" =~ ^[0-9]+$ ]] && [ "$used" -gt "$idle_mib" ]; then
        prod_log "gpu $idx busy: ${used} MiB in use (> IDLE_MEM_MIB=$idle_mib)"
        busy=1
      fi
    done <<<"$status"
  fi
  if [ -n "${apps//[[:space:]]/}" ]; then
    busy=1
    while IFS= read -r line; do
      [ -n "${line//[[:space:]]/}" ] || continue
      prod_log "gpu process: $line (gpu uuid, pid, name, MiB)"
    done <<<"$apps"
  fi
  if [ "$busy" = 1 ]; then
    if [ "${ALLOW_BUSY_GPUS:-0}" = 1 ]; then
      prod_log "GPUs are not idle; continuing because ALLOW_BUSY_GPUS=1"
    else
      prod_fail "GPUs are not idle (see the processes above): stop them yourself (kill PID) and retry; this script never kills anything (ALLOW_BUSY_GPUS=1 to launch anyway)"
    fi
  else
    prod_log "gpus idle: $GPU_COUNT GPU(s), no compute processes"
  fi
}

# prod_causality: the NSA correctness suite must pass before hours of GPU time are spent
prod_causality() {
  if [ "${SKIP_CAUSALITY:-0}" = 1 ]; then
    CAUSALITY_RESULT="skipped (SKIP_CAUSALITY=1)"
    prod_log "causality: $CAUSALITY_RESULT"
    return 0
  fi
  local script=${CAUSALITY_SCRIPT:-scripts/run_gpu_causality_test.sh} rc=0
  [ -f "$script" ] || prod_fail "NSA correctness suite $script not found (SKIP_CAUSALITY=1 skips it, for tests only)"
  local -a args=()
  mapfile -t args < <(split_words "${CAUSALITY_ARGS:-}")
  prod_log "causality: bash $script ${args[*]} -> $RUN_DIR/causality.log"
  bash "$script" "${args[@]}" 2>&1 | log_to "$RUN_DIR/causality.log" || rc=$?
  CAUSALITY_RESULT=$(grep -E '^causality: [0-9]+/[0-9]+ passed' "$RUN_DIR/causality.log" | tail -n 1 || true)
  CAUSALITY_RESULT=${CAUSALITY_RESULT:-"no summary line"}
  if [ "$rc" -ne 0 ]; then
    prod_fail "NSA correctness suite failed (exit $rc, $CAUSALITY_RESULT): see $RUN_DIR/causality.log"
  fi
  prod_log "causality: ok ($CAUSALITY_RESULT)"
}

# prod_config_checks: precision bf16, periodic checkpoints, the expected step count, and disk space
# for the checkpoints kept (params x 4 bytes x 3: weights + AdamW's two moments, fp32).
prod_config_checks() {
  config_facts --params "$CONFIG" "${OVERRIDES[@]}"
  OUT_DIR=$CFG_OUT_DIR
  local problems=()
  [ "$CFG_PRECISION" = bf16 ] || problems+=("runtime.precision=$CFG_PRECISION (expected bf16)")
  [ "$CFG_SAVE_EVERY" -gt 0 ] || problems+=("train.save_every=$CFG_SAVE_EVERY (expected > 0: periodic checkpoints)")
  [ "$CFG_STEPS" = "$EXPECT_STEPS" ] || problems+=("train.steps=$CFG_STEPS (expected $EXPECT_STEPS; set EXPECT_STEPS to change)")
  if [ "${#problems[@]}" -gt 0 ]; then
    local IFS=';'
    prod_fail "config assertions failed for $CONFIG: ${problems[*]}"
  fi
  prod_log "config: $CONFIG | precision bf16 | steps $CFG_STEPS | save_every $CFG_SAVE_EVERY | out_dir $OUT_DIR"

  CKPT_BYTES=$((CFG_PARAMS * 4 * 3))
  local kept existing need_n
  if [ "$CFG_KEEP_ALL" = 1 ]; then
    kept=$(((CFG_STEPS + CFG_SAVE_EVERY - 1) / CFG_SAVE_EVERY + 1))
  else
    kept=$CFG_KEEP_LAST
  fi
  existing=$(count_checkpoints "$OUT_DIR")
  need_n=$((kept + 1 - existing))  # +1: the atomic write's temporary file next to the kept ones
  [ "$need_n" -ge 1 ] || need_n=1
  DISK_NEED_BYTES=$((CKPT_BYTES * need_n))
  local probe=$OUT_DIR
  while [ ! -d "$probe" ]; do probe=$(dirname "$probe"); done
  DISK_FREE_BYTES=$(($(df -Pk "$probe" | awk 'NR == 2 { print $4 }') * 1024))
  local fmt_need fmt_free fmt_ckpt
  fmt_ckpt=$(awk -v b="$CKPT_BYTES" 'BEGIN { printf "%.2f GB", b / 1e9 }')
  fmt_need=$(awk -v b="$DISK_NEED_BYTES" 'BEGIN { printf "%.2f GB", b / 1e9 }')
  fmt_free=$(awk -v b="$DISK_FREE_BYTES" 'BEGIN { printf "%.2f GB", b / 1e9 }')
  DISK_NOTE="params $CFG_PARAMS | checkpoint ~$fmt_ckpt | keep $kept (+1 temporary, $existing present) | need $fmt_need | free $fmt_free"
  if [ "$DISK_FREE_BYTES" -lt "$DISK_NEED_BYTES" ]; then
    prod_fail "not enough disk for checkpoints in $OUT_DIR: $DISK_NOTE"
  fi
  prod_log "disk: $DISK_NOTE"
}

# _prod_exit: any exit during pre-flight that prod_fail did not record (e.g. a bad config, exit 2)
_prod_exit() {
  local rc=$?
  if [ "$rc" -ne 0 ] && [ -n "${RUN_DIR:-}" ] && ! grep -q '^exit_code: ' "$RUN_DIR/run.info" 2>/dev/null; then
    info "$RUN_DIR/run.info" preflight "FAILED (exit $rc; see the launcher's output)"
    info "$RUN_DIR/run.info" end "$(now_iso)"
    info "$RUN_DIR/run.info" exit_code "$rc"
  fi
}

# prod_preflight: the whole pre-flight into a fresh run dir; sets RUN_DIR, OUT_DIR and friends
prod_preflight() {
  RUN_DIR=$(new_run_dir m7c_prod50k)
  trap _prod_exit EXIT
  {
    echo "# M7C production run record (scripts/lib/production.sh); key: value lines"
    kv run_dir "$RUN_DIR"
    kv started "$(now_iso)"
    kv config "$CONFIG"
    kv gpu_count "$GPU_COUNT"
    kv gpus "$(gpu_summary)"
    kv max_vram_mib "$GPU_MAX_MIB"
    kv nproc "$NPROC"
  } >"$RUN_DIR/run.info"
  : >"$RUN_DIR/preflight.log"
  prod_log "run dir: $RUN_DIR"
  prod_log "gpus: $GPU_COUNT | $(gpu_summary)"
  if [ $((GPU_MAX_MIB * 1048576)) -lt 75000000000 ]; then
    prod_log "note: the production config is sized for 80 GB GPUs; this machine's largest has $(mib_to_gb "$GPU_MAX_MIB") GB"
  fi
  prod_gpus_idle
  prod_causality
  prod_config_checks
  run_start_checks "$CONFIG" "$(( NPROC > 1 ? NPROC : 1 ))" "${OVERRIDES[@]}"  # the trainer's own checks
  if [ -n "$START_PROBLEM" ]; then prod_fail "$START_PROBLEM" 2; fi
  printf '%s\n' "$START_LINES" >>"$RUN_DIR/preflight.log"
  RESUME_FROM=$(resume_note "$OUT_DIR" "$CFG_RESUME")
  {
    kv out_dir "$OUT_DIR"
    kv steps "$CFG_STEPS"
    kv data_source "$CFG_SOURCE"
    kv resume_from "$RESUME_FROM"
    kv causality "$CAUSALITY_RESULT"
    kv disk "$DISK_NOTE"
    kv preflight ok
  } >>"$RUN_DIR/run.info"
  prod_log "pre-flight ok | resume: $RESUME_FROM"
  trap - EXIT
}

# prod_load_preflight DIR: reuse a run dir whose pre-flight passed (production_50k_launch.sh)
prod_load_preflight() {
  RUN_DIR=$1
  grep -q '^preflight: ok$' "$RUN_DIR/run.info" 2>/dev/null || die "PREFLIGHT_DONE=$RUN_DIR: no passed pre-flight recorded in its run.info"
  OUT_DIR=$(sed -n 's/^out_dir: //p' "$RUN_DIR/run.info" | tail -n 1)
  RESUME_FROM=$(sed -n 's/^resume_from: //p' "$RUN_DIR/run.info" | tail -n 1)
  CAUSALITY_RESULT=$(sed -n 's/^causality: //p' "$RUN_DIR/run.info" | tail -n 1)
  DISK_NOTE=$(sed -n 's/^disk: //p' "$RUN_DIR/run.info" | tail -n 1)
  [ -n "$OUT_DIR" ] || die "PREFLIGHT_DONE=$RUN_DIR: run.info names no out_dir"
}

# prod_launch: launch_info.txt, then torchrun (unless DRY_RUN=1) with train.log
prod_launch() {
  local cmd_line
  cmd_line=$(quote_cmd "${TRAIN_CMD[@]}")
  {
    echo "# launch record (the 50K launch plan production run)"
    kv launched "$(now_iso)"
    kv host "$(hostname 2>/dev/null || echo unknown)"
    kv git_sha "$(git_sha)"
    kv git_branch "$(git_branch)"
    kv git_dirty "$(git_dirty)"
    kv torch "$(torch_version)"
    kv python "$(python_version)"
    kv config "$CONFIG"
    kv config_sha256 "$(sha256sum "$CONFIG" | cut -d' ' -f1)"
    kv overrides "${OVERRIDES[*]}"
    kv out_dir "$OUT_DIR"
    kv resume_from "$RESUME_FROM"
    kv gpus "$GPU_COUNT x $(gpu_summary)"
    kv nproc_per_node "$NPROC"
    kv causality "$CAUSALITY_RESULT"
    kv disk "$DISK_NOTE"
    kv command "$cmd_line"
    echo "# environment"
    env_snapshot
  } >"$RUN_DIR/launch_info.txt"
  info "$RUN_DIR/run.info" train_cmd "$cmd_line"
  log "launch_info: $RUN_DIR/launch_info.txt"
  log "launch: $cmd_line"
  if [ "${DRY_RUN:-0}" = 1 ]; then
    info "$RUN_DIR/run.info" dry_run "yes: pre-flight only, nothing launched"
    log "DRY_RUN=1: pre-flight passed; not launching"
    return 0
  fi
  lock_out_dir "$OUT_DIR"
  info "$RUN_DIR/run.info" train_start "$(now_iso)"
  log "training -> $RUN_DIR/train.log | monitor: bash scripts/monitor_production_50k.sh | stop: touch $OUT_DIR/.HALT"
  run_training_through_outages "$RUN_DIR" "$OUT_DIR" "$RUN_DIR/run.info"
  local rc=$TRAIN_RC
  info "$RUN_DIR/run.info" end "$(now_iso)"
  info "$RUN_DIR/run.info" exit_code "$rc"
  if [ "$rc" -eq 3 ]; then
    die "training halted on an anomaly ($(cat "$OUT_DIR/.anomaly_type" 2>/dev/null || echo see train.log)); last good checkpoint kept in $OUT_DIR" 3
  elif [ "$rc" -eq 75 ]; then
    die "training stopped: the data stayed unreachable ($(data_outage_line "$RUN_DIR")) through ${DATA_OUTAGE_RESUMES:-6} resumes; rerun to resume" 75
  elif [ "$rc" -eq 4 ]; then
    die "training stopped: a file could not be written ($(write_failure_line "$RUN_DIR")); free disk space, then rerun to resume" 4
  elif [ "$rc" -ne 0 ]; then
    die "training $(sed -n 's/^final_status: //p' "$RUN_DIR/run.info" | tail -n 1): see $RUN_DIR/train.log" "$rc"
  fi
  log "done: $(metrics_field "$OUT_DIR" status) at step $(metrics_field "$OUT_DIR" step)"
}
