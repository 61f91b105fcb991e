"""Decode windows near the start and the end of each split of a prepared dataset, for a human to read.

    PYTHONPATH=. python scripts/datasets/eye_test.py data/NAME [--tokens 200] [--tokenizer gpt2]

The tokenizer is the one named in meta.json (--tokenizer only for legacy directories without it).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np


from train.data.meta import SPLITS, read_meta, split_tokens
from train.data.tokenizers import load_tokenizer
from train.core.errors import UserError, print_error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data_dir", type=Path)
    parser.add_argument("--tokens", type=int, default=200, help="tokens per window")
    parser.add_argument("--tokenizer", default="gpt2", help="only used when the metadata names no tokenizer")
    args = parser.parse_args(argv)
    try:
        meta = read_meta(args.data_dir)
        tokenizer = load_tokenizer(meta.tokenizer or args.tokenizer)
        for split in SPLITS:
            n = split_tokens(args.data_dir, meta, split)
            tokens = np.memmap(args.data_dir / meta.splits[split].file, dtype=meta.np_dtype, mode="r", shape=(n,)) if n else []
            for label, start in (("start", 0), ("end", max(0, n - args.tokens))):
                window = [int(t) for t in tokens[start:start + args.tokens]]
                print(f"===== {split} ({n:,} tokens), {label}: tokens [{start:,}, {start + len(window):,}) =====")
                print(tokenizer.decode(window))
                print()
    except UserError as e:
        print_error(e)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
