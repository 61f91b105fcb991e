"""NSA selected attention as Triton kernels (paper §3.4 design), forward and backward.

Same contract as `nsa.attention.selection.selected_attention`: queries q [B, H_kv, G, Tq, hd] at
positions q_start .., keys/values k, v [B, H_kv, Tk, hd] at positions 0 .. Tk-1, block_idx
[B, H_kv, Tq, n] (selected blocks of l' keys, -1 = empty slot; a GQA group shares them). Query p reads
the keys of its blocks at positions <= p (the current block is partially visible); a block index must
not repeat within a row (select_blocks guarantees it; a repeat would count its keys twice).

Kernels (grid, tiling):
  forward  `_fwd_kernel`, grid (Tq, B*H_kv): group-centric. One program loads the G query heads of one
           position as a [GP, DP] tile (GP = G padded to a power of two >= 16, DP = hd padded to a power
           of two >= 16; padded rows/columns are masked loads of 0 and are never stored), then walks the
           n selected blocks, loading each block's keys/values once for the whole group as [BS, DP]
           tiles (BS = l' padded likewise), masking keys after p, and keeps an online softmax
           (running max, denominator, numerator). Writes O and the log-sum-exp LSE [B, H_kv, G, Tq].
  backward delta = rowsum(dO * O) (torch), then
           `_dq_kernel`, grid (Tq, B*H_kv): query-centric like the forward; recomputes P = exp(S - LSE)
           per block and accumulates dQ in registers;
           `_dkv_kernel`, grid (tiles,): block-centric over an inverted index ("which queries selected
           block j", built with torch sort + counts, no host sync). The queries of each (batch, KV
           head, block) are cut into tiles of at most `kv_tile` queries; a program loads its block's
           K/V once, walks its queries in row tiles of BM (query, head) pairs (no group padding),
           recomputes P and dS and accumulates dK, dV for the block in registers, then writes one
           partial per tile; `_dkv_reduce_kernel`, grid (B*H_kv*blocks,), sums a block's partials in a
           fixed order. Deterministic (no atomics); the tiles bound the serial work of a program even
           for block 0, which every query selects.
Accumulation is fp32 (fp64 for fp64 inputs). Dots on fp32/fp64 inputs use IEEE precision (no TF32) so
fp32 results match a float64 reference to fp32 tolerance.

Triton is imported when this module is imported; nsa.attention.selection imports it only when the
Triton kernel is chosen, so the package works without triton. On CPU tensors the kernels run only in
Triton's interpreter (TRITON_INTERPRET=1 set before this module is imported); the interpreter has no
bf16 matmul, so there bf16/fp16 operands are upcast to fp32 right before each dot (after the same
roundings a GPU run makes).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

KV_TILE = 512  # queries per dK/dV program (bounds its serial work; partial dK/dV memory ~ 1 / KV_TILE)
BLOCK_ROWS = 64  # (query, head) rows per step in the dK/dV program


@triton.jit
def _fwd_kernel(
    Q, K, V, IDX, O, LSE,
    sqb, sqh, sqg, sqt, sqd,
    skb, skh, skt, skd,
    svb, svh, svt, svd,
    sob, soh, sog, sot, sod,
    Tq, Tk, q_start, scale,
    H_KV: tl.constexpr, G: tl.constexpr, N_SEL: tl.constexpr, L_SEL: tl.constexpr, HD: tl.constexpr,
    GP: tl.constexpr, BS: tl.constexpr, DP: tl.constexpr,
    ACC: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H_KV
    h = bh % H_KV
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
    Q, K, V, IDX, DO, LSE, DELTA, DQ,
    sqb, sqh, sqg, sqt, sqd,
    skb, skh, skt, skd,
    svb, svh, svt, svd,
    sdb, sdh, sdg, sdt, sdd,
    sxb, sxh, sxg, sxt, sxd,
    Tq, Tk, q_start, scale,
    H_KV: tl.constexpr, G: tl.constexpr, N_SEL: tl.constexpr, L_SEL: tl.constexpr, HD: tl.constexpr,
    GP: tl.constexpr, BS: tl.constexpr, DP: tl.constexpr,
    ACC: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H_KV
    h = bh % H_KV
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
def _dkv_kernel(
    Q, K, V, DO, LSE, DELTA, QUERIES, TILE_SEG, TILE_START, TILE_COUNT, DKP, DVP,
    sqb, sqh, sqg, sqt, sqd,
    skb, skh, skt, skd,
    svb, svh, svt, svd,
    sdb, sdh, sdg, sdt, sdd,
    Tq, Tk, q_start, scale, n_blocks,
    H_KV: tl.constexpr, G: tl.constexpr, L_SEL: tl.constexpr, HD: tl.constexpr,
    BM: tl.constexpr, BS: tl.constexpr, DP: tl.constexpr,
    ACC: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
):
    tile = tl.program_id(0).to(tl.int64)
    seg = tl.load(TILE_SEG + tile).to(tl.int64)  # (batch * H_kv + head) * n_blocks + block
    start = tl.load(TILE_START + tile).to(tl.int64)  # first entry of this tile in QUERIES
    count = tl.load(TILE_COUNT + tile).to(tl.int64)  # queries in this tile (0 for spare tiles)
    bh = seg // n_blocks
    j = seg % n_blocks
    b = bh // H_KV
    h = bh % H_KV
    offs_m = tl.arange(0, BM)
    offs_s = tl.arange(0, BS)
    offs_d = tl.arange(0, DP)
    d_ok = offs_d < HD
    pos_k = j * L_SEL + offs_s
    k_ok = (offs_s < L_SEL) & (pos_k < Tk)
    kd_ok = k_ok[:, None] & d_ok[None, :]
    kb = tl.load(K + b * skb + h * skh + pos_k[:, None] * skt + offs_d[None, :] * skd, mask=kd_ok, other=0.0)
    vb = tl.load(V + b * svb + h * svh + pos_k[:, None] * svt + offs_d[None, :] * svd, mask=kd_ok, other=0.0)
    if UPCAST:
        kb = kb.to(tl.float32)
        vb = vb.to(tl.float32)
    dk = tl.zeros([BS, DP], dtype=ACC)
    dv = tl.zeros([BS, DP], dtype=ACC)
    for r0 in range(0, count * G, BM):  # rows are (query, head) pairs: no padding of the group
        r = r0 + offs_m
        r_ok = r < count * G
        qi = r // G
        g = r % G
        t = tl.load(QUERIES + start + qi, mask=r_ok, other=0).to(tl.int64)
        rd_ok = r_ok[:, None] & d_ok[None, :]
        q = tl.load(Q + b * sqb + h * sqh + g[:, None] * sqg + t[:, None] * sqt + offs_d[None, :] * sqd, mask=rd_ok, other=0.0)
        do = tl.load(DO + b * sdb + h * sdh + g[:, None] * sdg + t[:, None] * sdt + offs_d[None, :] * sdd, mask=rd_ok, other=0.0)
        lse = tl.load(LSE + (bh * G + g) * Tq + t, mask=r_ok, other=0.0)
        delta = tl.load(DELTA + (bh * G + g) * Tq + t, mask=r_ok, other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        vis = r_ok[:, None] & k_ok[None, :] & (pos_k[None, :] <= (q_start + t)[:, None])  # [BM, BS]
        sc = tl.dot(q, tl.trans(kb), input_precision=PREC, out_dtype=ACC) * scale
        p = tl.where(vis, tl.exp(sc - lse[:, None]), 0.0)
        dv += tl.dot(tl.trans(p.to(Q.dtype.element_ty).to(do.dtype)), do, input_precision=PREC, out_dtype=ACC)
        dp = tl.dot(do, tl.trans(vb), input_precision=PREC, out_dtype=ACC)
        ds = p * (dp - delta[:, None])
        dk += tl.dot(tl.trans(ds.to(Q.dtype.element_ty).to(q.dtype)), q, input_precision=PREC, out_dtype=ACC)
    out = tile * L_SEL * HD + offs_s[:, None] * HD + offs_d[None, :]
    sd_ok = (offs_s < L_SEL)[:, None] & d_ok[None, :]
    tl.store(DKP + out, dk * scale, mask=sd_ok)
    tl.store(DVP + out, dv, mask=sd_ok)


@triton.jit
def _dkv_reduce_kernel(
    DKP, DVP, SEG_TILE_FIRST, SEG_TILES, DK, DV, Tk, n_blocks,
    L_SEL: tl.constexpr, HD: tl.constexpr, BS: tl.constexpr, DP: tl.constexpr, ACC: tl.constexpr,
):
    """One program per (batch, KV head, block): sum its tiles' partials in tile order (deterministic)."""
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
    for i in range(first, first + n):
        dk += tl.load(DKP + i * L_SEL * HD + part, mask=sd_ok, other=0.0)
        dv += tl.load(DVP + i * L_SEL * HD + part, mask=sd_ok, other=0.0)
    pos_k = j * L_SEL + offs_s
    ok = sd_ok & (pos_k < Tk)[:, None]
    dst = (bh * Tk + pos_k[:, None]) * HD + offs_d[None, :]
    tl.store(DK + dst, dk.to(DK.dtype.element_ty), mask=ok)
    tl.store(DV + dst, dv.to(DV.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------- host side
def interpreter_active() -> bool:
    """True when this module's kernels were built for Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    return isinstance(_fwd_kernel, InterpretedFunction)


def _pow2(x: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(x))


def _meta(q: torch.Tensor, G: int, hd: int, l_sel: int) -> dict:
    """Compile-time constants shared by the kernels: tile sizes, accumulator dtype, dot precision."""
    f64 = q.dtype == torch.float64
    return dict(
        G=G, L_SEL=l_sel, HD=hd, BS=_pow2(l_sel), DP=_pow2(hd),
        ACC=tl.float64 if f64 else tl.float32,
        UPCAST=interpreter_active() and q.dtype in (torch.bfloat16, torch.float16),
        PREC="ieee" if q.dtype in (torch.float32, torch.float64) or interpreter_active() else "tf32",
    )


def _check(q, k, v, block_idx, q_start: int):
    B, H_kv, G, Tq, hd = q.shape
    if k.shape[:2] != (B, H_kv) or k.shape[3] != hd or v.shape != k.shape:
        raise ValueError(f"selected attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match")
    if k.shape[2] < q_start + Tq:
        raise ValueError(f"selected attention: {k.shape[2]} keys, but queries reach position {q_start + Tq - 1}")
    if block_idx.shape[:3] != (B, H_kv, Tq):
        raise ValueError(f"selected attention: block_idx {tuple(block_idx.shape)} does not match q {tuple(q.shape)}")
    if q.device.type == "cpu" and not interpreter_active():
        raise RuntimeError("the Triton selection kernels need a CUDA tensor, or TRITON_INTERPRET=1 set before triton is imported")


def selected_attention_fwd(q, k, v, block_idx, q_start: int, l_sel: int):
    """q [B, H_kv, G, Tq, hd], k/v [B, H_kv, Tk, hd], block_idx [B, H_kv, Tq, n] (-1 = none).

    Returns o [B, H_kv, G, Tq, hd] (q's dtype, contiguous) and lse [B, H_kv, G, Tq] (fp32; fp64 for fp64).
    """
    _check(q, k, v, block_idx, q_start)
    B, H_kv, G, Tq, hd = q.shape
    Tk, n = k.shape[2], block_idx.shape[-1]
    idx = block_idx.to(torch.int32).contiguous()
    o = torch.empty(B, H_kv, G, Tq, hd, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H_kv, G, Tq, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32, device=q.device)
    if Tq == 0:
        return o, lse
    meta = _meta(q, G, hd, l_sel)
    _fwd_kernel[(Tq, B * H_kv)](
        q, k, v, idx, o, lse, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        Tq, Tk, q_start, 1.0 / math.sqrt(hd), H_KV=H_kv, N_SEL=n, GP=_pow2(G), **meta,
    )
    return o, lse


@torch.no_grad()
def inverted_index(block_idx: torch.Tensor, n_blocks: int, kv_tile: int):
    """Which queries selected each block, cut into tiles of at most kv_tile queries. Torch ops only,
    static sizes (no host sync).

    block_idx [BH, Tq, n] (-1 = none). Segments s = bh * n_blocks + block. Returns
      queries [BH*Tq*n] int32: query positions (0-based in the chunk) sorted by segment, then position;
      tile_seg, tile_start, tile_count [n_tiles]: a tile's segment (spare tiles: a valid segment with
        count 0), its first entry in `queries`, its number of queries;
      seg_tile_first, seg_tiles [BH*n_blocks]: each segment's tiles are seg_tile_first .. + seg_tiles.
    n_tiles = BH*Tq*min(n, n_blocks) // kv_tile + BH*n_blocks bounds sum_s ceil(count_s / kv_tile).
    """
    BH, Tq, n = block_idx.shape
    dev = block_idx.device
    S = BH * n_blocks
    seg = block_idx.long() + (torch.arange(BH, device=dev) * n_blocks).view(BH, 1, 1)
    seg = torch.where(block_idx >= 0, seg, S).flatten()  # empty slots -> spare segment S (sorted last)
    _, order = torch.sort(seg, stable=True)
    queries = ((order // n) % Tq).to(torch.int32)
    counts = torch.zeros(S + 1, dtype=torch.long, device=dev).index_add_(0, seg, torch.ones_like(seg))[:S]
    seg_first = torch.cumsum(counts, 0) - counts
    seg_tiles = (counts + kv_tile - 1) // kv_tile
    seg_tile_first = torch.cumsum(seg_tiles, 0) - seg_tiles
    n_tiles = BH * Tq * min(n, n_blocks) // kv_tile + S
    used = seg_tiles.sum().view(1)
    tile_seg = torch.repeat_interleave(
        torch.arange(S + 1, device=dev), torch.cat((seg_tiles, n_tiles - used)), output_size=n_tiles
    )
    rank = torch.arange(n_tiles, device=dev) - torch.cat((seg_tile_first, used))[tile_seg]
    zero = counts.new_zeros(1)
    tile_start = torch.cat((seg_first, zero))[tile_seg] + rank * kv_tile
    tile_count = (torch.cat((counts, zero))[tile_seg] - rank * kv_tile).clamp(0, kv_tile)
    return queries, tile_seg.clamp_max(S - 1), tile_start, tile_count, seg_tile_first, seg_tiles


def selected_attention_bwd(q, k, v, block_idx, o, lse, d_o, q_start: int, l_sel: int,
                           kv_tile: int | None = None, block_rows: int | None = None):
    """Gradients (dq, dk, dv) of selected attention, shaped like q, k, v, in their dtypes.
    kv_tile / block_rows default to the module's KV_TILE / BLOCK_ROWS (read at call time)."""
    kv_tile, block_rows = kv_tile or KV_TILE, block_rows or BLOCK_ROWS
    B, H_kv, G, Tq, hd = q.shape
    Tk, n = k.shape[2], block_idx.shape[-1]
    acc_dtype = lse.dtype
    idx = block_idx.to(torch.int32).contiguous()
    delta = (d_o.to(acc_dtype) * o.to(acc_dtype)).sum(-1).contiguous()  # [B, H_kv, G, Tq]
    meta = _meta(q, G, hd, l_sel)
    scale = 1.0 / math.sqrt(hd)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(B, H_kv, Tk, hd, dtype=k.dtype, device=k.device)
    dv = torch.empty(B, H_kv, Tk, hd, dtype=v.dtype, device=v.device)
    if Tq == 0:
        return torch.zeros_like(q), dk.zero_(), dv.zero_()
    common = (*q.stride(), *k.stride(), *v.stride(), *d_o.stride())
    _dq_kernel[(Tq, B * H_kv)](
        q, k, v, idx, d_o, lse, delta, dq, *common, *dq.stride(),
        Tq, Tk, q_start, scale, H_KV=H_kv, N_SEL=n, GP=_pow2(G), **meta,
    )
    n_blocks = -(-Tk // l_sel)
    queries, tile_seg, tile_start, tile_count, seg_tile_first, seg_tiles = inverted_index(
        idx.view(B * H_kv, Tq, n), n_blocks, kv_tile
    )
    n_tiles = tile_seg.shape[0]
    dkp = torch.empty(n_tiles, l_sel, hd, dtype=acc_dtype, device=q.device)
    dvp = torch.empty(n_tiles, l_sel, hd, dtype=acc_dtype, device=q.device)
    _dkv_kernel[(n_tiles,)](
        q, k, v, d_o, lse, delta, queries, tile_seg, tile_start, tile_count, dkp, dvp, *common,
        Tq, Tk, q_start, scale, n_blocks, H_KV=H_kv, BM=_pow2(block_rows), **meta,
    )
    _dkv_reduce_kernel[(B * H_kv * n_blocks,)](
        dkp, dvp, seg_tile_first, seg_tiles, dk, dv, Tk, n_blocks,
        L_SEL=l_sel, HD=hd, BS=meta["BS"], DP=meta["DP"], ACC=meta["ACC"],
    )
    return dq, dk, dv


class TritonSelectedAttention(torch.autograd.Function):
    """Saves q, k, v, the int32 block indices, O and LSE; backward recomputes P from them."""

    @staticmethod
    def forward(ctx, q, k, v, block_idx, q_start: int, l_sel: int, kv_tile: int | None):
        o, lse = selected_attention_fwd(q, k, v, block_idx, q_start, l_sel)
        ctx.save_for_backward(q, k, v, block_idx.to(torch.int32), o, lse)
        ctx.q_start, ctx.l_sel, ctx.kv_tile = q_start, l_sel, kv_tile
        return o

    @staticmethod
    def backward(ctx, d_o):
        q, k, v, idx, o, lse = ctx.saved_tensors
        dq, dk, dv = selected_attention_bwd(q, k, v, idx, o, lse, d_o, ctx.q_start, ctx.l_sel, ctx.kv_tile)
        return dq, dk, dv, None, None, None, None


def triton_selected_attention(
    q: torch.Tensor,  # [B, H_kv, G, Tq, hd] queries at positions q_start ..
    k: torch.Tensor,  # [B, H_kv, Tk, hd] selection keys at positions 0 .. Tk-1 (Tk >= q_start + Tq)
    v: torch.Tensor,  # [B, H_kv, Tk, hd]
    block_idx: torch.Tensor,  # [B, H_kv, Tq, n] from select_blocks, -1 = none
    q_start: int,
    l_sel: int,
    tile: int | None = None,  # unused (the torch path's tile size); same signature as selected_attention
    kv_tile: int | None = None,  # queries per dK/dV program; None: KV_TILE
) -> torch.Tensor:  # [B, H_kv, G, Tq, hd]
    """Drop-in for nsa.attention.selection.selected_attention, differentiable in q, k, v."""
    dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)  # autocast may mix them
    return TritonSelectedAttention.apply(q.to(dtype), k.to(dtype), v.to(dtype), block_idx, q_start, l_sel, kv_tile)
