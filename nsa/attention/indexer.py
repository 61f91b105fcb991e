"""A learned block indexer for NSA's selection (nsa.selector=indexer): which blocks a query reads, scored by a small
learned model instead of NSA's pooled compressed-attention probabilities (Eq. 8-10).

Per layer (sizes from NSAConfig: h = indexer_heads, e = indexer_dim):
    index queries   q_I(t) = W_q x_t                        [H_kv, h, e]  (h per GQA group)
    head weights    w(t)   = W_w x_t                        [H_kv, h]
    index keys      k_I(s) = W_k x_s                        [e]           (one, shared by every group and head)
    block key       K_I(j) = max over s in block j of k_I(s), elementwise   (block j: positions j*l' .. (j+1)*l'-1)
    block score     I(t, j) = sum_h w(t, h) * ReLU(q_I(t, h) . K_I(j)) / sqrt(e)     per KV group
The scores feed the same top-n as pooled selection (impl/selection.py: block 0, the current and the previous block
forced), so the picks go to the same selected-attention kernels. Without positional encoding (no RoPE): a block is
scored by what it holds, not by how far back it is, so the scores do not meet positions they never saw in training
(pooled scoring's compressed keys are rotated at their position). One key per block, not per token: a query scores
T / l' blocks (O(T^2 / l') work, a decode step reads one stored key per block), and a key summarises its block by
the elementwise max, so a single strong token still shows.

The indexer learns from the main attention, never from the language-model loss: its input x is detached, and its
training signal is KL(target || softmax(I(t, .))) over the query's candidate blocks (blocks 0 .. current-2 that are
not forced), the target detached. nsa.indexer_target chooses it:
    compressed  the compressed branch's probability mass per block summed over the group's heads (p_slc of Eq. 9-10,
                the distribution pooled selection ranks by; `pooled_block_mass`). That branch attends to every
                compressed token of the past, so the target covers every candidate block, including those the
                selection leaves out (a selected-set target would never rank the tail).
    dense       dense attention of the layer's queries over the selected branch's keys, every visible token, its
                probability mass per block summed over the group's heads (DSA's target; `dense_block_mass`): what the
                selected branch would read if it read everything, token by token, not through a block's mean key.
                Costs a full attention pass over the KL's rows (KL_ROWS queries: [R, T] scores per head).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from nsa.attention.impl.index_scores import (block_max, counted_kl_rows, document_index_scores, index_block_scores,
                                             split_projection)


class BlockIndexer(nn.Module):
    """pool (nsa.indexer_pool): "keys", one key per block (the elementwise max of its tokens' keys), scored once per
    block; or "scores", every token scored and the block's score the max of its tokens' (MSA's pooling: exact where
    one token matches, at T / l' times the score work). One projection (one matmul each way) makes a token's index
    queries, head weights and index key: its output is [q (H_kv * h * e) | w (H_kv * h) | k (e)]."""

    def __init__(self, dim: int, n_kv_heads: int, heads: int, index_dim: int, l_sel: int, pool: str = "keys"):
        super().__init__()
        self.n_kv_heads, self.heads, self.index_dim, self.l_sel, self.pool = n_kv_heads, heads, index_dim, l_sel, pool
        self.projection = nn.Linear(dim, n_kv_heads * heads * (index_dim + 1) + index_dim, bias=False)
        self.register_load_state_dict_pre_hook(_join_projections)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, dim] -> index queries [B, T, H_kv, h, e], head weights [B, T, H_kv, h] and index keys [B, T, e]:
        views of one matmul's output, returned last ([B, T, P]; what nsa::indexer_kl differentiates)."""
        out = self.projection(x)
        return (*split_projection(out, self.n_kv_heads, self.heads, self.index_dim), out)

    def block_keys(self, k: torch.Tensor) -> torch.Tensor:
        """The index keys k [B, T, e] of positions 0 .. T-1 -> what the scores read: pool=keys, K_I [B, ceil(T / l'), e]
        (the last block may be partial); pool=scores, the token keys themselves."""
        return k if self.pool == "scores" else block_max(k, self.l_sel)

    def scores(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """q [B, Tq, H_kv, h, e], w [B, Tq, H_kv, h] (from `project`), keys from `block_keys` (or the decode cache)
        -> I [B, H_kv, Tq, N_b] (float32, or float64 for a float64 model; impl/index_scores.py)."""
        return index_block_scores(q, w, keys, self.l_sel, self.pool == "scores")

    def document_scores(self, x: torch.Tensor, frame: torch.Tensor, n_blocks: int,
                        rows: torch.Tensor | None = None) -> torch.Tensor:
        """Packed documents (frame [3, B, T]; nsa/attention/documents.py): x [B, T, dim] -> I [B, H_kv, R, n_blocks]
        of the queries `rows` [R] (default all T) over each query's own document's blocks 0 .. n_blocks-1
        (impl/index_scores.document_index_scores)."""
        q, w, k, _ = self.project(x)  # [B, T, H_kv, h, e], [B, T, H_kv, h], [B, T, e]
        if rows is not None:  # the scored queries' index queries and weights
            q, w = q[:, rows], w[:, rows]
        return document_index_scores(q, w, k, frame, n_blocks, self.l_sel, self.pool == "scores", rows)


# Before 2026-11-29 the indexer had three projections, in `projection`'s output order: checkpoints holding them load
# (their weights by _join_projections, their optimizer state by train/checkpoint/state_dicts.py), stacked along dim 0
LEGACY_PROJECTIONS = ("q_proj.weight", "w_proj.weight", "k_proj.weight")
PROJECTION = "projection.weight"


def _join_projections(module, state_dict, prefix, *args) -> None:
    """A checkpoint written before the indexer had one projection: its three weights stacked into `projection`."""
    names = [prefix + n for n in LEGACY_PROJECTIONS]
    if all(n in state_dict for n in names):
        state_dict[prefix + PROJECTION] = torch.cat([state_dict.pop(n) for n in names], dim=0)


KL_ROWS = 1024  # queries per layer and step the KL is taken over (evenly spaced; all of them up to this length)


def kl_row_count(T: int) -> int:
    """How many queries the KL is taken over at sequence length T: all of them up to KL_ROWS."""
    return min(T, KL_ROWS)


def shared_counted_rows(documents, frame: torch.Tensor, l_sel: int) -> torch.Tensor:
    """Packed documents: the KL mean's counted rows (impl/index_scores.counted_kl_rows over its rows), computed
    once per batch (Documents.once_per_batch) and shared by every indexer layer. frame [3, B, T]."""
    R = kl_row_count(frame.shape[2])
    return documents.once_per_batch(("indexer_kl_rows", R, l_sel), lambda: counted_kl_rows(frame, R, l_sel))
