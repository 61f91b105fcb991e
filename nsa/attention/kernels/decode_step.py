"""NSA's three branches for one query per (batch row, KV head) over static decode caches, split over programs.

A decode step reads few keys per (batch row, KV head): at 32k the visible compressed keys (2,047), n picked blocks
of l' keys (1,024) and the window (512). One program walking them in order is latency-bound (each step of its loops
waits for a load; the picks wait for the top-n before their loads can start), and at batch 1 M7C has two such
programs on a GPU of 132 SMs. Here the work is split flash-decoding style into programs that each read a slice and
leave a partial softmax (running max m, denominator, unnormalised output), in four launches:

    1 partials      grid (B*H_kv, NS + NW)
                      program s < NS:  the compressed tokens [s*CH, (s+1)*CH) that are done (n_done of them):
                                       their scores q.ck^T [G, CH] into a scratch row (SC), a partial of o_cmp
                      program NS + k:  the window ring's slots [k*TW, (k+1)*TW) that are written (min(p+1, w))
    2 block scores  grid (B*H_kv, NB)  the log-sum-exp of each query row from step 1's NS compressed partials; for
                      the CB blocks [t*CB, (t+1)*CB): Eq. 9 from the scores in SC (block j: sum over its units u
                      of sum_{k < l/d} of the group's probability of token j*r + u - k, r = l'/d), blocks after the
                      current one -inf, block 0 / previous / current +inf -> BS
    3 picks         grid (B*H_kv, n)   program i: the i-th best block of BS (ties: the lowest index, a stable
                      sort's order; none when fewer blocks exist), a partial over its l' keys at or before p
    4 combine       grid (B*H_kv, 3)   one branch: its partials merged per query head -> o_cmp, o_sel, o_win
    -> o_cmp, o_sel, o_win [B, H_kv, G, hd] in q's dtype (stacked: [3, B, H_kv, G, hd]).

What nsa/attention/static_cache.py computes in ~20 torch ops (the oracle: its torch path, `kernel=torch`), for the
pooled selection only (a learned indexer, given picks or the distance cap take the torch path). Every grid is fixed
by the caches' sizes, not by the position (a device tensor), so a CUDA graph replays the step at any position:
programs whose slice holds nothing written yet store an empty partial (m = -inf, nothing added). Partials and scores
are fp32 (fp64 for fp64 inputs). Kernels only; the launcher is `decode_branches`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa.attention.kernels.interpreter import interpreter_active

TILE = 64  # compressed keys per step of a partial program's loop
WINDOW_TILE = 64  # window slots per program (TW)
MIN_CHUNK_TOKENS = 64  # the fewest compressed tokens a step-1 program takes (CH = CB * r >= this)
MAX_BLOCKS_PER_PROGRAM = 256  # CB's ceiling
TARGET_PROGRAMS = 256  # step 1's compressed programs over all (batch row, KV head): CH grows with B * H_kv * tokens


@triton.jit
def _scores(q, K, rows, ok, HD: tl.constexpr, ACC: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr):
    """q [GP, HD] against the keys K[rows] [TILE, HD] (rows not ok: -inf) -> [GP, TILE] in ACC."""
    k = tl.load(K + rows[:, None] * HD + tl.arange(0, HD)[None, :], mask=ok[:, None], other=0.0)
    kk = k.to(ACC) if UPCAST else k
    s = tl.dot(q, tl.trans(kk), input_precision=PREC, out_dtype=ACC)
    return tl.where(ok[None, :], s, float("-inf"))


@triton.jit
def _online(s, V, rows, ok, m, den, acc, HD: tl.constexpr, ACC: tl.constexpr, UPCAST: tl.constexpr,
            PREC: tl.constexpr):
    """One tile of an online softmax: scores s [GP, TILE] (masked -inf, at least one visible), values V[rows]."""
    v = tl.load(V + rows[:, None] * HD + tl.arange(0, HD)[None, :], mask=ok[:, None], other=0.0)
    m_new = tl.maximum(m, tl.max(s, 1))
    scale = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    den = den * scale + tl.sum(p, 1)
    vv = v.to(ACC) if UPCAST else v
    pv = p.to(vv.dtype) if not UPCAST else p
    acc = acc * scale[:, None] + tl.dot(pv, vv, input_precision=PREC, out_dtype=ACC)
    return m_new, den, acc


@triton.jit
def _load_query(Q, bh, G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, ACC: tl.constexpr, UPCAST: tl.constexpr):
    """The group's G query rows [GP, HD] (padded rows zero)."""
    g = tl.arange(0, GP)
    q = tl.load(Q + (bh * G + g[:, None]) * HD + tl.arange(0, HD)[None, :], mask=(g < G)[:, None], other=0.0)
    return q.to(ACC) if UPCAST else q


