"""Selection health of an NSA layer: how much of the selection branch's full attention its chosen blocks hold,
how many of them lie outside the sliding window, and the raw gate of each branch. Pure tensor functions, no
host sync; the layer (nsa/attention/nsa.py) records them while statistics are on, nsa/gate_health.py collects
them per layer.

Definitions (docs/NSA.md, "Gate health"). A query at position p of its document reads the selection keys of
its own document at positions 0 .. p; selection block j covers the document positions [j*l', (j+1)*l'); the
sliding window covers p-w+1 .. p.
  sel_recall             oracle recall of the selection. a = softmax over the query's visible keys (positions
                         0 .. p of its document) of q.k_sel / sqrt(hd), with the forward's queries q and
                         selection keys k_sel; recall = the sum of a over the visible keys of the blocks the
                         query's KV group chose. Mean over query heads (the G heads of a group share its
                         blocks) and queries. 1 when the chosen blocks cover every visible key.
  sel_outside_window     share of the chosen blocks (block_idx >= 0) that lie wholly outside the window:
                         block j of a query at p is outside iff (j+1)*l' <= p - w + 1, i.e. its last position
                         (j+1)*l' - 1 comes before the window's first key p - w + 1 (none of its keys is in
                         the window).
  gate_mean_{cmp,sel,win}  mean over (token, head) of each branch's raw sigmoid gate g_c (gate_share_* is
                         the normalised g_c / (g_cmp + g_sel + g_win)).

Recall needs the full attention of every query, so it is not computed in the forward: with statistics on,
the forward keeps a small detached copy (`recall_sample`: row 0 of the batch, at most RECALL_QUERIES of its
queries, every s-th) and `selection_recall` computes it later, off the training clock, chunked over queries.
"""
from __future__ import annotations

import math

import torch

from nsa.attention.gate_stats import BRANCHES

RECALL_QUERIES = 1024  # most queries of row 0 a recall sample keeps (every s-th, s = ceil(T / RECALL_QUERIES))
RECALL_SCORES = 1 << 24  # most attention scores (float32) one chunk of selection_recall holds: 64 MiB


def gate_means(gates: torch.Tensor) -> dict[str, torch.Tensor]:
    """gates: [B, T, H, 3] sigmoid outputs -> gate_mean_{cmp,sel,win}: 0-dim float32 tensors (same device)."""
    means = gates.detach().float().mean(dim=(0, 1, 2))  # [3]
    return {f"gate_mean_{name}": means[i] for i, name in enumerate(BRANCHES)}


@torch.no_grad()
def outside_window_counts(block_idx: torch.Tensor, q_pos: torch.Tensor, l_sel: int, w: int) -> torch.Tensor:
    """block_idx [B, H_kv, Tq, n] (-1 = none); q_pos [Tq] or [B, Tq]: each query's position in its document
    -> [2] float32 sums: chosen blocks wholly outside the window, chosen blocks (valid picks)."""
    p = q_pos[:, None, :, None] if q_pos.dim() == 2 else q_pos[:, None]  # [B, 1, Tq, 1] or [Tq, 1]
    valid = block_idx >= 0
    outside = valid & ((block_idx + 1) * l_sel <= p - w + 1)
    return torch.stack((outside.sum(), valid.sum())).float()


def outside_window_share(counts: torch.Tensor) -> dict[str, torch.Tensor]:
    """outside_window_counts' [2] sums (possibly summed over calls) -> {"sel_outside_window": 0-dim}."""
    outside, valid = counts.unbind()
    return {"sel_outside_window": outside / valid.clamp_min(1)}


