"""NSA sliding-window branch, torch path: query p attends to the w keys p-w+1 .. p (fewer near the start).

Banded attention in one batched call: query block i (C = chunk queries) reads only the C + w - 1 keys
[first - w + 1, last] of its band, cut from k with `unfold` (memory O(T * (C + w))). The backward pass
recomputes scores from the output and log-sum-exp and folds the bands' key gradients back. The op
nsa::window_attention (nsa/attention/ops.py) runs `sliding_window_fwd` / `_bwd`.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from nsa.attention.impl.partial import attention_partial, attention_partial_backward


class _Bands(NamedTuple):
    C: int  # queries per block
    n_blk: int  # query blocks
    span: int  # keys per block: C + w - 1
    left: int  # zero keys padded before k so every band lies inside
    right: int  # ... and after it
    lo: int  # index (into the padded keys) of block 0's first key


def _bands(q_start: int, k_start: int, Tq: int, Tk: int, w: int, chunk: int) -> _Bands:
    C = min(chunk, Tq)
    n_blk = -(-Tq // C)
    span = C + w - 1
    first = q_start - w + 1 - k_start  # key index (into k) of the first key of block 0
    left = max(0, -first)
    right = max(0, first + (n_blk - 1) * C + span - Tk)
    return _Bands(C, n_blk, span, left, right, first + left)


def _band_keys(k: torch.Tensor, b: _Bands) -> torch.Tensor:
    """[B, H_kv, Tk, hd] -> [n_blk, B*H_kv, span, hd]: each query block's keys, an overlapping strided view
    of the zero-padded keys (no copy of the bands: block i starts C keys after block i-1)."""
    B, H_kv, _, hd = k.shape
    kp = F.pad(k, (0, 0, b.left, b.right)).contiguous()  # [B, H_kv, L, hd]
    L = kp.shape[2]
    return kp.as_strided((b.n_blk, B * H_kv, b.span, hd), (b.C * hd, L * hd, hd, 1), kp.storage_offset() + b.lo * hd)


def _blocked(x: torch.Tensor, b: _Bands) -> torch.Tensor:
    """[B, H, Tq, ...] -> [n_blk, B*H, C, ...], zero-padded to whole query blocks. Heads are ordered
    (batch, head), so query head b*H + h reads key head (b*H + h) // G = b*H_kv + h // G (GQA)."""
    B, H, Tq = x.shape[:3]
    pad = [0, 0] * (x.dim() - 3) + [0, b.n_blk * b.C - Tq]
    x = F.pad(x, pad).view(B * H, b.n_blk, b.C, *x.shape[3:]).transpose(0, 1)
    return x.reshape(b.n_blk, B * H, b.C, *x.shape[3:])


def _unblocked(x: torch.Tensor, B: int, Tq: int) -> torch.Tensor:
    """Inverse of _blocked: [n_blk, B*H, C, ...] -> [B, H, Tq, ...]."""
    n_blk, BH, C = x.shape[:3]
    x = x.transpose(0, 1).reshape(B, BH // B, n_blk * C, *x.shape[3:])
    return x[:, :, :Tq]


def _band_mask(q_start: int, k_start: int, Tq: int, Tk: int, w: int, b: _Bands, dtype, device):
    """Additive mask [n_blk, 1, C, span] (every head of a block shares it): key s is visible to query p
    iff p - w < s <= p and s is a key. Padding query rows see every key (their output is discarded)."""
    q_pos = q_start + torch.arange(b.n_blk, device=device)[:, None] * b.C + torch.arange(b.C, device=device)  # [n_blk, C]
    k_pos = q_pos[:, :1] - w + 1 + torch.arange(b.span, device=device)  # [n_blk, span]
    qp, kp = q_pos[:, :, None], k_pos[:, None, :]
    band = (kp <= qp) & (kp > qp - w) & (kp >= k_start) & (kp < k_start + Tk)  # [n_blk, C, span]
    band |= qp >= q_start + Tq
    return torch.zeros(band.shape, dtype=dtype, device=device).masked_fill_(~band, float("-inf"))[:, None]


def sliding_window_fwd(q, k, v, q_start: int, k_start: int, w: int, chunk: int):
    """The torch path. q [B, H, Tq, hd] at positions q_start ..; k, v [B, H_kv, Tk, hd] at positions
    k_start .. -> o [B, H, Tq, hd], lse [B, H, Tq] (fp32 or wider)."""
    B, H, Tq, hd = q.shape
    b = _bands(q_start, k_start, Tq, k.shape[2], w, chunk)
    mask = _band_mask(q_start, k_start, Tq, k.shape[2], w, b, q.dtype, q.device)
    out, lse = attention_partial(_blocked(q, b), _band_keys(k, b), _band_keys(v, b), mask, 1.0 / math.sqrt(hd),
                                 site="nsa.window")  # [n_blk, B*H, C, hd], [n_blk, B*H, C]
    return _unblocked(out, B, Tq), _unblocked(lse, B, Tq)


def sliding_window_bwd(d_o, q, k, v, o, lse, q_start: int, k_start: int, w: int, chunk: int):
    """Gradients of sliding_window_fwd: dq [B, H, Tq, hd], dk, dv [B, H_kv, Tk, hd]."""
    B, H, Tq, hd = q.shape
    H_kv, Tk = k.shape[1], k.shape[2]
    b = _bands(q_start, k_start, Tq, Tk, w, chunk)
    mask = _band_mask(q_start, k_start, Tq, Tk, w, b, q.dtype, q.device)
    dqb, dkb, dvb = attention_partial_backward(
        _blocked(d_o, b), _blocked(q, b), _band_keys(k, b), _band_keys(v, b), _blocked(o, b), _blocked(lse, b),
        mask, 1.0 / math.sqrt(hd),
    )  # dkb, dvb [n_blk, B*H_kv, span, hd]
    # fold the overlapping bands back: band i's key j is padded key lo + i*C + j
    at = (b.lo + torch.arange(b.n_blk, device=q.device)[:, None] * b.C + torch.arange(b.span, device=q.device)).flatten()

    def fold(grad_bands: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        flat = grad_bands.transpose(0, 1).reshape(B * H_kv, b.n_blk * b.span, hd)
        padded = torch.zeros(B * H_kv, b.left + Tk + b.right, hd, dtype=flat.dtype, device=q.device)
        padded.index_add_(1, at, flat)
        return padded.view(B, H_kv, -1, hd)[:, :, b.left : b.left + Tk].to(like.dtype).contiguous()

    return _unblocked(dqb, B, Tq).contiguous(), fold(dkb, k), fold(dvb, v)
