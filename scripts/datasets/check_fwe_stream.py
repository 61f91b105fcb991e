"""Pre-flight: pull a few batches from the configured data source and print their shape.

    PYTHONPATH=. python scripts/datasets/check_fwe_stream.py [--source fineweb_edu] [--tokenizer gpt2]
        [--seq-len 1024] [--batches 3] [--batch-size 2] [--subset sample-10BT] [--timeout 120]

Works offline on local sources (text:GLOB, jsonl:GLOB, parquet:GLOB, bin:DIR). Prints one
`ok batch[i] lens: [...] eos: [...]` line per batch (row lengths, documents ending in each row)
and the start of the first row, decoded. Exits non-zero with one line on any data problem.
"""
from __future__ import annotations

import argparse
import sys
import time


from train.data import DataConfig, build_data, load_tokenizer, padded_vocab
from train.core.errors import UserError, print_error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", default="fineweb_edu")
    parser.add_argument("--tokenizer", default="gpt2")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--subset", default=None)
    parser.add_argument("--text-field", default="text")
    parser.add_argument("--text-sample-by", default="document")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds allowed for the first batch")
    args = parser.parse_args(argv)
    cfg = DataConfig(source=args.source, tokenizer=args.tokenizer, subset=args.subset, text_field=args.text_field,
                     text_sample_by=args.text_sample_by, first_batch_timeout_s=args.timeout)
    started = time.monotonic()
    try:
        tokenizer = load_tokenizer(cfg.tokenizer)
        bundle = build_data(cfg, seq_len=args.seq_len, batch_size=args.batch_size,
                            vocab_size=padded_vocab(tokenizer.n_vocab), seed=0)
        for i in range(args.batches):
            x, y = bundle.train.next_batch()
            lens = [int(n) for n in (x >= 0).sum(dim=1)]
            eos = [int(n) for n in (y == tokenizer.eos_id).sum(dim=1)]
            print(f"ok batch[{i}] lens: {lens} eos: {eos}", flush=True)
            if i == 0:
                print(f"   first row: {tokenizer.decode(x[0, :48].tolist())!r}")
        print(f"ok {args.batches} batches from {args.source} in {time.monotonic() - started:.1f}s: {bundle.describe()}")
        bundle.close()
    except UserError as e:
        print_error(e)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
