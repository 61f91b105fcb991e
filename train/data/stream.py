"""Batches from a document stream: read -> tokenize in batches -> pack -> (x, y), resumable.

Each rank runs max(1, num_workers) *readers*; reader r of rank k is global reader
k * W + r of world_size * W, and owns a disjoint part of the documents (sources.ReaderPlan).
With num_workers = 0 the single reader runs in the training process; otherwise each DataLoader
worker runs one reader and batches arrive round-robin (reader 0, 1, ..., W-1, 0, ...).

Every batch carries its reader's position after it, (epoch, shard, doc, offset), so the
stream's state is the position of each reader plus which reader is next. Resuming restarts
each reader at its document, re-tokenizes it and skips `offset` tokens; workers are rotated
so the round-robin continues with the right reader.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from train.core.errors import DataError
from train.data.meta import dtype_for_vocab
from train.data.packing import WindowPacker
from train.data.remote import DataOutage, Retrier, RetryPolicy, RetryStats, total_counts
from train.data.sources import Position, ReaderPlan, StreamUnavailable, is_held_out, iter_documents
from train.data.state import expect_state
from train.data.tensors import windows_to_xy
from train.data.tokenizers import load_tokenizer

START = {"epoch": 0, "shard": 0, "doc": 0, "offset": 0}


def read_windows(ds, *, plan: ReaderPlan, text_field: str, keep, tokenizer_name: str, seq_len: int,
                 batch_size: int, tokenize_batch_docs: int, start: dict, retrier: Retrier | None = None
                 ) -> Iterator[tuple[np.ndarray, dict]]:
    """Yield ([batch_size, seq_len + 1] windows, reader state after them), forever. retrier: transient read failures
    are retried from the same document (sources.iter_documents)."""
    tokenizer = load_tokenizer(tokenizer_name)
    eos, dtype = tokenizer.eos_id, np.dtype(dtype_for_vocab(tokenizer.n_vocab))
    packer = WindowPacker(seq_len)
    cursor = Position(start["epoch"], start["shard"], start["doc"])
    skip_first = start["offset"]
    documents = iter_documents(ds, plan, text_field, keep, cursor, retrier=retrier)
    while True:
        windows = []
        while len(windows) < batch_size:
            window = packer.pop_window()
            if window is not None:
                windows.append(window)
                continue
            chunk = [next(documents) for _ in range(tokenize_batch_docs)]
            for (position, _), ids in zip(chunk, tokenizer.encode_batch([text for _, text in chunk])):
                tokens = np.empty(len(ids) + 1, dtype=dtype)
                tokens[:-1] = ids
                tokens[-1] = eos
                packer.add(position, tokens, skip_first)
                skip_first = 0
            cursor = Position(chunk[-1][0].epoch, chunk[-1][0].shard, chunk[-1][0].doc + 1)
        head = packer.head()
        position, offset = head if head is not None else (cursor, 0)
        yield np.stack(windows), {"epoch": position.epoch, "shard": position.shard, "doc": position.doc, "offset": offset}


class _Keep:
    """Picklable document filter: training skips held-out documents, validation keeps only them."""

    def __init__(self, role: str, split_seed: int, val_fraction: float):
        self.role, self.split_seed, self.val_fraction = role, split_seed, val_fraction

    def __call__(self, text: str) -> bool:
        if self.role == "all":
            return True
        return is_held_out(text, self.split_seed, self.val_fraction) == (self.role == "val")


class _ReaderDataset(IterableDataset):
    """One reader per DataLoader worker (or the only reader in-process)."""

    def __init__(self, ds, *, readers_per_rank: int, rank: int, world_size: int, first_reader: int,
                 starts: list[dict], retry: RetryPolicy | None, counts: list[dict], **reader_args):
        self.ds, self.readers_per_rank, self.rank, self.world_size = ds, readers_per_rank, rank, world_size
        self.first_reader, self.starts, self.reader_args = first_reader, starts, reader_args
        self.retry, self.counts = retry, counts

    def __iter__(self):
        info = get_worker_info()
        reader = (self.first_reader + (info.id if info else 0)) % self.readers_per_rank
        n_readers = self.world_size * self.readers_per_rank
        global_reader = self.rank * self.readers_per_rank + reader
        plan = ReaderPlan.make(self.ds.n_shards, n_readers, global_reader)
        stats = RetryStats(**{k: v for k, v in self.counts[reader].items() if k != "last_error"})
        retrier = Retrier(self.retry, stats, seed=global_reader) if self.retry is not None else None
        for windows, state in read_windows(self.ds, plan=plan, start=self.starts[reader], retrier=retrier,
                                           **self.reader_args):
            x, y = windows_to_xy(windows, pin=False)
            yield x, y, reader, state, stats.as_dict()


def _as_is(item):
    return item


def stream_identity(*, source: str, role: str, tokenizer_name: str, seq_len: int, batch_size: int, rank: int,
                    world_size: int, num_workers: int, split_seed: int, val_fraction: float) -> dict:
    """What a stream's saved state must match to be continued (its reader positions mean nothing otherwise)."""
    return {"kind": "stream", "source": source, "role": role, "tokenizer": tokenizer_name, "seq_len": seq_len,
            "batch_size": batch_size, "rank": rank, "world_size": world_size, "readers_per_rank": max(1, num_workers),
            "split_seed": split_seed, "val_fraction": val_fraction}


