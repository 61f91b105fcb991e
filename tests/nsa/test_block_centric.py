"""Block-centric selected attention (nsa/attention/kernels/block_centric.py, chosen for G < 16 by
nsa/attention/kernels/selected_attention.py): forward out/lse and dq/dk/dv equal the query-centric kernels and the
float64 dense reference; bit-identical reruns; the by-slot inverted index; the tile configs.

Triton's interpreter without CUDA (tests/conftest.py); sizes stay small (T <= 64).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.nsa.test_triton_selection import ATOL, DEV, RTOL, dense_reference, grads, make_case, ts  # skips without triton
from tests.nsa.interpreter_probe import interpreter_loop_problem
from nsa.attention.impl.index import frame_block_keys_torch, segment_keys_torch, sorted_entries_torch, tile_layout_torch
from nsa.attention.kernels.index_tiles import frame_block_keys, segment_keys, sorted_entries, tile_layout

if reason := interpreter_loop_problem():  # tests/nsa/interpreter_probe.py: a Triton interpreter limit
    pytest.skip(reason, allow_module_level=True)

CASES = {  # B, H_kv, G, Tq, hd, l', n, q_start, shuffle, q_tile
    "G1_T40": (1, 1, 1, 40, 16, 16, 4, 0, False, 4),  # T not a multiple of l'
    "G2_qstart_shuffled": (2, 1, 2, 17, 16, 8, 4, 17, True, 3),  # a later chunk, -1 anywhere in a row
    "G6_hd24_tiles_below_block": (1, 1, 6, 45, 24, 16, 4, 0, False, 5),  # 45 queries pick block 0: 9 tiles
    "G6_n_above_blocks": (1, 2, 6, 11, 16, 16, 16, 0, False, 64),  # one block, 15 empty slots per row
}
RERUN = "G2_qstart_shuffled"  # determinism: rerun once (the interpreter is slow)


def _run(path, monkeypatch, q, k, v, idx, d_o, q_start, l_sel, q_tile):
    monkeypatch.setattr(ts, "SELECTION_PATH", path)
    out, lse = ts.selected_attention_fwd(q, k, v, idx, q_start, l_sel, q_tile=q_tile)
    return (out, lse, *ts.selected_attention_bwd(q, k, v, idx, out, lse, d_o, q_start, l_sel, q_tile=q_tile))


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_block_centric_matches_query_centric_and_float64(case, monkeypatch):
    monkeypatch.setattr(ts, "KV_TILE", 7)  # dK/dV tiles smaller than a block's queries too
    B, H_kv, G, Tq, hd, l_sel, n, q_start, shuffle, q_tile = CASES[case]
    q, k, v, idx = make_case(B, H_kv, G, Tq, hd, l_sel, n, q_start, shuffle=shuffle, seed=len(case))
    d_o = torch.randn(q.shape, generator=torch.Generator().manual_seed(9)).to(DEV)
    blk = _run("block", monkeypatch, q, k, v, idx, d_o, q_start, l_sel, q_tile)
    qry = _run("query", monkeypatch, q, k, v, idx, d_o, q_start, l_sel, q_tile)
    _, lse_ref = dense_reference(q, k, v, idx, q_start, l_sel)
    ref = grads(lambda *t: dense_reference(*t, idx, q_start, l_sel)[0], q.double(), k.double(), v.double(), d_o.double())
    ref = (ref[0], lse_ref, *ref[1:])
    for name, a, b, c in zip(("out", "lse", "dq", "dk", "dv"), blk, qry, ref):
        assert a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous(), name
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a.double(), c, atol=ATOL, rtol=RTOL, msg=lambda m: f"{name} vs float64: {m}")
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m: f"{name} vs query-centric: {m}")
    if case == RERUN:
        again = _run("block", monkeypatch, q, k, v, idx, d_o, q_start, l_sel, q_tile)
        assert all(torch.equal(a, b) for a, b in zip(blk, again))  # no atomics: bit-identical reruns


def test_empty_rows_and_future_blocks_give_zero_without_nan(monkeypatch):
    """A row with no valid slot (all -1) gets out 0, lse -inf and dq 0; a block wholly after its query
    (no visible key) adds nothing. Block-centric path only."""
    monkeypatch.setattr(ts, "SELECTION_PATH", "block")
    q, k, v, idx = make_case(1, 1, 2, 20, 16, 8, 4, seed=5)
    idx[..., 3, :] = -1  # query 3 selects nothing
    idx[..., 4, :] = torch.tensor([0, 2, -1, -1])  # block 2 (keys 16..23) is after query 4
    d_o = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(DEV)
    d_o[..., 3, :] = 0  # the float64 reference has NaN on an empty row: compare the others
    out, lse = ts.selected_attention_fwd(q, k, v, idx, 0, 8, q_tile=2)
    dq, dk, dv = ts.selected_attention_bwd(q, k, v, idx, out, lse, d_o, 0, 8, q_tile=2)
    assert not out[..., 3, :].any() and not dq[..., 3, :].any() and (lse[..., 3] == float("-inf")).all()
    idx_ref = idx.clone()
    idx_ref[..., 3, :] = torch.tensor([0, -1, -1, -1])  # query 3 with d_o = 0 adds nothing to dk, dv
    _, lse_ref = dense_reference(q, k, v, idx_ref, 0, 8)
    ref = grads(lambda *t: dense_reference(*t, idx_ref, 0, 8)[0], q.double(), k.double(), v.double(), d_o.double())
    keep = torch.arange(20) != 3
    torch.testing.assert_close(lse[..., keep].double(), lse_ref[..., keep], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(out[..., keep, :].double(), ref[0][..., keep, :], atol=ATOL, rtol=RTOL)
    for name, a, b in zip(("dq", "dk", "dv"), (dq, dk, dv), ref[1:]):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a.double(), b, atol=ATOL, rtol=RTOL, msg=lambda m: f"{name}: {m}")


def test_default_path_follows_group_size(monkeypatch):
    assert ts.SELECTION_PATH == "auto"
    assert ts.use_block_centric(6) and ts.use_block_centric(1) and not ts.use_block_centric(16)
    launched = {}
    active = ts.interpreter_active()
    monkeypatch.setattr(ts, "interpreter_active", lambda: active)  # it looks at _fwd_kernel, spied on below
    for name in ("block_fwd_kernel", "block_dq_kernel", "slot_merge_kernel", "slot_sum_kernel", "_fwd_kernel",
                 "_dq_kernel"):
        kernel = getattr(ts, name)

        class Spy:  # records the launch, then runs the kernel
            def __getitem__(self, grid, kernel=kernel, name=name):
                launched[name] = launched.get(name, 0) + 1
                return kernel[grid]

        monkeypatch.setattr(ts, name, Spy())
    for G in (6, 16):
        q, k, v, idx = make_case(1, 1, G, 9, 16, 8, 3, seed=G)
        out, lse = ts.selected_attention_fwd(q, k, v, idx, 0, 8)
        ts.selected_attention_bwd(q, k, v, idx, out, lse, torch.ones_like(out), 0, 8)
    # G = 6: one launch for all slots (n = 3) and one merge, whatever Tq; G = 16: the query-centric kernels once
    assert launched == {"block_fwd_kernel": 1, "block_dq_kernel": 1, "slot_merge_kernel": 1, "slot_sum_kernel": 1,
                        "_fwd_kernel": 1, "_dq_kernel": 1}
    monkeypatch.setattr(ts, "SELECTION_PATH", "blocks")
    with pytest.raises(ValueError, match="SELECTION_PATH"):
        ts.use_block_centric(6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_slots_split_across_launches_give_the_same_result(dtype, monkeypatch):
    """PARTIAL_BYTES bounds the per-slot partials one launch writes: at most 2 slots' worth here, so n = 5 slots
    take 3 launch pairs, each merging into the result of the earlier ones (16-bit outputs then keep that result
    in fp32). Same out / lse / dq as one launch for all slots, to the rounding of a different summation order."""
    monkeypatch.setattr(ts, "SELECTION_PATH", "block")
    q, k, v, idx = make_case(1, 2, 3, 24, 16, 8, 5, shuffle=True, seed=4)
    idx[..., 6, :] = -1  # a row with no block: o 0, lse -inf, dq 0 in both
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    d_o = torch.randn(q.shape, generator=torch.Generator().manual_seed(6)).to(DEV, dtype)

    def run():
        out, lse = ts.selected_attention_fwd(q, k, v, idx, 0, 8, q_tile=4)
        return out, lse, ts.selected_attention_bwd(q, k, v, idx, out, lse, d_o, 0, 8, q_tile=4)[0]

    whole = run()
    rows = q.numel() // q.shape[-1]
    most = ts.partial_bytes(rows, 16, 5, 3, dtype)  # the larger of the forward's and dQ's partials, all 5 slots
    elt, acc = (8, 8) if dtype == torch.float64 else (2, 4)  # forward: outputs in q's dtype; dQ: terms in acc's
    assert most == rows * 5 * max(16 * elt + acc, 16 * acc)
    monkeypatch.setattr(ts, "PARTIAL_BYTES", most * 2 // 5)  # 2 slots' worth: launches of 2, 2, 1 slots
    assert ts.partial_bytes(rows, 16, 5, 3, dtype) == most * 2 // 5
    split = run()
    tol = dict(atol=1e-12, rtol=1e-12) if dtype == torch.float64 else dict(atol=1e-2, rtol=1e-2)  # bf16: o, dq rounding
    for name, a, b in zip(("out", "lse", "dq"), whole, split):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{name}: {m}")
    assert not split[0][..., 6, :].any() and (split[1][..., 6] == float("-inf")).all() and not split[2][..., 6, :].any()


@pytest.mark.parametrize("P, S, kv_tile, spread", [(1, 7, 4, "uneven"), (3, 5, 3, "empty parts"),
                                                   (4, 300, 2, "uneven"), (2, 1, 64, "one segment")])
def test_tile_layout_kernel_equals_its_torch_oracle(P, S, kv_tile, spread):
    """kernels/index_tiles.py's one-launch layout against tile_layout_torch: integers, so equal exactly; segments
    with no entries, with more than one tile, parts with no tiles at all and spare tiles (the static bound) all
    met; S = 300 takes more than one program (BLOCK 256) and a 9-step binary search."""
    g = torch.Generator().manual_seed(P * S)
    counts = torch.randint(0, 3 * kv_tile, (P * S,), generator=g)
    counts[torch.rand(P * S, generator=g) < 0.3] = 0
    if spread == "empty parts":
        counts.view(P, S)[1] = 0
    seg_tiles = (counts + kv_tile - 1) // kv_tile
    n_tiles = int(seg_tiles.view(P, S).sum(1).max()) + 5  # a bound with spare tiles in every part
    got = tile_layout(counts.to(DEV), seg_tiles.to(DEV), P, S, n_tiles, kv_tile)
    want = tile_layout_torch(counts, seg_tiles, P, S, n_tiles, kv_tile)
    for name, a, b in zip(("tile_seg", "tile_start", "tile_count", "seg_tile_first"), got, want):
        assert a.dtype == b.dtype == torch.long, name
        assert torch.equal(a.cpu(), b), name


@pytest.mark.parametrize("by_slot", [False, True], ids=["block_major", "by_slot"])
@pytest.mark.parametrize("with_sub", [False, True], ids=["plain", "sub"])
def test_segment_keys_kernel_equals_its_torch_oracle(by_slot, with_sub):
    """kernels/index_tiles.py's keys and counts against segment_keys_torch: integers, equal exactly; empty slots (-1)
    go to the spare segment, uncounted; 700 entries take three programs."""
    g = torch.Generator().manual_seed(3 + by_slot + 2 * with_sub)
    BH, Tq, n, n_blocks, n_sub = 5, 35, 4, 9, 16
    idx = torch.randint(-1, n_blocks, (BH, Tq, n), generator=g)
    sub = torch.randint(0, n_sub, (BH, Tq, n), generator=g) if with_sub else None
    key, counts = segment_keys(idx.to(DEV), n_blocks, by_slot, None if sub is None else sub.to(DEV), n_sub)
    want_key, want_counts = segment_keys_torch(idx, n_blocks, by_slot, sub, n_sub)
    assert key.dtype == counts.dtype == torch.long
    assert torch.equal(key.cpu(), want_key) and torch.equal(counts.cpu(), want_counts)
    assert int(counts.sum()) == int((idx >= 0).sum())


def test_frame_block_keys_kernel_equals_its_torch_oracle():
    """kernels/index_tiles.py frame_block_keys against frame_block_keys_torch: integers, equal exactly; empty slots and
    first keys outside 0 .. Tk-1 (k_base beyond the keys) give -1 / 0; k_base read through the frame's strides."""
    g = torch.Generator().manual_seed(11)
    B, H_kv, Tq, n, l_sel, Tk = 2, 3, 37, 5, 8, 60
    idx = torch.randint(-1, 6, (B, H_kv, Tq, n), generator=g)
    frame = torch.randint(0, 30, (3, B, Tq), generator=g)
    frame[1, 1, :4] = Tk + 3  # a frame breaking k_base + p < Tk: no block there
    home, off = frame_block_keys(idx.to(DEV), frame.to(DEV)[1], l_sel, Tk)
    want_home, want_off = frame_block_keys_torch(idx, frame[1], l_sel, Tk)
    assert home.dtype == off.dtype == torch.int32
    assert torch.equal(home.cpu(), want_home) and torch.equal(off.cpu(), want_off)
    assert (want_home[1, :, :4] == -1).all() and (want_home >= 0).any() and (want_off > 0).any()


