"""Prepare a very large corpus in resumable shards, then join them into one prepared directory.

    python -m train.data.prepare_sharded --source jsonl:corpus/*.jsonl --tokenizer hf:tokenizers/qwen3 \\
        --out data/NAME --shards N [--workers W] [--max-shards K] [--keep-shards] [--overwrite] \\
        [--val-fraction 0.005] [--split-seed 0] [--subset S] [--split train] [--text-field text] \\
        [--text-sample-by document|paragraph|line]

Shards are split by source file: shard i owns the contiguous data files [i*F/N, (i+1)*F/N) of the
F files of the source (one per file for local globs; the dataset's data files for hf:NAME). Each
shard is tokenized by one worker process with prepare's own writer, chunking, EOS and held-out
rule into DIR/shards/shard_{i}.{train,val}.bin, then finished with DIR/shards/shard_{i}.done.json
(tokens, documents, bytes, sha256, max id per split). A rerun skips every shard whose marker and
files are intact, so an interrupted job resumes where it stopped (--max-shards K stops after K
shards on purpose). When all shards are done they are joined in order (each shard's sha256
re-checked on the way) into DIR/train.bin and DIR/val.bin: the same documents in the same order as
a one-shot `python -m train.data.prepare`, so the files and meta.json are the same, and
DIR/manifest.json lists the shards. The shard .bin files are deleted after the join unless
--keep-shards. meta.json is written last.
"""
from __future__ import annotations

import argparse
import os
import sys

from train.core.errors import UserError, print_error
from train.data.preparation import add_source_arguments, empty_val_warning, spellings, summary_line
from train.data.sharded_preparation import prepare_sharded


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.data.prepare_sharded", description=__doc__.split("\n\n")[0])
    add_source_arguments(parser)
    parser.add_argument("--shards", required=True, type=int, help="number of shards (<= the source's files)")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 1) - 1), help="shards tokenized at once")
    parser.add_argument(*spellings("--max-shards"), type=int, default=None, help="tokenize at most this many shards now, then stop")
    parser.add_argument(*spellings("--keep-shards"), action="store_true", help="keep the shard .bin files after joining")
    parser.add_argument("--overwrite", action="store_true", help="start again: delete shards and the prepared files")
    args = parser.parse_args(argv)
    try:
        meta = prepare_sharded(args.source, args.tokenizer, args.out, n_shards=args.shards, workers=args.workers,
                               max_shards=args.max_shards, val_fraction=args.val_fraction, split_seed=args.split_seed,
                               subset=args.subset, split=args.split, text_field=args.text_field,
                               text_sample_by=args.text_sample_by, keep_shards=args.keep_shards,
                               overwrite=args.overwrite)
    except UserError as e:
        print_error(e)
        return e.exit_code
    if meta is None:
        return 0
    print(summary_line(args.out, meta, f"{args.shards} shards (manifest.json)"))
    if meta.get("val_split"):
        print(f"note: {meta['val_split']}")
    if warning := empty_val_warning(meta):
        print(warning, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
