"""phi, NSA's block compressor (paper §3.3.1), for keys and values together: one launch forward, three backward.

    phi(X) = mean_j X_j + W2 gelu(W1 flatten(X + E) + b1) + b2        X = raw rows s_i .. s_i + l - 1 of slot i

(nsa/attention/compressor.py's BlockCompressor; the torch form, impl/compression.py `phi`, is the oracle). Grid axis 2
picks keys (0) or values (1), each with its own parameters. Block i starts at raw row s_i = lo + i*d, or, for packed
documents, at block_start[b, i] with valid[b, i] (nsa/attention/documents.py CompressedLayout); an invalid slot's
output is zero and gets no gradient (no query reads it).

In torch ops phi is ~8 launches forward and ~9 backward for each of keys and values (the position add, two matmuls,
gelu, the mean, the sum, their backwards, the overlapping blocks' unfold_backward). Here:
  forward   phi_fwd_kernel:     per tile of slots, the l raw rows read once; W1 x accumulated over the l rows in
                                float32 (dots in the raw dtype, as torch's matmul reads them), gelu, W2, the mean.
                                Also stores the pre-activation a [2, B, H, C, hd] (float32) for the backward.
  backward  phi_dblock_kernel:  dA = (dy W2) gelu'(a) [2, B, H, C, hd] and each slot's row gradients
                                dh[i, j] = dA_i W1_j + dy_i / l  [2, B, H, C, l, hd] (float32);
            phi_draw_kernel:    per raw row, the sum of dh over the (l / d) blocks covering it (a gather: no
                                atomics, deterministic);
            phi_dweight_kernel: dW1 (one program per row j of the block: sum over slots of dA^T (x_j + E_j)),
                                dE_j = (sum_i dA_i) W1_j, and (one more program) dW2, db1, db2; ordered sums.
Kernels only; the launchers are `compress_blocks_fwd` / `compress_blocks_bwd`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa.attention.kernels.interpreter import interpreter_active

MAX_HEAD_DIM = 64  # the tiles hold whole [hd, hd] weight blocks and [BM, hd] rows in registers: sized for hd <= 64
BM = 32  # slots per program (and rows per reduction step)
BR = 32  # raw rows per program of the raw-gradient kernel
NUM_STAGES = 1  # the forward's loads over the block's rows unpipelined (3 / 2 stages: 24 / 4 B spills, hd 32, bias, sm_90)


@triton.jit
def _pick(which, k_ptr, v_ptr):
    """The keys' (which == 0) or the values' pointer."""
    if which == 0:
        ptr = k_ptr
    else:
        ptr = v_ptr
    return ptr


@triton.jit
def _slots(i, b, C, LO, BS, VALID, sbs_b, sbs_c, D: tl.constexpr, HAS_LAYOUT: tl.constexpr):
    """Slots i [N] of batch row b -> first raw row of each block [N] int64, and which slots hold a block [N]."""
    in_range = i < C
    if HAS_LAYOUT:
        start = tl.load(BS + b * sbs_b + i * sbs_c, mask=in_range, other=0)
        ok = in_range & (tl.load(VALID + b * sbs_b + i * sbs_c, mask=in_range, other=0) != 0)
    else:
        start = LO + i * D
        ok = in_range
    return start.to(tl.int64), ok


@triton.jit
def _operand(x, DT: tl.constexpr, UPCAST: tl.constexpr):
    """x rounded to the dot's input dtype DT (the raw dtype, as torch's matmul reads it); in the interpreter, which has
    no bf16 / fp16 matmul (UPCAST), then widened to float32 (exact)."""
    x = x.to(DT)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _gelu(a):
    return 0.5 * a * (1.0 + tl.math.erf(a * 0.7071067811865476))


@triton.jit
def _gelu_grad(a):
    return 0.5 * (1.0 + tl.math.erf(a * 0.7071067811865476)) + a * 0.3989422804014327 * tl.exp(-0.5 * a * a)


@triton.jit(do_not_specialize=["R", "C", "H", "LO"])
def phi_fwd_kernel(
    RK, RV, EK, EV, W1K, W1V, B1K, B1V, W2K, W2V, B2K, B2V, YK, YV, A,
    BS, VALID, sbs_b, sbs_c,
    srb, srh, srr, srd,
    R, C, H, LO,
    L: tl.constexpr, D: tl.constexpr, HD: tl.constexpr, DP: tl.constexpr, BM: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_LAYOUT: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """Program (i, bh, which): slots i*BM .. of head bh % H, batch row bh // H. RK / RV [B, H, R, HD] (one stride set),
    E [L, HD], W1 [HD, L*HD], W2 [HD, HD], B1 / B2 [HD] (contiguous); YK / YV [B, H, C, HD] and A [2, B, H, C, HD]
    contiguous."""
    which = tl.program_id(2)
    RAW = _pick(which, RK, RV)
    E = _pick(which, EK, EV)
    W1 = _pick(which, W1K, W1V)
    W2 = _pick(which, W2K, W2V)
    Y = _pick(which, YK, YV)
    B1 = _pick(which, B1K, B1V)
    B2 = _pick(which, B2K, B2V)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    i = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)  # [BM] slots
    c = tl.arange(0, DP)  # [DP] feature (input side)
    o = tl.arange(0, DP)  # [DP] feature (output side)
    c_ok = c < HD
    start, ok = _slots(i, b, C, LO, BS, VALID, sbs_b, sbs_c, D, HAS_LAYOUT)
    x_ok = ok[:, None] & c_ok[None, :]
    w_ok = c_ok[:, None] & (o < HD)[None, :]
    rows = RAW + b * srb + h * srh + start[:, None] * srr + c[None, :] * srd  # [BM, DP] row s_i of each block
    DT = RAW.dtype.element_ty
    a = tl.zeros([BM, DP], dtype=ACC)
    total = tl.zeros([BM, DP], dtype=ACC)
    for j in range(L):
        x = tl.load(rows + j * srr, mask=x_ok, other=0.0).to(ACC)  # [BM, DP]
        total += x
        e = tl.load(E + j * HD + c, mask=c_ok, other=0.0).to(DT).to(ACC)  # [DP] E_j in the raw dtype, as torch casts it
        xe = _operand(x + e[None, :], DT, UPCAST)  # rounded as torch's add
        w1t = _operand(tl.load(W1 + o[None, :] * (L * HD) + j * HD + c[:, None], mask=w_ok, other=0.0), DT, UPCAST)
        a += tl.dot(xe, w1t, input_precision=PREC, out_dtype=ACC)
    if HAS_BIAS:
        a += tl.load(B1 + o, mask=o < HD, other=0.0).to(ACC)[None, :]
    slot = ((which * (tl.num_programs(1)) + bh) * C + i)[:, None] * HD + o[None, :]  # [BM, DP] in [2, B*H, C, HD]
    tl.store(A + slot, a, mask=x_ok)
    g = _operand(_gelu(a), DT, UPCAST)
    w2t = _operand(tl.load(W2 + o[None, :] * HD + c[:, None], mask=w_ok, other=0.0), DT, UPCAST)  # W2[o, c]
    y = total / L + tl.dot(g, w2t, input_precision=PREC, out_dtype=ACC)
    if HAS_BIAS:
        y += tl.load(B2 + o, mask=o < HD, other=0.0).to(ACC)[None, :]
    y = tl.where(ok[:, None], y, 0.0)
    tl.store(Y + (bh * C + i)[:, None] * HD + o[None, :], y.to(Y.dtype.element_ty),
             mask=(i < C)[:, None] & c_ok[None, :])


@triton.jit(do_not_specialize=["C", "H"])
def phi_dblock_kernel(
    DYK, DYV, W1K, W1V, W2K, W2V, A, DA, DH,
    BS, VALID, sbs_b, sbs_c,
    C, H,
    L: tl.constexpr, HD: tl.constexpr, DP: tl.constexpr, BM: tl.constexpr,
    HAS_LAYOUT: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """Program (i, bh, which) as the forward's. DYK / DYV [B, H, C, HD] contiguous; A, DA [2, B, H, C, HD] and
    DH [2, B, H, C, L, HD] float32."""
    which = tl.program_id(2)
    DY = _pick(which, DYK, DYV)
    W1 = _pick(which, W1K, W1V)
    W2 = _pick(which, W2K, W2V)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    i = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    c = tl.arange(0, DP)
    o = tl.arange(0, DP)
    c_ok = c < HD
    _, ok = _slots(i, b, C, 0, BS, VALID, sbs_b, sbs_c, 1, HAS_LAYOUT)  # which slots hold a block (starts unused)
    m_ok = ok[:, None] & c_ok[None, :]
    w_ok = (o < HD)[:, None] & c_ok[None, :]
    DT = DYK.dtype.element_ty
    dy = tl.load(DY + (bh * C + i)[:, None] * HD + o[None, :], mask=m_ok, other=0.0).to(ACC)  # [BM, DP(o)]
    slot = (which * tl.num_programs(1) + bh) * C + i  # [BM] in [2, B*H, C]
    a = tl.load(A + slot[:, None] * HD + c[None, :], mask=m_ok, other=0.0)  # [BM, DP(c)]
    w2 = _operand(tl.load(W2 + o[:, None] * HD + c[None, :], mask=w_ok, other=0.0), DT, UPCAST)  # [o, c]
    dg = tl.dot(_operand(dy, DT, UPCAST), w2, input_precision=PREC, out_dtype=ACC)  # [BM, DP(c)] d gelu(a)
    da = dg * _gelu_grad(a)  # d(pre-activation)
    tl.store(DA + slot[:, None] * HD + c[None, :], da, mask=(i < C)[:, None] & c_ok[None, :])
    da = _operand(da, DT, UPCAST)
    mean_part = dy / L
    for j in range(L):
        w1 = _operand(tl.load(W1 + o[:, None] * (L * HD) + j * HD + c[None, :], mask=w_ok, other=0.0), DT, UPCAST)
        dh = tl.dot(da, w1, input_precision=PREC, out_dtype=ACC) + mean_part  # [BM, DP]
        tl.store(DH + (slot[:, None] * L + j) * HD + c[None, :], dh, mask=(i < C)[:, None] & c_ok[None, :])


@triton.jit(do_not_specialize=["R", "C", "H", "LO"])
def phi_draw_kernel(
    DH, DRK, DRV, FR, BS, VALID,
    sfk, sfb, sft, sbs_b, sbs_c,
    R, C, H, LO,
    L: tl.constexpr, D: tl.constexpr, HD: tl.constexpr, DP: tl.constexpr, BR: tl.constexpr,
    HAS_LAYOUT: tl.constexpr, ACC: tl.constexpr,
):
    """Program (p, bh, which): raw rows p*BR .. -> DRK / DRV [B, H, R, HD] contiguous. Row q's position in its
    document r and its document's first slot: q - LO and 0, or frame rows 0 and 2 (FR [3, B, R]); block g = r // d - k
    (k < l / d) covers it at row j = r - g*d of the block."""
    which = tl.program_id(2)
    DR = _pick(which, DRK, DRV)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    q = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)  # [BR] raw rows
    c = tl.arange(0, DP)
    q_ok = q < R
    if HAS_LAYOUT:
        r = tl.load(FR + b * sfb + q * sft, mask=q_ok, other=-1)
        base = tl.load(FR + 2 * sfk + b * sfb + q * sft, mask=q_ok, other=0)
    else:
        r = q - LO
        base = tl.zeros([BR], dtype=tl.int64)
    r_ok = q_ok & (r >= 0)
    top = tl.where(r_ok, r, 0) // D  # [BR] the last block that may cover the row
    acc = tl.zeros([BR, DP], dtype=ACC)
    for k in range(L // D):
        g = top - k
        j = tl.where(r_ok, r, 0) - g * D
        slot = base + g
        ok = r_ok & (g >= 0) & (slot < C)
        if HAS_LAYOUT:  # the slot must hold this document's block g: it starts at row q - j
            ok &= tl.load(VALID + b * sbs_b + slot * sbs_c, mask=ok, other=0) != 0
            ok &= tl.load(BS + b * sbs_b + slot * sbs_c, mask=ok, other=-1) == q - j
        src = ((which * tl.num_programs(1) + bh) * C + slot) * L + j  # [BR] rows of DH
        acc += tl.load(DH + src[:, None] * HD + c[None, :], mask=ok[:, None] & (c < HD)[None, :], other=0.0)
    tl.store(DR + (bh * R + q)[:, None] * HD + c[None, :], acc.to(DR.dtype.element_ty),
             mask=q_ok[:, None] & (c < HD)[None, :])


@triton.jit(do_not_specialize=["C", "H", "LO", "M"])
def phi_dweight_kernel(
    RK, RV, EK, EV, W1K, W1V, DYK, DYV, A, DA,
    DEK, DEV, DW1K, DW1V, DB1K, DB1V, DW2K, DW2V, DB2K, DB2V,
    BS, VALID, sbs_b, sbs_c,
    srb, srh, srr, srd,
    C, H, LO, M,
    L: tl.constexpr, D: tl.constexpr, HD: tl.constexpr, DP: tl.constexpr, BM: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_LAYOUT: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """Program (j, which): j < L: dW1[:, j*HD:(j+1)*HD] and dE[j]; j == L: dW2, db1, db2. Sums over the M = B*H*C
    slots in order (BM at a time). Gradients written in float32 ([HD, L*HD] etc., contiguous)."""
    which = tl.program_id(1)
    j = tl.program_id(0)
    c = tl.arange(0, DP)
    o = tl.arange(0, DP)
    c_ok = c < HD
    w_ok = (o < HD)[:, None] & c_ok[None, :]
    DT = RK.dtype.element_ty
    acc = tl.zeros([DP, DP], dtype=ACC)  # [o, c]
    sum_da = tl.zeros([DP], dtype=ACC)  # [o]
    sum_dy = tl.zeros([DP], dtype=ACC)  # [o]
    if j < L:
        RAW = _pick(which, RK, RV)
        E = _pick(which, EK, EV)
        e = tl.load(E + j * HD + c, mask=c_ok, other=0.0).to(DT).to(ACC)
        for m0 in range(0, M, BM):
            m = m0 + tl.arange(0, BM).to(tl.int64)  # [BM] slots over (b, h, i)
            bh = m // C
            i = m % C
            b = bh // H
            start, ok = _slots(i, b, C, LO, BS, VALID, sbs_b, sbs_c, D, HAS_LAYOUT)
            ok &= m < M
            m_ok = ok[:, None] & c_ok[None, :]
            x = tl.load(RAW + b[:, None] * srb + (bh % H)[:, None] * srh + (start + j)[:, None] * srr
                        + c[None, :] * srd, mask=m_ok, other=0.0).to(ACC)
            xe = _operand(tl.where(m_ok, x + e[None, :], 0.0), DT, UPCAST)  # [BM, c]
            da = tl.load(DA + (which * M + m)[:, None] * HD + c[None, :], mask=m_ok, other=0.0)  # [BM, o]
            sum_da += tl.sum(da, axis=0)
            acc += tl.dot(tl.trans(_operand(da, DT, UPCAST)), xe, input_precision=PREC, out_dtype=ACC)
        W1 = _pick(which, W1K, W1V)
        w1 = tl.load(W1 + o[:, None] * (L * HD) + j * HD + c[None, :], mask=w_ok, other=0.0).to(ACC)  # [o, c]
        DW1 = _pick(which, DW1K, DW1V)
        tl.store(DW1 + o[:, None] * (L * HD) + j * HD + c[None, :], acc, mask=w_ok)
        DE = _pick(which, DEK, DEV)
        tl.store(DE + j * HD + c, tl.sum(sum_da[:, None] * w1, axis=0), mask=c_ok)
    else:
        DY = _pick(which, DYK, DYV)
        for m0 in range(0, M, BM):
            m = m0 + tl.arange(0, BM).to(tl.int64)
            bh = m // C
            i = m % C
            _, ok = _slots(i, bh // H, C, LO, BS, VALID, sbs_b, sbs_c, D, HAS_LAYOUT)
            m_ok = (ok & (m < M))[:, None] & c_ok[None, :]
            dy = tl.load(DY + m[:, None] * HD + o[None, :], mask=m_ok, other=0.0).to(ACC)  # [BM, o]
            a = tl.load(A + (which * M + m)[:, None] * HD + c[None, :], mask=m_ok, other=0.0)  # [BM, c]
            g = _operand(tl.where(m_ok, _gelu(a), 0.0), DT, UPCAST)
            acc += tl.dot(tl.trans(_operand(dy, DT, UPCAST)), g, input_precision=PREC, out_dtype=ACC)  # [o, c]
            sum_dy += tl.sum(dy, axis=0)
            sum_da += tl.sum(tl.load(DA + (which * M + m)[:, None] * HD + o[None, :], mask=m_ok, other=0.0), axis=0)
        DW2 = _pick(which, DW2K, DW2V)
        tl.store(DW2 + o[:, None] * HD + c[None, :], acc, mask=w_ok)
        if HAS_BIAS:
            DB1 = _pick(which, DB1K, DB1V)
            DB2 = _pick(which, DB2K, DB2V)
            tl.store(DB1 + o, sum_da, mask=o < HD)
            tl.store(DB2 + o, sum_dy, mask=o < HD)


def fits(head_dim: int) -> bool:
    """Whether these kernels are tiled for this head dim (larger ones would spill; ops.compress_blocks then runs phi's
    torch ops)."""
    return head_dim <= MAX_HEAD_DIM


def _acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _dots(dtype: torch.dtype) -> dict:
    """The dots' precision and whether the interpreter must widen bf16 / fp16 operands."""
    interpreted = interpreter_active()
    return dict(PREC="ieee" if dtype in (torch.float32, torch.float64) or interpreted else "tf32",
                UPCAST=interpreted and dtype in (torch.bfloat16, torch.float16))


