"""Score a checkpoint on downstream tasks and write tasks_<name>.json and tasks_<name>.items.jsonl (one line per
item: train/evaluation/tasks_items.py) beside it: `python -m train.tasks`'s library.

    result = evaluate_tasks(TasksRequest(checkpoint=Path("artifacts/run"), tasks="hellaswag,arc_easy", limit=500))

Every input is checked before the model is loaded and before anything is written (an unknown task, a missing or
malformed file, a tokenizer that cannot be loaded: one UserError). The checkpoint's own tokenizer encodes; rows
are at most the checkpoint's train.seq_len tokens (the context it was trained for; --max_len up to
model.max_seq_len). bf16 autocast on CUDA, fp32 on CPU. Under torchrun (WORLD_SIZE > 1) every rank scores its
share of the docs and rank 0 writes the files (the items file first, then the JSON that names it). A file of
another checkpoint, or not written by this tool, is never replaced (pass --name): an items file only when the JSON
beside it is this tool's for this checkpoint and names it. Progress with rate and ETA goes to stderr every
PROGRESS_EVERY_S.
"""
from __future__ import annotations

import hashlib
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from train.checkpoint.io import load_checkpoint, model_from_checkpoint, resolve_checkpoint
from train.core.distributed import autocast_context, resolve_precision
from train.core.env import launch_ranks
from train.core.errors import UserError
from train.data.tokenizers import load_tokenizer
from train.evaluation.evaluate import NAME_RE, PROGRESS_EVERY_S, duration, pick_device
from train.evaluation.tasks import default_batch_tokens, score_tasks
from train.evaluation.tasks_data import SUBSET_SEED, is_path_spec, load_task
from train.evaluation.tasks_items import item_lines, write_items
from train.observe.telemetry import write_json_atomic

TOOL = "train.tasks"  # marks the result files this tool may replace
RESULT_FILE = "tasks_{name}.json"
ITEMS_FILE = "tasks_{name}.items.jsonl"
ANOTHER_NAME = "pass --name to write another file"


@dataclass
class TasksRequest:
    """What to score; None picks the default `python -m train.tasks --help` documents."""
    checkpoint: Path  # a checkpoint file or a run directory (its newest valid checkpoint)
    tasks: str  # comma-separated: hellaswag, hellaswag:rc_5shot, path/to/requests.jsonl[.gz]
    limit: int | None = None  # docs per task: the first N of the seeded order (default all)
    batch_tokens: int | None = None  # rows x longest row per forward (default: from the model and free memory)
    max_len: int | None = None  # longest row (default: the checkpoint's train.seq_len, at most model.max_seq_len)
    device: str = "auto"  # auto | cpu | cuda
    name: str | None = None  # result file tasks_<name>.json (default: from the tasks, limit and step)
    uncond: bool = False  # also score the unconditional requests: acc_uncond (PMI)
    seed: int = SUBSET_SEED


