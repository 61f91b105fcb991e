"""The run directories the bash runners write: ARTIFACTS_DIR/train_runs/<name>_<timestamp>/run.info.

The command line, usage and details: train/runs.py (its docstring).
"""
from __future__ import annotations

from pathlib import Path

from train.core.artifacts import METRICS_JSON, RUN_INFO, TRAIN_CSV, read_kv

PROGRESS_FILES = (METRICS_JSON, TRAIN_CSV)  # written once a launch trains, refreshed as it does


def out_dir_of(run_dir: Path) -> Path | None:
    out = read_kv(Path(run_dir) / RUN_INFO).get("out_dir")
    return Path(out) if out else None


def _last_progress(run_dir: Path) -> float | None:
    """mtime of the newest progress file in the run's out_dir; None when it never trained."""
    out = out_dir_of(run_dir)
    if out is None:
        return None
    times = [p.stat().st_mtime for p in (out / name for name in PROGRESS_FILES) if p.is_file()]
    return max(times) if times else None


def newest_run(artifacts: Path, prefix: str = "") -> Path | None:
    runs = sorted(p for p in (Path(artifacts) / "train_runs").glob(f"{prefix}*") if (p / RUN_INFO).is_file())
    started = [(t, p) for p in runs if (t := _last_progress(p)) is not None]
    if started:
        return max(started)[1]
    return runs[-1] if runs else None
