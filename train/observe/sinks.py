"""Where a run's rows go: one interface for every destination, and the recorder that fans rows out.

A row is a dict: `kind` says what it is, the other keys are its fields (a `step` key, as in a training
row, repeats the step argument and is not written as a field). Kinds: the heartbeat kinds of
train/core/artifacts.py (start, train, eval, tasks, alert, checkpoint, end, anomaly, watchdog, ...) and `sample`
(generated text, train/generation/sampling.py). A `tasks` row (train.eval_tasks, train/trainer/tasks_eval.py) holds
`tokens_seen`, `seconds` and `tasks`: one dict per task, the tasks.csv columns but the step.

    recorder = Recorder(sinks)
    recorder.log(step, {"kind": "eval", "val_loss": 3.2, "ppl": 24.5})

Every sink gets every row and decides what it writes for its kind:

| sink | writes |
|---|---|
| RunSummary (train/observe/summary.py) | metrics.json at start / checkpoint / end / anomaly, run_*.json at checkpoint / end |
| CsvSink | training.csv (train rows), val.csv (eval rows), tasks.csv (tasks rows: one line per task) |
| SamplesSink | samples.jsonl (sample rows; train.sample_every) |
| TensorBoardSink | scalars (`scalars()`: train/*, gates/*, per-layer selection/* and gates/*, val/*, tasks/<task>/*, alerts/<name>); text alerts/<name>, samples/<i> |
| WandbSink | the same scalars |
| HeartbeatSink | every row of a heartbeat kind, with all its fields |
| ConsoleSink | one line for train, eval, tasks, alert, sample, sdpa_audit, anomaly, end, eval_only rows |

`open_sinks` gives each rank its sinks, in that order: the files first, then the heartbeat that
announces them, the console last. Rank 0 of a training run has them all (W&B with runtime.wandb; tasks.csv with
train.eval_tasks, or when the out_dir has one: a resume moves its later rows aside even with the tasks off);
rank 0 of an eval-only run the heartbeat and the console; every other rank its heartbeat only.
`watchdog` rows come from the watchdog thread: only the heartbeat, which locks, writes them.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Protocol

from train.core.artifacts import (
    HEARTBEAT_KINDS,
    LAYER_SUFFIX,
    SAMPLES_JSONL,
    SUPERSEDED,
    TASK_SCALARS,
    TASKS_CSV,
    TASKS_FIELDS,
    TB_DIR,
    TRAIN_CSV,
    VAL_CSV,
    VAL_SOURCE_PREFIXES,
    heartbeat_name,
    task_label,
    train_fields,
    val_fields,
)
from train.core.config import RunConfig, data_mixture
from train.core.errors import StorageError
from train.observe.telemetry import CsvLog, Heartbeat, TensorBoard

NSA_PREFIXES = ("gate_", "sel_")  # gate and selection statistics (nsa/attention/gate_stats.py) in a train row


class Sink(Protocol):
    def log(self, step: int, row: dict) -> None: ...

    def close(self) -> None: ...


def fields(row: dict) -> dict:
    """A row's fields: everything but its kind and step."""
    return {k: v for k, v in row.items() if k not in ("kind", "step")}


def layer_scalars(key: str, values: list) -> dict:
    """A per-layer list of a train row (`<name>_layers`, train/core/artifacts.py SELECTION_HEALTH) as one scalar
    per layer: sel_recall_layers -> selection/recall/layer0, ...; gate_mean_cmp_layers -> gates/mean_cmp/layer0, ..."""
    name = key.removesuffix(LAYER_SUFFIX)
    group = "selection" if name.startswith("sel_") else "gates"
    short = name.removeprefix("sel_").removeprefix("gate_")
    return {f"{group}/{short}/layer{i}": v for i, v in enumerate(values)}


def scalars(row: dict) -> dict:
    """The TensorBoard / W&B scalars of a row: train/<column> and gates/<statistic> (train; per-layer lists as
    layer_scalars), val/loss and val/ppl (eval), tasks/<task label>/<TASK_SCALARS name> (tasks), alerts/<name> = 1 at
    the alert's step (alert); none for other kinds."""
    kind = row["kind"]
    if kind == "train":
        out = {}
        for k, v in fields(row).items():
            if isinstance(v, list):
                out.update(layer_scalars(k, v))
            else:
                out[f"gates/{k}" if k.startswith(NSA_PREFIXES) else f"train/{k}"] = v
        return out
    if kind == "eval":  # a mixture's sources: val/loss_NAME, val/bpb_NAME
        per_source = {f"val/{k[len('val_'):] if k.startswith('val_') else k}": v for k, v in row.items()
                      if k.startswith(VAL_SOURCE_PREFIXES)}
        return {"val/loss": row["val_loss"], "val/ppl": row["ppl"], **per_source}
    if kind == "tasks":
        return {f"tasks/{task_label(t['task'])}/{name}": t.get(name) for t in row["tasks"] for name in TASK_SCALARS}
    if kind == "alert":
        return {f"alerts/{row['alert']}": 1.0}
    return {}


