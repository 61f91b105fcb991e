"""What a run writes, by name: the one place for its file names, patterns, columns, record kinds and keys,
and the readers every tool uses (trainer, monitor, handoff, post-run, analyze, the bash runbooks).

The command line, usage and details: train/artifacts.py (its docstring).
"""
from __future__ import annotations

import csv
import json
import re
from pathlib import Path

from train.core.errors import UserError

# ---- the trainer's out_dir ------------------------------------------------------------------------
CONFIG_YAML = "config.yaml"  # the effective config (loads again with python -m train)
TRAIN_CSV = "training.csv"  # one row per log interval
VAL_CSV = "val.csv"  # one row per evaluation
TASKS_CSV = "tasks.csv"  # train.eval_tasks: one row per evaluation and task
SUPERSEDED = ".superseded"  # suffix: CSV rows logged after the step a resume restarted from
METRICS_JSON = "metrics.json"  # the run's status, rewritten at start, each log interval and end
RUN_SUMMARY_GLOB = "run_*.json"  # run_YYYYMMDD_HHMMSS.json: config, hardware, per-interval metrics, summary
RUN_SUMMARY_NAME = "run_{stamp}.json"  # stamp: time.strftime("%Y%m%d_%H%M%S") of the run's start
HEARTBEAT_NAME = "heartbeat_rank{rank}.jsonl"  # one JSON record per line, every rank
HEARTBEAT_GLOB = "heartbeat_rank*.jsonl"
TB_DIR = "tb"  # TensorBoard events (rank 0)
SAMPLES_JSONL = "samples.jsonl"  # train.sample_every: generated samples
EVAL_JSON_GLOB = "eval_*.json"  # eval_step{N}.json (train.eval_only), eval_<name>.json (python -m train.evaluate)
TASKS_JSON_GLOB = "tasks_*.json"  # tasks_<name>.json (python -m train.tasks, beside the checkpoint it scored)
TASK_ITEM_KEYS = ("task", "doc_id", "gold", "pred")  # what every line of a tasks items file holds (read_items)
POSTRUN_JSON = "postrun.json"
CHECKPOINT_NAME = "checkpoint_step{step}.pt"
CHECKPOINT_RE = re.compile(r"^checkpoint_step(\d+)\.pt$")
LATEST = "latest.pt"  # symlink to the newest valid checkpoint
HALT = ".HALT"  # an operator's graceful-stop request
ANOMALY = ".anomaly_type"  # written when the run halts on an anomaly (exit 3)
LOCK = ".lock"  # flock of the one trainer that owns the out_dir
STACKDUMP_NAME = "stackdump_rank{rank}_{pid}{suffix}.txt"  # suffix "" (SIGUSR1) or "_watchdog"
STACKDUMP_GLOB = "stackdump_*.txt"
SUPERSEDED_DIR, CORRUPT_DIR, ATTEMPTS_DIR = "superseded", "corrupt", "attempts"  # moved aside, never deleted

TRAIN_FIELDS = ["step", "loss", "lr", "toks_per_s", "grad_norm", "dt_step_s", "dt_fetch_s", "tokens_seen",
                "skipped_steps", "spike_skipped_steps", "mfu", "tflops", "toks_per_s_per_gpu", "mem_alloc_mib", "mem_reserved_mib",
                "interval_steps"]  # steps averaged in the row: < train.log_every marks a partial interval (a stop, a resume)
VAL_FIELDS = ["step", "val_loss", "ppl"]
# a data mixture adds, per source NAME (docs/ARTIFACTS.md): val.csv val_loss_NAME (its own validation split's mean
# loss) and bpb_NAME (bits per byte, where the split records its text bytes and has no loss mask), training.csv
# share_NAME (the share of the logged interval's rows that came from it) and rows_NAME (its rows so far); val_loss is
# then the sum of the sources' losses weighted as the current stage
VAL_LOSS_PREFIX, BPB_PREFIX, SHARE_PREFIX, ROWS_PREFIX = "val_loss_", "bpb_", "share_", "rows_"
VAL_SOURCE_PREFIXES = (VAL_LOSS_PREFIX, BPB_PREFIX)


