"""One stop decision for all ranks.

Each rank sees its own stop requests (a signal arrives at one rank before another, `.HALT` is seen
between two different steps). If ranks acted on them alone, one would leave the loop while its peer
entered the next step's collectives: a hang, and no final checkpoint. So after every optimizer step
the ranks OR their local requests with one tiny all-reduce on a CPU (gloo) group, which needs no
device synchronisation, and every rank applies the same decision after the same step.

`install_early_handlers()` runs first thing in the entry point, before torch is imported, so a
SIGTERM that arrives during start-up (torchrun forwards it to every worker) becomes a stop request
too, honoured after the first step, instead of killing a rank that has not installed StopFlags yet.
"""
from __future__ import annotations

import signal

# the order gives the reported reason when several ranks stop for different reasons
REASONS = ("write failed", "SIGTERM", "SIGINT", "HALT file", "data outage", "stop_after")
WRITE_FAILED = "write failed"  # a rank could not write one of its files (a full disk): every rank exits 4
DATA_OUTAGE = "data outage"  # a rank's stream source is unreachable past its retries (train/data/lookahead.py)

_early_signal: str | None = None


def _early(signum, _frame) -> None:
    global _early_signal
    _early_signal = signal.Signals(signum).name


def install_early_handlers() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _early)


def early_signal() -> str | None:
    """A SIGTERM / SIGINT received before the loop installed its own handlers."""
    return _early_signal


class StopVote:
    """`decide(local_reason)` -> the reason every rank stops for after this step, or None.

    Collective: every rank calls it once per step, in the same order relative to other collectives.
    """

    def __init__(self, group=None, enabled: bool = False):
        self.group, self.enabled = group, enabled
        if enabled:
            import torch

            self._flags = torch.zeros(len(REASONS), dtype=torch.int32)

    def decide(self, local_reason: str | None) -> str | None:
        if not self.enabled:
            return local_reason
        import torch.distributed as dist

        self._flags.zero_()
        if local_reason is not None:
            self._flags[REASONS.index(local_reason)] = 1
        dist.all_reduce(self._flags, op=dist.ReduceOp.MAX, group=self.group)
        for reason, flag in zip(REASONS, self._flags.tolist()):
            if flag:
                return reason
        return None

