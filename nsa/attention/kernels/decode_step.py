"""NSA's three branches for one query per (batch row, KV head) over static decode caches, in one launch.

    program (b, h_kv):  q [G, hd] (pre-scaled) at position p
      compressed: the visible compressed keys (n_done of them): pass 1 their log-sum-exp, pass 2 the probabilities,
                  o_cmp, and the group's summed probabilities per compressed token into a scratch row
      scores:     Eq. 9 from that row (block j: sum over its units u of sum_{k < l/d} p[u - k]), blocks after the
                  current one -inf, block 0 / previous / current +inf
      selected:   n times the best remaining block (ties: the lowest index, a stable sort's order), its l' keys at or
                  before p, one online softmax over all picks
      window:     the ring's min(p + 1, w) written slots
    -> o_cmp, o_sel, o_win [B, H_kv, G, hd] in q's dtype.

What nsa/attention/static_cache.py computes in ~20 torch ops (the oracle: its torch path, `kernel=torch`), for the
pooled selection only (a learned indexer, given picks or the distance cap take the torch path). A decode step is
launch-bound: one launch here replaces the compressed attention, block scores, sort, gathers and two more attentions.
The loops stop at what is written (n_done compressed tokens, min(p + 1, w) window slots), where the torch path
reads its buffers whole. One program per (b, h_kv) is latency-bound at batch 1 (two programs for M7C); splitting the
compressed pass over programs is the next step if a GPU says so. Kernels only; the launcher is `decode_branches`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa.attention.kernels.interpreter import interpreter_active

TILE = 64  # keys per step of the compressed and window loops


@triton.jit
def _scores(q, K, rows, ok, HD: tl.constexpr, ACC: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr):
    """q [GP, HD] against the keys K[rows] [TILE, HD] (rows not ok: -inf) -> [GP, TILE] in ACC, and the keys' tile."""
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