@pytest.mark.parametrize("n_sub", [None, 8])
def test_sorted_entries_kernel_equals_its_torch_oracle(n_sub):
    g = torch.Generator().manual_seed(13)
    Tq, n, E = 23, 4, 3 * 23 * 4
    order = torch.randperm(E, generator=g)
    sorted_key = torch.randint(0, 500, (E,), generator=g).sort().values
    got = sorted_entries(order.to(DEV), sorted_key.to(DEV), Tq, n, n_sub)
    want = sorted_entries_torch(order, sorted_key, Tq, n, n_sub)
    assert got[0].dtype == torch.int32 and torch.equal(got[0].cpu(), want[0])
    assert (got[1] is None) == (n_sub is None) and (n_sub is None or torch.equal(got[1].cpu(), want[1]))


def test_inverted_index_runs_and_offsets_with_a_second_key():
    """With a second sort key (frames: the offset in the aligned block), each sorted entry's offset and the end of its
    run (entries of equal segment and offset) are what a walk over the sorted entries finds."""
    g = torch.Generator().manual_seed(12)
    BH, Tq, n, n_blocks, n_sub = 3, 23, 4, 5, 8
    idx = torch.randint(-1, n_blocks, (BH, Tq, n), generator=g)
    sub = torch.randint(0, 3, (BH, Tq, n), generator=g)  # few offsets: long runs
    out = ts.inverted_index(idx.to(DEV), n_blocks, 4, sub=sub.to(DEV), n_sub=n_sub)
    sub_sorted, run_end = out[6].cpu(), out[7].cpu()
    key, _ = segment_keys_torch(idx, n_blocks, False, sub, n_sub)
    sorted_key, order = torch.sort(key, stable=True)
    assert torch.equal(sub_sorted, sub.flatten()[order].to(torch.int32))
    want = [next(j for j in range(i, len(sorted_key) + 1) if j == len(sorted_key) or sorted_key[j] != sorted_key[i])
            for i in range(len(sorted_key))]
    assert run_end.dtype == torch.int32 and run_end.tolist() == want


