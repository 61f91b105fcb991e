"""Batches drawn from a weighted mixture of world-size-free sources (bin: directories, synthetic), in the training
process (the mixture as configured: train/core/mixture.py; docs/DATA.md "Mixtures").

Global row g of optimizer step s draws from source j = the interval of the stage's cumulative weights that
u = hash(seed, MIXTURE_STREAM, s, g) falls in (its top 53 bits), and reads the window of source j that u picks among
that source's window starts (u mod their count: train/data/memmap.py `starts_of`; any token, or document starts with
window_start=document). Given the source, u is uniform over an interval of at least weight x 2**64 values, so u mod
n is uniform to within n / (weight x 2**64): the window does not depend on the choice of source. So the order is a
pure function of (seed, step, row, weights), the same on any world size and batch split; the state is the step
counter and resume is exact. A stage changes the weights from its first step on. Per source, its loss mask and
window starts apply as they would alone, and the trainer's EOS-based document masking sees each row's tokens as they
are. The hashes, each row's source and each bin: source's window starts are planned for a block of
HASH_BLOCK_STEPS steps at once (numpy calls per block, not per step); a step is then one gather per source drawn,
converted straight into each row's place in the int64 batch: bench/bench_mixture.py.
Synthetic sources generate their rows from their own seed (train/data/build.py `source_seed`).

A stream source (text:, jsonl:, parquet:, hf:, fineweb_edu) gives the rows it is picked for in the order it reads
them: its StreamBatches yields one row per next_batch(), and its reader positions join the state under "streams".
Which rows it fills is still the pure function above; what they hold is the stream's next windows, so a mixture
with a stream resumes exactly at the same world size and data.num_workers, and refuses another in one line (as a
stream alone does).

The realised rows per source are counted over each whole global batch (every rank counts the same), for the share
logged beside the weights (`shares`).
"""
from __future__ import annotations

import bisect

import numpy as np
import torch

from train.core.mixture import Mixture
from train.data.memmap import MemmapStream, RowHashBlocks, row_hashes, stream_key, targets_of, windows_to_batch
from train.data.remote import total_counts
from train.data.state import GlobalBatchOrder, expect_global_state

