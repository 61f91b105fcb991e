"""Run safety: graceful stop (.HALT file, SIGTERM, SIGINT), SIGUSR1 stack dumps, a stall watchdog.

A stop request is only a flag; the loop finishes the current optimizer step, checkpoints and exits 0.
"""
from __future__ import annotations

import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

HALT_FILE = ".HALT"

ANOMALY_FILE = ".anomaly_type"


def format_all_stacks() -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"--- thread {names.get(ident, '?')} ({ident}) ---\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


def write_stackdump(out_dir: Path, reason: str) -> Path:
    path = out_dir / f"stackdump_{time.strftime('%Y%m%d_%H%M%S')}_{int(time.time() * 1000) % 1000:03d}.txt"
    path.write_text(f"# reason: {reason}\n# time: {time.ctime()}\n{format_all_stacks()}")
    return path


class StopFlags:
    """Installs handlers in the main thread; `should_stop()` is cheap enough to call every step."""

    def __init__(self, out_dir: Path, on_stackdump: Callable[[Path], None] | None = None):
        self.out_dir = out_dir
        self.reason: str | None = None
        self._on_stackdump = on_stackdump
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._request_stop)
            if hasattr(signal, "SIGUSR1"):
                self._previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, self._stackdump)

    def _request_stop(self, signum, _frame) -> None:
        self.reason = signal.Signals(signum).name

    def _stackdump(self, _signum, _frame) -> None:
        path = write_stackdump(self.out_dir, "SIGUSR1")
        if self._on_stackdump:
            self._on_stackdump(path)

    def should_stop(self) -> bool:
        if self.reason is None and (self.out_dir / HALT_FILE).exists():
            self.reason = "HALT file"
        return self.reason is not None

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


class Watchdog(threading.Thread):
    """Dumps all stacks (file + callback) when no step completes for `timeout_s`; once per stall."""

    def __init__(self, out_dir: Path, timeout_s: float, on_stall: Callable[[Path, float], None]):
        super().__init__(name="watchdog", daemon=True)
        self.out_dir, self.timeout_s, self.on_stall = out_dir, timeout_s, on_stall
        self._last = time.monotonic()
        self._fired = False
        self._stop_event = threading.Event()

    def beat(self) -> None:
        self._last = time.monotonic()
        self._fired = False

    def run(self) -> None:
        poll = min(5.0, max(0.05, self.timeout_s / 4))
        while not self._stop_event.wait(poll):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s and not self._fired:
                self._fired = True
                path = write_stackdump(self.out_dir, f"watchdog: no step for {idle:.1f}s")
                self.on_stall(path, idle)

    def stop(self) -> None:
        self._stop_event.set()
