"""Downstream tasks in the training loop (train.eval_tasks): loaded at start-up, scored at each evaluation.

    tasks = LoopTasks.load(cfg)      # None when train.eval_tasks is empty; a UserError for a task that cannot be
                                     # loaded, before the run claims its out_dir (nothing written)
    row = tasks.score(raw_model, info, amp_dtype, fsdp=..., tokens_seen=...)   # every rank: a collective
    recorder.log(step, row)          # kind 'tasks': tasks.csv, the summary, TensorBoard / W&B, heartbeat, console

The runner (train/trainer/runner.py) scores where it evaluates (eval_every, eval_at_start, eval_only) and off the
training clock. Each rank scores its share of every task's fixed subset (train.eval_tasks_limit docs, seeded: the
same docs at every step, so the curves compare the same items) with train/evaluation/tasks.py's score_tasks; the
per-doc log-likelihoods are gathered over the CPU control group, so every rank gets the same row. The model is the
Transformer itself (not its DDP / compiled wrapper; FSDP-sharded modules run in lockstep), in eval mode under the
run's autocast, and gets its training mode back. Rows are at most train.seq_len tokens (the context the run trains
for), as `python -m train.tasks` reads a checkpoint of this run. Nothing here is imported by a run without tasks.
"""
from __future__ import annotations

import time

import torch

from train.core.config import RunConfig
from train.core.distributed import DistInfo, autocast_context
from train.core.errors import ConfigError

# the tasks.csv columns a row carries, from score_tasks' metrics (step and tokens_seen come from the run)
SCORE_KEYS = ("task", "primary_metric", "primary", "primary_stderr", "acc", "acc_stderr", "acc_norm",
              "acc_norm_stderr", "acc_per_char", "acc_per_byte", "acc_per_token", "gold_loglik", "chance", "items",
              "seconds")


class LoopTasks:
    def __init__(self, tasks: list, tokenizer, *, limit: int, max_len: int):
        """tasks: train/evaluation/tasks_data.py Tasks (distinct names); tokenizer: the run's (data.tokenizer)."""
        self.tasks, self.tokenizer, self.limit, self.max_len = tasks, tokenizer, limit, max_len
        self.batch_tokens: int | None = None  # fixed at the first scoring: the same batches at every step

    @classmethod
    def load(cls, cfg: RunConfig) -> LoopTasks | None:
        """Every task of train.eval_tasks read and checked, and the tokenizer loaded (UserError, one line, for the
        first that fails); None without tasks."""
        if not cfg.train.eval_tasks:
            return None
        from train.data.tokenizers import load_tokenizer
        from train.evaluation.tasks_data import load_task

        tasks = list({t.name: t for t in (load_task(spec) for spec in cfg.train.eval_tasks)}.values())
        tokenizer = load_tokenizer(cfg.data.tokenizer)  # a DataError (UserError) when it cannot be loaded
        if tokenizer.n_vocab > cfg.model.vocab_size:
            raise ConfigError(f"train.eval_tasks: tokenizer {tokenizer.name} (data.tokenizer) has {tokenizer.n_vocab} "
                              f"ids but model.vocab_size is {cfg.model.vocab_size}; the tasks are encoded with it")
        return cls(tasks, tokenizer, limit=cfg.train.eval_tasks_limit,
                   max_len=min(cfg.train.seq_len, cfg.model.max_seq_len))

    def describe(self) -> str:
        """'hellaswag:rc_0shot, my.jsonl: at most 500 docs each, rows of at most 1024 tokens'."""
        return (f"{', '.join(t.name for t in self.tasks)}: at most {self.limit:,} docs each "
                f"({', '.join(f'{min(len(t.docs), self.limit):,}' for t in self.tasks)}), rows of at most "
                f"{self.max_len} tokens")

    def score(self, model: torch.nn.Module, info: DistInfo, amp_dtype: torch.dtype, *, fsdp: bool,
              tokens_seen: int) -> dict:
        """Score every task on every rank (a collective): the 'tasks' row {kind, tokens_seen, seconds, tasks: [one
        dict of SCORE_KEYS per task]}, the same on every rank. model: the Transformer itself."""
        from train.evaluation.tasks import default_batch_tokens, score_tasks

        device = info.device
        if self.batch_tokens is None:
            self.batch_tokens = default_batch_tokens(model.cfg, self.max_len, device)[0]
        started = time.perf_counter()
        results = score_tasks(model, self.tokenizer, self.tasks, limit=self.limit, device=device,
                              batch_tokens=self.batch_tokens, max_len=self.max_len, rank=info.rank,
                              world=info.world_size, group=info.control_group, lockstep=fsdp and info.enabled,
                              autocast=lambda: autocast_context(device, amp_dtype))
        rows = [{k: result.metrics.get(k) for k in SCORE_KEYS} for result in results.values()]
        return {"kind": "tasks", "tokens_seen": tokens_seen, "seconds": time.perf_counter() - started, "tasks": rows}
