"""Stack dumps that work when a rank is stuck: faulthandler writes them from C, so a main thread that
holds the GIL inside a C call (a hung collective) still gets its stack dumped, by SIGUSR1 and by the
watchdog. The stuck children here really hold the GIL (a ctypes.PyDLL call) and get real signals."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest


from train.trainer.safety import StopFlags, Watchdog, stackdump_path

from .helpers import TINY_MODEL

REPO = Path(__file__).resolve().parents[2]

# A default pthread mutex locked twice by the same thread waits forever. PyDLL keeps the GIL during the
# call, and the futex wait resumes after a signal handler: Python code never runs again in this process.
STUCK_CHILD = """
import ctypes, sys, threading
from pathlib import Path
from train.trainer.safety import StopFlags, Watchdog

out, mode = Path(sys.argv[1]), sys.argv[2]
out.mkdir()
libc = ctypes.PyDLL(None)
mutex = ctypes.create_string_buffer(64)  # all zero: PTHREAD_MUTEX_INITIALIZER (glibc)

def stuck_in_c_holding_the_gil():
    libc.pthread_mutex_lock(mutex)
    print("blocking", threading.get_ident(), flush=True)
    libc.pthread_mutex_lock(mutex)

if mode == "watchdog":
    dog = Watchdog(out, 1.0, lambda path, idle: None)
    dog.start()
    dog.beat()
else:
    flags = StopFlags(out)
stuck_in_c_holding_the_gil()
"""


def _spawn_stuck(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, int]:
    script = tmp_path / "stuck_child.py"
    script.write_text(STUCK_CHILD)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "out"), mode], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("blocking "), (line, proc.stderr.read() if proc.poll() is not None else "")
    # wait until the main thread sleeps in the futex (no Python code runs after this point)
    deadline = time.time() + 30
    while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "S":
        assert time.time() < deadline, "the child never blocked"
        time.sleep(0.05)
    time.sleep(0.3)
    return proc, int(line.split()[1])


def _thread_stack(text: str, ident: int) -> str:
    """The frames faulthandler printed for thread `ident` (its block up to the next blank line)."""
    m = re.search(rf"(Current thread|Thread) 0x{ident:016x} \(most recent call first\):\n((?:  .*\n?)*)", text)
    assert m, f"no stack of thread 0x{ident:016x} in:\n{text}"
    return m.group(2)


def _wait_for_stack(out: Path, ident: int, timeout: float) -> tuple[Path, str]:
    """The first stackdump_*.txt in out that holds a stack of thread `ident`, and its text."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for path in sorted(out.glob("stackdump_*.txt")):
            if f"0x{ident:016x} (most recent call first)" in path.read_text():
                time.sleep(0.2)  # let the dump finish
                return path, path.read_text()
        time.sleep(0.1)
    raise AssertionError(f"no dump of the main thread in {out} after {timeout} s: "
                         f"{sorted(p.name for p in out.glob('*'))}")


@pytest.mark.fresh_python  # dump files are named by the trainer's pid: the process's own
def test_watchdog_dumps_a_main_thread_stuck_in_c_holding_the_gil(tmp_path):
    proc, ident = _spawn_stuck(tmp_path, "watchdog")
    try:
        path, text = _wait_for_stack(tmp_path / "out", ident, timeout=15)  # the watchdog's timeout is 1 s
        assert path.name == f"stackdump_rank0_{proc.pid}_watchdog.txt"
        assert "in stuck_in_c_holding_the_gil" in _thread_stack(text, ident)
        assert "Timeout (" in text and text.startswith("# watchdog stack dumps of rank 0")
        assert proc.poll() is None  # dumped, not killed (exit=False)
    finally:
        proc.kill()
        proc.communicate(timeout=30)


@pytest.mark.fresh_python  # dump files are named by the trainer's pid: the process's own
def test_sigusr1_dumps_a_main_thread_stuck_in_c_holding_the_gil(tmp_path):
    proc, ident = _spawn_stuck(tmp_path, "sigusr1")
    try:
        proc.send_signal(signal.SIGUSR1)
        path, text = _wait_for_stack(tmp_path / "out", ident, timeout=15)
        assert path.name == f"stackdump_rank0_{proc.pid}.txt"
        assert "in stuck_in_c_holding_the_gil" in _thread_stack(text, ident)
        proc.send_signal(signal.SIGUSR1)  # a second dump is appended to the same file
        deadline = time.time() + 15
        while path.read_text().count(f"0x{ident:016x} (most recent call first)") < 2:
            assert time.time() < deadline, path.read_text()
            time.sleep(0.1)
        assert proc.poll() is None  # SIGUSR1 does not kill (chain=False)
    finally:
        proc.kill()
        proc.communicate(timeout=30)


