"""Cached decode and chunked prefill equal one full prefill; cache bookkeeping and reads per step."""
from __future__ import annotations

import pytest
import torch

from tests.nsa._nsa_helpers import D, L, L_SEL, N_SEL, W, make_input, make_layer, rope_for


def run_in_chunks(layer, x, chunks):
    cache, outs, idxs, t = layer.new_cache(), [], [], 0
    rope = rope_for(x.shape[1])
    for n in chunks:
        y, idx = layer(x[:, t : t + n], (rope[0][t : t + n], rope[1][t : t + n]), cache, return_indices=True)
        outs.append(y)
        idxs.append(idx)
        t += n
    assert t == x.shape[1] and cache.t == t
    return torch.cat(outs, 1), torch.cat(idxs, 2), cache


# T = 70 crosses t+1 = l (8), l+d (12), multiples of l' (16, 32, 48, 64) and w (16)
@pytest.mark.parametrize(
    "chunks",
    [[1] * 70, [3, 5, 4, 4, 16, 1, 7, 30], [L - 1, 1, D, L_SEL - L - D, 1, 1, 52], [70]],
    ids=["token-by-token", "irregular", "boundaries", "one-chunk"],
)
def test_decode_and_chunked_prefill_equal_full_prefill(chunks):
    T = 70
    layer = make_layer(seed=7)
    x = make_input(2, T, seed=8)
    with torch.no_grad():
        y_full, idx_full = layer(x, rope_for(T), return_indices=True)
        y, idx, _ = run_in_chunks(layer, x, chunks)
    torch.testing.assert_close(y, y_full, rtol=0, atol=1e-12)
    assert torch.equal(idx, idx_full)


def test_cache_keeps_bounded_window_and_compression_tail():
    layer = make_layer()
    with torch.no_grad():
        _, _, cache = run_in_chunks(layer, make_input(1, 70), [1] * 70)
    assert cache.win_k.data.shape[2] == W and cache.win_k.t == 70  # a ring of the last w positions
    assert cache.cmp_raw_k.shape[2] < L
    assert cache.n_compressed == (70 - L) // D + 1
    assert cache.sel_k.length == 70 and cache.sel_k.data.shape[2] % L_SEL == 0


def test_reads_per_step_formula():
    layer = make_layer()
    cache = layer.new_cache()
    x = make_input(1, 100)
    rope = rope_for(100)
    expected = []
    with torch.no_grad():
        for t in range(100):
            layer(x[:, t : t + 1], (rope[0][t : t + 1], rope[1][t : t + 1]), cache)
            n_c = 0 if t + 1 < L else (t + 1 - L) // D + 1
            expected.append(n_c + min(N_SEL, t // L_SEL + 1) * L_SEL + min(W, t + 1))
            assert cache.reads_per_step() == expected[-1]
    # once t >= n*l' (64) it is the paper's N_c + n*l' + min(w, t): at t = 100, 24 + 64 + 16
    assert cache.reads_per_step() == 24 + N_SEL * L_SEL + W == 104
    assert cache.dense_reads_per_step() == 100
