"""Append-only key/value storage shared by the dense and NSA decode caches."""
from __future__ import annotations

import torch


class GrowingBuffer:
    """Append-only [B, H, t, hd] storage with amortised O(1) appends; capacity is a multiple of `quantum`."""

    def __init__(self, quantum: int = 1) -> None:
        self.quantum = quantum
        self.data: torch.Tensor | None = None  # [B, H, capacity, hd], zeros beyond `length`
        self.length = 0

    def append(self, x: torch.Tensor) -> None:  # x: [B, H, n, hd]
        need = self.length + x.shape[2]
        if self.data is None or need > self.data.shape[2]:
            cap = max(need, 2 * (0 if self.data is None else self.data.shape[2]))
            cap = -(-cap // self.quantum) * self.quantum
            grown = x.new_zeros(x.shape[0], x.shape[1], cap, x.shape[3])
            if self.data is not None:
                grown[:, :, : self.length] = self.data[:, :, : self.length]
            self.data = grown
        self.data[:, :, self.length : need] = x
        self.length = need

    def view(self) -> torch.Tensor:  # [B, H, length, hd]
        return self.data[:, :, : self.length]


class RingBuffer:
    """The last `size` positions of a [B, H, t, hd] stream; position s lives in slot s % size.

    Appending a token writes one slot (no shifting copy). Attention over the whole window does not
    depend on key order, so a decode step reads `unordered()`; a multi-token call needs the keys in
    position order, from `latest(n)`.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.data: torch.Tensor | None = None  # [B, H, size, hd]
        self.t = 0  # positions appended so far

    def append(self, x: torch.Tensor) -> None:  # x: [B, H, n, hd]
        n = x.shape[2]
        if self.data is None:
            self.data = x.new_zeros(x.shape[0], x.shape[1], self.size, x.shape[3])
        keep = min(n, self.size)  # older positions of x would be overwritten anyway
        slot = (self.t + n - keep) % self.size
        first = min(keep, self.size - slot)
        self.data[:, :, slot : slot + first] = x[:, :, n - keep : n - keep + first]
        if first < keep:  # wrap around
            self.data[:, :, : keep - first] = x[:, :, n - keep + first :]
        self.t += n

    def unordered(self) -> torch.Tensor:  # [B, H, min(t, size), hd], slot order
        return self.data[:, :, : min(self.t, self.size)]

    def latest(self, n: int) -> torch.Tensor | None:  # [B, H, min(n, t, size), hd] oldest first
        if self.data is None:
            return None
        n = min(n, self.t, self.size)
        start = (self.t - n) % self.size  # slot of the oldest wanted position
        if start + n <= self.size:
            return self.data[:, :, start : start + n]
        return torch.cat((self.data[:, :, start:], self.data[:, :, : start + n - self.size]), dim=2)
