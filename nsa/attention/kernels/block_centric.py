"""Block-centric selected attention for small GQA groups: forward and dQ (Flash Sparse Attention's loop
order, arXiv 2508.18224). Kernels only: pure functions of tensors and constexprs; the host wrappers that
build the index, allocate the state and choose between these and the query-centric kernels live in
nsa/attention/kernels/selected_attention.py (its docstring has the contract and the memory bounds).

Index (`inverted_index(..., by_slot=True)`): the (query, slot) entries of one selection slot s, sorted by
(batch * H_kv + KV head, block, query position) and cut into tiles of at most Q_TILE queries; slot s's
tiles are TILE_* [s * n_tiles, (s + 1) * n_tiles) (spare tiles: count 0). One launch covers a range of
slots, grid (n_tiles, slots): program (i, p) takes tile i of slot slot0 + p, loads its block's K/V once
([BS, DP] tiles) and walks the tile's rows, the (query, head) pairs, BM at a time (no padding of the
group to 16). Each row meets one block per slot, so a program writes that block's share of the row as a
partial of slot p: the attention over the block alone (normalized) and its log-sum-exp (forward), or the
block's dQ term (dQ). No row is written twice, no atomics. `slot_merge_kernel` / `slot_sum_kernel` then
combine a row's partials in slot order (and the running result of earlier slot ranges): deterministic.

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
def _fwd_partial(Q, OP, LSEP, part, b, h, bh, g, t, r_ok, vis, kb, vb, offs_d, d_ok,
                 sqb, sqh, sqg, sqt, sqd, Tq, scale,
                 G: tl.constexpr, HD: tl.constexpr, ACC: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr):
    """One row step of block_fwd_kernel: the (query t, head g) rows r_ok [BM] against the block's keys
    kb, vb [BS, DP] alone (vis [BM, BS]: which keys each row sees). Writes the rows' partial of slot
    `part` (int64 offset part * R): the block's attention output, normalized, to OP [.., R, hd] (OP's dtype)
    and its log-sum-exp to LSEP [.., R] (-inf where the row sees none of the block's keys, output 0)."""
    rd_ok = r_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * sqb + h * sqh + g[:, None] * sqg + t[:, None] * sqt + offs_d[None, :] * sqd,
                mask=rd_ok, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    row = part + (bh * G + g) * Tq + t  # the partial's row: [B, H_kv, G, Tq] order within slot part
    sc = tl.dot(q, tl.trans(kb), input_precision=PREC, out_dtype=ACC) * scale
    sc = tl.where(vis, sc, float("-inf"))  # masked scores are -inf, never a finite sentinel
    m = tl.max(sc, axis=1)
    has = m > float("-inf")
    m_safe = tl.where(has, m, 0.0)  # a row that sees nothing: p = exp(-inf) = 0, never NaN
    p = tl.exp(sc - m_safe[:, None])
    den = tl.sum(p, axis=1)
    den_safe = tl.where(has, den, 1.0)
    pv = tl.dot(p.to(Q.dtype.element_ty).to(vb.dtype), vb, input_precision=PREC, out_dtype=ACC)
    o = pv * (1.0 / den_safe)[:, None]
    tl.store(OP + row[:, None] * HD + offs_d[None, :], o.to(OP.dtype.element_ty), mask=rd_ok)
    tl.store(LSEP + row, tl.where(has, m_safe + tl.log(den_safe), float("-inf")), mask=r_ok)


@triton.jit
def _dq_step(Q, DO, LSE, DELTA, DQP, part, b, h, bh, g, t, r_ok, vis, kb, vb, offs_d, d_ok,
             sqb, sqh, sqg, sqt, sqd, sdb, sdh, sdg, sdt, sdd, Tq, scale,
             G: tl.constexpr, HD: tl.constexpr, ACC: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr):
    """One row step of block_dq_kernel: the rows' term scale * dS K of this block, written as their partial
    of slot `part` (int64 offset part * R) to DQP [.., R, hd]."""
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
    tl.store(DQP + (part + row)[:, None] * HD + offs_d[None, :], dq * scale, mask=rd_ok)


@triton.jit(do_not_specialize=["slot0"])
def block_fwd_kernel(
    Q, K, V, QUERIES, OFFS, RUN_END, TILE_SEG, TILE_START, TILE_COUNT, OP, LSEP, FRAME,
    sqb, sqh, sqg, sqt, sqd,
    skb, skh, skt, skd,
    svb, svh, svt, svd,
    sf0, sf1, sf2,
    Tq, Tk, q_start, scale, n_blocks, slot0, n_tiles, R,
    H_KV: tl.constexpr, G: tl.constexpr, L_SEL: tl.constexpr, HD: tl.constexpr,
    BM: tl.constexpr, BS: tl.constexpr, DP: tl.constexpr,
    ACC: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, HAS_FRAME: tl.constexpr,
):
    """Program (i, p): tile i of slot slot0 + p. Each of the tile's (query, head) rows gets its partial
    of slot p (R = B * H_kv * G * Tq rows per slot): the attention over this block alone, normalized, in
    OP [slots, R, hd], and its log-sum-exp in LSEP [slots, R]; slot_merge_kernel combines them.
    With a frame (HAS_FRAME) the tile's entries are blocks starting in aligned block J = seg % n_blocks
    at J*l' + OFFS[entry] (sorted by offset, then query): the program walks the runs of equal offsets
    (one document's block each, usually one per tile; a run ends at RUN_END[its first entry]), loading
    each run's K/V once."""
    part = tl.program_id(1).to(tl.int64)
    tile = (slot0 + part) * n_tiles + tl.program_id(0)
    part = part * R
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
                    _fwd_partial(Q, OP, LSEP, part, b, h, bh, r % G, t, r_ok, vis, kb, vb, offs_d, d_ok,
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
                _fwd_partial(Q, OP, LSEP, part, b, h, bh, r % G, t, r_ok, vis, kb, vb, offs_d, d_ok,
                             sqb, sqh, sqg, sqt, sqd, Tq, scale, G, HD, ACC, UPCAST, PREC)


@triton.jit(do_not_specialize=["slot0"])
def block_dq_kernel(
    Q, K, V, DO, LSE, DELTA, QUERIES, OFFS, RUN_END, TILE_SEG, TILE_START, TILE_COUNT, DQP, FRAME,
    sqb, sqh, sqg, sqt, sqd,
    skb, skh, skt, skd,
    svb, svh, svt, svd,
    sdb, sdh, sdg, sdt, sdd,
    sf0, sf1, sf2,
    Tq, Tk, q_start, scale, n_blocks, slot0, n_tiles, R,
    H_KV: tl.constexpr, G: tl.constexpr, L_SEL: tl.constexpr, HD: tl.constexpr,
    BM: tl.constexpr, BS: tl.constexpr, DP: tl.constexpr,
    ACC: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, HAS_FRAME: tl.constexpr,
):
    """Program (i, p): tile i of slot slot0 + p. Each of its rows' term of dQ = scale * sum_s dS_s K_s
    (dS = P * (dO V^T - delta), P = exp(S - LSE)) for this block, as its partial of slot p in DQP
    [slots, R, hd]; slot_sum_kernel adds them up. Frames: as block_fwd_kernel."""
    part = tl.program_id(1).to(tl.int64)
    tile = (slot0 + part) * n_tiles + tl.program_id(0)
    part = part * R
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
                    _dq_step(Q, DO, LSE, DELTA, DQP, part, b, h, bh, r % G, t, r_ok, vis, kb, vb, offs_d, d_ok,
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
                _dq_step(Q, DO, LSE, DELTA, DQP, part, b, h, bh, r % G, t, r_ok, vis, kb, vb, offs_d, d_ok,
                         sqb, sqh, sqg, sqt, sqd, sdb, sdh, sdg, sdt, sdd, Tq, scale, G, HD, ACC, UPCAST, PREC)


@triton.jit
def _home_rows(HOME, rows, Tq, n, G: tl.constexpr):
    """[BR] pointers to the index entries of rows (bh, g, t) of the [B, H_kv, G, Tq] order: HOME [BH, Tq, n], the
    index's key of each (query, slot) entry (-1: an empty slot, which no program wrote a partial for); slot s of a
    row is at its pointer + s."""
    return HOME + ((rows // (G * Tq)) * Tq + rows % Tq) * n


@triton.jit(do_not_specialize=["slot0", "n_slots"])
def slot_merge_kernel(
    OP, LSEP, HOME, O_IN, LSE_IN, O, LSE, R, Tq, n, slot0, n_slots,
    G: tl.constexpr, HD: tl.constexpr, BR: tl.constexpr, DP: tl.constexpr, ACC: tl.constexpr,
    HAS_PREV: tl.constexpr,
):
    """Rows pid*BR .. of the output: the partials of slots slot0 .. slot0 + n_slots - 1 (OP [n_slots, R, hd]
    normalized, in the inputs' dtype; LSEP [n_slots, R]; only valid slots read) merged, in slot order, with the result so far
    (HAS_PREV: O_IN, LSE_IN, the merge of the earlier slots) into O [R, hd] (its dtype) and LSE [R]:
    o = sum_s exp(lse_s - lse) o_s, lse = log sum_s exp(lse_s). A row with nothing visible: o 0, lse -inf."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    r_ok = rows < R
    home = _home_rows(HOME, rows, Tq, n, G) + slot0
    offs_d = tl.arange(0, DP)
    rd_ok = r_ok[:, None] & (offs_d < HD)[None, :]
    mx = tl.full((BR,), float("-inf"), ACC)
    if HAS_PREV:
        lse_prev = tl.load(LSE_IN + rows, mask=r_ok, other=float("-inf"))
        mx = lse_prev
    for p in range(n_slots):  # pass 1: the largest log-sum-exp of each row
        ok = r_ok & (tl.load(home + p, mask=r_ok, other=-1) >= 0)  # the row has a block in slot slot0 + p
        mx = tl.maximum(mx, tl.load(LSEP + p * R + rows, mask=ok, other=float("-inf")))
    has = mx > float("-inf")
    mx_safe = tl.where(has, mx, 0.0)
    den = tl.zeros((BR,), dtype=ACC)
    acc = tl.zeros((BR, DP), dtype=ACC)
    if HAS_PREV:
        w = tl.where(has, tl.exp(lse_prev - mx_safe), 0.0)  # exp(-inf) = 0: nothing before
        den += w
        acc += w[:, None] * tl.load(O_IN + rows[:, None] * HD + offs_d[None, :], mask=rd_ok, other=0.0)
    for p in range(n_slots):  # pass 2, in slot order: weights and the weighted outputs
        ok = r_ok & (tl.load(home + p, mask=r_ok, other=-1) >= 0)  # the row has a block in slot slot0 + p
        w = tl.where(ok & has, tl.exp(tl.load(LSEP + p * R + rows, mask=ok, other=float("-inf")) - mx_safe), 0.0)
        den += w
        o_p = tl.load(OP + (p * R + rows)[:, None] * HD + offs_d[None, :], mask=ok[:, None] & rd_ok, other=0.0)
        acc += w[:, None] * o_p.to(ACC)
    den_safe = tl.where(has, den, 1.0)
    tl.store(O + rows[:, None] * HD + offs_d[None, :], (acc / den_safe[:, None]).to(O.dtype.element_ty), mask=rd_ok)
    tl.store(LSE + rows, tl.where(has, mx_safe + tl.log(den_safe), float("-inf")), mask=r_ok)


@triton.jit(do_not_specialize=["slot0", "n_slots"])
def slot_sum_kernel(
    DQP, HOME, DQ_IN, DQ, R, Tq, n, slot0, n_slots,
    G: tl.constexpr, HD: tl.constexpr, BR: tl.constexpr, DP: tl.constexpr, ACC: tl.constexpr,
    HAS_PREV: tl.constexpr,
):
    """Rows pid*BR .. of dQ: the partials of slots slot0 .. slot0 + n_slots - 1 (DQP [n_slots, R, hd]; only
    valid slots read) added in slot order to the sum so far (HAS_PREV: DQ_IN), into DQ [R, hd] (its dtype)."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    r_ok = rows < R
    home = _home_rows(HOME, rows, Tq, n, G) + slot0
    offs_d = tl.arange(0, DP)
    rd_ok = r_ok[:, None] & (offs_d < HD)[None, :]
    acc = tl.zeros((BR, DP), dtype=ACC)
    if HAS_PREV:
        acc += tl.load(DQ_IN + rows[:, None] * HD + offs_d[None, :], mask=rd_ok, other=0.0)
    for p in range(n_slots):
        ok = r_ok & (tl.load(home + p, mask=r_ok, other=-1) >= 0)  # the row has a block in slot slot0 + p
        acc += tl.load(DQP + (p * R + rows)[:, None] * HD + offs_d[None, :], mask=ok[:, None] & rd_ok, other=0.0)
    tl.store(DQ + rows[:, None] * HD + offs_d[None, :], acc.to(DQ.dtype.element_ty), mask=rd_ok)
