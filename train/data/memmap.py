"""Random-offset batches from a prepared token file (np.memmap), in the training process.

Each rank owns a contiguous 1/world_size slice of the file, so ranks never share a window.
Batch `step` of rank `rank` draws batch_size window starts inside that slice from a counter-based
hash (splitmix64) of (seed, stream, rank, step, row): no state but the step counter, exact resume,
no sliding windows, and no per-step generator set-up (np.random.default_rng costs ~100 us).
A batch is one gather from the memmap plus two int64 conversions, so a single in-process sampler
is faster than DataLoader workers would be (no IPC); see bench/bench_data.py.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from train.data.state import TRAIN_STREAM, expect_state
from train.errors import DataError


class MemmapStream:
    def __init__(self, path: Path, *, dtype, n_tokens: int, seq_len: int, batch_size: int, seed: int,
                 rank: int = 0, world_size: int = 1, stream: int = TRAIN_STREAM, pin: bool = False):
        self.path = Path(path)
        self.seq_len, self.batch_size, self.seed, self.stream, self.pin = seq_len, batch_size, seed, stream, pin
        self.rank, self.world_size = rank, world_size
        self.tokens = np.memmap(self.path, dtype=dtype, mode="r", shape=(n_tokens,)) if n_tokens else np.zeros(0, dtype)
        self.lo = n_tokens * rank // world_size
        self.hi = n_tokens * (rank + 1) // world_size
        self.n_starts = self.hi - self.lo - seq_len  # window starts lo .. hi - (seq_len + 1)
        if self.n_starts < 1:
            raise DataError(f"{self.path}: rank {rank}/{world_size} slice holds {self.hi - self.lo} tokens, "
                            f"fewer than one window of seq_len+1={seq_len + 1}")
        self._span = np.arange(seq_len + 1)
        self._rows = np.arange(batch_size, dtype=np.uint64)
        self._key = splitmix64(splitmix64(splitmix64(_u64(seed)) ^ _u64(stream)) ^ _u64(rank))
        self.step = 0

    def offsets_at(self, step: int) -> np.ndarray:
        key = splitmix64(self._key ^ splitmix64(np.uint64(step)))
        draws = splitmix64(key ^ self._rows)  # modulo bias < n_starts / 2**64: negligible
        return self.lo + (draws % np.uint64(self.n_starts)).astype(np.int64)

    def batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        windows = self.tokens[self.offsets_at(step)[:, None] + self._span]  # one gather: [B, T+1], file dtype
        x = torch.from_numpy(windows[:, :-1].astype(np.int64))
        y = torch.from_numpy(windows[:, 1:].astype(np.int64))
        return (x.pin_memory(), y.pin_memory()) if self.pin else (x, y)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.batch_at(self.step)
        self.step += 1
        return batch

    def state_dict(self) -> dict:
        return {"kind": "memmap", "step": self.step, "seed": self.seed, "rank": self.rank,
                "world_size": self.world_size, "stream": self.stream}

    def load_state_dict(self, state: dict) -> None:
        expect_state(state, kind="memmap", seed=self.seed, rank=self.rank, world_size=self.world_size, stream=self.stream)
        self.step = int(state["step"])

    def close(self) -> None:
        self.tokens = None


def _u64(value: int) -> np.uint64:
    return np.uint64(value & 0xFFFF_FFFF_FFFF_FFFF)


def splitmix64(x):
    """SplitMix64 finalizer (Steele et al.): a fast, well-mixed 64-bit hash; works on scalars and arrays."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))
