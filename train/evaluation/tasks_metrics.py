"""Accuracy of a multiple-choice task from its continuation log-likelihoods, under each normalisation.

A doc's prediction is the choice with the highest score (ties: the first, as numpy's and lm-eval's argmax);
ll is the continuation's summed log-probability given its context, `continuation` its string as in the file
(with its leading space):

    acc            ll                                   lm-eval acc, OLMES acc_raw
    acc_norm       ll / characters of the continuation  lm-eval acc_norm: the choice's length without the
                   without one leading space            target delimiter " " that lm-eval puts before it
    acc_per_char   ll / len(continuation)               OLMES acc_per_char (primary for most rc tasks)
    acc_per_byte   ll / UTF-8 bytes of the continuation OLMES acc_per_byte
    acc_per_token  ll / continuation tokens scored      OLMES acc_per_token
    acc_uncond     ll - ll(continuation | "Answer:")    OLMES acc_uncond (PMI), when the unconditional
                                                        requests were scored

Lengths of 0 count as 1. Each comes with its standard error sqrt(p (1 - p) / n) over the n docs scored;
predictions() gives the per-doc choices each accuracy is the mean correctness of (train.tasks' items file).
gold_loglik, the mean ll of the gold continuations (nats), moves smoothly where the accuracies still sit at
chance (a small model early in training).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from train.evaluation.tasks_data import Doc

METRICS = ("acc", "acc_norm", "acc_per_char", "acc_per_byte", "acc_per_token", "acc_uncond")


def padded(values: Sequence[np.ndarray], width: int, fill: float) -> np.ndarray:
    """Ragged per-doc arrays -> [D, width] float64, `fill` past each doc's choices."""
    out = np.full((len(values), width), fill, dtype=np.float64)
    for row, v in enumerate(values):
        out[row, :len(v)] = v
    return out


def stderr(p: float, n: int) -> float:
    return math.sqrt(p * (1 - p) / n) if n else float("nan")


def norm_chars(continuation: str) -> int:
    """acc_norm's length: the continuation's characters without one leading space (lm-eval's target delimiter)."""
    return len(continuation.removeprefix(" "))


def utf8_bytes(continuation: str) -> int:
    return len(continuation.encode("utf-8"))


# the length per continuation string each normalisation divides by (acc_per_token's: the tokens scored)
STRING_LENGTHS = {"acc_norm": norm_chars, "acc_per_char": len, "acc_per_byte": utf8_bytes}


def predictions(docs: Sequence[Doc], loglik: Sequence[np.ndarray], tokens: Sequence[np.ndarray],
                uncond_loglik: Sequence[np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """docs [D] with loglik [D][C_d] (nats), tokens [D][C_d] (continuation tokens scored) and, when scored,
    uncond_loglik [D][C_d] -> {metric: [D] int64, each doc's predicted choice}: every metric of METRICS but
    acc_uncond without unconditional scores."""
    width = max((d.n_choices for d in docs), default=1)
    valid = np.arange(width)[None, :] < np.array([d.n_choices for d in docs], dtype=np.int64).reshape(-1, 1)  # [D, C]
    ll = padded(loglik, width, 0.0)  # [D, C]

    def lengths(measure) -> np.ndarray:  # [D, C], at least 1
        return np.maximum(padded([[measure(x) for _, x in d.requests] for d in docs], width, 1.0), 1.0)

    scores = {"acc": ll, **{name: ll / lengths(measure) for name, measure in STRING_LENGTHS.items()},
              "acc_per_token": ll / np.maximum(padded(tokens, width, 1.0), 1.0)}
    if uncond_loglik is not None:
        scores["acc_uncond"] = ll - padded(uncond_loglik, width, 0.0)
    return {name: np.argmax(np.where(valid, score, -np.inf), axis=1) if docs else np.zeros(0, np.int64)
            for name, score in scores.items()}


def task_metrics(docs: Sequence[Doc], loglik: Sequence[np.ndarray], tokens: Sequence[np.ndarray],
                 uncond_loglik: Sequence[np.ndarray] | None = None, primary: str = "acc") -> dict:
    """docs, loglik, tokens, uncond_loglik as for predictions -> {metric: p, metric_stderr: s, ..., primary_metric,
    primary, primary_stderr, items, chance, gold_loglik}. primary: one of METRICS; acc when its input is missing
    (acc_uncond without unconditional scores)."""
    n = len(docs)
    gold = np.array([d.gold for d in docs], dtype=np.int64)  # [D]
    out: dict = {}
    for name, predicted in predictions(docs, loglik, tokens, uncond_loglik).items():
        p = float((predicted == gold).mean()) if n else float("nan")
        out[name], out[f"{name}_stderr"] = p, stderr(p, n)
    primary = primary if primary in out else "acc"
    gold_ll = [float(ll[d.gold]) for d, ll in zip(docs, loglik)]
    out.update(primary_metric=primary, primary=out[primary], primary_stderr=out[f"{primary}_stderr"], items=n,
               chance=float(np.mean([1 / d.n_choices for d in docs])) if n else float("nan"),
               gold_loglik=float(np.mean(gold_ll)) if n else float("nan"))
    return out
