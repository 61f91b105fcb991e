"""python -m train CONFIG.yaml [--section.key=value ...]   (also under torchrun)

Bad input is reported as one line on stderr with exit code 2; see train/trainer/runner.py for the others.
"""
from __future__ import annotations

import os
import sys

from train.core.errors import UserError, print_error

USAGE = "usage: python -m train CONFIG.yaml [--section.key=value | --alias=value ...]"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        if not argv:
            print(USAGE, file=sys.stderr)
            return 2
        from train.core.config_docs import text

        print(f"{USAGE}\n\nEvery config key (YAML section.key), its default and meaning (docs/CONFIG.md):\n{text()}")
        return 0
    config_path, overrides = (argv[0], argv[1:]) if not argv[0].startswith("--") else (None, argv)
    try:
        from train.core.config import load_config
        from train.core.env import env_overrides
        from train.trainer.runner import run_training

        from_env, notes = env_overrides()
        for note in notes:
            print(note, file=sys.stderr, flush=True)
        cfg = load_config(config_path, from_env + overrides)  # the command line wins
        return run_training(cfg)
    except UserError as exc:
        print_error(exc)
        return exc.exit_code


def exit_process(code: int) -> None:
    """Exit with `code` without the interpreter's teardown.

    By the time main() returns, the run has closed every file it wrote (CSVs, heartbeat, TensorBoard,
    W&B, checkpoints, data workers). Seen here about 1 run in 10 after a stop request (signal or
    .HALT): the C++ runtime then aborts while tearing down worker-thread pools ("terminate called
    without an active exception"), turning a clean exit 0 into SIGABRT. Flush and leave instead."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cli() -> None:
    """The process entry point (`python -m train`, the `nsa-train` console script)."""
    from train.core.console import survive_closed_console
    from train.trainer.stop import install_early_handlers

    install_early_handlers()  # a SIGTERM during start-up becomes a stop request (train/trainer/stop.py)
    survive_closed_console()  # a vanished console reader must not stop the run before its checkpoint
    exit_process(main())


if __name__ == "__main__":
    cli()