def alert_text(row: dict) -> str:
    """'alert loss_spike: loss 4.2, window_mean 3.01, ... | message'."""
    details = ", ".join(f"{k} {f'{v:.4g}' if isinstance(v, float) else v}" for k, v in fields(row).items()
                        if k not in ("alert", "message"))
    text = f"alert {row['alert']}" + (f": {details}" if details else "")
    return text + (f" | {row['message']}" if row.get("message") else "")


class Recorder:
    """Hands each row to every sink, in order.

    A sink that cannot write (StorageError: a full disk, a quota, a file-size limit) is dropped and its one line
    kept in `failure` (the first one): this rank goes on with the step, and the trainer turns the failure into a stop
    request at the next stop vote, so every rank stops after the same step (train/trainer/stop.py) instead of this
    one leaving its peers in a collective."""

    def __init__(self, sinks: list[Sink]):
        self.sinks = list(sinks)
        self.failure: str | None = None
        self._failed: list[Sink] = []

    def log(self, step: int, row: dict) -> None:
        for sink in list(self.sinks):
            try:
                sink.log(step, row)
            except StorageError as exc:
                if sink in self.sinks:  # (the watchdog thread logs too)
                    self.sinks.remove(sink)  # a sink whose file failed is not asked again
                    self._failed.append(sink)
                self.failure = self.failure or str(exc)

    def log_last_word(self, step: int, row: dict) -> None:
        """A row every sink is asked to write, those that failed before too (a write_failed status: metrics.json may
        take it where a bigger file did not); whatever cannot be written is skipped."""
        for sink in self.sinks + self._failed:
            try:
                sink.log(step, row)
            except Exception:  # noqa: BLE001 (best effort: a failed sink's file may be closed, the disk full)
                pass

    def close(self) -> None:
        for sink in self._failed:  # each closed its file when the write failed; what is left to close fails the same
            try:
                sink.close()
            except (OSError, StorageError):
                pass
        _close_all(self.sinks)


class CsvSink:
    """The rows of one kind as one CSV file (rows after a resumed checkpoint's step moved aside: train/observe/telemetry.py).
    lines: the key of a list of dicts in the row, one CSV line each, with the row's other fields (a tasks row's
    `tasks`); None: the row is one line."""

    def __init__(self, path: Path, columns: list[str], kind: str, resume_step: int | None, lines: str | None = None):
        self.kind, self.lines = kind, lines
        self._csv = CsvLog(path, columns, resume_step)

    def log(self, step: int, row: dict) -> None:
        if row["kind"] != self.kind:
            return
        shared = {"step": step, **fields(row)}
        for line in shared.pop(self.lines) if self.lines else [{}]:
            self._csv.write({**shared, **line})  # columns outside the schema are not written

    def close(self) -> None:
        self._csv.close()


class SamplesSink:
    """'sample' rows, one JSON line per prompt, in samples.jsonl (train.sample_every). On resume, lines of steps
    after the checkpoint's are moved to samples.jsonl.superseded (kept, not lost), as the CSVs' rows are."""

    def __init__(self, path: Path, resume_step: int | None):
        self.path = path
        if resume_step is not None and path.exists():
            self._move_aside_after(resume_step)

    def _move_aside_after(self, step: int) -> None:
        lines = self.path.read_text(encoding="utf-8").splitlines(keepends=True)
        later = [line for line in lines if _json_step(line) > step]
        if not later:
            return
        with open(self.path.with_name(self.path.name + SUPERSEDED), "a", encoding="utf-8") as f:
            f.writelines(later)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("".join(line for line in lines if _json_step(line) <= step), encoding="utf-8")
        os.replace(tmp, self.path)

    def log(self, step: int, row: dict) -> None:
        if row["kind"] == "sample":
            with open(self.path, "a", encoding="utf-8") as f:
                f.writelines(json.dumps(sample, ensure_ascii=False) + "\n" for sample in row["samples"])

    def close(self) -> None:
        pass


