"""Decode cache for Native Sparse Attention (one per layer).

Holds, per branch:
  selection: every raw key/value so far (any block may be selected), in a zero-filled buffer whose
             capacity is a whole number of selection blocks, so blocks are views (no copy per step);
  compression: the compressed tokens emitted so far, plus the raw keys/values (< l positions) that the
             next compressed token still needs; a token is emitted when its block of l is complete,
             i.e. every d steps once l positions exist;
  window: the last w raw keys/values in a ring buffer (a decode step writes one slot);
  index (nsa.selector=indexer): one index key per complete selection block (the elementwise max of its tokens'
             keys, nsa/attention/indexer.py), and the keys of the block being filled; with nsa.indexer_pool=scores
             every token's key.
A window-only layer (nsa.gates=window) fills only the window ring; the other buffers stay empty.
"""
from __future__ import annotations

import torch

from nsa.attention.impl.compression import num_compressed
from nsa.attention.kv_buffer import GrowingBuffer, RingBuffer
from nsa.config import NSAConfig


class NSACache:
    def __init__(self, cfg: NSAConfig) -> None:
        self.cfg = cfg
        self.t = 0  # tokens appended so far
        self.sel_k, self.sel_v = GrowingBuffer(cfg.l_sel), GrowingBuffer(cfg.l_sel)
        self.cmp_k, self.cmp_v = GrowingBuffer(), GrowingBuffer()
        self.cmp_raw_k: torch.Tensor | None = None  # [B, H_kv, < l, hd] raw positions cmp_raw_start ..
        self.cmp_raw_v: torch.Tensor | None = None
        self.win_k, self.win_v = RingBuffer(cfg.w), RingBuffer(cfg.w)  # the last w raw positions
        self.index_blocks: torch.Tensor | None = None  # [B, complete blocks, e]
        self.index_open: torch.Tensor | None = None  # [B, < l', e] index keys of the block being filled
        self.index_tokens: torch.Tensor | None = None  # [B, t, e] every token's key (nsa.indexer_pool=scores)

    def index_keys(self, k: torch.Tensor, per_token: bool) -> torch.Tensor:
        """Append the index keys k [B, T, e] of the next T positions and return what the indexer scores: per_token
        (nsa.indexer_pool=scores) every token's key so far [B, t, e]; else the block keys of every block up to the
        newest position's, [B, ceil(t / l'), e] (the last block over its tokens so far)."""
        if per_token:
            self.index_tokens = k if self.index_tokens is None else torch.cat((self.index_tokens, k), dim=1)
            return self.index_tokens
        l_sel = self.cfg.l_sel
        if self.index_open is not None:
            k = torch.cat((self.index_open, k), dim=1)  # from the start of the open block
        n_tok = k.shape[1]
        complete = n_tok // l_sel
        if complete:
            new = k[:, : complete * l_sel].unflatten(1, (complete, l_sel)).amax(dim=2)  # [B, complete, e]
            self.index_blocks = new if self.index_blocks is None else torch.cat((self.index_blocks, new), dim=1)
        self.index_open = k[:, complete * l_sel:] if n_tok % l_sel else None
        parts = [t for t in (self.index_blocks, None if self.index_open is None else self.index_open.amax(1, True))
                 if t is not None]
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]

    def window(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v [B, H_kv, T, hd] and return the window keys/values of the T new queries:
        T = 1: the last min(w, t) positions in slot order (all visible, order is irrelevant);
        T > 1: the w-1 positions before the call, in order, then the T new ones."""
        if k.shape[2] == 1:
            self.win_k.append(k)
            self.win_v.append(v)
            return self.win_k.unordered(), self.win_v.unordered()
        prev_k, prev_v = self.win_k.latest(self.cfg.w - 1), self.win_v.latest(self.cfg.w - 1)
        # concatenate before appending: prev_* may be views of the ring that the append overwrites
        win_k, win_v = (k, v) if prev_k is None else (torch.cat((prev_k, k), dim=2), torch.cat((prev_v, v), dim=2))
        self.win_k.append(k)
        self.win_v.append(v)
        return win_k, win_v

    @property
    def n_compressed(self) -> int:
        return self.cmp_k.length

    def reads_per_step(self) -> int:
        """Keys read by one query at the newest position t-1: N_c + |I|*l' + min(w, t).

        |I| = min(n, (t-1)//l' + 1); once t >= n*l' this is the paper's N_c + n*l' + min(w, t).
        A window-only layer (nsa.gates=window) reads min(w, t).
        """
        t, c = self.t, self.cfg
        if t == 0:
            return 0
        if c.window_only:
            return min(c.w, t)
        n_blocks = min(c.n_sel, (t - 1) // c.l_sel + 1)
        return num_compressed(t, c.l, c.d) + n_blocks * c.l_sel + min(c.w, t)

    def dense_reads_per_step(self) -> int:
        """What a dense KV cache reads for the same query: every key so far."""
        return self.t
