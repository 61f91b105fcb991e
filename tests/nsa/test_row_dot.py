"""kernels/row_dot.py, the selection backward's delta (sum over hd of dO * O) in one launch: equal to its torch oracle
(float32 products summed in float32; float64 for float64) to the rounding of another summation order, for the
dtypes the layer runs in and a head dim that is not a power of two; mismatched shapes are refused."""
from __future__ import annotations

import pytest
import torch

from tests.nsa._nsa_helpers import KERNEL_DEVICE, kernels_unavailable

UNAVAILABLE = kernels_unavailable("row_dot")
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_row_dot_equals_the_float32_oracle(dtype):
    from nsa.attention.kernels.row_dot import row_dot

    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(2, 3, 37, 24, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    want = (a.to(wide) * b.to(wide)).sum(-1)
    got = row_dot(a.to(KERNEL_DEVICE), b.to(KERNEL_DEVICE)[..., :].clone())
    assert got.dtype == wide and got.shape == want.shape
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got.cpu(), want, atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="shapes"):
        row_dot(a, b[..., :-1])
