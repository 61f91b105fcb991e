"""The default batch of `python -m train.evaluate`: windows per forward, from the model and the free memory.

    batch = min(windows of the stream, TARGET_TOKENS[device] // seq_len, the most that fit in
                MEMORY_SHARE[device] of the memory free now)

TARGET_TOKENS is where throughput stops growing with the batch (a few thousand tokens keep a CPU's
matrix kernels busy; a GPU wants tens of thousands); more only costs memory and makes progress lines
rarer. A scoring forward (no gradients) holds one block's activations at a time, the residual stream
and the loss path's logits: one chunk of model.loss_chunk rows (all rows with loss_chunk=0). The
per-token activation bytes are train/planning/memory.py's; attention scores are counted as if materialised
(T x T per head), which overstates fused kernels and so errs small. The result does not depend on the
batch: every window is scored once whatever the batch (train/evaluation/scoring.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from train.planning.memory import activation_bytes_per_token

TARGET_TOKENS = {"cpu": 8192, "cuda": 65536}  # tokens per forward where throughput levels off
MEMORY_SHARE = {"cpu": 0.25, "cuda": 0.5}  # of the memory free now (another process may want the rest)
MEMINFO = Path("/proc/meminfo")


@dataclass(frozen=True)
class BatchChoice:
    size: int  # windows per forward
    why: str  # one phrase: what limited it


def forward_bytes(model_cfg, windows: int, seq_len: int, act_bytes: int) -> float:
    """Peak bytes of one scoring forward over `windows` windows of seq_len tokens, weights excluded.
    act_bytes: 2 under bf16 autocast, 4 in fp32."""
    tokens = windows * seq_len
    block = activation_bytes_per_token(SimpleNamespace(model=model_cfg), act_bytes)  # reads only .model
    scores = 4 * model_cfg.n_heads * seq_len  # one row of T x T attention scores per head, fp32
    residual = 2 * 4 * model_cfg.dim  # the block's input and output
    ids = 4 * 8  # int64 inputs and targets, on the host and on the device
    chunk = model_cfg.loss_chunk
    logit_rows = min(tokens, chunk) if chunk else tokens
    logits = logit_rows * model_cfg.vocab_size * (4 + act_bytes + (0 if chunk else 4))  # fp32, matmul out, lse
    return tokens * (block + scores + residual + ids) + logits


def free_memory(device: torch.device) -> int | None:
    """Bytes free now: the GPU's (torch.cuda.mem_get_info), else the host's MemAvailable; None if unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def choose_batch_size(model_cfg, *, seq_len: int, n_windows: int, device: torch.device, act_bytes: int,
                      free_bytes: int | None) -> BatchChoice:
    """The default batch (see the module doc); free_bytes None: only the device target limits it."""
    kind = "cuda" if device.type == "cuda" else "cpu"
    target = max(1, TARGET_TOKENS[kind] // seq_len)
    size, why = min(target, max(1, n_windows)), f"{TARGET_TOKENS[kind]:,} tokens per forward on {kind}"
    if n_windows < target:
        why = f"all {n_windows:,} windows in one forward"
    if free_bytes is not None:
        budget = MEMORY_SHARE[kind] * free_bytes
        if forward_bytes(model_cfg, size, seq_len, act_bytes) > budget:
            while size > 1 and forward_bytes(model_cfg, size, seq_len, act_bytes) > budget:
                size = max(1, size * 3 // 4)
            why = f"{MEMORY_SHARE[kind]:.0%} of {free_bytes / 2**30:.1f} GiB free"
    return BatchChoice(size, why)


def batch_size_for(requested: int | None, model_cfg, *, seq_len: int, n_windows: int, device: torch.device,
                   precision: torch.dtype) -> tuple[int, str]:
    """(windows per forward, where the number comes from): --batch_size when given, else choose_batch_size."""
    if requested is not None:
        return requested, "--batch_size"
    choice = choose_batch_size(model_cfg, seq_len=seq_len, n_windows=n_windows, device=device,
                               act_bytes=torch.finfo(precision).bits // 8, free_bytes=free_memory(device))
    return choice.size, f"auto: {choice.why}"