def _numerics(dtype: torch.dtype) -> dict:
    """The dot kernels' accumulator, dot precision and interpreter upcast for inputs of this dtype."""
    return dict(ACC=_acc(dtype), **_dots(dtype))


def _padded(hd: int) -> int:
    """The head-dim tile: a power of two, at least 16 (tl.dot's smallest)."""
    return max(16, triton.next_power_of_2(hd))


def _one_layout(raw_k: torch.Tensor, raw_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values with one stride set (the kernels take one): as given when they share it, else contiguous."""
    return (raw_k, raw_v) if raw_v.stride() == raw_k.stride() else (raw_k.contiguous(), raw_v.contiguous())


def _layout_args(block_start, valid, device):
    """(BS, VALID, stride_b, stride_c) of a packed layout, or placeholders (never read) without one."""
    if block_start is None:
        dummy = torch.empty(1, dtype=torch.int64, device=device)
        return dummy, dummy, 0, 0
    if block_start.stride() != valid.stride():
        raise ValueError("compress_blocks: block_start and valid must share one layout")
    return block_start, valid, *block_start.stride()


def compress_blocks_fwd(
    raw_k: torch.Tensor,  # [B, H, R, hd] raw keys (any strides; raw_v's the same)
    raw_v: torch.Tensor,  # [B, H, R, hd] raw values
    phi_k: list,  # [pos_enc [l, hd], W1 [hd, l*hd], b1 [hd] | None, W2 [hd, hd], b2 [hd] | None]
    phi_v: list,
    lo: int,  # raw row of slot 0's block (slot i: lo + i*d) without a layout
    count: int,  # C, slots
    l: int,
    d: int,
    block_start: torch.Tensor | None = None,  # [B, C] int64 (packed documents), with valid [B, C] bool
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # ck, cv [B, H, C, hd] (raw's dtype), a [2, B, H, C, hd] fp32
    B, H, R, hd = raw_k.shape
    raw_k, raw_v = _one_layout(raw_k, raw_v)
    acc_dtype = torch.float64 if raw_k.dtype == torch.float64 else torch.float32
    ck = torch.empty(B, H, count, hd, dtype=raw_k.dtype, device=raw_k.device)
    cv = torch.empty_like(ck)
    a = torch.empty(2, B, H, count, hd, dtype=acc_dtype, device=raw_k.device)
    if ck.numel():
        bs, vd, sbs_b, sbs_c = _layout_args(block_start, valid, raw_k.device)
        has_bias = phi_k[2] is not None
        ek, w1k, b1k, w2k, b2k = (t if t is not None else ck for t in phi_k)
        ev, w1v, b1v, w2v, b2v = (t if t is not None else ck for t in phi_v)
        phi_fwd_kernel[(triton.cdiv(count, BM), B * H, 2)](
            raw_k, raw_v, ek, ev, w1k, w1v, b1k, b1v, w2k, w2v, b2k, b2v, ck, cv, a,
            bs, vd, sbs_b, sbs_c, *raw_k.stride(), R, count, H, lo,
            L=l, D=d, HD=hd, DP=_padded(hd), BM=BM, HAS_BIAS=has_bias, HAS_LAYOUT=block_start is not None,
            **_numerics(raw_k.dtype), num_stages=NUM_STAGES,
        )
    return ck, cv, a


def compress_blocks_bwd(
    d_ck: torch.Tensor,  # [B, H, C, hd]
    d_cv: torch.Tensor,
    raw_k: torch.Tensor,  # the forward's inputs
    raw_v: torch.Tensor,
    phi_k: list,
    phi_v: list,
    a: torch.Tensor,  # [2, B, H, C, hd] the forward's pre-activations
    lo: int,
    l: int,
    d: int,
    block_start: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    frame: torch.Tensor | None = None,  # [3, B, R] the packed documents' frame (rows 0 and 2 read), with a layout
) -> tuple[torch.Tensor, torch.Tensor, list, list]:
    """-> d_raw_k, d_raw_v [B, H, R, hd] (raw's dtype, contiguous), and the gradients of phi_k's and phi_v's
    parameters in their order and dtypes (None for absent biases)."""
    B, H, R, hd = raw_k.shape
    C = d_ck.shape[2]
    raw_k, raw_v = _one_layout(raw_k, raw_v)
    d_ck, d_cv = d_ck.contiguous(), d_cv.contiguous()
    dev, acc_dtype = raw_k.device, a.dtype
    d_raw_k = torch.empty(B, H, R, hd, dtype=raw_k.dtype, device=dev)
    d_raw_v = torch.empty_like(d_raw_k)
    grads = [[torch.empty(t.shape, dtype=acc_dtype, device=dev) if t is not None else None for t in phi]
             for phi in (phi_k, phi_v)]
    if R == 0:
        return d_raw_k, d_raw_v, *([g.zero_() if g is not None else None for g in gs] for gs in grads)
    bs, vd, sbs_b, sbs_c = _layout_args(block_start, valid, dev)
    has_layout, has_bias = block_start is not None, phi_k[2] is not None
    dp, numerics = _padded(hd), _numerics(raw_k.dtype)
    da = torch.empty_like(a)
    dh = torch.empty(2, B, H, C, l, hd, dtype=acc_dtype, device=dev)
    w1k, w1v, w2k, w2v = phi_k[1], phi_v[1], phi_k[3], phi_v[3]
    if C:
        phi_dblock_kernel[(triton.cdiv(C, BM), B * H, 2)](
            d_ck, d_cv, w1k, w1v, w2k, w2v, a, da, dh, bs, vd, sbs_b, sbs_c, C, H,
            L=l, HD=hd, DP=dp, BM=BM, HAS_LAYOUT=has_layout, **numerics,
        )
    fr = frame if frame is not None else bs
    phi_draw_kernel[(triton.cdiv(R, BR), B * H, 2)](
        dh, d_raw_k, d_raw_v, fr, bs, vd, *(frame.stride() if frame is not None else (0, 0, 0)), sbs_b, sbs_c,
        R, C, H, lo, L=l, D=d, HD=hd, DP=dp, BR=BR, HAS_LAYOUT=has_layout, ACC=numerics["ACC"],
    )
    (de_k, dw1_k, db1_k, dw2_k, db2_k), (de_v, dw1_v, db1_v, dw2_v, db2_v) = (
        [g if g is not None else da for g in gs] for gs in grads)  # an absent bias: a placeholder, never written
    phi_dweight_kernel[(l + 1, 2)](
        raw_k, raw_v, phi_k[0], phi_v[0], w1k, w1v, d_ck, d_cv, a, da,
        de_k, de_v, dw1_k, dw1_v, db1_k, db1_v, dw2_k, dw2_v, db2_k, db2_v,
        bs, vd, sbs_b, sbs_c, *raw_k.stride(), C, H, lo, B * H * C,
        L=l, D=d, HD=hd, DP=dp, BM=BM, HAS_BIAS=has_bias, HAS_LAYOUT=has_layout, **numerics,
    )
    out = [[g.to(t.dtype) if g is not None else None for g, t in zip(gs, phi)]
           for gs, phi in zip(grads, (phi_k, phi_v))]
    return d_raw_k, d_raw_v, out[0], out[1]
