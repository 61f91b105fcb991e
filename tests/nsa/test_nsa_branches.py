"""Branch semantics: window / selection equal dense attention when they cover everything; Eq. 9;
forced blocks; index validity; GQA sharing; compressed-token locality."""
from __future__ import annotations

import math

import torch

from nsa.attention.impl.compression import compress, num_compressed
from nsa.attention.impl.selection import select_blocks, selection_block_scores
from tests.nsa._nsa_helpers import D, L, L_SEL, make_input, make_layer, rope_for, sorted_blocks


def dense_causal_reference(q, k, v):
    """Explicit-mask causal attention, GQA by repetition. q [B, H, T, hd]; k, v [B, H_kv, T, hd]."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    T = q.shape[2]
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    return scores.masked_fill(future, float("-inf")).softmax(-1) @ v


def branch_equals_dense(branch: str, gates, nsa_overrides):
    T = 45
    layer = make_layer(seed=4, nsa_overrides=nsa_overrides)
    layer.forced_gates = gates
    x, rope = make_input(2, T), rope_for(T)
    with torch.no_grad():
        y = layer(x, rope)
        q, kv = layer.project(x, rope)
        o = dense_causal_reference(q, *kv[branch])  # [B, H, T, hd]
        expected = layer.proj(o.transpose(1, 2).reshape(2, T, -1))
    torch.testing.assert_close(y, expected, rtol=0, atol=1e-12)


def test_window_covering_everything_equals_dense_attention():
    branch_equals_dense("win", (0.0, 0.0, 1.0), {"w": 64})


def test_selection_of_every_block_equals_dense_attention():
    branch_equals_dense("sel", (0.0, 1.0, 0.0), {"n_sel": 3})  # n >= ceil(45/16) = 3


def test_small_window_is_not_dense():
    """Sanity check of the check above: with w < T the window branch must differ from dense."""
    T = 45
    layer = make_layer(seed=4)
    layer.forced_gates = (0.0, 0.0, 1.0)
    x, rope = make_input(1, T), rope_for(T)
    with torch.no_grad():
        q, kv = layer.project(x, rope)
        dense = layer.proj(dense_causal_reference(q, *kv["win"]).transpose(1, 2).reshape(1, T, -1))
        y = layer(x, rope)
    assert torch.allclose(y[:, :16], dense[:, :16], atol=1e-12)  # p < w: window = everything so far
    assert not torch.allclose(y[:, 16:], dense[:, 16:], atol=1e-6)


def test_eq9_hand_computed_example():
    p = torch.arange(1.0, 10.0, dtype=torch.float64)  # p_cmp[0..8] = 1..9
    # paper defaults l=32, d=16, l'=64: p_slc[j] = p[4j-1] + 2p[4j] + 2p[4j+1] + 2p[4j+2] + p[4j+3]
    expected = torch.tensor([2 * 1 + 2 * 2 + 2 * 3 + 4, 4 + 2 * 5 + 2 * 6 + 2 * 7 + 8, 8 + 2 * 9], dtype=torch.float64)
    assert torch.equal(selection_block_scores(p, 32, 16, 64, 3), expected)  # 16, 48, 26
    assert torch.equal(selection_block_scores(p, L, D, L_SEL, 3), expected)  # same ratios in the test config
    # l = d: every compressed token lies in exactly one block -> plain sums of 4
    assert torch.equal(selection_block_scores(p, 16, 16, 64, 3), torch.tensor([10.0, 26.0, 9.0], dtype=torch.float64))
    # l = l' = 2d: p_slc[j] = p[2j-1] + 2 p[2j] + p[2j+1]
    assert torch.equal(selection_block_scores(p[:3], 32, 16, 32, 2), torch.tensor([2 * 1 + 2.0, 2 + 2 * 3], dtype=torch.float64))


def test_forced_blocks_survive_adversarial_scores_and_indices_are_valid():
    n, Tq, n_blocks = 4, 160, 10
    pos = torch.arange(Tq)
    current = pos // L_SEL
    blk = torch.arange(n_blocks)
    forced = (blk == 0) | (blk[None] == current[:, None]) | (blk[None] == current[:, None] - 1)
    scores = torch.where(forced, 0.0, 100.0 + blk.double())  # forced blocks score lowest
    idx = select_blocks(scores.expand(1, 1, Tq, n_blocks), 0, L_SEL, n)[0, 0]
    for p in range(Tq):
        c = p // L_SEL
        chosen = [j for j in idx[p].tolist() if j >= 0]
        assert len(chosen) == min(n, c + 1) and len(set(chosen)) == len(chosen)
        assert all(0 <= j <= c for j in chosen)  # only blocks starting at or before p
        assert {0, c, max(c - 1, 0)} <= set(chosen)
        if c >= 3:  # the one free pick: highest-scoring allowed block, i.e. the largest j <= c-2
            assert set(chosen) - {0, c, c - 1} == {c - 2}


def test_ties_go_to_the_lower_block_index():
    Tq, n_blocks = 160, 10
    idx = select_blocks(torch.zeros(1, 1, Tq, n_blocks, dtype=torch.float64), 0, L_SEL, 5)[0, 0]
    for p in (64, 100, 159):
        c = p // L_SEL
        assert sorted(j for j in idx[p].tolist() if j >= 0) == sorted({0, c - 1, c, 1, 2})


def test_gqa_groups_share_blocks_and_are_independent():
    T = 100
    layer = make_layer(seed=5)
    x, rope = make_input(1, T), rope_for(T)
    with torch.no_grad():
        _, idx = layer(x, rope, return_indices=True)
        assert not torch.equal(idx[:, 0], idx[:, 1])  # groups choose independently
        # Eq. 10 sums over the heads of a group: swapping two query heads inside group 0 changes nothing
        hd = layer.head_dim
        w = layer.q_proj.weight.view(layer.n_heads, hd, -1)
        w[[0, 1]] = w[[1, 0]].clone()
        _, idx_swapped = layer(x, rope, return_indices=True)
        assert torch.equal(sorted_blocks(idx_swapped), sorted_blocks(idx))
        # changing the queries of group 1 (heads 4..7) leaves group 0's blocks unchanged
        w[4:] = torch.randn_like(w[4:])
        _, idx_changed = layer(x, rope, return_indices=True)
        assert torch.equal(idx_changed[:, 0], idx[:, 0])
        assert not torch.equal(idx_changed[:, 1], idx[:, 1])


def test_compressed_token_depends_only_on_its_own_positions():
    T = 40
    layer = make_layer(seed=6)
    x = make_input(1, T)
    n_c = num_compressed(T, L, D)

    def tokens(inp):
        _, kv = layer.project(inp, None)
        raw_k, raw_v = kv["cmp"]
        return (compress(layer.compress_k, raw_k, 0, 0, n_c, L, D), compress(layer.compress_v, raw_v, 0, 0, n_c, L, D))

    with torch.no_grad():
        ck, cv = tokens(x)
        for i in (0, 3, n_c - 1):
            x_out, x_in = x.clone(), x.clone()
            outside = torch.ones(T, dtype=torch.bool)
            outside[i * D : i * D + L] = False
            x_out[:, outside] += 1.0
            x_in[:, i * D + L - 1] += 1.0
            ck2, cv2 = tokens(x_out)
            assert torch.equal(ck2[:, :, i], ck[:, :, i]) and torch.equal(cv2[:, :, i], cv[:, :, i])
            ck3, cv3 = tokens(x_in)
            assert not torch.equal(ck3[:, :, i], ck[:, :, i]) and not torch.equal(cv3[:, :, i], cv[:, :, i])
