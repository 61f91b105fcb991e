"""Per-item task results: python -m train.tasks's items file, one line per doc scored.

One JSON line per doc scored: the tasks in the order scored, each task's docs in the seeded subset's order.

    {"task": "hellaswag:rc_0shot", "doc_id": 7, "gold": 2,
     "loglik": [-31.2, ...],            per choice: the continuation's summed log-probability (nats)
     "uncond_loglik": [-40.1, ...],     the same given "Answer:" (only where acc_uncond was scored)
     "chars": [...], "chars_norm": [...], "bytes": [...], "tokens": [...],
                                        per choice: the lengths the normalisations divide by (0 counts as 1):
                                        characters (acc_per_char), characters without one leading space
                                        (acc_norm), UTF-8 bytes (acc_per_byte), tokens scored (acc_per_token)
     "pred": {"acc": 2, "acc_norm": 2, "acc_per_char": 2, "acc_per_byte": 2, "acc_per_token": 2, "acc_uncond": 0}}

doc_id is the requests file's (stable across --limit and --seed). The doc counts as right under a metric when
pred[metric] == gold, and every accuracy of the result JSON is the mean of that over the task's lines (both come
from tasks_metrics.predictions).

The file is read back by train/core/artifacts.py read_items; train/analysis/paired.py compares two.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from train.evaluation.tasks import TaskResult
from train.evaluation.tasks_data import Task
from train.evaluation.tasks_metrics import STRING_LENGTHS, predictions

# the items file's length fields: the string measure of each normalisation (tokens: TaskResult.tokens)
LENGTH_FIELDS = {"chars": STRING_LENGTHS["acc_per_char"], "chars_norm": STRING_LENGTHS["acc_norm"],
                 "bytes": STRING_LENGTHS["acc_per_byte"]}


def item_lines(task: Task, result: TaskResult) -> list[dict]:
    """One task's TaskResult -> its items file lines (see the module doc)."""
    docs = [task.docs[i] for i in result.doc_index]
    predicted = predictions(docs, result.loglik, result.tokens, result.uncond_loglik)
    lines = []
    for row, doc in enumerate(docs):
        continuations = [x for _, x in doc.requests]
        line = {"task": task.name, "doc_id": doc.doc_id, "gold": doc.gold,
                "loglik": [float(v) for v in result.loglik[row]]}
        if result.uncond_loglik is not None:
            line["uncond_loglik"] = [float(v) for v in result.uncond_loglik[row]]
        line.update({name: [measure(x) for x in continuations] for name, measure in LENGTH_FIELDS.items()})
        line["tokens"] = [int(v) for v in result.tokens[row]]
        line["pred"] = {metric: int(choices[row]) for metric, choices in predicted.items()}
        lines.append(line)
    return lines


def write_items(path: Path, lines: list[dict]) -> None:
    """The lines as JSONL at `path`, atomically (a temporary file beside it, then a rename)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    os.replace(tmp, path)
