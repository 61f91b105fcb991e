"""Per-item task results (python -m train.tasks's items file) and the paired test of two models on the same items.

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

Paired test (McNemar's exact test) of A against B on one metric, over the docs of a task both hold: b = docs only
A gets right, c = docs only B gets right. Were A and B equally accurate, each of the b + c discordant docs would
be A's with probability 1/2: p = min(1, 2 P(X <= min(b, c))), X ~ Binomial(b + c, 1/2) (two-sided; 1 when
b + c = 0).
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Sequence

from train.core.errors import UserError
from train.evaluation.tasks import TaskResult
from train.evaluation.tasks_data import Task
from train.evaluation.tasks_metrics import STRING_LENGTHS, predictions

# the items file's length fields: the string measure of each normalisation (tokens: TaskResult.tokens)
LENGTH_FIELDS = {"chars": STRING_LENGTHS["acc_per_char"], "chars_norm": STRING_LENGTHS["acc_norm"],
                 "bytes": STRING_LENGTHS["acc_per_byte"]}
KEYS = ("task", "doc_id", "gold", "pred")  # what read_items requires of every line


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


def read_items(path: Path) -> list[dict]:
    """An items file's lines; UserError naming the file (and the line) when it is not one."""
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
        if not isinstance(line, dict) or any(k not in line for k in KEYS) or not isinstance(line["pred"], dict):
            raise UserError(f"{path} line {number}: not a train.tasks item (needs {', '.join(KEYS)})")
        lines.append(line)
    return lines


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value from the discordant counts b (only A right) and c (only B right)."""
    n = b + c
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1))
    return min(1.0, 2 * tail / 2**n)


def paired_test(a: Sequence[dict], b: Sequence[dict], task: str, metric: str) -> dict:
    """McNemar's exact test of items files' lines a against b on `task` and `metric`, over the docs both hold
    with that metric -> {metric, items (docs paired), b (only A right), c (only B right), p_value}."""
    def correct(lines: Sequence[dict]) -> dict[int, bool]:
        return {line["doc_id"]: line["pred"][metric] == line["gold"] for line in lines
                if line["task"] == task and metric in line["pred"]}

    right_a, right_b = correct(a), correct(b)
    both = right_a.keys() & right_b.keys()
    only_a = sum(right_a[d] and not right_b[d] for d in both)
    only_b = sum(right_b[d] and not right_a[d] for d in both)
    return {"metric": metric, "items": len(both), "b": only_a, "c": only_b, "p_value": mcnemar_exact(only_a, only_b)}
