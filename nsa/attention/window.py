"""NSA sliding-window branch: query p attends to the w keys p-w+1 .. p (fewer near the start)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nsa.profiling import audit


def sliding_window_attention(
    q: torch.Tensor,  # [B, H, Tq, hd] queries at positions q_start ..
    k: torch.Tensor,  # [B, H_kv, Tk, hd] keys at positions k_start .. k_start+Tk-1
    v: torch.Tensor,  # [B, H_kv, Tk, hd]
    q_start: int,
    k_start: int,
    w: int,
    chunk: int,
) -> torch.Tensor:  # [B, H, Tq, hd]
    """Banded attention in one batched call: query block i (C = chunk queries) reads only the C + w - 1
    keys [first - w + 1, last] of its band, cut from k with `unfold` (so memory is O(T * (C + w)))."""
    B, H, Tq, hd = q.shape
    H_kv, Tk = k.shape[1], k.shape[2]
    C = min(chunk, Tq)
    n_blk = -(-Tq // C)
    span = C + w - 1  # keys per query block
    # key index (into k) of the first key of block 0, and padding so every band lies inside k
    first = q_start - w + 1 - k_start
    left = max(0, -first)
    right = max(0, first + (n_blk - 1) * C + span - Tk)
    kp = F.pad(k, (0, 0, left, right))  # [B, H_kv, left + Tk + right, hd]
    vp = F.pad(v, (0, 0, left, right))
    lo = first + left
    kb = kp[:, :, lo : lo + (n_blk - 1) * C + span].unfold(2, span, C)  # [B, H_kv, n_blk, hd, span]
    vb = vp[:, :, lo : lo + (n_blk - 1) * C + span].unfold(2, span, C)
    kb = kb.permute(0, 2, 1, 4, 3).reshape(B * n_blk, H_kv, span, hd)
    vb = vb.permute(0, 2, 1, 4, 3).reshape(B * n_blk, H_kv, span, hd)
    qb = F.pad(q, (0, 0, 0, n_blk * C - Tq)).view(B, H, n_blk, C, hd).transpose(1, 2).reshape(B * n_blk, H, C, hd)
    # absolute positions: query (block i, row r) = q_start + i*C + r; key (i, j) = q_start + i*C - w + 1 + j
    dev = q.device
    q_pos = q_start + torch.arange(n_blk, device=dev)[:, None] * C + torch.arange(C, device=dev)  # [n_blk, C]
    k_pos = q_pos[:, :1] - w + 1 + torch.arange(span, device=dev)  # [n_blk, span]
    qp, kp_ = q_pos[:, :, None], k_pos[:, None, :]
    band = (kp_ <= qp) & (kp_ > qp - w) & (kp_ >= k_start) & (kp_ < k_start + Tk)  # [n_blk, C, span]
    band |= (qp >= q_start + Tq)  # padding query rows: see everything (output discarded, no NaN)
    mask = band[:, None].repeat(B, 1, 1, 1)  # [B*n_blk, 1, C, span]
    audit("nsa.window", "sdpa_explicit_band_mask", qb, kb)
    out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, enable_gqa=H != H_kv)  # [B*n_blk, H, C, hd]
    return out.view(B, n_blk, H, C, hd).transpose(1, 2).reshape(B, H, n_blk * C, hd)[:, :, :Tq]