def _json_step(line: str) -> int:
    """The step of one samples.jsonl line; a torn line counts as after every checkpoint (moved aside)."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 2**62


class HeartbeatSink:
    def __init__(self, path: Path, rank: int):
        self._beat = Heartbeat(path, rank)

    def log(self, step: int, row: dict) -> None:
        if row["kind"] in HEARTBEAT_KINDS:
            self._beat.emit(row["kind"], step, **fields(row))

    def close(self) -> None:
        self._beat.close()


class TensorBoardSink:
    def __init__(self, log_dir: Path):
        self._tb = TensorBoard(log_dir)

    def log(self, step: int, row: dict) -> None:
        if values := scalars(row):
            self._tb.scalars(step, values)
        if row["kind"] == "alert":
            self._tb.text(step, f"alerts/{row['alert']}", alert_text(row))
        elif row["kind"] == "sample":
            for i, sample in enumerate(row["samples"]):
                shown = (sample["prompt"] + sample["text"]).splitlines() or [""]
                self._tb.text(step, f"samples/{i}", "\n".join("    " + line for line in shown))  # a Markdown code block

    def close(self) -> None:
        self._tb.close()


class WandbSink:
    def __init__(self, cfg: RunConfig, out_dir: Path):
        from train.observe.wandb_log import WandbLogger

        self._logger = WandbLogger(cfg, out_dir)

    def log(self, step: int, row: dict) -> None:
        if values := scalars(row):
            self._logger.log(step, values)

    def close(self) -> None:
        self._logger.finish()


class ConsoleSink:
    """One line per row of a kind that has a line (stdout; train/core/console.py survives a vanished reader)."""

    def __init__(self, out_dir: Path):
        self.out_dir = out_dir

    def log(self, step: int, row: dict) -> None:
        line = self.line(step, row)
        if line is not None:
            print(line, flush=True)

    def line(self, step: int, row: dict) -> str | None:
        kind = row["kind"]
        if kind == "train":
            mfu = f" mfu {row['mfu'] * 100:.1f}%" if row.get("mfu") is not None else ""
            return (f"step {step:>6} | loss {row['loss']:.4f} | lr {row['lr']:.2e} | "
                    f"{row['toks_per_s']:,.0f} tok/s | norm {row['grad_norm']:.3f}{mfu}")
        if kind == "eval":
            return f"step {step:>6} | val loss {row['val_loss']:.4f} | ppl {row['ppl']:.2f}"
        if kind == "tasks":
            scores = " | ".join(f"{task_label(t['task'])} {t['primary_metric']} {t['primary']:.3f} ± "
                                f"{t['primary_stderr']:.3f}" for t in row["tasks"])
            return f"step {step:>6} | tasks {scores} ({row['seconds']:.1f} s)"
        if kind == "alert":
            return f"step {step:>6} | {alert_text(row)}"
        if kind == "sample":
            first = row["samples"][0]
            return f"step {step:>6} | sample: {first['prompt'] + first['text']!r:.120}"
        if kind == "sdpa_audit":
            return f"sdpa audit: {row['sites']}"
        if kind == "anomaly":
            return f"HALT: {row['message']}; last good checkpoint kept"
        if kind == "end":
            return f"done: step {step} ({row['reason']}); checkpoint in {self.out_dir}"
        if kind == "eval_only":
            val = row["val_loss"]
            return f"eval_only | step {step} | val loss {val:.4f} | ppl {math.exp(min(val, 50.0)):.2f}"
        return None

    def close(self) -> None:
        pass


def open_sinks(cfg: RunConfig, out_dir: Path, *, rank: int, resume_step: int | None) -> list[Sink]:
    """This rank's sinks (see the table above); resume_step: the step a resumed run restarts from."""
    sinks: list[Sink] = []
    try:
        if rank == 0 and not cfg.train.eval_only:
            mixture = data_mixture(cfg)
            sources = () if mixture.single else mixture.names
            sinks += [CsvSink(out_dir / TRAIN_CSV, train_fields(sources, cfg.data.reads_streams, bool(cfg.train.seq_stages)), "train", resume_step),
                      CsvSink(out_dir / VAL_CSV, val_fields(sources), "eval", resume_step)]
            if cfg.train.eval_tasks or (out_dir / TASKS_CSV).exists():  # resumed without tasks: its rows still move aside
                sinks.append(CsvSink(out_dir / TASKS_CSV, TASKS_FIELDS, "tasks", resume_step, lines="tasks"))
            sinks.append(TensorBoardSink(out_dir / TB_DIR))
            if cfg.train.sample_every:
                sinks.append(SamplesSink(out_dir / SAMPLES_JSONL, resume_step))
            if cfg.runtime.wandb:
                sinks.append(WandbSink(cfg, out_dir))
        sinks.append(HeartbeatSink(out_dir / heartbeat_name(rank), rank))
        if rank == 0:
            sinks.append(ConsoleSink(out_dir))
    except BaseException:
        _close_all(sinks)
        raise
    return sinks


def _close_all(sinks: list[Sink]) -> None:
    """Close every sink, even when one fails; the first failure is raised afterwards."""
    error = None
    for sink in sinks:
        try:
            sink.close()
        except Exception as exc:  # noqa: BLE001 (re-raised below)
            error = error or exc
    if error is not None:
        raise error
