"""Score a checkpoint on a whole data split: loss, perplexity, bits per token and per byte.

    python -m train.evaluate CKPT_OR_RUN_DIR --data bin:DIR | text:GLOB | jsonl:GLOB | mixture [--split val|train]
        [--seq_len N] [--stride S] [--batch_size B] [--device auto|cpu|cuda] [--max_tokens N] [--name NAME]
        [--text_field text] [--text_sample_by document|paragraph|line]

Every target of the split's token stream is scored exactly once (train/evaluation/scoring.py): non-overlapping
windows by default, a sliding window with --stride S for RoPE models. The data comes from
train/evaluation/eval_data.py; the batch, unless --batch_size names it, from the model and the free memory
(train/evaluation/eval_batch.py): the result does not depend on it. Progress with an ETA goes to stderr every
PROGRESS_EVERY_S. Prints one JSON object and writes it to eval_<name>.json beside the checkpoint (a
file of another checkpoint, or not written by this tool, is never replaced). --data mixture scores each source of
the checkpoint's data.mixture that way (eval_<source's name>.json each) and prints their total weighted as the
mixture is configured, with each source's result under "sources". Bad input: one `error:` line, exit 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from train.core.errors import UserError, print_error
from train.evaluation.evaluate import MIXTURE, EvalRequest, evaluate, evaluate_mixture


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train.evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", type=Path, help="a checkpoint file or a run directory (its newest valid checkpoint)")
    p.add_argument("--data", required=True,
                   help="bin:DIR (a prepared directory) | text:GLOB | jsonl:GLOB | parquet:GLOB | mixture (each source "
                        "of the checkpoint's data.mixture, and their total weighted as configured)")
    p.add_argument("--split", default=None, help="bin: only; train | val (default val)")
    p.add_argument("--seq_len", type=int, default=None,
                   help="window length in tokens (default: the checkpoint's train.seq_len)")
    p.add_argument("--stride", type=int, default=None,
                   help="RoPE models: targets scored per window after the first (default seq_len: non-overlapping)")
    p.add_argument("--batch_size", type=int, default=None,
                   help="windows per forward (default: chosen from the model and the free memory)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--by_position", type=int, default=None, metavar="K",
                   help="also the loss in K equal slices of the window (by_position in the JSON; each marked when it "
                        "lies past the checkpoint's training length): with --seq_len above it, how the loss goes on")
    p.add_argument("--max_tokens", type=int, default=None, help="score only the first N tokens of the stream")
    p.add_argument("--name", default=None, help="result file eval_<name>.json (default: from --data, split and step)")
    p.add_argument("--text_field", default=None, help="jsonl:/parquet: column with the text (default text)")
    p.add_argument("--text_sample_by", default=None, choices=("document", "paragraph", "line"),
                   help="text: documents: whole files (default), blank-line paragraphs or lines; EOS follows each")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        request = EvalRequest(**vars(args))
        result = evaluate_mixture(request) if args.data == MIXTURE else evaluate(request)
    except UserError as exc:
        print_error(exc)
        return exc.exit_code
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
