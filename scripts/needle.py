"""Needle in a haystack: can a trained checkpoint retrieve a fact planted at a given depth?

    python scripts/needle.py artifacts/m7c_125m/latest.pt --S 8192 --depths 0,0.25,0.5,0.75,1 --trials 5

The prompt and the scoring: train/evaluation/needle.py. Prints one JSON object with accuracy by depth.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from train.checkpoint.io import model_from_checkpoint
from train.core.errors import UserError, print_error
from train.data.tokenizers import load_tokenizer
from train.evaluation.needle import NEEDLE, QUESTION, TRIALS, build_prompt, run_needle  # noqa: F401  (tests use the names)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ckpt", type=Path)
    p.add_argument("--S", type=int, default=8192, help="context length in tokens")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1.0")
    p.add_argument("--trials", type=int, default=TRIALS)
    p.add_argument("--prefill_tile", type=int, default=2048)
    p.add_argument("--rope_scale", type=float, default=None, help="override the checkpoint's model.rope_scale")
    p.add_argument("--tokenizer", default=None, help="default: the checkpoint's data.tokenizer")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        overrides = {"rope_scale": args.rope_scale} if args.rope_scale else {}
        model, cfg = model_from_checkpoint(args.ckpt, args.device, **overrides)
        tok = load_tokenizer(args.tokenizer or cfg["data"]["tokenizer"])
        result = run_needle(model, tok, S=args.S, depths=[float(d) for d in args.depths.split(",")],
                            trials=args.trials, seed=args.seed, prefill_tile=args.prefill_tile, device=args.device)
    except UserError as exc:
        print_error(exc)
        return exc.exit_code
    print(json.dumps({"checkpoint": str(args.ckpt), "attention": cfg["model"]["attention"],
                      "rope_scale": model.cfg.rope_scale, **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
