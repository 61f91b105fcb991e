"""Selected attention with its RoPE distance capped: a key more than `cap` positions before the query is read as if
it were exactly `cap` positions before it (ReRoPE's clipped relative position, InfLLM's one distance for every
retrieved block). A probe of a trained model beyond its training length (nsa.gate_health.distance_capped): the
selection may find a far block (the indexer scores without positions) and the selected branch still read it wrong,
at a distance its RoPE never saw in training.

With RoPE a score depends on the query and key positions only through their difference, so a far key at "distance
cap" is the query rotated at position cap against the key rotated at position 0 (un-rotated):

    score(t, s) = q_t(t) . k_s(s)        if t - s <= cap    (as trained)
                = q_t(cap) . k_s(0)      if t - s >  cap

Every query scores every key here, masked to its selected blocks (memory O(B * H * T^2)): for probes at the recall
task's lengths (T <= a few thousand), not for training; the float64 per-pair oracle: tests/nsa/test_distance_cap.py.
"""
from __future__ import annotations

import math

import torch

from nsa.layers import apply_rotary


def _selected_keys(block_idx: torch.Tensor, l_sel: int, frame: torch.Tensor | None) -> torch.Tensor:
    """block_idx [B, H_kv, T, n] (each query's selected blocks, -1 = none; document-relative with packed documents)
    -> [B, H_kv, T, T] bool: key s is visible to query t (same document, not later) and in a block it selected.
    frame [3, B, T] (q_pos, k_base, c_base: nsa/attention/documents.py) or None (one document from index 0)."""
    B, H_kv, T, _ = block_idx.shape
    index = torch.arange(T, device=block_idx.device)
    if frame is None:
        q_pos, k_base = index.expand(B, T), torch.zeros(B, T, dtype=torch.long, device=block_idx.device)
    else:
        q_pos, k_base = frame[0], frame[1]
    r = index - k_base[..., None]  # [B, T, T]: key s's position in query t's document
    seen = (r >= 0) & (r <= q_pos[..., None])
    n_blocks = -(-T // l_sel)
    picked = torch.zeros(B, H_kv, T, n_blocks + 1, dtype=torch.bool, device=block_idx.device)
    picked.scatter_(-1, torch.where(block_idx < 0, n_blocks, block_idx), True)  # -1 -> the spare column
    picked[..., n_blocks] = False
    key_block = torch.where(seen, r // l_sel, n_blocks)  # [B, T, T]; unseen keys -> the spare (False) column
    return picked.gather(-1, key_block[:, None].expand(B, H_kv, T, T))  # [B, H_kv, T, T]


def unrotated(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [B, H, T, hd] rotated by the tables rope = (cos, sin) [T or B, T, hd/2] (unit magnitude) -> x at position 0
    (the inverse rotation), in float32 or wider."""
    cos, sin = rope
    return apply_rotary(x.to(torch.promote_types(x.dtype, torch.float32)), cos, -sin)


def capped_queries(q: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], at_cap: tuple[torch.Tensor, torch.Tensor],
                   rows: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H_kv, G, R, hd] rotated at the positions of the tables' rows `rows` [R] (None: all T of them) -> the same
    queries rotated at position cap instead (at_cap = (cos, sin) [hd/2]), in float32 or wider: against an
    un-rotated key, a score at distance cap."""
    B, H_kv, G, R, hd = q.shape
    cos, sin = rope if rows is None else (r[..., rows, :] for r in rope)
    raw = unrotated(q.reshape(B, H_kv * G, R, hd), (cos, sin)).view(B, H_kv, G, R, hd)
    return apply_rotary(raw, at_cap[0][None], at_cap[1][None])


def capped_selected_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_idx: torch.Tensor,
                              rope: tuple[torch.Tensor, torch.Tensor], at_cap: tuple[torch.Tensor, torch.Tensor],
                              l_sel: int, cap: int, frame: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H_kv, G, T, hd] and k [B, H_kv, T, hd] rotated by the tables rope = (cos, sin) [T or B, T, hd/2]
    (plain RoPE: unit magnitude; per row with packed documents), v [B, H_kv, T, hd], block_idx [B, H_kv, T, n],
    at_cap = (cos, sin) [hd/2] of position `cap` (>= 1), frame [3, B, T] with packed documents
    -> o [B, H_kv, G, T, hd]: the selected branch with distances beyond `cap` read as `cap`. A cap beyond every
    distance is the selected branch as trained (to rounding). Differentiable (torch ops)."""
    T, hd = q.shape[-2:]
    scale = 1.0 / math.sqrt(hd)
    compute = torch.promote_types(q.dtype, torch.float32)
    scores = q.to(compute) @ k.to(compute).transpose(-1, -2)[:, :, None]  # [B, H_kv, G, T, T]
    if cap < T - 1:
        index = torch.arange(T, device=q.device)
        far = (index[:, None] - index) > cap  # [T, T]: within a document, distance = index difference
        far_scores = capped_queries(q, rope, at_cap) @ unrotated(k, rope).transpose(-1, -2)[:, :, None]
        scores = torch.where(far, far_scores, scores)
    allowed = _selected_keys(block_idx, l_sel, frame)[:, :, None]  # [B, H_kv, 1, T, T]
    probs = torch.softmax((scores * scale).masked_fill(~allowed, float("-inf")), dim=-1)
    return (probs @ v.to(compute)[:, :, None]).to(q.dtype)  # [B, H_kv, G, T, hd]