def val_fields(sources: tuple[str, ...] = ()) -> list[str]:
    """val.csv's columns for a run over these mixture sources (none: a run without a mixture)."""
    return VAL_FIELDS + [prefix + name for name in sources for prefix in VAL_SOURCE_PREFIXES]


# a run that reads a stream source adds (docs/DATA.md "Remote sources"): data_retries and data_stalls (failed reads
# retried so far, every rank's together; stalls: those that timed out) and data_wait_s (the longest any rank waited)
RETRY_FIELDS = ["data_retries", "data_stalls", "data_wait_s"]


def train_fields(sources: tuple[str, ...] = (), streams: bool = False, staged: bool = False) -> list[str]:
    """training.csv's columns for a run over these mixture sources (none: a run without a mixture); streams: a stream
    source is read (its retry counts); staged: train.seq_stages (the step's seq_len)."""
    return (TRAIN_FIELDS + [prefix + name for prefix in (SHARE_PREFIX, ROWS_PREFIX) for name in sources]
            + (RETRY_FIELDS if streams else [])
            + (["seq_len"] if staged else []))
# tasks.csv: the scores of one task at one evaluation (train/evaluation/tasks_metrics.py defines them); tokens_seen is
# the run's training tokens at that step
TASKS_FIELDS = ["step", "tokens_seen", "task", "primary_metric", "primary", "primary_stderr", "acc", "acc_stderr",
                "acc_norm", "acc_norm_stderr", "acc_per_char", "acc_per_byte", "acc_per_token", "gold_loglik", "chance",
                "items", "seconds"]
TASK_SCALARS = ("primary", "acc", "acc_norm", "gold_loglik")  # TensorBoard / W&B: tasks/<task_label>/<name>
TASK_SUFFIXES = (".jsonl.gz", ".jsonl")  # a task given as a path to a requests file

WRITE_FAILED = "write_failed"  # a checkpoint or log could not be written (a full disk): exit 4, train/trainer/runner.py
# heartbeat record kinds (field "kind"); every record also has ts, time, rank, step
HEARTBEAT_KINDS = ("start", "train", "eval", "tasks", "eval_only", "checkpoint", "alert", "anomaly", "end", "watchdog",
                   "stackdump", "profile", "sdpa_audit", "data_outage", "stage", WRITE_FAILED)
# NSA statistics a 'train' record carries (nsa/attention/gate_stats.py computes them under these names)
GATE_STATS = ("gate_entropy_mean", "gate_entropy_min", "gate_max_mean", "gate_collapse_frac", "gate_saturated_frac",
              "gate_share_cmp", "gate_share_sel", "gate_share_win")
SELECTION_STATS = ("sel_free_frac", "sel_distance_mean", "sel_free_distance_mean")
# selection health (nsa/attention/selection_health.py): the mean over layers under the name, and each layer's value
# in a list under the name + LAYER_SUFFIX (sel_recall_layers = [layer 0, layer 1, ...]); sel_recall is computed
# after the logged step, off the training clock
SELECTION_HEALTH = ("sel_recall", "sel_outside_window", "gate_mean_cmp", "gate_mean_sel", "gate_mean_win")
LAYER_SUFFIX = "_layers"

METRICS_FIELDS = ("status", "step", "steps", "tokens_seen", "last_loss", "last_toks_per_s", "best_val_loss",
                  "last_val_loss", "skipped_steps", "spike_skipped_steps", "params", "params_non_embedding", "flops", "device", "world_size",
                  "precision", "torch", "python", "git_sha", "started", "updated", "checkpoints", "data", "stop_reason",
                  "tasks")
CRASH_FIELDS = ("exit_code", "crashed_at_step")  # added when a launcher records a crash (train/observe/run_status.py)
CRASHED = "crashed"  # the trainer died without a word (a signal, the OOM killer); train/observe/run_status.py says so
ENDED_STATUSES = ("finished", "stopped", "anomaly", WRITE_FAILED, CRASHED)
STATUSES = ("running",) + ENDED_STATUSES

# ---- the runbooks' run dir (ARTIFACTS_DIR/train_runs/<name>_<timestamp>/) ---------------------------
RUN_INFO = "run.info"  # 'key: value' lines; a resumed launch appends
RUN_DIR_FILES = ("run.info", "launch_info.txt", "smoke.log", "train.log", "preflight.log", "causality.log")