def task_specs(text: str) -> list[str]:
    specs = list(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    if not specs:
        raise UserError("--tasks names no task (e.g. --tasks hellaswag,arc_easy)")
    return specs


def default_name(specs: list[str], limit: int | None, step: int) -> str:
    """e.g. hellaswag,arc_easy:rc_5shot + limit 500 at step 800 -> hellaswag-arc_easy_rc_5shot_limit500_step800."""
    parts = [Path(s).name.removesuffix(".gz").removesuffix(".jsonl") if is_path_spec(s) else s for s in specs]
    base = "-".join(parts)
    if len(base) > 60:
        base = f"{len(specs)}tasks_{hashlib.sha1(','.join(specs).encode()).hexdigest()[:8]}"
    return re.sub(r"[^A-Za-z0-9.-]+", "_", f"{base}{f'_limit{limit}' if limit else ''}_step{step}").strip("_")[:100]


def claim_result_files(path: Path, items: Path, checkpoint: Path) -> None:
    """Refuse to replace a file that is not this tool's result for this checkpoint: the JSON at `path`, and the
    items file unless that JSON names it."""
    prior = {}
    if path.exists():
        try:
            prior = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            prior = None
        if not (isinstance(prior, dict) and prior.get("tool") == TOOL):
            raise UserError(f"{path} already holds a file this tool did not write; {ANOTHER_NAME}")
        if Path(str(prior.get("checkpoint"))).name != checkpoint.name:
            raise UserError(f"{path} already holds the task scores of {Path(str(prior.get('checkpoint'))).name}; "
                            f"{ANOTHER_NAME}")
    if items.exists() and Path(str(prior.get("items_file"))).name != items.name:
        raise UserError(f"{items} already holds a file this tool did not write; {ANOTHER_NAME}")


def check_numbers(req: TasksRequest) -> None:
    for flag, value, least in (("--limit", req.limit, 1), ("--batch_tokens", req.batch_tokens, 1),
                               ("--max_len", req.max_len, 2)):
        if value is not None and value < least:
            raise UserError(f"{flag} must be >= {least}, got {value}")


def evaluate_tasks(req: TasksRequest) -> dict:
    """Score, write tasks_<name>.items.jsonl and tasks_<name>.json beside the checkpoint (rank 0), return the result
    (every rank)."""
    check_numbers(req)
    specs = task_specs(req.tasks)
    tasks = list({t.name: t for t in (load_task(s) for s in specs)}.values())  # hellaswag = hellaswag:rc_0shot once
    checkpoint = resolve_checkpoint(req.checkpoint).resolve()
    ckpt = load_checkpoint(checkpoint)
    step, cfg = ckpt["step"], ckpt["config"]
    del ckpt
    name = req.name or default_name(specs, req.limit, step)
    if not NAME_RE.match(name):
        raise UserError(f"--name {name!r}: use letters, digits, '.', '_' and '-' (at most 100)")
    result_path = checkpoint.parent / RESULT_FILE.format(name=name)
    items_path = checkpoint.parent / ITEMS_FILE.format(name=name)
    claim_result_files(result_path, items_path, checkpoint)
    tokenizer = load_tokenizer(cfg["data"]["tokenizer"])  # DataError (a UserError) when it cannot be loaded
    world, rank, local_rank = launch_ranks()
    device = pick_device(req.device)
    if device.type == "cuda" and world > 1:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    model, cfg = model_from_checkpoint(checkpoint, str(device))
    if req.max_len is not None and req.max_len > model.cfg.max_seq_len:
        raise UserError(f"--max_len {req.max_len} exceeds the model's max_seq_len {model.cfg.max_seq_len}")
    max_len = req.max_len or min(int(cfg["train"]["seq_len"]), model.cfg.max_seq_len)
    batch_tokens, batch_from = ((req.batch_tokens, "--batch_tokens") if req.batch_tokens is not None
                                else default_batch_tokens(model.cfg, max_len, device))
    precision = resolve_precision("auto", device)
    own_group = world > 1 and not dist.is_initialized()
    if own_group:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        started = time.perf_counter()
        progress = _progress_printer(tasks, batch_tokens, batch_from, max_len) if rank == 0 else None
        results = score_tasks(model, tokenizer, tasks, limit=req.limit, device=device, batch_tokens=batch_tokens,
                              max_len=max_len, uncond=req.uncond, seed=req.seed, rank=rank, world=world,
                              autocast=lambda: autocast_context(device, precision), progress=progress)
        seconds = time.perf_counter() - started
    finally:
        if own_group:
            dist.destroy_process_group()
    tokens = sum(r.metrics["tokens"] for r in results.values())
    result = {
        "tool": TOOL, "checkpoint": str(checkpoint), "step": step, "attention": cfg["model"]["attention"],
        "tokenizer": cfg["data"]["tokenizer"], "limit": req.limit, "seed": req.seed, "uncond": req.uncond,
        "max_len": max_len, "batch_tokens": batch_tokens, "batch_tokens_from": batch_from, "world_size": world,
        "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        "precision": str(precision).removeprefix("torch."),
        "tasks": {name: r.metrics for name, r in results.items()},
        "tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": tokens / max(seconds, 1e-9),
        "file": str(result_path), "items_file": str(items_path),
    }
    if rank == 0:
        write_items(items_path, [line for task in tasks for line in item_lines(task, results[task.name])])
        write_json_atomic(result_path, result)
    return result


def _progress_printer(tasks, batch_tokens: int, batch_from: str, max_len: int):
    """progress(done, total) for score_tasks: a first line, then one stderr line per PROGRESS_EVERY_S at most."""
    started, last = time.perf_counter(), [time.perf_counter()]

    def report(done: int, total: int) -> None:
        now = time.perf_counter()
        if done == 0:
            print(f"tasks: {', '.join(t.name for t in tasks)}: {total:,} tokens to read (this rank), rows of at most "
                  f"{max_len} tokens, {batch_tokens:,} tokens per forward ({batch_from})", file=sys.stderr, flush=True)
        elif now - last[0] >= PROGRESS_EVERY_S and done < total:
            last[0] = now
            rate = done / max(now - started, 1e-9)
            print(f"tasks: {done:,} / {total:,} tokens ({done / total:.1%}), {rate:,.0f} tokens/s, "
                  f"ETA {duration((total - done) / max(rate, 1e-9))}", file=sys.stderr, flush=True)
    return report
