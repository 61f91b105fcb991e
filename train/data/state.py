"""Stream state shared by every BatchStream: identity checks, and the world-size-free batch order.

World-size-free order (MemmapStream, SyntheticStream): the global batch of optimizer step s has
G = batch_size x accumulate x world_size rows, and row g's window is a pure function of
(seed, stream, s, g). On rank r the k-th next_batch() is micro-batch m = k % accumulate of step
s = k // accumulate and holds global rows (m * world_size + r) * batch_size + 0 .. batch_size-1.
So 2 ranks x batch 4 read exactly the rows of 1 rank x batch 8, and the state ({kind, seed,
stream, global_batch, step}) resumes on any world size and batch split with the same G.
"""
from __future__ import annotations

import numpy as np

from train.core.errors import DataError

# stream ids: the same generator/sampler with another id gives disjoint draws (validation)
TRAIN_STREAM, VAL_STREAM = 0, 1


RESTART_KEY = "data.restart_on_change"  # the override that starts the data fresh instead (docs/USE.md "Resuming")


def identity_refusal(state, expected: dict) -> str | None:
    """The one-line refusal for resuming a data state saved by a stream of another identity (seed, source, tokenizer,
    sequence length, ...) than `expected`; None when every field matches. The trainer's start checks
    (train/trainer/start_checks.py) and the streams' load_state_dict both ask this function."""
    if not isinstance(state, dict):
        return f"data state must be a dict, got {type(state).__name__}"
    for key, want in expected.items():
        got = state.get(key)
        if got != want:
            return (f"data state was saved with {key}={got!r} but this run has {key}={want!r}; resume with the same data "
                    f"settings, or set --{RESTART_KEY}=true to start the training data afresh under the new ones")
    return None


def expect_state(state: dict, **expected) -> None:
    """Raise DataError if `state` was saved by a stream with different identity fields."""
    if refusal := identity_refusal(state, expected):
        raise DataError(refusal)


def _split_text(global_batch, split) -> str:
    if isinstance(split, dict) and all(isinstance(split.get(k), int) for k in ("batch_size", "accumulate", "world_size")):
        return (f"{global_batch} (train.batch_size {split['batch_size']} x accumulate_grad_batches "
                f"{split['accumulate']} x world_size {split['world_size']})")
    return str(global_batch)


def mixture_refusal(saved, want: dict) -> str | None:
    """The one-line refusal for resuming a mixture's state under other sources or stages (train/core/mixture.py
    `Mixture.identity`); None when they are the same."""
    if saved == want:
        return None
    saved = saved if isinstance(saved, dict) else {}
    old = [f"{s.get('name')} ({s.get('kind')})" for s in saved.get("sources", [])]
    new = [f"{s['name']} ({s['kind']})" for s in want["sources"]]
    what = (f"sources {', '.join(old) or '?'} -> {', '.join(new)}" if old != new
            else "the same sources with other weights, stages or window starts")
    return (f"data state was saved with another data mixture ({what}); resume with the same data.mixture and "
            f"data.stages, or set --{RESTART_KEY}=true to start the training data afresh under the new ones")


def global_state_refusal(state, *, kind: str, seed: int, stream: int, mixture: dict | None = None) -> str | None:
    """Why a world-size-free stream (kind, seed, stream; a mixture's identity) cannot continue from `state`, in one
    line; None when it can (the global batch is checked apart: the trainer's start fits its split to the saved one)."""
    if refusal := identity_refusal(state, {"kind": kind}):
        return refusal
    if "global_batch" not in state and ("rank" in state or "world_size" in state):
        return (f"this {kind} data state was written before world-size-free data order (it is per rank, "
                f"rank {state.get('rank')!r} of world_size {state.get('world_size', '?')!r}); resume it with the "
                f"same world size on an older version of this code, or start a new out_dir")
    if refusal := identity_refusal(state, {"seed": seed, "stream": stream}):
        return refusal
    if mixture is not None and (refusal := mixture_refusal(state.get("mixture"), mixture)):
        return refusal
    step = state.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return f"data state has step={step!r}; expected a non-negative integer (a damaged checkpoint?)"
    return None


