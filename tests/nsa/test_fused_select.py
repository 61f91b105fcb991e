"""The fused top-n block selection kernel (nsa/attention/kernels/select_topk.py) against the torch path.

The reference is `block_select.select_by_score` = select_blocks(selection_block_scores(
compression_group_probs(...))) per chunk of queries. Without CUDA the kernel runs in Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported); it is slow, so sizes stay small.
"""
from __future__ import annotations

import pytest
import torch

from nsa.attention.impl.block_select import select_by_score
from nsa.attention.impl.compression import compression_group_probs, num_compressed
from nsa.attention.impl.selection import selection_block_scores

try:
    from tests.nsa.interpreter_probe import interpreter_loop_problem
    from nsa.attention.kernels import select_topk
except ImportError as exc:  # triton not installed
    pytest.skip(f"triton is not importable ({exc})", allow_module_level=True)

DEV = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
if DEV.type == "cpu" and not select_topk.interpreter_active():
    pytest.skip("Triton's interpreter is off (TRITON_INTERPRET=1 must be set before triton is imported)",
                allow_module_level=True)
if reason := interpreter_loop_problem():  # tests/nsa/interpreter_probe.py: a Triton interpreter limit
    pytest.skip(reason, allow_module_level=True)
fused_select_blocks = select_topk.fused_select_blocks


def make_inputs(B, H_kv, G, Tq, hd, q_start, l, d, seed=0, spread=2.0):
    """q [B, H_kv, G, Tq, hd] as a strided view (not contiguous); ck covers the prefix up to the last query."""
    g = torch.Generator().manual_seed(seed)
    q = (spread * torch.randn(B, Tq, H_kv, G, hd, generator=g, dtype=torch.float64)).permute(0, 2, 3, 1, 4)
    ck = torch.randn(B, H_kv, num_compressed(q_start + Tq, l, d), hd, generator=g, dtype=torch.float64)
    return q.to(DEV), ck.to(DEV)


def reference(q, ck, q_start, l, d, l_sel, n):
    return select_by_score(q.double(), ck.double(), q_start, l, d, l_sel, n, q_chunk=32)


def forced_or_lowest(q_start: int, Tq: int, l_sel: int, n: int) -> torch.Tensor:
    """[Tq, n] what selection must give when every competing block ties: block 0, the previous and the
    current block, then the lowest-indexed others; ascending, -1 padded."""
    rows = []
    for p in range(q_start, q_start + Tq):
        c = p // l_sel
        forced = sorted({0, max(c - 1, 0), c})  # all at +inf: with n < 3 the lower ones win too
        picked = (forced + list(range(1, c - 1)))[: min(n, c + 1)]
        rows.append(sorted(picked) + [-1] * (n - len(picked)))
    return torch.tensor(rows, dtype=torch.long, device=DEV)


# (B, H_kv, G, Tq, hd, q_start, l, d, l_sel, n)
CASES = [
    pytest.param(1, 2, 1, 80, 16, 0, 8, 4, 16, 4, id="G1-l2d-lsel4d-from0"),
    pytest.param(1, 1, 2, 90, 32, 40, 16, 16, 32, 3, id="G2-l=d-n3-chunk"),
    pytest.param(1, 1, 6, 123, 24, 77, 8, 4, 16, 5, id="G6-hd24-n5-chunk"),
    pytest.param(1, 1, 6, 37, 64, 1100, 32, 16, 64, 16, id="G6-M7C-geometry-late-chunk"),
    pytest.param(2, 1, 3, 64, 16, 5, 24, 8, 48, 6, id="G3-l3d-lsel6d-B2"),
]


