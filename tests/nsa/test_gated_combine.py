"""nsa::gated_combine (nsa/attention/ops.py), the gated sum of NSA's branches (Eq. 5) in the output projection's
layout: its torch path equals gated_sum with autograd (forward: the same code; gradients within a few roundings); the Triton kernels (kernels/gated_combine.py, Triton's interpreter) equal it to their fp32 accumulation's
rounding, with branch outputs of any strides; each input's gradient moves when that input does."""
from __future__ import annotations

import pytest
import torch

from nsa.attention import ops
from nsa.attention.impl.combine import gated_sum
from tests.nsa._nsa_helpers import KERNEL_DEVICE, kernels_unavailable


def _case(dtype, seed: int = 0, B: int = 2, H: int = 3, T: int = 37, hd: int = 24):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    gates = torch.rand(B, T, H, 3, generator=g, dtype=torch.float64).to(dtype)
    o_sel = rnd(B, H, T + 5, hd)[:, :, 5:]  # strided, as a slice of a larger buffer
    return gates, rnd(B, H, T, hd), o_sel, rnd(B, H, T, hd), rnd(B, T, H, hd)


def _grads(fn, gates, oc, os_, ow, d_y):
    leaves = [t.clone().requires_grad_(True) for t in (gates, oc, os_, ow)]
    y = fn(*leaves)
    y.backward(d_y)
    return y.detach(), [t.grad for t in leaves]


def _autograd_reference(gates, oc, os_, ow):
    return gated_sum(gates, oc, os_, ow).transpose(1, 2)  # [B, T, H, hd]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_torch_path_equals_gated_sum_with_autograd(dtype):
    case = _case(dtype)
    y_ref, g_ref = _grads(_autograd_reference, *case)
    y, grads = _grads(lambda *t: ops.gated_combine(*t, "torch"), *case)
    assert y.is_contiguous() and torch.equal(y, y_ref)  # the same code: gated_sum
    # the gradients are another code path (explicit products and sums against autograd's): the gates' sums over hd
    # may be ordered otherwise on another CPU, so within a few roundings of the dtype
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for name, a, b in zip(("gates", "o_cmp", "o_sel", "o_win"), grads, g_ref):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=name)


def test_gated_combine_ops_pass_opcheck():
    gates, oc, os_, ow, d_y = _case(torch.float64)
    torch.library.opcheck(ops._combine.op, tuple(t.requires_grad_(True) for t in (gates, oc, os_.contiguous(), ow))
                          + ("torch",))
    torch.library.opcheck(ops._combine_bwd.op, (d_y, gates.detach(), oc.detach(), os_.detach(), ow.detach(), "torch"))


DEV = KERNEL_DEVICE
UNAVAILABLE = kernels_unavailable("gated_combine")
needs_kernels = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_kernels_equal_the_torch_path(dtype):
    tol = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 2e-2}[dtype]
    case = [t.to(DEV) for t in _case(dtype, seed=1)]
    y_ref, g_ref = _grads(lambda *t: ops.gated_combine(*t, "torch"), *case)
    y, grads = _grads(lambda *t: ops.gated_combine(*t, "triton"), *case)
    torch.testing.assert_close(y, y_ref, atol=tol, rtol=tol)
    for name, a, b in zip(("gates", "o_cmp", "o_sel", "o_win"), grads, g_ref):
        assert a.dtype == b.dtype and a.is_contiguous(), name
        # the gates' gradient sums hd products: fp32 accumulation against the torch path's (bf16: its own rounding)
        torch.testing.assert_close(a, b, atol=tol * (8 if name == "gates" else 1), rtol=tol, msg=name)


@needs_kernels
def test_each_input_moves_its_own_gradient():
    """Perturb one branch output: only the gates' gradient and the output change (not the branches' gradients,
    which are g * dy); perturb the gates: the branches' gradients change."""
    gates, oc, os_, ow, d_y = (t.to(DEV) for t in _case(torch.float64, seed=2))
    base_y, base = _grads(lambda *t: ops.gated_combine(*t, "triton"), gates, oc, os_, ow, d_y)
    y, moved = _grads(lambda *t: ops.gated_combine(*t, "triton"), gates, oc, os_ * 1.1, ow, d_y)
    assert not torch.equal(y, base_y) and not torch.equal(moved[0], base[0])
    assert all(torch.equal(a, b) for a, b in zip(moved[1:], base[1:]))
    _, moved = _grads(lambda *t: ops.gated_combine(*t, "triton"), gates * 0.5, oc, os_, ow, d_y)
    assert all(not torch.equal(a, b) for a, b in zip(moved[1:], base[1:]))
