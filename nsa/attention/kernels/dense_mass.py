"""The learned indexer's dense target (nsa.indexer_target=dense) for the KL's rows as one Triton launch.

For KL row r, the query at sequence index (= position) t_r = r * T // R: dense causal attention of its G query heads
over the selected branch's keys 0 .. t_r, each head's probabilities summed over the group, then per selection block
(l' keys): mass(r, j) = sum_g sum_{s in block j, s <= t_r} softmax_s(q_g(t_r) . k(s) / sqrt(hd)). Same result as
`nsa.attention.impl.index_scores.dense_block_mass` on the gathered rows (plain layout, no distance cap) up to rounding;
no [R, T] scores exist: they live in registers one chunk of keys at a time.

Grid (cdiv(R, BT), B*H_kv): a program owns BT rows of one KV group and its G query heads as one tile of GP*BT rows
(row = g*BT + t; padded heads load q = 0 and are masked out).
    pass 1  over chunks of BN keys up to its last row's position: online max and denominator per row -> lse
    pass 2  over chunks of BJ blocks (BN = BJ*LP key lanes, LP = l' padded to a power of two):
            p = exp(s - lse) where the key is visible (<= t_r, < T, a real lane), summed over the heads and over each
            block's lanes -> [BT, BJ], stored; blocks past the tile's last position get 0 without a dot.
With packed documents (the KL's forward passes its frame: HAS_FRAME) a row attends only its own document's keys, at
its position in the document, its blocks counted from the document's first key; a tile's rows run one document at a
time.
Accumulation fp32 (fp64 for fp64 inputs); dots as select_topk.py's. T and R are runtime arguments.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from nsa.attention.kernels.interpreter import interpreter_active

ROWS = 64  # (head, KL row) tile rows per program: BT = ROWS // GP rows (at most 16)
KEY_LANES = 64  # keys per chunk (BJ * LP)


@triton.jit
def _dense_rows(q, keys, skt, d_ok, row_pos, row_ok, last, T, out, soj, r_ok, n_blocks,
                GP: tl.constexpr, L_SEL: tl.constexpr, LP: tl.constexpr, BT: tl.constexpr, BJ: tl.constexpr,
                SCALE: tl.constexpr, ACC: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr):
    """Both passes for the tile rows row_ok [RR] at positions row_pos [RR] over the keys from `keys` on (T of them),
    the largest position `last`; blocks 0 .. n_blocks-1 stored for the KL rows r_ok [BT]."""
    RR: tl.constexpr = GP * BT
    BN: tl.constexpr = BJ * LP
    lanes = tl.arange(0, BN)
    # ---- pass 1: each row's log-sum-exp over the keys it sees
    m = tl.full([RR], -1.0e30, dtype=ACC)
    den = tl.zeros([RR], dtype=ACC)
    for k0 in range(0, last + 1, BN):
        key = k0 + lanes
        kt = tl.load(keys + key[:, None].to(tl.int64) * skt, mask=(key < T)[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
        s = tl.dot(q, tl.trans(kt), input_precision=PREC, out_dtype=ACC) * SCALE  # [RR, BN]
        s = tl.where(row_ok[:, None] & (key[None, :] <= row_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        den = den * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new[:, None]), axis=1)
        m = m_new
    lse = m + tl.log(tl.where(den > 0, den, 1.0))

    # ---- pass 2: probability mass per block, summed over the group's heads
    cols = tl.arange(0, BJ)
    c_last = last // L_SEL
    for j0 in range(0, n_blocks, BJ):
        blk = j0 + cols
        if j0 <= c_last:
            key = (j0 + lanes // LP) * L_SEL + lanes % LP  # [BN]
            key_ok = (lanes % LP < L_SEL) & (key < T)
            kt = tl.load(keys + key[:, None].to(tl.int64) * skt, mask=key_ok[:, None] & d_ok[None, :], other=0.0)
            if UPCAST:
                kt = kt.to(tl.float32)
            s = tl.dot(q, tl.trans(kt), input_precision=PREC, out_dtype=ACC) * SCALE
            vis = row_ok[:, None] & key_ok[None, :] & (key[None, :] <= row_pos[:, None])
            p = tl.exp(tl.where(vis, s - lse[:, None], float("-inf")))  # [RR, BN]
            p_grp = tl.sum(tl.reshape(p, (GP, BT, BN)), axis=0)  # [BT, BN]
            mass = tl.sum(tl.reshape(p_grp, (BT, BJ, LP)), axis=2)  # [BT, BJ]
        else:  # past every row's position
            mass = tl.zeros([BT, BJ], dtype=ACC)
        tl.store(out + blk[None, :].to(tl.int64) * soj, mass, mask=r_ok[:, None] & (blk < n_blocks)[None, :])


@triton.jit
def dense_mass_tile(
    Q, K, OUT, FRAME,
    sqb, sqh, sqg, sqt, sqd,
    skb, skh, skt, skd,
    sob, soh, sor, soj,
    sf0, sf1, sf2,
    b, h, r0, r_hi, T, R, n_blocks,
    G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, DP: tl.constexpr,
    L_SEL: tl.constexpr, LP: tl.constexpr, BT: tl.constexpr, BJ: tl.constexpr, SCALE: tl.constexpr,
    ACC: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, HAS_FRAME: tl.constexpr,
):
    """KL rows r0 .. min(r0 + BT, r_hi) - 1 of batch row b, KV group h (module docstring). With a frame (packed
    documents: q_pos, k_base per sequence index) each row attends its own document's keys and its blocks count from
    the document's first key; the tile's rows run one document at a time. Also run inside the KL's forward
    (kernels/indexer_kl.py), which computes its rows' target first."""
    RR: tl.constexpr = GP * BT
    offs = tl.arange(0, RR)
    row_g = offs // BT
    row_r = r0 + offs % BT
    row_ok = (row_g < G) & (row_r < r_hi)
    row_t = (row_r.to(tl.int64) * T) // R  # [RR] each row's sequence index
    offs_d = tl.arange(0, DP)
    d_ok = offs_d < HD
    q = tl.load(Q + b * sqb + h * sqh + row_g[:, None] * sqg + row_t[:, None] * sqt + offs_d[None, :] * sqd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    keys = K + b * skb + h * skh + offs_d[None, :] * skd  # [1, DP]
    r_t = r0 + tl.arange(0, BT)
    r_ok = r_t < r_hi
    out = OUT + b * sob + h * soh + r_t.to(tl.int64)[:, None] * sor  # [BT, 1]
    if HAS_FRAME:
        f_rr = FRAME + b * sf1 + row_t * sf2  # [RR]
        pos_rr = tl.load(f_rr, mask=row_ok, other=0)
        kb_rr = tl.load(f_rr + sf0, mask=row_ok, other=0)
        f_t = FRAME + b * sf1 + ((r_t.to(tl.int64) * T) // R) * sf2  # [BT]
        pos_t = tl.load(f_t, mask=r_ok, other=0)
        kb_t = tl.load(f_t + sf0, mask=r_ok, other=0)
        todo = r_ok
        while tl.max(todo.to(tl.int32), axis=0) > 0:  # the rows' documents, smallest first index first
            kb = tl.min(tl.where(todo, kb_t, 2147483647), axis=0)
            mine = todo & (kb_t == kb)
            todo = todo & (kb_t != kb)
            _dense_rows(q, keys + kb * skt, skt, d_ok, pos_rr, row_ok & (kb_rr == kb),
                        tl.max(tl.where(mine, pos_t, 0), axis=0), T - kb, out, soj, mine, n_blocks, GP, L_SEL, LP, BT,
                        BJ, SCALE, ACC, UPCAST, PREC)
    else:
        last = (tl.minimum(r0 + BT, r_hi) - 1).to(tl.int64) * T // R  # the tile's last row's position
        _dense_rows(q, keys, skt, d_ok, row_t, row_ok, last, T, out, soj, r_ok, n_blocks, GP, L_SEL, LP, BT, BJ,
                    SCALE, ACC, UPCAST, PREC)


@triton.jit(do_not_specialize=["T", "R", "n_blocks"])
def _dense_mass_kernel(
    Q, K, OUT,
    sqb, sqh, sqg, sqt, sqd,
    skb, skh, skt, skd,
    sob, soh, sor, soj,
    T, R, n_blocks,
    H_KV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, DP: tl.constexpr,
    L_SEL: tl.constexpr, LP: tl.constexpr, BT: tl.constexpr, BJ: tl.constexpr, SCALE: tl.constexpr,
    ACC: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
):
    bh = tl.program_id(1).to(tl.int64)
    dense_mass_tile(Q, K, OUT, OUT, sqb, sqh, sqg, sqt, sqd, skb, skh, skt, skd, sob, soh, sor, soj, 0, 0, 0,
                    bh // H_KV, bh % H_KV, tl.program_id(0) * BT, R, T, R, n_blocks, G, GP, HD, DP, L_SEL, LP, BT, BJ,
                    SCALE, ACC, UPCAST, PREC, False)


def kernel_constexprs(dtype: torch.dtype, G: int, hd: int, l_sel: int) -> dict:
    """The kernel's compile-time constants for these shapes (also used to compile it ahead of time)."""
    gp, lp = triton.next_power_of_2(G), triton.next_power_of_2(l_sel)
    f64, interpret = dtype == torch.float64, interpreter_active()
    return dict(
        G=G, GP=gp, HD=hd, DP=max(16, triton.next_power_of_2(hd)), L_SEL=l_sel, LP=lp,
        BT=max(1, min(16, ROWS // gp)), BJ=max(1, KEY_LANES // lp), SCALE=1.0 / math.sqrt(hd),
        ACC=tl.float64 if f64 else tl.float32, UPCAST=interpret and dtype in (torch.bfloat16, torch.float16),
        PREC="ieee" if f64 or interpret else "tf32x3",
    )


@torch.no_grad()
def dense_block_mass_rows(
    q: torch.Tensor,  # [B, H_kv, G, T, hd] the layer's queries (RoPE applied) at positions 0 .., any strides
    k: torch.Tensor,  # [B, H_kv, T, hd] the selected branch's keys (RoPE applied)
    R: int,  # KL rows: the queries at r * T // R
    l_sel: int,
    n_blocks: int,
) -> torch.Tensor:  # [B, H_kv, R, n_blocks] float32 (float64 for float64 inputs)
    """Dense causal attention's probability mass per selection block, summed over each group's heads, for the KL's
    R rows: impl/index_scores.dense_block_mass(q[:, :, :, rows], k, rows, ...) in one launch (plain layout, no
    distance cap)."""
    B, H_kv, G, T, hd = q.shape
    if k.shape != (B, H_kv, T, hd) or not 0 < R <= T:
        raise ValueError(f"dense_block_mass_rows: q {tuple(q.shape)}, k {tuple(k.shape)}, R={R} do not match")
    if q.device.type == "cpu" and not interpreter_active():
        raise RuntimeError("dense_block_mass_rows needs a CUDA tensor, or TRITON_INTERPRET=1 set before triton is "
                           "imported")
    if k.dtype != q.dtype:
        dtype = torch.promote_types(q.dtype, k.dtype)
        q, k = q.to(dtype), k.to(dtype)
    meta = kernel_constexprs(q.dtype, G, hd, l_sel)
    out = torch.empty(B, H_kv, R, n_blocks, dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
    grid = (triton.cdiv(R, meta["BT"]), B * H_kv)
    _dense_mass_kernel[grid](q, k, out, *q.stride(), *k.stride(), *out.stride(), T, R, n_blocks, H_KV=H_kv, **meta)
    return out
