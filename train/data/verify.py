"""Check a prepared token directory against its metadata.

    python -m train.data.verify data/NAME [--vocab-size V]

Checks every split: the file exists, its size matches the token count, its sha256 matches,
the dtype fits the vocabulary, and the largest id is below the tokenizer's vocabulary (and
below --vocab-size, the model's, when given) and equals meta.json's max_token_id.
Prints `ok ...` and exits 0, or prints one line per problem and exits 1.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from train.data.meta import SPLITS, read_meta
from train.data.verification import verify


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.data.verify", description=__doc__.split("\n\n")[0])
    parser.add_argument("data_dir", type=Path)
    parser.add_argument("--vocab-size", type=int, default=None, help="the model's vocab_size, to check ids against")
    args = parser.parse_args(argv)
    problems = verify(args.data_dir, args.vocab_size)
    for problem in problems:
        print(problem)
    if problems:
        return 1
    meta = read_meta(args.data_dir)
    counts = ", ".join(f"{s} {meta.splits[s].tokens if meta.splits[s].tokens is not None else '?'} tokens" for s in SPLITS)
    checks = "sizes, dtype, ids" + ("" if meta.legacy else ", sha256")
    print(f"ok {args.data_dir}: {counts}, {meta.dtype}, tokenizer {meta.tokenizer} ({checks} checked)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
