"""Selected attention with its RoPE distance capped: a key more than `cap` positions before the query is read as if
it were exactly `cap` positions before it (ReRoPE's clipped relative position, InfLLM's one distance for every
retrieved block). The model option nsa.sel_distance_cap, and a probe of a model trained without it beyond its
training length (nsa.gate_health.distance_capped): the selection may find a far block (the indexer scores without
positions) and the selected branch still read it wrong, at a distance its RoPE never saw in training.

With RoPE a score depends on the query and key positions only through their difference, so a far key at "distance
cap" is the query rotated at position cap against the key rotated at position 0 (un-rotated):

    score(t, s) = q_t(t) . k_s(s)        if t - s <= cap    (as trained)
                = q_t(cap) . k_s(0)      if t - s >  cap

Every query scores every key here, masked to its selected blocks (impl/masked.py selected_keys; memory
O(B * H * Tq * Tk)): short contexts only (the recall task's, T <= a few thousand); autograd differentiates it. A
prefill chunk over a cache is the same with Tq < Tk (queries from q_start); a decode step reads only its gathered
keys (nsa/attention/decode.py, attend_capped). The float64
per-pair oracle: tests/nsa/test_distance_cap.py.
"""
from __future__ import annotations

import math

import torch

from nsa.attention.impl.masked import selected_keys
from nsa.layers import apply_rotary


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
                              l_sel: int, cap: int, frame: torch.Tensor | None = None,
                              q_start: int = 0) -> torch.Tensor:
    """q [B, H_kv, G, Tq, hd] at positions q_start .. q_start + Tq - 1 and k [B, H_kv, Tk, hd] at positions
    0 .. Tk - 1, rotated by the tables rope = (cos, sin) [Tk or B, Tk, hd/2] of positions 0 .. Tk - 1 (plain RoPE:
    unit magnitude; per row with packed documents, q_start 0), v [B, H_kv, Tk, hd], block_idx [B, H_kv, Tq, n],
    at_cap = (cos, sin) [hd/2] of position `cap` (>= 1), frame [3, B, Tq] with packed documents (a forward from 0)
    -> o [B, H_kv, G, Tq, hd]: the selected branch with distances beyond `cap` read as `cap`. A cap beyond every
    distance is the selected branch as trained (to rounding). q_start > 0: a prefill chunk or a decode step over a
    cache of Tk = q_start + Tq keys. Differentiable (torch ops)."""
    Tq, hd = q.shape[-2:]
    Tk = k.shape[2]
    scale = 1.0 / math.sqrt(hd)
    compute = torch.promote_types(q.dtype, torch.float32)
    scores = q.to(compute) @ k.to(compute).transpose(-1, -2)[:, :, None]  # [B, H_kv, G, Tq, Tk]
    q_index = torch.arange(q_start, q_start + Tq, device=q.device)  # [Tq]
    if cap < q_start + Tq - 1:
        # [Tq, Tk]: within a document, distance = index difference
        far = (q_index[:, None] - torch.arange(Tk, device=q.device)) > cap
        rows = None if q_start == 0 and Tq == Tk else q_index
        far_scores = capped_queries(q, rope, at_cap, rows) @ unrotated(k, rope).transpose(-1, -2)[:, :, None]
        scores = torch.where(far, far_scores, scores)
    if frame is None:  # one document from index 0: queries at q_start .., keys from 0
        positions = q_index.expand(q.shape[0], Tq)
        frame = torch.stack((positions, torch.zeros_like(positions), torch.zeros_like(positions)))  # [3, B, Tq]
    allowed = selected_keys(frame, block_idx, Tk, l_sel)[:, :, None]  # [B, H_kv, 1, Tq, Tk]
    probs = torch.softmax((scores * scale).masked_fill(~allowed, float("-inf")), dim=-1)
    return (probs @ v.to(compute)[:, :, None]).to(q.dtype)  # [B, H_kv, G, Tq, hd]
