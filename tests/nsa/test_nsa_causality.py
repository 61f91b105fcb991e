"""Causality of the vectorised NSA path: no NaN, perturbation, exact-zero Jacobian, selection indices."""
from __future__ import annotations

import pytest
import torch

from tests.nsa._nsa_helpers import D, DEVICE, L, L_SEL, T_VALUES, make_input, make_layer, rope_for


def probe_positions(T: int) -> list[int]:
    """t around l-1, multiples of d, l'-1, l' and T-2 (those inside [0, T-2])."""
    cands = {L - 2, L - 1, L, D, 2 * D, 3 * D, L_SEL - 1, L_SEL, L_SEL + 1, 2 * L_SEL, T - 2, 0}
    return sorted(t for t in cands if 0 <= t <= T - 2)


@pytest.mark.parametrize("T", T_VALUES)
def test_no_nan_or_inf_in_outputs_or_gradients(T):
    layer = make_layer()
    x = make_input(2, T).requires_grad_(True)
    y = layer(x, rope_for(T))
    assert torch.isfinite(y).all()
    y.square().sum().backward()
    assert torch.isfinite(x.grad).all()
    for name, p in layer.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), name


@pytest.mark.parametrize("T", [T for T in T_VALUES if T >= 2])
def test_future_perturbation_leaves_past_bit_identical(T):
    layer = make_layer()
    x, rope = make_input(2, T), rope_for(T)
    with torch.no_grad():
        y, idx = layer(x, rope, return_indices=True)
        for t in probe_positions(T):
            x2 = x.clone()
            x2[:, t + 1 :] = torch.randn_like(x2[:, t + 1 :]) * 3.0
            y2, idx2 = layer(x2, rope, return_indices=True)
            assert torch.equal(y2[:, : t + 1], y[:, : t + 1]), f"output leaked at t={t}"
            assert torch.equal(idx2[:, :, : t + 1], idx[:, :, : t + 1]), f"selection leaked at t={t}"
            assert not torch.equal(y2[:, t + 1 :], y[:, t + 1 :])  # the perturbation did something


@pytest.mark.parametrize("T", [9, 33, 64])
def test_jacobian_wrt_future_inputs_is_exactly_zero(T):
    layer = make_layer(seed=1)
    rope = rope_for(T)
    for t in probe_positions(T):
        x = make_input(1, T).requires_grad_(True)
        y = layer(x, rope)
        (grad,) = torch.autograd.grad(y[:, t].sum(), x)
        assert torch.count_nonzero(grad[:, t + 1 :]) == 0, f"d y[{t}] / d x[>{t}] != 0"
        assert torch.count_nonzero(grad[:, t]) > 0


def test_selection_uses_only_visible_compressed_tokens():
    """Selection scores must not depend on compressed tokens a query cannot see: a query just before a
    compressed token completes keeps its blocks when only that token's last position changes."""
    T = 64
    layer = make_layer(seed=2)
    rope = rope_for(T)
    x = make_input(1, T)
    with torch.no_grad():
        _, idx = layer(x, rope, return_indices=True)
        for end in range(L - 1, T, D):  # end position of compressed token (end - l + 1) / d
            x2 = x.clone()
            x2[:, end] += 5.0
            _, idx2 = layer(x2, rope, return_indices=True)
            assert torch.equal(idx2[:, :, :end], idx[:, :, :end])


def test_window_branch_is_causal_with_forced_gates():
    for gates in [(1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0)]:
        layer = make_layer(seed=3)
        layer.forced_gates = gates
        T, t = 40, 20
        x = make_input(1, T).requires_grad_(True)
        y = layer(x, rope_for(T))
        (grad,) = torch.autograd.grad(y[:, t].sum(), x)
        assert torch.count_nonzero(grad[:, t + 1 :]) == 0, gates


def test_selection_importance_ignores_invisible_compressed_tokens():
    """p_cmp of query p is bit-identical when compressed tokens it cannot see change (catches a softmax
    over all compressed tokens, which leaks the future into selection but not into the outputs)."""
    from nsa.attention.impl.compression import compression_group_probs, visible_compressed

    g = torch.Generator().manual_seed(0)
    T, n_c = 64, (64 - L) // D + 1
    q = torch.randn(1, 2, 4, T, 16, generator=g, dtype=torch.float64).to(DEVICE)
    ck = torch.randn(1, 2, n_c, 16, generator=g, dtype=torch.float64).to(DEVICE)
    probs = compression_group_probs(q, ck, 0, L, D)
    for p in (L - 2, L - 1, L + D - 1, 40, T - 1):
        vis = visible_compressed(p, L, D)
        ck2 = ck.clone()
        ck2[:, :, vis:] += 10.0
        probs2 = compression_group_probs(q, ck2, 0, L, D)
        assert torch.equal(probs2[:, :, p], probs[:, :, p])
        assert torch.count_nonzero(probs[:, :, p, vis:]) == 0
        if vis:
            torch.testing.assert_close(probs[:, :, p].sum(-1), torch.full_like(probs[:, :, p, 0], 4.0))