def test_slot_index_tiles_every_entry_once():
    """inverted_index(by_slot=True): each slot's tiles (fixed stride n_tiles) cover exactly that slot's
    valid entries, grouped by (bh, block), ascending query, at most kv_tile per tile; shapes are static."""
    g = torch.Generator().manual_seed(0)
    BH, Tq, n, n_blocks, kv_tile = 3, 21, 4, 6, 4
    idx = torch.stack([torch.randperm(n_blocks, generator=g)[:n] for _ in range(BH * Tq)]).view(BH, Tq, n)
    idx[torch.rand(idx.shape, generator=g) < 0.3] = -1
    queries, tile_seg, tile_start, tile_count, _, _ = ts.inverted_index(idx, n_blocks, kv_tile, by_slot=True)
    n_tiles = tile_seg.shape[0] // n
    assert n_tiles == BH * Tq // kv_tile + min(BH * n_blocks, BH * Tq)
    for s in range(n):
        seen = []
        for i in range(s * n_tiles, (s + 1) * n_tiles):
            c, st, seg = int(tile_count[i]), int(tile_start[i]), int(tile_seg[i])
            assert 0 <= c <= kv_tile
            ts_ = queries[st:st + c].long()
            assert torch.all(ts_[1:] > ts_[:-1])
            bh, blk = divmod(seg, n_blocks)
            assert torch.all(idx[bh, ts_, s] == blk)
            seen += [(bh, int(t)) for t in ts_]
        want = [(bh, t) for bh in range(BH) for t in range(Tq) if idx[bh, t, s] >= 0]
        assert sorted(seen) == want


