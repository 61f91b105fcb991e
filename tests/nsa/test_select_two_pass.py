"""Top-n block selection in two launches (nsa/attention/kernels/select_two_pass.py) against the torch path.

Each launch against its own oracle: the block scores against impl.selection.selection_block_scores over
compression_group_probs (float64), the top-n against impl.selection.select_blocks on the same scores (exactly: both
rank the same numbers), and the pair against block_select.select_by_score. The fused one-launch kernel is a third
path with the same contract: compared where both run, on float64 (no near ties) or up to near ties. Without CUDA
the kernels run in Triton's interpreter (tests/conftest.py), so sizes stay small.
"""
from __future__ import annotations

import pytest
import torch

from nsa.attention.impl.compression import compression_group_probs
from nsa.attention.impl.selection import select_blocks, selection_block_scores

try:
    from tests.nsa.interpreter_probe import interpreter_loop_problem
    from nsa.attention.kernels import select_topk, select_two_pass
except ImportError as exc:  # triton not installed
    pytest.skip(f"triton is not importable ({exc})", allow_module_level=True)
from tests.nsa.test_fused_select import CASES, forced_or_lowest, make_inputs, reference

DEV = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
if DEV.type == "cpu" and not select_topk.interpreter_active():
    pytest.skip("Triton's interpreter is off (TRITON_INTERPRET=1 must be set before triton is imported)",
                allow_module_level=True)
if reason := interpreter_loop_problem():
    pytest.skip(reason, allow_module_level=True)
two_pass = select_two_pass.two_pass_select_blocks


