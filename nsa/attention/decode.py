"""NSA for a single query (one decode step, or a one-token call): the three branches without masks
(`decode_branches`), or the window branch alone (`decode_window`, nsa.gates=window).

A query at position p sees every cached compressed token, every cached window key and whole selected
blocks except the keys after p in its own block, so the step is a few small matmuls instead of the
chunked, masked training path. The compression branch's probabilities are computed once and serve both
its own output and the block scores (paper §3.3.1: selection reuses the compression attention scores).
Same semantics as the vectorised path; tests check decode against a full prefill.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from nsa.attention.impl.capped import unrotated
from nsa.attention.impl.selection import select_blocks, selection_block_scores
from nsa.config import NSAConfig
from nsa.layers import apply_rotary

# a RoPE table source: positions [...] -> (cos, sin) [..., hd/2] (nsa.layers.RotaryEmbedding)
RopeTables = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """q [B, H_kv, G, hd] pre-scaled by 1/sqrt(hd); k, v [B, H_kv, N, hd] (N >= 1), all visible
    -> out [B, H_kv, G, hd], probabilities [B, H_kv, G, N] (float32 or wider)."""
    s = torch.matmul(q, k.transpose(-1, -2))  # [B, H_kv, G, N]
    p = torch.softmax(s, dim=-1, dtype=torch.promote_types(s.dtype, torch.float32))
    return torch.matmul(p.to(v.dtype), v), p


@torch.no_grad()
def _select_one(p_group: torch.Tensor, p: int, c: NSAConfig) -> torch.Tensor:
    """p_group [B, H_kv, N_c] (summed over the group) -> blocks [B, H_kv, n] ascending, -1 padded.

    Every block up to the current one competes (p is a Python int); forced blocks rank first and a
    stable descending sort sends ties to the lower index.
    """
    current = p // c.l_sel
    scores = selection_block_scores(p_group, c.l, c.d, c.l_sel, current + 1)  # [B, H_kv, current+1]
    scores[..., 0] = float("inf")  # forced: block 0, the previous and the current block
    scores[..., max(current - 1, 0) :] = float("inf")
    k = min(c.n_sel, current + 1)
    top = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    top = torch.sort(top, dim=-1).values
    return top if k == c.n_sel else F.pad(top, (0, c.n_sel - k), value=-1)


def decode_branches(
    q: torch.Tensor,  # [B, H, 1, hd] the query at position p (RoPE applied)
    ck: torch.Tensor,  # [B, H_kv, N_c, hd] compressed keys visible to p (all of them)
    cv: torch.Tensor,  # [B, H_kv, N_c, hd]
    sel_k: torch.Tensor,  # [B, H_kv, >= p+1, hd] selection keys at positions 0 .. (zero padded after p)
    sel_v: torch.Tensor,
    win_k: torch.Tensor,  # [B, H_kv, min(w, p+1), hd] the window keys ending at p
    win_v: torch.Tensor,
    p: int,
    c: NSAConfig,
    index_scores: torch.Tensor | None = None,  # [B, H_kv, 1, p // l' + 1] a learned indexer's (nsa.selector=indexer)
    capped: tuple[int, tuple[torch.Tensor, torch.Tensor], RopeTables] | None = None,
    picks: torch.Tensor | None = None,  # [B, H_kv, 1, n] an earlier indexer layer's blocks (nsa.indexer_every > 1)
):
    """-> o_cmp, o_sel, o_win [B, H, 1, hd] and the selected blocks [B, H_kv, 1, n]. The blocks are picked by the
    compressed branch's probabilities (pooled), or by index_scores when given, with the same forced blocks.
    capped = (cap, (cos, sin) [hd/2] of position cap, the RoPE's tables by position) for nsa.sel_distance_cap: the
    gathered keys more than cap positions back are read at distance cap (impl/capped.py). picks: the blocks to
    select, given (neither scored nor sorted again)."""
    B, H, _, hd = q.shape
    H_kv = ck.shape[1]
    qg = q.view(B, H_kv, H // H_kv, hd) * (1.0 / math.sqrt(hd))  # [B, H_kv, G, hd], scale folded in

    if ck.shape[2] == 0:  # p < l - 1: no compressed token yet -> zero output, nothing to score
        o_cmp, p_group = torch.zeros_like(qg), qg.new_zeros(B, H_kv, 0)
    else:
        o_cmp, probs = _attend(qg, ck, cv)
        p_group = probs.sum(dim=2)  # Eq. 10: one importance per KV group
    if picks is not None:
        block_idx = picks[:, :, 0]  # [B, H_kv, n] ascending, -1 padded, as a step picks them
    elif index_scores is None:
        block_idx = _select_one(p_group, p, c)  # [B, H_kv, n] ascending, -1 padded
    else:
        block_idx = select_blocks(index_scores, p, c.l_sel, c.n_sel)[:, :, 0]  # as a prefill picks

    # selected blocks: the k real picks are ascending and end with the current block, so the keys a
    # query may not see (after p) are exactly the tail of the gathered keys: slice, no mask
    l_sel = c.l_sel
    k_real = min(c.n_sel, p // l_sel + 1)
    need = (p // l_sel + 1) * l_sel
    if sel_k.shape[2] < need:
        sel_k, sel_v = (F.pad(t, (0, 0, 0, need - t.shape[2])) for t in (sel_k, sel_v))
    n_cap = sel_k.shape[2] // l_sel
    rows = (block_idx[..., :k_real] + torch.arange(0, B * H_kv * n_cap, n_cap, device=q.device).view(B, H_kv, 1)).flatten()
    n_keys = (k_real - 1) * l_sel + p % l_sel + 1
    kg, vg = (
        t[:, :, : n_cap * l_sel].reshape(-1, l_sel, hd).index_select(0, rows).view(B, H_kv, k_real * l_sel, hd)[:, :, :n_keys]
        for t in (sel_k, sel_v)
    )
    if capped is None:
        o_sel, _ = _attend(qg, kg, vg)
    else:
        positions = ((block_idx[..., :k_real, None] * l_sel + torch.arange(l_sel, device=q.device))
                     .flatten(-2)[..., :n_keys])  # [B, H_kv, n_keys]: the gathered keys' positions
        o_sel = attend_capped(qg, kg, vg, positions, p, capped)

    o_win = decode_window(q, win_k, win_v)  # [B, H, 1, hd]
    shape = (B, H, 1, hd)
    return o_cmp.view(shape), o_sel.view(shape), o_win, block_idx.unsqueeze(2)


def attend_capped(qg: torch.Tensor, kg: torch.Tensor, vg: torch.Tensor, positions: torch.Tensor,
                  p: int | torch.Tensor, capped: tuple[int, tuple[torch.Tensor, torch.Tensor], RopeTables],
                  visible: torch.Tensor | None = None) -> torch.Tensor:
    """`_attend` with the distance cap: qg [B, H_kv, G, hd] (pre-scaled) at position p (an int, or a 0-dim device
    tensor: static caches), kg, vg [B, H_kv, N, hd] at `positions` [B, H_kv, N]; a key more than cap back scores as the
    query rotated at cap against the key un-rotated; visible [B, H_kv, N] (None: every key) -> out [B, H_kv, G, hd]
    (computed in float32 or wider)."""
    cap, at_cap, tables = capped
    compute = torch.promote_types(qg.dtype, torch.float32)
    qc, kc = qg.to(compute), kg.to(compute)
    s = torch.matmul(qc, kc.transpose(-1, -2))  # [B, H_kv, G, N]
    if isinstance(p, torch.Tensor) or p > cap:  # an int p <= cap: no key is that far (block 0 is the farthest)
        far = (p - positions) > cap  # [B, H_kv, N]
        at = p.view(1) if isinstance(p, torch.Tensor) else torch.full((1,), p, device=qg.device)
        q_raw = unrotated(qc, tables(at))  # [B, H_kv, G, hd]: at position 0
        q_cap = apply_rotary(q_raw, at_cap[0][None], at_cap[1][None])
        s_far = torch.matmul(q_cap, unrotated(kc, tables(positions)).transpose(-1, -2))  # [B, H_kv, G, N]
        s = torch.where(far[:, :, None], s_far, s)
    if visible is not None:
        s = s.masked_fill(~visible[:, :, None], float("-inf"))
    probs = torch.softmax(s, dim=-1)
    return torch.matmul(probs, vg.to(compute)).to(qg.dtype)


def decode_window(
    q: torch.Tensor,  # [B, H, 1, hd] the query at position p (RoPE applied)
    win_k: torch.Tensor,  # [B, H_kv, min(w, p+1), hd] the window keys ending at p, any order
    win_v: torch.Tensor,
) -> torch.Tensor:
    """The sliding-window branch of one query -> [B, H, 1, hd]: the cache holds exactly the window, no mask."""
    B, H, _, hd = q.shape
    H_kv = win_k.shape[1]
    qg = q.view(B, H_kv, H // H_kv, hd) * (1.0 / math.sqrt(hd))  # [B, H_kv, G, hd], scale folded in
    o_win, _ = _attend(qg, win_k, win_v)  # [B, H_kv, G, hd]
    return o_win.view(B, H, 1, hd)
