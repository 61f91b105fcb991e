"""The counters a checkpoint carries besides weights, optimizer and data."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class TrainState:
    """What a checkpoint carries besides weights, optimizer and data (train/trainer/build_run.py saves and
    restores it; the summary sink reads it live)."""
    step: int = 0  # optimizer steps completed
    tokens_seen: int = 0
    best_val_loss: float = math.inf
    last_val_loss: float | None = None
    skipped_steps: int = 0  # non-finite steps skipped, whole run
    spike_skipped_steps: int = 0  # loss / gradient-norm spikes skipped, whole run (train/trainer/spikes.py)
    stop_reason: str | None = None
