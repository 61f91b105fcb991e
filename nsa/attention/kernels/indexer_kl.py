"""The learned indexer's KL term (nsa::indexer_kl) as one Triton launch forward and one backward.

Same result as the torch oracle `nsa.attention.impl.index_scores.kl_loss` and its closed-form backward
`kl_loss_backward` (up to rounding). Nothing of size [R, N_b] is written but the target: the scores live in registers
one chunk of blocks at a time.

Inputs: the indexer's projection output out [B, T, P], P = H_kv*h*e + H_kv*h + e, columns [q | w | k]
(impl/index_scores.split_projection); target [B, H_kv, R, N_b], given, or computed in the forward launch from a
source (TARGET 1: the compressed branch's Eq. 9-10 mass, select_topk.pooled_mass_tile; 2: dense attention's mass,
dense_mass.dense_mass_tile): each program writes its own rows' target first, then a barrier, then reads it back, and
the target is an output the backward reuses. Row r of the KL is the query at sequence index
t_r = r * T // R (position t_r, current block c_r = t_r // l'); its candidate blocks are 1 .. c_r - 2; it counts
(valid) when it has two or more. Scores (per KV group k): I(r, j) = sum_h w(t_r, h) * ReLU(q(t_r, h) . K(j)) / sqrt(e),
K(j) the elementwise max of block j's token keys (PER_TOKEN off), or, PER_TOKEN on, the max over block j's tokens s of
sum_h w(t_r, h) * ReLU(q(t_r, h) . k(s)) / sqrt(e).

Forward, grid (cdiv(R, BT), B*H_kv): a program owns BT rows of one KV group, all h index heads as R' = HP*BT tile rows
(row = hh*BT + t; padded heads have q = w = 0). Over chunks of BJ blocks up to its last row's c - 2, per row:
    m, den   online log-sum-exp of I over the candidates          -> lse
    total    sum of the target over the candidates
    A, Bv    sum of target * log(target), of target * I
    KL(r)  = A / total - log(total) - Bv / total + lse
             (= sum_j p log p - sum_j p log softmax(I), p = target / total)
and writes weight * KL(r) / count for valid rows with total > 0 (else 0), count = B * H_kv * valid rows (a function of
T, R and l' alone without documents: no host sync), and (lse, total) per row for the backward. The loss is the sum of those terms,
taken by the model once for every layer (nsa/model.py).

Backward, one launch, a 1-D grid of two kinds of program:
  row programs (cdiv(R, BT) * B * H_kv): per chunk the scores again, then
      g(r, j) = grad(r) * weight / count * valid(r) * [total > 0] * (exp(I(r, j) - lse(r)) - target(r, j) / total(r))
      on the candidates (0 elsewhere); a block's max passes g to its best token(s), split among ties as autograd
      splits a max (PER_TOKEN: the tokens whose score is the block's; else per dim of K(j), in the key programs);
      d w(t_r, h) = sum g * ReLU(s_h),  d s_h = g * w_h * [s_h > 0],  d q(t_r, h) = sum d s_h * key / sqrt(e)
      written to d_out's q and w columns at t_r; the positions between two rows get zeros there (a barrier orders
      the zero fill before the rows' values).
  key programs (cdiv(T, BKB * l') * B): BKB blocks' tokens; over every KV group and every row tile that may read them,
      d key += sum over rows and heads of d s_h * q_h / sqrt(e) (d K(j) routed per dim to the block's max token(s)),
      written to d_out's k columns: every token's, exactly once.
No atomics: every element of d_out is written by one program, so the backward is deterministic.

Packed documents (HAS_FRAME; frame [3, B, T]: each token's position in its document and its document's first index,
nsa/attention/documents.py): row r's position is its position in its document, its blocks count from the document's
first token and its scores read that document's keys only. A row program runs its rows' documents one at a time
(smallest first index first; usually one, two at a boundary), the others' rows taking part with no candidate. The
count of valid rows depends on the documents: it is given (counted: impl/index_scores.counted_kl_rows, computed once
per batch), not derived from T. Key program p owns key indices [p * BKB * l', (p + 1) * BKB * l') of its batch row:
for every document present there, the blocks whose first token lies in the range (at most BKB), over that document's
rows only (a while-loop from the first row tile that may read them to the first past the document); a token's
gradient is written by the program holding its block's first token, only where the token belongs to the document (a
document's last, partial block, never a candidate, reaches into the next document). The target computed in the
launch reads each row's own document the same way (select_topk.pooled_mass_tile, dense_mass.dense_mass_tile).

Accumulation fp32 (fp64 for fp64 inputs); dots as select_topk.py's (IEEE in the interpreter and for fp64, 3xTF32 for
fp32, native bf16/fp16 with UPCAST in the interpreter). T and R are runtime arguments.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from nsa.attention.kernels import dense_mass, select_topk
from nsa.attention.kernels.dense_mass import dense_mass_tile
from nsa.attention.kernels.interpreter import interpreter_active
from nsa.attention.kernels.select_topk import pooled_mass_tile

ROWS = 64  # (index head, KL row) tile rows per program: BT = ROWS // HP rows (at most MAX_ROWS)
MAX_ROWS = 16
TOKEN_LANES = 128  # PER_TOKEN: token lanes per chunk (BJ * LP) forward
BACKWARD_TOKEN_LANES = 64  # and backward (its score, gradient and key tiles in registers)
KEY_BLOCKS = 16  # blocks per key program with one key per block (BKB); PER_TOKEN: TOKEN_LANES // LP


@triton.jit
def block_keys(OUT, ob, sot, sop, k_col, offs_e, e_ok, j0, T, BJ: tl.constexpr, L_SEL: tl.constexpr,
                ACC: tl.constexpr):
    """Block keys of blocks j0 .. j0+BJ-1: the elementwise max of each block's token keys, one token offset at a time
    ([BJ, EP] live, not [BJ, l', EP]); 0 for a block with no token before T. -> keys [BJ, EP], present [BJ]."""
    first = (j0 + tl.arange(0, BJ)) * L_SEL  # [BJ]
    present = first < T
    keys = tl.full([BJ, offs_e.shape[0]], float("-inf"), dtype=ACC)
    for o in range(L_SEL):
        tok = first + o
        k = tl.load(OUT + ob + tok[:, None].to(tl.int64) * sot + (k_col + offs_e)[None, :] * sop,
                    mask=(tok < T)[:, None] & e_ok[None, :], other=float("-inf"))
        keys = tl.maximum(keys, k.to(ACC))
    return tl.where(present[:, None] & e_ok[None, :], keys, 0.0), present


@triton.jit
def _chunk_scores(q, w, OUT, ob, sot, sop, k_col, offs_e, e_ok, j0, T,
                  HP: tl.constexpr, BT: tl.constexpr, BJ: tl.constexpr, LP: tl.constexpr, BN: tl.constexpr,
                  L_SEL: tl.constexpr, PER_TOKEN: tl.constexpr, SCALE: tl.constexpr, ACC: tl.constexpr,
                  PREC: tl.constexpr):
    """Blocks j0 .. j0+BJ-1 for the tile's rows (q [R', EP], w [R']): -> s [R', BN] (the heads' scaled dots; BN = BJ*LP
    token lanes when PER_TOKEN, else the BJ block keys), keys [BN, EP] (what s dotted, in q's dtype), per_key [BT, BN]
    (summed over heads after ReLU; -inf for lanes past T or l') and I [BT, BJ] (PER_TOKEN: per_key's max over each
    block's lanes)."""
    if PER_TOKEN:
        lanes = tl.arange(0, BN)
        tok = (j0 + lanes // LP) * L_SEL + lanes % LP  # [BN]
        tok_ok = (lanes % LP < L_SEL) & (tok < T)
        keys = tl.load(OUT + ob + tok[:, None].to(tl.int64) * sot + (k_col + offs_e)[None, :] * sop,
                       mask=tok_ok[:, None] & e_ok[None, :], other=0.0)
    else:
        keys, tok_ok = block_keys(OUT, ob, sot, sop, k_col, offs_e, e_ok, j0, T, BJ, L_SEL, ACC)
    keys = keys.to(q.dtype)
    s = tl.dot(q, tl.trans(keys), input_precision=PREC, out_dtype=ACC) * SCALE  # [R', BN]
    per_key = tl.sum(tl.reshape(tl.maximum(s, 0.0) * w[:, None], (HP, BT, BN)), axis=0)  # [BT, BN]
    per_key = tl.where(tok_ok[None, :], per_key, float("-inf"))
    if PER_TOKEN:
        I = tl.max(tl.reshape(per_key, (BT, BJ, LP)), axis=2)  # [BT, BJ]
    else:
        I = per_key
    return s, keys, per_key, I


@triton.jit
def _load_rows(OUT, ob, sot, sop, kv, r0, T, R, FRAME, sf0, sfb, sf2,
               H_KV: tl.constexpr, HI: tl.constexpr, HP: tl.constexpr, E: tl.constexpr, EP: tl.constexpr,
               BT: tl.constexpr, UPCAST: tl.constexpr, ACC: tl.constexpr, HAS_FRAME: tl.constexpr):
    """The tile's rows r0 .. r0+BT-1: q [R', EP], w [R'] (R' = HP*BT, row = hh*BT + t), and per KL row [BT]: its
    position (in its document, with a frame; sfb: the frame's offset of batch row b) and its document's first index
    (0 without a frame), its index, whether it exists."""
    R_: tl.constexpr = HP * BT
    offs = tl.arange(0, R_)
    hh = offs // BT
    r_t = r0 + tl.arange(0, BT)  # [BT]
    r_ok = r_t < R
    t_seq = (r_t.to(tl.int64) * T) // R  # [BT] sequence index of each KL row
    r = r0 + offs % BT
    ok = (hh < HI) & (r < R)
    t_row = (r.to(tl.int64) * T) // R  # [R']
    offs_e = tl.arange(0, EP)
    e_ok = offs_e < E
    q = tl.load(OUT + ob + t_row[:, None] * sot + ((kv * HI + hh) * E)[:, None] * sop + offs_e[None, :] * sop,
                mask=ok[:, None] & e_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    w = tl.load(OUT + ob + t_row * sot + (H_KV * HI * E + kv * HI + hh) * sop, mask=ok, other=0.0).to(ACC)
    if HAS_FRAME:
        f = FRAME + sfb + t_seq * sf2
        pos = tl.load(f, mask=r_ok, other=0).to(tl.int32)
        kb = tl.load(f + sf0, mask=r_ok, other=0).to(tl.int32)
    else:
        pos = t_seq.to(tl.int32)
        kb = tl.zeros([BT], dtype=tl.int32)
    return q, w, pos, kb, r_t, r_ok, offs_e, e_ok


@triton.jit
def _next_document(todo, kb_r, current):
    """The next document among a tile's rows still to do (todo [BT]; kb_r [BT] their documents' first indices): the
    one of smallest first index -> (its first index, its rows' current blocks with -1 for the others (they have no
    candidate), the largest of them, the rows still to do after it)."""
    kb = tl.min(tl.where(todo, kb_r, 2147483647), axis=0)
    mine = todo & (kb_r == kb)
    return kb, tl.where(mine, current, -1), tl.max(tl.where(mine, current, 0), axis=0), todo & (kb_r != kb)


@triton.jit
def _accumulate_rows(q, w, OUT, ob, sot, sop, k_col, offs_e, e_ok, T, tgt, stj, current, last, n_blocks,
                     m, den, total, a_sum, b_sum,
                     HP: tl.constexpr, BT: tl.constexpr, BJ: tl.constexpr, LP: tl.constexpr, BN: tl.constexpr,
                     L_SEL: tl.constexpr, PER_TOKEN: tl.constexpr, SCALE: tl.constexpr, ACC: tl.constexpr,
                     PREC: tl.constexpr):
    """The forward's statistics of the rows whose current block is current [BT] (-1: none of these blocks), over
    blocks 1 .. last - 2 of the keys from ob on (T of them): the online log-sum-exp (m, den) and the target's total,
    sum t log t and sum t * I."""
    cols = tl.arange(0, BJ)
    # the target's total per (row, block lane), summed over lanes after the loop: a loop-carried row sum (total +=
    # tl.sum(t, 1)) that the kernel then reads three times fails Triton 3.6's compile (the GPU image's Triton; its
    # TritonGPUOptimizeThreadLocality pass asserts that such a loop result has one use); 3.9 compiles either form
    total_lanes = tl.zeros([BT, BJ], dtype=ACC)
    for j0 in range(0, last - 1, BJ):  # candidates are blocks 1 .. c - 2
        _, _, _, I = _chunk_scores(q, w, OUT, ob, sot, sop, k_col, offs_e, e_ok, j0, T, HP, BT, BJ, LP, BN,
                                   L_SEL, PER_TOKEN, SCALE, ACC, PREC)
        blk = j0 + cols
        cand = (blk[None, :] >= 1) & (blk[None, :] <= current[:, None] - 2) & (blk[None, :] < n_blocks)
        t = tl.load(tgt + blk[None, :].to(tl.int64) * stj, mask=cand, other=0.0).to(ACC)  # [BT, BJ]
        I = tl.where(cand, I, float("-inf"))  # only the candidates compete (no inf or NaN from the others below)
        m_new = tl.maximum(m, tl.max(I, axis=1))
        den = den * tl.exp(m - m_new) + tl.sum(tl.exp(I - m_new[:, None]), axis=1)
        m = m_new
        total_lanes += t
        a_sum += tl.sum(tl.where(t > 0, t * tl.log(tl.where(t > 0, t, 1.0)), 0.0), axis=1)
        b_sum += tl.sum(tl.where(cand, t * tl.where(cand, I, 0.0), 0.0), axis=1)
    return m, den, total + tl.sum(total_lanes, axis=1), a_sum, b_sum


@triton.jit(do_not_specialize=["T", "R"])
def _kl_fwd_kernel(
    OUT, TGT, KLROW, STATS, TQ, TS, TL, FRAME, COUNT,
    sob, sot, sop, stb, stk, str_, stj,
    sqb, sqh, sqg, sqt, sqd, ssb, ssh, ssn, ssd, slb, slh, slg, slt, sf0, sf1, sf2,
    T, R, n_blocks, scale, N_src,
    H_KV: tl.constexpr, HI: tl.constexpr, HP: tl.constexpr, E: tl.constexpr, EP: tl.constexpr,
    L_SEL: tl.constexpr, LP: tl.constexpr, BT: tl.constexpr, BJ: tl.constexpr, BN_ROW: tl.constexpr,
    PER_TOKEN: tl.constexpr, SCALE: tl.constexpr, ACC: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
    TARGET: tl.constexpr, T_G: tl.constexpr, T_GP: tl.constexpr, T_HD: tl.constexpr, T_DP: tl.constexpr,
    T_L: tl.constexpr, T_D: tl.constexpr, T_BT: tl.constexpr, T_BJ: tl.constexpr, T_SHIFT: tl.constexpr,
    T_SCALE: tl.constexpr, T_RUP: tl.constexpr, T_LP: tl.constexpr, T_UPCAST: tl.constexpr,
    T_HAS_LSE: tl.constexpr, HAS_FRAME: tl.constexpr,
):
    r0 = tl.program_id(0) * BT
    bk = tl.program_id(1).to(tl.int64)
    b = bk // H_KV
    kv = bk % H_KV
    ob = b * sob
    if TARGET != 0:  # this program's rows' target first (TARGET 1: compressed, 2: dense), read back after a barrier
        r_end = tl.minimum(r0 + BT, R)
        for rs in range(r0, r_end, T_BT):
            if TARGET == 1:
                pooled_mass_tile(TQ, TS, TL, TGT, FRAME, sqb, sqh, sqg, sqt, sqd, ssb, ssh, ssn, ssd, slb, slh, slg,
                                 slt, stb, stk, str_, stj, sf0, sf1, sf2, b, kv, rs, r_end, T, R, N_src, n_blocks,
                                 T_G, T_GP, T_HD, T_DP, T_L, T_D, L_SEL, T_BT, T_BJ, T_SHIFT, T_SCALE, T_RUP, ACC,
                                 T_UPCAST, PREC, T_HAS_LSE, HAS_FRAME)
            else:
                dense_mass_tile(TQ, TS, TGT, FRAME, sqb, sqh, sqg, sqt, sqd, ssb, ssh, ssn, ssd, stb, stk, str_, stj,
                                sf0, sf1, sf2, b, kv, rs, r_end, T, R, n_blocks, T_G, T_GP, T_HD, T_DP, L_SEL, T_LP,
                                T_BT, T_BJ, T_SCALE, ACC, T_UPCAST, PREC, HAS_FRAME)
        tl.debug_barrier()
    q, w, pos, kb_r, r_t, r_ok, offs_e, e_ok = _load_rows(OUT, ob, sot, sop, kv, r0, T, R, FRAME, sf0, b * sf1, sf2,
                                                           H_KV, HI, HP, E, EP, BT, UPCAST, ACC, HAS_FRAME)
    current = pos // L_SEL  # [BT]
    k_col = H_KV * HI * (E + 1)
    m = tl.full([BT], -1.0e30, dtype=ACC)
    den = tl.zeros([BT], dtype=ACC)
    total = tl.zeros([BT], dtype=ACC)
    a_sum = tl.zeros([BT], dtype=ACC)
    b_sum = tl.zeros([BT], dtype=ACC)
    tgt = TGT + b * stb + kv * stk + r_t.to(tl.int64)[:, None] * str_  # [BT, 1]
    if HAS_FRAME:  # the rows' documents one at a time (usually one or two per tile), each over its own keys
        todo = r_ok
        while tl.max(todo.to(tl.int32), axis=0) > 0:
            kb, cur, last, todo = _next_document(todo, kb_r, current)
            m, den, total, a_sum, b_sum = _accumulate_rows(
                q, w, OUT, ob + kb.to(tl.int64) * sot, sot, sop, k_col, offs_e, e_ok, T - kb, tgt, stj, cur, last,
                n_blocks, m, den, total, a_sum, b_sum, HP, BT, BJ, LP, BN_ROW, L_SEL, PER_TOKEN, SCALE, ACC, PREC)
        count = H_KV * tl.load(COUNT)  # the counted rows (index_scores.counted_kl_rows, once per batch)
        scale = tl.where(count > 0, scale / tl.maximum(count, 1).to(ACC), 0.0)  # scale: the weight, with a frame
    else:
        m, den, total, a_sum, b_sum = _accumulate_rows(
            q, w, OUT, ob, sot, sop, k_col, offs_e, e_ok, T, tgt, stj, tl.where(r_ok, current, -1),
            tl.max(tl.where(r_ok, current, 0), axis=0), n_blocks, m, den, total, a_sum, b_sum, HP, BT, BJ, LP,
            BN_ROW, L_SEL, PER_TOKEN, SCALE, ACC, PREC)
    lse = m + tl.log(tl.where(den > 0, den, 1.0))
    safe = tl.where(total > 0, total, 1.0)
    kl = a_sum / safe - tl.log(safe) - b_sum / safe + lse
    counts = r_ok & (current - 2 >= 2) & (total > 0)
    tl.store(KLROW + bk * R + r_t, tl.where(counts, kl * scale, 0.0), mask=r_ok)
    tl.store(STATS + (bk * R + r_t) * 2, lse, mask=r_ok)
    tl.store(STATS + (bk * R + r_t) * 2 + 1, total, mask=r_ok)


@triton.jit
def _block_grads(I, per_key, lse, total, rowscale, tgt, blk, current, r_ok, n_blocks, stj,
                 HP: tl.constexpr, BT: tl.constexpr, BJ: tl.constexpr, LP: tl.constexpr, BN: tl.constexpr,
                 PER_TOKEN: tl.constexpr, ACC: tl.constexpr):
    """dL/dI on the candidate blocks [BT, BJ], passed to the token lanes (PER_TOKEN: to each block's best token(s),
    split among ties) and repeated for the heads: -> [R', BN]."""
    cand = r_ok[:, None] & (blk[None, :] >= 1) & (blk[None, :] <= current[:, None] - 2) & (blk[None, :] < n_blocks)
    t = tl.load(tgt + blk[None, :].to(tl.int64) * stj, mask=cand, other=0.0).to(ACC)
    safe = tl.where(total > 0, total, 1.0)
    soft = tl.exp(tl.where(cand, I - lse[:, None], float("-inf")))  # 0 off the candidates
    g = tl.where(cand, soft - t / safe[:, None], 0.0) * rowscale[:, None]  # [BT, BJ]
    if PER_TOKEN:
        tok = tl.reshape(per_key, (BT, BJ, LP))
        is_max = (tok == I[:, :, None]).to(ACC)
        ties = tl.sum(is_max, axis=2)
        g_tok = tl.reshape(g[:, :, None] * is_max / tl.where(ties > 0, ties, 1.0)[:, :, None], (BT, BN))
    else:
        g_tok = g
    return tl.reshape(tl.broadcast_to(g_tok[None, :, :], (HP, BT, BN)), (HP * BT, BN))


@triton.jit
def _accumulate_row_grads(q, w, OUT, ob, sot, sop, k_col, offs_e, e_ok, T, tgt, stj, current, r_ok, last, n_blocks,
                          lse, total, rowscale, d_q, d_w,
                          HP: tl.constexpr, BT: tl.constexpr, BJ: tl.constexpr, LP: tl.constexpr, BN: tl.constexpr,
                          L_SEL: tl.constexpr, PER_TOKEN: tl.constexpr, SCALE: tl.constexpr, ACC: tl.constexpr,
                          PREC: tl.constexpr):
    """d q [R', EP] and d w [R'] of the rows whose current block is current [BT] (-1: none of these blocks), over
    blocks 1 .. last - 2 of the keys from ob on (T of them)."""
    cols = tl.arange(0, BJ)
    for j0 in range(0, last - 1, BJ):
        s, keys, per_key, I = _chunk_scores(q, w, OUT, ob, sot, sop, k_col, offs_e, e_ok, j0, T, HP, BT, BJ,
                                            LP, BN, L_SEL, PER_TOKEN, SCALE, ACC, PREC)
        g = _block_grads(I, per_key, lse, total, rowscale, tgt, j0 + cols, current, r_ok, n_blocks, stj,
                         HP, BT, BJ, LP, BN, PER_TOKEN, ACC)  # [R', BN]
        d_w += tl.sum(g * tl.maximum(s, 0.0), axis=1)
        d_s = tl.where(s > 0, g * w[:, None], 0.0)
        d_q += tl.dot(d_s.to(keys.dtype), keys, input_precision=PREC, out_dtype=ACC) * SCALE
    return d_q, d_w


@triton.jit
def _row_gradient_scale(STATS, grad, sgb, sgk, sgr, scale, b, kv, bk, r_t, r_ok, current, R, ACC: tl.constexpr):
    """The backward's per-row statistics of rows r_t [BT] (KV group kv, bk = b * H_kv + kv): the forward's log-sum-exp
    and target total, and dL/dterm * weight / count where the row counts (two or more candidates, a target), else 0."""
    lse = tl.load(STATS + (bk * R + r_t) * 2, mask=r_ok, other=0.0).to(ACC)
    total = tl.load(STATS + (bk * R + r_t) * 2 + 1, mask=r_ok, other=0.0).to(ACC)
    g_row = tl.load(grad + b * sgb + kv * sgk + r_t * sgr, mask=r_ok, other=0.0).to(ACC) * scale
    return lse, total, tl.where(r_ok & (current - 2 >= 2) & (total > 0), g_row, 0.0)


@triton.jit
def _rows_left(FRAME, sf0, sfb, sf2, r0, T, R, kb, HAS_FRAME: tl.constexpr):
    """Whether the row tile starting at KL row r0 exists and, with a frame, does not start past the document whose
    first index is kb (the rows' first indices grow along the rows; sfb: the frame's offset of the batch row)."""
    go = r0 < R
    if HAS_FRAME:
        t0 = (tl.minimum(r0, R - 1).to(tl.int64) * T) // R
        go = go & (tl.load(FRAME + sfb + sf0 + t0 * sf2) <= kb)
    return go


@triton.jit
def _rows_backward(pid, OUT, TGT, STATS, DOUT, FRAME, sob, sot, sop, stb, stk, str_, stj, sdb, sdt, sdp, sf0, sf1, sf2,
                   T, R, n_blocks, grad, sgb, sgk, sgr, scale, k_col, H_KV: tl.constexpr, HI: tl.constexpr,
                   HP: tl.constexpr, E: tl.constexpr, EP: tl.constexpr, L_SEL: tl.constexpr, LP: tl.constexpr,
                   BT: tl.constexpr, BJ: tl.constexpr, BN_ROW: tl.constexpr, PER_TOKEN: tl.constexpr,
                   SCALE: tl.constexpr, ACC: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
                   HAS_FRAME: tl.constexpr):
    """The backward's row program pid: d q and d w at its KL rows, zeros between them (module docstring)."""
    n_tiles = tl.cdiv(R, BT)
    r0 = (pid % n_tiles) * BT
    bk = (pid // n_tiles).to(tl.int64)
    b = bk // H_KV
    kv = bk % H_KV
    ob = b * sob
    q, w, pos, kb_r, r_t, r_ok, offs_e, e_ok = _load_rows(OUT, ob, sot, sop, kv, r0, T, R, FRAME, sf0, b * sf1, sf2,
                                                           H_KV, HI, HP, E, EP, BT, UPCAST, ACC, HAS_FRAME)
    current = pos // L_SEL
    lse, total, rowscale = _row_gradient_scale(STATS, grad, sgb, sgk, sgr, scale, b, kv, bk, r_t, r_ok, current, R,
                                               ACC)
    tgt = TGT + b * stb + kv * stk + r_t.to(tl.int64)[:, None] * str_
    d_q = tl.zeros([HP * BT, EP], dtype=ACC)
    d_w = tl.zeros([HP * BT], dtype=ACC)
    if HAS_FRAME:
        todo = r_ok
        while tl.max(todo.to(tl.int32), axis=0) > 0:
            kb, cur, last, todo = _next_document(todo, kb_r, current)
            d_q, d_w = _accumulate_row_grads(q, w, OUT, ob + kb.to(tl.int64) * sot, sot, sop, k_col, offs_e, e_ok,
                                             T - kb, tgt, stj, cur, r_ok, last, n_blocks, lse, total, rowscale, d_q,
                                             d_w, HP, BT, BJ, LP, BN_ROW, L_SEL, PER_TOKEN, SCALE, ACC, PREC)
    else:
        d_q, d_w = _accumulate_row_grads(q, w, OUT, ob, sot, sop, k_col, offs_e, e_ok, T, tgt, stj, current, r_ok,
                                         tl.max(tl.where(r_ok, current, 0), axis=0), n_blocks, lse, total, rowscale,
                                         d_q, d_w, HP, BT, BJ, LP, BN_ROW, L_SEL, PER_TOKEN, SCALE, ACC, PREC)
    # zeros at the positions from this tile's first row to the next tile's (its rows' values follow the barrier)
    t_lo = (r0.to(tl.int64) * T) // R
    t_hi = (tl.minimum(r0 + BT, R).to(tl.int64) * T) // R
    t_hi = tl.where(r0 + BT >= R, T, t_hi)
    offs_c = tl.arange(0, EP)
    for t0 in range(t_lo, t_hi, BT):
        tz = t0 + tl.arange(0, BT)
        at = DOUT + b * sdb + tz[:, None].to(tl.int64) * sdt
        for hh in range(HI):
            tl.store(at + ((kv * HI + hh) * E + offs_c)[None, :] * sdp, tl.zeros([BT, EP], dtype=ACC),
                     mask=(tz < t_hi)[:, None] & (offs_c < E)[None, :])
        tl.store(at + (H_KV * HI * E + kv * HI + tl.arange(0, HP))[None, :] * sdp, tl.zeros([BT, HP], dtype=ACC),
                 mask=(tz < t_hi)[:, None] & (tl.arange(0, HP) < HI)[None, :])
    tl.debug_barrier()
    offs = tl.arange(0, HP * BT)
    hh = offs // BT
    r = r0 + offs % BT
    ok = (hh < HI) & (r < R)
    t_row = (r.to(tl.int64) * T) // R
    tl.store(DOUT + b * sdb + t_row[:, None] * sdt + ((kv * HI + hh) * E)[:, None] * sdp + offs_e[None, :] * sdp,
             d_q, mask=ok[:, None] & e_ok[None, :])
    tl.store(DOUT + b * sdb + t_row * sdt + (H_KV * HI * E + kv * HI + hh) * sdp, d_w, mask=ok)


@triton.jit
def _block_key_grads(OUT, TGT, STATS, FRAME, ob, b, kb, j0, sot, sop, stb, stk, str_, stj, sf0, sf1, sf2, T, R,
                     n_blocks, grad, sgb, sgk, sgr, scale, k_col, offs_e, e_ok, H_KV: tl.constexpr, HI: tl.constexpr,
                     HP: tl.constexpr, E: tl.constexpr, EP: tl.constexpr, L_SEL: tl.constexpr, LP: tl.constexpr,
                     BT: tl.constexpr, BKB: tl.constexpr, BN_KEY: tl.constexpr, PER_TOKEN: tl.constexpr,
                     SCALE: tl.constexpr, ACC: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
                     HAS_FRAME: tl.constexpr):
    """d key [BN_KEY, EP] of blocks j0 .. j0+BKB-1 of the document whose first key is at index kb (0 without a frame;
    ob: b's offset in OUT), over every KV group and every KL row of that document that may read them (block keys:
    the gradient of each block's key, routed to its tokens by the caller)."""
    cols = tl.arange(0, BKB)
    d_key = tl.zeros([BN_KEY, EP], dtype=ACC)
    ob_doc = ob + kb.to(tl.int64) * sot
    # rows whose candidates reach block j0: t_r >= kb + (j0 + 2) * l'  <=>  r >= ceil((kb + (j0 + 2) * l') * R / T)
    r_first = ((kb + (j0 + 2) * L_SEL).to(tl.int64) * R + T - 1) // T
    r_start = ((r_first // BT) * BT).to(tl.int32)
    for kv in range(H_KV):
        bk = b * H_KV + kv
        tgt_base = TGT + b * stb + kv * stk
        r0 = r_start
        go = _rows_left(FRAME, sf0, b * sf1, sf2, r0, T, R, kb, HAS_FRAME)
        while go:
            q, w, pos, kb_r, r_t, r_ok, _, _ = _load_rows(OUT, ob, sot, sop, kv, r0, T, R, FRAME, sf0, b * sf1, sf2,
                                                          H_KV, HI, HP, E, EP, BT, UPCAST, ACC, HAS_FRAME)
            current = pos // L_SEL
            lse, total, rowscale = _row_gradient_scale(STATS, grad, sgb, sgk, sgr, scale, b, kv, bk, r_t, r_ok,
                                                       current, R, ACC)
            s, keys, per_key, I = _chunk_scores(q, w, OUT, ob_doc, sot, sop, k_col, offs_e, e_ok, j0, T - kb, HP, BT,
                                                BKB, LP, BN_KEY, L_SEL, PER_TOKEN, SCALE, ACC, PREC)
            g = _block_grads(I, per_key, lse, total, rowscale, tgt_base + r_t.to(tl.int64)[:, None] * str_,
                             j0 + cols, tl.where(kb_r == kb, current, -1), r_ok, n_blocks, stj, HP, BT, BKB, LP,
                             BN_KEY, PER_TOKEN, ACC)
            d_s = tl.where(s > 0, g * w[:, None], 0.0)  # [R', BN]
            d_key += tl.dot(tl.trans(d_s).to(q.dtype), q, input_precision=PREC, out_dtype=ACC) * SCALE
            r0 += BT
            go = _rows_left(FRAME, sf0, b * sf1, sf2, r0, T, R, kb, HAS_FRAME)
    return d_key


@triton.jit
def _write_key_grads(d_key, OUT, DOUT, FRAME, ob, b, kb, j0, owned, sot, sop, sdb, sdt, sdp, sf0, sf1, sf2, T, k_col,
                     offs_e, e_ok, L_SEL: tl.constexpr, LP: tl.constexpr, BKB: tl.constexpr, BN_KEY: tl.constexpr,
                     PER_TOKEN: tl.constexpr, ACC: tl.constexpr, HAS_FRAME: tl.constexpr):
    """Write d key of blocks j0 .. j0+BKB-1 of the document at kb to d_out's k columns: the tokens of the blocks this
    program owns (owned [BKB]) that lie in the document (with a frame: their first index is kb) and before T."""
    cols = tl.arange(0, BKB)
    ob_doc = ob + kb.to(tl.int64) * sot
    if PER_TOKEN:
        lanes = tl.arange(0, BN_KEY)
        rel = (j0 + lanes // LP) * L_SEL + lanes % LP  # [BN] document-relative token index
        tok = kb + rel
        ok = (lanes % LP < L_SEL) & (tok < T) & tl.reshape(tl.broadcast_to(owned[:, None], (BKB, LP)), (BN_KEY,))
        if HAS_FRAME:
            ok = ok & (tl.load(FRAME + b * sf1 + sf0 + tok.to(tl.int64) * sf2, mask=ok, other=-1) == kb)
        tl.store(DOUT + b * sdb + tok[:, None].to(tl.int64) * sdt + (k_col + offs_e)[None, :] * sdp, d_key,
                 mask=ok[:, None] & e_ok[None, :])
    else:  # each dim of a block key to the block's token(s) holding its max, split among ties
        best, _ = block_keys(OUT, ob_doc, sot, sop, k_col, offs_e, e_ok, j0, T - kb, BKB, L_SEL, ACC)  # [BKB, EP]
        first = (j0 + cols) * L_SEL
        ties = tl.zeros_like(best)
        for o in range(L_SEL):
            rel = first + o
            k = tl.load(OUT + ob_doc + rel[:, None].to(tl.int64) * sot + (k_col + offs_e)[None, :] * sop,
                        mask=(rel < T - kb)[:, None] & e_ok[None, :], other=float("-inf"))
            ties += (k.to(ACC) == best).to(ACC)
        share = d_key / tl.where(ties > 0, ties, 1.0)
        for o in range(L_SEL):
            rel = first + o
            ok = owned & (rel < T - kb)
            if HAS_FRAME:
                ok = ok & (tl.load(FRAME + b * sf1 + sf0 + (kb + rel).to(tl.int64) * sf2, mask=ok, other=-1) == kb)
            at = rel[:, None].to(tl.int64)
            k = tl.load(OUT + ob_doc + at * sot + (k_col + offs_e)[None, :] * sop,
                        mask=(rel < T - kb)[:, None] & e_ok[None, :], other=float("-inf"))
            tl.store(DOUT + b * sdb + (kb + at) * sdt + (k_col + offs_e)[None, :] * sdp,
                     tl.where(k.to(ACC) == best, share, 0.0), mask=ok[:, None] & e_ok[None, :])


@triton.jit
def _keys_backward(kp, OUT, TGT, STATS, DOUT, FRAME, sob, sot, sop, stb, stk, str_, stj, sdb, sdt, sdp, sf0, sf1, sf2,
                   T, R, n_blocks, grad, sgb, sgk, sgr, scale, k_col, H_KV: tl.constexpr, HI: tl.constexpr,
                   HP: tl.constexpr, E: tl.constexpr, EP: tl.constexpr, L_SEL: tl.constexpr, LP: tl.constexpr,
                   BT: tl.constexpr, BKB: tl.constexpr, BN_KEY: tl.constexpr, CP: tl.constexpr,
                   PER_TOKEN: tl.constexpr, SCALE: tl.constexpr, ACC: tl.constexpr, UPCAST: tl.constexpr,
                   PREC: tl.constexpr, HAS_FRAME: tl.constexpr):
    """The backward's key program kp: d k of the tokens of BKB blocks, over every KV group and row that may read them.
    Without a frame: blocks kp' * BKB .. of batch row b. With one: the blocks whose first token lies in the key
    indices [p * BKB * l', (p + 1) * BKB * l') (at most BKB per document), of every document there, one at a time:
    every token belongs to one document's block and every block to the program holding its first token."""
    C: tl.constexpr = BKB * L_SEL
    n_ranges = tl.cdiv(T, C)  # = cdiv(n_blocks, BKB) without a frame
    p = kp % n_ranges
    b = (kp // n_ranges).to(tl.int64)
    ob = b * sob
    offs_e = tl.arange(0, EP)
    e_ok = offs_e < E
    if HAS_FRAME:
        lo = p * C
        offs_c = tl.arange(0, CP)
        tok_r = lo + offs_c
        in_r = (offs_c < C) & (tok_r < T)
        kb_tok = tl.load(FRAME + b * sf1 + sf0 + tok_r.to(tl.int64) * sf2, mask=in_r, other=0).to(tl.int32)
        todo = in_r
        while tl.max(todo.to(tl.int32), axis=0) > 0:  # the documents of the range, in order
            kb = tl.min(tl.where(todo, kb_tok, 2147483647), axis=0)
            todo = todo & (kb_tok != kb)
            j0 = (tl.maximum(lo - kb, 0) + L_SEL - 1) // L_SEL  # its first block starting in the range
            owned = kb + (j0 + tl.arange(0, BKB)) * L_SEL < lo + C  # [BKB]
            d_key = _block_key_grads(OUT, TGT, STATS, FRAME, ob, b, kb, j0, sot, sop, stb, stk, str_, stj, sf0, sf1,
                                     sf2, T, R, n_blocks, grad, sgb, sgk, sgr, scale, k_col, offs_e, e_ok, H_KV, HI,
                                     HP, E, EP, L_SEL, LP, BT, BKB, BN_KEY, PER_TOKEN, SCALE, ACC, UPCAST, PREC,
                                     HAS_FRAME)
            _write_key_grads(d_key, OUT, DOUT, FRAME, ob, b, kb, j0, owned, sot, sop, sdb, sdt, sdp, sf0, sf1, sf2, T,
                             k_col, offs_e, e_ok, L_SEL, LP, BKB, BN_KEY, PER_TOKEN, ACC, HAS_FRAME)
    else:
        kb = p * 0
        j0 = p * BKB
        d_key = _block_key_grads(OUT, TGT, STATS, FRAME, ob, b, kb, j0, sot, sop, stb, stk, str_, stj, sf0, sf1, sf2,
                                 T, R, n_blocks, grad, sgb, sgk, sgr, scale, k_col, offs_e, e_ok, H_KV, HI, HP, E, EP,
                                 L_SEL, LP, BT, BKB, BN_KEY, PER_TOKEN, SCALE, ACC, UPCAST, PREC, HAS_FRAME)
        _write_key_grads(d_key, OUT, DOUT, FRAME, ob, b, kb, j0, tl.full([BKB], True, tl.int1), sot, sop, sdb, sdt,
                         sdp, sf0, sf1, sf2, T, k_col, offs_e, e_ok, L_SEL, LP, BKB, BN_KEY, PER_TOKEN, ACC, HAS_FRAME)


@triton.jit(do_not_specialize=["T", "R"])
def _kl_bwd_kernel(
    OUT, TGT, STATS, GRAD, DOUT, FRAME, COUNT,
    sob, sot, sop, stb, stk, str_, stj, sdb, sdt, sdp, sgb, sgk, sgr, sf0, sf1, sf2,
    T, R, n_blocks, scale, n_row_programs,
    H_KV: tl.constexpr, HI: tl.constexpr, HP: tl.constexpr, E: tl.constexpr, EP: tl.constexpr,
    L_SEL: tl.constexpr, LP: tl.constexpr, BT: tl.constexpr, BJ: tl.constexpr, BN_ROW: tl.constexpr,
    BKB: tl.constexpr, BN_KEY: tl.constexpr, CP: tl.constexpr, PER_TOKEN: tl.constexpr, SCALE: tl.constexpr,
    ACC: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, HAS_FRAME: tl.constexpr,
):
    pid = tl.program_id(0)
    k_col = H_KV * HI * (E + 1)
    if HAS_FRAME:  # scale: the weight; the counted rows read on the device, as the forward's
        count = H_KV * tl.load(COUNT)
        scale = tl.where(count > 0, scale / tl.maximum(count, 1).to(ACC), 0.0)
    # GRAD: the terms' gradient [B, H_kv, R] (strides sgb, sgk, sgr; a sum's, expanded: 0, 0, 0)
    if pid < n_row_programs:  # ---- rows: d q and d w at the KL's rows, zeros between them
        _rows_backward(pid, OUT, TGT, STATS, DOUT, FRAME, sob, sot, sop, stb, stk, str_, stj, sdb, sdt, sdp, sf0, sf1,
                       sf2, T, R, n_blocks, GRAD, sgb, sgk, sgr, scale, k_col, H_KV, HI, HP, E, EP, L_SEL, LP, BT, BJ,
                       BN_ROW, PER_TOKEN, SCALE, ACC, UPCAST, PREC, HAS_FRAME)
    else:  # ---- keys: d k of every token
        _keys_backward(pid - n_row_programs, OUT, TGT, STATS, DOUT, FRAME, sob, sot, sop, stb, stk, str_, stj, sdb,
                       sdt, sdp, sf0, sf1, sf2, T, R, n_blocks, GRAD, sgb, sgk, sgr, scale, k_col, H_KV, HI, HP, E, EP,
                       L_SEL, LP, BT, BKB, BN_KEY, CP, PER_TOKEN, SCALE, ACC, UPCAST, PREC, HAS_FRAME)


def kernel_constexprs(dtype: torch.dtype, heads: int, index_dim: int, l_sel: int, per_token: bool,
                      lanes: int = TOKEN_LANES) -> dict:
    """The kernels' compile-time constants for these shapes (also used to compile them ahead of time); lanes: token
    lanes per chunk with PER_TOKEN."""
    hp, lp = triton.next_power_of_2(heads), triton.next_power_of_2(l_sel)
    f64, interpret = dtype == torch.float64, interpreter_active()
    bt = max(16 // hp, min(MAX_ROWS, ROWS // hp))  # tile rows HP * BT >= 16 for the dots
    bj = max(1, lanes // lp) if per_token else 16  # >= 16 dot columns (block keys, or token lanes)
    return dict(
        HI=heads, HP=hp, E=index_dim, EP=max(16, triton.next_power_of_2(index_dim)), L_SEL=l_sel, LP=lp, BT=bt,
        BJ=bj, BN_ROW=bj * lp if per_token else bj, PER_TOKEN=per_token, SCALE=1.0 / math.sqrt(index_dim),
        ACC=tl.float64 if f64 else tl.float32, UPCAST=interpret and dtype in (torch.bfloat16, torch.float16),
        PREC="ieee" if f64 or interpret else "tf32x3",
    )


def key_blocks(per_token: bool, l_sel: int) -> tuple[int, int]:
    """Blocks per key program and its gradient tile's rows: PER_TOKEN, BACKWARD_TOKEN_LANES // LP blocks, their token
    lanes; else KEY_BLOCKS block keys (the tile's rows are a dot's: >= 16)."""
    if per_token:
        bkb = max(1, BACKWARD_TOKEN_LANES // triton.next_power_of_2(l_sel))
        return bkb, bkb * triton.next_power_of_2(l_sel)
    return KEY_BLOCKS, KEY_BLOCKS


def valid_rows(T: int, R: int, l_sel: int) -> int:
    """KL rows with two or more candidate blocks: t_r = r*T//R >= 4*l' <=> r >= ceil(4*l'*R / T)."""
    return R - min(R, -(-4 * l_sel * R // T))


def _check(out, target, n_kv_heads, heads, index_dim, R, l_sel, frame=None):
    B, T, P = out.shape
    n_blocks = -(-T // l_sel)
    # with packed documents the target may count more blocks (the layer's document targets do): only the first
    # ceil(T / l') can hold a candidate
    blocks_ok = target.shape[3] == n_blocks if frame is None else target.shape[3] >= n_blocks
    if P != n_kv_heads * heads * (index_dim + 1) + index_dim or target.shape[:3] != (B, n_kv_heads, R) \
            or not blocks_ok or not 0 < R <= T:
        raise ValueError(f"indexer_kl: out {tuple(out.shape)} and target {tuple(target.shape)} do not match "
                         f"(H_kv={n_kv_heads}, h={heads}, e={index_dim}, R={R}, l'={l_sel})")
    if frame is not None and (frame.shape != (3, B, T) or frame.dtype != torch.long or frame.device != out.device):
        raise ValueError(f"indexer_kl: frame must be int64 [3, {B}, {T}] on {out.device}, got {frame.dtype} "
                         f"{tuple(frame.shape)} on {frame.device}")
    if out.device.type == "cpu" and not interpreter_active():
        raise RuntimeError("indexer_kl's kernels need a CUDA tensor, or TRITON_INTERPRET=1 set before triton is "
                           "imported")
    return B, T, target.shape[3]


def _target_constexprs(source, dtype: torch.dtype, l_sel: int) -> dict:
    """The fused target's constants (TARGET 0: given; 1: compressed, select_topk's; 2: dense, dense_mass's)."""
    none = dict(TARGET=0, T_G=1, T_GP=1, T_HD=16, T_DP=16, T_L=1, T_D=1, T_BT=1, T_BJ=1, T_SHIFT=0, T_SCALE=1.0,
                T_RUP=1, T_LP=1, T_UPCAST=False, T_HAS_LSE=False)
    if source is None:
        return none
    kind, q, _, lse, l, d = source
    G, hd = q.shape[2], q.shape[4]
    if kind == "compressed":
        m = select_topk.kernel_constexprs(q.dtype, G, hd, l, d, l_sel, 1)
        return {**none, "TARGET": 1, "T_G": G, "T_GP": m["GP"], "T_HD": hd, "T_DP": m["DP"], "T_L": l, "T_D": d,
                "T_BT": m["BT"], "T_BJ": m["BJ"], "T_SHIFT": m["SHIFT"], "T_SCALE": m["SCALE"], "T_RUP": m["RUP"],
                "T_UPCAST": m["UPCAST"], "T_HAS_LSE": lse is not None}
    m = dense_mass.kernel_constexprs(q.dtype, G, hd, l_sel)
    return {**none, "TARGET": 2, "T_G": G, "T_GP": m["GP"], "T_HD": hd, "T_DP": m["DP"], "T_BT": m["BT"],
            "T_BJ": m["BJ"], "T_SCALE": m["SCALE"], "T_LP": m["LP"], "T_UPCAST": m["UPCAST"]}


def _frame_args(frame, counted, out):
    """The frame (or a stand-in never read), its strides and the counted rows (a 0-dim int64 tensor on the device,
    impl/index_scores.counted_kl_rows: required with a frame)."""
    if frame is None:
        return out, (0, 0, 0), out
    if counted is None or counted.numel() != 1 or counted.device != out.device:
        raise ValueError("indexer_kl: packed documents need the counted KL rows as a one-element tensor on "
                         f"{out.device} (impl/index_scores.counted_kl_rows)")
    return frame, frame.stride(), counted


def indexer_kl_forward(out, target, n_kv_heads: int, heads: int, index_dim: int, R: int, l_sel: int, per_token: bool,
                       weight: float, source: tuple | None = None, frame: torch.Tensor | None = None,
                       counted: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (the loss's terms [B, H_kv, R], row statistics [B, H_kv, R, 2], the target) as impl/index_scores.kl_loss:
    one kernel. target [B, H_kv, R, N_b], or None with source: (kind, q [B, H_kv, G, T, hd], keys, lse, l, d), the
    target computed in the same launch, each program its rows' first (kind "compressed": keys the compressed keys
    [B, H_kv, N_c, hd], lse the compressed branch's [B, H_kv, G, T] or None, as select_topk.pooled_block_mass_rows;
    "dense": keys the selected branch's [B, H_kv, T, hd], as dense_mass.dense_block_mass_rows). frame [3, B, T]
    (packed documents): each row scores its own document's blocks, counted from its first token, against a target
    counted so (a source's read within the row's document), and the rows counted in the mean are read from `counted`
    (impl/index_scores.counted_kl_rows: the layers share it, computed once per batch)."""
    B, T, P = out.shape
    n_blocks = -(-T // l_sel)
    acc = torch.promote_types(out.dtype, torch.float32)
    if target is None:  # computed in the launch: ceil(T / l') blocks per row (a document's first ones with a frame)
        target = torch.empty(B, n_kv_heads, R, n_blocks, dtype=acc, device=out.device)
    _, _, n_blocks = _check(out, target, n_kv_heads, heads, index_dim, R, l_sel, frame)
    meta = kernel_constexprs(out.dtype, heads, index_dim, l_sel, per_token)
    count = B * n_kv_heads * valid_rows(T, R, l_sel)
    kl_rows = torch.empty(B, n_kv_heads, R, dtype=acc, device=out.device)
    stats = torch.empty(B, n_kv_heads, R, 2, dtype=acc, device=out.device)
    tq, ts, tl_, n_src = out, out, out, 0  # unread without a source
    q_strides, s_strides, l_strides = (0,) * 5, (0,) * 4, (0,) * 4
    if source is not None:
        _, tq, ts, lse, _, _ = source
        if ts.dtype != tq.dtype:
            ts = ts.to(tq.dtype)
        q_strides, s_strides, n_src = tq.stride(), ts.stride(), ts.shape[2]
        if lse is not None:
            tl_, l_strides = lse, lse.stride()
    f, f_strides, c = _frame_args(frame, counted, out)
    # scale: weight / the counted rows (a function of T, R and l'); with a frame the kernel reads them
    scale = weight if frame is not None else weight / count if count else 0.0
    grid = (triton.cdiv(R, meta["BT"]), B * n_kv_heads)
    _kl_fwd_kernel[grid](out, target, kl_rows, stats, tq, ts, tl_, f, c, *out.stride(), *target.stride(), *q_strides,
                         *s_strides, *l_strides, *f_strides, T, R, n_blocks, scale, n_src,
                         H_KV=n_kv_heads, **meta, **_target_constexprs(source, out.dtype, l_sel),
                         HAS_FRAME=frame is not None,
                         maxnreg=255)  # the fused target's tiles in registers (as select_topk's)
    return kl_rows, stats, target


def indexer_kl_backward(grad, out, target, stats, n_kv_heads: int, heads: int, index_dim: int, R: int, l_sel: int,
                        per_token: bool, weight: float, d_out: torch.Tensor | None = None,
                        frame: torch.Tensor | None = None, counted: torch.Tensor | None = None) -> torch.Tensor:
    """-> d out [B, T, P] as impl/index_scores.kl_loss_backward: one kernel, every element written once (into d_out
    when given, out's shape and dtype: the tests pass one filled with NaN). frame, counted: as the forward's."""
    B, T, n_blocks = _check(out, target, n_kv_heads, heads, index_dim, R, l_sel, frame)
    meta = kernel_constexprs(out.dtype, heads, index_dim, l_sel, per_token, BACKWARD_TOKEN_LANES)
    count = B * n_kv_heads * valid_rows(T, R, l_sel)
    d_out = torch.empty_like(out) if d_out is None else d_out
    bkb, bn_key = key_blocks(per_token, l_sel)
    n_rows = triton.cdiv(R, meta["BT"]) * B * n_kv_heads
    grid = (n_rows + triton.cdiv(T, bkb * l_sel) * B,)  # key programs: BKB blocks' worth of key indices each
    grad = grad.expand(B, n_kv_heads, R)  # the terms' gradient (a sum's: one value, stride 0)
    f, f_strides, c = _frame_args(frame, counted, out)
    scale = weight if frame is not None else weight / count if count else 0.0
    _kl_bwd_kernel[grid](out, target, stats, grad, d_out, f, c, *out.stride(), *target.stride(), *d_out.stride(),
                         *grad.stride(), *f_strides, T, R, n_blocks, scale, n_rows, H_KV=n_kv_heads, BKB=bkb,
                         BN_KEY=bn_key, CP=triton.next_power_of_2(bkb * l_sel), **meta, HAS_FRAME=frame is not None,
                         num_stages=1,
                         num_warps=8 if per_token else 4, maxnreg=255)  # its tiles in registers (as select_topk's)
    return d_out
