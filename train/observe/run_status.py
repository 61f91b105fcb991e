"""What state a run is in, said the same way everywhere an operator looks (monitor, run.info, metrics.json,
handoff): running | finished | stopped | anomaly | write_failed | crashed.

The command line, usage and details: train/run_status.py (its docstring).
"""
from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from train.core.artifacts import (
    CRASHED,
    ENDED_STATUSES,
    LOCK,
    METRICS_JSON,
    TRAIN_CSV,
    WRITE_FAILED,
    heartbeat_name,
    read_csv,
    read_heartbeat,
    read_metrics,
)
from train.core.errors import StorageError
from train.observe.telemetry import write_json_atomic


@dataclass
class RunStatus:
    status: str  # running | finished | stopped | anomaly | write_failed | crashed | not started
    step: int  # the last step any file recorded
    exit_code: int | None = None  # of the trainer (crashed), when a launcher saw it

    @property
    def ended(self) -> bool:
        return self.status in ENDED_STATUSES

    def line(self) -> str:
        """'crashed (exit 137 at step 40)', 'running', 'finished' ..."""
        if self.status != CRASHED:
            return self.status
        code = f"exit {self.exit_code}" if self.exit_code is not None else "process gone, exit code unknown"
        return f"crashed ({code} at step {self.step})"


def owner_alive(out_dir: Path) -> bool | None:
    """Whether the process named in out_dir/.lock lives: True / False, None when this host cannot tell
    (no record, or the owner runs on another host sharing the file system)."""
    try:
        record = json.loads((Path(out_dir) / LOCK).read_text(encoding="utf-8") or "{}")
        host, pid = record["host"], int(record["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if host != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


def last_step(out_dir: Path, metrics: dict | None = None) -> int:
    """The newest step recorded by metrics.json, training.csv or rank 0's heartbeat."""
    out_dir = Path(out_dir)
    metrics = read_metrics(out_dir) if metrics is None else metrics
    rows = read_csv(out_dir / TRAIN_CSV)
    beats = read_heartbeat(out_dir / heartbeat_name(0))
    steps = [metrics.get("step"), rows[-1]["step"] if rows else None, beats[-1].get("step") if beats else None]
    return max((int(s) for s in steps if isinstance(s, (int, str)) and str(s).isdigit()), default=0)


def _exit_code(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def run_status(out_dir: Path, run_info: dict | None = None) -> RunStatus:
    """The status an operator should read. run_info: the launcher's run.info (its exit_code, if ended)."""
    out_dir = Path(out_dir)
    metrics = read_metrics(out_dir)
    status = metrics.get("status")
    step = last_step(out_dir, metrics)
    launcher_code = _exit_code((run_info or {}).get("exit_code"))
    if status == CRASHED:
        return RunStatus(CRASHED, int(metrics.get("crashed_at_step", step)), _exit_code(metrics.get("exit_code")))
    if status in ENDED_STATUSES:
        return RunStatus(status, step)
    if status is None:
        if launcher_code:  # the launcher ended with an error before the trainer wrote anything
            return RunStatus(CRASHED, step, launcher_code)
        return RunStatus("not started", step)
    # 'running' as the trainer last said: true only while its owner lives
    if owner_alive(out_dir) is False or (launcher_code is not None and owner_alive(out_dir) is None):
        if launcher_code == StorageError.exit_code:  # it said so on stderr; the full disk kept metrics.json old
            return RunStatus(WRITE_FAILED, step, launcher_code)
        return RunStatus(CRASHED, step, launcher_code)
    return RunStatus("running", step)


def mark_exited(out_dir: Path, exit_code: int) -> RunStatus:
    """After the trainer exited with exit_code: a metrics.json still saying 'running' becomes 'crashed', or
    'write_failed' for exit 4 (a file could not be written: the trainer stopped itself, but metrics.json may be
    what the full disk refused; this write may fail as well, and the status returned says it all the same).
    Nothing else in metrics.json changes. Returns the run's status either way."""
    out_dir = Path(out_dir)
    metrics = read_metrics(out_dir)
    if metrics.get("status") != "running":
        return run_status(out_dir, {"exit_code": exit_code})
    step = last_step(out_dir, metrics)
    if exit_code == StorageError.exit_code:
        try:
            write_json_atomic(out_dir / METRICS_JSON, {**metrics, "status": WRITE_FAILED, "updated": time.time()})
        except StorageError:
            pass
        return RunStatus(WRITE_FAILED, step, exit_code)
    write_json_atomic(out_dir / METRICS_JSON, {**metrics, "status": CRASHED, "exit_code": exit_code,
                                               "crashed_at_step": step, "updated": time.time()})
    return RunStatus(CRASHED, step, exit_code)