@triton.jit
def _store_partial(PM, PD, PA, slot, m, den, acc, GP: tl.constexpr, HD: tl.constexpr):
    """Partial `slot` (an index into [B*H_kv * NT]): m, den [GP], acc [GP, HD]."""
    g = tl.arange(0, GP)
    tl.store(PM + slot * GP + g, m)
    tl.store(PD + slot * GP + g, den)
    tl.store(PA + (slot * GP + g[:, None]) * HD + tl.arange(0, HD)[None, :], acc)


@triton.jit
def _n_done(pos, L: tl.constexpr, D: tl.constexpr):
    """Compressed tokens whose block has ended at position pos."""
    return tl.where(pos + 1 >= L, (pos + 1 - L) // D + 1, 0)


@triton.jit(do_not_specialize=["n_cmp"])
def decode_partials_kernel(
    Q, CK, CV, WK, WV, POS, SC, PM, PD, PA, n_cmp,
    G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, L: tl.constexpr, D: tl.constexpr, W: tl.constexpr,
    NS: tl.constexpr, NT: tl.constexpr, CH: tl.constexpr, TILE: tl.constexpr, TW: tl.constexpr,
    ACC: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
):
    """Step 1, program (bh, part). Q [B*H_kv, G, HD]; CK, CV [B*H_kv, n_cmp + 1, HD]; WK, WV [B*H_kv, W, HD];
    POS [] int64; SC [B*H_kv, GP, n_cmp] scores out; PM, PD [B*H_kv, NT, GP], PA [B*H_kv, NT, GP, HD] partials out:
    compressed chunk `part` into slot part (part < NS), window tile part - NS into slot part."""
    bh = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    pos = tl.load(POS).to(tl.int64)
    q = _load_query(Q, bh, G, GP, HD, ACC, UPCAST)
    g = tl.arange(0, GP)
    m = tl.full([GP], float("-inf"), ACC)
    den = tl.zeros([GP], ACC)
    acc = tl.zeros([GP, HD], ACC)
    if part < NS:  # compressed tokens [c0, c_end): scores kept for step 2, a partial of o_cmp
        t = tl.arange(0, TILE)
        c0 = part * CH
        c_end = tl.minimum(c0 + CH, _n_done(pos, L, D))
        CKb, CVb = CK + bh * (n_cmp + 1) * HD, CV + bh * (n_cmp + 1) * HD
        for start in range(c0, c_end, TILE):
            rows = start + t
            ok = rows < c_end
            s = _scores(q, CKb, rows, ok, HD, ACC, UPCAST, PREC)
            tl.store(SC + (bh * GP + g[:, None]) * n_cmp + rows[None, :], s, mask=ok[None, :])
            m, den, acc = _online(s, CVb, rows, ok, m, den, acc, HD, ACC, UPCAST, PREC)
    else:  # window slots [w0, w0 + TW) of the ring, those written
        rows = (part - NS) * TW + tl.arange(0, TW)
        ok = rows < tl.minimum(pos + 1, W)
        if (part - NS) * TW < tl.minimum(pos + 1, W):
            WKb, WVb = WK + bh * W * HD, WV + bh * W * HD
            s = _scores(q, WKb, rows, ok, HD, ACC, UPCAST, PREC)
            m, den, acc = _online(s, WVb, rows, ok, m, den, acc, HD, ACC, UPCAST, PREC)
    _store_partial(PM, PD, PA, bh * NT + part, m, den, acc, GP, HD)


@triton.jit(do_not_specialize=["n_cmp", "n_blocks"])
def decode_block_scores_kernel(
    POS, SC, PM, PD, BS, n_cmp, n_blocks,
    G: tl.constexpr, GP: tl.constexpr, L: tl.constexpr, D: tl.constexpr, L_SEL: tl.constexpr,
    NS: tl.constexpr, NSP: tl.constexpr, NT: tl.constexpr, CB: tl.constexpr, NBS: tl.constexpr, ACC: tl.constexpr,
):
    """Step 2, program (bh, t): BS [B*H_kv, NBS] for blocks [t*CB, (t+1)*CB) (those >= n_blocks are left)."""
    bh = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS).to(tl.int64)
    n_done = _n_done(pos, L, D)
    g = tl.arange(0, GP)
    g_ok = g < G
    # each query row's log-sum-exp over the visible compressed keys, from the NS partials of step 1
    s_idx = tl.arange(0, NSP)
    at = (bh * NT + s_idx[:, None]) * GP + g[None, :]  # [NSP, GP]
    pm = tl.load(PM + at, mask=(s_idx < NS)[:, None], other=float("-inf"))
    pd = tl.load(PD + at, mask=(s_idx < NS)[:, None], other=0.0)
    top = tl.max(pm, 0)  # [GP]
    top = tl.where(top > float("-inf"), top, 0.0)  # no partial holds a key: every weight 0
    weight = tl.where(pm > float("-inf"), tl.exp(pm - top[None, :]), 0.0)
    total = tl.sum(pd * weight, 0)
    lse = tl.where(total > 0, top + tl.log(tl.where(total > 0, total, 1.0)), 0.0)  # rows that see nothing: unused

    M: tl.constexpr = L // D  # units a compressed token spans
    R: tl.constexpr = L_SEL // D  # units a selection block spans
    blocks = tl.program_id(1) * CB + tl.arange(0, CB)
    score = tl.zeros([CB], ACC)
    for u in tl.static_range(R):
        for k in tl.static_range(M):
            tok = blocks.to(tl.int64) * R + u - k
            ok = g_ok[:, None] & ((tok >= 0) & (tok < n_done))[None, :]  # [GP, CB]
            s = tl.load(SC + (bh * GP + g[:, None]) * n_cmp + tok[None, :], mask=ok, other=0.0)
            score += tl.sum(tl.where(ok, tl.exp(s - lse[:, None]), 0.0), 0)
    current = pos // L_SEL
    score = tl.where(blocks <= current, score, float("-inf"))
    score = tl.where((blocks == 0) | ((blocks >= current - 1) & (blocks <= current)), float("inf"), score)
    tl.store(BS + bh * NBS + blocks, score, mask=blocks < n_blocks)


