#!/usr/bin/env bash
# Launch the M7C production run (configs/m7c_125m_2xa100_production.yaml) with torchrun over every
# visible GPU. Called by scripts/production_50k_launch.sh after its pre-flight (PREFLIGHT_DONE=<run
# dir>); run directly (the 50K launch plan, "Option B") it does the same pre-flight itself first.
#
#   bash scripts/run_2xa100_production.sh
#
# Writes launch_info.txt (git SHA, environment, config sha256, command) and train.log into the run
# dir, auto-resumes from the newest checkpoint of the out_dir. Knobs: scripts/lib/production.sh.
set -euo pipefail

SCRIPT_TAG=run_2xa100
HERE=$(dirname "${BASH_SOURCE[0]}")
# shellcheck source=scripts/lib/common.sh
source "$HERE/lib/common.sh"
# shellcheck source=scripts/lib/env_overrides.sh
source "$HERE/lib/env_overrides.sh"
# shellcheck source=scripts/lib/production.sh
source "$HERE/lib/production.sh"
cd_repo

prod_setup
if [ -n "${PREFLIGHT_DONE:-}" ]; then
  prod_load_preflight "$PREFLIGHT_DONE"
else
  log "pre-flight (run directly; production_50k_launch.sh does this for you)"
  prod_preflight
fi
prod_launch
