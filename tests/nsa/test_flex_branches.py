"""FlexAttention compressed and window branches (nsa/attention/impl/flex.py) against explicit-mask references.

On CPU FlexAttention runs unfused and forward-only: these tests check (1) the block masks derived from
each branch's geometry against torch's brute-force `create_block_mask` (the fused CUDA kernels trust
them to skip tiles, the CPU path ignores them, so they are checked on their own), and (2) outputs
against float64 attention with an explicit [Tq, Tk] mask. Gradients on CUDA: tests/nsa/test_nsa_gpu.py.
(3) The compiled eager wrapper (run here on CPU with a cheap Dynamo backend) compiles once per shape family,
not once per chunk offset.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import create_block_mask

from nsa.attention.impl import flex
from nsa.attention.impl.compression import num_compressed
from nsa.attention.ops import compressed_attention, window_attention as sliding_window_attention

# (Tq, q_start, l, d, w, H_kv, G): ragged lengths, chunk offsets, GQA groups of 1, 2, 4 and 6
GEOMETRIES = [
    (300, 0, 32, 16, 64, 2, 2),
    (520, 0, 16, 8, 256, 1, 4),
    (257, 130, 32, 16, 200, 3, 1),
    (1000, 0, 32, 16, 512, 2, 6),
    (20, 0, 32, 16, 8, 1, 2),  # T < l: no compressed token at all
]


def explicit_attention(q, k, v, visible):  # visible [Tq, Tk] bool; rows with no key -> zero
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
    return p @ v


def window_geometry(Tq, q_start, w):  # the layer's window keys: the w - 1 before the chunk, then the chunk
    k_start = max(0, q_start - w + 1)
    return k_start, q_start + Tq - k_start


@pytest.mark.parametrize("geom", GEOMETRIES)
def test_flex_branches_equal_explicit_mask_attention(geom):
    Tq, q_start, l, d, w, H_kv, G = geom
    g = torch.Generator().manual_seed(Tq)
    B, hd = 2, 16
    q = torch.randn(B, H_kv * G, Tq, hd, generator=g, dtype=torch.float64)
    q_pos = torch.arange(q_start, q_start + Tq)[:, None]

    n_c = num_compressed(q_start + Tq, l, d)
    ck, cv = (torch.randn(B, H_kv, n_c, hd, generator=g, dtype=torch.float64) for _ in range(2))
    out = flex.flex_compressed_attention(q, ck, cv, q_start, l, d)
    sees = (torch.arange(n_c) * d + l - 1)[None, :] <= q_pos
    torch.testing.assert_close(out, explicit_attention(q, ck, cv, sees), rtol=0, atol=1e-12)
    torch.testing.assert_close(out, compressed_attention(q, ck, cv, q_start, l, d, 64), rtol=0, atol=1e-12)

    k_start, Tk = window_geometry(Tq, q_start, w)
    k, v = (torch.randn(B, H_kv, Tk, hd, generator=g, dtype=torch.float64) for _ in range(2))
    out = flex.flex_window_attention(q, k, v, q_start, k_start, w)
    s_pos = torch.arange(k_start, k_start + Tk)[None, :]
    band = (s_pos <= q_pos) & (s_pos > q_pos - w)
    torch.testing.assert_close(out, explicit_attention(q, k, v, band), rtol=0, atol=1e-12)
    torch.testing.assert_close(out, sliding_window_attention(q, k, v, q_start, k_start, w, 128), rtol=0, atol=1e-12)


def tiles(mask):  # BlockMask -> (partial, full) [nq, nk] bool
    partial = mask.to_dense()[0, 0].bool()
    full = torch.zeros_like(partial)
    if mask.full_kv_num_blocks is not None:
        for r in range(full.shape[0]):
            full[r, mask.full_kv_indices[0, 0, r, : mask.full_kv_num_blocks[0, 0, r]].long()] = True
    return partial & ~full, full


@pytest.mark.parametrize("geom", GEOMETRIES + [(1024, 0, 32, 16, 512, 1, 1), (640, 4096, 32, 16, 128, 1, 1)])
def test_geometric_block_masks_equal_brute_force(geom):
    """Every tile with a visible key is listed; a tile marked full has every key visible (so skipping the
    mask_mod there is exact); and, away from ragged edges, the split agrees with torch's evaluation."""
    Tq, q_start, l, d, w, _, _ = geom
    n_c = num_compressed(q_start + Tq, l, d)
    k_start, Tk = window_geometry(Tq, q_start, w)
    cases = [("cmp", n_c, 0, l, d), ("win", Tk, k_start, w, 0)]
    for kind, tk, ks, a, b in cases:
        if tk == 0:
            continue
        ours = flex._block_mask(kind, Tq, tk, q_start, ks, a, b, "cpu")
        brute = create_block_mask(ours.mask_mod, None, None, Tq, tk, device="cpu")
        (o_part, o_full), (b_part, b_full) = tiles(ours), tiles(brute)
        assert torch.equal(o_part | o_full, b_part | b_full), kind
        assert not (o_full & ~b_full).any(), kind
        whole = torch.ones_like(o_full)
        if Tq % flex.BLOCK:
            whole[-1] = False
        if tk % flex.BLOCK:
            whole[:, -1] = False
        assert torch.equal(o_full & whole, b_full & whole), kind
        if kind == "win" and w >= 3 * flex.BLOCK and Tq >= 4 * flex.BLOCK:
            assert o_full.any(), "a wide band has tiles without a mask_mod call"


