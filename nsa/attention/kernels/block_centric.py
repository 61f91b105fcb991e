"""Block-centric selected attention for small GQA groups: forward and dQ (Flash Sparse Attention's loop
order, arXiv 2508.18224). Kernels only: pure functions of tensors and constexprs; the host wrappers that
build the index, allocate the state and choose between these and the query-centric kernels live in
nsa/attention/kernels/selected_attention.py (its docstring has the contract and the memory bounds).

Index (`inverted_index(..., by_slot=True)`): the (query, slot) entries of one selection slot s, sorted by
(batch * H_kv + KV head, block, query position) and cut into tiles of at most Q_TILE queries; slot s's
tiles are TILE_* [s * n_tiles, (s + 1) * n_tiles) (spare tiles: count 0). One launch per slot, grid
(n_tiles,): a program loads its block's K/V once ([BS, DP] tiles) and walks the tile's rows, the
(query, head) pairs, BM at a time (no padding of the group to 16). Every (query, head) row appears in at
most one program of a launch (a query has one block per slot), so the per-row state in global memory is
read, updated and written back without atomics, and launches run in slot order: deterministic.

Document frames (HAS_FRAME; selected_attention.py's docstring): a tile's entries are the blocks whose
first key lies in one aligned block, sorted by that key's offset in it; each run of equal offsets (one
document's block) is walked with its own K/V load, its rows' visibility read from the frame.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_block(K, V, b, h, first, offs_s, offs_d, d_ok, skb, skh, skt, skd, svb, svh, svt, svd, Tk,
                L_SEL: tl.constexpr, UPCAST: tl.constexpr):
    """Keys and values first .. first + l' - 1 (index < Tk) as [BS, DP] tiles, and that mask [BS]."""
    pos_k = first + offs_s
    k_ok = (offs_s < L_SEL) & (pos_k < Tk)
    kd_ok = k_ok[:, None] & d_ok[None, :]
    kb = tl.load(K + b * skb + h * skh + pos_k[:, None] * skt + offs_d[None, :] * skd, mask=kd_ok, other=0.0)
    vb = tl.load(V + b * svb + h * svh + pos_k[:, None] * svt + offs_d[None, :] * svd, mask=kd_ok, other=0.0)
    if UPCAST:  # the interpreter has no bf16/fp16 matmul
        kb = kb.to(tl.float32)
        vb = vb.to(tl.float32)
    return kb, vb, k_ok


