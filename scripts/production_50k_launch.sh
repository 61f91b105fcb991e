#!/usr/bin/env bash
# Production 50k-step launch (the 50K launch plan), the recommended path:
#
#   tmux new -s prod50k
#   bash scripts/production_50k_launch.sh
#
# 1. the 50K launch plan's environment, each value overridable by the caller: NSA_DDP_COMPRESS=bf16,
#    NSA_DDP_BUCKET_MB=25, NCCL_ALGO=Ring, NCCL_PROTO=Simple, NCCL_IB_DISABLE=1, NCCL_DEBUG=WARN,
#    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (NSA_* knobs -> config: scripts/lib/env_overrides.sh);
# 2. pre-flight into artifacts/train_runs/m7c_prod50k_<timestamp>/: GPUs idle (busy GPUs are
#    reported, never killed), the NSA correctness suite (scripts/run_gpu_causality_test.sh),
#    config assertions (bf16, save_every > 0, 50000 steps), free disk for the kept checkpoints;
# 3. scripts/run_2xa100_production.sh: launch_info.txt, then torchrun over every GPU with
#    configs/m7c_125m_2xa100_production.yaml (auto-resume from the newest checkpoint).
# Knobs: see scripts/lib/production.sh (DRY_RUN=1 = pre-flight only). Exit: 0 ok, 1 pre-flight
# failure, 2 bad config, 3 anomaly halt, 4 a file could not be written (full disk), else the trainer's code.
set -euo pipefail

SCRIPT_TAG=prod50k
HERE=$(dirname "${BASH_SOURCE[0]}")
# shellcheck source=scripts/lib/common.sh
source "$HERE/lib/common.sh"
# shellcheck source=scripts/lib/env_overrides.sh
source "$HERE/lib/env_overrides.sh"
# shellcheck source=scripts/lib/production.sh
source "$HERE/lib/production.sh"
cd_repo

prod_setup
log "production 50k launch: $CONFIG on $GPU_COUNT GPU(s)"
prod_preflight
PREFLIGHT_DONE="$RUN_DIR" NSA_ENV_NOTES_SHOWN=1 exec bash scripts/run_2xa100_production.sh
