#!/usr/bin/env bash
# Extension cost on the recall task (docs/NSA.md "Extending to 4x the training length"): seq-64 checkpoints of each
# arm continue at seq 256 (4x), scored for recall at 256 (1x of the new length) and 512 (2x) every SAVE_EVERY steps.
#   bash bench/extension_cost.sh artifacts/recall_nsa_w8 artifacts/recall_dense_w8      # run dirs of seq-64 runs
# Knobs: DATA (the seq-256 corpus, written once), OUT (where the runs go), STEPS, SAVE_EVERY, LR, DOCUMENTS, PY.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DATA=${DATA:-data/recall_w8_256}
OUT=${OUT:-artifacts}
STEPS=${STEPS:-600}
SAVE_EVERY=${SAVE_EVERY:-100}
LR=${LR:-1e-3}
DOCUMENTS=${DOCUMENTS:-256}
[ "$#" -ge 1 ] || { echo "usage: bash bench/extension_cost.sh RUN_DIR [RUN_DIR ...]" >&2; exit 2; }
[ -f "$DATA/meta.json" ] || "$PY" -m train.recall make --out "$DATA" --window 8 --seq_len 256 --max_windows 32 \
  --loss_on answers --train_tokens 8000000
for run in "$@"; do
  out="$OUT/ext256_$(basename "$run")"
  # the same batch of 32 x 256 tokens per step as the seq-64 runs' 128 x 64; a fresh optimizer and schedule
  [ -f "$out/checkpoint_step$STEPS.pt" ] || "$PY" -m train "$run/config.yaml" --train.extend_from="$run" \
    --train.out_dir="$out" --data.source="bin:$DATA" --train.seq_len=256 --model.max_seq_len=256 \
    --train.batch_size=32 --train.steps="$STEPS" --train.stop_after=0 --train.warmup_steps=50 --train.lr="$LR" \
    --train.save_every="$SAVE_EVERY" --train.keep_all_checkpoints=true --train.eval_every=0 --train.log_every=50
  for ((s = SAVE_EVERY; s <= STEPS; s += SAVE_EVERY)); do
    [ -f "$out/recall_step${s}_x2.json" ] || "$PY" -m train.recall score "$out/checkpoint_step$s.pt" \
      --documents "$DOCUMENTS" --lengths 1 2 > /dev/null
  done
  echo "$out: recall_step<N>.json (256 tokens) and recall_step<N>_x2.json (512)"
done