class StreamBatches:
    """BatchStream over a document stream (see module docstring)."""

    any_world_size = False  # reader positions are per rank and per worker: resume needs the same world size

    def __init__(self, ds, *, source: str, role: str, tokenizer_name: str, text_field: str, split_seed: int,
                 val_fraction: float, seq_len: int, batch_size: int, tokenize_batch_docs: int, rank: int,
                 world_size: int, num_workers: int, pin: bool, persistent_workers: bool, prefetch_factor: int,
                 retry: RetryPolicy | None = None):
        self.ds, self.source, self.role, self.retry = ds, source, role, retry
        self.rank, self.world_size, self.num_workers, self.pin = rank, world_size, num_workers, pin
        self.readers_per_rank = max(1, num_workers)
        self.loader_args = {"persistent_workers": persistent_workers, "prefetch_factor": prefetch_factor}
        self.reader_args = {"text_field": text_field, "keep": _Keep(role, split_seed, val_fraction),
                            "tokenizer_name": tokenizer_name, "seq_len": seq_len, "batch_size": batch_size,
                            "tokenize_batch_docs": tokenize_batch_docs}
        self.identity = stream_identity(source=source, role=role, tokenizer_name=tokenizer_name, seq_len=seq_len,
                                        batch_size=batch_size, rank=rank, world_size=world_size,
                                        num_workers=num_workers, split_seed=split_seed, val_fraction=val_fraction)
        self.positions = [dict(START) for _ in range(self.readers_per_rank)]
        self.counts = [RetryStats().as_dict() for _ in range(self.readers_per_rank)]  # each reader's retries so far
        self.next_reader = 0
        self.batches = 0
        self._loader = None
        self._iter = None
        self._peeked = None

    def _start(self) -> None:
        dataset = _ReaderDataset(self.ds, readers_per_rank=self.readers_per_rank, rank=self.rank, world_size=self.world_size,
                                 first_reader=self.next_reader, starts=[dict(p) for p in self.positions],
                                 retry=self.retry, counts=[dict(c) for c in self.counts], **self.reader_args)
        if self.num_workers == 0:
            self._iter = iter(dataset)
            return
        self._loader = DataLoader(dataset, batch_size=None, collate_fn=_as_is, num_workers=self.num_workers,
                                  pin_memory=self.pin, **self.loader_args)
        self._iter = iter(self._loader)

    def prime(self) -> None:
        """Fetch the first batch now (build_data times this); next_batch() returns it first."""
        if self._peeked is None:
            self._peeked = self._fetch()

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        item, self._peeked = (self._peeked or self._fetch()), None
        x, y, reader, state, counts = item
        if reader != self.next_reader:
            raise RuntimeError(f"stream batches out of order: got reader {reader}, expected {self.next_reader}")
        self.positions[reader], self.counts[reader] = state, counts
        self.next_reader = (reader + 1) % self.readers_per_rank
        self.batches += 1
        if self.pin and self.num_workers == 0:
            x, y = x.pin_memory(), y.pin_memory()
        return x, y

    def retry_counts(self) -> dict:
        """This rank's read retries so far, its readers together: retries, stalls, wait_s, last_error."""
        return total_counts(self.counts)

    def _fetch(self):
        if self._iter is None:
            self._start()
        try:
            return next(self._iter)
        except Exception as e:  # a worker's DataError arrives re-wrapped with its traceback
            raise _unwrap_worker_error(e) from None

    def state_dict(self) -> dict:
        return {**self.identity, "readers": [dict(p) for p in self.positions], "next_reader": self.next_reader,
                "batches": self.batches, "retry_counts": [dict(c) for c in self.counts]}

    def load_state_dict(self, state: dict) -> None:
        expect_state(state, **self.identity)
        readers = state.get("readers")
        if not isinstance(readers, list) or len(readers) != self.readers_per_rank:
            raise DataError("data state has no reader positions; it was not saved by this stream")
        self.close()
        self.positions = [{k: int(r[k]) for k in START} for r in readers]
        self.next_reader = int(state["next_reader"])
        self.batches = int(state["batches"])
        counts = state.get("retry_counts")  # absent in checkpoints written before retries were counted
        if isinstance(counts, list) and len(counts) == self.readers_per_rank:
            self.counts = [dict(c) for c in counts]

    def close(self) -> None:
        it, self._iter, self._loader, self._peeked = self._iter, None, None, None
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()


def _unwrap_worker_error(e: Exception) -> Exception:
    """Turn a DataLoader worker's re-raised exception back into a one-line DataError when it was one."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    if isinstance(e, DataError) and len(lines) <= 1:
        return e
    last = lines[-1] if lines else type(e).__name__
    for error_type in (DataOutage, StreamUnavailable, DataError):
        for prefix in (f"{error_type.__module__}.{error_type.__name__}: ", f"{error_type.__name__}: "):
            if last.startswith(prefix):
                return error_type(last[len(prefix):])
    return e
