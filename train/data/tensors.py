"""Token windows -> the (x, y) tensors every BatchStream returns."""
from __future__ import annotations

import numpy as np
import torch


def windows_to_xy(windows: np.ndarray, pin: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T+1] ids -> contiguous int64 CPU (x, y), y = x shifted by one; pinned if asked."""
    w = torch.from_numpy(np.ascontiguousarray(windows, dtype=np.int64))
    x, y = w[:, :-1].contiguous(), w[:, 1:].contiguous()
    if pin:
        x, y = x.pin_memory(), y.pin_memory()
    return x, y