@triton.jit(do_not_specialize=["n_cmp", "n_sel_keys"])
def decode_branches_kernel(
    Q, CK, CV, SK, SV, WK, WV, POS, PG, OC, OS, OW,
    n_cmp, n_sel_keys,
    G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, L: tl.constexpr, D: tl.constexpr, L_SEL: tl.constexpr,
    N_PICK: tl.constexpr, W: tl.constexpr, NBP: tl.constexpr, TILE: tl.constexpr,
    ACC: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
):
    """Program bh = b * H_kv + h_kv. Q, O* [B*H_kv, G, HD]; CK, CV [B*H_kv, n_cmp + 1, HD]; SK, SV [B*H_kv,
    n_sel_keys, HD]; WK, WV [B*H_kv, W, HD] (all contiguous); POS [] int64; PG [B*H_kv, n_cmp] scratch in ACC."""
    bh = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS).to(tl.int64)
    g = tl.arange(0, GP)
    g_ok = g < G
    dd = tl.arange(0, HD)
    q = tl.load(Q + (bh * G + g[:, None]) * HD + dd[None, :], mask=g_ok[:, None], other=0.0)
    q = q.to(ACC) if UPCAST else q
    t = tl.arange(0, TILE)

    # ---- compressed branch: pass 1, the log-sum-exp of each query row over the visible compressed keys
    n_done = tl.where(pos + 1 >= L, (pos + 1 - L) // D + 1, 0)
    CKb, CVb, PGb = CK + bh * (n_cmp + 1) * HD, CV + bh * (n_cmp + 1) * HD, PG + bh * n_cmp
    m = tl.full([GP], float("-inf"), ACC)
    den = tl.zeros([GP], ACC)
    for start in range(0, n_done, TILE):
        rows = start + t
        s = _scores(q, CKb, rows, rows < n_done, HD, ACC, UPCAST, PREC)
        m_new = tl.maximum(m, tl.max(s, 1))
        den = den * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new[:, None]), 1)
        m = m_new
    # pass 2: probabilities, o_cmp, and the group's probability mass per compressed token (into PG)
    acc = tl.zeros([GP, HD], ACC)
    inv = tl.where(den > 0, 1.0 / tl.where(den > 0, den, 1.0), 0.0)  # no compressed token yet: p = 0
    for start in range(0, n_done, TILE):
        rows = start + t
        ok = rows < n_done
        s = _scores(q, CKb, rows, ok, HD, ACC, UPCAST, PREC)
        p = tl.exp(s - m[:, None]) * inv[:, None]
        p = tl.where(g_ok[:, None], p, 0.0)
        v = tl.load(CVb + rows[:, None] * HD + dd[None, :], mask=ok[:, None], other=0.0)
        vv = v.to(ACC) if UPCAST else v
        pv = p if UPCAST else p.to(vv.dtype)
        acc += tl.dot(pv, vv, input_precision=PREC, out_dtype=ACC)
        tl.store(PGb + rows, tl.sum(p, 0), mask=ok)
    tl.store(OC + (bh * G + g[:, None]) * HD + dd[None, :], acc.to(OC.dtype.element_ty), mask=g_ok[:, None])
    tl.debug_barrier()  # PG's row is read back by other threads of this program

    # ---- block scores (Eq. 9) and the forced blocks
    M: tl.constexpr = L // D
    R: tl.constexpr = L_SEL // D
    blocks = tl.arange(0, NBP)
    score = tl.zeros([NBP], ACC)
    for u in tl.static_range(R):
        for k in tl.static_range(M):
            i = blocks * R + u - k
            score += tl.load(PGb + i, mask=(i >= 0) & (i < n_done), other=0.0)
    current = pos // L_SEL
    score = tl.where(blocks <= current, score, float("-inf"))
    score = tl.where((blocks == 0) | ((blocks >= current - 1) & (blocks <= current)), float("inf"), score)

    # ---- selected branch: the n best blocks, one online softmax over their keys at or before pos
    SKb, SVb = SK + bh * n_sel_keys * HD, SV + bh * n_sel_keys * HD
    key = tl.arange(0, L_SEL)
    m = tl.full([GP], float("-inf"), ACC)
    den = tl.zeros([GP], ACC)
    acc = tl.zeros([GP, HD], ACC)
    for _ in tl.static_range(N_PICK):
        best = tl.argmax(score, 0)  # the lowest index among equal scores
        if tl.max(score, 0) > float("-inf"):  # else fewer than n blocks exist: no more picks
            rows = best.to(tl.int64) * L_SEL + key
            ok = rows <= pos
            s = _scores(q, SKb, rows, ok, HD, ACC, UPCAST, PREC)
            m, den, acc = _online(s, SVb, rows, ok, m, den, acc, HD, ACC, UPCAST, PREC)
            score = tl.where(blocks == best, float("-inf"), score)
    tl.store(OS + (bh * G + g[:, None]) * HD + dd[None, :], (acc / den[:, None]).to(OS.dtype.element_ty),
             mask=g_ok[:, None])

    # ---- window branch: the ring's written slots
    WKb, WVb = WK + bh * W * HD, WV + bh * W * HD
    n_win = tl.minimum(pos + 1, W)
    m = tl.full([GP], float("-inf"), ACC)
    den = tl.zeros([GP], ACC)
    acc = tl.zeros([GP, HD], ACC)
    for start in range(0, n_win, TILE):
        rows = start + t
        ok = rows < n_win
        s = _scores(q, WKb, rows, ok, HD, ACC, UPCAST, PREC)
        m, den, acc = _online(s, WVb, rows, ok, m, den, acc, HD, ACC, UPCAST, PREC)
    tl.store(OW + (bh * G + g[:, None]) * HD + dd[None, :], (acc / den[:, None]).to(OW.dtype.element_ty),
             mask=g_ok[:, None])


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # o_cmp, o_sel, o_win [B, H_kv, G, hd] in qg's dtype
    B, H_kv, G, hd = qg.shape
    if hd & (hd - 1) or hd < 16 or l_sel & (l_sel - 1) or l_sel < 16:
        raise ValueError(f"decode_branches: head dim {hd} and l' {l_sel} must be powers of two >= 16")
    n_cmp, n_sel_keys, w = cmp_k.shape[2] - 1, sel_k.shape[2], win_k.shape[2]
    n_blocks = n_sel_keys // l_sel
    qg, cmp_k, cmp_v, sel_k, sel_v, win_k, win_v = (
        x.contiguous() for x in (qg, cmp_k, cmp_v, sel_k, sel_v, win_k, win_v))
    outs = [torch.empty_like(qg) for _ in range(3)]
    wide = torch.float64 if qg.dtype == torch.float64 else torch.float32
    scratch = torch.empty(B * H_kv, max(n_cmp, 1), dtype=wide, device=qg.device)  # each token's group mass
    interpreted = interpreter_active()
    decode_branches_kernel[(B * H_kv,)](
        qg, cmp_k, cmp_v, sel_k, sel_v, win_k, win_v, pos, scratch, *outs, n_cmp, n_sel_keys,
        G=G, GP=max(16, triton.next_power_of_2(G)), HD=hd, L=l, D=d, L_SEL=l_sel, N_PICK=min(n_sel, n_blocks), W=w,
        NBP=triton.next_power_of_2(n_blocks), TILE=TILE,
        ACC=tl.float64 if wide == torch.float64 else tl.float32,
        UPCAST=interpreted and qg.dtype in (torch.bfloat16, torch.float16),
        PREC="ieee" if qg.dtype in (torch.float32, torch.float64) or interpreted else "tf32")
    return tuple(outs)
