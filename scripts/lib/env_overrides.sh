# shellcheck shell=bash
# the source guides' environment knobs as trainer config overrides, for the launch commands and the run
# records. The table itself lives in ONE place, the trainer's train/core/env.py (`python -m train.env`
# prints what the environment implies; the trainer applies the same table when it starts):
#
#   NSA_DDP_COMPRESS=none|bf16|fp16   -> --runtime.ddp_compress=VALUE   (DDP gradient compression)
#   NSA_DDP_BUCKET_MB=N               -> --runtime.ddp_bucket_mb=N      (DDP bucket size, MB)
#   NSA_DDP_DISABLE_GC=1              -> --runtime.disable_gc=true      (Python GC off in the trainer)
#   NSA_NVTX=1                        -> --runtime.nvtx=true            (NVTX ranges for nsys)
#   NSA_SDPA_AUDIT=1                  -> --runtime.sdpa_audit=true      (log the attention kernels once)
#   NSA_PREFILL_BATCHED, NSA_SEL_RANGES_V2: accepted, not needed (the batched / vectorised NSA
#     path is the only one): a one-line note on stderr.
# NCCL_* variables are not config: NCCL reads them from the environment, so they pass through.
#
# Usage: read_overrides ARRAY   (needs PY; exits 1 with a one-line message on a bad value)

# nsa_env_overrides: one override per line on stdout, notes on stderr (once per launch:
# production_50k_launch.sh hands over to run_2xa100_production.sh with NSA_ENV_NOTES_SHOWN=1)
nsa_env_overrides() {
  if ! env | grep -q '^NSA_'; then
    return 0  # no knob set: nothing to ask
  fi
  local out err rc=0
  err=$(mktemp)
  out=$("${PY:-.venv/bin/python}" -m train.env 2>"$err") || rc=$?
  if [ "$rc" -ne 0 ]; then
    printf '[%s] error: %s\n' "${SCRIPT_TAG:-env}" "$(grep -v '^[[:space:]]' "$err" | tail -n 1 | sed 's/^[A-Za-z_.]*Error: //')" >&2
    rm -f "$err"
    return 1
  fi
  if [ -z "${NSA_ENV_NOTES_SHOWN:-}" ]; then
    sed "s/^/[${SCRIPT_TAG:-env}] /" "$err" >&2
  fi
  rm -f "$err"
  local -a words=()
  read -r -a words <<<"$out" || true
  if [ "${#words[@]}" -gt 0 ]; then printf '%s\n' "${words[@]}"; fi
}

# read_overrides VAR: runs nsa_env_overrides and stores its lines in the array named VAR.
# Exits the script (code 1) when a knob has a bad value.
read_overrides() {
  local __out
  __out=$(nsa_env_overrides) || exit 1
  local -n __dest=$1
  __dest=()
  if [ -n "$__out" ]; then
    mapfile -t __dest <<<"$__out"
  fi
}

# export_nccl_defaults: the M7C runbook's NCCL settings for SSH single-node runs; the caller's environment wins.
export_nccl_defaults() {
  export NCCL_P2P_DISABLE="${NCCL_P2P_DISABLE:-1}"
  export NCCL_IB_DISABLE="${NCCL_IB_DISABLE:-1}"
  export TORCH_NCCL_BLOCKING_WAIT="${TORCH_NCCL_BLOCKING_WAIT:-1}"
  export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
  export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
}

# export_production_defaults: the 50K launch plan's production environment (2x A100 PCIe); the caller's wins.
export_production_defaults() {
  export NSA_DDP_COMPRESS="${NSA_DDP_COMPRESS:-bf16}"
  export NSA_DDP_BUCKET_MB="${NSA_DDP_BUCKET_MB:-25}"
  export NCCL_ALGO="${NCCL_ALGO:-Ring}"
  export NCCL_PROTO="${NCCL_PROTO:-Simple}"
  export NCCL_IB_DISABLE="${NCCL_IB_DISABLE:-1}"
  export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
  export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
}
