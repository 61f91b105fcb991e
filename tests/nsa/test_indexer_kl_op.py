"""The indexer's KL term as one op (nsa::indexer_kl, ops.indexer_kl): its closed-form backward
(impl/index_scores.kl_loss_backward) against autograd through the torch formula (kl_loss), in float64, for both
poolings, with blocks whose tokens tie for the max; the op's value and gradient on the torch path."""
from __future__ import annotations

import pytest
import torch

from nsa.attention import ops
from nsa.attention.impl.index_scores import kl_loss, kl_loss_backward

H_KV, HEADS, DIM = 2, 2, 8


def make(T: int, R: int, l_sel: int, seed: int = 0, ties: bool = False):
    """out [1, T, P] (a projection output) and a target [1, H_kv, R, N_b] with zeros (a block the target gives no
    mass), float64."""
    g = torch.Generator().manual_seed(seed)
    P = H_KV * HEADS * (DIM + 1) + DIM
    out = torch.randn(1, T, P, generator=g, dtype=torch.float64)
    if ties:  # two tokens of a block with the same index key: their max ties in every dim and every score
        out[0, 9, -DIM:] = out[0, 10, -DIM:]
    n_blocks = -(-T // l_sel)
    target = torch.rand(1, H_KV, R, n_blocks, generator=g, dtype=torch.float64)
    target[..., 2] = 0.0
    return out, target


@pytest.mark.parametrize("per_token", [True, False])
@pytest.mark.parametrize("T, R, l_sel, ties", [(64, 64, 8, False), (70, 23, 8, True), (100, 17, 16, False)])
def test_closed_form_backward_is_autograds(per_token, T, R, l_sel, ties):
    out, target = make(T, R, l_sel, ties=ties)
    weight = 0.7
    x = out.clone().requires_grad_()
    loss, stats = kl_loss(x, target, H_KV, HEADS, DIM, R, l_sel, per_token, weight)
    assert loss.item() > 0 and stats.shape == (1, H_KV, R, 2)
    grad = torch.tensor(1.3, dtype=torch.float64)
    (want,) = torch.autograd.grad(loss, x, grad)
    got = kl_loss_backward(grad, out, target, H_KV, HEADS, DIM, R, l_sel, per_token, weight)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13)
    rows = torch.arange(R) * T // R
    others = torch.ones(T, dtype=torch.bool)
    others[rows] = False
    assert (got[:, others, : H_KV * HEADS * (DIM + 1)] == 0).all()  # q and w get gradient at the KL's rows only
    assert (got[:, :, -DIM:] != 0).any()


@pytest.mark.parametrize("per_token", [True, False])
def test_the_op_on_the_torch_path(per_token):
    T, R, l_sel = 80, 31, 8
    out, target = make(T, R, l_sel, seed=2)
    a = out.clone().requires_grad_()
    b = out.clone().requires_grad_()
    want, _ = kl_loss(a, target, H_KV, HEADS, DIM, R, l_sel, per_token, 2.0)
    got = ops.indexer_kl(b, target, H_KV, HEADS, DIM, R, l_sel, per_token, 2.0, "torch")
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    want.backward()
    got.backward()
    torch.testing.assert_close(b.grad, a.grad, rtol=1e-10, atol=1e-13)
