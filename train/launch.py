"""python -m train.launch [torchrun arguments] -m train CONFIG.yaml ...   (torchrun, with the ranks' exit code kept)

torchrun reports any failed worker as exit 1, after a ChildFailedError traceback of its own. The trainer's exit codes
say what the operator should do (train/trainer/runner.py: 2 bad input, 3 anomaly, 4 a file could not be written, 75
a data outage), and a rank's status file may be exactly what a full disk could not take. So this launcher runs
torchrun's own `run` and, when workers fail, exits with the code the failed ranks agree on, after one line naming
the ranks: the runbooks see 4 on a full disk whether or not metrics.json could be rewritten. Ranks killed by a
signal (torchrun stops the others after the first failure) do not count against the agreement; failures that
disagree, or only signals, exit 1 as torchrun does. A signal the launcher itself receives (SIGTERM from a scheduler:
torchrun passes it to the ranks, which stop gracefully together) is one line and exit 128 + its number, with no
traceback; the run's own status then says how it ended (scripts/lib/common.sh).
"""
from __future__ import annotations

import signal
import sys

from train.core.errors import StorageError, UserError
from train.trainer.runner import EXIT_ANOMALY, EXIT_DATA_OUTAGE

AGREED_CODES = (UserError.exit_code, EXIT_ANOMALY, StorageError.exit_code, EXIT_DATA_OUTAGE)  # the trainer's own


def exit_code_of(codes: dict[int, int]) -> int:
    """{rank: exit code (negative: killed by that signal)} -> this launcher's exit code."""
    own = {code for code in codes.values() if code > 0}
    return own.pop() if len(own) == 1 and own <= set(AGREED_CODES) else 1


def describe(codes: dict[int, int]) -> str:
    """'rank 0 exit 4, rank 1 SIGTERM'"""
    def one(code: int) -> str:
        if code < 0:
            try:
                return signal.Signals(-code).name
            except ValueError:
                return f"signal {-code}"
        return f"exit {code}"

    return ", ".join(f"rank {rank} {one(code)}" for rank, code in sorted(codes.items()))


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        run(args)
    except SignalException as exc:  # torchrun forwarded it to every rank, which stop after the same step
        code, name = 128 + int(exc.sigval), signal.Signals(exc.sigval).name
        print(f"launch: {name} received and passed to the workers (their own lines above say how they ended): "
              f"exit {code}", file=sys.stderr, flush=True)
        return code
    except ChildFailedError as exc:
        codes = {rank: int(failure.exitcode) for rank, failure in exc.failures.items()}  # keyed by global rank
        code = exit_code_of(codes)
        print(f"launch: workers failed ({describe(codes)}): exit {code}"
              f"{'' if code != 1 else ' (their own lines above say why)'}", file=sys.stderr, flush=True)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
