"""What a run writes, by name: the one place for its file names, patterns, columns, record kinds and keys,
and the readers every tool uses (trainer, monitor, handoff, post-run, analyze, the bash runbooks).

Standard library only: the monitor and the bash helpers run it without torch. docs/ARTIFACTS.md
describes each name below; tests/tools/test_artifacts_schema.py keeps the two in step, and
`python -m train.artifacts ...` answers the bash runbooks.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from train.core.artifacts import checkpoint_files, read_metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.artifacts", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    count = sub.add_parser("count-checkpoints", help="how many files in OUT_DIR are named like checkpoints")
    count.add_argument("out_dir", type=Path)
    field = sub.add_parser("metrics-field", help="one top-level value of OUT_DIR/metrics.json (empty when absent)")
    field.add_argument("out_dir", type=Path)
    field.add_argument("key")
    args = parser.parse_args(argv)
    if args.command == "count-checkpoints":
        print(len(checkpoint_files(args.out_dir)))
    else:
        value = read_metrics(args.out_dir).get(args.key)
        print("" if value is None else json.dumps(value) if isinstance(value, (list, dict)) else value)
    return 0


if __name__ == "__main__":
    sys.exit(main())
