"""Whole-model decoding over static caches, replayed as one CUDA graph per step.

    prompt [B, T] -> the model's chunked prefill into growing caches -> copied into static caches
    (nsa/attention/static_cache.py, sized max_len) -> step(token [B]) -> logits [B, V], position + 1 on the device

A decode step of a small model is launch-bound: M7C's NSA step issues ~40 kernels per layer, each a few µs of
host time for a few µs of GPU work (the second GPU session: NSA's decode step 1.23 ms against dense's 0.45 ms at
32k, while reading 9x fewer keys). A CUDA graph records the step's kernels once and replays them with one launch;
this needs every buffer, shape and branch fixed between steps, which the static caches give: the position lives
in a device tensor that the step itself advances, so a replay needs no host value at all.

`StaticDecoder(model, batch, max_len, graphs=None)`: graphs None means on CUDA. Capture runs the step a few times
first (Triton compiles, cuBLAS picks its kernels) at the current position and puts the position back after each:
a step writes only slots that the step at the same position writes again before reading them, so the warm-up
leaves the caches as it found them. On CPU (and with graphs=False) the same step runs eagerly: the tests compare it
with the growing caches' decode, which equals a full forward.

Every row decodes at the same position (one prompt per call, as nsa/generate.py). `restart()` starts a new document
at position 0 over the same buffers (a packed-documents model's sampled EOS: nothing of the old document is read,
since a step reads only slots at or before its position, each written in the new document first). Refused in one
line (StaticDecodeError, `static_decode_problem`): a model in training mode (dropout), window-only NSA layers, a
distance-cap probe (nsa.gate_health.distance_capped; a model trained with nsa.sel_distance_cap decodes).
"""
from __future__ import annotations

import torch

from nsa.attention.static_cache import StepIndex, static_cache
from nsa.attention.static_cache import static_decode_problem as layer_problem


class StaticDecodeError(ValueError):
    """A model or request the static decoder cannot serve."""


def static_decode_problem(model, max_len: int | None = None) -> str | None:
    """Why `model` cannot decode over static caches up to max_len positions, in one line, or None."""
    if model.training:
        return "the model is in training mode (dropout): call model.eval() before decoding"
    for i, blk in enumerate(model.blocks):
        problem = layer_problem(blk.attn)
        if problem:
            return f"layer {i}: {problem}"
    if max_len is not None and not 1 <= max_len <= model.cfg.max_seq_len:
        return f"max_len={max_len} must be in 1 .. the model's max_seq_len={model.cfg.max_seq_len}"
    return None


def block_step(blk, cache, x: torch.Tensor, rope, at, picks: torch.Tensor | None = None):
    """One Block (nsa.model.Block) over its static cache: x [B, 1, dim] at position at.pos, the last indexer layer's
    picks of this step or None -> ([B, 1, dim], the picks the next blocks reuse or None)."""
    y, picks = cache.step(blk.attn, blk.attn_norm(x), rope, at, picks)
    x = x + y
    return x + blk.mlp(blk.mlp_norm(x)), picks


