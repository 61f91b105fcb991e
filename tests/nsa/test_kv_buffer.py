"""The decode caches' storage: append-only growing buffer and the window ring buffer."""
from __future__ import annotations

import torch

from nsa.attention.dense import KVCache
from nsa.attention.kv_buffer import GrowingBuffer, RingBuffer

CHUNKS = [3, 5, 4, 4, 1, 7, 1, 1, 12, 2, 1]


def positions(t: int, n: int) -> torch.Tensor:  # [1, 2, n, 3]: every entry holds its position
    return torch.arange(t, t + n, dtype=torch.float64).view(1, 1, n, 1).expand(1, 2, n, 3).contiguous()


def test_ring_buffer_keeps_the_last_positions_in_order_and_unordered():
    ring, t = RingBuffer(5), 0
    assert ring.latest(4) is None
    for n in CHUNKS:
        ring.append(positions(t, n))
        t += n
        want = list(range(max(0, t - 5), t))
        assert ring.latest(5)[0, 0, :, 0].tolist() == want
        assert ring.latest(3)[0, 0, :, 0].tolist() == want[-3:]
        assert sorted(ring.unordered()[0, 1, :, 2].tolist()) == want
    assert ring.data.shape[2] == 5 and ring.t == t


def test_growing_buffer_and_dense_cache_hold_everything_appended():
    buf, cache, t = GrowingBuffer(quantum=4), KVCache(), 0
    for n in CHUNKS:
        x = positions(t, n)
        buf.append(x)
        k, v = cache.append(x, -x)
        t += n
        assert buf.view()[0, 0, :, 0].tolist() == list(range(t))
        assert buf.data.shape[2] % 4 == 0 and bool((buf.data[:, :, t:] == 0).all())
        assert torch.equal(k, positions(0, t)) and torch.equal(v, -positions(0, t)) and cache.length == t
