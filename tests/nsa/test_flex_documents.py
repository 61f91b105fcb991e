"""NSA's FlexAttention branches with document frames (nsa/attention/impl/flex.py, frame=[3, B, Tq]).

Rules (frame = q_pos, k_base, c_base from nsa.attention.documents.compressed_layout):
  compressed: query (b, t) sees compressed token ki iff c_base <= ki < c_base + num_compressed(q_pos + 1, l, d);
  window:     query (b, t) sees key ki iff today's window condition holds and ki >= k_base.
On CPU FlexAttention runs forward only and unfused (it evaluates the mask_mod everywhere, ignoring the block
mask), so: (1) outputs in float64 equal the torch path run on each document's slices alone from position 0,
FlexAttention on each document alone, and an explicit-mask reference; (2) a token of another document changes
nothing, exactly; (3) a window with no EOS gives the frameless result (the window branch exactly, the compressed
one to rounding: the frameless call pads its keys); (4) the per-row block masks cover every visible tile (torch's
brute-force create_block_mask with B), mark full only fully visible tiles, and skip the tiles outside a query
tile's documents; (5) a new batch of documents does not recompile. Backward: CUDA.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import create_block_mask

from nsa.attention.documents import compressed_layout
from nsa.attention.impl import flex
from nsa.attention.impl.compression import compressed_attention_fwd, num_compressed
from nsa.attention.impl.window import sliding_window_fwd
from tests.nsa._nsa_helpers import starts_of

EOS = 0
L, D, W = 32, 16, 64  # compressed block l, stride d, window w
# per row, document lengths (T = 300): not multiples of 16 / 32 / 128, a 1-token document, documents shorter
# than l (no compressed token), documents that start mid-window and cross 128-tiles, rows with different layouts
LAYOUTS = {
    "mixed": [[37, 1, 151, 111], [133, 167]],
    "many": [[5, 17, 1, 31, 33, 47, 1, 66, 99], [299, 1]],
}


def documents(rows):
    """(b, first, end, c0, n_c) per document: its window span and its compressed slots [c0, c0 + n_c), counted
    here from the lengths alone (independently of compressed_layout)."""
    for b, lengths in enumerate(rows):
        a = c0 = 0
        for n in lengths:
            n_c = num_compressed(n, L, D)
            yield b, a, a + n, c0, n_c
            a, c0 = a + n, c0 + n_c


def tensors(B, T, H_kv, G, n_c, hd=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H_kv * G, T, hd, generator=g, dtype=torch.float64)
    ck, cv = (torch.randn(B, H_kv, n_c, hd, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, H_kv, T, hd, generator=g, dtype=torch.float64) for _ in range(2))
    return q, ck, cv, k, v


def explicit_attention(q, k, v, visible):  # visible [B, Tq, Tk] bool; rows with no key -> zero
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    p = torch.softmax(s.masked_fill(~visible[:, None], float("-inf")), dim=-1).nan_to_num(0.0)
    return p @ v


def visibility(rows, T, n_c):
    """The rules, document by document: [B, T, n_c] compressed and [B, T, T] window visibility."""
    cmp = torch.zeros(len(rows), T, n_c, dtype=torch.bool)
    win = torch.zeros(len(rows), T, T, dtype=torch.bool)
    for b, a, e, c0, _ in documents(rows):
        p = torch.arange(e - a)[:, None]  # document positions
        j = torch.arange(n_c)[None, :] - c0
        cmp[b, a:e] = (j >= 0) & (j * D + L - 1 <= p)
        r = torch.arange(T)[None, :] - a
        win[b, a:e] = (r >= 0) & (r <= p) & (r > p - W)
    return cmp, win


@pytest.mark.parametrize("layout, gqa", [("mixed", (2, 2)), ("mixed", (1, 4)), ("many", (3, 1))])  # (H_kv, G)
def test_frames_equal_each_document_alone(layout, gqa):
    rows = LAYOUTS[layout]
    B, T = len(rows), sum(rows[0])
    frame = compressed_layout(starts_of(rows), L, D).frame  # [3, B, T]
    n_c = T // D  # the layout's slots (unused ones hold noise no query may see)
    q, ck, cv, k, v = tensors(B, T, *gqa, n_c)
    o_cmp = flex.flex_compressed_attention(q, ck, cv, 0, L, D, frame=frame)
    o_win = flex.flex_window_attention(q, k, v, 0, 0, W, frame=frame)
    cmp_ref, win_ref = torch.zeros_like(q), torch.zeros_like(q)
    for b, a, e, c0, nd in documents(rows):
        qd, cs, ks = q[b:b + 1, :, a:e], slice(c0, c0 + nd), slice(a, e)
        ref = compressed_attention_fwd(qd, ck[b:b + 1, :, cs], cv[b:b + 1, :, cs], 0, L, D, 64)[0]
        cmp_ref[b:b + 1, :, a:e] = ref
        if nd:
            out = flex.flex_compressed_attention(qd, ck[b:b + 1, :, cs], cv[b:b + 1, :, cs], 0, L, D)
            torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
        ref = sliding_window_fwd(qd, k[b:b + 1, :, ks], v[b:b + 1, :, ks], 0, 0, W, 128)[0]
        win_ref[b:b + 1, :, a:e] = ref
        torch.testing.assert_close(flex.flex_window_attention(qd, k[b:b + 1, :, ks], v[b:b + 1, :, ks], 0, 0, W), ref,
                                   rtol=0, atol=1e-12)
    torch.testing.assert_close(o_cmp, cmp_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(o_win, win_ref, rtol=0, atol=1e-12)
    sees_cmp, sees_win = visibility(rows, T, n_c)
    torch.testing.assert_close(o_cmp, explicit_attention(q, ck, cv, sees_cmp), rtol=0, atol=1e-12)
    torch.testing.assert_close(o_win, explicit_attention(q, k, v, sees_win), rtol=0, atol=1e-12)
    # the test can fail: without the frame the packed batch is not the documents alone
    assert not torch.allclose(flex.flex_window_attention(q, k, v, 0, 0, W), win_ref, atol=1e-3)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_folded_frames_equal_the_rule(monkeypatch, layout):
    """The compressed branch with its queries folded into batch rows of 100 (3 per row, cutting documents) reads
    each query's own document: the explicit rule, and the unfolded call's log-sum-exps (float64)."""
    rows = LAYOUTS[layout]
    B, T = len(rows), sum(rows[0])
    frame = compressed_layout(starts_of(rows), L, D).frame
    q, ck, cv, _, _ = tensors(B, T, 2, 3, T // D, seed=4)
    plain, plain_lse = flex.flex_compressed_attention(q, ck, cv, 0, L, D, frame=frame, return_lse=True)
    monkeypatch.setattr(flex, "FOLD_QUERIES", 100)
    assert flex.fold_count(T) == 3
    o, lse = flex.flex_compressed_attention(q, ck, cv, 0, L, D, frame=frame, return_lse=True)
    torch.testing.assert_close(o, explicit_attention(q, ck, cv, visibility(rows, T, T // D)[0]), rtol=0, atol=1e-12)
    torch.testing.assert_close(o, plain, rtol=0, atol=1e-12)
    assert torch.equal(lse == float("-inf"), plain_lse == float("-inf"))
    torch.testing.assert_close(lse[lse > float("-inf")], plain_lse[lse > float("-inf")], rtol=0, atol=1e-12)


def test_window_frame_with_offsets_equals_explicit_rule():
    """The window rule with chunk offsets (q_start, k_start) and an arbitrary k_base per query."""
    B, Tq, q_start, w, H_kv, G = 2, 200, 150, 96, 2, 2
    k_start = q_start - w + 1
    Tk = q_start + Tq - k_start
    q, _, _, _, _ = tensors(B, Tq, H_kv, G, 0, seed=1)
    g = torch.Generator().manual_seed(2)
    k, v = (torch.randn(B, H_kv, Tk, 16, generator=g, dtype=torch.float64) for _ in range(2))
    k_base = torch.tensor([[0] * 30 + [40] * 100 + [170] * 70, [90] * 200])  # [B, Tq] key indices
    frame = torch.stack((torch.zeros_like(k_base), k_base, torch.zeros_like(k_base)))
    out = flex.flex_window_attention(q, k, v, q_start, k_start, w, frame=frame)
    p = (q_start + torch.arange(Tq))[None, :, None]
    ki = torch.arange(Tk)[None, None, :]
    s = k_start + ki
    sees = (s <= p) & (s > p - w) & (ki >= k_base[:, :, None])  # [B, Tq, Tk]
    torch.testing.assert_close(out, explicit_attention(q, k, v, sees), rtol=0, atol=1e-12)


def test_other_documents_change_nothing():
    rows = LAYOUTS["mixed"]
    B, T = len(rows), sum(rows[0])
    frame = compressed_layout(starts_of(rows), L, D).frame
    n_c = T // D
    q, ck, cv, k, v = tensors(B, T, 2, 2, n_c, seed=3)
    ref_c = flex.flex_compressed_attention(q, ck, cv, 0, L, D, frame=frame)
    ref_w = flex.flex_window_attention(q, k, v, 0, 0, W, frame=frame)
    g = torch.Generator().manual_seed(4)
    for b, a, e, c0, nd in documents(rows):
        ck2, cv2, k2, v2 = ck.clone(), cv.clone(), k.clone(), v.clone()
        for x, sl in ((ck2, slice(c0, c0 + nd)), (cv2, slice(c0, c0 + nd)), (k2, slice(a, e)), (v2, slice(a, e))):
            x[b, :, sl] = torch.randn(x[b, :, sl].shape, generator=g, dtype=x.dtype)
        out_c = flex.flex_compressed_attention(q, ck2, cv2, 0, L, D, frame=frame)
        out_w = flex.flex_window_attention(q, k2, v2, 0, 0, W, frame=frame)
        inside = torch.zeros(T, dtype=torch.bool)
        inside[a:e] = True
        for out, ref, own in ((out_c, ref_c, nd > 0), (out_w, ref_w, True)):  # a document shorter than l: no token
            assert torch.equal(out[b][:, ~inside], ref[b][:, ~inside]), (b, a, e)
            assert torch.equal(out[1 - b], ref[1 - b])
            assert torch.equal(out[b][:, inside], ref[b][:, inside]) != own
    unused = slice(sum(n for *_, n in documents(rows[:1])), n_c)  # row 0's slots past its documents' tokens
    ck2 = ck.clone()
    ck2[0, :, unused] = 1e3
    assert torch.equal(flex.flex_compressed_attention(q, ck2, cv, 0, L, D, frame=frame), ref_c)


def test_one_document_frame_is_todays_result():
    B, T = 2, 300
    frame = compressed_layout(torch.zeros(B, T, dtype=torch.long), L, D).frame  # no EOS
    q, ck, cv, k, v = tensors(B, T, 2, 2, num_compressed(T, L, D), seed=5)
    # compressed, float64: the frameless call pads the compressed keys to a power of two (17 -> 128 rows), so its
    # matmuls have other shapes, whose blocking and reduction order the BLAS picks by the CPU's vector width (an
    # AVX2 CPU: up to 7.8e-16 apart). 1e-12 is >= 2e3 ulps at these magnitudes (|out| < 2.4).
    torch.testing.assert_close(flex.flex_compressed_attention(q, ck, cv, 0, L, D, frame=frame),
                               flex.flex_compressed_attention(q, ck, cv, 0, L, D), rtol=0, atol=1e-12)
    # window: the same shapes and operations, only the mask_mod that builds the (equal) mask differs: exact
    assert torch.equal(flex.flex_window_attention(q, k, v, 0, 0, W, frame=frame),
                       flex.flex_window_attention(q, k, v, 0, 0, W))


def tiles(mask):  # BlockMask -> (partial, full) [B, nq, nk] bool
    partial = mask.to_dense()[:, 0].bool()
    full = torch.zeros_like(partial)
    if mask.full_kv_num_blocks is not None:
        for b in range(full.shape[0]):
            for r in range(full.shape[1]):
                full[b, r, mask.full_kv_indices[b, 0, r, : mask.full_kv_num_blocks[b, 0, r]].long()] = True
    return partial & ~full, full


def many_documents(T, seed):
    """Two rows covering T: random short documents (lengths 1 .. 59), and random ones (1 .. 299) around a
    document of T/2 + 128 tokens (full tiles inside it)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for top, long in ((60, 0), (300, T // 2 + 128)):
        first = int(torch.randint(1, 100, (1,), generator=g))
        lengths = [first, min(long, T - first)] if long else []
        while sum(lengths) < T:
            lengths.append(min(int(torch.randint(1, top, (1,), generator=g)), T - sum(lengths)))
        rows.append(lengths)
    return rows


def check_tiles(ours, B, T, tk):
    """ours: a per-row BlockMask -> (partial, full) [B, nq, nk], after checking it against brute force."""
    brute = create_block_mask(ours.mask_mod, B, None, T, tk, device="cpu")
    (o_part, o_full), (b_part, b_full) = tiles(ours), tiles(brute)
    assert torch.equal(o_part | o_full, b_part | b_full)  # exactly the tiles with a visible key
    assert not (o_full & ~b_full).any()  # full only where every key is visible
    whole = torch.ones_like(o_full)
    if T % flex.BLOCK:
        whole[:, -1] = False
    if tk % flex.BLOCK:
        whole[:, :, -1] = False
    assert torch.equal(o_full & whole, b_full & whole)  # and every whole tile that is
    return o_part, o_full


def visited(mask, B=1):  # tiles a BlockMask makes the kernel read
    part, full = tiles(mask)
    return int((part | full).sum()) * (B if part.shape[0] == 1 else 1)


# hand-made edges (T = 1024, with l = 16, d = 4: 256 compressed slots, two whole key tiles): a document opening
# at key 127 (the last key of a tile: window and dense tiles), one whose first compressed slot is 127 and
# whose queries fill a query tile, a query tile shared by a long document and the next one, and a query tile
# whose last query sees compressed slots up to 128 exactly (the first of a key tile)
EDGES = [[520] + [15] * 8 + [384], [127, 600, 297], [800, 224], [15] * 7 + [5, 600, 314]]


@pytest.mark.parametrize("case", ["random-1024", "random-700", "edges"])
def test_frame_block_masks_equal_brute_force_and_skip_other_documents(case):
    rows, l, d = (EDGES, 16, 4) if case == "edges" else (many_documents(int(case[7:]), seed=len(case)), L, D)
    B, T = len(rows), sum(rows[0])
    start = starts_of(rows)
    frame = compressed_layout(start, l, d).frame
    win = flex._window_frame_block_mask(frame, T, 0, 0, 512)
    _, full = check_tiles(win, B, T, T)
    assert full.any()  # a 512-wide window keeps full tiles inside long documents
    assert visited(win) < visited(flex._block_mask("win", T, T, 0, 0, 512, 0, "cpu"), B)
    dense = flex._document_block_mask(start)
    _, full = check_tiles(dense, B, T, T)
    assert full.any()
    nq = -(-T // flex.BLOCK)
    assert visited(dense) < B * nq * (nq + 1) // 2  # fewer than the causal tiles
    cmp = flex._compressed_frame_block_mask(frame, T // d, l, d)
    _, full = check_tiles(cmp, B, T, T // d)
    if case == "edges":
        assert full.any()
        assert visited(cmp) < visited(flex._block_mask("cmp", T, T // d, 0, 0, l, d, "cpu"), B)


def test_new_documents_do_not_recompile(monkeypatch):
    """The frames are data (captured tensors): a batch with other documents, same shapes, reuses the graph."""
    monkeypatch.setattr(flex, "COMPILE_DEVICES", flex.COMPILE_DEVICES | {"cpu"})
    monkeypatch.setattr(flex, "COMPILE_BACKEND", "aot_eager")
    T = 256
    q, ck, cv, k, v = (x.float() for x in tensors(2, T, 1, 2, T // D, seed=6))
    torch._dynamo.reset()
    counters.clear()
    try:
        for seed in (1, 2, 3):
            rows = many_documents(T, seed)
            frame = compressed_layout(starts_of(rows), L, D).frame
            sees_cmp, sees_win = visibility(rows, T, T // D)
            out = flex.flex_compressed_attention(q, ck, cv, 0, L, D, frame=frame)
            torch.testing.assert_close(out, explicit_attention(q, ck, cv, sees_cmp), rtol=1e-5, atol=1e-5)
            out = flex.flex_window_attention(q, k, v, 0, 0, W, frame=frame)
            torch.testing.assert_close(out, explicit_attention(q, k, v, sees_win), rtol=1e-5, atol=1e-5)
        assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])  # one per branch
    finally:
        torch._dynamo.reset()
        counters.clear()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's backward needs CUDA")
@pytest.mark.parametrize("fold", [0, 100], ids=["plain", "folded"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_cuda_frames_backward_equals_torch_path(monkeypatch, layout, fold):
    from nsa.attention.ops import compressed_attention, window_attention

    monkeypatch.setattr(flex, "FOLD_QUERIES", fold)
    rows = LAYOUTS[layout]
    B, T = len(rows), sum(rows[0])
    frame = compressed_layout(starts_of(rows).cuda(), L, D).frame
    leaves = [x.cuda().requires_grad_() for x in tensors(B, T, 2, 2, T // D, seed=7)]
    q, ck, cv, k, v = leaves
    w = torch.randn(q.shape, dtype=torch.float64, device="cuda")
    ref = [compressed_attention(q, ck, cv, 0, L, D, 64, "torch", frame=frame),
           window_attention(q, k, v, 0, 0, W, 128, "torch", frame=frame)]
    q32, ck32, cv32, k32, v32 = (x.detach().float().requires_grad_() for x in leaves)
    out = [flex.flex_compressed_attention(q32, ck32, cv32, 0, L, D, frame=frame),
           flex.flex_window_attention(q32, k32, v32, 0, 0, W, frame=frame)]
    for o, r, ins, ins32 in zip(out, ref, [(q, ck, cv), (q, k, v)], [(q32, ck32, cv32), (q32, k32, v32)]):
        torch.testing.assert_close(o.double(), r, rtol=0, atol=2e-3)
        g = torch.autograd.grad((o * w.float()).sum(), ins32)
        g_ref = torch.autograd.grad((r * w).sum(), ins)
        for a, b in zip(g, g_ref):
            torch.testing.assert_close(a.double(), b, rtol=0, atol=1e-2)
