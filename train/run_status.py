"""What state a run is in, said the same way everywhere an operator looks (monitor, run.info, metrics.json,
handoff): running | finished | stopped | anomaly | crashed.

metrics.json holds the trainer's own word, but a trainer killed by a signal (kill -9, the OOM killer, a lost
node) cannot write 'crashed'; its last word stays 'running'. So a 'running' status is believed only while the
process that owns the out_dir lives: `.lock` names the owner (host, pid; train/checkpoint/run_dir.py) and the kernel
frees the lock at any exit. When the owner is gone the run crashed, at the last step any file recorded, with
the exit code the launcher saw (run.info `exit_code`) when there was a launcher.

The bash runners call `python -m train.run_status mark-exited OUT_DIR EXIT_CODE` after a failed trainer, so
metrics.json says it too (status 'crashed', exit_code, crashed_at_step; 'write_failed' for exit 4, where the disk takes
the write: a full one may not, and `describe --exit-code 4` says write_failed all the same). Standard library only: the
monitor runs it without torch.

    python -m train.run_status describe OUT_DIR [--run-info RUN_DIR/run.info | --exit-code N]   -> one line
    python -m train.run_status mark-exited OUT_DIR EXIT_CODE                                    -> the line it recorded
                                                          (mark-crashed, its earlier name, still works)
    python -m train.run_status step OUT_DIR                                       -> the last step recorded
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from train.core.artifacts import RUN_INFO, read_kv
from train.observe.run_status import mark_exited, run_status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.run_status", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    describe = sub.add_parser("describe", help="print the run's status in one line")
    describe.add_argument("out_dir", type=Path)
    describe.add_argument("--run-info", type=Path, help=f"the launcher's {RUN_INFO} (its exit_code)")
    describe.add_argument("--exit-code", type=int, help="the trainer's exit code, as the launcher saw it")
    mark = sub.add_parser("mark-exited", aliases=["mark-crashed"], help="record in metrics.json that the trainer exited with EXIT_CODE "
                                              "(crashed; write_failed for 4)")
    mark.add_argument("out_dir", type=Path)
    mark.add_argument("exit_code", type=int)
    sub.add_parser("step", help="print the last step any file of the run recorded").add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    if args.command == "describe":
        info = read_kv(args.run_info) if args.run_info else {}
        if args.exit_code is not None:
            info["exit_code"] = args.exit_code
        print(run_status(args.out_dir, info or None).line())
    elif args.command == "step":
        print(run_status(args.out_dir).step)
    else:
        print(mark_exited(args.out_dir, args.exit_code).line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
