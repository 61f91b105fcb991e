"""The run directories the bash runners write: ARTIFACTS_DIR/train_runs/<name>_<timestamp>/run.info.

A run dir records one launch (run.info names its trainer `out_dir`); several launches may share an
out_dir (resume), and a launch that failed before training leaves a run dir whose out_dir holds no
metrics yet. Tools that default to "the current run" (the monitor, TensorBoard) ask `newest_run`:

    python -m train.runs newest ARTIFACTS_DIR [--prefix m7c_] [--out-dir]

The newest run that has started training wins (by the age of its out_dir's metrics.json / training.csv,
i.e. the run that is training now); only when no run has started does the newest run dir by name.
Standard library only (the monitor runs it without torch).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from train.observe.runs import newest_run, out_dir_of


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.runs", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    newest = sub.add_parser("newest", help="print the current run dir (or, with --out-dir, its out_dir)")
    newest.add_argument("artifacts", type=Path)
    newest.add_argument("--prefix", default="", help="only run dirs whose name starts with this (e.g. m7c_)")
    newest.add_argument("--out-dir", action="store_true", help="print the run's trainer out_dir instead")
    args = parser.parse_args(argv)
    run = newest_run(args.artifacts, args.prefix)
    if run is None:
        print(f"error: no run under {args.artifacts}/train_runs" + (f" named {args.prefix}*" if args.prefix else ""),
              file=sys.stderr)
        return 2
    target = out_dir_of(run) if args.out_dir else run
    if target is None:
        print(f"error: {run}/run.info names no out_dir", file=sys.stderr)
        return 2
    print(target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