@triton.jit(do_not_specialize=["n_blocks", "n_sel_keys"])
def decode_picks_kernel(
    Q, SK, SV, POS, BS, PM, PD, PA, n_blocks, n_sel_keys,
    G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, L_SEL: tl.constexpr, NBP: tl.constexpr,
    NBS: tl.constexpr, FIRST: tl.constexpr, NT: tl.constexpr,
    ACC: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
):
    """Step 3, program (bh, i): the i-th best block of BS (removing the i better ones first, ties to the lowest
    index), a partial over its keys at or before pos into slot FIRST + i. SK, SV [B*H_kv, n_sel_keys, HD]."""
    bh = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    pos = tl.load(POS).to(tl.int64)
    blocks = tl.arange(0, NBP)
    score = tl.load(BS + bh * NBS + blocks, mask=blocks < n_blocks, other=float("-inf"))
    best = tl.argmax(score, 0)
    for _ in range(0, i):
        score = tl.where(blocks == best, float("-inf"), score)
        best = tl.argmax(score, 0)  # the lowest index among equal scores
    m = tl.full([GP], float("-inf"), ACC)
    den = tl.zeros([GP], ACC)
    acc = tl.zeros([GP, HD], ACC)
    if tl.max(score, 0) > float("-inf"):  # else fewer than i + 1 blocks exist: no pick
        q = _load_query(Q, bh, G, GP, HD, ACC, UPCAST)
        rows = best.to(tl.int64) * L_SEL + tl.arange(0, L_SEL)
        ok = rows <= pos
        SKb, SVb = SK + bh * n_sel_keys * HD, SV + bh * n_sel_keys * HD
        s = _scores(q, SKb, rows, ok, HD, ACC, UPCAST, PREC)
        m, den, acc = _online(s, SVb, rows, ok, m, den, acc, HD, ACC, UPCAST, PREC)
    _store_partial(PM, PD, PA, bh * NT + FIRST + i, m, den, acc, GP, HD)


