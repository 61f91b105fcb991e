"""Tokenize a source once into train.bin / val.bin / meta.json (see docs/DATA.md).

    python -m train.data.prepare --source text:corpus/*.txt --tokenizer gpt2 --out data/NAME \\
        [--val-fraction 0.005] [--split-seed 0] [--workers N] [--max-docs N] [--overwrite]

Documents are read once through the same sources as training (sources.iter_documents),
tokenized in chunks by a process pool (results kept in order, at most 2 chunks per worker in
flight), each followed by EOS, and appended to train.bin or val.bin by a keyed hash of the
document (the same rule the streaming loader uses). Files stream to disk with running sha256,
so memory stays bounded by the chunks in flight. meta.json is written last: a directory
without it was not finished.
"""
from __future__ import annotations

import argparse
import os
import sys

from train.core.errors import UserError, print_error
from train.data.preparation import add_source_arguments, empty_val_warning, prepare, spellings, summary_line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.data.prepare", description=__doc__.split("\n\n")[0])
    add_source_arguments(parser)
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 1) - 1), help="tokenizer processes")
    parser.add_argument(*spellings("--max-docs"), type=int, default=None, help="stop after this many documents")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing prepared dataset")
    args = parser.parse_args(argv)
    try:
        meta = prepare(args.source, args.tokenizer, args.out, val_fraction=args.val_fraction, split_seed=args.split_seed,
                       workers=args.workers, max_docs=args.max_docs, subset=args.subset, split=args.split,
                       text_field=args.text_field, text_sample_by=args.text_sample_by, overwrite=args.overwrite)
    except UserError as e:
        print_error(e)
        return e.exit_code
    print(summary_line(args.out, meta, f"{meta['text_bytes'] / 1e6 / max(meta['seconds'], 1e-9):.1f} MB/s"))
    if meta.get("val_split"):
        print(f"note: {meta['val_split']}")
    if warning := empty_val_warning(meta):
        print(warning, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
