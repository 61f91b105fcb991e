"""Tiny run configs for trainer tests (CPU, seconds per run)."""
from __future__ import annotations

import csv
import json
from pathlib import Path

from train.core.config import RunConfig, load_config

TINY_MODEL = ["--model.vocab_size=320", "--model.dim=32", "--model.n_layers=2", "--model.n_heads=4",
              "--model.n_kv_heads=2", "--model.ffn_dim=64", "--model.max_seq_len=64"]


def tiny_config(out_dir: Path, *extra: str) -> RunConfig:
    args = TINY_MODEL + [
        f"--train.out_dir={out_dir}", "--train.steps=8", "--train.seq_len=32", "--train.batch_size=4",
        "--train.lr=3e-3", "--train.warmup_steps=2", "--train.log_every=2", "--train.eval_steps=2",
        "--runtime.device=cpu", "--runtime.threads=1", *extra,
    ]
    return load_config(None, args)


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
