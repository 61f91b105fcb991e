"""Twin comparison: an NSA config against its dense twin and its window-only control, same data, seed and
token budget.

    python -m train.compare CONFIG.yaml [--section.key=value ...] --out DIR [--arms nsa,dense,window]
        [--side_by_side] [--dense_from EARLIER_DIR] [--reuse_from EARLIER_DIR ...] [--eval_max_tokens N]
        [--tasks hellaswag,arc_easy,... [--tasks_limit N]] [--needle 1,2,4 [--needle_trials N]] [--recall_probe]
        [--recall_format kv|prose] [--recall_lengths 1,2,4,8] [--positions M,K]
    make compare CONFIG=configs/m7c_125m_80g.yaml OUT=artifacts/twin_m7c COMPARE_ARGS="--data.source=bin:data/DIR"

Three arms, each the same config but for its attention: nsa (the config, nsa.gates: learned), dense (its twin:
model.attention: dense and no nsa section) and window (its window-only control: nsa.gates: window, the NSA layer
with its gates pinned to the sliding-window branch; the YAML keeps only the nsa keys such a layer reads).
--arms lists the arms to run (default all three; nsa always runs, and at least one control). DIR holds
  nsa.yaml, dense.yaml, window.yaml    the arms' effective configs (each loads again with python -m train)
  nsa/, dense/, window/                ordinary out_dirs: resume, .HALT, the monitor and the handoff work as for any run
  logs/<arm>.log                       each arm's console output, appended by every launch
  report.json, report.md, report.png   train/analysis/compare_report.py: curves, whole-split scores, both gaps, verdict
                                       (and, with --tasks, every arm's task scores: tasks_<name>.json in its out_dir,
                                       and McNemar's paired test on the items both scored: tasks_<name>.items.jsonl;
                                       with --needle, the needle test: needle_step<N>_S<S>.json; with a recall
                                       corpus or --recall_probe, the recall probe: recall_step<N>.json)
The arms train one after the other (each on one process: CPU, or the first visible GPU), or with
--side_by_side one per GPU at the same time (as many at once as GPUs are visible). Then train.evaluate scores
each on the whole validation split of the prepared directory (a bin: source: the split the trainer never
trained on). The same command again resumes whichever arm is unfinished, reuses finished evaluations and
rewrites the report; a DIR made from another config is refused; a DIR made before the window arm existed
(nsa.yaml and dense.yaml only) gets its window arm trained. Reusing an earlier comparison's arms (ablations of
nsa.* settings): --dense_from EARLIER_DIR reuses its dense arm, which must be this config's twin (checked key by
key); --reuse_from EARLIER_DIR (repeatable) reuses every control arm (dense, window) of the first EARLIER_DIR
whose arm matches this config's key by key (out_dir aside) and trains the others here; it is refused when no
arm matches. A reused arm must have finished. Exit: 0, 2 bad input, else the failing arm's exit code.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from train.core.errors import UserError, print_error
from train.evaluation.needle import TRIALS as NEEDLE_TRIALS
from train.workflows.compare import ARMS, ArmFailed, compare_twins, select_arms


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="python -m train.compare", description=__doc__.split("\n\n")[0],
                                epilog="Any --section.key=value applies to both arms (python -m train --help lists the keys).")
    p.add_argument("config", type=Path, help="an NSA config (model.attention: nsa)")
    p.add_argument("--out", type=Path, required=True, help="the comparison's directory (created, or resumed)")
    p.add_argument("--arms", default=",".join(ARMS),
                   help=f"the arms to run, comma separated (default {','.join(ARMS)}; nsa always runs, and at least "
                        "one control arm)")
    p.add_argument("--side_by_side", action="store_true",
                   help="train the arms at once, one GPU each (needs 2 GPUs; more arms than GPUs: in turns)")
    p.add_argument("--dense_from", type=Path, default=None,
                   help="an earlier comparison's DIR whose dense arm is this one's twin (same config but out_dir): "
                        "reuse it instead of training it again (ablations of nsa.* settings)")
    p.add_argument("--reuse_from", type=Path, action="append", default=[],
                   help="an earlier comparison's DIR (repeatable): reuse each of its control arms (dense, window) "
                        "whose config is this one's key by key, train the others here")
    p.add_argument("--eval_max_tokens", type=int, default=None,
                   help="score only the first N tokens of the validation split (default: all of it)")
    p.add_argument("--tasks", default=None,
                   help="downstream tasks every arm is scored on after training (train.tasks spelling: "
                        "hellaswag,arc_easy,... or .jsonl paths); the report gives each with its standard error")
    p.add_argument("--tasks_limit", type=int, default=None,
                   help="docs per task: the same seeded subset for every arm (default: all)")
    p.add_argument("--needle", default=None,
                   help="the needle-in-a-haystack test on every arm at these multiples of train.seq_len (e.g. 1,2,4: "
                        "up to 4x the training length; word-level tokenizers only)")
    p.add_argument("--needle_trials", type=int, default=None, help=f"needle trials per depth (default {NEEDLE_TRIALS})")
    p.add_argument("--recall_probe", action="store_true",
                   help="the recall probe on every arm even when the data is no recall corpus (zero-shot: documents "
                        "of seq_len tokens, distances in multiples of nsa.w; a recall corpus is always probed)")
    p.add_argument("--recall_lengths", default=None,
                   help="the recall probe on every arm at these multiples of the training length (e.g. 1,2,4,8), the "
                        "buckets extended to them; the dense arm also with its RoPE interpolated by each multiple")
    p.add_argument("--positions", default=None, metavar="M,K",
                   help="every arm's validation loss at M times the training length, in K slices of the window "
                        "(train.evaluate --by_position): does the loss keep falling past the training length?")
    p.add_argument("--recall_format", default=None,
                   help="the recall probe's lines: kv (qx=M) or prose (The code of qx is M.); default: the corpus's, "
                        "or kv")
    args, rest = p.parse_known_args(argv)
    strays = [a for a in rest if not (a.startswith("--") and "." in a.split("=", 1)[0])]
    if strays:
        p.error(f"unrecognized arguments: {' '.join(strays)} (config overrides look like --section.key=value)")
    return args, rest


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        report, files = compare_twins(args.config, overrides, args.out, side_by_side=args.side_by_side,
                                      dense_from=args.dense_from, reuse_from=args.reuse_from,
                                      eval_max_tokens=args.eval_max_tokens, arms=select_arms(args.arms),
                                      tasks=args.tasks, tasks_limit=args.tasks_limit, needle=args.needle,
                                      needle_trials=args.needle_trials, recall_probe=args.recall_probe,
                                      recall_format=args.recall_format, recall_lengths=args.recall_lengths,
                                      positions=args.positions)
    except (UserError, ArmFailed) as exc:
        print_error(exc)
        return exc.exit_code
    print(f"compare: {report['verdict']}")
    print(f"compare: report in {', '.join(str(f) for f in files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
