"""Synthetic tokens with learnable structure, deterministic from (seed, stream, step, global row).

A fixed "phrase book" (n_phrases random phrases of phrase_len ids, drawn once from the seed)
is concatenated in random order; each window starts at a random offset. Inside a phrase the
next token is determined by the current one, so a tiny model's loss falls from ln(vocab) to
about ln(n_phrases) / phrase_len within tens of steps. Validation uses the same book and a
different stream id, so it measures the same structure on batches training never drew.

Rows follow the world-size-free order of state.GlobalBatchOrder: the phrase picks and start
offset of global row g of optimizer step s come from a counter-based hash (memmap.splitmix64)
of (seed, stream, s, g), vectorised over the rows.
"""
from __future__ import annotations

import numpy as np
import torch

from train.data.memmap import row_hashes, splitmix64, stream_key
from train.data.state import TRAIN_STREAM, GlobalBatchOrder
from train.data.tensors import windows_to_xy


class SyntheticStream(GlobalBatchOrder):
    kind = "synthetic"

    def __init__(self, *, seq_len: int, batch_size: int, vocab_size: int, seed: int, rank: int = 0,
                 world_size: int = 1, accumulate: int = 1, stream: int = TRAIN_STREAM, pin: bool = False,
                 n_phrases: int = 64, phrase_len: int = 16):
        self.seq_len, self.vocab_size, self.pin = seq_len, vocab_size, pin
        self._init_order(batch_size=batch_size, rank=rank, world_size=world_size, accumulate=accumulate,
                         seed=seed, stream=stream)
        self.phrase_len = phrase_len
        book_rng = np.random.default_rng([seed, 0x5EED])
        self.book = book_rng.integers(0, vocab_size, size=(n_phrases, phrase_len), dtype=np.int64)
        self._phrases_per_row = -(-(seq_len + 1) // phrase_len) + 1
        self._draw = np.arange(self._phrases_per_row + 1, dtype=np.uint64)  # phrase picks, then the start offset
        self._span = np.arange(seq_len + 1)
        self._key = stream_key(seed, stream)

    def rows_batch(self, step: int, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        draws = splitmix64(row_hashes(self._key, step, rows)[:, None] ^ self._draw)  # [B, phrases + 1]
        picks = (draws[:, :-1] % np.uint64(len(self.book))).astype(np.int64)
        starts = (draws[:, -1:] % np.uint64(self.phrase_len)).astype(np.int64)
        text = self.book[picks].reshape(len(rows), -1)  # [B, phrases * phrase_len]
        windows = np.take_along_axis(text, starts + self._span, axis=1)
        return windows_to_xy(windows, self.pin)

    def close(self) -> None:
        pass
