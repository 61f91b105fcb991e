#!/usr/bin/env bash
# The M7C pilot's report (the M7C training runbook; docs/NSA.md "The M7C pilot"): NSA at M7C scale against its
# dense twin and its window-only control on FineWeb-Edu, one command from a bootstrapped checkout. In tmux:
#
#   tmux new -s pilot
#   bash scripts/pilot_m7c.sh
#
# What it does:
#   1. requires .venv (bash scripts/prime_bootstrap.sh), exports the M7C runbook's NCCL defaults;
#   2. picks the M7C config from the largest GPU's memory as scripts/train_m7c_prime.sh does (no GPU: refused
#      unless CONFIG is set: the pilot trains three 125M models);
#   3. prepares FineWeb-Edu once (PILOT_DOCS documents, GPT-2 tokens) into PILOT_DATA with train.data.prepare,
#      unless PILOT_DATA already holds a prepared directory (its meta.json);
#   4. writes the recall corpus once (python -m train.recall make: prose lines, GPT-2 tokens, the config's nsa.w and
#      train.seq_len, PILOT_RECALL_TOKENS training tokens) into PILOT_RECALL, unless it is there already;
#   5. runs python -m train.compare CONFIG --out PILOT_OUT: the three arms train on the same tokens (one after the
#      other on one GPU; side by side, one GPU each, on two or more) from the data mixture FineWeb-Edu (weight
#      1 - PILOT_RECALL_WEIGHT) + recall documents (PILOT_RECALL_WEIGHT; docs/NSA.md "The M7C pilot" says why 0.1),
#      then each is scored on the whole validation split of each source, on the recall probe it trained for
#      (prose lines), on the needle test at 1, 2 and 4 times the training length (--needle) and on the downstream
#      tasks (--tasks). PILOT_OUT/report.md and report.json hold loss per source, retrieval, selection health over
#      training, task scores and tokens/s for every arm. PILOT_RECALL_WEIGHT= (empty) trains on FineWeb-Edu alone
#      and probes recall zero-shot.
# The same command again resumes the unfinished arms, reuses every finished score and rewrites the report.
# Exit status: 0 done; 2 bad input (nothing written); otherwise train.data.prepare's or train.compare's.
#
# Knobs (environment):
#   CONFIG=path.yaml           force an NSA config instead of choosing by VRAM
#   PILOT_OUT=DIR              the comparison's directory (default $ARTIFACTS_DIR/pilot_m7c)
#   PILOT_DATA=DIR             the prepared FineWeb-Edu directory (default data/fineweb_edu_pilot)
#   PILOT_DOCS=200000          documents to prepare when PILOT_DATA is not prepared yet (~1k tokens each)
#   PILOT_RECALL=DIR           the recall corpus (default data/recall_prose_pilot)
#   PILOT_RECALL_WEIGHT=0.1    its share of the training rows (empty: no recall documents, a zero-shot probe)
#   PILOT_RECALL_TOKENS=20000000  its training tokens when it is written (validation: 1/40 of that)
#   PILOT_STEPS=3000           steps per arm (3000 x 32,768 tokens: ~98M tokens with the M7C configs)
#   PILOT_WARMUP=300           warmup steps (the configs' 2000 are for their 50k-step schedule)
#   PILOT_TASKS=hellaswag,...  downstream tasks (train.tasks spelling); empty: none
#   PILOT_TASKS_LIMIT=500      docs per task (the same seeded subset for every arm)
#   PILOT_NEEDLE=1,2,4         needle context lengths in multiples of train.seq_len; empty: no needle test
#   PILOT_ARMS=nsa,dense,window
#   PILOT_ARGS="--k=v ..."     config overrides for every arm (no spaces inside a value)
#   ARTIFACTS_DIR=artifacts    NVIDIA_SMI=nvidia-smi    VENV=.venv
# A config with train.seq_stages (CONFIG=configs/m7c_125m_long.yaml: 2k, then 8k / 16k / 32k) runs its own schedule:
# PILOT_STEPS and PILOT_WARMUP default to the config's (its stages lie past 3,000 steps); the recall corpus is written
# at the last stage's length (its far buckets reach across the long context), and PILOT_NEEDLE defaults to 1 and 2
# times the last stage's length (in multiples of the first's, as train.compare counts them).
#   DRY_RUN=1                  print the config and the commands, then exit 0
set -euo pipefail

