"""The run's status and summary files, as a sink (train/observe/sinks.py) on rank 0 of a training run:

    metrics.json        rewritten atomically at start, at each checkpoint, at the end and on an anomaly
    run_YYYYMMDD_HHMMSS.json  (seeds 001/002) config, hardware, per-interval metrics, evaluations, task scores,
                        summary; rewritten at each checkpoint and at the end

It keeps this process's train, eval and tasks rows (a resumed run's summary covers its own invocation) and
reads the live TrainState for the counters. The latest score of each downstream task (train.eval_tasks) goes into
both files under `tasks`; a resumed run starts from those tasks.csv holds up to its checkpoint's step.
Fields: docs/ARTIFACTS.md (METRICS_FIELDS in train/core/artifacts.py).
"""
from __future__ import annotations

import math
import platform
import subprocess
import time
from pathlib import Path

import torch

from train.checkpoint import io as ckpt_io
from train.checkpoint.train_state import TrainState
from train.core.artifacts import (METRICS_JSON, RUN_SUMMARY_NAME, TASKS_CSV, VAL_SOURCE_PREFIXES, WRITE_FAILED,
                                  latest_task_rows, read_csv)
from train.core.config import RunConfig
from train.core.distributed import DistInfo
from train.observe.efficiency import Efficiency
from train.observe.sinks import fields
from train.observe.telemetry import write_json_atomic

# what the summary keeps of each downstream task's latest evaluation (tasks.csv has every column)
SUMMARY_TASK_KEYS = ("step", "primary_metric", "primary", "primary_stderr", "acc", "acc_norm", "items")


def git_sha() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


