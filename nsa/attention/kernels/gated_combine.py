"""NSA's gated combination of its three branches (paper Eq. 5) in one launch per direction.

    y[b, t, h] = g[b, t, h, 0] o_cmp[b, h, t] + g[b, t, h, 1] o_sel[b, h, t] + g[b, t, h, 2] o_win[b, h, t]

written straight in the output projection's layout [B, T, H, hd] (no transpose copy after it), in float32 (float64
for float64 inputs), stored in the branches' dtype. The backward reads dy once and writes the three branch
gradients (g_i dy, in the branches' layout) and the gates' (sum over hd of dy o_i). In torch ops the forward is 5-6
launches (casts, three products, two sums, the transpose copy) and the backward ~15 (products, sums, the gate
slices' zero-filled gradients, contiguous copies for the branch backwards). Kernels only; the launchers are
`gated_combine_fwd` / `gated_combine_bwd`, the oracle nsa.attention.impl.combine.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa.attention.kernels.interpreter import interpreter_active  # noqa: F401  (kernels built as the switch says)

ROWS = 32  # positions per program


@triton.jit
def _program_rows(T, H, HD: tl.constexpr, DP: tl.constexpr, ROWS: tl.constexpr):
    """Program (i, bh)'s batch row b, head h, positions t [ROWS] (i*ROWS ..), head-dim offsets d [DP] and masks."""
    bh = tl.program_id(1).to(tl.int64)
    t = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, DP)
    t_ok = t < T
    return bh // H, bh % H, t, d, t_ok, t_ok[:, None] & (d < HD)[None, :]


@triton.jit
def _branch(O, b, h, t, d, ok, sob, soh, sot, sod, ACC: tl.constexpr):
    return tl.load(O + b * sob + h * soh + t[:, None] * sot + d[None, :] * sod, mask=ok, other=0.0).to(ACC)


@triton.jit
def _gate(Gt, b, h, t, i, t_ok, sgb, sgt, sgh, sgi, ACC: tl.constexpr):
    return tl.load(Gt + b * sgb + t * sgt + h * sgh + i * sgi, mask=t_ok, other=0.0).to(ACC)


