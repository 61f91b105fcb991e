"""NSA top-n block selection as one Triton kernel: scores -> softmax -> group sum -> Eq. 9 -> top-n.

Same result as the torch path `nsa.attention.impl.block_select.select_by_score`, i.e.
select_blocks(selection_block_scores(compression_group_probs(q, ck))) for every query, ties included.
No [T, N_c] (or [T, N_blocks]) tensor exists at any time, by construction: probabilities and block
scores live in registers one chunk at a time, and the only tensor written is block_idx [B, H_kv, Tq, n].

Geometry (stride units of d positions): compressed token i covers units [i, i+m) with m = l/d; selection
block j covers units [j*r, (j+1)*r) with r = l'/d. Query p sees token i iff i*d + l - 1 <= p; its
current block is c = p // l', and only blocks j <= c compete.

Grid (cdiv(Tq, BT), B*H_kv). A program owns BT consecutive queries of one KV head and all G query heads
of the group as one tile of R = GP*BT rows (~64), row = g*BT + t (GP = G padded to a power of two;
padded heads and queries past Tq get probability 0), so small groups still fill the MMA rows.
  pass 1  (skipped when the compressed branch's log-sum-exps are given: `lse`, the paper's Eq. 8 sharing)
          over chunks of BN compressed tokens, up to those the tile's last query sees:
            s = q @ ck^T / sqrt(hd)                          # [R, DP] @ [DP, BN] -> [R, BN]
            online max m and denominator den per row (scores a row cannot see are -inf);
          lse = m + log(den)                                 # [R]; a row that sees nothing keeps p = 0
  pass 2  over chunks of BJ selection blocks, columns 0 .. BJ-1 = blocks j0-S .. j0-S+BJ-1, where
          S = ceil((m-1)/r) look-back columns hold the tokens whose tails reach block j0; up to the
          current block of the tile's last query (later chunks are skipped):
            p     = exp(s - lse), 0 where not visible        # [R, BN] the chunk's tokens, BN = BJ*RUP
            p_grp = sum over heads of p.reshape(GP, BT, BN)  # [BT, BN]        Eq. 10
            score = Eq. 9 on p_grp.reshape(BT, BJ, RUP):     # [BT, BJ]
                    the token at offset o of column jj adds |[o, o+m) & [k*r, (k+1)*r)| times its
                    probability to column jj + k (k = 0 .. S; k > 0 via tl.gather along the columns)
          (RUP = r padded to a power of two; padded lanes are masked.) The S look-back columns
          (incomplete; scored by the previous chunk) and blocks > c get -inf, blocks 0, c-1, c +inf.
          The BJ candidates then merge into a running top-n per query: (value, block) pairs [BT, NP]
          kept sorted best-first (NP = n padded to a power of two; slots >= n stay -inf). Order: higher
          value first, ties -> lower block. Every block of a chunk has a higher index than all blocks
          merged before, so a running entry precedes a new one iff its value is >= the new one; ranks
          in the union come from counting ([BT, NP, BJ] and [BT, BJ, BJ] comparisons; they form a
          permutation) and slot s takes the entry of rank s. A chunk where no candidate beats any
          query's n-th value is not merged. Allowed blocks score >= 0 > -inf, so each query keeps
          exactly min(n, c+1) blocks.
  output  the kept blocks ascending, again by counting ([BT, NP, NP]); empty slots -> -1 (last).
Every block's score is computed by the same operations over the same token pattern (no carry between
chunks), so blocks that tie in exact arithmetic (e.g. uniform probabilities) tie here too, and the
lower index wins as in select_blocks.

Documents (`frame` [3, B, Tq] int64: q_pos, k_base, c_base; nsa/attention/documents.py; HAS_FRAME): query
(b, t) is the query at position p = q_pos of a document whose compressed tokens are ck[b, :, c_base + i];
everything above holds in the document's frame (positions, blocks, forced blocks, look-back), and the
block indices are document-relative. A tile's queries may straddle documents: the program runs passes 1
and 2 once per distinct c_base among them (smallest first; usually one, two at a boundary), each over
that document's tokens only, with the other rows at position -l' (they see no token and may pick no
block). Each document's passes equal those of the document run alone (same relative chunks), so the
indices do too. One launch whatever the number of documents; without a frame the kernel is unchanged.

Accumulation is fp32 (fp64 for fp64 inputs). q @ ck^T: bf16/fp16 on tensor cores; fp32 on a GPU as
3xTF32 (~fp32 accuracy; an IEEE FMA dot spills registers), IEEE for fp64 and in the interpreter.
q_start, Tq and N_c are runtime arguments, not specialized (chunked prefill does not recompile); head
counts, head dim, l, d, l', n and tile sizes are constexprs. On CPU tensors the kernel runs only in
Triton's interpreter (TRITON_INTERPRET=1 before triton is imported), which has no bf16 matmul: there
bf16/fp16 tiles are upcast to fp32 right before the dot (UPCAST).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from nsa.attention.kernels.interpreter import interpreter_active

BLOCK_ROWS = 64  # (head, query) rows per program: BT = BLOCK_ROWS // GP queries (1 .. MAX_BLOCK_QUERIES)
MAX_BLOCK_QUERIES = 16
BLOCKS_PER_CHUNK = 16  # BJ: selection blocks per pass-2 chunk (a power of two)


@triton.jit
def merge_topn(val, blk, top_v, top_i, N: tl.constexpr, NP: tl.constexpr, BJ: tl.constexpr):
    """Merge one chunk's candidates val [BT, BJ] (blocks blk [BJ], each higher than every block merged before;
    -inf: not a candidate) into the running top-n (top_v, top_i) [BT, NP], kept sorted best-first (slots >= n
    stay -inf). Order: higher value first, ties -> lower block. A running entry precedes a new one iff its value
    is >= the new one; ranks in the union come from counting ([BT, NP, BJ] and [BT, BJ, BJ] comparisons; they
    form a permutation) and slot s takes the entry of rank s. A chunk where no candidate beats any query's n-th
    value is not merged."""
    slots = tl.arange(0, NP)
    cols = tl.arange(0, BJ)
    nth = tl.max(tl.where(slots[None, :] == N - 1, top_v, float("-inf")), axis=1)  # [BT] n-th best so far
    if tl.max((val > nth[:, None]).to(tl.int32)) > 0:  # some candidate enters some query's top-n
        # rank in the union: running entries ahead of it + new candidates ahead of it
        new_ahead_of_run = (val[:, None, :] > top_v[:, :, None]).to(tl.int32)  # [BT, NP, BJ]
        rank_run = slots[None, :] + tl.sum(new_ahead_of_run, axis=2)  # [BT, NP]
        run_ahead_of_new = (top_v[:, :, None] >= val[:, None, :]).to(tl.int32)  # [BT, NP, BJ]
        v_a = val[:, :, None]  # [BT, BJ (ahead), 1]
        v_b = val[:, None, :]  # [BT, 1, BJ (behind)]
        new_ahead = (v_a > v_b) | ((v_a == v_b) & (cols[:, None] < cols[None, :])[None, :, :])  # [BT, BJ, BJ]
        rank_new = tl.sum(run_ahead_of_new, axis=1) + tl.sum(new_ahead.to(tl.int32), axis=1)  # [BT, BJ]
        # slot s takes the entry of rank s
        take_run = rank_run[:, :, None] == slots[None, None, :]  # [BT, NP, NP (slot)]
        take_new = rank_new[:, :, None] == slots[None, None, :]  # [BT, BJ, NP (slot)]
        v_run = tl.max(tl.where(take_run, top_v[:, :, None], float("-inf")), axis=1)  # [BT, NP]
        v_new = tl.max(tl.where(take_new, val[:, :, None], float("-inf")), axis=1)
        i_run = tl.max(tl.where(take_run, top_i[:, :, None], -1), axis=1)
        i_new = tl.max(tl.where(take_new, blk[None, :, None], -1), axis=1)
        keep = slots[None, :] < N
        top_v = tl.where(keep, tl.maximum(v_run, v_new), float("-inf"))
        top_i = tl.where(keep, tl.maximum(i_run, i_new), 0).to(tl.int32)
    return top_v, top_i


@triton.jit
def ascending(top_v, top_i, NP: tl.constexpr):
    """The kept blocks of a running top-n (top_v, top_i) [BT, NP] in ascending order, by counting ([BT, NP, NP]
    comparisons), as int64 [BT, NP]; empty slots (-inf) -> -1, last."""
    slots = tl.arange(0, NP)
    NO_BLOCK: tl.constexpr = 2147483647  # sorts after every block index
    key = tl.where(top_v > float("-inf"), top_i, NO_BLOCK)  # [BT, NP] int32; kept blocks are distinct
    k_a = key[:, :, None]  # [BT, NP (a), 1]
    k_b = key[:, None, :]  # [BT, 1, NP (b)]
    b_first = (k_b < k_a) | ((k_b == k_a) & (slots[None, :] < slots[:, None])[None, :, :])  # [BT, NP, NP]
    position = tl.sum(b_first.to(tl.int32), axis=2)  # [BT, NP] ascending rank (a permutation)
    at = position[:, :, None] == slots[None, None, :]  # [BT, NP (a), NP (slot)]
    key = tl.max(tl.where(at, key[:, :, None], -1), axis=1)  # [BT, NP] ascending
    return tl.where(key == NO_BLOCK, -1, key).to(tl.int64)


@triton.jit
def _row_lse(
    q, ck_tile, skn, d_ok, row_pos, row_in, last, N_c,
    L: tl.constexpr, D: tl.constexpr, R: tl.constexpr, BN: tl.constexpr, SCALE: tl.constexpr,
    ACC: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
):
    """Pass 1 for one document (compressed tokens ck_tile + i * skn, i < N_c): the log-sum-exp [R] of the
    rows row_in at positions row_pos [R] (last: the largest position; a row at a negative position sees
    no token, and a row that sees none gets 0)."""
    n_vis = tl.where(last + 1 >= L, (last + 1 - L) // D + 1, 0)  # tokens the last query sees
    n_vis = tl.minimum(n_vis, N_c)
    offs_n = tl.arange(0, BN)
    # running max starts finite so chunks a row cannot see give exp(-inf - m) = 0 (no -inf - -inf)
    m_i = tl.full([R], -1.0e30, dtype=ACC)
    den = tl.zeros([R], dtype=ACC)
    for n0 in range(0, n_vis, BN):
        tok = n0 + offs_n  # [BN]
        kt = tl.load(ck_tile + tok[:, None].to(tl.int64) * skn, mask=(tok < n_vis)[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
        s = tl.dot(q, tl.trans(kt), input_precision=PREC, out_dtype=ACC) * SCALE  # [R, BN]
        vis = row_in[:, None] & (tok < n_vis)[None, :] & (tok[None, :] * D + (L - 1) <= row_pos[:, None])
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        den = den * tl.exp(m_i - m_new) + tl.sum(tl.exp(s - m_new[:, None]), axis=1)
        m_i = m_new
    return tl.where(den > 0, m_i + tl.log(tl.where(den > 0, den, 1.0)), 0.0)  # [R]


@triton.jit
def _chunk_block_scores(
    q, ck_tile, skn, d_ok, row_pos, row_in, lse, first, n_vis,
    GP: tl.constexpr, L: tl.constexpr, D: tl.constexpr, L_SEL: tl.constexpr, BT: tl.constexpr, BJ: tl.constexpr,
    SHIFT: tl.constexpr, SCALE: tl.constexpr, RUP: tl.constexpr, ACC: tl.constexpr, UPCAST: tl.constexpr,
    PREC: tl.constexpr,
):
    """Eq. 9-10 for block columns first .. first+BJ-1 of the tile's BT queries (rows row_pos [R], row_in; lse [R];
    n_vis compressed tokens readable): -> score [BT, BJ], each query's group-summed compressed probability mass per
    block; columns < SHIFT are incomplete (junk: the caller excludes them)."""
    M: tl.constexpr = L // D  # units per compressed token
    RU: tl.constexpr = L_SEL // D  # units (= compressed tokens) per selection block
    BN: tl.constexpr = BJ * RUP  # token lanes per chunk (RUP = RU padded to a power of two)
    offs_n = tl.arange(0, BN)
    cols = tl.arange(0, BJ)  # [BJ] block column within a chunk
    lane_col = offs_n // RUP  # [BN] token lane -> block column
    lane_off = offs_n % RUP  # [BN] token lane -> token offset in its block (units)
    offs_o = tl.arange(0, RUP)
    # Eq. 9: the token at offset o of block column c covers units [o, o+M) from that block's start, so it
    # adds |[o, o+M) & [k*RU, (k+1)*RU)| of its probability to block column c + k (k = 0 .. SHIFT)
    w_own = (tl.minimum(offs_o + M, RU) - offs_o).to(ACC)  # [RUP] (k = 0; o < RU)
    tok = (first + lane_col) * RU + lane_off  # [BN] tokens of columns 0 .. BJ-1
    tok_ok = (lane_off < RU) & (tok >= 0) & (tok < n_vis)
    kt = tl.load(ck_tile + tok[:, None].to(tl.int64) * skn, mask=tok_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        kt = kt.to(tl.float32)
    s = tl.dot(q, tl.trans(kt), input_precision=PREC, out_dtype=ACC) * SCALE  # [R, BN]
    vis = row_in[:, None] & tok_ok[None, :] & (tok[None, :] * D + (L - 1) <= row_pos[:, None])
    p = tl.exp(tl.where(vis, s - lse[:, None], float("-inf")))  # [R, BN], 0 where not visible
    p_grp = tl.sum(tl.reshape(p, (GP, BT, BN)), axis=0)  # [BT, BN] Eq. 10
    p_blk = tl.reshape(p_grp, (BT, BJ, RUP))  # [BT, BJ, RUP] tokens by block column
    score = tl.sum(p_blk * w_own[None, None, :], axis=2)  # [BT, BJ] Eq. 9, tokens of the block itself
    for k in tl.static_range(1, SHIFT + 1):  # tails of the k-th previous column (m > 1)
        w_k = tl.maximum(tl.minimum(offs_o + M, (k + 1) * RU) - tl.maximum(offs_o, k * RU), 0).to(ACC)
        carry = tl.sum(p_blk * w_k[None, None, :], axis=2)  # [BT, BJ] into column c + k
        src = tl.maximum(cols - k, 0)[None, :] + tl.zeros([BT, BJ], dtype=tl.int32)
        score += tl.gather(carry, src, axis=1)  # columns < SHIFT get junk and are excluded by the caller
    return score


@triton.jit
def _merge_blocks(
    q, ck_tile, skn, d_ok, row_pos, row_in, lse, pos_t, last, N_c, top_v, top_i,
    GP: tl.constexpr, L: tl.constexpr, D: tl.constexpr, L_SEL: tl.constexpr, N: tl.constexpr,
    NP: tl.constexpr, BT: tl.constexpr, BJ: tl.constexpr, SHIFT: tl.constexpr, SCALE: tl.constexpr,
    RUP: tl.constexpr, ACC: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
):
    """Pass 2 for one document (as _row_lse; lse [R] from it): the blocks of the tile's queries at
    positions pos_t [BT] merged into their running top-n (top_v, top_i) [BT, NP]. A query at position
    -l' may pick no block (its top-n stays)."""
    n_vis = tl.where(last + 1 >= L, (last + 1 - L) // D + 1, 0)  # tokens the last query sees
    n_vis = tl.minimum(n_vis, N_c)
    # ---- pass 2: block scores per chunk of blocks, merged into a running top-n
    current = pos_t // L_SEL  # [BT] each query's current block
    cols = tl.arange(0, BJ)  # [BJ] block column within a chunk
    c_last = last // L_SEL
    for j0 in range(0, c_last + 1, BJ - SHIFT):  # blocks j0 .. j0 + BJ - SHIFT - 1 are complete here
        first = j0 - SHIFT  # block of column 0
        score = _chunk_block_scores(q, ck_tile, skn, d_ok, row_pos, row_in, lse, first, n_vis, GP, L, D, L_SEL, BT, BJ,
                                    SHIFT, SCALE, RUP, ACC, UPCAST, PREC)
        blk = first + cols  # [BJ]
        allowed = (cols[None, :] >= SHIFT) & (blk[None, :] <= current[:, None])  # [BT, BJ]
        forced = (blk[None, :] == 0) | (blk[None, :] == current[:, None]) | (blk[None, :] == current[:, None] - 1)
        val = tl.where(allowed, tl.where(forced, float("inf"), score), float("-inf"))  # [BT, BJ]

        top_v, top_i = merge_topn(val, blk, top_v, top_i, N, NP, BJ)
    return top_v, top_i


@triton.jit
def _document(todo, pos_t, cb_t, frame_b, row_q, row_ok, sf0, sf2, L_SEL: tl.constexpr):
    """Frame mode: the next document of a tile, the one of smallest c_base among the queries still to do
    (todo [BT]; pos_t, cb_t [BT]: their positions and c_bases). Returns its c_base, its largest query
    position and the positions [R] of the rows (queries row_q [R]; frame_b: the frame of batch row b),
    -l' for rows of other documents."""
    cb = tl.min(tl.where(todo, cb_t, 2147483647), axis=0)
    last = tl.max(tl.where(todo & (cb_t == cb), pos_t, 0), axis=0)
    f_r = frame_b + row_q.to(tl.int64) * sf2  # [R] (recomputed: cheaper than keeping it live)
    in_r = row_ok & (tl.load(f_r + 2 * sf0, mask=row_ok, other=-1).to(tl.int32) == cb)  # [R]
    return cb, last, tl.where(in_r, tl.load(f_r, mask=row_ok, other=0).to(tl.int32), -L_SEL)


@triton.jit(do_not_specialize=["q_start", "Tq", "N_c"])  # new chunk offsets / lengths: no recompile
def _select_topk_kernel(
    Q, CK, OUT, FRAME, LSE,
    sqb, sqh, sqg, sqt, sqd,
    skb, skh, skn, skd,
    sf0, sf1, sf2,
    slb, slh, slg, slt,
    q_start, Tq, N_c,
    H_KV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, DP: tl.constexpr,
    L: tl.constexpr, D: tl.constexpr, L_SEL: tl.constexpr, N: tl.constexpr, NP: tl.constexpr,
    BT: tl.constexpr, BJ: tl.constexpr, SHIFT: tl.constexpr, SCALE: tl.constexpr,
    RUP: tl.constexpr, ACC: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
    HAS_FRAME: tl.constexpr, HAS_LSE: tl.constexpr,
):
    R: tl.constexpr = GP * BT  # rows: (head, query) pairs
    q0 = tl.program_id(0) * BT  # positions and block indices are int32, pointer offsets int64
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H_KV
    h = bh % H_KV

    # rows of the tile: row = g * BT + t
    offs_r = tl.arange(0, R)
    row_g = offs_r // BT
    row_q = q0 + offs_r % BT  # query index in 0 .. Tq-1
    row_ok = (row_g < G) & (row_q < Tq)
    offs_d = tl.arange(0, DP)
    d_ok = offs_d < HD
    q_rows = Q + b * sqb + h * sqh + row_g[:, None] * sqg + row_q[:, None].to(tl.int64) * sqt  # [R, 1]
    q = tl.load(q_rows + offs_d[None, :] * sqd, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [R, DP]
    if UPCAST:  # the interpreter has no bf16/fp16 matmul
        q = q.to(tl.float32)
    ck_tile = CK + b * skb + h * skh + offs_d[None, :] * skd  # [1, DP] pointers of token 0

    offs_t = tl.arange(0, BT)
    q_idx = q0 + offs_t  # [BT]
    q_ok = q_idx < Tq
    slots = tl.arange(0, NP)
    if HAS_LSE:  # the compressed branch's log-sum-exps (Eq. 8's softmax, shared): no pass 1
        lse_in = tl.load(LSE + b * slb + h * slh + row_g.to(tl.int64) * slg + row_q.to(tl.int64) * slt,
                         mask=row_ok, other=0.0).to(ACC)
        lse_in = tl.where(lse_in > float("-inf"), lse_in, 0.0)  # a row that sees no token: p = 0 as in pass 1
    if HAS_FRAME:
        # frame [3, B, Tq]: q_pos, k_base, c_base per query. The tile's queries run one document (one
        # c_base) at a time: the document of the smallest c_base still to do, in its own frame; the
        # other queries and rows take part at position -l' (they see no token and may pick no block)
        f_t = FRAME + b * sf1 + q_idx.to(tl.int64) * sf2  # [BT]
        pos_t = tl.load(f_t, mask=q_ok, other=0).to(tl.int32)  # [BT] positions within the documents
        cb_t = tl.load(f_t + 2 * sf0, mask=q_ok, other=0).to(tl.int32)  # [BT] first compressed token
        if HAS_LSE:
            lse = lse_in
        else:
            lse = tl.zeros([R], dtype=ACC)
            todo = q_ok  # [BT] queries whose document has not run yet
            while tl.max(todo.to(tl.int32), axis=0) > 0:  # pass 1, once per document in the tile (usually 1-2)
                cb, last, row_pos = _document(todo, pos_t, cb_t, FRAME + b * sf1, row_q, row_ok, sf0, sf2, L_SEL)
                lse = tl.where(row_pos >= 0, _row_lse(q, ck_tile + cb.to(tl.int64) * skn, skn, d_ok, row_pos, row_ok,
                                                      last, N_c - cb, L, D, R, BJ * RUP, SCALE, ACC, UPCAST, PREC), lse)
                todo = todo & (cb_t != cb)
        top_v = tl.full([BT, NP], float("-inf"), dtype=ACC)  # running top-n, best first
        top_i = tl.zeros([BT, NP], dtype=tl.int32)
        todo = q_ok
        while tl.max(todo.to(tl.int32), axis=0) > 0:  # pass 2, document by document
            cb, last, row_pos = _document(todo, pos_t, cb_t, FRAME + b * sf1, row_q, row_ok, sf0, sf2, L_SEL)
            top_v, top_i = _merge_blocks(
                q, ck_tile + cb.to(tl.int64) * skn, skn, d_ok, row_pos, row_ok, lse,
                tl.where(todo & (cb_t == cb), pos_t, -L_SEL), last, N_c - cb, top_v, top_i,
                GP, L, D, L_SEL, N, NP, BT, BJ, SHIFT, SCALE, RUP, ACC, UPCAST, PREC,
            )
            todo = todo & (cb_t != cb)
    else:
        row_pos = q_start + row_q  # [R] absolute positions
        last = q_start + tl.minimum(q0 + BT, Tq) - 1  # the tile's last query position
        if HAS_LSE:
            lse = lse_in
        else:
            lse = _row_lse(q, ck_tile, skn, d_ok, row_pos, row_ok, last, N_c, L, D, R, BJ * RUP, SCALE, ACC, UPCAST,
                           PREC)
        top_v = tl.full([BT, NP], float("-inf"), dtype=ACC)  # running top-n, best first
        top_i = tl.zeros([BT, NP], dtype=tl.int32)
        top_v, top_i = _merge_blocks(
            q, ck_tile, skn, d_ok, row_pos, row_ok, lse, q_start + q_idx, last, N_c, top_v, top_i,
            GP, L, D, L_SEL, N, NP, BT, BJ, SHIFT, SCALE, RUP, ACC, UPCAST, PREC,
        )

    out = ascending(top_v, top_i, NP)  # [BT, NP] int64, -1 for empty slots (last)
    tl.store(OUT + (bh * Tq + q_idx[:, None].to(tl.int64)) * N + slots[None, :], out,
             mask=q_ok[:, None] & (slots < N)[None, :])


@triton.jit
def _pooled_rows(q, ck_tile, skn, d_ok, row_pos, row_ok, lse, last, N_c, out, soj, r_ok, n_blocks,
                 GP: tl.constexpr, L: tl.constexpr, D: tl.constexpr, L_SEL: tl.constexpr, BT: tl.constexpr,
                 BJ: tl.constexpr, SHIFT: tl.constexpr, SCALE: tl.constexpr, RUP: tl.constexpr, ACC: tl.constexpr,
                 UPCAST: tl.constexpr, PREC: tl.constexpr, HAS_LSE: tl.constexpr):
    """One document's rows (row_ok [RR] at positions row_pos [RR], the largest `last`) over its N_c compressed tokens
    from ck_tile on: their mass per block 0 .. n_blocks-1 stored for the KL rows r_ok [BT] (lse [RR] given, or
    computed here without HAS_LSE)."""
    RR: tl.constexpr = GP * BT
    if not HAS_LSE:
        lse = _row_lse(q, ck_tile, skn, d_ok, row_pos, row_ok, last, N_c, L, D, RR, BJ * RUP, SCALE, ACC, UPCAST,
                       PREC)
    n_vis = tl.minimum(tl.where(last + 1 >= L, (last + 1 - L) // D + 1, 0), N_c)
    cols = tl.arange(0, BJ)
    c_last = last // L_SEL
    for j0 in range(0, n_blocks, BJ - SHIFT):  # blocks j0 .. j0 + BJ - SHIFT - 1 are complete here
        first = j0 - SHIFT
        blk = first + cols
        if j0 <= c_last:
            score = _chunk_block_scores(q, ck_tile, skn, d_ok, row_pos, row_ok, lse, first, n_vis, GP, L, D, L_SEL,
                                        BT, BJ, SHIFT, SCALE, RUP, ACC, UPCAST, PREC)
        else:  # past every row's last visible token
            score = tl.zeros([BT, BJ], dtype=ACC)
        tl.store(out + blk[None, :].to(tl.int64) * soj, score,
                 mask=r_ok[:, None] & ((cols >= SHIFT) & (blk < n_blocks))[None, :])


@triton.jit
def pooled_mass_tile(
    Q, CK, LSE, OUT, FRAME,
    sqb, sqh, sqg, sqt, sqd,
    skb, skh, skn, skd,
    slb, slh, slg, slt,
    sob, soh, sor, soj,
    sf0, sf1, sf2,
    b, h, r0, r_hi, T, R, N_c, n_blocks,
    G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, DP: tl.constexpr,
    L: tl.constexpr, D: tl.constexpr, L_SEL: tl.constexpr, BT: tl.constexpr, BJ: tl.constexpr,
    SHIFT: tl.constexpr, SCALE: tl.constexpr, RUP: tl.constexpr, ACC: tl.constexpr, UPCAST: tl.constexpr,
    PREC: tl.constexpr, HAS_LSE: tl.constexpr, HAS_FRAME: tl.constexpr,
):
    """pooled_block_mass_rows for KL rows r0 .. min(r0 + BT, r_hi) - 1 (row r = the query at sequence index
    r * T // R) of batch row b, KV group h: every block 0 .. n_blocks-1 written (0 past what a row sees). With a frame
    (packed documents: q_pos, k_base, c_base per sequence index) each row reads its own document's compressed tokens
    (from c_base on) at its position in the document, one document of the tile at a time. Also run inside the KL's
    forward (kernels/indexer_kl.py), which computes its rows' target first."""
    RR: tl.constexpr = GP * BT  # (head, KL row) rows, row = g * BT + t
    offs_r = tl.arange(0, RR)
    row_g = offs_r // BT
    row_r = r0 + offs_r % BT
    row_ok = (row_g < G) & (row_r < r_hi)
    row_t = (row_r.to(tl.int64) * T) // R  # [RR] sequence index (the position without a frame)
    offs_d = tl.arange(0, DP)
    d_ok = offs_d < HD
    q = tl.load(Q + b * sqb + h * sqh + row_g[:, None] * sqg + row_t[:, None] * sqt
                + offs_d[None, :] * sqd, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    ck_tile = CK + b * skb + h * skh + offs_d[None, :] * skd
    r_t = r0 + tl.arange(0, BT)
    r_ok = r_t < r_hi
    lse = tl.zeros([RR], dtype=ACC)
    if HAS_LSE:
        lse = tl.load(LSE + b * slb + h * slh + row_g.to(tl.int64) * slg + row_t * slt,
                      mask=row_ok, other=0.0).to(ACC)
        lse = tl.where(lse > float("-inf"), lse, 0.0)  # a row that sees no token: p = 0
    out = OUT + b * sob + h * soh + r_t.to(tl.int64)[:, None] * sor  # [BT, 1]
    if HAS_FRAME:
        f_rr = FRAME + b * sf1 + row_t * sf2  # [RR]
        pos_rr = tl.load(f_rr, mask=row_ok, other=0).to(tl.int32)
        cb_rr = tl.load(f_rr + 2 * sf0, mask=row_ok, other=0).to(tl.int32)
        f_t = FRAME + b * sf1 + ((r_t.to(tl.int64) * T) // R) * sf2  # [BT]
        pos_t = tl.load(f_t, mask=r_ok, other=0).to(tl.int32)
        cb_t = tl.load(f_t + 2 * sf0, mask=r_ok, other=0).to(tl.int32)
        todo = r_ok
        while tl.max(todo.to(tl.int32), axis=0) > 0:  # the rows' documents, smallest compressed base first
            cb = tl.min(tl.where(todo, cb_t, 2147483647), axis=0)
            mine = todo & (cb_t == cb)
            todo = todo & (cb_t != cb)
            in_doc = row_ok & (cb_rr == cb)
            _pooled_rows(q, ck_tile + cb.to(tl.int64) * skn, skn, d_ok, tl.where(in_doc, pos_rr, -L_SEL), in_doc,
                         lse, tl.max(tl.where(mine, pos_t, 0), axis=0), N_c - cb, out, soj, mine, n_blocks, GP, L, D,
                         L_SEL, BT, BJ, SHIFT, SCALE, RUP, ACC, UPCAST, PREC, HAS_LSE)
    else:
        last = ((tl.minimum(r0 + BT, r_hi) - 1).to(tl.int64) * T // R).to(tl.int32)  # the tile's last row's position
        _pooled_rows(q, ck_tile, skn, d_ok, row_t.to(tl.int32), row_ok, lse, last, N_c, out, soj, r_ok, n_blocks, GP,
                     L, D, L_SEL, BT, BJ, SHIFT, SCALE, RUP, ACC, UPCAST, PREC, HAS_LSE)


@triton.jit(do_not_specialize=["T", "R", "N_c", "n_blocks"])
def _pooled_mass_kernel(
    Q, CK, LSE, OUT,
    sqb, sqh, sqg, sqt, sqd,
    skb, skh, skn, skd,
    slb, slh, slg, slt,
    sob, soh, sor, soj,
    T, R, N_c, n_blocks,
    H_KV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, DP: tl.constexpr,
    L: tl.constexpr, D: tl.constexpr, L_SEL: tl.constexpr, BT: tl.constexpr, BJ: tl.constexpr,
    SHIFT: tl.constexpr, SCALE: tl.constexpr, RUP: tl.constexpr, ACC: tl.constexpr, UPCAST: tl.constexpr,
    PREC: tl.constexpr, HAS_LSE: tl.constexpr,
):
    """pooled_block_mass_rows: program (row tile, b * H_kv + h) -> pooled_mass_tile."""
    bh = tl.program_id(1).to(tl.int64)
    pooled_mass_tile(Q, CK, LSE, OUT, OUT, sqb, sqh, sqg, sqt, sqd, skb, skh, skn, skd, slb, slh, slg, slt,
                     sob, soh, sor, soj, 0, 0, 0, bh // H_KV, bh % H_KV, tl.program_id(0) * BT, R, T, R, N_c,
                     n_blocks, G, GP, HD, DP, L, D, L_SEL, BT, BJ, SHIFT, SCALE, RUP, ACC, UPCAST, PREC, HAS_LSE,
                     False)


@torch.no_grad()
def pooled_block_mass_rows(
    q: torch.Tensor,  # [B, H_kv, G, T, hd] queries (RoPE applied) at positions 0 .., any strides
    ck: torch.Tensor,  # [B, H_kv, N_c, hd] compressed keys (RoPE applied)
    R: int,  # KL rows: the queries at r * T // R
    l: int, d: int, l_sel: int, n_blocks: int,
    lse: torch.Tensor | None = None,  # [B, H_kv, G, T] the compressed branch's log-sum-exps (Eq. 8 shared)
) -> torch.Tensor:  # [B, H_kv, R, n_blocks] float32 (float64 for float64 inputs)
    """The learned indexer's compressed target (nsa.indexer_target=compressed): for each of the R KL rows the
    compressed branch's probability mass per selection block, summed over the group's heads (Eq. 9-10: what pooled
    selection ranks by), equal to nsa.attention.indexer.pooled_block_mass(q[:, :, :, rows], ck, rows, ...) up to
    rounding. One launch; the rows are read in place (no gather)."""
    B, H_kv, G, T, hd = q.shape
    if ck.shape[:2] != (B, H_kv) or ck.shape[3] != hd or not 0 < R <= T:
        raise ValueError(f"pooled_block_mass_rows: q {tuple(q.shape)}, ck {tuple(ck.shape)}, R={R} do not match")
    if q.device.type == "cpu" and not interpreter_active():
        raise RuntimeError("pooled_block_mass_rows needs a CUDA tensor, or TRITON_INTERPRET=1 set before triton is "
                           "imported")
    if ck.dtype != q.dtype:
        dtype = torch.promote_types(q.dtype, ck.dtype)
        q, ck = q.to(dtype), ck.to(dtype)
    meta = kernel_constexprs(q.dtype, G, hd, l, d, l_sel, 1)
    meta.pop("N"), meta.pop("NP")
    acc = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty(B, H_kv, R, n_blocks, dtype=acc, device=q.device)
    if out.numel() == 0:
        return out
    lse_arg, l_strides = (ck, (0, 0, 0, 0)) if lse is None else (lse, lse.stride())  # unread without lse
    grid = (triton.cdiv(R, meta["BT"]), B * H_kv)
    _pooled_mass_kernel[grid](q, ck, lse_arg, out, *q.stride(), *ck.stride(), *l_strides, *out.stride(), T, R,
                              ck.shape[2], n_blocks, H_KV=H_kv, **meta, HAS_LSE=lse is not None,
                              num_stages=num_stages(q.dtype, hd), maxnreg=255)  # as the selection kernel's
    return out


def kernel_constexprs(dtype: torch.dtype, G: int, hd: int, l: int, d: int, l_sel: int, n: int) -> dict:
    """The kernel's compile-time constants for these shapes (also used to compile it ahead of time)."""
    m, r = l // d, l_sel // d
    shift = -(-(m - 1) // r)  # blocks of look-back so a chunk holds every token overlapping its blocks
    rup, gp = triton.next_power_of_2(r), triton.next_power_of_2(G)
    bj = max(BLOCKS_PER_CHUNK, 16 // rup, triton.next_power_of_2(2 * shift + 1))  # tl.dot needs BJ * RUP >= 16
    f64, interpret = dtype == torch.float64, interpreter_active()
    return dict(
        G=G, GP=gp, HD=hd, DP=max(16, triton.next_power_of_2(hd)),
        L=l, D=d, L_SEL=l_sel, N=n, NP=triton.next_power_of_2(n),
        BT=max(1, min(MAX_BLOCK_QUERIES, _rows(dtype, hd) // gp)), BJ=bj, SHIFT=shift, RUP=rup, SCALE=1.0 / math.sqrt(hd),
        ACC=tl.float64 if f64 else tl.float32,
        UPCAST=interpret and dtype in (torch.bfloat16, torch.float16),
        # q @ ck^T: bf16/fp16 run natively (the precision is ignored); fp32 on a GPU as 3xTF32 (tensor
        # cores, ~fp32 accuracy; a plain FMA dot spills registers); fp64 and the interpreter IEEE
        PREC="ieee" if f64 or interpret else "tf32x3",
    )


def _rows(dtype: torch.dtype, hd: int) -> int:
    """(head, query) rows per program: half for 4-byte dtypes at hd > 128 (fits an H100's shared memory)."""
    return BLOCK_ROWS // 2 if dtype in (torch.float32, torch.float64) and hd > 128 else BLOCK_ROWS


def num_stages(dtype: torch.dtype, hd: int) -> int:
    """Software-pipelining depth: fp32 at hd > 128 keeps one stage (three overflow an A100's shared memory)."""
    return 1 if dtype in (torch.float32, torch.float64) and hd > 128 else 3


def checked_select_args(name: str, q: torch.Tensor, ck: torch.Tensor, q_start: int, l: int, d: int, l_sel: int,
                        n: int, frame: torch.Tensor | None, lse: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The selection kernels' one set of argument checks (`name` leads each error); returns (q, ck) in one dtype."""
    B, H_kv, G, Tq, hd = q.shape
    if ck.dim() != 4 or ck.shape[:2] != (B, H_kv) or ck.shape[3] != hd:
        raise ValueError(f"{name}: q {tuple(q.shape)} and ck {tuple(ck.shape)} do not match")
    if d < 1 or l < 1 or l % d or l_sel % d or l_sel < 1 or n < 1 or q_start < 0:
        raise ValueError(f"{name}: need d | l, d | l', n >= 1, q_start >= 0 "
                         f"(l={l}, d={d}, l'={l_sel}, n={n}, q_start={q_start})")
    if frame is not None and (frame.shape != (3, B, Tq) or frame.dtype != torch.long or frame.device != q.device):
        raise ValueError(f"{name}: frame must be int64 [3, {B}, {Tq}] on {q.device}, got "
                         f"{frame.dtype} {tuple(frame.shape)} on {frame.device}")
    if lse is not None and (lse.shape != (B, H_kv, G, Tq) or lse.device != q.device or not lse.is_floating_point()):
        raise ValueError(f"{name}: lse must be [{B}, {H_kv}, {G}, {Tq}] floating point on {q.device}, "
                         f"got {lse.dtype} {tuple(lse.shape)} on {lse.device}")
    if q.device.type == "cpu" and not interpreter_active():
        raise RuntimeError(f"{name} needs a CUDA tensor, or TRITON_INTERPRET=1 set before triton is imported")
    if ck.dtype != q.dtype:
        dtype = torch.promote_types(q.dtype, ck.dtype)
        q, ck = q.to(dtype), ck.to(dtype)
    return q, ck


@torch.no_grad()
def fused_select_blocks(
    q: torch.Tensor,  # [B, H_kv, G, Tq, hd] queries (RoPE applied) at positions q_start .., any strides
    ck: torch.Tensor,  # [B, H_kv, N_c, hd] compressed keys (RoPE applied); token i covers [i*d, i*d + l)
    q_start: int,
    l: int,
    d: int,
    l_sel: int,
    n: int,
    frame: torch.Tensor | None = None,  # [3, B, Tq] int64 (q_pos, k_base, c_base): documents; q_start unused
    lse: torch.Tensor | None = None,  # [B, H_kv, G, Tq] the compressed branch's log-sum-exps, any strides
) -> torch.Tensor:  # [B, H_kv, Tq, n] int64 block indices, ascending; -1 pads |I_p| = min(n, p // l' + 1)
    """Top-n selection blocks per query (block 0, the previous and the current block forced; ties -> lower
    index), equal to block_select.select_by_score. One kernel launch, no host sync.

    frame (nsa/attention/documents.py): query (b, t) is a query at position p = frame[0, b, t] of a
    document whose compressed tokens are ck[b, :, c + i], c = frame[2, b, t], i < num_compressed(p + 1)
    (frame[1], the key base, is not read here). Everything above holds in the document's frame: blocks
    are counted from the document's first token (current block p // l'), and the returned indices are
    document-relative. Equal to running each document alone (q_start = its first query's position, ck
    sliced to its tokens). A program runs the documents of its tile of queries one after another (one
    c_base at a time), so a tile straddling a boundary costs each document's own passes; the launch count
    stays one. Without a frame: queries at q_start + t, one document (bit-identical to no frame support).

    lse (optional): each (query, head) row's log-sum-exp of its scaled scores over the compressed tokens it sees,
    as the compressed branch computes it (q @ ck^T / sqrt(hd), the same visibility, -inf where it sees none):
    the paper's Eq. 8 shares that softmax with selection. Given, the kernel skips pass 1 (one of its two q @ ck^T
    passes); the picks equal those without it up to the roundings of the two log-sum-exps (a near-tie of two
    blocks' scores may resolve differently).
    """
    q, ck = checked_select_args("fused_select_blocks", q, ck, q_start, l, d, l_sel, n, frame, lse)
    B, H_kv, G, Tq, hd = q.shape
    out = torch.empty(B, H_kv, Tq, n, dtype=torch.long, device=q.device)
    if out.numel() == 0:
        return out
    meta = kernel_constexprs(q.dtype, G, hd, l, d, l_sel, n)
    grid = (triton.cdiv(Tq, meta["BT"]), B * H_kv)
    f = out if frame is None else frame  # unread without a frame
    f_strides = (0, 0, 0) if frame is None else frame.stride()
    lse_arg, l_strides = (ck, (0, 0, 0, 0)) if lse is None else (lse, lse.stride())  # unread without lse
    _select_topk_kernel[grid](
        q, ck, out, f, lse_arg, *q.stride(), *ck.stride(), *f_strides, *l_strides, q_start, Tq, ck.shape[2],
        H_KV=H_kv, **meta, HAS_FRAME=frame is not None, HAS_LSE=lse is not None, num_stages=num_stages(q.dtype, hd),
        # left to itself ptxas caps the kernel at 168 registers at hd 32 and spills: the frame variant on sm_80
        # (Triton 3.9), the plain one in bf16 on sm_90 (Triton 3.6); 255 lets it keep its state in registers
        maxnreg=255,
    )
    return out
