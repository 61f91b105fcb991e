"""What counts as training time: the one place that decides it.

Training time of a log interval = wall time since the previous interval ended, minus the time spent
off the clock. The runner (train/trainer/runner.py) puts off the clock everything between two steps that is
not training: evaluation, sampling, checkpoints, and writing a row to the sinks. The loop
(train/trainer/loop.py) asks `lap()` once per log interval, right after its host sync, so on CUDA the
interval's queued device work is inside the wall time it measures; toks_per_s and dt_step_s come from
that number.

    clock = TrainingClock()
    with clock.off_the_clock():     # nested uses count once
        evaluate()
    seconds = clock.lap()           # training seconds of the interval that ends now; the next begins
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator


class TrainingClock:
    def __init__(self, now: Callable[[], float] = time.perf_counter):
        self._now = now
        self._interval_start = now()
        self._excluded = 0.0  # seconds off the clock in the current interval, finished spans
        self._depth, self._off_since = 0, 0.0  # an unfinished span: how deep, since when

    def lap(self) -> float:
        """Training seconds since the last lap (or since the clock was made); starts the next interval."""
        now = self._now()
        off = self._excluded + (self._open_span(now) if self._depth else 0.0)
        seconds = now - self._interval_start - off
        self._interval_start, self._excluded = now, 0.0
        return max(seconds, 1e-9)

    @contextmanager
    def off_the_clock(self) -> Iterator[None]:
        """Time inside is not training time. A lap inside splits it: each interval loses only its own part."""
        if self._depth == 0:
            self._off_since = self._now()
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._excluded += self._open_span(self._now())

    def _open_span(self, now: float) -> float:
        """Seconds of the open off-the-clock span that fall in the current interval."""
        return now - max(self._off_since, self._interval_start)
