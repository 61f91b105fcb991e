"""NSA compression branch, torch path: compressed tokens, attention over them, selection importance.

Compressed token i summarises raw positions [i*d, i*d + l). A query at position p may see token i
iff i*d + l - 1 <= p (the whole block is in its past). Queries that see no token get a zero output.
Compressed keys are rotated (RoPE) at position i*d + l - 1, the last position they cover; phi itself
sees un-rotated keys plus its own learned intra-block position encoding (docs/NSA.md, "RoPE").
`compress` applies phi, the BlockCompressor module of nsa/attention/compressor.py (a higher layer: named
in the annotation only, never imported here). The op nsa::compressed_attention (nsa/attention/ops.py)
runs `compressed_attention_fwd` / `_bwd`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from nsa.attention.impl.partial import attention_partial, attention_partial_backward


def num_compressed(t: int, l: int, d: int) -> int:
    """Compressed tokens whose block lies inside positions [0, t): i*d + l <= t."""
    return 0 if t < l else (t - l) // d + 1


def visible_compressed(p: int, l: int, d: int) -> int:
    """How many compressed tokens a query at position p sees (tokens 0 .. count-1)."""
    return num_compressed(p + 1, l, d)


def phi(
    blocks: torch.Tensor,  # [..., l, hd] raw keys (or values) of each block, un-rotated
    pos_enc: torch.Tensor,  # [l, hd] E, the learned intra-block position encoding
    w1: torch.Tensor,  # [hd, l*hd]
    b1: torch.Tensor | None,  # [hd]
    w2: torch.Tensor,  # [hd, hd]
    b2: torch.Tensor | None,  # [hd]
) -> torch.Tensor:  # [..., hd]
    """NSA's block compressor (paper §3.3.1): phi(X) = mean_j X_j + W2 gelu(W1 flatten(X + E) + b1) + b2, the
    BlockCompressor module's forward (nsa/attention/compressor.py holds the parameters; the Triton form is
    kernels/compress_blocks.py)."""
    h = (blocks + pos_enc.to(blocks.dtype)).flatten(-2)  # [..., l*hd]
    return blocks.mean(dim=-2) + F.linear(F.gelu(F.linear(h, w1, b1)), w2, b2)


def strided_blocks(raw: torch.Tensor, lo: int, count: int, l: int, d: int) -> torch.Tensor:
    """raw [B, H_kv, R, hd] -> [B, H_kv, count, l, hd], block i = raw rows lo + i*d .. + l - 1 (a strided view)."""
    span = raw[:, :, lo : lo + (count - 1) * d + l]  # [B, H_kv, (count-1)*d + l, hd]
    return span.unfold(2, l, d).transpose(-1, -2)


def gather_blocks(raw: torch.Tensor, block_rows: torch.Tensor, l: int) -> torch.Tensor:
    """raw [B, H_kv, T, hd], block_rows [B, 1, C*l, 1] (documents.CompressedLayout) -> [B, H_kv, C, l, hd]: each
    slot's block of raw rows (one gather)."""
    B, H, _, hd = raw.shape
    return raw.gather(2, block_rows.expand(B, H, block_rows.shape[2], hd)).view(B, H, -1, l, hd)


def compress(
    compressor: torch.nn.Module,  # a BlockCompressor (nsa/attention/compressor.py)
    raw: torch.Tensor,  # [B, H_kv, R, hd] raw keys or values at positions raw_start .. raw_start+R-1
    raw_start: int,
    first: int,  # first compressed token to emit
    count: int,  # how many tokens to emit (first .. first+count-1)
    l: int,
    d: int,
) -> torch.Tensor:  # [B, H_kv, count, hd]
    B, H, _, hd = raw.shape
    if count <= 0:
        return raw.new_zeros(B, H, 0, hd)
    return compressor(strided_blocks(raw, first * d - raw_start, count, l, d))  # blocks [B, H_kv, count, l, hd]


def compressed_visibility(q_start: int, t_q: int, n_c: int, l: int, d: int, device) -> torch.Tensor:
    """[t_q, n_c] bool: query q_start+t may see compressed token i (i*d + l - 1 <= position)."""
    q_pos = torch.arange(q_start, q_start + t_q, device=device)[:, None]
    end_pos = torch.arange(n_c, device=device)[None, :] * d + (l - 1)
    return end_pos <= q_pos


