"""Downstream multiple-choice tasks on a model in memory: the library the command and the training loop call.

    tasks = [load_task("hellaswag"), load_task("arc_easy")]          # train/evaluation/tasks_data.py
    results = score_tasks(model, tokenizer, tasks, limit=500)        # {task name: TaskResult}
    results["hellaswag:rc_0shot"].metrics["acc_per_char"], ...["primary"], ...["primary_stderr"]

Per task: the fixed subset of `limit` docs (tasks_data.select_docs: seeded, the same on every call and rank),
this rank's share of it (doc i of the subset when i % world == rank), each doc's choices (and their unconditional
twins when asked for) encoded and scored (tasks_scoring.py), every rank's per-doc log-likelihoods gathered
(all_gather_object over `group`) and the metrics computed from all of them on every rank (tasks_metrics.py). The
model runs in eval mode under no_grad (not inference_mode: the training loop calls this too, and tensors the
model keeps across calls, FlexAttention block masks, must stay usable by autograd) and gets its own mode back.
`model` is the project's Transformer (model.cfg is read): pass the module itself, not a DDP wrapper; an
FSDP-sharded module needs lockstep=True (every rank then runs as many forwards as the busiest). Results do not
depend on world, batch_tokens or the batch composition beyond float rounding.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from train.core.errors import UserError
from train.evaluation.eval_batch import choose_batch_size, free_memory
from train.evaluation.tasks_data import SUBSET_SEED, Task, select_docs, shard
from train.evaluation.tasks_metrics import task_metrics
from train.evaluation.tasks_scoring import dummy_forward, encode_requests, plan_batches, score_rows


@dataclass
class TaskResult:
    metrics: dict  # JSON-ready: task, file, metrics and their stderr, primary, items, tokens, seconds, tokens_per_s
    doc_index: np.ndarray  # [D] indices into task.docs of the docs scored (the seeded subset, in its order)
    loglik: list[np.ndarray]  # [D][C_d] summed log-probability of each choice's continuation (nats)
    tokens: list[np.ndarray]  # [D][C_d] continuation tokens scored (acc_per_token's length)
    uncond_loglik: list[np.ndarray] | None  # [D][C_d] the same given "Answer:" (scored with uncond=True)


LOGITS_BYTES = {"cpu": 2**28, "cuda": 2**32}  # fp32 logits per forward at most (as if every token were scored)


def default_batch_tokens(model_cfg, max_len: int, device: torch.device) -> tuple[int, str]:
    """(tokens per forward, why): eval_batch.py's choice for rows of max_len tokens (counting full logits, which
    errs small: only the continuation's rows are computed), at most LOGITS_BYTES of fp32 logits (with GPT-2's
    vocabulary on CPU, larger forwards measured no faster) and at least one row."""
    kind = "cuda" if device.type == "cuda" else "cpu"
    choice = choose_batch_size(dataclasses.replace(model_cfg, loss_chunk=0), seq_len=max_len, n_windows=10**9,
                               device=device, act_bytes=2 if kind == "cuda" else 4, free_bytes=free_memory(device))
    tokens, why = choice.size * max_len, choice.why
    cap = LOGITS_BYTES[kind] // (4 * model_cfg.vocab_size) // max_len * max_len
    if cap < tokens:
        tokens = max(cap, max_len)
        why = f"{LOGITS_BYTES[kind] / 2**20:,.0f} MiB of logits at vocab {model_cfg.vocab_size:,}"
    return tokens, f"auto: {why}"


def _local_plan(task: Task, tokenizer, selected: np.ndarray, rank: int, world: int, with_uncond: bool,
                max_len: int, batch_tokens: int):
    mine = shard(selected, rank, world)
    per_doc = 2 if with_uncond else 1
    pairs = [r for i in mine for r in (task.docs[i].requests + (task.docs[i].uncond if with_uncond else ()))]
    rows = encode_requests(tokenizer, pairs, max_len)
    starts = np.cumsum([0] + [per_doc * task.docs[i].n_choices for i in mine])  # [len(mine) + 1] first row of each doc
    return mine, rows, plan_batches(rows, batch_tokens), starts


def _gather(payload, world: int, group) -> list:
    if world == 1:
        return [payload]
    out = [None] * world
    dist.all_gather_object(out, payload, group=group)
    return out


def score_tasks(model: torch.nn.Module, tokenizer, tasks: Sequence[Task], *, limit: int | None = None,
                device: torch.device | str | None = None, batch_tokens: int | None = None, max_len: int | None = None,
                uncond: bool = False, seed: int = SUBSET_SEED, rank: int = 0, world: int = 1, group=None,
                lockstep: bool = False, autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
                progress: Callable[[int, int], None] | None = None) -> dict[str, TaskResult]:
    """Score every task; {task.name: TaskResult}, the same on every rank.

    limit: docs per task (None: all). device: where the model is (default: its parameters'). batch_tokens: rows x
    longest row per forward (default: default_batch_tokens). max_len: longest row the model reads (default and
    cap: model.cfg.max_seq_len); longer requests lose their context's start. uncond: also score the
    unconditional requests (acc_uncond; always when it is the task's primary metric). rank, world, group: the
    split of the docs and the process group of the gather (world > 1 needs torch.distributed initialised).
    lockstep: every rank runs the same number of forwards (FSDP). autocast: a context factory per forward (the
    run's bf16 autocast; default none). progress(tokens done, tokens total) of this rank, first with 0."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    cap = model.cfg.max_seq_len
    max_len = cap if max_len is None else min(max_len, cap)
    if max_len < 2:
        raise UserError(f"max_len must be >= 2, got {max_len}")
    if batch_tokens is None:
        batch_tokens = default_batch_tokens(model.cfg, max_len, device)[0]
    if world > 1 and not dist.is_initialized():
        raise ValueError(f"world={world} needs an initialised torch.distributed process group")
    plans = []
    for task in tasks:
        selected = select_docs(len(task.docs), limit, seed)
        with_uncond = (uncond or task.primary_metric == "acc_uncond") and task.has_uncond
        plans.append((selected, with_uncond, *_local_plan(task, tokenizer, selected, rank, world, with_uncond,
                                                          max_len, batch_tokens)))
    top = max((int(p[3].tokens.max()) for p in plans if len(p[3].tokens)), default=0)
    if top >= model.cfg.vocab_size:
        raise UserError(f"tokenizer {getattr(tokenizer, 'name', tokenizer)} gives ids up to {top}, beyond the "
                        f"model's vocab_size {model.cfg.vocab_size}")
    total, done = sum(int(p[3].inputs.sum()) for p in plans), 0
    if progress is not None:
        progress(0, total)
    was_training = model.training
    model.eval()
    local = []
    try:
        for selected, with_uncond, mine, rows, batches, starts in plans:
            started = time.perf_counter()
            ll = score_rows(model, rows, batches, device=device, max_len=max_len, autocast=autocast,
                            progress=None if progress is None else (lambda d, base=done: progress(base + d, total)))
            if lockstep and world > 1:
                for _ in range(max(_gather(len(batches), world, group)) - len(batches)):
                    dummy_forward(model, device)
            done += int(rows.inputs.sum())
            local.append({"positions": np.arange(rank, len(selected), world), "starts": starts, "loglik": ll,
                          "scored": rows.scored, "inputs": int(rows.inputs.sum()),
                          "truncated": int(rows.truncated.sum()),
                          "seconds": time.perf_counter() - started})
    finally:
        model.train(was_training)
    gathered = _gather(local, world, group)
    return {task.name: _result(task, plan[0], plan[1], [g[k] for g in gathered])
            for k, (task, plan) in enumerate(zip(tasks, plans))}


def _result(task: Task, selected: np.ndarray, with_uncond: bool, shares: list[dict]) -> TaskResult:
    """Every rank's share of one task -> its TaskResult (docs in the subset's order)."""
    n = len(selected)
    loglik: list = [None] * n
    uncond: list = [None] * n
    tokens: list = [None] * n
    for share in shares:
        for j, position in enumerate(share["positions"]):
            doc = task.docs[selected[position]]
            first, c = int(share["starts"][j]), doc.n_choices
            loglik[position] = share["loglik"][first:first + c]
            tokens[position] = share["scored"][first:first + c]
            if with_uncond:
                uncond[position] = share["loglik"][first + c:first + 2 * c]
    docs = [task.docs[i] for i in selected]
    metrics = {"task": task.name, "file": str(task.path), "docs": len(task.docs),
               **task_metrics(docs, loglik, tokens, uncond if with_uncond else None, task.primary_metric)}
    inputs = sum(s["inputs"] for s in shares)
    seconds = max(s["seconds"] for s in shares)
    metrics.update(uncond=with_uncond, requests=sum(d.n_choices for d in docs) * (2 if with_uncond else 1),
                   tokens=inputs, truncated=sum(s["truncated"] for s in shares), seconds=round(seconds, 3),
                   tokens_per_s=inputs / max(seconds, 1e-9))
    return TaskResult(metrics=metrics, doc_index=selected, loglik=loglik, tokens=tokens,
                      uncond_loglik=uncond if with_uncond else None)