class RunSummary:
    def __init__(self, out_dir: Path, cfg: RunConfig, state: TrainState, *, info: DistInfo, amp_dtype: torch.dtype,
                 efficiency: Efficiency, params: tuple[int, int], data_description: dict, started: float,
                 data_restarts: list[dict] | None = None, extended_from: dict | None = None):
        """params: (all, non-embedding); started: unix time of the start (names run_*.json); data_restarts: the
        steps where the training data started afresh, and why (data.restart_on_change)."""
        self.out_dir, self.cfg, self.state, self.info = out_dir, cfg, state, info
        self.precision = str(amp_dtype).replace("torch.", "")
        self.report, self.peak = efficiency.report, efficiency.peak
        self.params, self.data_description, self.started = params, data_description, started
        self.data_restarts = list(data_restarts or [])
        self.extended_from = extended_from  # train.extend_from's lineage (None: not an extension)
        self.git_sha = git_sha()
        self.history: list[dict] = []  # train rows of this invocation
        self.evals: list[dict] = []
        self.task_evals: list[dict] = []  # tasks.csv lines of this invocation: iter + the columns
        self.tasks: dict[str, dict] = {}  # task -> its latest scores (SUMMARY_TASK_KEYS)
        if state.step > 0:  # resumed: the scores tasks.csv holds up to the checkpoint's step
            for task, row in latest_task_rows(read_csv(out_dir / TASKS_CSV), up_to=state.step).items():
                self.tasks[task] = {k: _from_csv(row.get(k)) for k in SUMMARY_TASK_KEYS}

    def log(self, step: int, row: dict) -> None:
        kind = row["kind"]
        if kind == "train":
            self.history.append({"step": step, **fields(row)})
        elif kind == "eval":
            per_source = {k: v for k, v in row.items() if k.startswith(VAL_SOURCE_PREFIXES)}  # a data mixture's
            self.evals.append({"iter": step, "val_loss": row["val_loss"], "ppl": row["ppl"], **per_source})
        elif kind == "tasks":
            for scores in row["tasks"]:
                self.task_evals.append({"iter": step, "tokens_seen": row.get("tokens_seen"), **scores})
                self.tasks[scores["task"]] = {k: step if k == "step" else scores.get(k) for k in SUMMARY_TASK_KEYS}
        elif kind == "start":
            self.write_metrics("running")
        elif kind == "checkpoint":
            self.write_metrics("running")
            self.write_run_summary()
        elif kind == "end":
            self.write_metrics("stopped" if self.state.stop_reason else "finished")
            self.write_run_summary()
        elif kind == "anomaly":
            self.write_metrics("anomaly")
        elif kind == WRITE_FAILED:
            self.write_metrics(WRITE_FAILED)

    def close(self) -> None:
        pass

    def write_metrics(self, status: str) -> None:
        state = self.state
        last = self.history[-1] if self.history else {}
        write_json_atomic(self.out_dir / METRICS_JSON, {
            "status": status, "step": state.step, "steps": self.cfg.train.steps,
            "tokens_seen": state.tokens_seen, "last_loss": last.get("loss"),
            "last_toks_per_s": last.get("toks_per_s"), "best_val_loss": _finite_or_none(state.best_val_loss),
            "last_val_loss": state.last_val_loss, "skipped_steps": state.skipped_steps,
            "spike_skipped_steps": state.spike_skipped_steps,
            "params": self.params[0], "params_non_embedding": self.params[1],
            "flops": self.report.as_dict() if self.report is not None else None,
            "device": str(self.info.device), "world_size": self.info.world_size,
            "precision": self.precision, "torch": torch.__version__,
            "python": platform.python_version(), "git_sha": self.git_sha, "started": self.started,
            "updated": time.time(), "checkpoints": self._checkpoints(), "data": self.data_description,
            "stop_reason": state.stop_reason, "tasks": self.tasks, "data_restarts": self.data_restarts,
            **({"extended_from": self.extended_from} if self.extended_from else {}),
        })

    def write_run_summary(self) -> None:
        hist, rt, info, report = self.history, self.cfg.runtime, self.info, self.report
        warm = hist[1:] if len(hist) > 1 else hist  # the first interval includes start-up
        mfus = [h["mfu"] for h in warm if h.get("mfu") is not None]
        tps = [h["toks_per_s"] for h in warm]
        name = RUN_SUMMARY_NAME.format(stamp=time.strftime("%Y%m%d_%H%M%S", time.localtime(self.started)))
        write_json_atomic(self.out_dir / name, {
            "config": self.cfg.to_dict(),
            "hardware": {"device": str(info.device), "device_name": _device_name(info.device),
                         "world_size": info.world_size, "peak_flops_per_gpu": self.peak},
            "parallelism": {"ddp": info.enabled and not (rt.fsdp or rt.zero1), "zero1": rt.zero1 and info.enabled,
                            "fsdp": rt.fsdp and info.enabled, "ddp_compress": rt.ddp_compress},
            "calculation_method": report.calculation_method if report is not None else None,
            "flops_per_token": report.flops_per_token if report is not None else None,
            "attention_to_ffn_ratio": report.attention_to_ffn_ratio if report is not None else None,
            "training_iterations": [{"iter": h["step"], **{k: v for k, v in h.items() if k != "step"}} for h in hist],
            "eval_steps": self.evals, "task_evals": self.task_evals, "checkpoints": self._checkpoints(),
            "summary": {"steps": self.state.step, "tokens_seen": self.state.tokens_seen,
                        "avg_mfu": sum(mfus) / len(mfus) if mfus else None, "peak_mfu": max(mfus) if mfus else None,
                        "avg_toks_per_s": sum(tps) / len(tps) if tps else None,
                        "final_loss": hist[-1]["loss"] if hist else None,
                        "best_val_loss": _finite_or_none(self.state.best_val_loss), "tasks": self.tasks,
                        "wall_s": time.time() - self.started},
        })

    def _checkpoints(self) -> list[str]:
        return [p.name for _, p in ckpt_io.valid_checkpoints(self.out_dir)]


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _from_csv(text: str | None):
    """A tasks.csv cell as the value it was: an int, a float, or the text itself (a metric's name)."""
    if text is None or text == "":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
