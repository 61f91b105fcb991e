"""Gate-health statistics for NSA layers, kept on device (no host sync) for the trainer to log.

Pure tensor functions: a layer computes them from its gates and selected blocks on every forward while
recording is on; nsa/gate_health.py switches recording on and aggregates over a model's layers.

Definitions (docs/NSA.md, "Gate health"):
  gate_entropy_mean/min  binary entropy (nats) of each sigmoid gate g: -g ln g - (1-g) ln(1-g), in
                         [0, ln 2]; mean and min over (token, head, branch)
  gate_max_mean          mean over (token, head) of the largest of the three gates
  gate_collapse_frac     fraction of (token, head) where one gate > 0.99 and both others < 0.01
  gate_saturated_frac    fraction of gates < 0.01 or > 0.99
  gate_share_{cmp,sel,win}  mean over (token, head) of g_c / (g_cmp + g_sel + g_win)
  sel_free_frac          fraction of selected blocks that are not forced (block 0, current, previous)
  sel_distance_mean      mean distance in blocks (current - j) of all selected blocks
  sel_free_distance_mean the same over the non-forced selected blocks only
"""
from __future__ import annotations

import torch

BRANCHES = ("cmp", "sel", "win")
_EPS = 1e-12


def gate_statistics(gates: torch.Tensor) -> dict[str, torch.Tensor]:
    """gates: [B, T, H, 3] sigmoid outputs -> dict of 0-dim tensors (float32, same device)."""
    g = gates.detach().float()
    entropy = -(g * torch.log(g.clamp_min(_EPS)) + (1 - g) * torch.log((1 - g).clamp_min(_EPS)))
    top = g.amax(dim=-1)  # [B, T, H]
    high, low = g > 0.99, g < 0.01
    collapsed = (high.sum(-1) == 1) & (low.sum(-1) == 2)  # [B, T, H]
    return {
        "gate_entropy_mean": entropy.mean(),
        "gate_entropy_min": entropy.amin(),
        "gate_max_mean": top.mean(),
        "gate_collapse_frac": collapsed.float().mean(),
        "gate_saturated_frac": (high | low).float().mean(),
        **gate_shares(g),
    }


def gate_shares(gates: torch.Tensor) -> dict[str, torch.Tensor]:
    """gates: [B, T, H, 3] -> gate_share_{cmp,sel,win}: mean over (token, head) of g_c / (g_cmp + g_sel + g_win).
    All a layer with pinned gates (nsa.gates=window) records of them: entropy, collapse and saturation describe
    gates that learn."""
    g = gates.detach().float()
    share = g / g.sum(dim=-1, keepdim=True).clamp_min(_EPS)  # [B, T, H, 3]
    return {f"gate_share_{name}": share[..., i].mean() for i, name in enumerate(BRANCHES)}


@torch.no_grad()
def selection_counts(block_idx: torch.Tensor, q_start: int, l_sel: int, q_pos: torch.Tensor | None = None) -> torch.Tensor:
    """block_idx [B, H_kv, Tq, n] (-1 = none) -> [4] float32 sums: valid picks, free picks,
    distance over valid picks, distance over free picks (distance = current block - j). q_pos [B, Tq]:
    each query's position in its document (packed documents; blocks are then document-relative)."""
    if q_pos is None:
        q_pos = torch.arange(q_start, q_start + block_idx.shape[2], device=block_idx.device)
    current = (q_pos // l_sel)[..., None, :, None] if q_pos.dim() == 2 else (q_pos // l_sel)[:, None]  # [B, 1, Tq, 1] or [Tq, 1]
    valid = block_idx >= 0
    forced = (block_idx == 0) | (block_idx == current) | (block_idx == current - 1)
    free = valid & ~forced
    distance = current - block_idx
    sums = (valid.sum(), free.sum(), (distance * valid).sum(), (distance * free).sum())
    return torch.stack(sums).float()


def selection_statistics(counts: torch.Tensor) -> dict[str, torch.Tensor]:
    valid, free, distance, free_distance = counts.unbind()
    return {
        "sel_free_frac": free / valid.clamp_min(1),
        "sel_distance_mean": distance / valid.clamp_min(1),
        "sel_free_distance_mean": free_distance / free.clamp_min(1),
    }
