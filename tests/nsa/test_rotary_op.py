"""nsa::rotary (nsa/attention/ops.py) and its Triton kernel (nsa/attention/kernels/rotary.py): the op's torch path is
nsa.layers.apply_rotary (forward: the same code; backward: the inverse rotation, equal to autograd through
apply_rotary within one rounding); the kernel, in Triton's interpreter, equals it to the
rounding of its own fused products, for shared and per-row positions, strided inputs, every dtype the layer
uses, and its inverse undoes it."""
from __future__ import annotations

import importlib

import pytest
import torch

from nsa.attention import ops
from nsa.layers import RotaryEmbedding, apply_rotary
from tests.nsa._nsa_helpers import KERNEL_DEVICE, kernels_unavailable


# a product sum rounded once per term in fp32 (or fused), or in another order: a few ulp of fp32, one bf16 rounding
TOLERANCE = {torch.float64: dict(atol=1e-12, rtol=1e-12), torch.float32: dict(atol=2e-6, rtol=2e-6),
             torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


def _case(dtype, per_row: bool, seed: int = 0, B: int = 2, H: int = 3, T: int = 37, hd: int = 16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H + 2, T, hd, generator=g, dtype=torch.float64)[:, 1:-1].to(dtype)  # strided, as a slice
    positions = torch.randint(0, 500, (B, T), generator=g) if per_row else torch.arange(T) * 7
    if dtype != torch.float64:
        cos, sin = RotaryEmbedding(hd, 10_000.0)(positions)  # float32, as the model's are
        return x, cos, sin
    # float64 angles (cos^2 + sin^2 = 1 to float64 rounding: the inverse rotation gives x back)
    angles = positions[..., None].double() * 10_000.0 ** (-torch.arange(hd // 2, dtype=torch.float64) / (hd // 2))
    return x, angles.cos(), angles.sin()


@pytest.mark.parametrize("per_row", [False, True], ids=["shared", "per_row"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_torch_path_is_apply_rotary_and_its_gradient_the_inverse_rotation(dtype, per_row):
    x, cos, sin = _case(dtype, per_row)
    d_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    a = x.clone().requires_grad_(True)
    want = apply_rotary(a, cos, sin)
    want.backward(d_out)
    b = x.clone().requires_grad_(True)
    got = ops.rotary(b, cos, sin, "torch")
    got.backward(d_out)
    assert got.is_contiguous() and got.dtype == dtype
    assert torch.equal(got, want)  # the same code: apply_rotary
    # the gradient is another code path (the inverse rotation against autograd's products and sums): equal in exact
    # arithmetic, so within one rounding of the dtype
    assert b.grad.dtype == a.grad.dtype
    torch.testing.assert_close(b.grad, a.grad, **TOLERANCE[dtype])


def test_rotary_op_passes_opcheck():
    x, cos, sin = _case(torch.float64, per_row=True)
    torch.library.opcheck(ops._rotary.op, (x.contiguous().requires_grad_(True), cos, sin, False, "torch"))
    at = torch.randint(0, x.shape[2], (x.shape[0], 5), generator=torch.Generator().manual_seed(4))
    torch.library.opcheck(ops._rotary.op, (x[:, :, :5].contiguous().requires_grad_(True), cos, sin, False, "torch", at))


DEV = KERNEL_DEVICE
UNAVAILABLE = kernels_unavailable("rotary")
needs_interpreter = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))
kr = None if UNAVAILABLE else importlib.import_module("nsa.attention.kernels.rotary")


@needs_interpreter
@pytest.mark.parametrize("per_row", [False, True], ids=["shared", "per_row"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_kernel_equals_apply_rotary_and_its_inverse_undoes_it(dtype, per_row):
    x, cos, sin = (t.to(DEV) for t in _case(dtype, per_row, seed=1, hd=24))  # hd/2 = 12: a padded power-of-two tile
    want = apply_rotary(x, cos, sin)
    got = kr.rotary(x, cos, sin)
    assert got.is_contiguous() and got.dtype == dtype
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    back = kr.rotary(got, cos, sin, inverse=True)
    torch.testing.assert_close(back, apply_rotary(got, cos, -sin), **TOLERANCE[dtype])
    if dtype == torch.float64:
        torch.testing.assert_close(back, x, atol=1e-12, rtol=1e-12)  # a rotation's inverse


@needs_interpreter
def test_triton_op_backward_is_the_inverse_rotation_of_the_gradient():
    x, cos, sin = (t.to(DEV) for t in _case(torch.float64, per_row=True, seed=2))
    d_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64).to(DEV)
    a = x.clone().requires_grad_(True)
    apply_rotary(a, cos, sin).backward(d_out)
    b = x.clone().requires_grad_(True)
    ops.rotary(b, cos, sin, "triton").backward(d_out)
    torch.testing.assert_close(b.grad, a.grad, atol=1e-12, rtol=1e-12)
    assert not torch.allclose(b.grad, d_out)  # a real rotation: the gradient moved


@pytest.mark.parametrize("kernel", ["torch", "triton"])
@pytest.mark.parametrize("per_row", [False, True], ids=["shared", "per_row"])
def test_rows_taken_by_index_equal_the_gathered_tables(kernel, per_row):
    """`at` [B, T] (packed documents' compressed keys: each at its block's last position): the op equals rotating by
    the gathered rows (the torch path gathers them: bit for bit; the kernel reads them: to float64 rounding), forward
    and backward; rows of the tables no index names change nothing."""
    if kernel == "triton" and UNAVAILABLE:
        pytest.skip(UNAVAILABLE)
    dev = DEV if kernel == "triton" else torch.device("cpu")
    x, cos, sin = (t.to(dev) for t in _case(torch.float64, per_row, seed=3, T=41))
    B, _, _, hd = x.shape
    g = torch.Generator().manual_seed(7)
    at = torch.randint(0, 30, (B, 11), generator=g).to(dev)  # 11 outputs from rows 0 .. 29 of 41
    y = x[:, :, :11].clone().requires_grad_(True)
    index = at[..., None].expand(-1, -1, hd // 2)
    rows = [t.expand(B, *t.shape[-2:]).gather(1, index) for t in (cos, sin)]
    d_out = torch.randn(y.shape, generator=g, dtype=torch.float64).to(dev)
    want = apply_rotary(y, *rows)
    (want_grad,) = torch.autograd.grad(want, y, d_out)
    got = ops.rotary(y, cos, sin, kernel, at=at)
    (got_grad,) = torch.autograd.grad(got, y, d_out)
    tol = dict(atol=0, rtol=0) if kernel == "torch" else dict(atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(got_grad, want_grad, **tol)
    unread = torch.ones(41, dtype=torch.bool)
    unread[at.flatten().cpu()] = False
    cos2, sin2 = cos.clone(), sin.clone()
    cos2[..., unread.to(dev), :] += 1.0
    sin2[..., unread.to(dev), :] -= 1.0
    assert torch.equal(ops.rotary(y, cos2, sin2, kernel, at=at), got)