def _chunk_mask(q_start: int, C: int, n_vis: int, l: int, d: int, dtype, device):
    """Additive mask [1, 1, C, n_vis] (0 = visible, -inf = not) and sees_any [C, 1] in `dtype`.
    Rows that see no token attend to token 0 instead (no NaN); their output and gradient are zeroed."""
    visible = compressed_visibility(q_start, C, n_vis, l, d, device)  # [C, n_vis]
    sees_any = visible[:, :1].to(dtype)  # token 0 is the first one any query sees
    visible[:, 0] = True
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
    return mask[None, None], sees_any


def compressed_attention_fwd(q, ck, cv, q_start: int, l: int, d: int, chunk: int):
    """The torch path. q [B, H, Tq, hd] at positions q_start ..; ck, cv [B, H_kv, N_c, hd]
    -> o [B, H, Tq, hd] (rows that see no compressed token are exactly zero), lse [B, H, Tq] (fp32 or wider;
    the backward pass's state: for rows that see nothing it is that of token 0).
    Queries run in chunks; each reads only the tokens its chunk's last query sees."""
    B, H, Tq, hd = q.shape
    scale = 1.0 / math.sqrt(hd)
    o = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.zeros(B, H, Tq, dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
    for a in range(0, Tq, chunk):
        C = min(chunk, Tq - a)
        n_vis = visible_compressed(q_start + a + C - 1, l, d)  # seen by the chunk's last query
        if n_vis == 0:
            continue
        mask, sees_any = _chunk_mask(q_start + a, C, n_vis, l, d, q.dtype, q.device)
        out, lse_c = attention_partial(q[:, :, a : a + C], ck[:, :, :n_vis], cv[:, :, :n_vis], mask, scale,
                                       site="nsa.compressed")
        o[:, :, a : a + C] = out * sees_any
        lse[:, :, a : a + C] = lse_c
    return o, lse


def compressed_attention_bwd(d_o, q, ck, cv, o, lse, q_start: int, l: int, d: int, chunk: int):
    """Gradients of compressed_attention_fwd: dq [B, H, Tq, hd], dck, dcv [B, H_kv, N_c, hd]."""
    Tq, hd = q.shape[2], q.shape[3]
    scale = 1.0 / math.sqrt(hd)
    dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    dck = torch.zeros(ck.shape, dtype=ck.dtype, device=ck.device)
    dcv = torch.zeros(cv.shape, dtype=cv.dtype, device=cv.device)
    for a in range(0, Tq, chunk):
        C = min(chunk, Tq - a)
        n_vis = visible_compressed(q_start + a + C - 1, l, d)
        if n_vis == 0:
            continue
        mask, sees_any = _chunk_mask(q_start + a, C, n_vis, l, d, q.dtype, q.device)
        rows = slice(a, a + C)
        dq_c, dk_c, dv_c = attention_partial_backward(
            (d_o[:, :, rows] * sees_any).contiguous(), q[:, :, rows], ck[:, :, :n_vis], cv[:, :, :n_vis],
            o[:, :, rows], lse[:, :, rows], mask, scale,
        )
        dq[:, :, rows] = dq_c
        dck[:, :, :n_vis] += dk_c
        dcv[:, :, :n_vis] += dv_c
    return dq, dck, dcv


@torch.no_grad()
def compression_group_probs(
    q: torch.Tensor,  # [B, H_kv, G, Tq, hd] queries (RoPE applied), positions q_start ..
    ck: torch.Tensor,  # [B, H_kv, N_c, hd]
    q_start: int,
    l: int,
    d: int,
) -> torch.Tensor:  # [B, H_kv, Tq, N_c]: softmax probabilities summed over the G heads of a group
    n_c = ck.shape[2]
    if n_c == 0:
        return q.new_zeros(*q.shape[:2], q.shape[3], 0)
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = torch.einsum("bkgtd,bknd->bkgtn", q, ck) * scale  # [B, H_kv, G, Tq, N_c]
    mask = compressed_visibility(q_start, q.shape[3], n_c, l, d, q.device)  # [Tq, N_c]
    scores = scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores
    probs = torch.softmax(scores.masked_fill_(~mask, float("-inf")), dim=-1)
    blind = min(q.shape[3], max(0, l - 1 - q_start))  # leading queries that see no token (NaN rows)
    probs[..., :blind, :] = 0.0
    return probs.sum(dim=2)  # Eq. 10: shared by the group