@triton.jit(do_not_specialize=["T", "H"])
def gated_combine_fwd_kernel(
    Gt, OC, OS, OW, Y,
    sgb, sgt, sgh, sgi,
    scb, sch, sct, scd, ssb, ssh, sst, ssd, swb, swh, swt, swd,
    T, H,
    HD: tl.constexpr, DP: tl.constexpr, ROWS: tl.constexpr, ACC: tl.constexpr,
):
    """Program (i, bh): positions i*ROWS .. of head bh % H, batch row bh // H. Gt [B, T, H, 3], O* [B, H, T, hd] (any
    strides), Y [B, T, H, hd] contiguous."""
    b, h, t, d, t_ok, ok = _program_rows(T, H, HD, DP, ROWS)
    y = (_gate(Gt, b, h, t, 0, t_ok, sgb, sgt, sgh, sgi, ACC)[:, None]
         * _branch(OC, b, h, t, d, ok, scb, sch, sct, scd, ACC))
    y += (_gate(Gt, b, h, t, 1, t_ok, sgb, sgt, sgh, sgi, ACC)[:, None]
          * _branch(OS, b, h, t, d, ok, ssb, ssh, sst, ssd, ACC))
    y += (_gate(Gt, b, h, t, 2, t_ok, sgb, sgt, sgh, sgi, ACC)[:, None]
          * _branch(OW, b, h, t, d, ok, swb, swh, swt, swd, ACC))
    tl.store(Y + ((b * T + t[:, None]) * H + h) * HD + d[None, :], y.to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _branch_grads(DY_t, g, O, DO, DG, b, h, t, d, ok, t_ok, H, T, sob, soh, sot, sod, i,
                  HD: tl.constexpr, ACC: tl.constexpr):
    """One branch's share of the backward: DO [B, H, T, hd] (contiguous) = g dy, DG[.., i] = sum_d dy o."""
    o = _branch(O, b, h, t, d, ok, sob, soh, sot, sod, ACC)
    tl.store(DO + ((b * H + h) * T + t[:, None]) * HD + d[None, :], (g[:, None] * DY_t).to(DO.dtype.element_ty),
             mask=ok)
    tl.store(DG + ((b * T + t) * H + h) * 3 + i, tl.sum(DY_t * o, axis=1).to(DG.dtype.element_ty), mask=t_ok)


@triton.jit(do_not_specialize=["T", "H"])
def gated_combine_bwd_kernel(
    DY, Gt, OC, OS, OW, DOC, DOS, DOW, DG,
    sdb, sdt, sdh, sdd,
    sgb, sgt, sgh, sgi,
    scb, sch, sct, scd, ssb, ssh, sst, ssd, swb, swh, swt, swd,
    T, H,
    HD: tl.constexpr, DP: tl.constexpr, ROWS: tl.constexpr, ACC: tl.constexpr,
):
    """Program (i, bh) as the forward's. DY [B, T, H, hd] (any strides); DO* [B, H, T, hd] and DG [B, T, H, 3]
    contiguous."""
    b, h, t, d, t_ok, ok = _program_rows(T, H, HD, DP, ROWS)
    dy = tl.load(DY + b * sdb + t[:, None] * sdt + h * sdh + d[None, :] * sdd, mask=ok, other=0.0).to(ACC)
    _branch_grads(dy, _gate(Gt, b, h, t, 0, t_ok, sgb, sgt, sgh, sgi, ACC), OC, DOC, DG, b, h, t, d, ok, t_ok, H, T,
                  scb, sch, sct, scd, 0, HD, ACC)
    _branch_grads(dy, _gate(Gt, b, h, t, 1, t_ok, sgb, sgt, sgh, sgi, ACC), OS, DOS, DG, b, h, t, d, ok, t_ok, H, T,
                  ssb, ssh, sst, ssd, 1, HD, ACC)
    _branch_grads(dy, _gate(Gt, b, h, t, 2, t_ok, sgb, sgt, sgh, sgi, ACC), OW, DOW, DG, b, h, t, d, ok, t_ok, H, T,
                  swb, swh, swt, swd, 2, HD, ACC)


def _acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def gated_combine_fwd(g: torch.Tensor, o_cmp: torch.Tensor, o_sel: torch.Tensor, o_win: torch.Tensor) -> torch.Tensor:
    """g [B, T, H, 3], o_* [B, H, T, hd] (one dtype) -> y [B, T, H, hd] contiguous, the branches' dtype."""
    B, H, T, hd = o_cmp.shape
    y = torch.empty(B, T, H, hd, dtype=o_cmp.dtype, device=o_cmp.device)
    if y.numel():
        gated_combine_fwd_kernel[(triton.cdiv(T, ROWS), B * H)](
            g, o_cmp, o_sel, o_win, y, *g.stride(), *o_cmp.stride(), *o_sel.stride(), *o_win.stride(), T, H,
            HD=hd, DP=triton.next_power_of_2(hd), ROWS=ROWS, ACC=_acc(o_cmp.dtype),
        )
    return y


def gated_combine_bwd(d_y: torch.Tensor, g: torch.Tensor, o_cmp: torch.Tensor, o_sel: torch.Tensor,
                      o_win: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """d_y [B, T, H, hd] -> d_g [B, T, H, 3] (g's dtype), d_o_cmp, d_o_sel, d_o_win [B, H, T, hd] (contiguous)."""
    B, H, T, hd = o_cmp.shape
    d_g = torch.empty(B, T, H, 3, dtype=g.dtype, device=g.device)
    d_o = [torch.empty(B, H, T, hd, dtype=o.dtype, device=o.device) for o in (o_cmp, o_sel, o_win)]
    if d_y.numel():
        gated_combine_bwd_kernel[(triton.cdiv(T, ROWS), B * H)](
            d_y, g, o_cmp, o_sel, o_win, *d_o, d_g, *d_y.stride(), *g.stride(), *o_cmp.stride(), *o_sel.stride(),
            *o_win.stride(), T, H, HD=hd, DP=triton.next_power_of_2(hd), ROWS=ROWS, ACC=_acc(o_cmp.dtype),
        )
    return (d_g, *d_o)
