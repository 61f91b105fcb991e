"""Spike skipping (train.spike_skip_z_loss / spike_skip_z_norm): an optimizer step whose loss or gradient norm is an
upward outlier against a trailing window of accepted steps is skipped, through the same on-device path as a
non-finite step (train/trainer/optim.py `step_unless_nonfinite`).

Everything stays on the device (no host sync per step): the window is a ring buffer [2, W] (row 0 the global mean
loss, row 1 the global gradient norm of the last W accepted steps), a count of accepted steps and the streak of
consecutive spike skips (and its peak since the loop last read it). A step is a spike when the window is full (W accepted steps since the start, so nothing is
flagged before) and, for a checked quantity x with threshold z,

    x - mean > z * max(std, 1e-4 * |mean|)      (one-sided: only upward; std unbiased, over the window)

The floor keeps a nearly flat series from flagging rounding noise. A skipped step (spike or non-finite) does not
enter the window, nor does a step whose loss or norm is non-finite. The streak counts spike skips in a row: an
accepted step resets it, a non-finite skip leaves it as it is (train.nonfinite_skip_limit governs those).

Every rank feeds the same values (the loss is all-reduced by the loop, the norm is global), so every rank takes the
same decisions and holds the same buffers: a checkpoint stores them once (`state_dict`), for any world size.
"""
from __future__ import annotations

import torch

from train.core.config import TrainConfig

STD_FLOOR = 1e-4  # relative to |mean|: the smallest spread a z-score is measured against


class SpikeDetector:
    def __init__(self, window: int, z_loss: float | None, z_norm: float | None, device: torch.device):
        """z_loss / z_norm: thresholds in standard deviations; None: that quantity is not checked."""
        if window < 2:
            raise ValueError(f"window must be >= 2, got {window}")
        self.window = window
        self.ring = torch.zeros(2, window, device=device)  # [2, W] float32: loss, norm of accepted steps
        self.count = torch.zeros((), dtype=torch.int64, device=device)  # accepted steps recorded (whole run)
        self.streak = torch.zeros((), device=device)  # consecutive spike skips, 0-dim float32
        self.peak = torch.zeros((), device=device)  # the longest streak since the last take_peak(), 0-dim float32
        self.z = torch.tensor([z_loss or 0.0, z_norm or 0.0], device=device)  # [2]
        self.checked = torch.tensor([z_loss is not None, z_norm is not None], device=device)  # [2] bool

    @classmethod
    def from_config(cls, cfg: TrainConfig, device: torch.device) -> SpikeDetector | None:
        """None when spike skipping is off (both thresholds null): the loop then does no extra work."""
        if not cfg.spike_skip:
            return None
        return cls(cfg.spike_skip_window, cfg.spike_skip_z_loss, cfg.spike_skip_z_norm, device)

    def observe(self, loss: torch.Tensor, norm: torch.Tensor, found_inf: torch.Tensor) -> torch.Tensor:
        """One step's decision and bookkeeping, on the device. loss: the global mean loss, norm: the global gradient
        norm (0-dim each); found_inf: 1.0 when the step is skipped as non-finite. Returns spike (0-dim float32, 1.0
        when the step is to be skipped as a spike, never together with found_inf)."""
        x = torch.stack([loss.detach().float(), norm.detach().float()])  # [2]
        mean = self.ring.mean(dim=1)  # [2]
        std = torch.maximum(self.ring.std(dim=1), STD_FLOOR * mean.abs())  # [2]
        over = (x - mean > self.z * std) & self.checked  # [2] bool; a nan x compares False
        full = self.count >= self.window
        spike = ((over.any() & full).float() * (1.0 - found_inf))  # 0-dim
        skip = found_inf + spike  # 0 or 1
        accept = (1.0 - skip) * torch.isfinite(x).all().float()  # 0-dim: enters the window
        pos = (self.count % self.window).view(1)  # [1]
        old = self.ring.index_select(1, pos)  # [2, 1]
        self.ring.index_copy_(1, pos, torch.where(accept.bool(), x.view(2, 1), old))
        self.count += accept.long()
        self.streak.copy_((self.streak + spike) * skip)  # accepted: 0; spike: +1; non-finite: unchanged
        torch.maximum(self.peak, self.streak, out=self.peak)
        return spike

    def take_peak(self) -> torch.Tensor:
        """The longest streak since the last call (0-dim, on the device; the caller reads it with its interval's
        other counters), then the peak starts again from 0: a streak still running goes on counting in `streak`
        and is seen again at its next step, one that ended was seen now."""
        peak = self.peak.clone()
        self.peak.zero_()
        return peak

    # ---- checkpoint ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """World-size free (the same on every rank): the ring as it lies, the count, the streak and its peak (host
        sync: call it at a checkpoint only)."""
        return {"ring": self.ring.detach().cpu().clone(), "count": int(self.count), "streak": int(self.streak),
                "peak": int(self.peak)}

    def load_state_dict(self, state: dict) -> str | None:
        """Restore a saved window; None, or a one-line note when the window length changed (the newest accepted
        values are kept, oldest first, so the decisions continue from the same history)."""
        ring = state["ring"].to(self.ring.device, self.ring.dtype)  # [2, W_saved]
        count, saved_w = int(state["count"]), ring.shape[1]
        self.streak.fill_(float(state["streak"]))
        self.peak.fill_(float(state["peak"]))
        if saved_w == self.window:
            self.ring.copy_(ring)
            self.count.fill_(count)
            return None
        n = min(count, saved_w)
        order = [(count - n + i) % saved_w for i in range(n)]  # chronological, oldest first
        kept = ring[:, order][:, max(0, n - self.window):]  # [2, <= W]
        self.ring.zero_()
        self.ring[:, :kept.shape[1]] = kept
        self.count.fill_(kept.shape[1])
        return (f"note: train.spike_skip_window changes from the checkpoint's {saved_w} to {self.window}; the newest "
                f"{kept.shape[1]} accepted steps are kept")