def test_flex_only_for_cuda_low_precision_tensors():
    cpu = torch.zeros(1)
    assert not flex.use_flex("auto", cpu) and not flex.use_flex("triton", cpu)
    assert not flex.use_flex("auto", torch.zeros(1, device="meta"))  # only CUDA runs the fused kernels
    if torch.cuda.is_available():
        assert flex.use_flex("auto", torch.zeros(1, device="cuda"))
        assert not flex.use_flex("torch", torch.zeros(1, device="cuda"))
        assert not flex.use_flex("auto", torch.zeros(1, device="cuda", dtype=torch.float64))


@pytest.mark.parametrize("fold", [0, 64], ids=["plain", "folded"])
def test_compiled_flex_compiles_once_across_chunk_offsets(monkeypatch, fold):
    """A chunked prefill calls each branch with the same shapes at a new offset per chunk: the eager wrapper
    torch.compile(flex_attention, dynamic=False) must reuse one graph per branch (the offsets are data in
    the mask_mod, not code), and still match the SDPA path at every offset. CPU, forward, backend aot_eager:
    Dynamo's guards (what decides a recompile) do not depend on the backend. folded: the compressed branch's 256
    queries folded into 4 batch rows (the positions a captured frame: data too)."""
    monkeypatch.setattr(flex, "FOLD_QUERIES", fold)
    monkeypatch.setattr(flex, "COMPILE_DEVICES", flex.COMPILE_DEVICES | {"cpu"})
    monkeypatch.setattr(flex, "COMPILE_BACKEND", "aot_eager")
    B, H_kv, G, T, hd, l, d, w = 1, 1, 2, 256, 16, 32, 16, 64
    offsets = [256, 512, 768, 1024, 1536]  # >= w - 1: the window keys are w - 1 + T at every offset
    n_c = num_compressed(max(offsets) + T, l, d)  # one compressed key count (tokens past a query are masked)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H_kv * G, T, hd, generator=g)
    ck, cv = (torch.randn(B, H_kv, n_c, hd, generator=g) for _ in range(2))
    k, v = (torch.randn(B, H_kv, w - 1 + T, hd, generator=g) for _ in range(2))
    torch._dynamo.reset()
    counters.clear()
    try:
        for q_start in offsets:
            out = flex.flex_compressed_attention(q, ck, cv, q_start, l, d)
            ref = compressed_attention(q, ck, cv, q_start, l, d, 64)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=f"compressed, q_start={q_start}")
        assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
        for q_start in offsets:
            k_start, Tk = window_geometry(T, q_start, w)
            assert Tk == k.shape[2]
            out = flex.flex_window_attention(q, k, v, q_start, k_start, w)
            ref = sliding_window_attention(q, k, v, q_start, k_start, w, 128)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=f"window, q_start={q_start}")
        assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])  # one more: the window branch
        assert counters["frames"]["ok"] == 2, dict(counters["frames"])
    finally:
        torch._dynamo.reset()
        counters.clear()


