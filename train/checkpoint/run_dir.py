"""One out_dir, one owner, one lineage: who may write it, what a start resumes from, where old files go.

The command line, usage and details: train/run_dir.py (its docstring).
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from train.checkpoint import io as ckpt_io
from train.core.artifacts import ATTEMPTS_DIR, CORRUPT_DIR, LOCK, SUPERSEDED_DIR, checkpoint_files
from train.core.errors import CheckpointError, ConfigError, UserError

# what stays in place when an early-crashed attempt is moved aside: the run's owners and the archives
KEPT_IN_PLACE = {LOCK, ".launch.lock", SUPERSEDED_DIR, CORRUPT_DIR, ATTEMPTS_DIR}
# files whose presence means "this out_dir already holds a run" (for resume=none)
RUN_FILES = ("training.csv", "val.csv", "metrics.json")


class OutDirBusy(UserError):
    """Another live process owns the out_dir."""


class OutDirLock:
    """`flock` on out_dir/.lock for the life of the process; the kernel drops it at any exit, kill -9
    included, so a crashed trainer never leaves a stale lock. The file names the holder."""

    def __init__(self, out_dir: Path):
        self.path = Path(out_dir) / LOCK
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise self._busy(fd) from None
        os.ftruncate(fd, 0)
        record = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%dT%H:%M:%S")}
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        self._fd = fd

    def check_free(self) -> None:
        """OutDirBusy, as acquire() would raise it, when a live process holds the lock; creates nothing
        (preflight and the runners' start checks: train/trainer/start_checks.py)."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise self._busy(fd) from None
        os.close(fd)

    def _busy(self, fd: int) -> OutDirBusy:
        holder = _describe_holder(fd)
        os.close(fd)
        return OutDirBusy(f"out_dir {self.path.parent} is in use by another trainer ({holder}); "
                          f"stop it first or use another train.out_dir")

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the lock
            self._fd = None


def drop_if_only_lock(out_dir: Path) -> None:
    """Remove out_dir when it holds nothing but the lock file (a start that failed in a directory it created)."""
    out_dir = Path(out_dir)
    if out_dir.is_dir() and [e.name for e in out_dir.iterdir()] == [LOCK]:
        (out_dir / LOCK).unlink(missing_ok=True)
        try:
            out_dir.rmdir()
        except OSError:  # something arrived meanwhile: leave it
            pass


def _describe_holder(fd: int) -> str:
    try:
        record = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"host {record['host']}, pid {record['pid']}, since {record['since']}"
    except (ValueError, KeyError, OSError):
        return "holder unknown"


@dataclass
class StartPlan:
    """What a start does: resume from `resume` (None: fresh) after moving each `moves` path into its
    directory under out_dir (superseded/, corrupt/, attempts/<timestamp>/); `notes` say so, one line each."""

    resume: Path | None
    moves: list[tuple[Path, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def plan_start(out_dir: Path, resume: str, *, eval_only: bool = False) -> StartPlan:
    """Decide what a start resumes and which files leave the live directory; reads, changes nothing
    (`python -m train.preflight` shows it). CheckpointError / ConfigError when the start must not happen."""
    out_dir = Path(out_dir)
    plan = StartPlan(resume=None)
    live = [e for e in out_dir.iterdir() if e.name not in KEPT_IN_PLACE and not _is_partial(e)] if out_dir.is_dir() else []
    if resume not in ("auto", "none"):
        path = Path(resume)
        problem = ckpt_io.checkpoint_problem(path)
        if problem is not None:
            raise CheckpointError(problem)
        plan.resume = path
        if not eval_only:
            _plan_supersede(out_dir, path, plan)
        return plan
    if resume == "auto":
        plan.resume = _plan_newest_valid(out_dir, plan, quarantine=not eval_only)
        if plan.resume is not None or eval_only:
            return plan
    elif eval_only:
        return plan
    else:  # none
        named = checkpoint_files(out_dir)
        previous = [n for n in RUN_FILES if (out_dir / n).exists()] + [p.name for _, p in named]
        if previous:
            hint = "--train.resume=auto to continue it" if named else "a new train.out_dir"
            raise ConfigError(f"out_dir {out_dir} already holds a run ({', '.join(previous[:3])}); use {hint}")
        return plan
    moving = {path for path, _ in plan.moves}
    attempt = [e for e in live if e not in moving]
    if attempt:
        dest = f"{ATTEMPTS_DIR}/{time.strftime('%Y%m%d_%H%M%S')}"
        plan.moves += [(e, dest) for e in sorted(attempt)]
        plan.notes.append(f"note: {out_dir} holds an attempt without a valid checkpoint "
                          f"({', '.join(e.name for e in sorted(attempt)[:3])}{', ...' if len(attempt) > 3 else ''}); "
                          f"its files move to {out_dir / dest}/ and training starts fresh")
    return plan


def apply_start(out_dir: Path, plan: StartPlan, *, eval_only: bool = False) -> None:
    """Carry a plan out: partial writes removed, planned moves made (never overwriting), latest.pt
    pointed at the newest valid checkpoint. Call with the lock held, on one rank."""
    out_dir = Path(out_dir)
    if eval_only:
        return
    for entry in out_dir.iterdir():
        if _is_partial(entry):
            entry.unlink(missing_ok=True)
    for path, dest in plan.moves:
        move_aside(path, out_dir / dest)
    ckpt_io.repoint_latest(out_dir)


def _plan_newest_valid(out_dir: Path, plan: StartPlan, quarantine: bool) -> Path | None:
    """Newest checkpoint that validates; newer invalid ones go to corrupt/ (when quarantine)."""
    bad: list[tuple[Path, str]] = []
    chosen = None
    for _, path in reversed(checkpoint_files(out_dir)):
        problem = ckpt_io.checkpoint_problem(path)
        if problem is None:
            chosen = path
            break
        bad.append((path, problem))
    instead = f"resuming from {chosen.name}" if chosen else "no valid checkpoint left"
    for path, problem in bad:
        if quarantine:
            plan.moves.append((path, CORRUPT_DIR))
            plan.notes.append(f"warning: {path.name} failed validation and moves to {out_dir / CORRUPT_DIR}/ "
                              f"({instead}): {problem}")
        else:
            plan.notes.append(f"warning: {path.name} failed validation ({instead}): {problem}")
    return chosen


def _plan_supersede(out_dir: Path, resume: Path, plan: StartPlan) -> None:
    """Resuming from step N: checkpoints after N, or of another lineage, leave the live directory."""
    ckpt = ckpt_io.load_checkpoint(resume)
    step, lineage = ckpt["step"], ckpt.get("lineage")
    leaving = []
    for other_step, path in checkpoint_files(out_dir):
        if path.resolve() == resume.resolve():
            continue
        if other_step > step or (ckpt_io.is_valid(path) and ckpt_io.load_checkpoint(path).get("lineage") != lineage):
            leaving.append(path)
    if leaving:
        plan.moves += [(p, SUPERSEDED_DIR) for p in leaving]
        plan.notes.append(f"note: resuming from step {step}: {len(leaving)} newer or foreign checkpoint(s) move to "
                          f"{out_dir / SUPERSEDED_DIR}/ ({', '.join(p.name for p in leaving)})")


def _is_partial(entry: Path) -> bool:
    """A temporary file of an atomic write (`.name.tmp<pid>`): never a checkpoint or a log."""
    return entry.name.startswith(".") and ".tmp" in entry.name and entry.is_file()


def move_aside(path: Path, dest_dir: Path) -> Path:
    """Move path into dest_dir without overwriting: a name already there gets a ~N suffix."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    target = dest_dir / path.name
    n = 1
    while target.exists() or target.is_symlink():
        n += 1
        target = dest_dir / f"{path.stem}~{n}{path.suffix}"
    os.replace(path, target)
    return target
