# shellcheck shell=bash
# Shared helpers for the runbook scripts (sourced, never run). Callers set SCRIPT_TAG first and
# `set -euo pipefail`. Everything here works from the repository root (cd_repo).
#
# Knobs read here: VENV (default .venv), NVIDIA_SMI (default nvidia-smi on PATH),
# CUDA_VISIBLE_DEVICES (limits which GPUs count), ARTIFACTS_DIR (default artifacts).

SCRIPT_TAG=${SCRIPT_TAG:-runbook}
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

log() { printf '[%s] %s\n' "$SCRIPT_TAG" "$*"; }
warn() { printf '[%s] warning: %s\n' "$SCRIPT_TAG" "$*" >&2; }
# die MESSAGE [EXIT_CODE]: one line on stderr, then exit (default 1)
die() {
  printf '[%s] error: %s\n' "$SCRIPT_TAG" "$1" >&2
  exit "${2:-1}"
}

cd_repo() { cd "$REPO_ROOT" || die "cannot cd to $REPO_ROOT"; }

# require_venv: sets PY (the venv's python); dies with the set-up hint when the venv is missing.
require_venv() {
  VENV=${VENV:-.venv}
  PY="$VENV/bin/python"
  if [ ! -x "$PY" ]; then
    die "virtual environment '$VENV' not found: run bash scripts/prime_bootstrap.sh"
  fi
}

# any_python: the venv's python when there is one, else python3 (for stdlib-only tools).
any_python() {
  local venv=${VENV:-.venv}
  if [ -x "$venv/bin/python" ]; then
    printf '%s\n' "$venv/bin/python"
  elif command -v python3 >/dev/null 2>&1; then
    command -v python3
  else
    die "no python found (.venv missing and no python3 on PATH): run bash scripts/prime_bootstrap.sh"
  fi
}

now_iso() { date '+%Y-%m-%dT%H:%M:%S%z'; }
now_stamp() { date '+%Y%m%d_%H%M%S'; }

git_sha() { git -C "$REPO_ROOT" rev-parse HEAD 2>/dev/null || echo unknown; }
git_branch() { git -C "$REPO_ROOT" rev-parse --abbrev-ref HEAD 2>/dev/null || echo unknown; }
git_dirty() {
  if [ -n "$(git -C "$REPO_ROOT" status --porcelain --untracked-files=no 2>/dev/null | head -n 1)" ]; then
    echo "yes (uncommitted changes to tracked files)"
  else
    echo no
  fi
}

# torch / python versions without importing torch (fast)
torch_version() {
  "$PY" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || echo unknown
}
python_version() { "$PY" -c 'import platform; print(platform.python_version())' 2>/dev/null || echo unknown; }

# print a command as a copy-pasteable shell line
quote_cmd() {
  local out
  printf -v out '%q ' "$@"
  printf '%s\n' "${out% }"
}

# split_words STRING -> the words, one per line (EXTRA_ARGS / SMOKE_ARGS; values cannot hold spaces)
split_words() {
  local -a words=()
  read -r -a words <<<"${1:-}" || true
  if [ "${#words[@]}" -gt 0 ]; then
    printf '%s\n' "${words[@]}"
  fi
}