def test_growing_compressed_keys_compile_once_per_power_of_two(monkeypatch):
    """A chunked prefill's compressed branch meets a new key count N_c every chunk (the cache's tokens so far).
    Padded to the next power of two, 16 chunks with N_c from 15 to 255 compile twice (buckets 128 and 256),
    not 16 times (past Dynamo's recompile limit of 8 flex_attention would fall back to its unfused kernel),
    and every chunk still equals the SDPA path on the unpadded keys."""
    monkeypatch.setattr(flex, "COMPILE_DEVICES", flex.COMPILE_DEVICES | {"cpu"})
    monkeypatch.setattr(flex, "COMPILE_BACKEND", "aot_eager")
    B, H_kv, G, T, hd, l, d = 1, 1, 2, 256, 16, 32, 16
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, H_kv * G, T, hd, generator=g)
    ck_all, cv_all = (torch.randn(B, H_kv, num_compressed(16 * T, l, d), hd, generator=g) for _ in range(2))
    torch._dynamo.reset()
    counters.clear()
    try:
        counts = []
        for q_start in range(0, 16 * T, T):
            n_c = num_compressed(q_start + T, l, d)  # the tokens a cache holds after this chunk
            counts.append(n_c)
            ck, cv = ck_all[:, :, :n_c], cv_all[:, :, :n_c]
            out = flex.flex_compressed_attention(q, ck, cv, q_start, l, d)
            ref = compressed_attention(q, ck, cv, q_start, l, d, 64)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=f"q_start={q_start}, N_c={n_c}")
        assert len(set(counts)) == 16 and min(counts) < 128 < max(counts) <= 256, counts
        assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    finally:
        torch._dynamo.reset()
        counters.clear()


@pytest.mark.parametrize("q_start", [0, 21])
def test_flex_compressed_log_sum_exps_equal_the_torch_path(q_start):
    """return_lse (what selection reuses, Eq. 8): FlexAttention's log-sum-exps equal the torch path's on every row
    that sees a compressed token, and are -inf on the rows that see none (the output there is 0)."""
    from nsa.attention import ops

    g = torch.Generator().manual_seed(3)
    l, d, T = 8, 4, 40
    q = torch.randn(1, 4, T, 16, generator=g, dtype=torch.float64)
    ck = torch.randn(1, 2, num_compressed(q_start + T, l, d), 16, generator=g, dtype=torch.float64)
    cv = torch.randn(ck.shape, generator=g, dtype=torch.float64)
    o, lse = flex.flex_compressed_attention(q, ck, cv, q_start, l, d, return_lse=True)
    o_ref, lse_ref = ops._compressed(q, ck, cv, q_start, l, d, 16, None)
    sees = torch.arange(q_start, q_start + T) >= l - 1  # [T] a query sees compressed token 0 from position l - 1
    assert lse.shape == (1, 4, T) and (lse[..., ~sees] == float("-inf")).all() and not o[..., ~sees, :].any()
    torch.testing.assert_close(lse[..., sees], lse_ref[..., sees], rtol=0, atol=1e-12)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-12)
    plain, with_lse = compressed_attention(q, ck, cv, q_start, l, d, 16), compressed_attention(
        q, ck, cv, q_start, l, d, 16, return_lse=True)
    # flex asked for its log-sum-exps may take another internal path: the output to fp64 rounding, not bit for bit
    torch.testing.assert_close(plain, with_lse[0], rtol=0, atol=1e-12)
    assert not with_lse[1].requires_grad


