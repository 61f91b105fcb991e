"""Decode cache for Native Sparse Attention (one per layer).

Holds, per branch:
  selection: every raw key/value so far (any block may be selected), in a zero-filled buffer whose
             capacity is a whole number of selection blocks, so blocks are views (no copy per step);
  compression: the compressed tokens emitted so far, plus the raw keys/values (< l positions) that the
             next compressed token still needs; a token is emitted when its block of l is complete,
             i.e. every d steps once l positions exist;
  window: the last w-1 raw keys/values (the current token makes w).
"""
from __future__ import annotations

import torch

from nsa.attention.compression import num_compressed
from nsa.config import NSAConfig


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


class NSACache:
    def __init__(self, cfg: NSAConfig) -> None:
        self.cfg = cfg
        self.t = 0  # tokens appended so far
        self.sel_k, self.sel_v = GrowingBuffer(cfg.l_sel), GrowingBuffer(cfg.l_sel)
        self.cmp_k, self.cmp_v = GrowingBuffer(), GrowingBuffer()
        self.cmp_raw_k: torch.Tensor | None = None  # [B, H_kv, < l, hd] raw positions cmp_raw_start ..
        self.cmp_raw_v: torch.Tensor | None = None
        self.win_k: torch.Tensor | None = None  # [B, H_kv, <= w-1, hd] the last raw positions
        self.win_v: torch.Tensor | None = None

    @property
    def n_compressed(self) -> int:
        return self.cmp_k.length

    def reads_per_step(self) -> int:
        """Keys read by one query at the newest position t-1: N_c + |I|*l' + min(w, t).

        |I| = min(n, (t-1)//l' + 1); once t >= n*l' this is the paper's N_c + n*l' + min(w, t).
        """
        t, c = self.t, self.cfg
        if t == 0:
            return 0
        n_blocks = min(c.n_sel, (t - 1) // c.l_sel + 1)
        return num_compressed(t, c.l, c.d) + n_blocks * c.l_sel + min(c.w, t)

    def dense_reads_per_step(self) -> int:
        """What a dense KV cache reads for the same query: every key so far."""
        return self.t