# ---- GPUs -------------------------------------------------------------------------------------
# detect_gpus: sets GPU_COUNT, GPU_NAMES[], GPU_MEM_MIB[], GPU_MAX_MIB from
#   $NVIDIA_SMI --query-gpu=name,memory.total --format=csv,noheader,nounits
# honouring CUDA_VISIBLE_DEVICES (numeric indices select rows; other forms only limit the count).
# No nvidia-smi, or one that fails (no driver / no devices), means no GPU.
detect_gpus() {
  NVIDIA_SMI=${NVIDIA_SMI:-nvidia-smi}
  GPU_COUNT=0
  GPU_NAMES=()
  GPU_MEM_MIB=()
  GPU_MAX_MIB=0
  if ! command -v "$NVIDIA_SMI" >/dev/null 2>&1; then
    return 0
  fi
  local out
  if ! out=$("$NVIDIA_SMI" --query-gpu=name,memory.total --format=csv,noheader,nounits 2>/dev/null); then
    warn "$NVIDIA_SMI failed (no driver or no devices): treating this machine as having no GPU"
    return 0
  fi
  local -a names=() mems=()
  local line name mem
  while IFS= read -r line; do
    [ -n "${line//[[:space:]]/}" ] || continue
    name=${line%,*}
    mem=${line##*,}
    mem=${mem//[[:space:]]/}
    name=$(printf '%s' "$name" | sed 's/^[[:space:]]*//; s/[[:space:]]*$//')
    [[ "$mem" =~ ^[0-9]+$ ]] || mem=0
    names+=("$name")
    mems+=("$mem")
  done <<<"$out"

  local -a pick=()
  local i
  if [ "${CUDA_VISIBLE_DEVICES+set}" = set ]; then
    local -a vis=()
    IFS=',' read -r -a vis <<<"$CUDA_VISIBLE_DEVICES" || true
    local numeric=1 v
    for v in "${vis[@]}"; do
      [[ "$v" =~ ^[0-9]+$ ]] || numeric=0
    done
    if [ "${#vis[@]}" -eq 0 ] || [ "${vis[0]}" = "-1" ]; then
      pick=()
    elif [ "$numeric" = 1 ]; then
      for v in "${vis[@]}"; do
        if [ "$v" -lt "${#names[@]}" ]; then pick+=("$v"); fi
      done
    else
      for ((i = 0; i < ${#vis[@]} && i < ${#names[@]}; i++)); do pick+=("$i"); done
    fi
  else
    for ((i = 0; i < ${#names[@]}; i++)); do pick+=("$i"); done
  fi
  for i in "${pick[@]}"; do
    GPU_NAMES+=("${names[$i]}")
    GPU_MEM_MIB+=("${mems[$i]}")
    if [ "${mems[$i]}" -gt "$GPU_MAX_MIB" ]; then GPU_MAX_MIB=${mems[$i]}; fi
  done
  GPU_COUNT=${#GPU_NAMES[@]}
}

# mib_to_gb MIB -> decimal GB with one digit (81920 -> 85.9)
mib_to_gb() { awk -v m="$1" 'BEGIN { printf "%.1f", m * 1048576 / 1e9 }'; }

# gpu_summary -> "2 x NVIDIA A100-SXM4-80GB (81920 MiB = 85.9 GB)" or "none"
gpu_summary() {
  if [ "$GPU_COUNT" -eq 0 ]; then
    echo "none"
    return
  fi
  local i parts=()
  for ((i = 0; i < GPU_COUNT; i++)); do
    parts+=("gpu$i ${GPU_NAMES[$i]} ${GPU_MEM_MIB[$i]} MiB ($(mib_to_gb "${GPU_MEM_MIB[$i]}") GB)")
  done
  local IFS=';'
  printf '%s\n' "${parts[*]}"
}

# select_m7c_config (after detect_gpus): CONFIG from the largest visible GPU's memory unless the caller set it
# (>= 75 GB: m7c_125m_80g, >= 35 GB: m7c_125m_40g, else m7c_125m_24g; no GPU: m7c_cpu), and CONFIG_REASON
# shellcheck disable=SC2034  # CONFIG_REASON is read by the caller
select_m7c_config() {
  if [ -n "${CONFIG:-}" ]; then
    CONFIG_REASON="forced by CONFIG"
  elif [ "$GPU_COUNT" -eq 0 ]; then
    CONFIG=configs/m7c_cpu.yaml
    CONFIG_REASON="no GPU found: CPU config"
  else
    local gb bytes=$((GPU_MAX_MIB * 1048576))
    gb=$(mib_to_gb "$GPU_MAX_MIB")
    if [ "$bytes" -ge 75000000000 ]; then
      CONFIG=configs/m7c_125m_80g.yaml
      CONFIG_REASON="largest GPU ${GPU_MAX_MIB} MiB = ${gb} GB >= 75 GB"
    elif [ "$bytes" -ge 35000000000 ]; then
      CONFIG=configs/m7c_125m_40g.yaml
      CONFIG_REASON="largest GPU ${GPU_MAX_MIB} MiB = ${gb} GB >= 35 GB"
    else
      CONFIG=configs/m7c_125m_24g.yaml
      CONFIG_REASON="largest GPU ${GPU_MAX_MIB} MiB = ${gb} GB < 35 GB"
    fi
  fi
}

# torchrun_launch NPROC -> sets LAUNCH[]: torchrun --standalone over NPROC processes, through train/launch.py, which
# exits with the code the failed ranks agree on (4: a full disk) where torchrun itself would say 1
# shellcheck disable=SC2034  # LAUNCH is read by the caller
torchrun_launch() {
  LAUNCH=("$PY" -m train.launch --standalone "--nproc_per_node=$1" -m train)
}

# launcher_for NPROC -> sets LAUNCH[]: python for 0/1 process, torchrun (torchrun_launch) for more
# shellcheck disable=SC2034  # LAUNCH is read by the caller
launcher_for() {
  if [ "$1" -ge 2 ]; then
    torchrun_launch "$1"
  else
    LAUNCH=("$PY" -m train)
  fi
}

# ---- config facts -----------------------------------------------------------------------------
# config_facts [--params] CONFIG [OVERRIDES...]: loads the effective config (train.core.config.load_config)
# and sets CFG_<KEY> shell variables: CFG_OUT_DIR CFG_STEPS CFG_SAVE_EVERY CFG_KEEP_LAST CFG_KEEP_ALL
# CFG_PRECISION CFG_RESUME CFG_SOURCE CFG_ATTENTION, and with --params CFG_PARAMS (model built on
# the meta device: no memory, no GPU). A bad config exits 2 with the trainer's one-line message.
config_facts() {
  local want_params=0
  if [ "${1:-}" = "--params" ]; then
    want_params=1
    shift
  fi
  local out rc=0
  out=$(NSA_WANT_PARAMS=$want_params "$PY" - "$@" 2>&1 <<'PY'
import os, sys
from train.core.errors import UserError
try:
    from train.core.config import load_config
    cfg = load_config(sys.argv[1], sys.argv[2:])
except UserError as exc:
    print(f"error: {exc}")
    sys.exit(2)
t, r = cfg.train, cfg.runtime
facts = {
    "OUT_DIR": t.out_dir, "STEPS": t.steps, "SAVE_EVERY": t.save_every, "KEEP_LAST": t.keep_last,
    "KEEP_ALL": int(t.keep_all_checkpoints), "PRECISION": r.precision, "RESUME": t.resume,
    "SOURCE": cfg.data.source, "ATTENTION": cfg.model.attention, "SEQ_LEN": t.seq_len, "NSA_W": cfg.model.nsa.w,
    "STAGED": int(bool(t.seq_stages)),  # train.seq_stages: FINAL_SEQ_LEN is the last stage's
    "FINAL_SEQ_LEN": max([t.seq_len, *(int(s["seq_len"]) for s in t.seq_stages or [] if "seq_len" in s)]),
}
if os.environ.get("NSA_WANT_PARAMS") == "1":
    import torch
    from nsa.model import Transformer
    with torch.device("meta"):
        model = Transformer(cfg.model)
    facts["PARAMS"] = sum(p.numel() for p in model.parameters())
for k, v in facts.items():
    print(f"FACT {k}={v}")
PY
) || rc=$?
  if [ "$rc" -ne 0 ]; then
    local msg
    msg=$(printf '%s\n' "$out" | grep -m1 '^error: ' || printf '%s\n' "$out" | tail -n 1)
    die "config $1: ${msg#error: }" 2
  fi
  local line key value
  while IFS= read -r line; do
    case "$line" in
      "FACT "*)
        line=${line#FACT }
        key=${line%%=*}
        value=${line#*=}
        printf -v "CFG_$key" '%s' "$value"
        ;;
    esac
  done <<<"$out"
}

# newest_checkpoint DIR -> path of the newest checkpoint that validates, or nothing (the trainer's
# own rule, asked from train/checkpoint/run_dir.py: a truncated newest file is skipped, as resume=auto does)
newest_checkpoint() {
  [ -d "$1" ] || return 0
  "${PY:-$(any_python)}" -m train.run_dir newest-valid "$1" 2>/dev/null || true
}

count_checkpoints() {  # files named like checkpoints (the name pattern lives in train/core/artifacts.py)
  "${PY:-$(any_python)}" -m train.artifacts count-checkpoints "$1" 2>/dev/null || echo 0
}

# resume_note OUT_DIR RESUME -> what the trainer's train.resume will do (for run.info)
resume_note() {
  local dir=$1 resume=$2 ck
  case "$resume" in
    auto)
      ck=$(newest_checkpoint "$dir")
      if [ -n "$ck" ]; then echo "$ck"; else echo "none (fresh start: no checkpoint in $dir)"; fi
      ;;
    none) echo "none (train.resume=none)" ;;
    *) echo "$resume (train.resume)" ;;
  esac
}

# run_start_checks CONFIG NPROC [OVERRIDES...]: the launch's own start checks, through the trainer's code
# (python -m train.start_checks: stale .HALT, a live trainer on the out_dir, the data source, and for a resume
# the checkpoint's architecture, train.steps, tokenizer and global batch on NPROC ranks). Reads only. Sets
# START_LINES (what the launch will do, one per line) and START_PROBLEM (the launch's one-line refusal, or empty).
# shellcheck disable=SC2034  # START_LINES is read by the caller
run_start_checks() {
  local config=$1 nproc=$2 out rc=0
  shift 2
  START_LINES=""
  START_PROBLEM=""
  out=$("$PY" -m train.start_checks "$config" "$@" --world-size "$nproc" 2>&1) || rc=$?
  if [ "$rc" -ne 0 ]; then
    START_PROBLEM=$(printf '%s\n' "$out" | grep -m1 '^error: ' || printf '%s\n' "$out" | tail -n 1)
    START_PROBLEM=${START_PROBLEM#error: }
  else
    START_LINES=$out
  fi
}

# check_halt OUT_DIR: a leftover .HALT would stop the new run after one step. The message is the
# trainer's own (train/trainer/safety.py stale_halt_message); halt_problem prints it, or nothing.
halt_problem() {
  local msg
  if ! msg=$("${PY:-$(any_python)}" -m train.safety check-halt "$1" 2>&1); then
    printf '%s\n' "${msg#error: }"
  fi
}
check_halt() {
  local msg
  msg=$(halt_problem "$1")
  if [ -n "$msg" ]; then die "$msg" 2; fi
}

# lock_out_dir OUT_DIR: one launcher per out_dir. The lock (fd 9) is inherited by the trainer
# processes and released when the last of them exits, whatever way it exits.
lock_out_dir() {
  mkdir -p "$1" || die "cannot create out_dir $1"
  if ! command -v flock >/dev/null 2>&1; then
    warn "flock not found: cannot guard $1 against a second launcher"
    return 0
  fi
  exec 9>"$1/.launch.lock"
  if ! flock -n 9; then
    die "another launch is running on $1 (lock $1/.launch.lock held): attach to it (tmux attach -t m7c) or stop it first"
  fi
}

# drop_lock_only_out_dir OUT_DIR EXISTED: after a failed start, an out_dir this launch created that holds only
# lock files goes again (it held nothing before and holds nothing of value now)
drop_lock_only_out_dir() {
  local dir=$1 existed=$2 entry
  [ "$existed" = 0 ] && [ -d "$dir" ] || return 0
  for entry in "$dir"/* "$dir"/.[!.]* "$dir"/..?*; do
    [ -e "$entry" ] || continue
    case "${entry##*/}" in .lock | .launch.lock) ;; *) return 0 ;; esac
  done
  rm -f "$dir/.lock" "$dir/.launch.lock"
  rmdir "$dir" 2>/dev/null || true
}

# new_run_dir PREFIX -> creates and prints $ARTIFACTS_DIR/train_runs/PREFIX_<timestamp>[_n]
new_run_dir() {
  local base dir n=1
  base="${ARTIFACTS_DIR:-artifacts}/train_runs/$1_$(now_stamp)"
  mkdir -p "$(dirname "$base")" || die "cannot create $(dirname "$base")"
  dir=$base
  while ! mkdir "$dir" 2>/dev/null; do
    n=$((n + 1))
    dir="${base}_$n"
    [ "$n" -lt 100 ] || die "cannot create a run directory under $(dirname "$base")"
  done
  printf '%s\n' "$dir"
}

# kv KEY VALUE...: print one run.info line "key: value"; info FILE KEY VALUE...: append it to FILE
kv() {
  local key=$1
  shift
  printf '%s: %s\n' "$key" "$*"
}
info() {
  local file=$1
  shift
  kv "$@" >>"$file"
}

# env_snapshot: the environment variables that shape a run, one NAME=value per line
env_snapshot() {
  env | LC_ALL=C sort | grep -E '^(NCCL_|NSA_|TORCH_|PYTORCH_|CUDA_|OMP_|HF_|MASTER_|PYTHONPATH=)' || true
}

# log_to [-a] FILE: tee stdin into FILE, deaf to Ctrl-C and SIGTERM: a stop request reaches the trainer
# (graceful stop), never the log writer, which lives until the trainer closes the pipe (a dead tee
# would break the trainer's console writes before its final checkpoint)
log_to() {
  (trap '' INT TERM; exec tee "$@")
}

# trainer_exit_code CODE: whether CODE is one the trainer itself exits with (train/trainer/runner.py: 2 bad input,
# 3 anomaly, 4 a file could not be written, 75 a data outage), as train/launch.py passes them through
trainer_exit_code() {
  case "$1" in 2|3|4|75) return 0 ;; *) return 1 ;; esac
}

# run_logged_training RUN_DIR OUT_DIR RUN_INFO: run "${TRAIN_CMD[@]}" with its output appended to
# RUN_DIR/train.log, then record this launch's final_step, final_status and last_checkpoint in RUN_INFO
# (statuses: train/observe/run_status.py). A trainer that died without a word (kill -9, OOM) is recorded as
# crashed, in metrics.json too; one that never wrote metrics.json in this launch "failed before training".
# Sets TRAIN_RC to the trainer's exit code, 3 when the run halted on an anomaly, 4 when a file could not be written.
run_logged_training() {
  local run_dir=$1 out_dir=$2 run_info=$3 final_status final_step
  local started updated restarts extended
  TRAIN_RC=0
  started=$(date +%s)
  # a SIGTERM to the whole job (a scheduler's preemption) stops the trainer gracefully; this shell
  # waits for it and records the end instead of dying first
  trap ':' TERM
  "${TRAIN_CMD[@]}" 2>&1 | log_to -a "$run_dir/train.log" || TRAIN_RC=$?
  trap - TERM
  updated=$(metrics_field "$out_dir" updated)
  updated=${updated%%.*}
  if [ "${updated:-0}" -lt "$started" ]; then  # metrics.json (if any) is an earlier launch's
    if [ "$TRAIN_RC" -eq 0 ]; then final_status="exited 0 before training"; else final_status="failed before training (exit $TRAIN_RC)"; fi
    info "$run_info" final_step "none (this launch trained no step)"
    info "$run_info" final_status "$final_status"
    return 0
  fi
  final_status=$(metrics_field "$out_dir" status)
  if [ "$TRAIN_RC" -ne 0 ] && ! trainer_exit_code "$TRAIN_RC"; then
    # not the trainer's own code: torchrun's 1 (ranks that disagree), or a signal the launcher received (128 + N;
    # train/launch.py keeps the code its ranks agree on: 2, 3, 4, 75); the run's own status (written by this launch)
    # says why: anomaly halt, or a graceful stop on SIGTERM/SIGINT
    case "$final_status" in
      anomaly) TRAIN_RC=3 ;;
      write_failed) TRAIN_RC=4 ;;
      stopped)  # a graceful stop, or every rank stopped together on a data outage (exit 75, a checkpoint written)
        if [ "$(metrics_field "$out_dir" stop_reason)" = "data outage" ]; then TRAIN_RC=75; else TRAIN_RC=0; fi ;;
    esac
  fi
  if [ "$TRAIN_RC" -ne 0 ] && [ "$final_status" = running ]; then  # died without a word: crashed; 4: write_failed
    "$PY" -m train.run_status mark-exited "$out_dir" "$TRAIN_RC" >/dev/null || true
  fi
  # the exit code too: a full disk (exit 4, kept under torchrun by train/launch.py) may have kept metrics.json 'running'
  final_status=$("$PY" -m train.run_status describe "$out_dir" --exit-code "$TRAIN_RC" 2>/dev/null || echo "$final_status")
  final_step=$("$PY" -m train.run_status step "$out_dir" 2>/dev/null || metrics_field "$out_dir" step)
  info "$run_info" final_step "$final_step"
  info "$run_info" final_status "$final_status"
  info "$run_info" last_checkpoint "$(newest_checkpoint "$out_dir")"
  extended=$(metrics_field "$out_dir" extended_from)  # train.extend_from: the checkpoint this run continues, longer
  if [ -n "$extended" ]; then info "$run_info" extended_from "$extended"; fi
  restarts=$(metrics_field "$out_dir" data_restarts)  # data.restart_on_change: where the data started afresh
  if [ -n "$restarts" ] && [ "$restarts" != "[]" ]; then info "$run_info" data_restarts "$restarts"; fi
}

# run_training_through_outages RUN_DIR OUT_DIR RUN_INFO: run_logged_training, and after a data outage (TRAIN_RC 75: a
# stream source stayed unreachable past data.retry_max / data.retry_max_s and every rank stopped after the same step
# with a checkpoint) wait DATA_OUTAGE_WAIT_S seconds (default 300) and run the same command again, which resumes from
# that checkpoint; at most DATA_OUTAGE_RESUMES times (default 6; 0: never). Each outage is a data_outage line in
# RUN_INFO. TRAIN_RC as run_logged_training sets it: 75 when the last launch met an outage too.
run_training_through_outages() {
  local run_dir=$1 out_dir=$2 run_info=$3 resumes=0
  local wait_s=${DATA_OUTAGE_WAIT_S:-300} most=${DATA_OUTAGE_RESUMES:-6}
  while :; do
    run_logged_training "$run_dir" "$out_dir" "$run_info"
    [ "$TRAIN_RC" -eq 75 ] || return 0
    if [ "$resumes" -ge "$most" ]; then
      info "$run_info" data_outage "$(data_outage_line "$run_dir"); not resumed: DATA_OUTAGE_RESUMES=$most spent"
      return 0
    fi
    resumes=$((resumes + 1))
    info "$run_info" data_outage "$(data_outage_line "$run_dir"); resume $resumes of $most in ${wait_s}s"
    log "data outage at step $(metrics_field "$out_dir" step): $(data_outage_line "$run_dir"); resuming in ${wait_s}s ($resumes of $most)"
    sleep "$wait_s"
  done
}

# data_outage_line RUN_DIR: the trainer's one line for a data outage, from train.log
data_outage_line() {
  grep -h '^data outage on rank' "$1/train.log" 2>/dev/null | tail -n 1 | sed 's/^data outage on rank [0-9]*: //'
}

# write_failure_line RUN_DIR: the trainer's one line for a file it could not write (exit 4), from train.log
write_failure_line() {
  grep -h '^error: .*could not be written' "$1/train.log" 2>/dev/null | tail -n 1 | sed 's/^error: //'
}

# metrics_field OUT_DIR KEY -> a top-level value of metrics.json (empty when absent; train/core/artifacts.py reads it)
metrics_field() {
  "${PY:-$(any_python)}" -m train.artifacts metrics-field "$1" "$2" 2>/dev/null || true
}