def test_tile_config_fits_targets_and_is_pure():
    """fp32 gets smaller row tiles than bf16; every launched kernel's estimate fits an A100 at head dims
    64/128/192 (G 6 and 16, l' = 64) in bf16 and fp32. Measured values: the AOT table of
    scripts/compile_kernels.py (shared memory compiled <= estimate)."""
    a100 = 166912
    for hd in (64, 128, 192):
        for G in (6, 16):
            for dtype in ("bf16", "fp32", torch.bfloat16, torch.float32):
                assert ts.shared_memory_estimate(hd, 64, G, dtype) <= a100, (hd, G, dtype)
    bf, fp = (ts.tile_config("dkv", 64, 64, 6, d) for d in (torch.bfloat16, torch.float32))
    assert fp.rows < bf.rows and (bf.BS, bf.DP) == (64, 64)
    assert ts.launched_kernels(6)[:4] == ("block_fwd", "block_dq", "slot_merge", "slot_sum")
    assert ts.launched_kernels(16)[:2] == ("fwd", "dq")
    with pytest.raises(ValueError, match="unknown kernel"):
        ts.tile_config("dkv2", 64, 64, 6, "bf16")


def test_dkv_programs_split_a_blocks_keys(monkeypatch):
    """fp32 and head dim 256 run the dK/dV kernel with programs of BK < BS keys (grid axis 1): same
    gradients as one program per block (forced here at a small head dim)."""
    q, k, v, idx = make_case(1, 1, 2, 20, 16, 16, 3, seed=11)
    d_o = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).to(DEV)
    out, lse = ts.selected_attention_fwd(q, k, v, idx, 0, 16)
    whole = ts.selected_attention_bwd(q, k, v, idx, out, lse, d_o, 0, 16)
    config = ts.tile_config
    monkeypatch.setattr(ts, "tile_config", lambda kernel, *a: dataclasses.replace(config(kernel, *a), keys=8)
                        if kernel == "dkv" else config(kernel, *a))
    assert ts._launch("dkv", 16, 16, 2, torch.float32)["BK"] == 8
    split = ts.selected_attention_bwd(q, k, v, idx, out, lse, d_o, 0, 16)
    for a, b in zip(whole, split):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_kernel_fit_refuses_what_a_gpu_cannot_hold():
    """The start-of-run check (train/trainer/build_run.py on CUDA) in one line, from the tile configs."""
    from nsa.attention.ops import kernel_fit_problem
    from nsa.config import ModelConfig, NSAConfig

    cfg = ModelConfig(dim=1536, n_heads=8, n_kv_heads=2, head_dim=192, attention="nsa", nsa=NSAConfig())
    assert kernel_fit_problem(cfg, torch.bfloat16, 232_448) is None  # H100
    assert kernel_fit_problem(cfg, torch.bfloat16, 166_912) is None  # A100
    problem = kernel_fit_problem(cfg, torch.float32, 48 * 1024)  # a GPU with 48 KB per block
    assert problem and "\n" not in problem and "head_dim=192" in problem and "nsa.kernel=torch" in problem
    torch_path = ModelConfig(dim=1536, n_heads=8, n_kv_heads=2, head_dim=192, attention="nsa", nsa=NSAConfig(kernel="torch"))
    assert kernel_fit_problem(torch_path, torch.float32, 1024) is None