@pytest.mark.parametrize("Tq, fold, folds", [(8192, 2048, 4), (65536, 2048, 32), (6144, 2048, 3), (2048, 2048, 1),
                                             (3000, 2048, 1), (8192, 0, 1)])
def test_fold_count(monkeypatch, Tq, fold, folds):
    """The compressed branch folds its queries into Tq / FOLD_QUERIES batch rows where that divides and is >= 2."""
    monkeypatch.setattr(flex, "FOLD_QUERIES", fold)
    assert flex.fold_count(Tq) == folds


@pytest.mark.parametrize("Tq, q_start, G", [(256, 0, 6), (256, 130, 2), (192, 0, 1)])
def test_folded_compressed_branch_equals_explicit_attention(monkeypatch, Tq, q_start, G):
    """Queries folded into batch rows of 64 (4 or 3 of them, each its own chunk of positions) give the rule's
    attention row for row: the explicit-mask reference and the unfolded call (outputs and log-sum-exps, float64);
    the call really folds (FlexAttention receives B * NC rows of 64 queries and the keys expanded to them)."""
    g = torch.Generator().manual_seed(Tq + q_start)
    l, d, B, H_kv, hd = 16, 8, 2, 2, 16
    q = torch.randn(B, H_kv * G, Tq, hd, generator=g, dtype=torch.float64)
    n_c = num_compressed(q_start + Tq, l, d)
    ck, cv = (torch.randn(B, H_kv, n_c, hd, generator=g, dtype=torch.float64) for _ in range(2))
    plain = flex.flex_compressed_attention(q, ck, cv, q_start, l, d, return_lse=True)
    calls = []
    real = flex._run_flex
    monkeypatch.setattr(flex, "_run_flex", lambda site, *a, **k: calls.append((site, a[0].shape, a[1].shape))
                        or real(site, *a, **k))
    monkeypatch.setattr(flex, "FOLD_QUERIES", 64)
    o, lse = flex.flex_compressed_attention(q, ck, cv, q_start, l, d, return_lse=True)
    folds = Tq // 64
    assert [(site, tuple(qs), ks[0]) for site, qs, ks in calls] == [
        ("nsa.compressed[folded]", (B * folds, H_kv * G, 64, hd), B * folds)]
    sees = (torch.arange(n_c) * d + l - 1)[None, :] <= torch.arange(q_start, q_start + Tq)[:, None]
    torch.testing.assert_close(o, explicit_attention(q, ck, cv, sees), rtol=0, atol=1e-12)
    torch.testing.assert_close(o, plain[0], rtol=0, atol=1e-12)
    assert torch.equal(lse == float("-inf"), plain[1] == float("-inf"))  # rows that see no token: both -inf
    seen = lse > float("-inf")
    torch.testing.assert_close(lse[seen], plain[1][seen], rtol=0, atol=1e-12)
    torch.testing.assert_close(flex.flex_compressed_attention(q, ck, cv, q_start, l, d), o, rtol=0, atol=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's backward needs CUDA")
def test_cuda_folded_backward_equals_the_unfolded_one(monkeypatch):
    """Gradients of q and of the compressed keys and values (the latter summed over the folded rows by autograd)
    equal the unfolded call's, fp32 on the device."""
    g = torch.Generator(device="cuda").manual_seed(0)
    l, d, Tq, hd = 32, 16, 512, 64
    q = torch.randn(2, 12, Tq, hd, device="cuda", generator=g)
    ck, cv = (torch.randn(2, 2, num_compressed(Tq, l, d), hd, device="cuda", generator=g) for _ in range(2))
    w = torch.randn(q.shape, device="cuda", generator=g)
    grads = []
    for fold in (0, 128):
        monkeypatch.setattr(flex, "FOLD_QUERIES", fold)
        leaves = [t.detach().requires_grad_() for t in (q, ck, cv)]
        out = flex.flex_compressed_attention(*leaves, 0, l, d)
        grads.append([out, *torch.autograd.grad((out * w).sum(), leaves)])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
