"""Paired test (McNemar's exact test) of two models on the same task items (train.tasks' items files).

A against B on one metric, over the docs of a task both hold: b = docs only A gets right, c = docs only B gets
right. Were A and B equally accurate, each of the b + c discordant docs would be A's with probability 1/2:
p = min(1, 2 P(X <= min(b, c))), X ~ Binomial(b + c, 1/2) (two-sided; 1 when b + c = 0).
"""
from __future__ import annotations

import math
from typing import Sequence


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