def checkpoint_name(step: int) -> str:
    return CHECKPOINT_NAME.format(step=step)


def heartbeat_name(rank: int) -> str:
    return HEARTBEAT_NAME.format(rank=rank)


def task_label(task: str) -> str:
    """A task's name in scalar tags: hellaswag:rc_0shot as it is; a requests file by its name without the suffix
    (runs/x/my_items.jsonl.gz -> my_items)."""
    for suffix in TASK_SUFFIXES:
        if task.endswith(suffix):
            return Path(task).name.removesuffix(suffix)
    return task


def latest_task_rows(rows: list[dict], up_to: int | None = None) -> dict[str, dict]:
    """tasks.csv rows (read_csv) -> task -> its row of the latest step (at most `up_to`), in the order tasks first
    appear."""
    latest: dict[str, dict] = {}
    for row in rows:
        step = int(row["step"])
        if (up_to is None or step <= up_to) and row.get("task") and \
                (row["task"] not in latest or step >= int(latest[row["task"]]["step"])):
            latest[row["task"]] = row
    return latest


def checkpoint_files(out_dir: Path) -> list[tuple[int, Path]]:
    """Files named like checkpoints in out_dir, oldest first (validity is train/checkpoint/io.py's business)."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in out_dir.iterdir() if (m := CHECKPOINT_RE.match(p.name)))


# ---- readers ----------------------------------------------------------------------------------------
def read_kv(path: Path) -> dict[str, str]:
    """run.info / launch_info.txt 'key: value' lines -> dict; '#' lines skipped; a repeated key keeps its last value."""
    out: dict[str, str] = {}
    path = Path(path)
    if not path.is_file():
        return out
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.startswith("#") and ": " in line:
            key, value = line.split(": ", 1)
            out[key.strip()] = value.strip()
    return out


def read_csv(path: Path) -> list[dict[str, str]]:
    """training.csv / val.csv / tasks.csv rows (as text); rows without a numeric step (a torn last line) are skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    with open(path, newline="", encoding="utf-8") as f:
        return [r for r in csv.DictReader(f) if (r.get("step") or "").isdigit()]


def read_heartbeat(path: Path) -> list[dict]:
    """Records of one heartbeat file; a torn or foreign line is skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def read_metrics(out_dir: Path) -> dict:
    try:
        data = json.loads((Path(out_dir) / METRICS_JSON).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _number(value) -> float | None:
    """A record's number: ints and floats, and the strings "nan" / "inf" the heartbeat writes for non-finite ones."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if value in ("nan", "inf", "-inf"):
        return float(value)
    return None


def nsa_statistics(record: dict) -> dict[str, float]:
    """The gate, selection and selection-health statistics a heartbeat 'train' record carries (the means over
    layers), by their names above."""
    out = {}
    for key in GATE_STATS + SELECTION_STATS + SELECTION_HEALTH:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(value)
    return out


def layer_key(name: str) -> str:
    """The record key of a SELECTION_HEALTH statistic's per-layer list: sel_recall -> sel_recall_layers."""
    return name + LAYER_SUFFIX


def nsa_layer_statistics(record: dict) -> dict[str, list[float]]:
    """The per-layer selection health a heartbeat 'train' record carries: name -> [layer 0, layer 1, ...]
    (non-finite values, written as "nan", come back as float nan)."""
    out = {}
    for name in SELECTION_HEALTH:
        values = record.get(layer_key(name))
        if isinstance(values, list) and values:
            numbers = [_number(v) for v in values]
            if all(v is not None for v in numbers):
                out[name] = numbers
    return out


# ---- for the bash runbooks ------------------------------------------------------------------------


def read_items(path: Path) -> list[dict]:
    """A tasks items file's lines (train/evaluation/tasks_items.py writes them; docs/USE.md has the schema);
    UserError naming the file (and the line) when it is not one."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot be read ({type(exc).__name__}: {exc})") from None
    lines = []
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except ValueError as exc:
            raise UserError(f"{path} line {number}: not JSON ({exc})") from None
        if not isinstance(line, dict) or any(k not in line for k in TASK_ITEM_KEYS) or not isinstance(line["pred"], dict):
            raise UserError(f"{path} line {number}: not a train.tasks item (needs {', '.join(TASK_ITEM_KEYS)})")
        lines.append(line)
    return lines