MIXTURE_STREAM = 0x6D697874  # "mixt": the hash stream that picks a row's source (not a window stream)
class MixtureStream(GlobalBatchOrder):
    """parts: one per mixture source, in its order: MemmapStream / SyntheticStream (world-size-free) or StreamBatches
    built with batch_size 1."""

    kind = "mixture"

    def __init__(self, mixture: Mixture, parts: list[GlobalBatchOrder], *, seq_len: int, batch_size: int, seed: int,
                 rank: int = 0, world_size: int = 1, accumulate: int = 1, stream: int, pin: bool = False):
        self._init_order(batch_size=batch_size, rank=rank, world_size=world_size, accumulate=accumulate,
                         seed=seed, stream=stream)
        self.mixture, self.parts, self.seq_len, self.pin = mixture, parts, seq_len, pin
        self.any_world_size = mixture.any_world_size  # a stream source's position is per rank
        self._key = stream_key(seed, MIXTURE_STREAM ^ stream)
        self._hashes = RowHashBlocks(self._key)
        self._plans_first, self._plans = -1, {}  # the block plans of the current block of steps, per rows array
        # per stage: cumulative shares scaled to 2**53, the last exactly 2**53, so u < 2**53 always lands in one
        self._cuts = []
        for stage in mixture.stages:
            cum = np.cumsum(np.asarray(stage.weights, dtype=np.float64))
            cum[-1] = 1.0
            self._cuts.append((cum * float(1 << 53)).astype(np.uint64))
        self._starts = [stage.start for stage in mixture.stages]
        self.rows_per_source = np.zeros(len(parts), dtype=np.int64)  # over whole global batches of counted steps
        self._counted_steps = 0

    def sources_of(self, step: int, rows: np.ndarray) -> np.ndarray:
        """[len(rows)] int64: the source index of each global row (uint64) of optimizer step `step`."""
        return self._pick(step, row_hashes(self._key, step, rows))

    def _pick(self, step: int, hashes: np.ndarray) -> np.ndarray:
        return np.searchsorted(self._cuts_at(step), hashes >> np.uint64(11), side="right")  # top 53 bits -> source

    def _cuts_at(self, step: int) -> np.ndarray:
        return self._cuts[bisect.bisect_right(self._starts, step) - 1]  # the stage of `step`

    def rows_batch(self, step: int, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        plan, i = self._plan(step, rows)
        bounds, order, j = plan.bounds[i], plan.order[i], plan.only[i]  # source j's rows: order[bounds[j]:bounds[j+1]]
        if j in plan.starts:  # every row from one bin: source: exactly its own batch
            return windows_to_batch(*self.parts[j].windows(plan.starts[j][i]), self.pin)
        x = np.empty((len(rows), self.seq_len), dtype=np.int64)  # [B, T]
        y = np.empty((len(rows), self.seq_len), dtype=np.int64)
        others = []
        for j, part in enumerate(self.parts):
            lo, hi = bounds[j], bounds[j + 1]
            if lo == hi:
                continue
            if j in plan.starts:  # bin: one gather, then each row converted straight into its place
                picked = order[lo:hi]
                windows, excluded = part.windows(plan.starts[j][i, lo:hi])  # [n, T+1]
                x[picked] = windows[:, :-1]
                y[picked] = windows[:, 1:] if excluded is None else targets_of(windows, excluded)
            else:
                others.append((part, order[lo:hi]))
        x, y = torch.from_numpy(x), torch.from_numpy(y)
        for part, picked in others:
            if isinstance(part, GlobalBatchOrder):  # synthetic: its own rows
                xj, yj = part.rows_batch(step, rows[picked])
            else:  # a stream: its next rows, one [1, T] batch each, in order
                rows_read = [part.next_batch() for _ in picked]
                xj, yj = torch.cat([r[0] for r in rows_read]), torch.cat([r[1] for r in rows_read])
            index = torch.from_numpy(picked)
            x[index], y[index] = xj, yj
        return (x.pin_memory(), y.pin_memory()) if self.pin else (x, y)

    def _plan(self, step: int, rows: np.ndarray) -> tuple[_BlockPlan, int]:
        """The plan of the block of steps holding `step` for these rows, built once per block and rows array (a rank
        asks for one rows array per micro-batch), and step's index in it."""
        hashes, i = self._hashes.block(step, rows)  # [K, B] uint64
        first = step - i
        if first != self._plans_first:
            self._plans_first, self._plans = first, {}
        tag = rows.tobytes()
        plan = self._plans.get(tag)
        if plan is None:
            plan = self._plans[tag] = _BlockPlan(self, first, hashes)
        return plan, i

    def _count_until(self, step: int) -> None:
        all_rows = np.arange(self.global_batch, dtype=np.uint64)
        for s in range(self._counted_steps, step):
            self.rows_per_source += np.bincount(self.sources_of(s, all_rows), minlength=len(self.parts))
        self._counted_steps = max(self._counted_steps, step)

    def rows(self, until: int | None = None) -> dict[str, int]:
        """{source name: rows of every whole optimizer step so far, or before step `until`} (all ranks together; a
        function of the step: a resumed stream counts them again from its order)."""
        self._count_until(self.step if until is None else until)
        return {name: int(n) for name, n in zip(self.mixture.names, self.rows_per_source)}

    def retry_counts(self) -> dict | None:
        """The read retries of this rank's stream sources together (None without one)."""
        return total_counts([part.retry_counts() for part in self._streams().values()])

    def _streams(self) -> dict[str, object]:
        """{name: part} of the stream sources (their positions are per rank: resume needs the same world size)."""
        return {name: part for name, part in zip(self.mixture.names, self.parts)
                if not isinstance(part, GlobalBatchOrder)}

    def state_dict(self) -> dict:
        streams = {name: part.state_dict() for name, part in self._streams().items()}
        return {**super().state_dict(), "mixture": self.mixture.identity(), **({"streams": streams} if streams else {})}

    def load_state_dict(self, state: dict) -> None:
        split = {"batch_size": self.batch_size, "accumulate": self.accumulate, "world_size": self.world_size}
        step = expect_global_state(state, kind=self.kind, seed=self.seed, stream=self.stream,
                                   global_batch=self.global_batch, split=split, mixture=self.mixture.identity())
        for name, part in self._streams().items():  # each raises the stream's one-line refusal on another identity
            part.load_state_dict((state.get("streams") or {}).get(name))
        self.calls = step * self.accumulate
        self.rows_per_source[:] = 0
        self._counted_steps = 0

    def close(self) -> None:
        for part in self.parts:
            part.close()


class _BlockPlan:
    """For the K = HASH_BLOCK_STEPS steps of a block and one rows array [B]: each row's source, the rows grouped by
    source in ascending position (order [K, B]; source j's run of step k is order[k, bounds[k][j]:bounds[k][j+1]]),
    the source of each step whose rows all come from one (only [K], else -1) and, per bin: source j, the window starts
    of the rows in order (starts[j] [K, B]: only its own run is read). Numpy calls per block, not per step; the
    numbers are the per-row pure function of the module docstring."""

    def __init__(self, mix: MixtureStream, first: int, hashes: np.ndarray):
        K, J = hashes.shape[0], len(mix.parts)
        which = np.empty(hashes.shape, dtype=np.int64)  # [K, B] each row's source
        stage = np.searchsorted(mix._starts, np.arange(first, first + K), side="right") - 1  # [K]
        edges = [0, *(np.flatnonzero(np.diff(stage)) + 1).tolist(), K]  # runs of steps in one stage
        for s, e in zip(edges[:-1], edges[1:]):
            which[s:e] = mix._pick(first + s, hashes[s:e])
        self.order = np.argsort(which, axis=1, kind="stable")  # [K, B]: positions grouped by source, ascending
        counts = (which[:, :, None] == np.arange(J)).sum(axis=1)  # [K, J]
        bounds = np.zeros((K, J + 1), dtype=np.int64)
        np.cumsum(counts, axis=1, out=bounds[:, 1:])
        self.bounds = bounds.tolist()
        self.only = np.where(counts.max(axis=1) == hashes.shape[1], counts.argmax(axis=1), -1).tolist()
        grouped = np.take_along_axis(hashes, self.order, axis=1)  # [K, B] the hashes in `order`
        self.starts = {j: part.starts_of(grouped) for j, part in enumerate(mix.parts) if isinstance(part, MemmapStream)}
