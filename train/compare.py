"""Twin comparison: an NSA config against its dense twin, same data, seed and token budget.

    python -m train.compare CONFIG.yaml [--section.key=value ...] --out DIR [--side_by_side]
        [--eval_max_tokens N]
    make compare CONFIG=configs/m7c_125m_80g.yaml OUT=artifacts/twin_m7c COMPARE_ARGS="--data.source=bin:data/DIR"

The dense twin is the same config with model.attention: dense and no nsa section. DIR holds
  nsa.yaml, dense.yaml      the two effective configs (each loads again with python -m train)
  nsa/, dense/              ordinary out_dirs: resume, .HALT, the monitor and the handoff work as for any run
  logs/<arm>.log            each arm's console output, appended by every launch
  report.json, report.md, report.png    train/analysis/compare_report.py: curves, whole-split scores, verdict
The arms train one after the other (each on one process: CPU, or the first visible GPU), or with
--side_by_side one per GPU at the same time. Then train.evaluate scores both on the whole validation
split of the prepared directory (a bin: source: the split the trainer never trained on). The same
command again resumes whichever arm is unfinished, reuses finished evaluations and rewrites the report;
a DIR made from another config is refused. For ablations of nsa.* settings, --dense_from EARLIER_DIR
reuses an earlier comparison's dense arm when it is this config's twin (checked key by key). Exit: 0, 2 bad input, else the failing arm's exit code.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from train.core.errors import UserError
from train.workflows.compare import ArmFailed, compare_twins


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="python -m train.compare", description=__doc__.split("\n\n")[0],
                                epilog="Any --section.key=value applies to both arms (python -m train --help lists the keys).")
    p.add_argument("config", type=Path, help="an NSA config (model.attention: nsa)")
    p.add_argument("--out", type=Path, required=True, help="the comparison's directory (created, or resumed)")
    p.add_argument("--side_by_side", action="store_true", help="train both arms at once, one GPU each (needs 2 GPUs)")
    p.add_argument("--dense_from", type=Path, default=None,
                   help="an earlier comparison's DIR whose dense arm is this one's twin (same config but out_dir): "
                        "reuse it instead of training it again (ablations of nsa.* settings)")
    p.add_argument("--eval_max_tokens", type=int, default=None,
                   help="score only the first N tokens of the validation split (default: all of it)")
    args, rest = p.parse_known_args(argv)
    strays = [a for a in rest if not (a.startswith("--") and "." in a.split("=", 1)[0])]
    if strays:
        p.error(f"unrecognized arguments: {' '.join(strays)} (config overrides look like --section.key=value)")
    return args, rest


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        report, files = compare_twins(args.config, overrides, args.out, side_by_side=args.side_by_side,
                                      dense_from=args.dense_from, eval_max_tokens=args.eval_max_tokens)
    except (UserError, ArmFailed) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(f"compare: {report['verdict']}")
    print(f"compare: report in {', '.join(str(f) for f in files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