@pytest.mark.parametrize("B, H_kv, G, Tq, hd, q_start, l, d, l_sel, n", CASES)
def test_matches_torch_path_float64(B, H_kv, G, Tq, hd, q_start, l, d, l_sel, n):
    q, ck = make_inputs(B, H_kv, G, Tq, hd, q_start, l, d)
    got = two_pass(q, ck, q_start, l, d, l_sel, n)
    assert got.dtype == torch.long and got.shape == (B, H_kv, Tq, n)
    torch.testing.assert_close(got, reference(q, ck, q_start, l, d, l_sel, n), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("G, q_start, n", [(6, 29, 5), (2, 0, 2)])
def test_exact_ties_go_to_lower_blocks(dtype, G, q_start, n):
    """q = 0: uniform probabilities, every fully visible competing block ties exactly (and with n = 2 < 3 the forced
    blocks tie at +inf): the lowest win, as in select_blocks."""
    Tq, l, d, l_sel = 80, 8, 4, 16
    q, ck = make_inputs(1, 1, G, Tq, 16, q_start, l, d)
    got = two_pass(torch.zeros_like(q).to(dtype), ck.to(dtype), q_start, l, d, l_sel, n)[0, 0]
    torch.testing.assert_close(got, forced_or_lowest(q_start, Tq, l_sel, n), rtol=0, atol=0)


@pytest.mark.parametrize("tiling", ["interpreter", "gpu"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("q_start, Tq, l_sel, n", [(0, 70, 4, 5), (37, 50, 8, 16), (0, 9, 4, 3), (300, 20, 16, 1)])
def test_top_n_equals_select_blocks_with_many_ties(dtype, q_start, Tq, l_sel, n, tiling, monkeypatch):
    """Launch 2 alone on scores from {0, 1, 2, 3} (ties everywhere, zeros included) and junk past each row's current
    block (never read: NaN): exactly select_blocks' picks, including rows with fewer than n blocks. Both tilings: the
    GPU's (a few rows a program, the last program's rows partly past Tq) and the interpreter's larger programs."""
    if tiling == "gpu":
        monkeypatch.setattr(select_two_pass, "INTERPRETER_ROW_KEYS", 0)
    g = torch.Generator().manual_seed(q_start + Tq)
    n_blocks = (q_start + Tq - 1) // l_sel + 1
    scores = torch.randint(0, 4, (2, 3, Tq, n_blocks + 3), generator=g).to(DEV, dtype)  # wider than needed
    current = (q_start + torch.arange(Tq, device=DEV)) // l_sel
    junk = torch.arange(n_blocks + 3, device=DEV)[None, :] > current[:, None]
    want = select_blocks(scores[..., :n_blocks].masked_fill(junk[:, :n_blocks], 7.0), q_start, l_sel, n)
    got = select_two_pass.top_n_rows(scores.masked_fill(junk, float("nan")), q_start, l_sel, n)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_nan_score_still_gives_exactly_the_rows_picks():
    """A diverged run's NaN scores rank as +inf (a sign-bit NaN as 0): each row still keeps min(n, c + 1) distinct
    blocks ascending, and nothing is written outside its n slots (the output's neighbours are untouched)."""
    q_start, Tq, l_sel, n = 0, 40, 4, 3
    scores = torch.rand(1, 1, Tq, 10, generator=torch.Generator().manual_seed(0), dtype=torch.float32).to(DEV)
    scores[0, 0, 20:, 2] = float("nan")
    scores[0, 0, 30:, 5] = -float("nan")
    out = torch.full((1, 1, Tq, n + 2), -7, dtype=torch.long, device=DEV)
    select_two_pass.top_n_rows(scores, q_start, l_sel, n, out=out[..., 1:n + 1])
    assert (out[..., 0] == -7).all() and (out[..., n + 1] == -7).all()
    for t, row in enumerate(out[0, 0, :, 1:n + 1].tolist()):
        kept = [b for b in row if b >= 0]
        assert len(kept) == min(n, t // l_sel + 1) and kept == sorted(set(kept)), (t, row)
        assert (t < 20 or t // l_sel < 2 or 2 in kept), (t, row)  # NaN ranks with the forced blocks


def test_block_scores_equal_the_torch_paths_scores():
    """Launch 1 alone: S[t, j] for every block up to t's current one equals Eq. 9-10 in float64 (selection's scores
    before the forced blocks), with and without the compressed branch's log-sum-exps."""
    from nsa.attention.kernels.select_topk import kernel_constexprs
    B, H_kv, G, Tq, hd, q_start, l, d, l_sel = 1, 2, 3, 61, 16, 19, 16, 8, 32
    q, ck = make_inputs(B, H_kv, G, Tq, hd, q_start, l, d, seed=11)
    probs = compression_group_probs(q, ck, q_start, l, d)  # [B, H_kv, Tq, N_c]
    n_blocks = (q_start + Tq - 1) // l_sel + 1
    want = selection_block_scores(probs, l, d, l_sel, n_blocks)
    s = torch.logsumexp(torch.einsum("bhgtd,bhnd->bhgtn", q, ck) / hd ** 0.5 + torch.where(
        (torch.arange(ck.shape[2], device=DEV) * d + l - 1)[None, :] <= (q_start + torch.arange(Tq, device=DEV))[:, None],
        0.0, float("-inf")), dim=-1)  # [B, H_kv, G, Tq] the compressed branch's log-sum-exps
    meta = kernel_constexprs(q.dtype, G, hd, l, d, l_sel, 1)
    meta.pop("N"), meta.pop("NP")
    current = (q_start + torch.arange(Tq, device=DEV)) // l_sel
    seen = torch.arange(n_blocks, device=DEV)[None, :] <= current[:, None]  # [Tq, n_blocks]
    for lse in (None, s):
        got = torch.full((B, H_kv, Tq, n_blocks), float("nan"), dtype=q.dtype, device=DEV)
        lse_arg, l_strides = (ck, (0, 0, 0, 0)) if lse is None else (lse, lse.stride())
        select_two_pass._block_scores_kernel[(-(-Tq // meta["BT"]), B * H_kv)](
            q, ck, lse_arg, got, *q.stride(), *ck.stride(), *l_strides, *got.stride(), q_start, Tq, ck.shape[2],
            H_KV=H_kv, **meta, HAS_LSE=lse is not None)
        torch.testing.assert_close(got[..., seen], want[..., seen], rtol=1e-12, atol=1e-14)


def test_queries_in_chunks_equal_one_launch_pair(monkeypatch):
    """Scores over SCORE_BYTES split the queries into consecutive chunks (a launch pair each, each chunk's scores only
    as wide as its last query's blocks): the same picks as one pair."""
    B, H_kv, G, Tq, hd, q_start, l, d, l_sel, n = 1, 2, 2, 90, 16, 33, 8, 4, 16, 4
    q, ck = make_inputs(B, H_kv, G, Tq, hd, q_start, l, d, seed=2)
    whole = two_pass(q, ck, q_start, l, d, l_sel, n)
    launches = []
    real = select_two_pass.top_n_rows
    monkeypatch.setattr(select_two_pass, "top_n_rows", lambda s, *a, **k: launches.append(s.shape) or real(s, *a, **k))
    monkeypatch.setattr(select_two_pass, "SCORE_BYTES", B * H_kv * 20 * 8 * 8)  # 20 queries of 8 blocks, float64
    chunked = two_pass(q, ck, q_start, l, d, l_sel, n)
    assert [s[2] for s in launches] == [20, 20, 20, 20, 10] and launches[0][3] < launches[-1][3] == 8
    torch.testing.assert_close(chunked, whole, rtol=0, atol=0)


def test_causality_perturbation():
    """Compressed keys a query cannot see and queries after it never change its picks; they change later ones."""
    from nsa.attention.impl.compression import num_compressed
    G, Tq, hd, q_start, l, d, l_sel, n = 2, 96, 16, 0, 8, 4, 16, 4
    q, ck = make_inputs(1, 1, G, Tq, hd, q_start, l, d, seed=5)
    base = two_pass(q, ck, q_start, l, d, l_sel, n)
    g = torch.Generator().manual_seed(6)
    for p in (37, 70):
        q2, ck2 = q.clone(), ck.clone()
        q2[..., p + 1:, :] += 50 * torch.randn(q2[..., p + 1:, :].shape, generator=g, dtype=q.dtype).to(DEV)
        seen = num_compressed(p + 1, l, d)
        ck2[:, :, seen:] += 50 * torch.randn(ck2[:, :, seen:].shape, generator=g, dtype=ck.dtype).to(DEV)
        out = two_pass(q2, ck2, q_start, l, d, l_sel, n)
        torch.testing.assert_close(out[..., :p + 1, :], base[..., :p + 1, :], rtol=0, atol=0)
        assert (out[..., p + 1:, :] != base[..., p + 1:, :]).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_agrees_with_the_fused_kernel_up_to_near_ties(dtype):
    """Two different kernels on the same rounded inputs (and the float64 torch path): a query's picks may differ
    only by blocks whose float64 scores are within a tiny relative gap."""
    B, H_kv, G, Tq, hd, q_start, l, d, l_sel, n = 1, 1, 6, 100, 32, 60, 8, 4, 16, 5
    q, ck = make_inputs(B, H_kv, G, Tq, hd, q_start, l, d, seed=3)
    q, ck = q.to(dtype), ck.to(dtype)
    got = two_pass(q, ck, q_start, l, d, l_sel, n)
    n_blocks = (q_start + Tq - 1) // l_sel + 1
    scores = selection_block_scores(compression_group_probs(q.double(), ck.double(), q_start, l, d), l, d, l_sel,
                                    n_blocks)
    for other in (select_topk.fused_select_blocks(q, ck, q_start, l, d, l_sel, n),
                  reference(q, ck, q_start, l, d, l_sel, n)):
        rows = (got != other).any(-1).nonzero().tolist()
        assert len(rows) <= 2, f"{len(rows)} of {B * H_kv * Tq} queries differ"
        for b, h, t in rows:
            mine, theirs = set(got[b, h, t].tolist()) - {-1}, set(other[b, h, t].tolist()) - {-1}
            assert len(mine) == len(theirs)
            s = scores[b, h, t]
            gap = max(abs(s[i] - s[j]).item() for i in mine - theirs for j in theirs - mine)
            assert gap <= 1e-5 * s.max().item(), (b, h, t, sorted(mine), sorted(theirs), gap)


def test_the_layer_op_takes_two_launches_and_the_fused_kernel_only_for_rows_too_long(monkeypatch):
    """nsa::select_blocks on the Triton path: two_pass where `applies` (rows within MAX_ROW_BLOCKS blocks), with or
    without packed documents, the fused kernel for rows too long to hold; both give the torch path's picks here."""
    from nsa.attention import ops
    from nsa.attention.documents import compressed_layout

    calls = []
    real = select_two_pass.two_pass_select_blocks
    monkeypatch.setattr(select_two_pass, "two_pass_select_blocks", lambda *a, **k: calls.append("two_pass") or real(*a, **k))
    real_fused = select_topk.fused_select_blocks
    monkeypatch.setattr(select_topk, "fused_select_blocks", lambda *a, **k: calls.append("fused") or real_fused(*a, **k))
    B, H_kv, G, Tq, hd, l, d, l_sel, n = 1, 1, 2, 64, 16, 8, 4, 16, 4
    q, ck = make_inputs(B, H_kv, G, Tq, hd, 0, l, d, seed=9)
    want = reference(q, ck, 0, l, d, l_sel, n)
    torch.testing.assert_close(ops.select_blocks(q, ck, 0, l, d, l_sel, n, 32, "triton"), want, rtol=0, atol=0)
    frame = compressed_layout(torch.zeros(1, Tq, dtype=torch.long, device=DEV), l, d).frame  # one document
    torch.testing.assert_close(ops.select_blocks(q, ck, 0, l, d, l_sel, n, 32, "triton", frame=frame), want,
                               rtol=0, atol=0)
    monkeypatch.setattr(select_two_pass, "MAX_ROW_BLOCKS", 2)
    torch.testing.assert_close(ops.select_blocks(q, ck, 0, l, d, l_sel, n, 32, "triton"), want, rtol=0, atol=0)
    assert calls == ["two_pass", "two_pass", "fused"]


# packed documents: (H_kv, G, l', n, document lengths of row 0 and row 1), as tests/nsa/test_kernel_documents.py
DOCUMENTS = {"G2_lsel8_n4": (1, 2, 8, 4, ([5, 37, 3, 31, 14], [51, 2, 7, 30])),
             "G3_lsel12_n5": (2, 3, 12, 5, ([9, 39, 6, 25, 11], [3, 70, 17]))}


@pytest.mark.parametrize("case", DOCUMENTS, ids=list(DOCUMENTS))
def test_packed_documents_equal_the_fused_kernel_and_each_document_alone(case, monkeypatch):
    """With a frame each query scores its own document's blocks at its position in it: the picks equal the fused
    kernel's with the same frame (float64, with and without the compressed branch's log-sum-exps) and, document by
    document, this path's picks for that document alone (no frame, its own compressed tokens); queries in chunks
    (SCORE_BYTES small) change nothing."""
    from nsa.attention.impl.compression import num_compressed
    from tests.nsa.test_kernel_documents import compress, documents, window_starts
    from nsa.attention.documents import compressed_layout

    H_kv, G, l_sel, n, lengths = DOCUMENTS[case]
    l, d, hd = 8, 4, 16
    start = window_starts(lengths)
    B, T = start.shape
    layout = compressed_layout(start, l, d)
    g = torch.Generator().manual_seed(len(case))
    q = (2 * torch.randn(B, H_kv, G, T, hd, generator=g, dtype=torch.float64)).to(DEV)
    ck = compress(torch.randn(B, H_kv, T, hd, generator=g, dtype=torch.float64), layout).to(DEV)
    frame = layout.frame.to(DEV)
    lse = torch.randn(B, H_kv, G, T, generator=g, dtype=torch.float64).to(DEV) + 3.0  # any normaliser: both read it
    for given in (lse, None):  # got: the picks without the log-sum-exps, compared with each document alone below
        got = two_pass(q, ck, 0, l, d, l_sel, n, frame=frame, lse=given)
        want = select_topk.fused_select_blocks(q, ck, 0, l, d, l_sel, n, frame=frame, lse=given)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    for b, first, n_tok in documents(lengths):
        c_base, count = int(layout.frame[2, b, first]), num_compressed(n_tok, l, d)
        alone = two_pass(q[b:b + 1, :, :, first:first + n_tok], ck[b:b + 1, :, c_base:c_base + count], 0, l, d, l_sel, n)
        torch.testing.assert_close(got[b:b + 1, :, first:first + n_tok], alone, rtol=0, atol=0,
                                   msg=lambda m: f"row {b} document at {first} ({n_tok} tokens): {m}")
    width = select_two_pass.row_blocks(0, T, l_sel)
    monkeypatch.setattr(select_two_pass, "SCORE_BYTES", B * H_kv * 24 * width * 8)  # 24 queries a launch pair
    torch.testing.assert_close(two_pass(q, ck, 0, l, d, l_sel, n, frame=frame), got, rtol=0, atol=0)


def test_positions_past_the_bound_read_nothing_beyond_it():
    """A document position past the absolute one (a malformed frame): the row keeps min(n, blocks) picks within
    row_blocks(q_start, Tq, l') and never reads the column after them (NaN there would rank first)."""
    q_start, Tq, n, l_sel = 9, 2, 3, 4
    width = select_two_pass.row_blocks(q_start, Tq, l_sel)  # 3 blocks
    big = torch.rand(1, 1, Tq, width + 1, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(DEV)
    big[..., width] = float("nan")
    positions = torch.tensor([[100, 8]], device=DEV)  # current blocks 25 (past the bound) and 2
    got = select_two_pass.top_n_rows(big, q_start, l_sel, n, positions=positions)[0, 0]
    want = select_blocks(big[..., :width], 0, l_sel, n, positions=torch.tensor([[[100, 8]]]).clamp_max(
        width * l_sel - 1).to(DEV))[0, 0]
    assert got[0].max() < width and torch.equal(got[1], want[1]), got


def test_a_one_document_frame_equals_q_start():
    """plain_frame (one document at positions q_start ..) gives what q_start gives without a frame."""
    from nsa.attention.documents import plain_frame

    B, H_kv, G, Tq, hd, q_start, l, d, l_sel, n = 2, 1, 3, 37, 16, 1100, 32, 16, 64, 16
    q, ck = make_inputs(B, H_kv, G, Tq, hd, q_start, l, d, seed=4)
    got = two_pass(q, ck, q_start, l, d, l_sel, n, frame=plain_frame(B, Tq, q_start, DEV))
    torch.testing.assert_close(got, two_pass(q, ck, q_start, l, d, l_sel, n), rtol=0, atol=0)


def test_rejects_bad_input_in_one_line():
    q, ck = make_inputs(1, 1, 2, 16, 16, 0, 8, 4)
    with pytest.raises(ValueError, match="do not match"):
        two_pass(q, ck[..., :8], 0, 8, 4, 16, 4)
    with pytest.raises(ValueError, match="need d"):
        two_pass(q, ck, 0, 6, 4, 16, 4)
    with pytest.raises(ValueError, match="blocks a row"):
        two_pass(q, ck, 10 ** 6, 8, 4, 16, 4)
    with pytest.raises(ValueError, match="frame must be"):
        two_pass(q, ck, 0, 8, 4, 16, 4, frame=torch.zeros(3, 1, 15, dtype=torch.long, device=DEV))
    with pytest.raises(ValueError, match="fp32 / fp64"):
        select_two_pass.top_n_rows(torch.zeros(1, 1, 4, 1, dtype=torch.long, device=DEV), 0, 4, 2)
