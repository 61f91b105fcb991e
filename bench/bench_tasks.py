"""Throughput of the downstream-task scorer (train/evaluation/tasks.py) and the time for a whole task.

    .venv/bin/python bench/bench_tasks.py [--configs configs/train_showcase.yaml configs/m7c_125m_80g.yaml]
        [--task hellaswag] [--limit 100] [--device cpu]

For each config: the model it describes (random weights: the scorer's speed does not depend on them) and its
tokenizer score the first `limit` docs of the seeded subset of `task`, rows of at most the config's
train.seq_len tokens, the batch chosen as `python -m train.tasks` chooses it. Reported: tokens/s, seconds per
doc, and the time for every doc of the task extrapolated from them (tokens per doc measured on the subset).
Prints one JSON object; --out writes it (bench/results/tasks_throughput.json).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from nsa.model import Transformer
from train.core.config import load_config
from train.data.tokenizers import load_tokenizer
from train.evaluation.tasks import default_batch_tokens, score_tasks
from train.evaluation.tasks_data import load_task

CONFIGS = ["configs/train_showcase.yaml", "configs/m7c_125m_80g.yaml"]


def bench_config(path: str, task, limit: int, device: torch.device) -> dict:
    cfg = load_config(path, ["--runtime.device=cpu"] if device.type == "cpu" else [])
    torch.manual_seed(0)
    model = Transformer(cfg.model).to(device).eval()
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    max_len = min(cfg.train.seq_len, cfg.model.max_seq_len)
    batch_tokens, why = default_batch_tokens(cfg.model, max_len, device)
    score_tasks(model, tokenizer, [task], limit=2, device=device, max_len=max_len, batch_tokens=batch_tokens)  # warm
    started = time.perf_counter()
    metrics = score_tasks(model, tokenizer, [task], limit=limit, device=device, max_len=max_len,
                          batch_tokens=batch_tokens)[task.name].metrics
    seconds = time.perf_counter() - started
    docs_all = len(task.docs)
    return {"config": path, "attention": cfg.model.attention, "params": sum(p.numel() for p in model.parameters()),
            "tokenizer": cfg.data.tokenizer, "max_len": max_len, "batch_tokens": batch_tokens, "batch_from": why,
            "docs": metrics["items"], "tokens": metrics["tokens"], "seconds": round(seconds, 2),
            "tokens_per_s": round(metrics["tokens"] / seconds, 1),
            "docs_all": docs_all, "seconds_all_docs_estimate": round(seconds / metrics["items"] * docs_all, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=CONFIGS)
    p.add_argument("--task", default="hellaswag")
    p.add_argument("--limit", type=int, default=100)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    task = load_task(args.task)
    report = {"task": task.name, "device": str(device), "threads": torch.get_num_threads(),
              "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "torch": torch.__version__,
              "results": [bench_config(path, task, args.limit, device) for path in args.configs]}
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
