"""python -m train.import_hf HF_DIR OUT_CKPT

A Hugging Face model directory (GPT-2 / LLaMA / Qwen3: config.json + model.safetensors, or sharded
safetensors) or one of our NSA exports (nsa_config.json + model.safetensors) -> one of our checkpoints.

The checkpoint holds weights only: step 0, an empty optimizer state, no data state, and
`imported_from`. Inference tools (model_from_checkpoint) and `train.init_from=OUT_CKPT` read it;
`train.resume` refuses it (there is no training state to continue). OUT_CKPT is never overwritten.

`init_state_dict` serves `train.init_from` (hf:DIR or one of our checkpoints): the source's
architecture must equal the run's, shapes must match exactly. docs/HF.md.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from train.core.errors import UserError, print_error
from train.hf.importer import import_checkpoint


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.import_hf", description=__doc__.split("\n\n")[1])
    p.add_argument("model_dir", type=Path, help="a Hugging Face model directory, or one of our NSA exports")
    p.add_argument("out_ckpt", type=Path, help="the checkpoint file to write (never overwritten)")
    args = p.parse_args(argv)
    try:
        cfg = import_checkpoint(args.model_dir, args.out_ckpt)
    except UserError as exc:
        print_error(exc)
        return exc.exit_code
    print(f"imported {args.model_dir} ({cfg.n_layers} layers, dim {cfg.dim}, attention {cfg.attention}) "
          f"to {args.out_ckpt}; start a run from it with --train.init_from={args.out_ckpt}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
