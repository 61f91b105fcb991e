"""File writers of the run artefacts: CSV (training.csv, val.csv, tasks.csv), JSON lines (heartbeat_rank{R}.jsonl),
TensorBoard events (tb/), atomic JSON (metrics.json, run_*.json, eval results).

Which row goes to which file is train/observe/sinks.py's business; schemas are documented in docs/ARTIFACTS.md.
"""
from __future__ import annotations

import csv
import json
import math
import os
import threading
import time
from pathlib import Path

from train.core.artifacts import SUPERSEDED
from train.core.errors import StorageError


def _fmt(v):
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return v


class CsvLog:
    """Append-only CSV with a header. On resume, rows logged after the checkpoint step are moved to
    `<name>.superseded` (kept, not lost) so the live file has each step once."""

    def __init__(self, path: Path, fields: list[str], resume_step: int | None):
        self.path, self.fields = path, fields
        if resume_step is not None and path.exists():
            self._truncate_after(resume_step)
        if path.exists() and path.stat().st_size and self._header() != fields:  # written by an older version
            self._rewrite(self._rows())
        new = not path.exists() or path.stat().st_size == 0
        self._f = open(path, "a", newline="")
        self._w = csv.DictWriter(self._f, fieldnames=fields, extrasaction="ignore")
        if new:
            self._w.writeheader()
            self._f.flush()

    def _header(self) -> list[str]:
        with open(self.path, newline="") as f:
            return next(csv.reader(f), [])

    def _rows(self) -> list[dict]:
        with open(self.path, newline="") as f:
            return list(csv.DictReader(f))

    def _truncate_after(self, step: int) -> None:
        rows = self._rows()
        keep = [r for r in rows if r.get("step", "").isdigit() and int(r["step"]) <= step]
        later = [r for r in rows if r not in keep]
        if not later:
            return
        self._append_superseded(later)
        self._rewrite(keep)

    def _append_superseded(self, rows: list[dict]) -> None:
        """Rows moved aside go to `<name>.superseded`, a CSV with this log's header like the live file. One written
        by an older version (another header, or none: its first line a row) is rewritten under this header first."""
        path = self.path.with_name(self.path.name + SUPERSEDED)
        if path.exists() and path.stat().st_size:
            with open(path, newline="") as f:
                header = next(csv.reader(f), [])
            if header != self.fields:
                with open(path, newline="") as f:
                    headerless = header[:1] != self.fields[:1]  # every log's first column is `step`
                    rows = list(csv.DictReader(f, fieldnames=self.fields if headerless else None)) + rows
                self._rewrite(rows, path)
                return
            with open(path, "a", newline="") as f:
                csv.DictWriter(f, fieldnames=self.fields, extrasaction="ignore").writerows(rows)
            return
        self._rewrite(rows, path)

    def _rewrite(self, keep: list[dict], path: Path | None = None) -> None:
        """`path` (default the log) again with this log's header and `keep` (a column it lacked stays empty),
        atomically."""
        path = path or self.path
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=self.fields, extrasaction="ignore")
            w.writeheader()
            w.writerows(keep)
        os.replace(tmp, path)

    def write(self, row: dict) -> None:
        try:
            self._w.writerow({k: _fmt(v) for k, v in row.items()})
            self._f.flush()
        except OSError as exc:  # a full disk: the rows already in the file stay whole
            raise StorageError.of(str(self.path), exc) from None

    def close(self) -> None:
        _close_after_failed_write(self._f)


def _close_after_failed_write(f) -> None:
    """Close a file (or writer) every write of which was flushed at once: all that can still be pending is a write that
    already failed (and raised StorageError), so a failure here is that one again."""
    try:
        f.close()
    except OSError:
        pass


class Heartbeat:
    """One JSON object per line: ts (unix s), time (ISO), rank, step, kind, plus kind-specific fields."""

    def __init__(self, path: Path, rank: int):
        self.rank, self.path = rank, path
        self._f = open(path, "a")
        self._lock = threading.Lock()  # the watchdog thread emits too

    def emit(self, kind: str, step: int, **fields) -> None:
        now = time.time()
        record = {"ts": round(now, 3), "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(now)),
                  "rank": self.rank, "step": step, "kind": kind}
        record.update({k: _json_safe(v) for k, v in fields.items()})
        with self._lock:
            try:
                self._f.write(json.dumps(record) + "\n")
                self._f.flush()
            except OSError as exc:
                raise StorageError.of(str(self.path), exc) from None

    def close(self) -> None:
        with self._lock:
            _close_after_failed_write(self._f)


def _json_safe(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # "nan" / "inf": strict JSON has no NaN
    if isinstance(v, list):  # per-layer statistics, the tasks of a 'tasks' record
        return [_json_safe(x) for x in v]
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    return v


class TensorBoard:
    """Scalars (and sample text) under tb/ (rank 0). A missing tensorboard package disables it with a warning line."""

    def __init__(self, log_dir: Path | None):
        self._w = None
        if log_dir is None:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            print("[telemetry] tensorboard not installed: tb/ disabled", flush=True)
            return
        _quiet_event_writer_threads()
        self._w = SummaryWriter(log_dir=str(log_dir))
        self.log_dir = log_dir

    def scalars(self, step: int, values: dict[str, float | None]) -> None:
        if self._w is None:
            return
        try:  # the writer thread's failed write is raised by the next add_* or by flush, whichever comes first
            for name, v in values.items():
                if v is not None and isinstance(v, (int, float)) and math.isfinite(v):
                    self._w.add_scalar(name, v, step)
            self._w.flush()
        except OSError as exc:
            self._failed(exc)

    def text(self, step: int, tag: str, text: str) -> None:
        """Markdown text under `tag` (alerts, generated samples)."""
        if self._w is None:
            return
        try:
            self._w.add_text(tag, text, step)
            self._w.flush()
        except OSError as exc:
            self._failed(exc)

    def _failed(self, exc: OSError) -> None:
        writer, self._w = self._w, None  # a failed writer is not asked again
        _close_after_failed_write(writer)
        raise StorageError.of(f"{self.log_dir} (TensorBoard events)", exc) from None

    def close(self) -> None:
        if self._w is not None:
            self._w.close()


def _quiet_event_writer_threads() -> None:
    """TensorBoard's event writer thread re-raises a failed write (a full disk) after storing it for the next add_* or
    flush, and Python's thread hook prints that as a traceback before the trainer's one line. Errors of those threads
    are left to the writer's caller (TensorBoard._failed: one line); every other thread's go to the previous hook."""
    previous = threading.excepthook
    if getattr(previous, "quiets_event_writers", False):
        return

    def hook(args) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and isinstance(args.exc_value, OSError):
            return  # stored on the thread (its .exception); the writer's next call raises it on the trainer's thread
        previous(args)

    hook.quiets_event_writers = True
    threading.excepthook = hook


def write_json_atomic(path: Path, obj: dict) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, default=str))


def write_text_atomic(path: Path, text: str) -> None:
    """path holds text, or (a full disk) still holds what it held: StorageError, no partial file left."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise StorageError.of(str(path), exc) from None