@triton.jit
def _run_rows(QUERIES, FRAME, start, r0, r_end, cur, j, b, offs_m, sf0, sf1, sf2,
              G: tl.constexpr, L_SEL: tl.constexpr):
    """Frame mode: the rows r0 .. r0 + BM - 1 (< r_end) of a run of a tile's entries (entry start + r // G,
    block start J*l' + cur, J = j), their query indices, and how far into the block each row sees
    (p - j_doc*l', j_doc the row's document-relative block)."""
    r = r0 + offs_m
    r_ok = r < r_end
    t = tl.load(QUERIES + start + r // G, mask=r_ok, other=0).to(tl.int64)
    f = FRAME + b * sf1 + t * sf2
    # positions and offsets in int32 (fewer registers); block start - k_base = the row's j_doc * l'
    rel = (j * L_SEL + cur).to(tl.int32) - tl.load(f + sf0, mask=r_ok, other=0).to(tl.int32)
    return r, r_ok, t, tl.load(f, mask=r_ok, other=0).to(tl.int32) - rel


@triton.jit
def _fwd_step(Q, OACC, M, DEN, LSE, b, h, bh, g, t, r_ok, vis, kb, vb, offs_d, d_ok,
              sqb, sqh, sqg, sqt, sqd, Tq, scale,
              G: tl.constexpr, HD: tl.constexpr, ACC: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr):
    """One row step of block_fwd_kernel: the (query t, head g) rows r_ok [BM] against the block's keys
    kb, vb [BS, DP] (vis [BM, BS]: which keys each row sees) update their state in global memory."""
    rd_ok = r_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * sqb + h * sqh + g[:, None] * sqg + t[:, None] * sqt + offs_d[None, :] * sqd,
                mask=rd_ok, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    row = (bh * G + g) * Tq + t  # [B, H_kv, G, Tq] row of the state
    m_old = tl.load(M + row, mask=r_ok, other=-1.0e30)
    den_old = tl.load(DEN + row, mask=r_ok, other=0.0)
    sc = tl.dot(q, tl.trans(kb), input_precision=PREC, out_dtype=ACC) * scale
    sc = tl.where(vis, sc, float("-inf"))  # masked scores are -inf, never a finite sentinel
    m_new = tl.maximum(m_old, tl.max(sc, axis=1))  # m_old >= -1e30: finite, so alpha is never NaN
    alpha = tl.exp(m_old - m_new)
    p = tl.exp(sc - m_new[:, None])
    den_new = den_old * alpha + tl.sum(p, axis=1)
    pv = tl.dot(p.to(Q.dtype.element_ty).to(vb.dtype), vb, input_precision=PREC, out_dtype=ACC)
    has = den_new > 0
    den_safe = tl.where(has, den_new, 1.0)
    o_ptr = OACC + row[:, None] * HD + offs_d[None, :]
    o_old = tl.load(o_ptr, mask=rd_ok, other=0.0)
    # rescale exactly 1 when the block adds nothing (all its keys after the query)
    o_new = o_old * ((den_old * alpha) / den_safe)[:, None] + pv * (1.0 / den_safe)[:, None]
    tl.store(o_ptr, o_new, mask=rd_ok)
    tl.store(M + row, m_new, mask=r_ok)
    tl.store(DEN + row, den_new, mask=r_ok)
    tl.store(LSE + row, tl.where(has, m_new + tl.log(den_safe), float("-inf")), mask=r_ok)


@triton.jit
def _dq_step(Q, DO, LSE, DELTA, DQACC, b, h, bh, g, t, r_ok, vis, kb, vb, offs_d, d_ok,
             sqb, sqh, sqg, sqt, sqd, sdb, sdh, sdg, sdt, sdd, Tq, scale,
             G: tl.constexpr, HD: tl.constexpr, ACC: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr):
    """One row step of block_dq_kernel: adds the rows' term scale * dS K of this block to DQACC."""
    rd_ok = r_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * sqb + h * sqh + g[:, None] * sqg + t[:, None] * sqt + offs_d[None, :] * sqd,
                mask=rd_ok, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + g[:, None] * sdg + t[:, None] * sdt + offs_d[None, :] * sdd,
                 mask=rd_ok, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    row = (bh * G + g) * Tq + t
    lse = tl.load(LSE + row, mask=r_ok, other=0.0)
    delta = tl.load(DELTA + row, mask=r_ok, other=0.0)
    dp = tl.dot(do, tl.trans(vb), input_precision=PREC, out_dtype=ACC) - delta[:, None]
    sc = tl.dot(q, tl.trans(kb), input_precision=PREC, out_dtype=ACC) * scale
    ds = tl.where(vis, tl.exp(sc - lse[:, None]), 0.0) * dp  # P recomputed from the final LSE
    dq = tl.dot(ds.to(Q.dtype.element_ty).to(kb.dtype), kb, input_precision=PREC, out_dtype=ACC)
    dq_ptr = DQACC + row[:, None] * HD + offs_d[None, :]
    tl.store(dq_ptr, tl.load(dq_ptr, mask=rd_ok, other=0.0) + dq * scale, mask=rd_ok)


@triton.jit(do_not_specialize=["slot"])
def block_fwd_kernel(
    Q, K, V, QUERIES, OFFS, RUN_END, TILE_SEG, TILE_START, TILE_COUNT, OACC, M, DEN, LSE, FRAME,
    sqb, sqh, sqg, sqt, sqd,
    skb, skh, skt, skd,
    svb, svh, svt, svd,
    sf0, sf1, sf2,
    Tq, Tk, q_start, scale, n_blocks, slot, n_tiles,
    H_KV: tl.constexpr, G: tl.constexpr, L_SEL: tl.constexpr, HD: tl.constexpr,
    BM: tl.constexpr, BS: tl.constexpr, DP: tl.constexpr,
    ACC: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, HAS_FRAME: tl.constexpr,
):
    """One slot's step of an online softmax kept per (query, head) row in global memory: running max M,
    denominator DEN, the output OACC [B, H_kv, G, Tq, hd] kept normalized (OACC = numerator / DEN), and
    LSE = M + log(DEN) (-inf while DEN = 0). Initial state: M = -1e30, DEN = 0, OACC = 0, LSE = -inf.
    With a frame (HAS_FRAME) the tile's entries are blocks starting in aligned block J = seg % n_blocks
    at J*l' + OFFS[entry] (sorted by offset, then query): the program walks the runs of equal offsets
    (one document's block each, usually one per tile; a run ends at RUN_END[its first entry]), loading
    each run's K/V once."""
    tile = slot.to(tl.int64) * n_tiles + tl.program_id(0)
    count = tl.load(TILE_COUNT + tile).to(tl.int64)  # queries in this tile (0: spare, nothing to do)
    if count > 0:
        seg = tl.load(TILE_SEG + tile).to(tl.int64)  # (batch * H_kv + head) * n_blocks + block
        start = tl.load(TILE_START + tile).to(tl.int64)  # first entry of this tile in QUERIES
        bh = seg // n_blocks
        j = seg % n_blocks
        b = bh // H_KV
        h = bh % H_KV
        offs_m = tl.arange(0, BM)
        offs_s = tl.arange(0, BS)
        offs_d = tl.arange(0, DP)
        d_ok = offs_d < HD
        if HAS_FRAME:
            e0 = count * 0
            while e0 < count:  # one run (one document's block) per iteration: entries sorted by offset
                cur = tl.load(OFFS + start + e0)  # the run's block start - J*l'
                e1 = tl.minimum(tl.load(RUN_END + start + e0) - start, count)  # the run's entries: e0 .. e1-1
                kb, vb, k_ok = _load_block(K, V, b, h, j * L_SEL + cur, offs_s, offs_d, d_ok,
                                           skb, skh, skt, skd, svb, svh, svt, svd, Tk, L_SEL, UPCAST)
                for r0 in range(e0 * G, e1 * G, BM):
                    r, r_ok, t, reach = _run_rows(QUERIES, FRAME, start, r0, e1 * G, cur, j, b, offs_m,
                                                  sf0, sf1, sf2, G, L_SEL)
                    vis = r_ok[:, None] & k_ok[None, :] & (offs_s[None, :] <= reach[:, None])  # [BM, BS]
                    _fwd_step(Q, OACC, M, DEN, LSE, b, h, bh, r % G, t, r_ok, vis, kb, vb, offs_d, d_ok,
                              sqb, sqh, sqg, sqt, sqd, Tq, scale, G, HD, ACC, UPCAST, PREC)
                e0 = e1
        else:
            pos_k = j * L_SEL + offs_s
            kb, vb, k_ok = _load_block(K, V, b, h, j * L_SEL, offs_s, offs_d, d_ok,
                                       skb, skh, skt, skd, svb, svh, svt, svd, Tk, L_SEL, UPCAST)
            for r0 in range(0, count * G, BM):  # rows are (query, head) pairs
                r = r0 + offs_m
                r_ok = r < count * G
                t = tl.load(QUERIES + start + r // G, mask=r_ok, other=0).to(tl.int64)
                vis = r_ok[:, None] & k_ok[None, :] & (pos_k[None, :] <= (q_start + t)[:, None])  # [BM, BS]
                _fwd_step(Q, OACC, M, DEN, LSE, b, h, bh, r % G, t, r_ok, vis, kb, vb, offs_d, d_ok,
                          sqb, sqh, sqg, sqt, sqd, Tq, scale, G, HD, ACC, UPCAST, PREC)


@triton.jit(do_not_specialize=["slot"])
def block_dq_kernel(
    Q, K, V, DO, LSE, DELTA, QUERIES, OFFS, RUN_END, TILE_SEG, TILE_START, TILE_COUNT, DQACC, FRAME,
    sqb, sqh, sqg, sqt, sqd,
    skb, skh, skt, skd,
    svb, svh, svt, svd,
    sdb, sdh, sdg, sdt, sdd,
    sf0, sf1, sf2,
    Tq, Tk, q_start, scale, n_blocks, slot, n_tiles,
    H_KV: tl.constexpr, G: tl.constexpr, L_SEL: tl.constexpr, HD: tl.constexpr,
    BM: tl.constexpr, BS: tl.constexpr, DP: tl.constexpr,
    ACC: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, HAS_FRAME: tl.constexpr,
):
    """One slot's term of dQ = scale * sum_s dS_s K_s, dS = P * (dO V^T - delta), P = exp(S - LSE),
    added to DQACC [B, H_kv, G, Tq, hd] (zeros before slot 0). Frames: as block_fwd_kernel."""
    tile = slot.to(tl.int64) * n_tiles + tl.program_id(0)
    count = tl.load(TILE_COUNT + tile).to(tl.int64)
    if count > 0:
        seg = tl.load(TILE_SEG + tile).to(tl.int64)
        start = tl.load(TILE_START + tile).to(tl.int64)
        bh = seg // n_blocks
        j = seg % n_blocks
        b = bh // H_KV
        h = bh % H_KV
        offs_m = tl.arange(0, BM)
        offs_s = tl.arange(0, BS)
        offs_d = tl.arange(0, DP)
        d_ok = offs_d < HD
        if HAS_FRAME:
            e0 = count * 0
            while e0 < count:  # as block_fwd_kernel
                cur = tl.load(OFFS + start + e0)
                e1 = tl.minimum(tl.load(RUN_END + start + e0) - start, count)
                kb, vb, k_ok = _load_block(K, V, b, h, j * L_SEL + cur, offs_s, offs_d, d_ok,
                                           skb, skh, skt, skd, svb, svh, svt, svd, Tk, L_SEL, UPCAST)
                for r0 in range(e0 * G, e1 * G, BM):
                    r, r_ok, t, reach = _run_rows(QUERIES, FRAME, start, r0, e1 * G, cur, j, b, offs_m,
                                                  sf0, sf1, sf2, G, L_SEL)
                    vis = r_ok[:, None] & k_ok[None, :] & (offs_s[None, :] <= reach[:, None])
                    _dq_step(Q, DO, LSE, DELTA, DQACC, b, h, bh, r % G, t, r_ok, vis, kb, vb, offs_d, d_ok,
                             sqb, sqh, sqg, sqt, sqd, sdb, sdh, sdg, sdt, sdd, Tq, scale, G, HD, ACC, UPCAST, PREC)
                e0 = e1
        else:
            pos_k = j * L_SEL + offs_s
            kb, vb, k_ok = _load_block(K, V, b, h, j * L_SEL, offs_s, offs_d, d_ok,
                                       skb, skh, skt, skd, svb, svh, svt, svd, Tk, L_SEL, UPCAST)
            for r0 in range(0, count * G, BM):
                r = r0 + offs_m
                r_ok = r < count * G
                t = tl.load(QUERIES + start + r // G, mask=r_ok, other=0).to(tl.int64)
                vis = r_ok[:, None] & k_ok[None, :] & (pos_k[None, :] <= (q_start + t)[:, None])
                _dq_step(Q, DO, LSE, DELTA, DQACC, b, h, bh, r % G, t, r_ok, vis, kb, vb, offs_d, d_ok,
                         sqb, sqh, sqg, sqt, sqd, sdb, sdh, sdg, sdt, sdd, Tq, scale, G, HD, ACC, UPCAST, PREC)
