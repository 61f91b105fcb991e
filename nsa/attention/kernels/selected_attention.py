"""NSA selected attention as Triton kernels (paper §3.4 design), forward and backward.

Same contract as `nsa.attention.ops.selected_attention`: queries q [B, H_kv, G, Tq, hd] at
positions q_start .., keys/values k, v [B, H_kv, Tk, hd] at positions 0 .. Tk-1, block_idx
[B, H_kv, Tq, n] (selected blocks of l' keys, -1 = empty slot; a GQA group shares them). Query p reads
the keys of its blocks at positions <= p (the current block is partially visible); a block index must
not repeat within a row (select_blocks guarantees it; a repeat would count its keys twice).

Kernels (grid, tiling). Forward and dQ take one of two paths (`use_block_centric`): query-centric
for G >= 16 (BLOCK_CENTRIC_BELOW), block-centric below, where a query-centric program would pad the
group to 16 MMA rows (M7C, G = 6: 62.5% of the rows compute zeros, and M = 16 keeps sm_90 on mma.sync).
SELECTION_PATH ("auto" | "block" | "query", read at call time) forces either.
  query-centric forward `_fwd_kernel`, grid (Tq, B*H_kv): one program loads the G query heads of one
           position as a [GP, DP] tile (GP = G padded to a power of two >= 16, DP = hd padded to a power
           of two >= 16; padded rows/columns are masked loads of 0 and are never stored), then walks the
           n selected blocks, loading each block's keys/values once for the whole group as [BS, DP]
           tiles (BS = l' padded likewise), masking keys after p, and keeps an online softmax
           (running max, denominator, numerator). Writes O and the log-sum-exp LSE [B, H_kv, G, Tq].
  query-centric dQ `_dq_kernel`, grid (Tq, B*H_kv): like the forward; recomputes P = exp(S - LSE) per
           block and accumulates dQ in registers.
  block-centric forward / dQ (Flash Sparse Attention's loop order, arXiv 2508.18224;
           nsa/attention/kernels/block_centric.py): a by-slot inverted index (`inverted_index(...,
           by_slot=True)`: the (query, slot s) entries sorted by (s, batch * H_kv + head, block, query),
           tiles of at most Q_TILE queries, a fixed number of tiles per slot), then one launch for all
           slots, grid (tiles per slot, n). A program loads its block's K/V once and walks the (query,
           head) rows that picked the block, BM at a time (no group padding). A query has one block per
           slot, so each program writes its rows' partial of its slot, and no row's partial is written
           twice: no atomics. `block_fwd_kernel` writes the attention over the one block, normalized
           ([n, R, hd] in q's dtype, R = B*H_kv*G*Tq rows), and its log-sum-exp (fp32 [n, R]);
           `slot_merge_kernel` combines a row's n partials in slot order (o = sum_s exp(lse_s - lse) o_s)
           into O and LSE. `block_dq_kernel` writes slot s's term scale * dS_s K_s (fp32 [n, R, hd]);
           `slot_sum_kernel` adds them in slot order into dQ. Empty slots (-1) are never written and never
           read (the merge kernels read the index). Deterministic. Launches per call: 2 forward, 2 for dQ
           (+ torch ops for the index), whatever Tq and n; no host sync. Until 2026-11-28 these were n
           launches, one per slot, each reading and writing an online softmax's row state: 16 launches
           forward and 16 for dQ at M7C, 4-6 ms of host time per direction at 8k on an H200, and each
           launch 1/n of the work (fewer programs than a wave at short T).
           Memory: the partials, transient: forward n * R * (hd * 2 + 4) B in bf16 (outputs in q's dtype:
           the merge is a convex combination of them, no cancellation), dQ n * R * hd * 4 B (fp32 terms,
           which may cancel); M7C, n = 16: 198 / 384 MiB at 2k x batch 4 and at 8k x batch 1, 1.6 / 3 GiB
           at 64k. Above PARTIAL_BYTES (1 GiB) the slots are split across launch pairs (M7C 64k: 2 / 4),
           each merged into the result of the earlier ones (fp32 [R, hd] kept between them for 16-bit
           outputs). Traffic: each (row, slot) writes and the merge reads 2 * hd + 4 B forward (bf16) and
           4 * hd B for dQ, at most what the per-slot state update read and wrote. The
           index: ~80 MiB transient at M7C 64k (int64 sort keys and order over B*H_kv*T*n = 2M entries,
           int32 queries 8 MiB, 3 x 64K tile ints). K/V are read once per (slot, block, tile) instead of
           once per (query, block) as in the query-centric path (n * l' * hd * 2 * 2 B = 256 KiB per
           (query, KV head) in bf16).
  backward delta = rowsum(dO * O) (torch), the dQ path above, then
           `_dkv_kernel`, grid (tiles, BS // BK): block-centric over the block-major inverted index
           ("which queries selected block j", built with torch sort + counts, no host sync). The
           queries of each (batch, KV head, block) are cut into tiles of at most `kv_tile` queries; a
           program loads BK keys of its block (all BS, or BS split for fp32 / large head dims) and their
           values once, walks its queries in row tiles of BM (query, head) pairs (no group padding),
           recomputes P and dS and accumulates dK, dV in registers, then writes one partial per tile;
           `_dkv_reduce_kernel`, grid (B*H_kv*blocks,), sums a block's partials in a fixed order.
           Deterministic (no atomics); the tiles bound the serial work of a program even for block 0,
           which every query selects. Partials at M7C 64k: 6,144 tiles x 2 x 64 x 64 fp32 = 192 MiB.
Documents (`frame` [3, B, Tq] int64: q_pos, k_base, c_base; nsa/attention/documents.py): query (b, t) sits
at position p = q_pos of a document whose first key is k_base; its (document-relative) block j covers
keys k_base + j*l' + r, r < l', visible iff j*l' + r <= p. Each kernel takes a HAS_FRAME variant (same
launches, no host sync, no atomics):
  query-centric fwd / dQ: the program reads its query's p and k_base;
  block-centric fwd / dQ and dK/dV: blocks no longer sit at multiples of l' in the keys, and two
           documents' "block j" are different keys, so the indexes key each (query, block) pair by the
           aligned block J = s // l' of its real first key s = k_base + j*l' and sort by the offset
           s - J*l' (then query) within it: the segment count and the static tile bounds stay those of
           the no-frame index. A run of equal offsets in a tile is one document's block (documents are
           disjoint, so a first key names one document); a program walks its tile's runs (ends from the
           index, `inverted_index(sub=...)`), loading each run's K/V once (one run per tile but at
           document boundaries);
  dK/dV partials: a run's keys span aligned blocks J and J+1, so a tile's partial is [2l', hd] (zeroed,
           twice the no-frame memory); each run stores only the rows its queries see (disjoint across
           documents, hence across runs and key-chunk programs: no overlap, no atomics), and
           `_dkv_reduce_kernel` sums aligned block j from the tiles of j (rows 0 .. l'-1) and j-1 (rows
           l' .. 2l'-1), in a fixed order.
Tile sizes, warps and pipeline stages per kernel, dtype and head dim: `tile_config` (pure; its
`shared_bytes` is an upper bound of the shared memory, so a config can be refused before any GPU sees
it: `shared_memory_estimate`).
Accumulation is fp32 (fp64 for fp64 inputs). Dots on fp32/fp64 inputs use IEEE precision (no TF32) so
fp32 results match a float64 reference to fp32 tolerance.

Triton is imported when this module is imported; nsa.attention.ops imports it only when the Triton
kernel is chosen, so the package works without triton. On CPU tensors the kernels run only in
Triton's interpreter (TRITON_INTERPRET=1 set before this module is imported); the interpreter has no
bf16 matmul, so there bf16/fp16 operands are upcast to fp32 right before each dot (after the same
roundings a GPU run makes).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nsa.attention.kernels.block_centric import (_load_block, _run_rows, block_dq_kernel, block_fwd_kernel,
                                                 slot_merge_kernel, slot_sum_kernel)
from nsa.attention.kernels.index_tiles import frame_block_keys, segment_keys, sorted_entries, tile_layout
from nsa.attention.kernels.interpreter import interpreter_active
from nsa.attention.kernels.row_dot import row_dot

KV_TILE = 512  # queries per dK/dV program (bounds its serial work; partial dK/dV memory ~ 1 / KV_TILE)
BLOCK_ROWS = None  # (query, head) rows per step in the dK/dV program; None: tile_config's (per dtype, head dim)
Q_TILE = 64  # queries per block-centric forward / dQ program
PARTIAL_BYTES = 1 << 30  # block-centric forward / dQ: most bytes of per-slot partials one launch writes (read at call time)
SELECTION_PATH = "auto"  # forward + dQ kernels: "auto" (block-centric iff G < BLOCK_CENTRIC_BELOW), "block", "query"
BLOCK_CENTRIC_BELOW = 16  # G at which a padded group stops wasting MMA rows (GP = G)


@triton.jit
def _fwd_kernel(
    Q, K, V, IDX, O, LSE, FRAME,
    sqb, sqh, sqg, sqt, sqd,
    skb, skh, skt, skd,
    svb, svh, svt, svd,
    sob, soh, sog, sot, sod,
    sf0, sf1, sf2,
    Tq, Tk, q_start, scale,
    H_KV: tl.constexpr, G: tl.constexpr, N_SEL: tl.constexpr, L_SEL: tl.constexpr, HD: tl.constexpr,
    GP: tl.constexpr, BS: tl.constexpr, DP: tl.constexpr,
    ACC: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, HAS_FRAME: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H_KV
    h = bh % H_KV
    if HAS_FRAME:  # frame [3, B, Tq]: the query's position in its document, the document's first key
        pos_q = tl.load(FRAME + b * sf1 + t * sf2)
        k_base = tl.load(FRAME + sf0 + b * sf1 + t * sf2)
    else:
        pos_q = q_start + t
    offs_g = tl.arange(0, GP)
    offs_s = tl.arange(0, BS)
    offs_d = tl.arange(0, DP)
    g_ok = offs_g < G
    d_ok = offs_d < HD
    q = tl.load(Q + b * sqb + h * sqh + offs_g[:, None] * sqg + t * sqt + offs_d[None, :] * sqd,
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # [GP, DP]
    if UPCAST:  # the interpreter has no bf16/fp16 matmul
        q = q.to(tl.float32)
    # running max starts finite so a fully masked block gives alpha = 1 and P = exp(-inf) = 0 exactly;
    # masked scores are -inf (never a finite sentinel)
    m = tl.full([GP], -1.0e30, dtype=ACC)
    den = tl.zeros([GP], dtype=ACC)
    acc = tl.zeros([GP, DP], dtype=ACC)
    s_ok = offs_s < L_SEL
    k_tile = K + b * skb + h * skh + offs_s[:, None] * skt + offs_d[None, :] * skd  # block 0's [BS, DP] pointers
    v_tile = V + b * svb + h * svh + offs_s[:, None] * svt + offs_d[None, :] * svd
    idx_row = IDX + (bh * Tq + t) * N_SEL
    for s in range(N_SEL):
        j = tl.load(idx_row + s).to(tl.int64)
        if j >= 0:  # -1 = empty slot
            if HAS_FRAME:  # block j of the document: keys k_base + j*l' + r, visible iff j*l' + r <= p
                first = k_base + j * L_SEL  # index of the block's first key
                k_ok = s_ok & (offs_s <= pos_q - j * L_SEL) & (first + offs_s >= 0) & (first + offs_s < Tk)
            else:
                first = j * L_SEL  # position of the block's first key
                k_ok = s_ok & (offs_s <= pos_q - first)  # keys after p masked (the current block)
            kd_ok = k_ok[:, None] & d_ok[None, :]
            kb = tl.load(k_tile + first * skt, mask=kd_ok, other=0.0)  # [BS, DP]
            vb = tl.load(v_tile + first * svt, mask=kd_ok, other=0.0)
            if UPCAST:
                kb = kb.to(tl.float32)
                vb = vb.to(tl.float32)
            sc = tl.dot(q, tl.trans(kb), input_precision=PREC, out_dtype=ACC) * scale  # [GP, BS]
            sc = tl.where(k_ok[None, :], sc, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(sc - m_new[:, None])
            den = den * alpha + tl.sum(p, axis=1)
            pv = p.to(Q.dtype.element_ty).to(vb.dtype)  # P rounded to the input dtype, as flash attention
            acc = acc * alpha[:, None] + tl.dot(pv, vb, input_precision=PREC, out_dtype=ACC)
            m = m_new
    has = den > 0  # every real row has >= 1 key (the current block); guard anyway: empty row -> 0
    out = acc / tl.where(has, den, 1.0)[:, None]
    lse = tl.where(has, m + tl.log(tl.where(has, den, 1.0)), float("-inf"))
    tl.store(O + b * sob + h * soh + offs_g[:, None] * sog + t * sot + offs_d[None, :] * sod,
             out.to(O.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
    tl.store(LSE + (bh * G + offs_g) * Tq + t, lse, mask=g_ok)


@triton.jit
def _dq_kernel(
    Q, K, V, IDX, DO, LSE, DELTA, DQ, FRAME,
    sqb, sqh, sqg, sqt, sqd,
    skb, skh, skt, skd,
    svb, svh, svt, svd,
    sdb, sdh, sdg, sdt, sdd,
    sxb, sxh, sxg, sxt, sxd,
    sf0, sf1, sf2,
    Tq, Tk, q_start, scale,
    H_KV: tl.constexpr, G: tl.constexpr, N_SEL: tl.constexpr, L_SEL: tl.constexpr, HD: tl.constexpr,
    GP: tl.constexpr, BS: tl.constexpr, DP: tl.constexpr,
    ACC: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, HAS_FRAME: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H_KV
    h = bh % H_KV
    if HAS_FRAME:  # as _fwd_kernel
        pos_q = tl.load(FRAME + b * sf1 + t * sf2)
        k_base = tl.load(FRAME + sf0 + b * sf1 + t * sf2)
    else:
        pos_q = q_start + t
    offs_g = tl.arange(0, GP)
    offs_s = tl.arange(0, BS)
    offs_d = tl.arange(0, DP)
    g_ok = offs_g < G
    d_ok = offs_d < HD
    gd_ok = g_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * sqb + h * sqh + offs_g[:, None] * sqg + t * sqt + offs_d[None, :] * sqd, mask=gd_ok, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + offs_g[:, None] * sdg + t * sdt + offs_d[None, :] * sdd, mask=gd_ok, other=0.0)
    lse = tl.load(LSE + (bh * G + offs_g) * Tq + t, mask=g_ok, other=0.0)  # padded rows: dO = 0 -> dS = 0
    delta = tl.load(DELTA + (bh * G + offs_g) * Tq + t, mask=g_ok, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    dq = tl.zeros([GP, DP], dtype=ACC)
    s_ok = offs_s < L_SEL
    k_tile = K + b * skb + h * skh + offs_s[:, None] * skt + offs_d[None, :] * skd
    v_tile = V + b * svb + h * svh + offs_s[:, None] * svt + offs_d[None, :] * svd
    idx_row = IDX + (bh * Tq + t) * N_SEL
    for s in range(N_SEL):
        j = tl.load(idx_row + s).to(tl.int64)
        if j >= 0:
            if HAS_FRAME:
                first = k_base + j * L_SEL
                k_ok = s_ok & (offs_s <= pos_q - j * L_SEL) & (first + offs_s >= 0) & (first + offs_s < Tk)
            else:
                first = j * L_SEL  # position of the block's first key
                k_ok = s_ok & (offs_s <= pos_q - first)
            kd_ok = k_ok[:, None] & d_ok[None, :]
            kb = tl.load(k_tile + first * skt, mask=kd_ok, other=0.0)  # [BS, DP]
            vb = tl.load(v_tile + first * svt, mask=kd_ok, other=0.0)
            if UPCAST:
                kb = kb.to(tl.float32)
                vb = vb.to(tl.float32)
            sc = tl.dot(q, tl.trans(kb), input_precision=PREC, out_dtype=ACC) * scale
            p = tl.where(k_ok[None, :], tl.exp(sc - lse[:, None]), 0.0)  # [GP, BS], recomputed from LSE
            dp = tl.dot(do, tl.trans(vb), input_precision=PREC, out_dtype=ACC)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(Q.dtype.element_ty).to(kb.dtype), kb, input_precision=PREC, out_dtype=ACC)
    dq = dq * scale
    tl.store(DQ + b * sxb + h * sxh + offs_g[:, None] * sxg + t * sxt + offs_d[None, :] * sxd,
             dq.to(DQ.dtype.element_ty), mask=gd_ok)


@triton.jit
def _dkv_step(
    Q, DO, LSE, DELTA, b, h, bh, g, t, r_ok, vis, kb, vb, dk, dv, offs_d, d_ok,
    sqb, sqh, sqg, sqt, sqd,
    sdb, sdh, sdg, sdt, sdd,
    Tq, scale,
    G: tl.constexpr, ACC: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
):
    """One row step of _dkv_kernel: the (query t, head g) rows r_ok [BM] against the keys kb, vb [BK, DP]
    (vis [BM, BK]: which keys each row sees) add their terms to dk, dv [BK, DP] (dk unscaled)."""
    rd_ok = r_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * sqb + h * sqh + g[:, None] * sqg + t[:, None] * sqt + offs_d[None, :] * sqd, mask=rd_ok, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + g[:, None] * sdg + t[:, None] * sdt + offs_d[None, :] * sdd, mask=rd_ok, other=0.0)
    lse = tl.load(LSE + (bh * G + g) * Tq + t, mask=r_ok, other=0.0)
    delta = tl.load(DELTA + (bh * G + g) * Tq + t, mask=r_ok, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    sc = tl.dot(q, tl.trans(kb), input_precision=PREC, out_dtype=ACC) * scale
    p = tl.where(vis, tl.exp(sc - lse[:, None]), 0.0)
    dv += tl.dot(tl.trans(p.to(Q.dtype.element_ty).to(do.dtype)), do, input_precision=PREC, out_dtype=ACC)
    dp = tl.dot(do, tl.trans(vb), input_precision=PREC, out_dtype=ACC)
    ds = p * (dp - delta[:, None])
    dk += tl.dot(tl.trans(ds.to(Q.dtype.element_ty).to(q.dtype)), q, input_precision=PREC, out_dtype=ACC)
    return dk, dv


@triton.jit
def _dkv_kernel(
    Q, K, V, DO, LSE, DELTA, QUERIES, OFFS, RUN_END, TILE_SEG, TILE_START, TILE_COUNT, DKP, DVP, FRAME,
    sqb, sqh, sqg, sqt, sqd,
    skb, skh, skt, skd,
    svb, svh, svt, svd,
    sdb, sdh, sdg, sdt, sdd,
    sf0, sf1, sf2,
    Tq, Tk, q_start, scale, n_blocks,
    H_KV: tl.constexpr, G: tl.constexpr, L_SEL: tl.constexpr, HD: tl.constexpr,
    BM: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr, DP: tl.constexpr,
    ACC: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, HAS_FRAME: tl.constexpr,
):
    """Without a frame: a tile's queries selected block j = seg % n_blocks (keys j*l' ..); its partial
    DKP/DVP [tiles, l', hd] is written whole. With a frame (HAS_FRAME): they selected blocks whose first
    key lies in aligned block J = seg % n_blocks, at J*l' + OFFS[entry] (entries sorted by that offset,
    then query; a run of equal offsets, ending at RUN_END, is one document's block), so the program walks
    the runs, loading each run's K/V once, and stores each run's dK/dV into the tile's partial [tiles, 2l', hd] (zeros
    before) at rows offset + r, only the rows some query of the run sees: documents are disjoint, so no
    row is stored twice (not by another run, nor by the program of another key chunk)."""
    tile = tl.program_id(0).to(tl.int64)
    seg = tl.load(TILE_SEG + tile).to(tl.int64)  # (batch * H_kv + head) * n_blocks + block
    start = tl.load(TILE_START + tile).to(tl.int64)  # first entry of this tile in QUERIES
    count = tl.load(TILE_COUNT + tile).to(tl.int64)  # queries in this tile (0 for spare tiles)
    bh = seg // n_blocks
    j = seg % n_blocks
    b = bh // H_KV
    h = bh % H_KV
    offs_m = tl.arange(0, BM)
    offs_s = tl.program_id(1) * BK + tl.arange(0, BK)  # this program's BK keys of the block (BK <= BS)
    offs_d = tl.arange(0, DP)
    d_ok = offs_d < HD
    if HAS_FRAME:
        e0 = count * 0
        while e0 < count:  # one run (one document's block) per iteration: entries sorted by offset
            cur = tl.load(OFFS + start + e0)  # the run's block start - J*l'
            e1 = tl.minimum(tl.load(RUN_END + start + e0) - start, count)  # the run's entries: e0 .. e1-1
            kb, vb, k_ok = _load_block(K, V, b, h, j * L_SEL + cur, offs_s, offs_d, d_ok,
                                       skb, skh, skt, skd, svb, svh, svt, svd, Tk, L_SEL, UPCAST)
            dk = tl.zeros([BK, DP], dtype=ACC)
            dv = tl.zeros([BK, DP], dtype=ACC)
            far = tl.full((), -1, tl.int32)  # the farthest key (block offset) a row of the run sees
            for r0 in range(e0 * G, e1 * G, BM):  # rows are (query, head) pairs
                r, r_ok, t, reach = _run_rows(QUERIES, FRAME, start, r0, e1 * G, cur, j, b, offs_m,
                                              sf0, sf1, sf2, G, L_SEL)
                vis = r_ok[:, None] & k_ok[None, :] & (offs_s[None, :] <= reach[:, None])  # [BM, BK]
                dk, dv = _dkv_step(Q, DO, LSE, DELTA, b, h, bh, r % G, t, r_ok, vis, kb, vb, dk, dv, offs_d, d_ok,
                                   sqb, sqh, sqg, sqt, sqd, sdb, sdh, sdg, sdt, sdd, Tq, scale, G, ACC, UPCAST, PREC)
                far = tl.maximum(far, tl.max(tl.where(r_ok, reach, -1), axis=0))
            # the rows the run's queries see, at window rows cur + r of the tile's [2l', hd] partial
            rows = tile * (2 * L_SEL * HD) + (cur + offs_s)[:, None] * HD + offs_d[None, :]
            seen = (k_ok & (offs_s <= far))[:, None] & d_ok[None, :]
            tl.store(DKP + rows, dk * scale, mask=seen)
            tl.store(DVP + rows, dv, mask=seen)
            e0 = e1
    else:
        pos_k = j * L_SEL + offs_s
        kb, vb, k_ok = _load_block(K, V, b, h, j * L_SEL, offs_s, offs_d, d_ok,
                                   skb, skh, skt, skd, svb, svh, svt, svd, Tk, L_SEL, UPCAST)
        dk = tl.zeros([BK, DP], dtype=ACC)
        dv = tl.zeros([BK, DP], dtype=ACC)
        for r0 in range(0, count * G, BM):  # rows are (query, head) pairs: no padding of the group
            r = r0 + offs_m
            r_ok = r < count * G
            qi = r // G
            g = r % G
            t = tl.load(QUERIES + start + qi, mask=r_ok, other=0).to(tl.int64)
            vis = r_ok[:, None] & k_ok[None, :] & (pos_k[None, :] <= (q_start + t)[:, None])  # [BM, BK]
            dk, dv = _dkv_step(Q, DO, LSE, DELTA, b, h, bh, g, t, r_ok, vis, kb, vb, dk, dv, offs_d, d_ok,
                               sqb, sqh, sqg, sqt, sqd, sdb, sdh, sdg, sdt, sdd, Tq, scale, G, ACC, UPCAST, PREC)
        out = tile * L_SEL * HD + offs_s[:, None] * HD + offs_d[None, :]
        sd_ok = (offs_s < L_SEL)[:, None] & d_ok[None, :]
        tl.store(DKP + out, dk * scale, mask=sd_ok)
        tl.store(DVP + out, dv, mask=sd_ok)


@triton.jit
def _dkv_reduce_kernel(
    DKP, DVP, SEG_TILE_FIRST, SEG_TILES, DK, DV, Tk, n_blocks,
    L_SEL: tl.constexpr, HD: tl.constexpr, BS: tl.constexpr, DP: tl.constexpr, ACC: tl.constexpr,
    HAS_FRAME: tl.constexpr,
):
    """One program per (batch, KV head, block): sum its tiles' partials in tile order (deterministic).
    With a frame (partials [tiles, 2l', hd] of the blocks starting in aligned block j): rows 0 .. l'-1 of
    block j's tiles, then rows l' .. 2l'-1 of block j-1's."""
    seg = tl.program_id(0).to(tl.int64)
    bh = seg // n_blocks
    j = seg % n_blocks
    first = tl.load(SEG_TILE_FIRST + seg).to(tl.int64)
    n = tl.load(SEG_TILES + seg).to(tl.int64)
    offs_s = tl.arange(0, BS)
    offs_d = tl.arange(0, DP)
    sd_ok = (offs_s < L_SEL)[:, None] & (offs_d < HD)[None, :]
    part = offs_s[:, None] * HD + offs_d[None, :]
    dk = tl.zeros([BS, DP], dtype=ACC)
    dv = tl.zeros([BS, DP], dtype=ACC)
    if HAS_FRAME:
        for i in range(first, first + n):
            dk += tl.load(DKP + i * 2 * L_SEL * HD + part, mask=sd_ok, other=0.0)
            dv += tl.load(DVP + i * 2 * L_SEL * HD + part, mask=sd_ok, other=0.0)
        first_prev = tl.load(SEG_TILE_FIRST + seg - 1, mask=j > 0, other=0).to(tl.int64)
        n_prev = tl.load(SEG_TILES + seg - 1, mask=j > 0, other=0).to(tl.int64)  # same (batch, head) iff j > 0
        for i in range(first_prev, first_prev + n_prev):
            dk += tl.load(DKP + (i * 2 + 1) * L_SEL * HD + part, mask=sd_ok, other=0.0)
            dv += tl.load(DVP + (i * 2 + 1) * L_SEL * HD + part, mask=sd_ok, other=0.0)
    else:
        for i in range(first, first + n):
            dk += tl.load(DKP + i * L_SEL * HD + part, mask=sd_ok, other=0.0)
            dv += tl.load(DVP + i * L_SEL * HD + part, mask=sd_ok, other=0.0)
    pos_k = j * L_SEL + offs_s
    ok = sd_ok & (pos_k < Tk)[:, None]
    dst = (bh * Tk + pos_k[:, None]) * HD + offs_d[None, :]
    tl.store(DK + dst, dk.to(DK.dtype.element_ty), mask=ok)
    tl.store(DV + dst, dv.to(DV.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------- tile configs
@dataclass(frozen=True)
class TileConfig:
    """How one kernel is tiled at a (head dim, l', G, dtype): compile-time sizes and launch options."""

    rows: int  # MMA rows per step: GP, the group padded (query-centric), or BM (query, head) rows (block-centric)
    keys: int  # keys per program: BK of a block's BS (dK/dV: programs split a block's keys), else BS
    BS: int  # keys per block tile: l' padded to a power of two >= 16
    DP: int  # head dim padded to a power of two >= 16
    num_warps: int
    num_stages: int
    shared_bytes: int  # estimated shared memory per program on sm_80 / sm_90 (bytes; >= Triton 3.9's own)


KERNELS = ("fwd", "dq", "dkv", "dkv_reduce", "block_fwd", "block_dq", "slot_merge", "slot_sum")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}


def _pow2(x: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(x))


def tile_config(kernel: str, hd: int, l_sel: int, G: int, dtype: torch.dtype | str, frame: bool = False) -> TileConfig:
    """The tiling the host wrappers launch `kernel` (one of KERNELS) with. Pure (no device, no compile):
    another module can call it at config time and refuse a shape whose `shared_bytes` exceeds a target's
    shared memory per block (A100 166,912 B, H100 232,448 B); `shared_memory_estimate` does that for all
    the kernels one call launches. dtype: a torch dtype or "bf16" / "fp16" / "fp32" / "fp64".

    Chosen from ahead-of-time compiles for sm_80 and sm_90 (Triton 3.9; scripts/compile_kernels.py):
    16-bit inputs: 64-row tiles (wgmma on sm_90) up to DP 128; at DP 256 (head dim 192) 32 rows and
    dK/dV programs of 32 keys (mma.sync; 64 rows spill). fp32/fp64 dots are IEEE FMA loops whose
    operands live in registers: the smallest row tile (16), 8 warps (query-centric: 8 at DP 128, 16 at
    DP 256), dK/dV programs of 32 keys from DP 128 on. No spills at head dims 64/128 in fp32 (bf16:
    the block-centric forward at head dim 128 on sm_90 spills <= 20 B), and every kernel fits an A100's
    shared memory at head dim 192. Pipeline stages: Triton's default 3 for the query-centric kernels,
    1 for the row-loop kernels (stages 2-3 cost shared memory and registers; speed unmeasured).
    frame: the document-frame variants (HAS_FRAME), whose run loops (K/V loads at unaligned block
    starts) hold more registers. At 16 bits: dK/dV programs of at most 32 keys up to DP 128, the
    block-centric dQ on 8 warps at DP 64 (with the no-frame tiles both spill 52-56 B at the M7C shape
    on sm_80) and both block-centric kernels on 32-row tiles at DP 128 (64 rows spill 140-240 B on
    sm_90). Their `shared_bytes` are at most the no-frame configs' and bound their compiles (Triton
    3.9, sm_80 / sm_90), so shared_memory_estimate covers both."""
    if kernel not in KERNELS:
        raise ValueError(f"tile_config: unknown kernel {kernel!r}; one of {KERNELS}")
    dtype = _DTYPES.get(dtype, dtype)
    bits = torch.finfo(dtype).bits
    wide = bits > 16  # fp32 / fp64: IEEE dots without tensor cores
    BS, DP = _pow2(l_sel), _pow2(hd)
    keys, stages = BS, 1
    if kernel == "dkv_reduce":  # memory-bound sum of [BS, DP] partials in registers
        return TileConfig(BS, BS, BS, DP, 4 if DP <= 64 else 8 if DP <= 128 else 16, 1, 0)
    if kernel in ("slot_merge", "slot_sum"):  # memory-bound: [rows, DP] accumulator tiles of 4,096 values, no dots
        rows = max(16, 4096 // DP)
        return TileConfig(rows, BS, BS, DP, 4, 1, 8 * rows)  # Triton 3.9: rows * 4 B (a layout conversion)
    if kernel in ("fwd", "dq"):  # query-centric: rows are the group padded to 16
        rows, stages = _pow2(G), 3
        warps = (4 if DP <= 64 else 8 if DP <= 128 else 16) if wide else 4
    elif kernel in ("block_fwd", "block_dq"):
        if wide:
            rows, warps = 16, 8
        elif frame and DP == 128:  # 64 rows spill 140-240 B on sm_90 in the frame variants
            rows, warps = 32, (8 if kernel == "block_fwd" else 4)
        elif DP <= 128:
            rows, warps = 64, (8 if (kernel == "block_fwd" and DP == 128) or (kernel == "block_dq" and frame) else 4)
        else:
            rows, warps = 32, 8
    elif wide:  # dkv: K, V and the dK, dV accumulators of BK keys stay resident for the whole tile
        rows, warps, keys = 16, 8, (BS if DP <= 64 else min(BS, 32))
    else:
        rows, warps, keys = (64, 4 if DP <= 64 else 8, min(BS, 32) if frame else BS) if DP <= 128 else (32, 8, min(BS, 32))
    return TileConfig(rows, keys, BS, DP, warps, stages, _shared_estimate(kernel, rows, keys, DP, bits))


def _shared_estimate(kernel: str, rows: int, keys: int, DP: int, bits: int) -> int:
    """Upper bound of the shared memory Triton 3.9 allocates (checked against the AOT table): the K and V
    tiles, the row operands staged for the dots (Q; Q and dO), P as an operand where it is live beside
    them, and for 16-bit inputs a [rows, DP] fp32 layout-conversion buffer (sm_90 MMA accumulators)."""
    elt = bits // 8
    row_operands, scores = {"fwd": (1, 1), "dq": (2, 0), "dkv": (2, 1), "block_fwd": (1, 1), "block_dq": (2, 0)}[kernel]
    est = (2 * keys * DP + row_operands * rows * DP + scores * rows * keys) * elt
    return est + (rows * DP * 4 if bits <= 16 else 0)


def launched_kernels(G: int) -> tuple[str, ...]:
    """The kernels selected_attention_fwd / _bwd launch for groups of G query heads (with SELECTION_PATH)."""
    first = ("block_fwd", "block_dq", "slot_merge", "slot_sum") if use_block_centric(G) else ("fwd", "dq")
    return (*first, "dkv", "dkv_reduce")


def shared_memory_estimate(hd: int, l_sel: int, G: int, dtype: torch.dtype | str) -> int:
    """The most shared memory (bytes) any kernel of the selection forward + backward needs at this shape:
    refuse a configuration where this exceeds the target's per-block limit."""
    return max(tile_config(k, hd, l_sel, G, dtype).shared_bytes for k in launched_kernels(G))


def use_block_centric(G: int) -> bool:
    """Forward and dQ path: block-centric for groups below 16 (SELECTION_PATH = "auto"), or forced."""
    if SELECTION_PATH not in ("auto", "block", "query"):
        raise ValueError(f"SELECTION_PATH = {SELECTION_PATH!r}; one of auto, block, query")
    return SELECTION_PATH == "block" or (SELECTION_PATH == "auto" and G < BLOCK_CENTRIC_BELOW)


# ---------------------------------------------------------------- host side
def _meta(q: torch.Tensor, G: int, hd: int, l_sel: int) -> dict:
    """Compile-time constants shared by the kernels: tile sizes, accumulator dtype, dot precision."""
    f64 = q.dtype == torch.float64
    return dict(
        G=G, L_SEL=l_sel, HD=hd, BS=_pow2(l_sel), DP=_pow2(hd),
        ACC=tl.float64 if f64 else tl.float32,
        UPCAST=interpreter_active() and q.dtype in (torch.bfloat16, torch.float16),
        PREC="ieee" if q.dtype in (torch.float32, torch.float64) or interpreter_active() else "tf32",
    )


def _launch(kernel: str, hd: int, l_sel: int, G: int, dtype: torch.dtype, rows: int | None = None,
            frame: bool = False) -> dict:
    """Launch options and the row tile of a kernel (rows overrides the config's, e.g. BLOCK_ROWS)."""
    cfg = tile_config(kernel, hd, l_sel, G, dtype, frame)
    out = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if kernel in ("dkv", "block_fwd", "block_dq"):
        out["BM"] = _pow2(rows) if rows else cfg.rows
    if kernel in ("slot_merge", "slot_sum"):
        out["BR"] = cfg.rows
    if kernel == "dkv":
        out["BK"] = cfg.keys
    return out


def _check(q, k, v, block_idx, q_start: int, frame: torch.Tensor | None = None):
    B, H_kv, G, Tq, hd = q.shape
    if k.shape[:2] != (B, H_kv) or k.shape[3] != hd or v.shape != k.shape:
        raise ValueError(f"selected attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match")
    if frame is None and k.shape[2] < q_start + Tq:
        raise ValueError(f"selected attention: {k.shape[2]} keys, but queries reach position {q_start + Tq - 1}")
    if frame is not None and (frame.shape != (3, B, Tq) or frame.dtype != torch.long or frame.device != q.device):
        raise ValueError(f"selected attention: frame must be int64 [3, {B}, {Tq}] on {q.device}, got "
                         f"{frame.dtype} {tuple(frame.shape)} on {frame.device}")
    if block_idx.shape[:3] != (B, H_kv, Tq):
        raise ValueError(f"selected attention: block_idx {tuple(block_idx.shape)} does not match q {tuple(q.shape)}")
    if q.device.type == "cpu" and not interpreter_active():
        raise RuntimeError("the Triton selection kernels need a CUDA tensor, or TRITON_INTERPRET=1 set before triton is imported")


def _frame_args(frame: torch.Tensor | None, dummy: torch.Tensor) -> tuple:
    """The kernels' FRAME pointer and its three strides (a dummy pointer, never read, without a frame)."""
    return (dummy, 0, 0, 0) if frame is None else (frame, *frame.stride())


@torch.no_grad()
def _block_keys(idx: torch.Tensor, l_sel: int, Tk: int, frame: torch.Tensor | None):
    """idx [B, H_kv, Tq, n] (-1 = none) -> what the inverted indexes are keyed by: without a frame the
    block itself (and no offsets); with one, block j of query (b, t) starts at key s = k_base + j*l', keyed
    by its aligned block s // l' (-1 for empty slots) and the offset s % l' [B, H_kv, Tq, n] (int64).
    A first key outside 0 .. Tk-1 (a frame breaking k_base + p < Tk) counts as an empty slot. With a frame both int32,
    from one launch (kernels/index_tiles.py frame_block_keys)."""
    if frame is None:
        return idx, None
    return frame_block_keys(idx, frame[1], l_sel, Tk)


def slot_index(idx: torch.Tensor, Tk: int, l_sel: int, q_tile: int | None = None,
               frame: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The by-slot inverted index the block-centric forward and dQ kernels read, built once per forward and kept
    for the backward (nsa::selected_attention returns it): [queries, tile_seg, tile_start, tile_count, home], and
    with a frame also [offsets, run_ends]. idx [B, H_kv, Tq, n] (-1 = none); q_tile: queries per tile (default
    Q_TILE, read at call time). queries, offsets, run ends: inverted_index's queries, sub_sorted and run_end (int32
    [B*H_kv*Tq*n]); tile_*: its tiles (int64 [n * tiles per slot]); home [B, H_kv, Tq, n] int32: each entry's key
    (-1: an empty slot; the merge kernels read no partial there). Sizes depend on shapes only (slot_index_like)."""
    B, H_kv, Tq, n = idx.shape
    n_blocks = -(-Tk // l_sel)
    home, off = _block_keys(idx, l_sel, Tk, frame)
    out = inverted_index(home.reshape(B * H_kv, Tq, n), n_blocks, q_tile or Q_TILE, by_slot=True,
                         sub=None if off is None else off.view(B * H_kv, Tq, n), n_sub=l_sel)
    index = [*out[:4], home.to(torch.int32).contiguous()]
    return index if frame is None else index + list(out[6:])


def slot_index_like(idx: torch.Tensor, Tk: int, l_sel: int, frame: bool) -> list[torch.Tensor]:
    """Empty tensors shaped as slot_index(idx, Tk, l_sel, frame=...) returns (custom ops' fake implementations)."""
    B, H_kv, Tq, n = idx.shape
    entries, per_part, segments = B * H_kv * Tq * n, B * H_kv * Tq, B * H_kv * -(-Tk // l_sel)
    tiles = n * (per_part // Q_TILE + min(segments, per_part))
    int32 = dict(dtype=torch.int32)
    index = [idx.new_empty(entries, **int32), *(idx.new_empty(tiles, dtype=torch.int64) for _ in range(3)),
             idx.new_empty(idx.shape, **int32)]
    return index + [idx.new_empty(entries, **int32) for _ in range(2)] if frame else index


def _slot_index(index: list[torch.Tensor], Tk: int, l_sel: int, n: int):
    """slot_index's list -> (queries, offs, run ends, tile_seg, tile_start, tile_count, n_blocks, tiles per slot,
    home): what the kernels take (without a frame `queries` stands in for offsets and run ends, unread)."""
    queries, tile_seg, tile_start, tile_count, home = index[:5]
    offs, run_end = index[5:] if len(index) == 7 else (queries, queries)
    return queries, offs, run_end, tile_seg, tile_start, tile_count, -(-Tk // l_sel), tile_seg.shape[0] // n, home


def selected_attention_fwd(q, k, v, block_idx, q_start: int, l_sel: int, q_tile: int | None = None,
                           frame: torch.Tensor | None = None, return_index: bool = False):
    """q [B, H_kv, G, Tq, hd], k/v [B, H_kv, Tk, hd], block_idx [B, H_kv, Tq, n] (-1 = none).

    Returns o [B, H_kv, G, Tq, hd] (q's dtype, contiguous) and lse [B, H_kv, G, Tq] (fp32; fp64 for fp64); with
    return_index also the block-centric path's slot_index (for selected_attention_bwd; [] on the query-centric path).
    q_tile: queries per block-centric program (default Q_TILE, read at call time).
    frame [3, B, Tq] int64 (q_pos, k_base, c_base; nsa/attention/documents.py), q_start then unused:
    query (b, t) sits at position p = frame[0, b, t] of a document whose first key is k[b, :, k_base]
    (k_base = frame[1, b, t]); its block j (document-relative, as fused_select_blocks returns them) covers
    keys k_base + j*l' + r, r < l', visible iff j*l' + r <= p. Documents must be disjoint (a key belongs to
    one document, as documents.py's frames give) and k_base + p < Tk. Both paths take frames:
    query-centric programs read their query's frame; the block-centric index keys each (query, block) by
    the block's real first key k_base + j*l' (aligned block + offset), and a program walks the runs of
    equal first keys in its tile (one K/V load per run). Same launches as without a frame, no host sync.
    """
    _check(q, k, v, block_idx, q_start, frame)
    B, H_kv, G, Tq, hd = q.shape
    Tk, n = k.shape[2], block_idx.shape[-1]
    idx = block_idx.to(torch.int32).contiguous()
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    o = torch.empty(B, H_kv, G, Tq, hd, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H_kv, G, Tq, dtype=acc_dtype, device=q.device)
    if Tq == 0:
        return (o, lse, []) if return_index else (o, lse)
    meta = _meta(q, G, hd, l_sel)
    scale = 1.0 / math.sqrt(hd)
    fr, *f_strides = _frame_args(frame, idx)
    has_frame = frame is not None
    if not use_block_centric(G):
        _fwd_kernel[(Tq, B * H_kv)](
            q, k, v, idx, o, lse, fr, *q.stride(), *k.stride(), *v.stride(), *o.stride(), *f_strides,
            Tq, Tk, q_start, scale, H_KV=H_kv, N_SEL=n, GP=_pow2(G), **meta, HAS_FRAME=has_frame,
            **_launch("fwd", hd, l_sel, G, q.dtype),
        )
        return (o, lse, []) if return_index else (o, lse)
    index = slot_index(idx, Tk, l_sel, q_tile, frame)
    queries, offs, run_end, tile_seg, tile_start, tile_count, n_blocks, n_tiles, home = _slot_index(
        index, Tk, l_sel, n)
    R = B * H_kv * G * Tq  # rows of the [B, H_kv, G, Tq] state
    # partial outputs in q's dtype: the merge is a convex combination of them (no cancellation), so rounding each
    # costs what rounding the output costs; log-sum-exps in the accumulator's
    per = _slots_per_launch(n, R * _fwd_partial_row_bytes(hd, q.dtype, acc_dtype))
    op = torch.empty(per, R, hd, dtype=q.dtype, device=q.device)  # partials: never read where not written
    lsep = torch.empty(per, R, dtype=acc_dtype, device=q.device)
    # earlier slot ranges' merge, fp32 where o is 16-bit (only when the slots take more than one launch)
    o_run = o if per >= n or o.dtype == acc_dtype else torch.empty(o.shape, dtype=acc_dtype, device=o.device)
    launch = _launch("block_fwd", hd, l_sel, G, q.dtype, frame=has_frame)
    merge = _launch("slot_merge", hd, l_sel, G, q.dtype)
    for slot0 in range(0, n, per):  # one launch pair unless the partials would exceed PARTIAL_BYTES
        slots = min(per, n - slot0)
        block_fwd_kernel[(n_tiles, slots)](
            q, k, v, queries, offs, run_end, tile_seg, tile_start, tile_count, op, lsep, fr,
            *q.stride(), *k.stride(), *v.stride(), *f_strides, Tq, Tk, q_start, scale, n_blocks, slot0, n_tiles, R,
            H_KV=H_kv, **meta, HAS_FRAME=has_frame, **launch,
        )
        last = slot0 + slots >= n
        slot_merge_kernel[(triton.cdiv(R, merge["BR"]),)](
            op, lsep, home, o_run, lse, o if last else o_run, lse, R, Tq, n, slot0, slots,
            G=G, HD=hd, DP=meta["DP"], ACC=meta["ACC"], HAS_PREV=slot0 > 0, **merge,
        )
    return (o, lse, index) if return_index else (o, lse)


def _slots_per_launch(n: int, slot_bytes: int) -> int:
    """Selection slots one block-centric launch covers: all n unless their partials (slot_bytes per slot) would
    exceed PARTIAL_BYTES; at least one."""
    return max(1, min(n, PARTIAL_BYTES // slot_bytes))


def _fwd_partial_row_bytes(hd: int, dtype: torch.dtype, acc_dtype: torch.dtype) -> int:
    """Bytes of one (row, slot) forward partial: the output in the input's dtype, the log-sum-exp in acc_dtype."""
    return hd * torch.finfo(dtype).bits // 8 + torch.finfo(acc_dtype).bits // 8


def _dq_partial_row_bytes(hd: int, acc_dtype: torch.dtype) -> int:
    """Bytes of one (row, slot) dQ partial: the term in acc_dtype (terms of a sum that may cancel)."""
    return hd * torch.finfo(acc_dtype).bits // 8


def partial_bytes(rows: int, hd: int, n: int, G: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Device memory the block-centric forward or dQ holds for its partials (transient, one layer at a time; the
    larger of the two): rows = B * H * Tq (query heads), n slots, inputs in dtype; 0 where the query-centric path
    runs (G >= 16 by default)."""
    if not use_block_centric(G):
        return 0
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    return max(_slots_per_launch(n, rows * b) * rows * b
               for b in (_fwd_partial_row_bytes(hd, dtype, acc), _dq_partial_row_bytes(hd, acc)))


@torch.no_grad()
def inverted_index(block_idx: torch.Tensor, n_blocks: int, kv_tile: int, by_slot: bool = False,
                   sub: torch.Tensor | None = None, n_sub: int = 1):
    """Which queries selected each block, cut into tiles of at most kv_tile queries. Torch ops only,
    static sizes (no host sync).

    block_idx [BH, Tq, n] (-1 = none). Segments s = bh * n_blocks + block (S = BH * n_blocks of them);
    by_slot: one set of segments per selection slot (the entries of slot 0 first, then slot 1, ...).
    sub [BH, Tq, n] in [0, n_sub) (optional): a second sort key within a segment (frames: the offset of
    the block's first key in its aligned block), before the query position.
    Returns
      queries [BH*Tq*n] int32: query positions (0-based in the chunk) sorted by (slot if by_slot),
        segment, (sub), position;
      tile_seg, tile_start, tile_count [P * n_tiles] (P = n if by_slot else 1; part p's tiles are
        p * n_tiles .. (p + 1) * n_tiles - 1): a tile's segment within its part (spare tiles: a valid
        segment with count 0), its first entry in `queries`, its number of queries;
      seg_tile_first, seg_tiles [P * S]: each segment's tiles are seg_tile_first .. + seg_tiles;
      with sub only: sub_sorted [BH*Tq*n] int32, sub in the order of `queries`, and run_end [BH*Tq*n]
        int32: for each entry, one past the last entry of its run (the entries of equal segment and sub
        around it; a tile may end a run earlier).
    With C = BH*Tq*min(n, n_blocks) entries per part (BH*Tq by slot), n_tiles = C // kv_tile + min(S, C)
    bounds sum_s ceil(count_s / kv_tile) over a part's segments.
    """
    BH, Tq, n = block_idx.shape
    S = BH * n_blocks
    P = n if by_slot else 1
    # empty slots -> the spare segment P*S (sorted last, not counted); kernels/index_tiles.py
    key, counts = segment_keys(block_idx, n_blocks, by_slot, sub, n_sub)
    sorted_key, order = torch.sort(key, stable=True)
    queries, sub_sorted = sorted_entries(order, sorted_key, Tq, n, None if sub is None else n_sub)
    seg_tiles = (counts + (kv_tile - 1)) // kv_tile
    per_part = BH * Tq * (1 if by_slot else min(n, n_blocks))
    n_tiles = per_part // kv_tile + min(S, per_part)
    tile_seg, tile_start, tile_count, seg_tile_first = tile_layout(counts, seg_tiles, P, S, n_tiles, kv_tile)
    if sub is None:
        return queries, tile_seg, tile_start, tile_count, seg_tile_first, seg_tiles
    run_end = torch.searchsorted(sorted_key, sorted_key, right=True, out_int32=True)  # past the last equal key
    return queries, tile_seg, tile_start, tile_count, seg_tile_first, seg_tiles, sub_sorted, run_end


def selected_attention_bwd(q, k, v, block_idx, o, lse, d_o, q_start: int, l_sel: int,
                           kv_tile: int | None = None, block_rows: int | None = None, q_tile: int | None = None,
                           frame: torch.Tensor | None = None, index: list[torch.Tensor] | None = None):
    """Gradients (dq, dk, dv) of selected attention, shaped like q, k, v, in their dtypes.
    index: the forward's slot_index (return_index), read by the block-centric dQ instead of building it again
    (q_tile is then the forward's); None or []: built here.
    kv_tile / block_rows / q_tile default to the module's KV_TILE / BLOCK_ROWS / Q_TILE (read at call
    time; BLOCK_ROWS None: the dK/dV kernel's tile_config rows). frame: as selected_attention_fwd; the
    dK/dV index then keys (query, block) pairs by the aligned block of the block's first key (sorted by
    offset within it), a tile's partial spans two aligned blocks ([tiles, 2l', hd], zeroed first: twice
    the partials' memory) and the reduction sums aligned block j's rows from the tiles of j and j - 1."""
    kv_tile, block_rows, q_tile = kv_tile or KV_TILE, block_rows or BLOCK_ROWS, q_tile or Q_TILE
    _check(q, k, v, block_idx, q_start, frame)
    B, H_kv, G, Tq, hd = q.shape
    Tk, n = k.shape[2], block_idx.shape[-1]
    acc_dtype = lse.dtype
    idx = block_idx.to(torch.int32).contiguous()
    delta = row_dot(d_o, o)  # [B, H_kv, G, Tq] in acc_dtype: sum over hd of dO * O
    meta = _meta(q, G, hd, l_sel)
    scale = 1.0 / math.sqrt(hd)
    dk = torch.empty(B, H_kv, Tk, hd, dtype=k.dtype, device=k.device)
    dv = torch.empty(B, H_kv, Tk, hd, dtype=v.dtype, device=v.device)
    if Tq == 0:
        return torch.zeros_like(q), dk.zero_(), dv.zero_()
    common = (*q.stride(), *k.stride(), *v.stride(), *d_o.stride())
    fr, *f_strides = _frame_args(frame, idx)
    has_frame = frame is not None
    if use_block_centric(G):
        index = index or slot_index(idx, Tk, l_sel, q_tile, frame)
        queries, offs, run_end, tile_seg, tile_start, tile_count, n_blocks_q, n_tiles_q, home = _slot_index(
            index, Tk, l_sel, n)
        R = B * H_kv * G * Tq
        per = _slots_per_launch(n, R * _dq_partial_row_bytes(hd, acc_dtype))
        dqp = torch.empty(per, R, hd, dtype=acc_dtype, device=q.device)  # never read where not written
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        dq_run = dq if per >= n or dq.dtype == acc_dtype else torch.empty(q.shape, dtype=acc_dtype, device=q.device)
        launch = _launch("block_dq", hd, l_sel, G, q.dtype, frame=has_frame)
        add = _launch("slot_sum", hd, l_sel, G, q.dtype)
        for slot0 in range(0, n, per):  # slot order: dQ sums its n terms in a fixed order (deterministic)
            slots = min(per, n - slot0)
            block_dq_kernel[(n_tiles_q, slots)](
                q, k, v, d_o, lse, delta, queries, offs, run_end, tile_seg, tile_start, tile_count, dqp, fr, *common,
                *f_strides, Tq, Tk, q_start, scale, n_blocks_q, slot0, n_tiles_q, R, H_KV=H_kv, **meta,
                HAS_FRAME=has_frame, **launch,
            )
            last = slot0 + slots >= n
            slot_sum_kernel[(triton.cdiv(R, add["BR"]),)](
                dqp, home, dq_run, dq if last else dq_run, R, Tq, n, slot0, slots,
                G=G, HD=hd, DP=meta["DP"], ACC=meta["ACC"], HAS_PREV=slot0 > 0, **add,
            )
    else:
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        _dq_kernel[(Tq, B * H_kv)](
            q, k, v, idx, d_o, lse, delta, dq, fr, *common, *dq.stride(), *f_strides,
            Tq, Tk, q_start, scale, H_KV=H_kv, N_SEL=n, GP=_pow2(G), **meta, HAS_FRAME=has_frame,
            **_launch("dq", hd, l_sel, G, q.dtype),
        )
    n_blocks = -(-Tk // l_sel)
    home, off = _block_keys(idx, l_sel, Tk, frame)
    index = inverted_index(home.reshape(B * H_kv, Tq, n), n_blocks, kv_tile,
                           sub=None if off is None else off.view(B * H_kv, Tq, n), n_sub=l_sel)
    queries, tile_seg, tile_start, tile_count, seg_tile_first, seg_tiles = index[:6]
    offs, run_end = (queries, queries) if frame is None else index[6:]
    n_tiles = tile_seg.shape[0]
    if frame is None:  # every tile writes its whole partial
        dkp = torch.empty(n_tiles, l_sel, hd, dtype=acc_dtype, device=q.device)
        dvp = torch.empty(n_tiles, l_sel, hd, dtype=acc_dtype, device=q.device)
    else:  # a tile writes the rows its runs see, within two aligned blocks
        dkp = torch.zeros(n_tiles, 2 * l_sel, hd, dtype=acc_dtype, device=q.device)
        dvp = torch.zeros(n_tiles, 2 * l_sel, hd, dtype=acc_dtype, device=q.device)
    dkv = _launch("dkv", hd, l_sel, G, q.dtype, block_rows, frame=has_frame)
    _dkv_kernel[(n_tiles, meta["BS"] // dkv["BK"])](
        q, k, v, d_o, lse, delta, queries, offs, run_end, tile_seg, tile_start, tile_count, dkp, dvp, fr, *common,
        *f_strides,
        Tq, Tk, q_start, scale, n_blocks, H_KV=H_kv, **meta, HAS_FRAME=has_frame, **dkv,
    )
    _dkv_reduce_kernel[(B * H_kv * n_blocks,)](
        dkp, dvp, seg_tile_first, seg_tiles, dk, dv, Tk, n_blocks,
        L_SEL=l_sel, HD=hd, BS=meta["BS"], DP=meta["DP"], ACC=meta["ACC"], HAS_FRAME=has_frame,
        **_launch("dkv_reduce", hd, l_sel, G, q.dtype),
    )
    return dq, dk, dv


class TritonSelectedAttention(torch.autograd.Function):
    """Saves q, k, v, the int32 block indices, O and LSE (and the frame); backward recomputes P from them."""

    @staticmethod
    def forward(ctx, q, k, v, block_idx, q_start: int, l_sel: int, kv_tile: int | None, frame=None):
        o, lse = selected_attention_fwd(q, k, v, block_idx, q_start, l_sel, frame=frame)
        ctx.save_for_backward(q, k, v, block_idx.to(torch.int32), o, lse)
        ctx.q_start, ctx.l_sel, ctx.kv_tile, ctx.frame = q_start, l_sel, kv_tile, frame
        return o

    @staticmethod
    def backward(ctx, d_o):
        q, k, v, idx, o, lse = ctx.saved_tensors
        dq, dk, dv = selected_attention_bwd(q, k, v, idx, o, lse, d_o, ctx.q_start, ctx.l_sel, ctx.kv_tile,
                                            frame=ctx.frame)
        return dq, dk, dv, None, None, None, None, None


def triton_selected_attention(
    q: torch.Tensor,  # [B, H_kv, G, Tq, hd] queries at positions q_start ..
    k: torch.Tensor,  # [B, H_kv, Tk, hd] selection keys at positions 0 .. Tk-1 (Tk >= q_start + Tq)
    v: torch.Tensor,  # [B, H_kv, Tk, hd]
    block_idx: torch.Tensor,  # [B, H_kv, Tq, n] from select_blocks, -1 = none
    q_start: int,
    l_sel: int,
    tile: int | None = None,  # unused (the torch path's tile size); same signature as selected_attention
    kv_tile: int | None = None,  # queries per dK/dV program; None: KV_TILE
    frame: torch.Tensor | None = None,  # [3, B, Tq] documents (selected_attention_fwd); q_start then unused
) -> torch.Tensor:  # [B, H_kv, G, Tq, hd]
    """Drop-in for nsa.attention.ops.selected_attention, differentiable in q, k, v."""
    dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)  # autocast may mix them
    return TritonSelectedAttention.apply(q.to(dtype), k.to(dtype), v.to(dtype), block_idx, q_start, l_sel, kv_tile, frame)