SCRIPT_TAG=pilot_m7c
# shellcheck source=scripts/lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
# shellcheck source=scripts/lib/env_overrides.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/env_overrides.sh"
cd_repo

require_venv
export_nccl_defaults
export PYTHONUNBUFFERED=1

ARTIFACTS_DIR=${ARTIFACTS_DIR:-artifacts}
PILOT_OUT=${PILOT_OUT:-$ARTIFACTS_DIR/pilot_m7c}
PILOT_DATA=${PILOT_DATA:-data/fineweb_edu_pilot}
PILOT_DOCS=${PILOT_DOCS:-200000}
PILOT_RECALL=${PILOT_RECALL:-data/recall_prose_pilot}
PILOT_RECALL_WEIGHT=${PILOT_RECALL_WEIGHT-0.1}
PILOT_RECALL_TOKENS=${PILOT_RECALL_TOKENS:-20000000}
STEPS_GIVEN=${PILOT_STEPS:+1}${PILOT_WARMUP:+1}  # a staged config keeps its own schedule unless these are given
NEEDLE_GIVEN=${PILOT_NEEDLE+1}
PILOT_STEPS=${PILOT_STEPS:-3000}
PILOT_WARMUP=${PILOT_WARMUP:-300}
PILOT_TASKS=${PILOT_TASKS-hellaswag,arc_easy,arc_challenge,piqa,sciq,winogrande}
PILOT_TASKS_LIMIT=${PILOT_TASKS_LIMIT:-500}
PILOT_NEEDLE=${PILOT_NEEDLE-1,2,4}
PILOT_ARMS=${PILOT_ARMS:-nsa,dense,window}
for knob in PILOT_DOCS PILOT_STEPS PILOT_TASKS_LIMIT PILOT_RECALL_TOKENS; do
  [[ "${!knob}" =~ ^[1-9][0-9]*$ ]] || die "$knob=${!knob} must be a positive integer" 2
done
[[ "$PILOT_WARMUP" =~ ^[0-9]+$ ]] || die "PILOT_WARMUP=$PILOT_WARMUP must be a non-negative integer" 2
if [ -n "$PILOT_RECALL_WEIGHT" ]; then
  [[ "$PILOT_RECALL_WEIGHT" =~ ^0?\.[0-9]*[1-9][0-9]*$ ]] \
    || die "PILOT_RECALL_WEIGHT=$PILOT_RECALL_WEIGHT must be a share between 0 and 1 (e.g. 0.1), or empty" 2
fi

detect_gpus
if [ "$GPU_COUNT" -eq 0 ] && [ -z "${CONFIG:-}" ]; then
  die "no GPU found: the pilot trains three 125M models on GPUs; set CONFIG (and PILOT_ARGS) to run it here anyway" 2
fi
select_m7c_config
[ -f "$CONFIG" ] || die "config $CONFIG not found" 2

mapfile -t EXTRA < <(split_words "${PILOT_ARGS:-}")
ARM_OVERRIDES=()  # the arms' config overrides among PILOT_ARGS (--section.key=value), for the recall corpus's geometry
for arg in "${EXTRA[@]}"; do
  if [[ "$arg" == --*.*=* ]]; then ARM_OVERRIDES+=("$arg"); fi
done
PREPARE_CMD=("$PY" -m train.data.prepare --source fineweb_edu --tokenizer gpt2 --out "$PILOT_DATA"
             --max-docs "$PILOT_DOCS")