@pytest.mark.parametrize("B, H_kv, G, Tq, hd, q_start, l, d, l_sel, n", CASES)
def test_matches_torch_path_float64(B, H_kv, G, Tq, hd, q_start, l, d, l_sel, n):
    q, ck = make_inputs(B, H_kv, G, Tq, hd, q_start, l, d)
    got = fused_select_blocks(q, ck, q_start, l, d, l_sel, n)
    assert got.dtype == torch.long and got.shape == (B, H_kv, Tq, n)
    torch.testing.assert_close(got, reference(q, ck, q_start, l, d, l_sel, n), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("G, q_start, n", [(6, 29, 5), (2, 0, 2)])
def test_exact_ties_go_to_lower_blocks(dtype, G, q_start, n):
    """q = 0: uniform probabilities, so all fully visible competing blocks tie exactly; the lowest win
    (n = 2 < 3: even the forced blocks tie, at +inf)."""
    Tq, l, d, l_sel = 80, 8, 4, 16
    q, ck = make_inputs(1, 1, G, Tq, 16, q_start, l, d)
    q = torch.zeros_like(q)
    got = fused_select_blocks(q.to(dtype), ck.to(dtype), q_start, l, d, l_sel, n)[0, 0]
    torch.testing.assert_close(got, forced_or_lowest(q_start, Tq, l_sel, n), rtol=0, atol=0)
    torch.testing.assert_close(got, reference(q, ck, q_start, l, d, l_sel, n)[0, 0], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_differs_only_at_near_ties(dtype):
    """fp32 / bf16 inputs against the float64 torch path on the same (rounded) values: a query's set may
    differ only by swapping blocks whose float64 scores are within a tiny relative gap."""
    B, H_kv, G, Tq, hd, q_start, l, d, l_sel, n = 1, 1, 6, 100, 32, 60, 8, 4, 16, 5
    q, ck = make_inputs(B, H_kv, G, Tq, hd, q_start, l, d, seed=3)
    q, ck = q.to(dtype), ck.to(dtype)
    got = fused_select_blocks(q, ck, q_start, l, d, l_sel, n)
    want = reference(q, ck, q_start, l, d, l_sel, n)
    n_blocks = (q_start + Tq - 1) // l_sel + 1
    probs = compression_group_probs(q.double(), ck.double(), q_start, l, d)
    scores = selection_block_scores(probs, l, d, l_sel, n_blocks)  # [B, H_kv, Tq, N_b] float64
    rows = (got != want).any(-1).nonzero().tolist()
    assert len(rows) <= 2, f"{len(rows)} of {B * H_kv * Tq} queries differ"
    for b, h, t in rows:
        mine, theirs = set(got[b, h, t].tolist()) - {-1}, set(want[b, h, t].tolist()) - {-1}
        assert len(mine) == len(theirs)
        s = scores[b, h, t]
        gap = max(abs(s[i] - s[j]).item() for i in mine - theirs for j in theirs - mine)
        assert gap <= 1e-5 * s.max().item(), (b, h, t, sorted(mine), sorted(theirs), gap)


def test_causality_perturbation():
    """Changing compressed keys a query cannot see and queries after it never changes its selection."""
    G, Tq, hd, q_start, l, d, l_sel, n = 2, 96, 16, 0, 8, 4, 16, 4
    q, ck = make_inputs(1, 1, G, Tq, hd, q_start, l, d, seed=5)
    base = fused_select_blocks(q, ck, q_start, l, d, l_sel, n)
    g = torch.Generator().manual_seed(6)
    for p in (37, 70):  # inside a tile of queries, not at its end
        t = p - q_start
        q2, ck2 = q.clone(), ck.clone()
        q2[..., t + 1 :, :] += 50 * torch.randn(q2[..., t + 1 :, :].shape, generator=g, dtype=q.dtype).to(DEV)
        seen = num_compressed(p + 1, l, d)
        ck2[:, :, seen:] += 50 * torch.randn(ck2[:, :, seen:].shape, generator=g, dtype=ck.dtype).to(DEV)
        out = fused_select_blocks(q2, ck2, q_start, l, d, l_sel, n)
        torch.testing.assert_close(out[..., : t + 1, :], base[..., : t + 1, :], rtol=0, atol=0)
        assert (out[..., t + 1 :, :] != base[..., t + 1 :, :]).any()  # the perturbation is felt later


def test_chunked_calls_match_one_call_and_empty_prefix():
    """Queries split into chunks (q_start > 0) select as in one call; with no compressed token yet
    (N_c = 0) each query keeps its forced blocks only."""
    G, Tq, hd, l, d, l_sel, n = 2, 53, 16, 8, 4, 16, 4
    q, ck = make_inputs(1, 1, G, Tq, hd, 0, l, d, seed=7)
    whole = fused_select_blocks(q, ck, 0, l, d, l_sel, n)
    part = fused_select_blocks(q[..., 21:, :], ck, 21, l, d, l_sel, n)
    torch.testing.assert_close(part, whole[..., 21:, :], rtol=0, atol=0)
    empty = fused_select_blocks(q[..., :7, :], ck[:, :, :0], 0, l, d, l_sel, n)  # positions 0..6 < l
    torch.testing.assert_close(empty[0, 0], torch.tensor([[0, -1, -1, -1]] * 7, device=DEV), rtol=0, atol=0)


def test_rejects_mismatched_shapes():
    q, ck = make_inputs(1, 1, 2, 16, 16, 0, 8, 4)
    with pytest.raises(ValueError):
        fused_select_blocks(q, ck[..., :8], 0, 8, 4, 16, 4)
    with pytest.raises(ValueError):
        fused_select_blocks(q, ck, 0, 6, 4, 16, 4)


@pytest.mark.parametrize("frame", [False, True], ids=["plain", "documents"])
def test_the_compressed_branch_log_sum_exps_give_the_same_picks(frame):
    """Eq. 8 shared: given the compressed branch's own log-sum-exps (nsa::compressed_attention's second output, the
    torch path here, FlexAttention's on CUDA), the kernel skips its first pass and picks exactly what it picks
    alone (float64: the two normalisers agree to rounding, and no two blocks here are that close). A wrong
    normaliser (every row's shifted by a different amount) changes the picks: the kernel reads it."""
    from nsa.attention import ops
    from nsa.attention.documents import compressed_layout
    from nsa.attention.impl.compression import compressed_attention_fwd

    B, H_kv, G, Tq, hd, l, d, l_sel, n = 1, 2, 3, 96, 16, 8, 4, 8, 4  # documents of 4-5 blocks: free picks
    q, ck = make_inputs(B, H_kv, G, Tq, hd, 0, l, d, seed=3, spread=3.0)
    q = q.contiguous()
    cv = torch.randn_like(ck)
    layout = None
    if frame:  # three documents in the window: lengths 29, 40, 27
        starts = torch.repeat_interleave(torch.tensor([0, 29, 69]), torch.tensor([29, 40, 27]))[None]
        layout = compressed_layout(starts.to(DEV), l, d)
        ck = torch.randn(B, H_kv, layout.frame[2].max().item() + num_compressed(40, l, d), hd, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(4)).to(DEV)
        cv = torch.randn_like(ck)
    f = None if layout is None else layout.frame
    q_flat = q.reshape(B, H_kv * G, Tq, hd)
    _, lse = (ops._compressed(q_flat, ck, cv, 0, l, d, 32, f) if frame
              else compressed_attention_fwd(q_flat, ck, cv, 0, l, d, 32))  # lse [B, H, Tq]
    lse = lse.view(B, H_kv, G, Tq)
    alone = fused_select_blocks(q, ck, 0, l, d, l_sel, n, frame=f)
    shared = fused_select_blocks(q, ck, 0, l, d, l_sel, n, frame=f, lse=lse)
    assert torch.equal(alone, shared)
    shifted = lse + 3.0 * torch.randn(lse.shape, generator=torch.Generator().manual_seed(5), dtype=lse.dtype).to(DEV)
    assert not torch.equal(alone, fused_select_blocks(q, ck, 0, l, d, l_sel, n, frame=f, lse=shifted))


@pytest.mark.parametrize("with_lse", [False, True])
@pytest.mark.parametrize("G, T, R, hd, l, d, l_sel", [(6, 150, 37, 24, 8, 4, 16), (2, 96, 96, 16, 16, 16, 32),
                                                       (3, 200, 50, 16, 24, 8, 48)])
def test_pooled_mass_rows_matches_the_torch_target(with_lse, G, T, R, hd, l, d, l_sel):
    """The indexer's compressed target for the KL's rows (select_topk.pooled_block_mass_rows, the rows r * T // R read
    in place, every block written: 0 past what a row sees) against impl/index_scores.pooled_block_mass on the
    gathered rows, float64, with the compressed branch's log-sum-exps given or computed."""
    from nsa.attention.impl.index_scores import kl_row_indices, pooled_block_mass

    q, ck = make_inputs(1, 2, G, T, hd, 0, l, d, seed=4)
    rows = kl_row_indices(T, R, DEV)
    n_blocks = -(-T // l_sel)
    want = pooled_block_mass(q[:, :, :, rows], ck, rows, l, d, l_sel, n_blocks)
    lse = None
    if with_lse:  # as the compressed branch returns them: -inf where a query sees no compressed token
        scores = torch.einsum("bkgtd,bknd->bkgtn", q, ck) / hd ** 0.5
        visible = torch.arange(ck.shape[2], device=DEV) * d + (l - 1) <= torch.arange(T, device=DEV)[:, None]
        lse = torch.logsumexp(scores.masked_fill(~visible, float("-inf")), dim=-1)
    got = select_topk.pooled_block_mass_rows(q, ck, R, l, d, l_sel, n_blocks, lse=lse)
    assert got.shape == (1, 2, R, n_blocks) and got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
