"""Score every target of a token stream exactly once: plan the windows, run them in batches, sum the loss.

    tokens t_0 .. t_{N-1}; window w reads t[w.start : w.end] and predicts t[w.start + 1 : w.end + 1];
    only its last w.scored targets count. Together the windows score t_1 .. t_{N-1}, each once.

Non-overlapping (stride == seq_len): windows of seq_len + 1 tokens, t[0..L], t[L..2L], ... (neighbours
share one token: the last target of one is the first input of the next); the last window is partial.
Strided (stride S < seq_len): the first window scores all of its L targets; each later window ends S
targets further on, reads up to L tokens and scores only its last S targets, so every target after the
first window is predicted from at least L - S tokens of context.
"""
from __future__ import annotations

import itertools
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from nsa.loss import IGNORE_INDEX


@dataclass(frozen=True)
class Window:
    start: int  # index of the first input token
    end: int  # index of the last target (one past the last input)
    scored: int  # how many of the window's end - start targets count: the last ones


def plan_windows(n_tokens: int, seq_len: int, stride: int) -> Iterator[Window]:
    """Windows over a stream of n_tokens tokens; their scored targets are t_1 .. t_{n_tokens-1}, each once."""
    if not 1 <= stride <= seq_len:
        raise ValueError(f"stride must be in [1, seq_len={seq_len}], got {stride}")
    last_target, scored_to = n_tokens - 1, 0  # targets 1..scored_to are covered
    while scored_to < last_target:
        end = min(scored_to + (seq_len if scored_to == 0 else stride), last_target)
        start = scored_to if stride == seq_len else max(0, end - seq_len)
        yield Window(start, end, end - scored_to)
        scored_to = end


def count_windows(n_tokens: int, seq_len: int, stride: int) -> int:
    """len(list(plan_windows(n_tokens, seq_len, stride))), without walking them."""
    targets = max(0, n_tokens - 1)
    if targets <= seq_len:
        return 1 if targets else 0
    return 1 + -(-(targets - seq_len) // stride)


@dataclass
class Score:
    nll_sum: float  # nats, summed over the scored targets
    tokens: int  # targets scored
    windows: int
    # with by_position: per window position p (0 .. seq_len - 1: the target of the p+1-th input), nats summed and
    # targets counted over every window
    position_nll: list[float] | None = None
    position_tokens: list[int] | None = None

    @property
    def loss(self) -> float:
        """Mean nats per scored target."""
        return self.nll_sum / self.tokens


def window_batch(tokens: np.ndarray, windows: list[Window], mask: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> inputs [B, T] and targets [B, T] (int64; T: the longest window), IGNORE_INDEX where nothing is
    scored: a window's context targets, the right padding of shorter windows, and with a loss mask [N] (uint8)
    every target whose byte is 0."""
    starts = np.array([w.start for w in windows], dtype=np.int64)  # [B]
    lengths = np.array([w.end - w.start for w in windows], dtype=np.int64)  # [B] inputs (= targets) per window
    scored = np.array([w.scored for w in windows], dtype=np.int64)  # [B]
    width = int(lengths.max())
    columns = np.arange(width + 1)  # [T + 1]
    index = np.minimum(starts[:, None] + columns, (starts + lengths)[:, None])  # [B, T + 1], within each window
    span = torch.from_numpy(np.asarray(tokens[index], dtype=np.int64))  # [B, T + 1]: one gather
    pos = torch.arange(width)  # [T]
    n, first = torch.from_numpy(lengths)[:, None], torch.from_numpy(lengths - scored)[:, None]  # [B, 1]
    inputs = torch.where(pos < n, span[:, :-1], 0)  # [B, T]
    scored_here = (pos >= first) & (pos < n)  # [B, T]
    if mask is not None:
        scored_here &= torch.from_numpy(np.asarray(mask[index[:, 1:]]) != 0)  # [B, T]: the data's own targets
    targets = torch.where(scored_here, span[:, 1:], IGNORE_INDEX)  # [B, T]
    return inputs, targets


@torch.inference_mode()
def score_stream(model: torch.nn.Module, tokens: np.ndarray, *, seq_len: int, stride: int, batch_size: int,
                 device: torch.device, autocast: Callable[[], AbstractContextManager],
                 progress: Callable[[int], None] | None = None, mask: np.ndarray | None = None,
                 by_position: bool = False) -> Score:
    """Sum of the model's cross-entropy over every target of `tokens` [N] (ids), each scored once.

    The model's own loss path (chunked over rows when model.loss_chunk > 0) takes the targets; it
    returns their mean, so each batch adds mean x count. `autocast()` makes each batch's precision
    context (bf16 autocast on CUDA, a null context on CPU). `progress(targets scored so far)` after each batch.
    mask [N] uint8 (a prepared split's loss mask): only targets whose byte is 1 are scored. by_position
    (non-overlapping windows only): each target's loss from the full logits, summed per position in the window too
    (Score.position_nll / position_tokens: does the loss keep falling with context, or rise past the training
    length?)."""
    if by_position and stride != seq_len:
        raise ValueError("by_position scores non-overlapping windows (stride = seq_len)")
    nll_sum = torch.zeros((), dtype=torch.float64, device=device)
    position_nll = torch.zeros(seq_len, dtype=torch.float64, device=device)  # [T]
    position_tokens = torch.zeros(seq_len, dtype=torch.int64, device=device)  # [T]
    n_scored = n_windows = 0
    windows = plan_windows(len(tokens), seq_len, stride)
    while batch := list(itertools.islice(windows, batch_size)):
        inputs, targets = window_batch(tokens, batch, mask)
        count = sum(w.scored for w in batch) if mask is None else int((targets != IGNORE_INDEX).sum())
        if count == 0:  # a masked batch with no target: nothing to add (its mean would be 0/0)
            n_windows += len(batch)
            continue
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with autocast():
            if by_position:
                logits = model(inputs)  # [B, T, V] float32
        if by_position:
            nll = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                                  reduction="none").view(targets.shape).double()  # [B, T], 0 where not scored
            scored = targets != IGNORE_INDEX  # [B, T]
            width = targets.shape[1]
            position_nll[:width] += nll.sum(0)
            position_tokens[:width] += scored.sum(0)
            nll_sum += nll.sum()
        else:
            with autocast():
                mean = model(inputs, targets)
            nll_sum += mean.double() * count
        n_scored, n_windows = n_scored + count, n_windows + len(batch)
        if progress is not None:
            progress(n_scored)
    if not by_position:
        return Score(nll_sum=float(nll_sum), tokens=n_scored, windows=n_windows)
    return Score(nll_sum=float(nll_sum), tokens=n_scored, windows=n_windows, position_nll=position_nll.tolist(),
                 position_tokens=position_tokens.tolist())


def position_buckets(score: Score, buckets: int, training_length: int) -> list[dict]:
    """Score.position_* in `buckets` equal slices of the window: [{from, to, tokens, loss, beyond_training}] (from, to:
    positions of the targets, 1-based contexts; beyond_training: the slice starts past the training length)."""
    width = len(score.position_nll)
    edges = [round(i * width / buckets) for i in range(buckets + 1)]
    rows = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        n = sum(score.position_tokens[lo:hi])
        rows.append({"from": lo + 1, "to": hi, "tokens": n,
                     "loss": sum(score.position_nll[lo:hi]) / n if n else None, "beyond_training": lo >= training_length})
    return rows
