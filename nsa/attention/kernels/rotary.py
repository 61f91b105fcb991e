"""Rotary position embedding in one launch ("rotate half" layout, nsa.layers.apply_rotary's contract).

    out[..., :h] = x1 cos - x2 sin,   out[..., h:] = x2 cos + x1 sin      (x1 = x[..., :h], x2 = x[..., h:], h = hd/2)

computed in float32 (float64 for float64 inputs) and stored in x's dtype. `inverse` rotates by -angle: the adjoint of
the rotation, i.e. its backward (grad_x = rotate(grad_out, -angle)). The torch form of the same map is ~14 launches
forward and ~15 backward (slices, upcasts, four products, two sums, a concatenation, the slices' zero-filled
gradients); this kernel reads x and the angles once and writes the result once. Kernels only; the launcher is
`rotary`, the oracle nsa.layers.apply_rotary.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa.attention.kernels.interpreter import interpreter_active  # noqa: F401  (kernels built as the switch says)

ROWS = 32  # positions per program


@triton.jit(do_not_specialize=["T", "H"])
def rotary_kernel(
    X, COS, SIN, OUT, AT,
    sxb, sxh, sxt, sxd,
    scb, sct, scd,
    sab, sat,
    T, H,
    HALF: tl.constexpr, HP: tl.constexpr, ROWS: tl.constexpr, INVERSE: tl.constexpr, ACC: tl.constexpr,
    HAS_AT: tl.constexpr,
):
    """Program (i, bh): positions i*ROWS .. of head bh % H of batch row bh // H. X [B, H, T, 2*HALF] (any strides),
    COS / SIN [B or 1, T, HALF] (scb = 0: shared by the batch rows; same strides for both), OUT [B, H, T, 2*HALF]
    contiguous."""
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    t = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    j = tl.arange(0, HP)
    ok = (t < T)[:, None] & (j < HALF)[None, :]
    x = X + b * sxb + h * sxh + t[:, None] * sxt + j[None, :] * sxd
    x1 = tl.load(x, mask=ok, other=0.0).to(ACC)
    x2 = tl.load(x + HALF * sxd, mask=ok, other=0.0).to(ACC)
    row = t
    if HAS_AT:  # position t's angles are the table's row AT[b, t]
        row = tl.load(AT + b * sab + t * sat, mask=t < T, other=0)
    angle = b * scb + row[:, None] * sct + j[None, :] * scd
    cos = tl.load(COS + angle, mask=ok, other=0.0).to(ACC)
    sin = tl.load(SIN + angle, mask=ok, other=0.0).to(ACC)
    if INVERSE:
        sin = -sin
    out = OUT + bh * T * 2 * HALF + t[:, None] * 2 * HALF + j[None, :]
    tl.store(out, (x1 * cos - x2 * sin).to(OUT.dtype.element_ty), mask=ok)
    tl.store(out + HALF, (x2 * cos + x1 * sin).to(OUT.dtype.element_ty), mask=ok)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False,
           at: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, H, T, hd] (any strides), cos / sin [T, hd/2] or per row [B, T, hd/2] (the same layout) -> x rotated
    [B, H, T, hd], contiguous, x's dtype (inverse: by -angle). at [B, T] int64 (optional): position t of row b takes
    the tables' row at[b, t] (tables then [T', hd/2] or [B, T', hd/2]), read in the kernel instead of a gather before
    it. One launch."""
    B, H, T, hd = x.shape
    half = hd // 2
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    if cos.shape != sin.shape or cos.stride() != sin.stride():
        raise ValueError("rotary: cos and sin must share one layout")
    acc = tl.float64 if x.dtype == torch.float64 else tl.float32
    out = torch.empty(B, H, T, hd, dtype=x.dtype, device=x.device)
    if out.numel():
        rotary_kernel[(triton.cdiv(T, ROWS), B * H)](
            x, cos, sin, out, at if at is not None else cos, *x.stride(),
            cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1), cos.stride(2),
            *(at.stride() if at is not None else (0, 0)),
            T, H, HALF=half, HP=triton.next_power_of_2(half), ROWS=ROWS, INVERSE=inverse, ACC=acc, HAS_AT=at is not None,
        )
    return out