@triton.jit
def decode_combine_kernel(
    PM, PD, PA, O,
    G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, NS: tl.constexpr, NW: tl.constexpr, NP: tl.constexpr,
    NT: tl.constexpr, NTP: tl.constexpr,
):
    """Step 4, program (bh, branch): partials [lo, lo + count) of branch 0 (compressed: slots [0, NS)), 1 (picks:
    [NS + NW, NT)) or 2 (window: [NS, NS + NW)) merged per query head -> O [3, B*H_kv, G, HD] (no key: zero)."""
    bh = tl.program_id(0).to(tl.int64)
    branch = tl.program_id(1)
    lo = tl.where(branch == 0, 0, tl.where(branch == 1, NS + NW, NS))
    count = tl.where(branch == 0, NS, tl.where(branch == 1, NP, NW))
    j = tl.arange(0, NTP)
    ok = j < count
    slot = bh * NT + lo + j  # [NTP]
    g = tl.arange(0, GP)
    m = tl.load(PM + slot[:, None] * GP + g[None, :], mask=ok[:, None], other=float("-inf"))  # [NTP, GP]
    den = tl.load(PD + slot[:, None] * GP + g[None, :], mask=ok[:, None], other=0.0)
    top = tl.max(m, 0)
    top = tl.where(top > float("-inf"), top, 0.0)  # no partial holds a key: every weight 0
    weight = tl.where(m > float("-inf"), tl.exp(m - top[None, :]), 0.0)  # [NTP, GP]
    total = tl.sum(den * weight, 0)  # [GP]
    scale = weight / tl.where(total > 0, total, 1.0)[None, :]  # no key (compressed, early): output 0
    dd = tl.arange(0, HD)
    for h in tl.static_range(G):  # one query head at a time: [NTP, HD] partial outputs
        acc = tl.load(PA + (slot[:, None] * GP + h) * HD + dd[None, :], mask=ok[:, None], other=0.0)
        w_h = tl.sum(tl.where(g[None, :] == h, scale, 0.0), 1)  # [NTP] column h of scale
        out = tl.sum(acc * w_h[:, None], 0)
        tl.store(O + ((branch * tl.num_programs(0) + bh) * G + h) * HD + dd, out.to(O.dtype.element_ty))


