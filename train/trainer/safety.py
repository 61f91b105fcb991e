"""Run safety: graceful stop (.HALT file, SIGTERM, SIGINT), SIGUSR1 stack dumps, a stall watchdog.

The command line, usage and details: train/safety.py (its docstring).
"""
from __future__ import annotations

import faulthandler
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from train.core.artifacts import HALT, STACKDUMP_NAME

# The sweeper of one dump file: it blocks reading a pipe until DumpFile.close() writes a byte or the dumping
# process is gone (end of file: a crash, kill -9), then removes the file if it still holds the header only.
SWEEPER = """
import os, signal, sys
for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, signal.SIG_IGN)
os.read(0, 1)
path, inode, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
try:
    st = os.stat(path)
except OSError:
    sys.exit(0)
if (st.st_ino, st.st_size) == (inode, size):
    os.unlink(path)
"""


def stale_halt_message(out_dir: Path) -> str | None:
    """The one-line refusal for a leftover OUT_DIR/.HALT (it would stop a new run after one step);
    None when there is none."""
    halt = Path(out_dir) / HALT
    if not os.path.lexists(halt):
        return None
    return (f"{halt} exists (a graceful stop was requested earlier); remove it to resume: "
            f"rm {shlex.quote(str(halt))}")


def stackdump_path(out_dir: Path, rank: int = 0, kind: str = "") -> Path:
    """out_dir/stackdump_rank{R}_{pid}.txt, or ..._{kind}.txt (the watchdog's)."""
    suffix = f"_{kind}" if kind else ""
    return Path(out_dir) / STACKDUMP_NAME.format(rank=rank, pid=os.getpid(), suffix=suffix)


def thread_names() -> str:
    """'0x00007f..=MainThread, ...': faulthandler's thread ids with their Python names."""
    return ", ".join(f"0x{t.ident:016x}={t.name}" for t in threading.enumerate() if t.ident is not None)


