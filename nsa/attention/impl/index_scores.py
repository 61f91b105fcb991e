"""The learned block indexer's scores and picks in torch ops (nsa.selector=indexer; the module and its projections:
nsa/attention/indexer.py). The oracle of the one-launch kernel nsa/attention/kernels/indexer_topk.py (same
arguments; picks equal up to the scores' rounding)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from nsa.attention.impl.selection import select_blocks


def weighted_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [B, Tq, H_kv, h, e], w [B, Tq, H_kv, h], keys [B, N, e] (shared by the queries) or [B, Tq, N, e] (each
    query's own) -> sum_h w_h ReLU(q_h . k_n) / sqrt(e): [B, H_kv, Tq, N] (float32, or float64 for float64 inputs)."""
    logits = torch.einsum("btkhe,bne->bkhtn" if keys.dim() == 3 else "btkhe,btne->bkhtn", q, keys)
    acc = torch.promote_types(logits.dtype, torch.float32)
    logits = F.relu(logits.to(acc)) / math.sqrt(q.shape[-1])
    return torch.einsum("bkhtn,btkh->bktn", logits, w.to(acc))


def max_over_blocks(per_token: torch.Tensor, l_sel: int) -> torch.Tensor:
    """per_token [..., S] token scores from position 0 -> [..., ceil(S / l')] each block's best token (a partial
    last block's over its real tokens)."""
    S = per_token.shape[-1]
    n_blocks = -(-S // l_sel)
    per_token = F.pad(per_token, (0, n_blocks * l_sel - S), value=float("-inf"))
    return per_token.unflatten(-1, (n_blocks, l_sel)).amax(dim=-1)


def index_block_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, l_sel: int,
                       per_token: bool) -> torch.Tensor:
    """The indexer's block scores I [B, H_kv, Tq, N_b]: keys [B, N_b, e] one per block, or per_token [B, S, e] one per
    token from position 0 (a block scores its best token)."""
    scores = weighted_scores(q, w, keys)
    return max_over_blocks(scores, l_sel) if per_token else scores


@torch.no_grad()
def indexer_picks(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, q_start: int, l_sel: int, n: int,
                  per_token: bool) -> torch.Tensor:
    """Top-n blocks per query of queries at positions q_start .. by the indexer's scores (block 0, the previous and
    the current block forced; ties -> lower index) -> [B, H_kv, Tq, n] int64, ascending, -1 pads."""
    return select_blocks(index_block_scores(q, w, keys, l_sel, per_token), q_start, l_sel, n)
