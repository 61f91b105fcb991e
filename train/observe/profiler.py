"""torch.profiler captures: a scheduled window (runtime.profile_steps A:B) and on-demand captures
(a sustained throughput drop). Traces go to OUT_DIR/profile/ (TensorBoard's profiler plugin reads
them); on CUDA a memory snapshot (torch.cuda.memory._dump_snapshot) is written beside them."""
from __future__ import annotations

from pathlib import Path

import torch


class StepProfiler:
    """on_written(step, tag, paths): called after a capture is written (the runner records a 'profile' row)."""

    def __init__(self, out_dir: Path, spec: str, on_written=None):
        self.dir = out_dir / "profile"
        self.window = tuple(int(x) for x in spec.split(":")) if spec else None
        self.on_written = on_written
        self._prof = None
        self._stop_at = None
        self._tag = ""

    def before_step(self, step: int) -> None:
        """step: the 1-based index of the step about to run."""
        if self.window and step == self.window[0] and self._prof is None:
            self.start(step, self.window[1], tag=f"steps{self.window[0]}-{self.window[1]}")

    def start(self, step: int, stop_at: int, tag: str) -> None:
        if self._prof is not None:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self._tag, self._stop_at = tag, stop_at
        self._prof = torch.profiler.profile(
            activities=activities, record_shapes=True, profile_memory=True,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(str(self.dir), worker_name=tag),
        )
        self._prof.__enter__()

    def after_step(self, step: int) -> None:
        if self._prof is None or step < self._stop_at:
            return
        self._prof.__exit__(None, None, None)
        self._prof = None
        written = sorted(str(p) for p in self.dir.glob(f"{self._tag}*"))
        if torch.cuda.is_available():
            snap = self.dir / f"memory_snapshot_{self._tag}.pickle"
            torch.cuda.memory._dump_snapshot(str(snap))
            torch.cuda.memory._record_memory_history(enabled=None)
            written.append(str(snap))
        if self.on_written:
            self.on_written(step, self._tag, written)

    def close(self, step: int) -> None:
        if self._prof is not None:
            self._stop_at = step
            self.after_step(step)
