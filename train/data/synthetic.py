"""Synthetic tokens with learnable structure, deterministic from (seed, stream, rank, step).

A fixed "phrase book" (n_phrases random phrases of phrase_len ids, drawn once from the seed)
is concatenated in random order; each window starts at a random offset. Inside a phrase the
next token is determined by the current one, so a tiny model's loss falls from ln(vocab) to
about ln(n_phrases) / phrase_len within tens of steps. Validation uses the same book and a
different stream id, so it measures the same structure on batches training never drew.
"""
from __future__ import annotations

import numpy as np
import torch

from train.data.state import TRAIN_STREAM, expect_state
from train.data.tensors import windows_to_xy


class SyntheticStream:
    def __init__(self, *, seq_len: int, batch_size: int, vocab_size: int, seed: int, rank: int = 0,
                 stream: int = TRAIN_STREAM, pin: bool = False, n_phrases: int = 64, phrase_len: int = 16):
        self.seq_len, self.batch_size, self.vocab_size = seq_len, batch_size, vocab_size
        self.seed, self.rank, self.stream, self.pin = seed, rank, stream, pin
        self.phrase_len = phrase_len
        self.step = 0
        book_rng = np.random.default_rng([seed, 0x5EED])
        self.book = book_rng.integers(0, vocab_size, size=(n_phrases, phrase_len), dtype=np.int64)
        self._phrases_per_row = -(-(seq_len + 1) // phrase_len) + 1

    def batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed, self.stream, self.rank, step])
        picks = rng.integers(0, len(self.book), size=(self.batch_size, self._phrases_per_row))
        rows = self.book[picks].reshape(self.batch_size, -1)  # [B, phrases * phrase_len]
        starts = rng.integers(0, self.phrase_len, size=(self.batch_size, 1))
        windows = np.take_along_axis(rows, starts + np.arange(self.seq_len + 1), axis=1)
        return windows_to_xy(windows, self.pin)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.batch_at(self.step)
        self.step += 1
        return batch

    def state_dict(self) -> dict:
        return {"kind": "synthetic", "step": self.step, "seed": self.seed, "rank": self.rank, "stream": self.stream}

    def load_state_dict(self, state: dict) -> None:
        expect_state(state, kind="synthetic", seed=self.seed, rank=self.rank, stream=self.stream)
        self.step = int(state["step"])

    def close(self) -> None:
        pass

