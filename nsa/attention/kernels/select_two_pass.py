"""NSA top-n block selection in two launches: every query's block scores written out, then each row's top-n.

Same result as the torch path `nsa.attention.impl.block_select.select_by_score` and as the one-launch kernel
(kernels/select_topk.py `fused_select_blocks`), ties included. Why two launches: the fused kernel merges each chunk
of BJ block scores into a running top-n held in registers, and that merge is most of its chunk loop. Compiled for
sm_90 (bf16, M7C's shape, Triton 3.9), the fused kernel's chunk loop is 1,896 instructions with 74 barriers (each
a shared-memory round trip: the merge's rank counting, the group sum's layout changes) at 189 registers a thread
(2 programs an SM); the same loop storing the scores instead (here) is 666 instructions with 22 barriers at 104
registers (4 programs an SM). The second GPU session measured the fused kernel at 5.3 ms at 32k (before Eq. 8
sharing removed its first pass) against a ~0.07 ms roofline: a chain of barrier-separated steps with little
resident to hide it (docs/BENCHMARKS.md, the chunk loops counted from the SASS).

    1 block scores  grid (cdiv(Tq, BT), B*H_kv): the fused kernel's programs (GP*BT (head, query) rows of one KV
                      group) and its pass 2 chunk by chunk (select_topk._pooled_rows: Eq. 9-10 per chunk of BJ
                      blocks, the compressed branch's log-sum-exps given or pass 1 here), each chunk's scores
                      stored to S [B, H_kv, Tq, blocks] (fp32; fp64 for fp64 inputs) up to the tile's last current
                      block; nothing merged. Packed documents (a frame: q_pos, k_base, c_base per query):
                      select_topk.pooled_mass_tile with every query a row, each over its own document's compressed
                      tokens at its position in it, one document of the tile at a time (the learned indexer's
                      target loop), every document-relative block the chunk's queries may reach (0 past what a
                      row sees).
    2 top-n         grid (cdiv(Tq, BR), B*H_kv): BR rows of S whole in registers ([BR, NBP], NBP = the row's
                      blocks padded to a power of two, <= MAX_ROW_BLOCKS; a row within one warp up to 1,024 blocks,
                      so its counts and sums are shuffles, no barrier; a query at q_start + t, or at its frame's
                      q_pos): each score's bits as an integer key (scores are sums of probabilities, >= 0, and
                      non-negative floats order as their bits; a NaN clamped to +inf's bits), forced blocks (0,
                      previous, current) +inf's bits, blocks after the current -1; the k-th largest key (k =
                      min(n, c + 1)) by bisection over the key range (31 rounds of a count per row, 63 for fp64);
                      every key above it kept, and of those equal to it the lowest-indexed (a cumulative sum):
                      select_blocks' rule exactly; the kept blocks stored ascending by a second cumulative sum,
                      -1 after them.

Traffic: S is written once and read once (M7C at 32k, batch 1: at most 2 x 32,768 x 512 x 4 B = 128 MiB each way,
half of it without documents; ~0.06 ms at an H200's 4.3 TB/s; 512 MiB at 64k). Above SCORE_BYTES (1 GiB) the
queries run in consecutive chunks, a launch pair each, each chunk's S as wide as its last query's blocks (with
documents too: a position within a document never exceeds the absolute one). Rows wider than MAX_ROW_BLOCKS blocks
(over 256k tokens at l' = 64) take the fused kernel: `applies` decides. Kernels and launcher; nsa/attention/ops.py
chooses.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa.attention.kernels.interpreter import interpreter_active
from nsa.attention.kernels.select_topk import (_pooled_rows, _row_lse, checked_select_args, kernel_constexprs,
                                               num_stages, pooled_mass_tile)

SCORE_BYTES = 1 << 30  # most bytes of block scores one launch pair writes (read at call time)
MAX_ROW_BLOCKS = 4096  # NBP: a row's blocks the top-n kernel holds in registers; longer rows take the fused kernel
WARP_ROW_BLOCKS = 1024  # a row's blocks one warp of the top-n kernel holds (32 a lane); longer rows take more warps
LANE_KEYS = 16  # keys a lane holds when rows are short (several rows a warp)
MAX_TOPN_ROWS = 16
# keys a top-n program holds in Triton's interpreter (0: the GPU's tiling there too). The interpreter runs each of a
# program's ops as one numpy call whatever its size, so a float64 row's 63 bisection rounds cost the same for 16 rows
# as for 2,048: fewer, larger programs there. Each row's arithmetic is the same; tests run both tilings.
INTERPRETER_ROW_KEYS = 1 << 14


@triton.jit(do_not_specialize=["q_start", "Tq", "N_c"])  # new chunk offsets / lengths: no recompile
def _block_scores_kernel(
    Q, CK, LSE, S,
    sqb, sqh, sqg, sqt, sqd,
    skb, skh, skn, skd,
    slb, slh, slg, slt,
    ssb, ssh, sst, ssj,
    q_start, Tq, N_c,
    H_KV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, DP: tl.constexpr,
    L: tl.constexpr, D: tl.constexpr, L_SEL: tl.constexpr, BT: tl.constexpr, BJ: tl.constexpr,
    SHIFT: tl.constexpr, SCALE: tl.constexpr, RUP: tl.constexpr, ACC: tl.constexpr, UPCAST: tl.constexpr,
    PREC: tl.constexpr, HAS_LSE: tl.constexpr,
):
    """S[b, h, t, j] = query t's group-summed compressed mass in block j (Eq. 9-10), for j up to the current block
    of the tile's last query (later columns are not written)."""
    R: tl.constexpr = GP * BT  # rows: (head, query) pairs, row = g * BT + t
    q0 = tl.program_id(0) * BT
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H_KV
    h = bh % H_KV
    offs_r = tl.arange(0, R)
    row_g = offs_r // BT
    row_q = q0 + offs_r % BT  # [R] query index in 0 .. Tq-1
    row_ok = (row_g < G) & (row_q < Tq)
    offs_d = tl.arange(0, DP)
    d_ok = offs_d < HD
    q = tl.load(Q + b * sqb + h * sqh + row_g[:, None] * sqg + row_q[:, None].to(tl.int64) * sqt + offs_d[None, :] * sqd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [R, DP]
    if UPCAST:  # the interpreter has no bf16/fp16 matmul
        q = q.to(tl.float32)
    ck_tile = CK + b * skb + h * skh + offs_d[None, :] * skd  # [1, DP] pointers of token 0
    row_pos = q_start + row_q  # [R] absolute positions
    last = q_start + tl.minimum(q0 + BT, Tq) - 1  # the tile's last query position
    if HAS_LSE:  # the compressed branch's log-sum-exps (Eq. 8's softmax, shared)
        lse = tl.load(LSE + b * slb + h * slh + row_g.to(tl.int64) * slg + row_q.to(tl.int64) * slt,
                      mask=row_ok, other=0.0).to(ACC)
        lse = tl.where(lse > float("-inf"), lse, 0.0)  # a row that sees no token: p = 0
    else:
        lse = _row_lse(q, ck_tile, skn, d_ok, row_pos, row_ok, last, N_c, L, D, R, BJ * RUP, SCALE, ACC, UPCAST, PREC)
    t = q0 + tl.arange(0, BT)
    out = S + b * ssb + h * ssh + t.to(tl.int64)[:, None] * sst  # [BT, 1]
    _pooled_rows(q, ck_tile, skn, d_ok, row_pos, row_ok, lse, last, N_c, out, ssj, t < Tq, last // L_SEL + 1,
                 GP, L, D, L_SEL, BT, BJ, SHIFT, SCALE, RUP, ACC, UPCAST, PREC, True)


@triton.jit(do_not_specialize=["Tq", "N_c", "n_blocks"])
def _block_scores_frame_kernel(
    Q, CK, LSE, S, FRAME,
    sqb, sqh, sqg, sqt, sqd,
    skb, skh, skn, skd,
    slb, slh, slg, slt,
    ssb, ssh, sst, ssj,
    sf0, sf1, sf2,
    Tq, N_c, n_blocks,
    H_KV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, DP: tl.constexpr,
    L: tl.constexpr, D: tl.constexpr, L_SEL: tl.constexpr, BT: tl.constexpr, BJ: tl.constexpr,
    SHIFT: tl.constexpr, SCALE: tl.constexpr, RUP: tl.constexpr, ACC: tl.constexpr, UPCAST: tl.constexpr,
    PREC: tl.constexpr, HAS_LSE: tl.constexpr,
):
    """Packed documents (frame [3, B, Tq]: q_pos, k_base, c_base): S[b, h, t, j] for every document-relative block
    j < n_blocks, each query over its own document's compressed tokens at its position in the document (0 past what
    it sees): select_topk.pooled_mass_tile with every query a row, one document of the tile at a time."""
    bh = tl.program_id(1).to(tl.int64)
    pooled_mass_tile(Q, CK, LSE, S, FRAME, sqb, sqh, sqg, sqt, sqd, skb, skh, skn, skd, slb, slh, slg, slt,
                     ssb, ssh, sst, ssj, sf0, sf1, sf2, bh // H_KV, bh % H_KV, tl.program_id(0) * BT, Tq, Tq, Tq, N_c,
                     n_blocks, G, GP, HD, DP, L, D, L_SEL, BT, BJ, SHIFT, SCALE, RUP, ACC, UPCAST, PREC, HAS_LSE, True)


@triton.jit(do_not_specialize=["q_start", "Tq"])
def _top_n_kernel(
    S, OUT, FRAME,
    ssb, ssh, sst, ssj,
    sob, soh, sot, sos,
    sf1, sf2,
    q_start, Tq, width,
    H_KV: tl.constexpr, L_SEL: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, BR: tl.constexpr,
    NBP: tl.constexpr, KEY: tl.constexpr, INF_KEY: tl.constexpr, KEY_BITS: tl.constexpr, HAS_FRAME: tl.constexpr,
):
    """OUT[b, h, t] = the top-n blocks of S[b, h, t] (block 0, the previous and the current block forced; only
    blocks up to the current compete; ties -> the lower block), ascending, -1 last. Query t is at position
    q_start + t, or with a frame at FRAME[0, b, t] (its document's; the blocks document-relative). Columns past
    `width` are never read (a position beyond them keeps the blocks within)."""
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H_KV
    h = bh % H_KV
    t = tl.program_id(0) * BR + tl.arange(0, BR)  # [BR]
    t_ok = t < Tq
    if HAS_FRAME:
        pos = tl.load(FRAME + b * sf1 + t.to(tl.int64) * sf2, mask=t_ok, other=0).to(tl.int32)  # [BR]
    else:
        pos = q_start + t
    current = pos // L_SEL  # [BR]
    blk = tl.arange(0, NBP)  # [NBP]
    allowed = t_ok[:, None] & (blk[None, :] <= current[:, None]) & (blk < width)[None, :]  # [BR, NBP]
    s = tl.load(S + b * ssb + h * ssh + t.to(tl.int64)[:, None] * sst + blk[None, :] * ssj, mask=allowed, other=0.0)
    # scores >= 0: their bits order as the values do (a NaN's bits are clamped into range: kept counts stay exact)
    key = tl.maximum(tl.minimum(s.to(KEY, bitcast=True), INF_KEY), 0)
    forced = (blk[None, :] == 0) | (blk[None, :] == current[:, None]) | (blk[None, :] == current[:, None] - 1)
    key = tl.where(allowed, tl.where(forced, INF_KEY, key), -1)
    k = tl.minimum(tl.minimum(current + 1, width), N)  # [BR] blocks a row keeps: every competing one, at most n
    # the k-th largest key: the largest v with #(key >= v) >= k, by bisection over the keys' range (every allowed key
    # is >= 0, so #(key >= 0) >= k holds at the start, and #(key >= INF_KEY + 1) = 0 < k)
    lo = tl.zeros([BR], dtype=KEY)
    hi = tl.full([BR], INF_KEY + 1, dtype=KEY)
    # a loop, not unrolled: unrolled, Triton 3.6 (the GPU image's) spilled 12 B at 4 warps (rows of 4,096 blocks) on
    # sm_90; rolled, no version spills and 3.9 holds fewer registers (M7C's shapes 70-119 instead of 72-146)
    for _ in range(KEY_BITS):  # hi - lo halves each round: lo + 1 == hi after ceil(log2(INF_KEY + 1))
        mid = lo + (hi - lo) // 2
        enough = tl.sum((key >= mid[:, None]).to(tl.int32), axis=1) >= k
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid)
    above = key > lo[:, None]  # [BR, NBP] every block above the k-th key is kept
    tied = key == lo[:, None]  # of those equal to it, the lowest-indexed fill the remaining places
    places = k - tl.sum(above.to(tl.int32), axis=1)
    kept = above | (tied & (tl.cumsum(tied.to(tl.int32), axis=1) <= places[:, None]))  # exactly k a row
    slot = tl.cumsum(kept.to(tl.int32), axis=1) - 1  # ascending compaction
    out = OUT + b * sob + h * soh + t.to(tl.int64)[:, None] * sot  # [BR, 1]
    tl.store(out + slot * sos, (blk[None, :] + tl.zeros([BR, NBP], dtype=tl.int32)).to(tl.int64),
             mask=kept & t_ok[:, None] & (slot < N))  # slot < N holds already: no write can leave the row
    slots = tl.arange(0, NP)
    tl.store(out + slots[None, :] * sos, tl.full([BR, NP], -1, dtype=tl.int64),
             mask=t_ok[:, None] & (slots[None, :] >= k[:, None]) & (slots < N)[None, :])


