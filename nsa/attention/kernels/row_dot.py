"""Row-wise dot products in float32 in one launch: delta = sum_d dO * O, the softmax backward's per-row term.

    out[r] = sum_j a[r, j] * b[r, j]      a, b [..., hd] (one shape, any dtype), out [...] float32 (float64 for float64)

In torch ops under bf16 autocast this is four launches (two upcasts, the product, the sum) and two in float32; here
the rows are read once in their dtype and summed in float32. Kernels only; the launcher is `row_dot`, the oracle
`(a.float() * b.float()).sum(-1)`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa.attention.kernels.interpreter import interpreter_active  # noqa: F401  (kernels built as the switch says)

ROWS = 32  # rows per program


@triton.jit(do_not_specialize=["R"])
def row_dot_kernel(A, B, OUT, R, HD: tl.constexpr, DP: tl.constexpr, ROWS: tl.constexpr, ACC: tl.constexpr):
    """Program i: rows i*ROWS .. of A, B [R, HD] (contiguous) -> OUT [R]."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    j = tl.arange(0, DP)
    ok = (r < R)[:, None] & (j < HD)[None, :]
    at = r[:, None] * HD + j[None, :]
    a = tl.load(A + at, mask=ok, other=0.0).to(ACC)
    b = tl.load(B + at, mask=ok, other=0.0).to(ACC)
    tl.store(OUT + r, tl.sum(a * b, axis=1), mask=r < R)


def row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a, b [..., hd] (the same shape) -> [...] float32 (float64 for float64 inputs), contiguous. One launch."""
    if a.shape != b.shape:
        raise ValueError(f"row_dot: shapes {tuple(a.shape)} and {tuple(b.shape)} differ")
    a, b = a.contiguous(), b.contiguous()
    wide = torch.float64 if torch.float64 in (a.dtype, b.dtype) else torch.float32
    out = torch.empty(a.shape[:-1], dtype=wide, device=a.device)
    hd, rows = a.shape[-1], out.numel()
    if rows:
        row_dot_kernel[(triton.cdiv(rows, ROWS),)](a, b, out, rows, HD=hd, DP=triton.next_power_of_2(hd), ROWS=ROWS,
                                                   ACC=tl.float64 if wide == torch.float64 else tl.float32)
    return out
