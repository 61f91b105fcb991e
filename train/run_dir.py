"""One out_dir, one owner, one lineage: who may write it, what a start resumes from, where old files go.

Nothing a run wrote is deleted here. A start under the exclusive lock sorts the directory first:
- newer checkpoints than the one resumed (and checkpoints of another lineage) -> `superseded/`
- checkpoints that fail validation under `resume=auto` -> `corrupt/`
- an earlier attempt's logs when no valid checkpoint is left (a crash before the first save)
  -> `attempts/<timestamp>/`, then training starts fresh
Partial writes (`.checkpoint_step*.pt.tmp<pid>`) are deleted: they never were checkpoints, and
under the lock no writer can still own them.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from train import checkpoint as ckpt_io
from train.errors import CheckpointError, ConfigError, UserError

LOCK_FILE = ".lock"
SUPERSEDED_DIR, CORRUPT_DIR, ATTEMPTS_DIR = "superseded", "corrupt", "attempts"
# what stays in place when an early-crashed attempt is moved aside: the run's owners and the archives
KEPT_IN_PLACE = {LOCK_FILE, ".launch.lock", SUPERSEDED_DIR, CORRUPT_DIR, ATTEMPTS_DIR}
# files whose presence means "this out_dir already holds a run" (for resume=none)
RUN_FILES = ("training.csv", "val.csv", "metrics.json")


class OutDirBusy(UserError):
    """Another live process owns the out_dir."""


class OutDirLock:
    """`flock` on out_dir/.lock for the life of the process; the kernel drops it at any exit, kill -9
    included, so a crashed trainer never leaves a stale lock. The file names the holder."""

    def __init__(self, out_dir: Path):
        self.path = Path(out_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe_holder(fd)
            os.close(fd)
            raise OutDirBusy(f"out_dir {self.path.parent} is in use by another trainer ({holder}); "
                             f"stop it first or use another train.out_dir") from None
        os.ftruncate(fd, 0)
        record = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%dT%H:%M:%S")}
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the lock
            self._fd = None


def _describe_holder(fd: int) -> str:
    try:
        record = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"host {record['host']}, pid {record['pid']}, since {record['since']}"
    except (ValueError, KeyError, OSError):
        return "holder unknown"


@dataclass
class StartPlan:
    """What a start does: resume from `resume` (None: fresh), after the moves that `notes` describe."""

    resume: Path | None
    notes: list[str] = field(default_factory=list)


def plan_start(out_dir: Path, resume: str, *, eval_only: bool = False) -> StartPlan:
    """Decide the checkpoint to resume and sort out_dir accordingly. Call with the lock held, on one rank."""
    out_dir = Path(out_dir)
    _remove_partial_writes(out_dir)
    plan = StartPlan(resume=None)
    if resume not in ("auto", "none"):
        path = Path(resume)
        problem = ckpt_io.checkpoint_problem(path)
        if problem is not None:
            raise CheckpointError(problem)
        plan.resume = path
        if not eval_only:
            _supersede(out_dir, path, plan.notes)
            ckpt_io.repoint_latest(out_dir)
        return plan
    if resume == "auto":
        plan.resume = _newest_valid(out_dir, plan.notes, quarantine=not eval_only)
        if plan.resume is not None:
            if not eval_only:
                ckpt_io.repoint_latest(out_dir)
            return plan
    if eval_only:
        return plan
    if resume == "none":
        previous = [n for n in RUN_FILES if (out_dir / n).exists()] + [p.name for _, p in ckpt_io.list_checkpoints(out_dir)]
        if previous:
            hint = "--train.resume=auto to continue it" if ckpt_io.list_checkpoints(out_dir) else "a new train.out_dir"
            raise ConfigError(f"out_dir {out_dir} already holds a run ({', '.join(previous[:3])}); use {hint}")
        return plan
    if not [e for e in out_dir.iterdir() if e.name not in KEPT_IN_PLACE]:
        return plan
    dest = _move_attempt(out_dir)
    plan.notes.append(f"note: {out_dir} held an attempt without a valid checkpoint; its files moved to {dest}; "
                      f"starting fresh")
    return plan


def _newest_valid(out_dir: Path, notes: list[str], quarantine: bool) -> Path | None:
    """Newest checkpoint that validates; invalid ones are moved to corrupt/ (when quarantine)."""
    bad: list[tuple[Path, str]] = []
    chosen = None
    for _, path in reversed(ckpt_io.list_checkpoints(out_dir)):
        problem = ckpt_io.checkpoint_problem(path)
        if problem is None:
            chosen = path
            break
        bad.append((path, problem))
    for path, problem in bad:
        instead = f"resuming from {chosen.name}" if chosen else "no valid checkpoint left"
        if quarantine:
            moved = move_aside(path, out_dir / CORRUPT_DIR)
            notes.append(f"warning: {path.name} failed validation and was moved to {moved} ({instead}): {problem}")
        else:
            notes.append(f"warning: {path.name} failed validation ({instead}): {problem}")
    return chosen


def _supersede(out_dir: Path, resume: Path, notes: list[str]) -> None:
    """Resuming from step N: checkpoints after N, or of another lineage, leave the live directory."""
    ckpt = ckpt_io.load_checkpoint(resume)
    step, lineage = ckpt["step"], ckpt.get("lineage")
    moved = []
    for other_step, path in ckpt_io.list_checkpoints(out_dir):
        if path.resolve() == resume.resolve():
            continue
        if other_step > step:
            moved.append(move_aside(path, out_dir / SUPERSEDED_DIR))
        elif ckpt_io.checkpoint_problem(path) is None and ckpt_io.load_checkpoint(path).get("lineage") != lineage:
            moved.append(move_aside(path, out_dir / SUPERSEDED_DIR))
    if moved:
        notes.append(f"note: resuming from step {step}: {len(moved)} newer or foreign checkpoint(s) moved to "
                     f"{out_dir / SUPERSEDED_DIR} ({', '.join(p.name for p in moved)})")


def _move_attempt(out_dir: Path) -> Path:
    dest = out_dir / ATTEMPTS_DIR / time.strftime("%Y%m%d_%H%M%S")
    n = 1
    while dest.exists():
        n += 1
        dest = dest.with_name(f"{dest.name.split('~')[0]}~{n}")
    dest.mkdir(parents=True)
    for entry in sorted(out_dir.iterdir()):
        if entry.name not in KEPT_IN_PLACE:
            os.replace(entry, dest / entry.name)
    return dest


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


def _remove_partial_writes(out_dir: Path) -> None:
    for entry in out_dir.iterdir():
        if entry.name.startswith(".") and ".tmp" in entry.name and entry.is_file():
            entry.unlink(missing_ok=True)
