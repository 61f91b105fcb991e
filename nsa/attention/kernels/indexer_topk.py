"""The learned block indexer's picks as one Triton kernel: scores -> forced blocks -> top-n (nsa.selector=indexer).

Same result as the torch path `nsa.attention.impl.index_scores.indexer_picks` (index_block_scores, then
impl/selection.py's select_blocks), up to the rounding of the scores: where two blocks' scores differ by less than
that, either may be kept. No [Tq, N_b] tensor exists: the scores live in registers one chunk of blocks at a time,
and the only tensor written is block_idx [B, H_kv, Tq, n].

Scores (nsa/attention/indexer.py): for query t of KV group k and block j,
    I(t, j) = sum_h w(t, h) * ReLU(q(t, h) . K(j)) / sqrt(e)
with K(j) the block's key (PER_TOKEN off: keys [B, N_b, e], one per block) or, PER_TOKEN on, the max over the block's
tokens s of sum_h w(t, h) * ReLU(q(t, h) . k(s)) / sqrt(e) (keys [B, S, e], one per token; tokens past S score -inf).

Grid (cdiv(Tq, BT), B*H_kv). A program owns BT consecutive queries of one KV group and all h index heads as one tile
of R = HP*BT rows, row = hh*BT + t (HP = h padded to a power of two; padded heads have q = 0 and w = 0, so they add
0). Over chunks of BJ blocks up to the current block of the tile's last query:
    s     = q @ keys^T / sqrt(e)                          [R, EP] @ [EP, BN] -> [R, BN] (BN = BJ, or BJ * LP tokens)
    s     = ReLU(s) * w(row)                              [R, BN]
    score = sum over heads of s.reshape(HP, BT, BN)       [BT, BN]; PER_TOKEN: max over each block's LP token lanes
    val   = +inf for the forced blocks (0, current - 1, current), -inf after the current block, else score
and val merges into a running top-n per query (select_topk.merge_topn: higher first, ties -> lower block), written
ascending with -1 for empty slots (select_topk.ascending). Every allowed score is finite, so each query keeps
exactly min(n, current + 1) blocks, as select_blocks does.

Packed documents (HAS_FRAME; frame [3, B, Tq]: each query's position in its document and its document's first key
index; token keys from index 0): a tile's queries run their documents one at a time, smallest first index first (as
select_topk.py's frame mode), each over its own document's keys from its first index with blocks counted from there;
the other queries take part at block -1 (no candidate, nothing merged). One launch whatever the number of documents.

Accumulation is fp32 (fp64 for fp64 inputs); q @ keys^T as select_topk.py's dot (bf16/fp16 on tensor cores, fp32 as
3xTF32, IEEE for fp64 and in the interpreter, where bf16/fp16 tiles are upcast first: UPCAST). q_start, Tq and the
key count are runtime arguments (chunked prefill does not recompile).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from nsa.attention.kernels.interpreter import interpreter_active
from nsa.attention.kernels.indexer_kl import block_keys
from nsa.attention.kernels.select_topk import ascending, merge_topn

ROWS = 64  # (index head, query) rows per program: BT = ROWS // HP queries (1 .. MAX_BLOCK_QUERIES)
# the top-n merge holds [BT, NP, BJ] comparisons in registers. M7C's shapes (n 16, bf16, ahead of time, 2026-12-07):
# 16 queries take 209-247 registers with Triton 3.9 and spill 32-104 B at 255 with 3.6 (the GPU image's); 8 take
# 130-185 (3.9) and 161-201 (3.6), no spill
MAX_BLOCK_QUERIES = 8
TOKEN_LANES = 128  # PER_TOKEN: token lanes per chunk (BJ * LP): the [R, BN] scores tile stays in registers


@triton.jit
def _merge_blocks(q, w, K, skb, skn, ske, b, kb, offs_e, e_ok, current, last, N, top_v, top_i,
                  HP: tl.constexpr, BT: tl.constexpr, BJ: tl.constexpr, LP: tl.constexpr, L_SEL: tl.constexpr,
                  N_SEL: tl.constexpr, NP: tl.constexpr, PER_TOKEN: tl.constexpr, POOL_TOKENS: tl.constexpr,
                  SCALE: tl.constexpr, ACC: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr):
    """Score blocks 0 .. last // l' of the keys starting at key index kb (a document's first token; 0 without
    documents; N keys from there) for the tile's rows (q [R, EP], w [R]) and merge them into the running top-n
    (top_v, top_i) [BT, NP] of the queries whose current block is current [BT] (-1: a query of another document,
    which may pick none of these blocks)."""
    BN: tl.constexpr = BJ * LP  # key lanes per chunk (LP = 1 with one key per block)
    if PER_TOKEN or POOL_TOKENS:  # N token keys
        n_blocks = (N + L_SEL - 1) // L_SEL
    else:  # N block keys
        n_blocks = N
    keys = K + b * skb + kb.to(tl.int64) * skn + offs_e[None, :] * ske  # [1, EP] pointers of key 0
    cols = tl.arange(0, BJ)
    lanes = tl.arange(0, BN)
    for j0 in range(0, tl.minimum(last // L_SEL + 1, n_blocks), BJ):
        if PER_TOKEN:
            tok = (j0 + lanes // LP) * L_SEL + lanes % LP  # [BN] the chunk's tokens, LP lanes per block
            tok_ok = (lanes % LP < L_SEL) & (tok < N)
        else:
            tok = j0 + lanes  # [BN] the chunk's blocks
            tok_ok = tok < n_blocks
        if POOL_TOKENS:  # each block's key: the elementwise max of its token keys
            kt, _ = block_keys(K, b * skb + kb.to(tl.int64) * skn, skn, ske, 0, offs_e, e_ok, j0, N, BJ, L_SEL, ACC)
        else:
            kt = tl.load(keys + tok[:, None].to(tl.int64) * skn, mask=tok_ok[:, None] & e_ok[None, :], other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
        kt = kt.to(q.dtype)
        s = tl.dot(q, tl.trans(kt), input_precision=PREC, out_dtype=ACC) * SCALE  # [R, BN]
        s = tl.maximum(s, 0.0) * w[:, None]
        score = tl.sum(tl.reshape(s, (HP, BT, BN)), axis=0)  # [BT, BN] summed over the index heads
        if PER_TOKEN:
            score = tl.where(tok_ok[None, :], score, float("-inf"))
            score = tl.max(tl.reshape(score, (BT, BJ, LP)), axis=2)  # [BT, BJ] a block's best token
        blk = j0 + cols  # [BJ]
        allowed = (blk[None, :] <= current[:, None]) & (blk[None, :] < n_blocks)  # [BT, BJ]
        forced = (blk[None, :] == 0) | (blk[None, :] == current[:, None]) | (blk[None, :] == current[:, None] - 1)
        val = tl.where(allowed, tl.where(forced, float("inf"), score), float("-inf"))
        top_v, top_i = merge_topn(val, blk, top_v, top_i, N_SEL, NP, BJ)
    return top_v, top_i


@triton.jit(do_not_specialize=["q_start", "Tq", "N"])
def _indexer_topk_kernel(
    Q, W, K, OUT, FRAME,
    sqb, sqt, sqk, sqh, sqe,
    swb, swt, swk, swh,
    skb, skn, ske,
    sf0, sf1, sf2,
    q_start, Tq, N,
    H_KV: tl.constexpr, HI: tl.constexpr, HP: tl.constexpr, E: tl.constexpr, EP: tl.constexpr,
    L_SEL: tl.constexpr, N_SEL: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr, BJ: tl.constexpr,
    LP: tl.constexpr, PER_TOKEN: tl.constexpr, POOL_TOKENS: tl.constexpr, SCALE: tl.constexpr, ACC: tl.constexpr,
    UPCAST: tl.constexpr, PREC: tl.constexpr, HAS_FRAME: tl.constexpr,
):
    R: tl.constexpr = HP * BT  # rows: (index head, query) pairs
    q0 = tl.program_id(0) * BT
    bk = tl.program_id(1).to(tl.int64)
    b = bk // H_KV
    kv = bk % H_KV

    offs_r = tl.arange(0, R)
    row_h = offs_r // BT  # index head of a row
    row_q = q0 + offs_r % BT  # query index in 0 .. Tq-1
    row_ok = (row_h < HI) & (row_q < Tq)
    offs_e = tl.arange(0, EP)
    e_ok = offs_e < E
    q_at = Q + b * sqb + kv * sqk + row_q[:, None].to(tl.int64) * sqt + row_h[:, None] * sqh  # [R, 1]
    q = tl.load(q_at + offs_e[None, :] * sqe, mask=row_ok[:, None] & e_ok[None, :], other=0.0)  # [R, EP]
    if UPCAST:  # the interpreter has no bf16/fp16 matmul
        q = q.to(tl.float32)
    w = tl.load(W + b * swb + kv * swk + row_q.to(tl.int64) * swt + row_h * swh, mask=row_ok, other=0.0).to(ACC)  # [R]

    offs_t = tl.arange(0, BT)
    q_idx = q0 + offs_t  # [BT]
    q_ok = q_idx < Tq
    top_v = tl.full([BT, NP], float("-inf"), dtype=ACC)  # running top-n, best first
    top_i = tl.zeros([BT, NP], dtype=tl.int32)
    if HAS_FRAME:
        # frame [3, B, Tq]: q_pos, k_base per query (token keys from index 0). The tile's queries run one document
        # (one k_base) at a time, smallest first, over that document's keys; the others take part at block -1
        f_t = FRAME + b * sf1 + q_idx.to(tl.int64) * sf2  # [BT]
        pos_t = tl.load(f_t, mask=q_ok, other=0).to(tl.int32)  # [BT] positions within the documents
        kb_t = tl.load(f_t + sf0, mask=q_ok, other=0).to(tl.int32)  # [BT] their documents' first key index
        todo = q_ok
        while tl.max(todo.to(tl.int32), axis=0) > 0:  # once per document in the tile (usually 1-2)
            kb = tl.min(tl.where(todo, kb_t, 2147483647), axis=0)
            mine = todo & (kb_t == kb)
            last = tl.max(tl.where(mine, pos_t, 0), axis=0)
            current = tl.where(mine, pos_t // L_SEL, -1)
            top_v, top_i = _merge_blocks(q, w, K, skb, skn, ske, b, kb, offs_e, e_ok, current, last, N - kb, top_v,
                                         top_i, HP, BT, BJ, LP, L_SEL, N_SEL, NP, PER_TOKEN, POOL_TOKENS, SCALE, ACC,
                                         UPCAST, PREC)
            todo = todo & (kb_t != kb)
    else:
        current = tl.where(q_ok, (q_start + q_idx) // L_SEL, -1)  # [BT] each query's current block
        last = q_start + tl.minimum(q0 + BT, Tq) - 1  # the tile's last query position
        top_v, top_i = _merge_blocks(q, w, K, skb, skn, ske, b, q_start * 0, offs_e, e_ok, current,
                                     last, N, top_v, top_i, HP, BT, BJ, LP, L_SEL, N_SEL, NP, PER_TOKEN, POOL_TOKENS,
                                     SCALE, ACC, UPCAST, PREC)

    out = ascending(top_v, top_i, NP)  # [BT, NP]
    slots = tl.arange(0, NP)
    tl.store(OUT + (bk * Tq + q_idx[:, None].to(tl.int64)) * N_SEL + slots[None, :], out,
             mask=q_ok[:, None] & (slots < N_SEL)[None, :])


def kernel_constexprs(dtype: torch.dtype, heads: int, index_dim: int, l_sel: int, n: int, per_token: bool,
                      pool_tokens: bool = False) -> dict:
    """The kernel's compile-time constants for these shapes (also used to compile it ahead of time)."""
    hp, lp = triton.next_power_of_2(heads), triton.next_power_of_2(l_sel)
    bj = max(2, TOKEN_LANES // lp) if per_token else 16  # tl.dot needs >= 16 columns: BJ * LP >= 16
    f64, interpret = dtype == torch.float64, interpreter_active()
    return dict(
        HI=heads, HP=hp, E=index_dim, EP=max(16, triton.next_power_of_2(index_dim)), L_SEL=l_sel, N_SEL=n,
        NP=triton.next_power_of_2(n), BT=max(1, min(MAX_BLOCK_QUERIES, ROWS // hp)), BJ=bj,
        LP=lp if per_token else 1, PER_TOKEN=per_token, POOL_TOKENS=pool_tokens and not per_token,
        SCALE=1.0 / math.sqrt(index_dim), ACC=tl.float64 if f64 else tl.float32,
        UPCAST=interpret and dtype in (torch.bfloat16, torch.float16), PREC="ieee" if f64 or interpret else "tf32x3",
    )


@torch.no_grad()
def fused_indexer_picks(
    q: torch.Tensor,  # [B, Tq, H_kv, h, e] index queries of the queries at positions q_start .., any strides
    w: torch.Tensor,  # [B, Tq, H_kv, h] head weights
    keys: torch.Tensor,  # [B, N_b, e] block keys, or (per_token or token_keys) [B, S, e] token keys from position 0
    q_start: int,
    l_sel: int,
    n: int,
    per_token: bool,
    token_keys: bool = False,  # with one key per block: keys are token keys, each block's the max of its tokens'
    frame: torch.Tensor | None = None,  # [3, B, Tq] int64 packed documents (q_pos, k_base, c_base); token keys
) -> torch.Tensor:  # [B, H_kv, Tq, n] int64 block indices, ascending; -1 pads |I_p| = min(n, p // l' + 1)
    """Top-n blocks per query by the indexer's scores (block 0, the previous and the current block forced; ties ->
    lower index): impl/index_scores.indexer_picks in one launch, no host sync. With a frame (nsa/attention/
    documents.py; then q_start is unused and the keys are token keys from index 0): query (b, t) at position
    p = frame[0, b, t] of the document whose first key is keys[b, frame[1, b, t]] scores that document's blocks,
    counted from its first token (impl/index_scores.document_picks); one launch whatever the number of documents."""
    B, Tq, H_kv, h, e = q.shape
    if w.shape != (B, Tq, H_kv, h) or keys.dim() != 3 or keys.shape[0] != B or keys.shape[2] != e:
        raise ValueError(f"fused_indexer_picks: q {tuple(q.shape)}, w {tuple(w.shape)} and keys {tuple(keys.shape)} "
                         f"do not match")
    if l_sel < 1 or n < 1 or q_start < 0:
        raise ValueError(f"fused_indexer_picks: need l' >= 1, n >= 1, q_start >= 0 (l'={l_sel}, n={n}, "
                         f"q_start={q_start})")
    if frame is not None and (frame.shape != (3, B, Tq) or frame.dtype != torch.long or frame.device != q.device
                              or not (per_token or token_keys)):
        raise ValueError(f"fused_indexer_picks: frame must be int64 [3, {B}, {Tq}] on {q.device} over token keys, "
                         f"got {frame.dtype} {tuple(frame.shape)} on {frame.device}")
    if q.device.type == "cpu" and not interpreter_active():
        raise RuntimeError("fused_indexer_picks needs a CUDA tensor, or TRITON_INTERPRET=1 set before triton is "
                           "imported")
    if keys.dtype != q.dtype:
        keys = keys.to(q.dtype)
    out = torch.empty(B, H_kv, Tq, n, dtype=torch.long, device=q.device)
    if out.numel() == 0:
        return out
    meta = kernel_constexprs(q.dtype, h, e, l_sel, n, per_token, token_keys)
    grid = (triton.cdiv(Tq, meta["BT"]), B * H_kv)
    f = out if frame is None else frame  # unread without a frame
    f_strides = (0, 0, 0) if frame is None else frame.stride()
    _indexer_topk_kernel[grid](q, w, keys, out, f, *q.stride(), *w.stride(), *keys.stride(), *f_strides, q_start, Tq,
                               keys.shape[1], H_KV=H_kv, **meta, HAS_FRAME=frame is not None,
                               maxnreg=255)  # as select_topk's: its merge state in registers
    return out