def split_sizes(batch_heads: int, n_cmp: int, n_blocks: int, units_per_block: int) -> tuple[int, int]:
    """(CB, NB): selection blocks per step-2 program (a power of two) and step 2's programs per (batch row, KV head).
    Step 1's compressed programs take the CH = CB * r tokens under those blocks: at least MIN_CHUNK_TOKENS, more
    when B * H_kv * n_cmp / TARGET_PROGRAMS is larger (fewer, longer programs once the batch fills the GPU)."""
    want_tokens = max(MIN_CHUNK_TOKENS, -(-batch_heads * n_cmp // TARGET_PROGRAMS))
    cb = min(MAX_BLOCKS_PER_PROGRAM, triton.next_power_of_2(-(-want_tokens // units_per_block)))
    return cb, -(-n_blocks // cb)


def decode_branches(
    qg: torch.Tensor,  # [B, H_kv, G, hd] the query at position pos, pre-scaled by 1/sqrt(hd)
    cmp_k: torch.Tensor,  # [B, H_kv, C + 1, hd] compressed keys (slot C: scratch, never read)
    cmp_v: torch.Tensor,
    sel_k: torch.Tensor,  # [B, H_kv, N_b * l', hd] selection keys of every position
    sel_v: torch.Tensor,
    win_k: torch.Tensor,  # [B, H_kv, w, hd] the window ring (position s in slot s % w)
    win_v: torch.Tensor,
    pos: torch.Tensor,  # [] int64, on the device
    l: int, d: int, l_sel: int, n_sel: int,
) -> torch.Tensor:  # [3, B, H_kv, G, hd] o_cmp, o_sel, o_win stacked, in qg's dtype
    B, H_kv, G, hd = qg.shape
    if hd & (hd - 1) or hd < 16 or l_sel & (l_sel - 1) or l_sel < 16:
        raise ValueError(f"decode_branches: head dim {hd} and l' {l_sel} must be powers of two >= 16")
    n_cmp, n_sel_keys, w = cmp_k.shape[2] - 1, sel_k.shape[2], win_k.shape[2]
    n_blocks = n_sel_keys // l_sel
    BH = B * H_kv
    qg, cmp_k, cmp_v, sel_k, sel_v, win_k, win_v = (
        x.contiguous() for x in (qg, cmp_k, cmp_v, sel_k, sel_v, win_k, win_v))
    r = l_sel // d
    cb, nb = split_sizes(BH, n_cmp, n_blocks, r)
    ch = cb * r  # compressed tokens per step-1 program
    ns = max(1, -(-n_cmp // ch))
    nw = -(-w // WINDOW_TILE)
    n_pick = min(n_sel, n_blocks)
    nt = ns + nw + n_pick
    gp = max(16, triton.next_power_of_2(G))
    nbs = nb * cb
    wide = torch.float64 if qg.dtype == torch.float64 else torch.float32
    scores = torch.empty(BH, gp, max(n_cmp, 1), dtype=wide, device=qg.device)  # each token's score per query row
    block_scores = torch.empty(BH, nbs, dtype=wide, device=qg.device)
    part_m = torch.empty(BH, nt, gp, dtype=wide, device=qg.device)
    part_den = torch.empty_like(part_m)
    part_acc = torch.empty(BH, nt, gp, hd, dtype=wide, device=qg.device)
    out = torch.empty(3, B, H_kv, G, hd, dtype=qg.dtype, device=qg.device)
    interpreted = interpreter_active()
    common = dict(ACC=tl.float64 if wide == torch.float64 else tl.float32,
                  UPCAST=interpreted and qg.dtype in (torch.bfloat16, torch.float16),
                  PREC="ieee" if qg.dtype in (torch.float32, torch.float64) or interpreted else "tf32")
    decode_partials_kernel[(BH, ns + nw)](
        qg, cmp_k, cmp_v, win_k, win_v, pos, scores, part_m, part_den, part_acc, max(n_cmp, 1),
        G=G, GP=gp, HD=hd, L=l, D=d, W=w, NS=ns, NT=nt, CH=ch, TILE=min(TILE, max(16, triton.next_power_of_2(ch))),
        TW=WINDOW_TILE, **common)
    decode_block_scores_kernel[(BH, nb)](
        pos, scores, part_m, part_den, block_scores, max(n_cmp, 1), n_blocks,
        G=G, GP=gp, L=l, D=d, L_SEL=l_sel, NS=ns, NSP=triton.next_power_of_2(ns), NT=nt, CB=cb, NBS=nbs,
        ACC=common["ACC"])
    decode_picks_kernel[(BH, n_pick)](
        qg, sel_k, sel_v, pos, block_scores, part_m, part_den, part_acc, n_blocks, n_sel_keys,
        G=G, GP=gp, HD=hd, L_SEL=l_sel, NBP=triton.next_power_of_2(n_blocks), NBS=nbs, FIRST=ns + nw, NT=nt,
        **common)
    decode_combine_kernel[(BH, 3)](
        part_m, part_den, part_acc, out, G=G, GP=gp, HD=hd, NS=ns, NW=nw, NP=n_pick, NT=nt,
        NTP=triton.next_power_of_2(max(ns, nw, n_pick)))
    return out