class DumpFile:
    """An append-only file that faulthandler writes dumps into (through its descriptor) and Python
    annotates. Unbuffered, so Python's lines and faulthandler's writes land in order."""

    def __init__(self, path: Path, header: str):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.file = open(path, "ab", buffering=0)
        self.note(f"{header}; opened {time.strftime('%Y-%m-%d %H:%M:%S')}, pid {os.getpid()}, "
                  f"main thread 0x{threading.main_thread().ident:016x}")
        self.empty_size = self.seen = self.size()
        self._sweeper, self._sweep_fd = self._start_sweeper()

    def _start_sweeper(self) -> tuple[subprocess.Popen, int]:
        """A process (in its own session: a Ctrl-C or a process-group kill of the run misses it) that
        removes the file unless a dump arrived, at close() or when this process dies."""
        read_end, write_end = os.pipe()
        try:
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", SWEEPER, str(self.path),
                                     str(os.fstat(self.file.fileno()).st_ino), str(self.empty_size)],
                                    stdin=read_end, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    start_new_session=True)
        finally:
            os.close(read_end)
        return proc, write_end

    def size(self) -> int:
        return os.fstat(self.file.fileno()).st_size

    def note(self, text: str) -> None:
        self.file.write(f"# {text}\n".encode())

    def settled_size(self, size: int, limit_s: float = 1.0) -> int:
        """Wait (briefly) until a dump that is being written stops growing."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            time.sleep(0.02)
            now = self.size()
            if now == size:
                break
            size = now
        return size

    def acknowledge(self, what: str) -> None:
        """Annotate the dump(s) that arrived since the last call."""
        self.note(f"^ {what}; noticed {time.strftime('%Y-%m-%d %H:%M:%S')}; threads: {thread_names()}")
        self.seen = self.size()

    def close(self) -> None:
        """Close; the sweeper removes the file now when no dump ever arrived (only the header is in it)."""
        if self.file.closed:
            return
        self.file.close()
        try:
            os.write(self._sweep_fd, b"x")
        except BrokenPipeError:  # the sweeper is gone (killed): nothing removes the file
            pass
        os.close(self._sweep_fd)
        try:
            self._sweeper.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._sweeper.kill()
            self._sweeper.wait()


class StopFlags:
    """Installs handlers in the main thread; `should_stop()` is cheap enough to call every step.

    SIGTERM / SIGINT / out_dir/.HALT request a stop (`reason`). SIGUSR1 makes faulthandler append all
    stacks to `stackdump_path` at once, even when the main thread is stuck holding the GIL; the next
    `should_stop()` that sees the dump complete calls `on_stackdump(path)`."""

    def __init__(self, out_dir: Path, on_stackdump: Callable[[Path], None] | None = None, *,
                 rank: int = 0):
        self.out_dir = out_dir
        self.reason: str | None = None
        self._on_stackdump = on_stackdump
        self._previous = {}
        self._dump: DumpFile | None = None
        self._pending: int | None = None  # a grown size seen once; acted on when seen again (complete)
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._request_stop)
            if hasattr(signal, "SIGUSR1"):
                self._dump = DumpFile(stackdump_path(out_dir, rank),
                                      f"stack dumps of rank {rank} on SIGUSR1 (kill -USR1 {os.getpid()}), "
                                      "newest last")
                faulthandler.register(signal.SIGUSR1, file=self._dump.file, all_threads=True, chain=False)

    @property
    def stackdump_file(self) -> Path | None:
        return self._dump.path if self._dump else None

    def _request_stop(self, signum, _frame) -> None:
        self.reason = signal.Signals(signum).name

    def _check_stackdump(self) -> None:
        size = self._dump.size()
        if size == self._dump.seen:
            return
        if size != self._pending:  # a dump may still be being written (by another thread)
            self._pending = size
            return
        self._pending = None
        self._dump.acknowledge("SIGUSR1")
        if self._on_stackdump:
            self._on_stackdump(self._dump.path)

    def should_stop(self) -> bool:
        if self._dump is not None:
            self._check_stackdump()
        if self.reason is None and (self.out_dir / HALT).exists():
            self.reason = "HALT file"
        return self.reason is not None

    def restore(self) -> None:
        if self._dump is not None:
            faulthandler.unregister(signal.SIGUSR1)
            if self._dump.size() != self._dump.seen:
                self._dump.acknowledge("SIGUSR1")
            self._dump.close()
            self._dump = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


class Watchdog(threading.Thread):
    """When no step completes for `timeout_s`, faulthandler appends all stacks to
    stackdump_rank{R}_{pid}_watchdog.txt (from a C thread: works while the main thread holds the GIL
    in a C call); once per stall. This Python thread only notices the dump and calls
    `on_stall(path, idle_s)`, as soon as it can run.

    beat() after every step re-arms the timer. Re-arming restarts faulthandler's timer thread (tens
    of microseconds), so a beat within `slack_s` of the last re-arm skips it and the timer is armed
    for timeout_s + slack_s: a stall is dumped after between timeout_s and timeout_s + slack_s."""

    def __init__(self, out_dir: Path, timeout_s: float, on_stall: Callable[[Path, float], None], *,
                 rank: int = 0):
        super().__init__(name="watchdog", daemon=True)
        self.out_dir, self.timeout_s, self.on_stall = out_dir, timeout_s, on_stall
        self.slack_s = min(1.0, timeout_s * 0.05)
        self.path = stackdump_path(out_dir, rank, "watchdog")
        self._dump = DumpFile(self.path, f"watchdog stack dumps of rank {rank}: appended when no step "
                                         f"completes for {timeout_s:g} s (runtime.watchdog_s)")
        self._last = time.monotonic()
        self._gap = 0.0  # the last completed interval between beats
        self._armed_at: float | None = None
        self._stop_event = threading.Event()

    def _arm(self, now: float) -> None:
        faulthandler.dump_traceback_later(self.timeout_s + self.slack_s, repeat=False, file=self._dump.file,
                                          exit=False)
        self._armed_at = now

    def start(self) -> None:
        self._last = time.monotonic()
        self._arm(self._last)
        super().start()

    def beat(self) -> None:
        now = time.monotonic()
        self._gap, self._last = now - self._last, now
        if self._armed_at is not None and now - self._armed_at >= self.slack_s:
            self._arm(now)

    def run(self) -> None:
        poll = min(1.0, max(0.02, self.timeout_s / 10))
        while not self._stop_event.wait(poll):
            size = self._dump.size()
            if size == self._dump.seen:
                continue
            self._dump.settled_size(size)
            idle = time.monotonic() - self._last
            if idle < self.timeout_s:  # the stall ended before this thread could run (GIL held)
                idle = max(self._gap, self.timeout_s)
            self._dump.acknowledge(f"watchdog: no step for {idle:.1f}s")
            self.on_stall(self.path, idle)

    def stop(self) -> None:
        self._stop_event.set()
        if self._armed_at is not None:
            faulthandler.cancel_dump_traceback_later()
            self._armed_at = None
        if self.is_alive() and self is not threading.current_thread():
            self.join(timeout=5)
        if not self.is_alive():
            self._dump.close()
