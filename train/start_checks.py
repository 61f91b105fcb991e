"""The checks a training launch makes before its first step, as the functions the trainer itself calls
(train/trainer/build_run.py), so that the preflight checklist (train/workflows/preflight.py) and the bash runners refuse
exactly what the launch refuses, in the launch's own words:

- out_dir: a stale `.HALT`, a live owner of `.lock`, what `train.resume` resumes (train/checkpoint/run_dir.py);
- resume: the checkpoint's architecture, train.steps against its step and its wsd decay (train/trainer/lr_schedule.py),
  its tokenizer, and its global batch on this world size (`fit_global_batch`: the rule in docs/DISTRIBUTED.md);
- data: the source's files, metadata, tokenizer and vocabulary (train/data/build.py's own checks).
- tasks: every task of train.eval_tasks loaded and the tokenizer that encodes them (train/trainer/tasks_eval.py).

    python -m train.start_checks CONFIG [--section.key=value ...] [--world-size N]

prints what the launch will do, one line each, and exits 0; or prints the launch's one-line refusal and
exits 2. It reads only: nothing in the out_dir is moved or written.
"""
from __future__ import annotations

import argparse
import sys

from train.core.config import load_config
from train.core.errors import ConfigError, UserError, print_error
from train.trainer.start_checks import start_checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.start_checks", allow_abbrev=False,
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="the run's YAML config; overrides (--section.key=value) may follow")
    parser.add_argument("--world-size", type=int, default=1, help="ranks of the launch (default 1)")
    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.world_size < 1:
            raise ConfigError(f"--world-size must be >= 1, got {args.world_size}")
        lines = start_checks(load_config(args.config, overrides), args.world_size)
    except UserError as exc:
        print_error(exc)
        return exc.exit_code
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
