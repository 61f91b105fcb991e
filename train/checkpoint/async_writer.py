"""Asynchronous checkpoint writes (train.async_checkpoint): the state is staged to host memory on the training
thread, then one background thread writes it while training goes on.

`stage_to_host(obj)` is the only part that blocks training: every tensor of the state gets its own host copy
(pinned on CUDA, so the device-to-host copies run at full bandwidth), storages shared in the state stay shared
(a tied embedding is one storage in the file, as with a synchronous save), and containers are rebuilt, so later
steps change nothing the thread is writing. `AsyncWriter` owns the thread: at most one write in flight (`submit`
first waits for the previous one), `wait()` blocks until it is done, and a write that failed surfaces as one
CheckpointError line at the next `submit` or `wait`, never lost. The write itself is the synchronous path
(train/checkpoint/io.py write_checkpoint: temporary name, fsync, rename, then `latest.pt` and retention), so a
kill -9 during it leaves only a temporary file that no listing takes for a checkpoint.
"""
from __future__ import annotations

import copy
import threading
from typing import Callable

import torch

from train.core.errors import CheckpointError


def stage_to_host(obj, pin: bool = False):
    """A copy of obj (dicts, lists, tuples, tensors, plain values) whose tensors live in fresh host memory, pinned
    when `pin`. Tensors that share a storage share its copy. With pin, device copies are asynchronous and this
    waits for them before returning."""
    memo: dict = {}
    staged = _stage(obj, memo, pin)
    if pin and torch.cuda.is_available():
        torch.cuda.synchronize()
    return staged


def _stage(obj, memo: dict, pin: bool):
    if isinstance(obj, torch.Tensor):
        return _stage_tensor(obj, memo, pin)
    if isinstance(obj, dict):
        return type(obj)((k, _stage(v, memo, pin)) for k, v in obj.items())
    if isinstance(obj, list):
        return [_stage(v, memo, pin) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_stage(v, memo, pin) for v in obj)
    if isinstance(obj, (str, int, float, bool, type(None))):
        return obj
    return copy.deepcopy(obj)


def _stage_tensor(t: torch.Tensor, memo: dict, pin: bool) -> torch.Tensor:
    storage = t.untyped_storage()
    key = (storage.device, storage.data_ptr(), storage.nbytes())
    host = memo.get(key)
    if host is None:
        pinned = pin and storage.device.type != "cpu"
        host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pinned).untyped_storage()
        host.copy_(storage, non_blocking=pinned)
        memo[key] = host
    return torch.empty(0, dtype=t.dtype).set_(host, t.storage_offset(), t.size(), t.stride())


class AsyncWriter:
    """One background write at a time. `submit(what, write)` runs write() on a new thread once the previous write
    is done; `wait()` returns when none is in flight; both raise the failed previous write's CheckpointError."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: str | None = None
        self._cause: BaseException | None = None  # the failed write's exception (an OSError: its errno says why)

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, what: str, write: Callable[[], object]) -> None:
        self.wait()
        self._thread = threading.Thread(target=self._run, args=(what, write), name="async-checkpoint", daemon=False)
        self._thread.start()

    def wait(self) -> None:
        """Block until no write is in flight; a write that failed raises here (once)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, cause, self._error, self._cause = self._error, self._cause, None, None
            raise CheckpointError(error) from cause

    def _run(self, what: str, write: Callable[[], object]) -> None:
        try:
            write()
        except BaseException as exc:  # noqa: BLE001 - reported on the training thread, not lost with this one
            detail = " ".join(str(exc).split()) or type(exc).__name__
            self._error = f"the asynchronous write of {what} failed: {type(exc).__name__}: {detail}"
            self._cause = exc
