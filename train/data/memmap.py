"""Random-offset batches from a prepared token file (np.memmap), in the training process.

Batches follow the world-size-free order of state.GlobalBatchOrder: global row g of optimizer
step s is the window of seq_len+1 tokens starting at hash(seed, stream, s, g) % n_starts, drawn
over the whole file with a counter-based hash (splitmix64). Whatever the world size and batch
split, the same global batch holds the same windows; the state is the step counter, resume is
exact, there are no sliding windows and no per-step generator set-up (np.random.default_rng
costs ~100 us). A batch is one gather from the memmap plus two int64 conversions, so a single
in-process sampler is faster than DataLoader workers would be (no IPC); see bench/bench_data.py.

A loss mask (a prepared split's optional uint8 file, one byte per token; docs/DATA.md) marks which tokens
are training targets: a target whose byte is 0 becomes IGNORE_INDEX (the model's loss skips it), one more
gather per batch.

Window starts at documents (data.window_start=document): the candidate starts are the first token of every
document (the file's start and each token after an EOS) that leaves room for a whole window; row g then opens
at starts[hash % len(starts)]. The starts are found once, by a chunked scan of the file for EOS (no full copy
in memory), and the order stays a pure function of (seed, step, row): resume is exact as before.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from nsa.loss import IGNORE_INDEX
from train.core.errors import DataError
from train.data.state import TRAIN_STREAM, GlobalBatchOrder


class MemmapStream(GlobalBatchOrder):
    kind = "memmap"

    def __init__(self, path: Path, *, dtype, n_tokens: int, seq_len: int, batch_size: int, seed: int,
                 rank: int = 0, world_size: int = 1, accumulate: int = 1, stream: int = TRAIN_STREAM, pin: bool = False,
                 loss_mask: Path | None = None, document_starts_eos: int | None = None):
        self.path = Path(path)
        self.seq_len, self.pin = seq_len, pin
        self._init_order(batch_size=batch_size, rank=rank, world_size=world_size, accumulate=accumulate,
                         seed=seed, stream=stream)
        self.lo, self.hi = 0, n_tokens  # every rank samples the whole file
        self.n_starts = n_tokens - seq_len  # window starts 0 .. n_tokens - (seq_len + 1)
        if self.n_starts < 1:
            raise DataError(f"{self.path} holds {n_tokens} tokens, fewer than one window of seq_len+1={seq_len + 1} "
                            f"tokens; use a smaller train.seq_len or prepare more data")
        # a plain ndarray view of the mapping: indexing a np.memmap builds a memmap subclass per result (measurable at
        # these batch sizes); the view reads the same pages
        self.tokens = np.asarray(np.memmap(self.path, dtype=dtype, mode="r", shape=(n_tokens,)))
        self.mask = None
        if loss_mask is not None:
            size = Path(loss_mask).stat().st_size if Path(loss_mask).is_file() else None
            if size != n_tokens:
                raise DataError(f"{loss_mask}: a loss mask of {size if size is not None else 'no'} bytes for {n_tokens} "
                                f"tokens in {self.path.name} (one byte per token); prepare the directory again")
            self.mask = np.asarray(np.memmap(loss_mask, dtype=np.uint8, mode="r", shape=(n_tokens,)))
        self.starts = None  # [n] int64 window starts at documents, or None: any token
        if document_starts_eos is not None:
            self.starts = document_starts(self.tokens, document_starts_eos, last=self.n_starts - 1)
            if not len(self.starts):
                raise DataError(f"{self.path}: no document (EOS {document_starts_eos}) starts early enough for a window of "
                                f"seq_len+1={seq_len + 1} tokens; use data.window_start=any or a smaller train.seq_len")
        # every window as a row of a strided view ([n_tokens - seq_len, T+1], no copy): a batch is one row gather
        # (a memcpy per row) instead of an element-wise gather through a [B, T+1] index array (14x less time at
        # 16 x 1024; docs/BENCHMARKS.md)
        self._windows = sliding_window_view(self.tokens, seq_len + 1)
        self._mask_windows = sliding_window_view(self.mask[1:], seq_len) if self.mask is not None else None
        self._key = stream_key(seed, stream)
        self._hashes = RowHashBlocks(self._key)

    def window_starts(self, step: int, rows: np.ndarray) -> np.ndarray:
        """Window start (int64) of each global row in `rows` (uint64) of optimizer step `step`."""
        return self.starts_of(self._hashes(step, rows))

    def starts_of(self, draws: np.ndarray) -> np.ndarray:
        """Window starts (int64) for uniform 64-bit draws (uint64): one per row."""
        # modulo bias < n_starts / 2**64: negligible
        if self.starts is not None:
            return self.starts[(draws % np.uint64(len(self.starts))).astype(np.int64)]
        return self.lo + (draws % np.uint64(self.n_starts)).astype(np.int64)

    def offsets_at(self, k: int) -> np.ndarray:
        """Window starts of this rank's k-th micro-batch (what batch_at(k) reads)."""
        return self.window_starts(*self.rows_at(k))

    def windows(self, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """(windows [B, T+1] in the file's dtype, excluded [B, T] bool: targets the loss mask drops, or None) that
        begin at `starts` ([B] int64): one gather (two with a loss mask)."""
        excluded = self._mask_windows[starts] == 0 if self._mask_windows is not None else None  # targets' bytes
        return self._windows[starts], excluded

    def rows_batch(self, step: int, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        windows, excluded = self.windows(self.window_starts(step, rows))  # [B, T+1] file dtype
        return windows_to_batch(windows, excluded, self.pin)

    def close(self) -> None:
        self.tokens = self.mask = self.starts = self._windows = self._mask_windows = None


def windows_to_batch(windows: np.ndarray, excluded: np.ndarray | None, pin: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows [B, T+1] of any integer dtype (and the targets to exclude [B, T], or None) -> x, y [B, T] int64 tensors
    (one conversion each)."""
    x = torch.from_numpy(windows[:, :-1].astype(np.int64))
    y = torch.from_numpy(targets_of(windows, excluded))
    return (x.pin_memory(), y.pin_memory()) if pin else (x, y)


def targets_of(windows: np.ndarray, excluded: np.ndarray | None) -> np.ndarray:
    """[B, T] int64 targets of windows [B, T+1], IGNORE_INDEX where `excluded` [B, T] (in int64: -100 does not fit
    a token file's unsigned dtype)."""
    y = windows[:, 1:].astype(np.int64)
    if excluded is not None:
        y[excluded] = IGNORE_INDEX  # targets the data excludes from the loss
    return y


def document_starts(tokens: np.ndarray, eos_id: int, *, last: int, chunk: int = 1 << 24) -> np.ndarray:
    """[n] int64: 0 and every position after an EOS in `tokens` ([N], any integer dtype), those <= last."""
    found = [np.zeros(1, dtype=np.int64)]
    for lo in range(0, min(len(tokens), last), chunk):  # an EOS at position last - 1 opens a document at last
        hit = np.flatnonzero(np.asarray(tokens[lo:min(lo + chunk, last)]) == eos_id)
        found.append(hit.astype(np.int64) + (lo + 1))
    return np.concatenate(found)


def _u64(value: int) -> np.uint64:
    return np.uint64(value & 0xFFFF_FFFF_FFFF_FFFF)


def splitmix64(x):
    """SplitMix64 finalizer (Steele et al.): a fast, well-mixed 64-bit hash; works on scalars and arrays (uint64)."""
    if isinstance(x, np.ndarray):  # arrays wrap on overflow silently; np.errstate costs more than the hash at B = 16
        return _splitmix64(x)
    with np.errstate(over="ignore"):  # numpy scalars warn on overflow
        return _splitmix64(x)


def _splitmix64(x):
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def stream_key(seed: int, stream: int) -> np.uint64:
    return splitmix64(splitmix64(_u64(seed)) ^ _u64(stream))


def _splitmix64_int(x: int) -> int:
    """splitmix64 on a Python int (mod 2**64): the same numbers as on np.uint64, without numpy's per-scalar cost."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


_MASK64 = 0xFFFF_FFFF_FFFF_FFFF


def row_hashes(key: np.uint64, step: int, rows: np.ndarray) -> np.ndarray:
    """uint64 hash of (key, step, g) for each global row g in `rows` (uint64 array)."""
    return splitmix64(np.uint64(_step_key(key, step)) ^ rows)


def _step_key(key: np.uint64, step: int) -> int:
    return _splitmix64_int(int(key) ^ _splitmix64_int(int(step) & _MASK64))


class RowHashBlocks:
    """row_hashes(key, step, rows) for HASH_BLOCK_STEPS consecutive steps at once: the same numbers (a pure function
    of (key, step, row), so resume stays exact), one [steps, B] numpy pass per block instead of ~8 numpy calls on B
    values every step (6.7 us of a 23 us batch at 16 rows). A rank asks for the same rows arrays every step (one per
    micro-batch), so blocks are kept per rows array, for the current block of steps only."""

    def __init__(self, key: np.uint64):
        self.key = key
        self._first = -1  # first step of the cached block
        self._blocks: dict[bytes, np.ndarray] = {}  # rows' bytes -> [HASH_BLOCK_STEPS, len(rows)] uint64

    def block(self, step: int, rows: np.ndarray) -> tuple[np.ndarray, int]:
        """(the hashes of `rows` for the block of steps holding `step` [HASH_BLOCK_STEPS, len(rows)], step's row in it)."""
        first = step - step % HASH_BLOCK_STEPS
        if first != self._first:
            self._first, self._blocks = first, {}
        tag = rows.tobytes()
        hashes = self._blocks.get(tag)
        if hashes is None:
            keys = np.array([_step_key(self.key, s) for s in range(first, first + HASH_BLOCK_STEPS)], dtype=np.uint64)
            hashes = self._blocks[tag] = splitmix64(keys[:, None] ^ rows[None, :])
        return hashes, step - first

    def __call__(self, step: int, rows: np.ndarray) -> np.ndarray:
        hashes, i = self.block(step, rows)
        return hashes[i]


HASH_BLOCK_STEPS = 64