def test_sigusr1_in_process_calls_back_names_threads_and_restores(tmp_path):
    seen: list[Path] = []
    got: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, _frame: got.append(signum))
    try:
        flags = StopFlags(tmp_path, on_stackdump=seen.append, rank=3)
        path = stackdump_path(tmp_path, 3)
        try:
            assert flags.stackdump_file == path and path.exists()
            os.kill(os.getpid(), signal.SIGUSR1)
            deadline = time.time() + 10
            while not seen:
                assert time.time() < deadline, "on_stackdump never called"
                assert not flags.should_stop()
                time.sleep(0.01)
            assert seen == [path] and got == []  # faulthandler's handler replaced ours (no chaining)
            text = path.read_text()
            ident = threading.main_thread().ident
            assert "in test_sigusr1_in_process_calls_back_names_threads_and_restores" in _thread_stack(text, ident)
            assert f"0x{ident:016x}=MainThread" in text.splitlines()[-1]  # the line Python adds after the dump
            assert not flags.should_stop() and seen == [path]  # once per dump
        finally:
            flags.restore()
        size = path.stat().st_size  # it holds a dump: kept
        os.kill(os.getpid(), signal.SIGUSR1)  # restored: our handler again, no dump
        deadline = time.time() + 10
        while not got:
            assert time.time() < deadline, "the previous SIGUSR1 handler was not restored"
            time.sleep(0.01)
        assert path.stat().st_size == size
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_stop_requests_keep_their_interface_and_unused_dump_files_go(tmp_path):
    flags = StopFlags(tmp_path)
    path = flags.stackdump_file
    try:
        assert not flags.should_stop() and flags.reason is None
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.time() + 10
        while not flags.should_stop():
            assert time.time() < deadline
            time.sleep(0.01)
        assert flags.reason == "SIGTERM"
    finally:
        flags.restore()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert not path.exists()  # no dump arrived: the header-only file is removed
    halted = StopFlags(tmp_path)
    try:
        (tmp_path / ".HALT").touch()
        assert halted.should_stop() and halted.reason == "HALT file"
    finally:
        halted.restore()


def test_watchdog_in_process_calls_back_once_per_stall(tmp_path):
    stalls: list[tuple[Path, float]] = []
    dog = Watchdog(tmp_path, 0.3, lambda path, idle: stalls.append((path, idle)), rank=1)
    dog.start()
    try:
        time.sleep(1.5)  # a stall that releases the GIL: the callback runs during it
        assert len(stalls) == 1, stalls
        path, idle = stalls[0]
        assert path == stackdump_path(tmp_path, 1, "watchdog") and idle >= 0.3
        ident = threading.main_thread().ident
        assert "in test_watchdog_in_process_calls_back_once_per_stall" in _thread_stack(path.read_text(), ident)
        for _ in range(20):  # steps that complete in time: no dump
            time.sleep(0.05)
            dog.beat()
        assert len(stalls) == 1
        time.sleep(1.5)  # a second stall
        assert len(stalls) == 2
    finally:
        dog.stop()
    assert not dog.is_alive() and path.exists()


def test_an_unused_watchdog_file_is_removed(tmp_path):
    dog = Watchdog(tmp_path, 60.0, lambda path, idle: None)
    dog.start()
    assert dog.path.exists()
    dog.beat()
    dog.stop()
    assert not dog.path.exists() and not dog.is_alive()


def test_dump_file_names(tmp_path):
    assert stackdump_path(tmp_path).name == f"stackdump_rank0_{os.getpid()}.txt"
    assert stackdump_path(tmp_path, 2, kind="watchdog").name == f"stackdump_rank2_{os.getpid()}_watchdog.txt"


@pytest.mark.fresh_python  # dump files are named by the trainer's pid: the process's own
def test_kill_9_of_a_training_run_leaves_no_empty_dump_file(tmp_path):
    """A real training run killed with SIGKILL (no cleanup code of its own runs): its watchdog file, which
    never got a dump, is gone; its SIGUSR1 file, which got one, stays."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "train", *TINY_MODEL, f"--train.out_dir={out}",
                             "--train.steps=100000", "--train.seq_len=16", "--train.batch_size=2", "--train.log_every=1",
                             "--runtime.device=cpu", "--runtime.threads=1"], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    usr1, watchdog = out / f"stackdump_rank0_{proc.pid}.txt", out / f"stackdump_rank0_{proc.pid}_watchdog.txt"
    try:
        deadline = time.time() + 90
        beat = out / "heartbeat_rank0.jsonl"
        while not (beat.exists() and '"kind": "train"' in beat.read_text()):  # training steps
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.poll() is not None else ""
            time.sleep(0.1)
        assert usr1.exists() and watchdog.exists()  # both opened at start
        proc.send_signal(signal.SIGUSR1)
        while "(most recent call first)" not in usr1.read_text():
            assert time.time() < deadline, usr1.read_text()
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    deadline = time.time() + 15
    while watchdog.exists():
        assert time.time() < deadline, f"{watchdog.name} (no dump in it) outlived its process: {watchdog.read_text()!r}"
        time.sleep(0.05)
    assert "(most recent call first)" in usr1.read_text()  # the dump is kept
    assert sorted(p.name for p in out.glob("stackdump_*")) == [usr1.name]