@torch.no_grad()
def recall_sample(q: torch.Tensor, sel_k: torch.Tensor, block_idx: torch.Tensor, q_pos: torch.Tensor,
                  k_base: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The detached copy selection_recall reads, from row 0 of a forward (no host sync):
    q [B, H, Tq, hd] (the forward's rotated, normalised queries), sel_k [B, H_kv, Tk, hd] (selection keys),
    block_idx [B, H_kv, Tq, n] (-1 = none), q_pos [Tq] or [B, Tq] (position of each query in its document),
    k_base None or [B, Tq] (index in sel_k of each query's document's first key; None: 0).
    Keeps every s-th query, s = ceil(Tq / RECALL_QUERIES), and all keys:
    {q [H, Tq', hd], k [H_kv, Tk, hd], block_idx [H_kv, Tq', n], q_pos [Tq'], k_base [Tq']}."""
    Tq = q.shape[2]
    s = max(1, -(-Tq // RECALL_QUERIES))
    q_pos = q_pos[0] if q_pos.dim() == 2 else q_pos  # [Tq]
    k_base = torch.zeros_like(q_pos) if k_base is None else k_base[0]  # [Tq]
    return {"q": q[0, :, ::s].detach().clone(), "k": sel_k[0].detach().clone(),
            "block_idx": block_idx[0, :, ::s].clone(), "q_pos": q_pos[::s].clone(), "k_base": k_base[::s].clone()}


@torch.no_grad()
def selection_recall(sample: dict[str, torch.Tensor], l_sel: int, max_scores: int = RECALL_SCORES) -> torch.Tensor:
    """sel_recall of one recall_sample -> 0-dim float32 tensor on the sample's device (no host sync).
    block j of a query holds its document's keys at positions [j*l', (j+1)*l').

    Scores in float32 (float64 for a float64 sample), chunk by chunk of C queries (C * H * Tk <= max_scores):
    memory stays bounded at any T.
    """
    dtype = torch.promote_types(sample["q"].dtype, torch.float32)
    q, k, block_idx = sample["q"].to(dtype), sample["k"].to(dtype), sample["block_idx"]
    q_pos, k_base = sample["q_pos"], sample["k_base"]
    H, Tq, hd = q.shape
    H_kv, Tk = k.shape[:2]
    G = H // H_kv
    n_blocks = -(-Tk // l_sel)  # document-relative blocks that fit in Tk keys
    qg = q.view(H_kv, G, Tq, hd) * (1.0 / math.sqrt(hd))  # [H_kv, G, Tq, hd]
    kt = k.transpose(1, 2)[:, None]  # [H_kv, 1, hd, Tk]
    keys = torch.arange(Tk, device=q.device)  # [Tk]
    C = max(1, max_scores // (H * Tk))
    total = torch.zeros((), dtype=dtype, device=q.device)
    for c0 in range(0, Tq, C):
        scores = qg[:, :, c0:c0 + C] @ kt  # [H_kv, G, C, Tk]
        rel = keys - k_base[c0:c0 + C, None]  # [C, Tk]: each key's position in the query's document
        visible = (rel >= 0) & (rel <= q_pos[c0:c0 + C, None])  # [C, Tk]
        idx = block_idx[:, c0:c0 + C]  # [H_kv, C, n]
        slot = torch.where((idx >= 0) & (idx < n_blocks), idx, n_blocks)  # -1 (none) -> a spare slot, dropped
        picked = torch.zeros(*idx.shape[:2], n_blocks + 1, dtype=torch.bool, device=q.device)
        picked = picked.scatter_(-1, slot, True)[..., :n_blocks]  # [H_kv, C, n_blocks]
        key_block = (rel.clamp(0, Tk - 1) // l_sel).expand(H_kv, -1, -1)  # [H_kv, C, Tk]
        chosen = visible & picked.gather(-1, key_block)  # [H_kv, C, Tk]
        lse_all = scores.masked_fill(~visible, -math.inf).logsumexp(-1)  # [H_kv, G, C]
        lse_chosen = scores.masked_fill(~chosen[:, None], -math.inf).logsumexp(-1)  # -inf where none chosen
        total += torch.exp(lse_chosen - lse_all).sum()
    return (total / (H * Tq)).float()
