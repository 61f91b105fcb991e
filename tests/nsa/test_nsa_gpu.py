"""GPU checks (skipped without CUDA): bf16 vectorised path vs the float64 reference."""
from __future__ import annotations

import pytest
import torch

from nsa.attention.reference import reference_forward
from tests.nsa._nsa_helpers import make_input, make_layer, rope_for

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("T", [33, 100])
def test_bf16_on_gpu_close_to_float64_reference(T):
    layer = make_layer(seed=11).cpu()
    x, rope = make_input(2, T).cpu(), tuple(r.cpu() for r in rope_for(T))
    gpu = layer.to(device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        y = gpu(x.to("cuda", torch.bfloat16), tuple(r.cuda() for r in rope)).double().cpu()
        # the reference sees exactly the bf16 parameters and inputs, computed in float64
        ref, _ = reference_forward(gpu.cpu(), x.to(torch.bfloat16), rope)
    rel_rms = ((y - ref).square().mean().sqrt() / ref.square().mean().sqrt()).item()
    assert rel_rms < 5e-3, rel_rms


def test_bf16_gradients_finite_on_gpu():
    layer = make_layer(seed=12).to(device="cuda", dtype=torch.bfloat16)
    x = make_input(2, 64).to("cuda", torch.bfloat16).requires_grad_(True)
    layer(x, tuple(r.cuda() for r in rope_for(64))).float().square().sum().backward()
    assert torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters())
