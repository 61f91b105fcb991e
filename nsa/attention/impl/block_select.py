"""NSA block selection, torch path: compression scores -> Eq. 9 -> group sum (Eq. 10) -> top-n.

Scored in sub-chunks of q_chunk queries, each over only the compressed tokens its last query sees and
the blocks it may select (the O(T^2 / d) part of NSA). The CUDA path is one fused Triton kernel
(nsa/attention/kernels/select_topk.py) with the same result; nsa/attention/ops.py chooses.
"""
from __future__ import annotations

import torch

from nsa.attention.impl.compression import compression_group_probs, num_compressed
from nsa.attention.impl.selection import select_blocks, selection_block_scores


@torch.no_grad()
def select_by_score(
    q: torch.Tensor,  # [B, H_kv, G, Tq, hd] queries (RoPE applied) at positions q_start ..
    ck: torch.Tensor,  # [B, H_kv, N_c, hd] compressed keys (RoPE applied)
    q_start: int,
    l: int,
    d: int,
    l_sel: int,
    n: int,
    q_chunk: int,
) -> torch.Tensor:  # [B, H_kv, Tq, n] int64 block indices, ascending; -1 pads |I_p| < n
    idxs = []
    for a, q_sub in zip(range(0, q.shape[3], q_chunk), q.split(q_chunk, dim=3)):
        last = q_start + a + q_sub.shape[3] - 1
        n_vis = num_compressed(last + 1, l, d)
        n_reach = last // l_sel + 1  # blocks starting at or before the last query
        p_cmp = compression_group_probs(q_sub, ck[:, :, :n_vis], q_start + a, l, d)  # [B, H_kv, C, n_vis]
        scores = selection_block_scores(p_cmp, l, d, l_sel, n_reach)  # [B, H_kv, C, n_reach]
        idxs.append(select_blocks(scores, q_start + a, l_sel, n))  # [B, H_kv, C, n]
    return torch.cat(idxs, dim=2) if len(idxs) > 1 else idxs[0]