def expect_global_state(state: dict, *, kind: str, seed: int, stream: int, global_batch: int, split: dict,
                        mixture: dict | None = None) -> int:
    """Check a world-size-free state against this stream; return the optimizer steps it consumed."""
    if refusal := global_state_refusal(state, kind=kind, seed=seed, stream=stream, mixture=mixture):
        raise DataError(refusal)
    saved = state.get("global_batch")
    if saved != global_batch:
        raise DataError(f"data state was saved with global batch {_split_text(saved, state.get('split'))} but this run "
                        f"has global batch {_split_text(global_batch, split)}; choose train.batch_size, "
                        f"train.accumulate_grad_batches and the number of GPUs so that their product is {saved} again, "
                        f"or start a new out_dir")
    return state["step"]


class GlobalBatchOrder:
    """Mixin: next_batch/state_dict/load_state_dict in the world-size-free order (module docstring).

    A subclass sets `kind`, calls _init_order(...) and implements rows_batch(step, rows) ->
    (x, y) for global rows `rows` (uint64 [batch_size]) of optimizer step `step`.
    """

    any_world_size = True
    kind = ""

    def _init_order(self, *, batch_size: int, rank: int, world_size: int, accumulate: int, seed: int, stream: int) -> None:
        if batch_size < 1 or accumulate < 1 or world_size < 1:
            raise DataError(f"batch_size, accumulate and world_size must be >= 1, got {batch_size}, {accumulate}, {world_size}")
        self.batch_size, self.rank, self.world_size, self.accumulate = batch_size, rank, world_size, accumulate
        self.seed, self.stream = seed, stream
        self.global_batch = batch_size * accumulate * world_size
        self.calls = 0  # k: next_batch() calls so far on this rank
        self._row = np.arange(batch_size, dtype=np.uint64)

    @property
    def step(self) -> int:
        """Optimizer steps consumed (whole ones; a partial step is read again after a resume)."""
        return self.calls // self.accumulate

    def rows_at(self, k: int) -> tuple[int, np.ndarray]:
        """(optimizer step, global row indices as uint64 [batch_size]) of this rank's k-th micro-batch."""
        step, micro = divmod(int(k), self.accumulate)
        first = (micro * self.world_size + self.rank) * self.batch_size
        return step, self._row + np.uint64(first)

    def batch_at(self, k: int):
        """This rank's k-th micro-batch (for validation streams, accumulate=1: val batch k)."""
        return self.rows_batch(*self.rows_at(k))

    def rows_batch(self, step: int, rows: np.ndarray):  # pragma: no cover - implemented by subclasses
        raise NotImplementedError

    def next_batch(self):
        batch = self.batch_at(self.calls)
        self.calls += 1
        return batch

    def state_dict(self) -> dict:
        split = {"batch_size": self.batch_size, "accumulate": self.accumulate, "world_size": self.world_size}
        return {"kind": self.kind, "seed": self.seed, "stream": self.stream, "global_batch": self.global_batch,
                "step": self.step, "split": split}  # split: informational only, never checked

    def load_state_dict(self, state: dict) -> None:
        split = {"batch_size": self.batch_size, "accumulate": self.accumulate, "world_size": self.world_size}
        step = expect_global_state(state, kind=self.kind, seed=self.seed, stream=self.stream,
                                   global_batch=self.global_batch, split=split)
        self.calls = step * self.accumulate


def stream_resume_refusal(saved_world_size: int, world_size: int, saved_num_workers: int, num_workers: int,
                          checkpoint: str | None = None) -> str | None:
    """The one-line refusal for resuming a stream-source checkpoint with another world size or
    data.num_workers (their reader positions are per rank and per worker); None when both match."""
    if saved_world_size == world_size and max(1, saved_num_workers) == max(1, num_workers):
        return None
    where = f"checkpoint {checkpoint}" if checkpoint else "the checkpoint"
    return (f"{where} was written by {saved_world_size} rank(s) with data.num_workers={saved_num_workers} but this run "
            f"has {world_size} rank(s) with data.num_workers={num_workers}, and a stream source's position is kept per "
            f"rank and per worker; resume with `torchrun --nproc_per_node={saved_world_size} ...` and "
            f"--data.num_workers={saved_num_workers}, or set --{RESTART_KEY}=true to start the stream afresh")