class StaticDecoder:
    def __init__(self, model, batch: int, max_len: int, graphs: bool | None = None, compile: bool = False,
                 backend: str = "inductor", warmup_steps: int = 2, fused: bool = True) -> None:
        problem = static_decode_problem(model, max_len)
        if problem:
            raise StaticDecodeError(problem)
        self.model, self.batch, self.max_len = model, batch, max_len
        weight = model.lm_head.weight
        self.device = weight.device
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        if self.graphs and self.device.type != "cuda":
            raise StaticDecodeError("CUDA graphs need a CUDA model")
        self.warmup_steps = warmup_steps
        # compile: each block's step through torch.compile (static shapes, no graph break allowed), which fuses its
        # elementwise ops; compiled once and reused by every block (regional compilation: the blocks differ only in
        # their weights and buffers, the graph's inputs). With graphs the compiled steps are what the graph records
        compiled = ((lambda fn: torch.compile(fn, fullgraph=True, dynamic=False, backend=backend)) if compile
                    else (lambda fn: fn))
        self._block_step = compiled(block_step)
        self._enter, self._leave = compiled(self._embed), compiled(self._head)
        # fused: NSA layers with pooled selection run their three branches in one Triton launch (on CUDA)
        self.caches = [static_cache(blk.attn, batch, max_len, weight.dtype, self.device, fused) for blk in model.blocks]
        self.index = StepIndex(max_len, model.cfg.nsa if model.cfg.attention == "nsa" else None, self.device)
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=self.device)  # [B, 1] the step's input
        self.pos = torch.zeros((), dtype=torch.long, device=self.device)  # the step's position, on the device
        self.t = 0  # positions cached, on the host (bounds only; never read from the device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # [B, V] the graph's output buffer

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, chunk: int = 512) -> torch.Tensor:
        """ids [B, T] from position 0 (the model's chunked prefill) -> logits [B, V] of the last position."""
        B, T = ids.shape
        if B != self.batch:
            raise StaticDecodeError(f"prefill of {B} rows into a decoder built for batch {self.batch}")
        if not 1 <= T < self.max_len:
            raise StaticDecodeError(f"a prompt of {T} tokens: must be 1 .. {self.max_len - 1} (max_len={self.max_len})")
        growing = self.model.new_caches()
        for start in range(0, T, chunk):
            logits = self.model(ids[:, start:start + chunk], start_pos=start, caches=growing)
        for static, cache in zip(self.caches, growing):
            static.load(cache)
        self.pos.fill_(T)
        self.t = T
        self.graph = None  # a graph holds the position it was captured at: capture again
        return logits[:, -1]

    def restart(self) -> None:
        """The next step is position 0 of a new document (the buffers are kept: a graph stays valid)."""
        self.pos.fill_(0)
        self.t = 0

    @torch.no_grad()
    def step(self, token: torch.Tensor) -> torch.Tensor:
        """token [B] (or [B, 1]) at the next position -> logits [B, V] of that position (the graph's output buffer
        when graphed: read or copy it before the next step)."""
        if self.t >= self.max_len:
            raise StaticDecodeError(f"the caches are full: max_len={self.max_len} positions")
        self.token.copy_(token.view(self.batch, 1))
        if not self.graphs:
            logits = self._step()
        else:
            if self.graph is None:
                self._capture()
            self.graph.replay()
            logits = self.logits
        self.t += 1
        return logits

    def _step(self) -> torch.Tensor:
        """One token through every layer at self.pos, which it advances -> logits [B, V] (float32). No host work."""
        x, rope, at = self._enter()
        picks = None  # nsa.indexer_every > 1: the last indexer layer's, for the blocks up to the next
        for blk, cache in zip(self.model.blocks, self.caches):
            x, picks = self._block_step(blk, cache, x, rope, at, picks)
        return self._leave(x)

    def _embed(self):
        """-> the step's input x [B, 1, dim], RoPE tables (cos, sin [1, hd/2]) or None, the position's StepIndex."""
        m = self.model
        x = m.tok_emb(self.token)  # [B, 1, dim]
        positions = self.pos.view(1)
        if m.pos_emb is not None:
            x = x + m.pos_emb(positions)
        rope = m.rope(positions) if m.rope is not None else None
        return x, rope, self.index.update(self.pos)  # the slots and masks of this position, for every layer

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, 1, dim] after the last block -> logits [B, V] (float32); the position advances."""
        logits = self.model.lm_head(self.model.norm(x)).float()[:, -1]
        self.pos.add_(1)
        return logits

    def _capture(self) -> None:
        at = self.pos.clone()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup_steps):  # compile and tune at this position; put the position back
                self._step()
                self.pos.copy_(at)
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._step()
        self.pos.copy_(at)  # capture records the step's kernels; it runs none of them