DATA_ARG="--data.source=bin:$PILOT_DATA"
config_facts "$CONFIG" "${ARM_OVERRIDES[@]}"
SCHEDULE=("--train.steps=$PILOT_STEPS" "--train.warmup_steps=$PILOT_WARMUP")
if [ "$CFG_STAGED" = 1 ]; then  # train.seq_stages: the config's schedule, probes at the last stage's length
  if [ -z "$STEPS_GIVEN" ]; then SCHEDULE=(); fi
  STRETCH=$((CFG_FINAL_SEQ_LEN / CFG_SEQ_LEN))
  if [ -z "$NEEDLE_GIVEN" ]; then PILOT_NEEDLE="$STRETCH,$((2 * STRETCH))"; fi
fi
RECALL_CMD=()
if [ -n "$PILOT_RECALL_WEIGHT" ]; then
  RECALL_CMD=("$PY" -m train.recall make --out "$PILOT_RECALL" --window "$CFG_NSA_W" --seq_len "$CFG_FINAL_SEQ_LEN"
              --max_windows "$((CFG_FINAL_SEQ_LEN / CFG_NSA_W))" --tokenizer gpt2 --format prose --train_tokens "$PILOT_RECALL_TOKENS"
              --val_tokens "$((PILOT_RECALL_TOKENS / 40))")
  WEB_WEIGHT=$(awk -v w="$PILOT_RECALL_WEIGHT" 'BEGIN { printf "%g", 1 - w }')
  DATA_ARG="--data.mixture=[{name: web, source: 'bin:$PILOT_DATA', weight: $WEB_WEIGHT}, {name: recall, source: 'bin:$PILOT_RECALL', weight: $PILOT_RECALL_WEIGHT}]"
fi
COMPARE_CMD=("$PY" -m train.compare "$CONFIG" --out "$PILOT_OUT" --arms "$PILOT_ARMS" "$DATA_ARG"
             "${SCHEDULE[@]}" --recall_probe --recall_format prose)
if [ -n "$PILOT_NEEDLE" ]; then COMPARE_CMD+=(--needle "$PILOT_NEEDLE"); fi
if [ -n "$PILOT_TASKS" ]; then COMPARE_CMD+=(--tasks "$PILOT_TASKS" --tasks_limit "$PILOT_TASKS_LIMIT"); fi
if [ "$GPU_COUNT" -ge 2 ]; then COMPARE_CMD+=(--side_by_side); fi
COMPARE_CMD+=("${EXTRA[@]}")

PREPARED=0
if [ -f "$PILOT_DATA/meta.json" ]; then PREPARED=1; fi
RECALL_READY=0
if [ -f "$PILOT_RECALL/meta.json" ]; then RECALL_READY=1; fi
if [ "${DRY_RUN:-0}" = 1 ]; then
  echo "config: $CONFIG ($CONFIG_REASON)"
  echo "gpus: $GPU_COUNT | $(gpu_summary)"
  if [ "$PREPARED" = 1 ]; then echo "data: $PILOT_DATA (prepared)"; else echo "prepare: $(quote_cmd "${PREPARE_CMD[@]}")"; fi
  if [ "${#RECALL_CMD[@]}" -gt 0 ]; then
    if [ "$RECALL_READY" = 1 ]; then echo "recall: $PILOT_RECALL (written)"; else echo "recall: $(quote_cmd "${RECALL_CMD[@]}")"; fi
  fi
  echo "compare: $(quote_cmd "${COMPARE_CMD[@]}")"
  exit 0
fi

log "config: $CONFIG ($CONFIG_REASON); gpus: $(gpu_summary)"
if [ "$PREPARED" = 0 ]; then
  log "preparing FineWeb-Edu ($PILOT_DOCS documents, GPT-2 tokens) -> $PILOT_DATA"
  "${PREPARE_CMD[@]}"
fi
if [ "${#RECALL_CMD[@]}" -gt 0 ] && [ "$RECALL_READY" = 0 ]; then
  log "writing the recall corpus (prose lines, GPT-2 tokens, $PILOT_RECALL_TOKENS training tokens) -> $PILOT_RECALL"
  "${RECALL_CMD[@]}"
fi
log "comparing -> $PILOT_OUT (report.md, report.json; arms' logs in $PILOT_OUT/logs)"
exec "${COMPARE_CMD[@]}"
