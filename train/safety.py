"""Run safety: graceful stop (.HALT file, SIGTERM, SIGINT), SIGUSR1 stack dumps, a stall watchdog.

A stop request is only a flag; the loop finishes the current optimizer step, checkpoints and exits 0.

Stack dumps are written by the standard library's `faulthandler`, whose C code needs neither the GIL
nor the main thread, so they work exactly when they are needed: a rank stuck in a C call (a hung
collective, a deadlocked lock) that holds the GIL. Each process has its dump files, opened at start
and appended to (docs/ARTIFACTS.md):

- `stackdump_rank{R}_{pid}.txt`: `kill -USR1 PID` appends every thread's stack at once;
- `stackdump_rank{R}_{pid}_watchdog.txt`: appended when no step completes for runtime.watchdog_s.

Python notices a new dump later, when it runs again: it appends a line with the time and the names of
the threads (faulthandler prints thread ids only) and calls the heartbeat callback. A file that got no
dump is removed when the process ends, however it ends (kill -9 and OOM kills included): a small
sweeper process per file waits on a pipe that only this process (and its forks) hold open.

`python -m train.safety check-halt OUT_DIR` prints the stale-.HALT message (stale_halt_message) and
exits 2 when OUT_DIR/.HALT exists, else exits 0: the bash runners use it, so the text lives here only.
"""
from __future__ import annotations

import sys
from pathlib import Path

from train.core.errors import print_error
from train.trainer.safety import stale_halt_message


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 2 or argv[0] != "check-halt":
        print("usage: python -m train.safety check-halt OUT_DIR   (exit 2 with the message when OUT_DIR/.HALT "
              "exists, else 0)", file=sys.stderr)
        return 2
    message = stale_halt_message(Path(argv[1]))
    if message:
        print_error(message)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