def row_blocks(q_start: int, Tq: int, l_sel: int) -> int:
    """Blocks a call's last query may pick from: its current block and every one before."""
    return (q_start + Tq - 1) // l_sel + 1


def applies(q_start: int, Tq: int, l_sel: int) -> bool:
    """Whether selection runs in two launches (else the fused kernel): rows of at most MAX_ROW_BLOCKS blocks."""
    return Tq > 0 and triton.next_power_of_2(row_blocks(q_start, Tq, l_sel)) <= MAX_ROW_BLOCKS


def query_chunk(B: int, H_kv: int, Tq: int, width: int, elem: int) -> int:
    """Queries per launch pair: S of [B, H_kv, chunk, width] within SCORE_BYTES; at least one."""
    return max(1, min(Tq, SCORE_BYTES // (B * H_kv * width * elem)))


def top_n_programs(nbp: int) -> tuple[int, int]:
    """(rows, warps) of a top-n program for rows of nbp (a power of two) blocks: a row within one warp up to
    WARP_ROW_BLOCKS blocks (its counts and sums are shuffles, no barrier), several short rows a warp."""
    return max(1, min(MAX_TOPN_ROWS, 32 * LANE_KEYS // nbp)), max(1, nbp // WARP_ROW_BLOCKS)


@torch.no_grad()
def two_pass_select_blocks(
    q: torch.Tensor,  # [B, H_kv, G, Tq, hd] queries (RoPE applied) at positions q_start .., any strides
    ck: torch.Tensor,  # [B, H_kv, N_c, hd] compressed keys (RoPE applied); token i covers [i*d, i*d + l)
    q_start: int,
    l: int,
    d: int,
    l_sel: int,
    n: int,
    frame: torch.Tensor | None = None,  # [3, B, Tq] int64 (q_pos, k_base, c_base): documents
    lse: torch.Tensor | None = None,  # [B, H_kv, G, Tq] the compressed branch's log-sum-exps (Eq. 8), any strides
) -> torch.Tensor:  # [B, H_kv, Tq, n] int64 block indices, ascending; -1 pads |I_p| = min(n, p // l' + 1)
    """Top-n selection blocks per query as fused_select_blocks (the same contract and checks), in two launches per
    chunk of queries (one chunk unless S exceeds SCORE_BYTES). No host sync. With a frame, q_start is still the
    absolute position of query 0 (0 for a window's layout, documents.compressed_layout): a position within a
    document never exceeds the absolute one, so row_blocks(q_start, Tq, l') bounds every document-relative block
    (a frame breaking that keeps each query's picks within the bound)."""
    q, ck = checked_select_args("two_pass_select_blocks", q, ck, q_start, l, d, l_sel, n, frame, lse)
    B, H_kv, G, Tq, hd = q.shape
    out = torch.empty(B, H_kv, Tq, n, dtype=torch.long, device=q.device)
    if out.numel() == 0:
        return out
    if not applies(q_start, Tq, l_sel):
        raise ValueError(f"two_pass_select_blocks: {row_blocks(q_start, Tq, l_sel)} blocks a row exceed "
                         f"{MAX_ROW_BLOCKS} (the fused kernel takes such rows)")
    meta = kernel_constexprs(q.dtype, G, hd, l, d, l_sel, n)
    meta.pop("N"), meta.pop("NP")
    acc = torch.promote_types(q.dtype, torch.float32)
    chunk = query_chunk(B, H_kv, Tq, row_blocks(q_start, Tq, l_sel), acc.itemsize)
    for a in range(0, Tq, chunk):
        t_n = min(chunk, Tq - a)
        cols = row_blocks(q_start + a, t_n, l_sel)  # the blocks this chunk's queries may reach
        scores = torch.empty(B, H_kv, t_n, cols, dtype=acc, device=q.device)
        q_a = q[:, :, :, a:a + t_n]
        lse_arg, l_strides = (ck, (0, 0, 0, 0)) if lse is None else (lse[..., a:a + t_n], lse.stride())
        grid = (triton.cdiv(t_n, meta["BT"]), B * H_kv)
        common = dict(H_KV=H_kv, **meta, HAS_LSE=lse is not None, num_stages=num_stages(q.dtype, hd),
                      maxnreg=255)  # as the fused kernel's
        if frame is None:
            _block_scores_kernel[grid](q_a, ck, lse_arg, scores, *q_a.stride(), *ck.stride(), *l_strides,
                                       *scores.stride(), q_start + a, t_n, ck.shape[2], **common)
        else:
            f_a = frame[:, :, a:a + t_n]
            _block_scores_frame_kernel[grid](q_a, ck, lse_arg, scores, f_a, *q_a.stride(), *ck.stride(), *l_strides,
                                             *scores.stride(), *f_a.stride(), t_n, ck.shape[2], cols, **common)
        top_n_rows(scores, q_start + a, l_sel, n, out=out[:, :, a:a + t_n],
                   positions=None if frame is None else frame[0, :, a:a + t_n])
    return out


@torch.no_grad()
def top_n_rows(
    scores: torch.Tensor,  # [B, H_kv, Tq, >= row_blocks(q_start, Tq, l')] block scores (>= 0), any strides; only
    # blocks up to each query's current one are read
    q_start: int,
    l_sel: int,
    n: int,
    out: torch.Tensor | None = None,  # [B, H_kv, Tq, n] int64 to write into (a view is fine)
    positions: torch.Tensor | None = None,  # [B, Tq] int64 each query's position within its document (packed
    # documents: the blocks document-relative), at most its absolute one q_start + t; default q_start + t
) -> torch.Tensor:  # [B, H_kv, Tq, n] int64, ascending, -1 last: impl.selection.select_blocks(scores, ...)
    """Launch 2 alone: each row's top-n blocks as impl.selection.select_blocks picks them (block 0, the previous and
    the current block forced; ties -> the lower block). One launch. Columns from row_blocks(q_start, Tq, l') on are
    never read (a position past them keeps the picks within)."""
    B, H_kv, Tq, width = scores.shape
    cols = row_blocks(q_start, Tq, l_sel)
    if width < cols or not applies(q_start, Tq, l_sel) or scores.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"top_n_rows: scores {scores.dtype} {tuple(scores.shape)} need fp32 / fp64 and "
                         f"{cols} <= blocks (<= {MAX_ROW_BLOCKS} padded)")
    if positions is not None and (positions.shape != (B, Tq) or positions.device != scores.device):
        raise ValueError(f"top_n_rows: positions must be [{B}, {Tq}] on {scores.device}, got "
                         f"{tuple(positions.shape)} on {positions.device}")
    if out is None:
        out = torch.empty(B, H_kv, Tq, n, dtype=torch.long, device=scores.device)
    if out.numel() == 0:
        return out
    nbp = triton.next_power_of_2(cols)
    rows, warps = top_n_programs(nbp)
    if interpreter_active() and INTERPRETER_ROW_KEYS:
        rows = max(rows, min(INTERPRETER_ROW_KEYS // nbp, triton.next_power_of_2(Tq)))
    f64 = scores.dtype == torch.float64
    pos, p_strides = (scores, (0, 0)) if positions is None else (positions, positions.stride())  # unread without
    _top_n_kernel[(triton.cdiv(Tq, rows), B * H_kv)](
        scores, out, pos, *scores.stride(), *out.stride(), *p_strides, q_start, Tq, cols, H_KV=H_kv, L_SEL=l_sel,
        N=n, NP=triton.next_power_of_2(n), BR=rows, NBP=nbp, KEY=tl.int64 if f64 else tl.int32,
        INF_KEY=0x7FF0000000000000 if f64 else 0x7F800000, KEY_BITS=63 if f64 else 31,
        HAS_FRAME=positions is not None, num_warps=warps)
    return out
