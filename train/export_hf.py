"""python -m train.export_hf CKPT_OR_RUN_DIR OUT_DIR [--dtype fp32|bf16] [--overwrite]

One of our checkpoints (or a run directory: its newest valid checkpoint) -> a Hugging Face model
directory: model.safetensors, config.json, generation_config.json, the run's tokenizer files and a
model card (README.md). An NSA model has no transformers class: it exports model.safetensors with
our tensor names, nsa_config.json (our config) and README.md, and no config.json. docs/HF.md.

Safe by construction: every check runs before anything is written; the files are written into a
temporary directory beside OUT_DIR and renamed into place at the end, so a failed export leaves
nothing behind. A non-empty OUT_DIR is replaced only with --overwrite, and only if it holds a
previous export. Bad input: one `error:` line on stderr, exit 2.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from train.core.errors import UserError, print_error
from train.hf.convert import ARCHITECTURES
from train.hf.export import DTYPES, export


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.export_hf", description=__doc__.split("\n\n")[1])
    p.add_argument("source", type=Path, help="a checkpoint file or a run directory (its newest valid checkpoint)")
    p.add_argument("out_dir", type=Path)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="dtype of the exported weights")
    p.add_argument("--overwrite", action="store_true", help="replace OUT_DIR when it holds a previous export")
    args = p.parse_args(argv)
    try:
        kind = export(args.source, args.out_dir, args.dtype, args.overwrite)
    except UserError as exc:
        print_error(exc)
        return exc.exit_code
    what = "safetensors + nsa_config.json (no transformers config)" if kind == "nsa" else ARCHITECTURES[kind]
    print(f"exported {what} to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
