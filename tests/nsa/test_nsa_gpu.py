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


@pytest.mark.parametrize("T", [100, 300])
def test_fused_branches_match_portable_path_with_gradients(T):
    """kernel=auto on CUDA (FlexAttention compressed + window, Triton selection) against kernel=torch
    (SDPA with explicit masks) in fp32: outputs and every gradient. CPU runs only flex forward."""
    grads = {}
    for kernel in ("auto", "torch"):
        layer = make_layer(seed=13, nsa_overrides=dict(kernel=kernel)).to(device="cuda", dtype=torch.float32)
        x = make_input(2, T).to("cuda", torch.float32).requires_grad_(True)
        y = layer(x, tuple(r.cuda().float() for r in rope_for(T)))
        y.square().sum().backward()
        grads[kernel] = [y.detach(), x.grad] + [p.grad for p in layer.parameters()]
    for fused, portable in zip(grads["auto"], grads["torch"]):
        scale = portable.abs().max().clamp_min(1e-6)
        assert ((fused - portable).abs().max() / scale).item() < 2e-3


def test_dense_decode_step_never_runs_cudnn_and_equals_full_attention():
    """A dense decode step (one query against a cache whose length is new every step) must not reach cuDNN's
    SDPA: cuDNN builds an execution plan per shape (65 ms of host time a step at 32k on an H200). The ops a
    step dispatches are recorded; its output equals causal attention over the whole sequence, last row."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from nsa.attention.dense import causal_attention

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(str(func))
            return func(*args, **(kwargs or {}))

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, H, 777, 64, device="cuda", dtype=torch.bfloat16, generator=g) for H in (12, 2, 2))
    with Ops() as ops:
        step = causal_attention(q[:, :, -1:], k, v)  # the last position's decode step
    assert not any("cudnn" in name for name in ops.names), sorted(ops.names)
    full = causal_attention(q, k, v)[:, :, -1:]
    torch.testing.assert_close(step, full, rtol=2e-2, atol=2e-2)
