"""The learned indexer's one-launch picks kernel (nsa/attention/kernels/indexer_topk.py) against its torch oracle
(impl/index_scores.indexer_picks: the scores in torch ops, then select_blocks).

The two paths sum the same products in different orders, so their scores differ by rounding; picks are compared
by the oracle's scores of what each kept (equal within the rounding of the scores, forced blocks at +inf), and bit
for bit where the scores tie exactly (q = 0: every score 0) or are well separated (float64). Without CUDA the kernel
runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1); sizes stay small.
"""
from __future__ import annotations

import pytest
import torch

from nsa.attention import ops
from nsa.attention.impl.index_scores import index_block_scores, indexer_picks

try:
    from tests.nsa.interpreter_probe import interpreter_loop_problem
    from nsa.attention.kernels import indexer_topk
except ImportError as exc:  # triton not installed
    pytest.skip(f"triton is not importable ({exc})", allow_module_level=True)

DEV = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
if DEV.type == "cpu" and not indexer_topk.interpreter_active():
    pytest.skip("Triton's interpreter is off (TRITON_INTERPRET=1 must be set before triton is imported)",
                allow_module_level=True)
if reason := interpreter_loop_problem():
    pytest.skip(reason, allow_module_level=True)


def make_inputs(B, Tq, H_kv, h, e, n_keys, seed=0, dtype=torch.float64):
    """q [B, Tq, H_kv, h, e] as a strided view of a projection's output (not contiguous in the head axes), w, keys."""
    g = torch.Generator().manual_seed(seed)
    proj = torch.randn(B, Tq, H_kv * h * e + 7, generator=g, dtype=torch.float64)
    q = proj[..., 7:].view(B, Tq, H_kv, h, e)
    w = torch.randn(B, Tq, H_kv, h, generator=g, dtype=torch.float64)
    keys = torch.randn(B, n_keys, e, generator=g, dtype=torch.float64)
    return q.to(DEV, dtype), w.to(DEV, dtype), keys.to(DEV, dtype)


def kept_scores(picks: torch.Tensor, scores: torch.Tensor, q_start: int, l_sel: int) -> torch.Tensor:
    """The oracle's scores of the kept blocks, forced blocks at +inf, sorted descending; -inf for empty slots."""
    Tq = picks.shape[2]
    current = (torch.arange(q_start, q_start + Tq, device=picks.device) // l_sel)[:, None]  # [Tq, 1]
    forced = (picks == 0) | (picks == current) | (picks == current - 1)
    s = scores.gather(-1, picks.clamp_min(0))
    s = torch.where(forced, float("inf"), s)
    return torch.where(picks >= 0, s, float("-inf")).sort(dim=-1, descending=True).values


def check_valid(picks: torch.Tensor, q_start: int, l_sel: int, n: int):
    """Ascending distinct blocks, none after the query's current one, min(n, current + 1) of them, -1 pads last."""
    Tq = picks.shape[2]
    current = torch.arange(q_start, q_start + Tq, device=picks.device) // l_sel  # [Tq]
    count = (picks >= 0).sum(-1)
    assert torch.equal(count, torch.minimum(current + 1, torch.tensor(n, device=picks.device)).expand_as(count))
    kept = torch.where(picks >= 0, picks, torch.iinfo(torch.long).max)
    assert bool(((kept[..., 1:] > kept[..., :-1]) | (picks[..., 1:] < 0)).all()), "not ascending or not distinct"
    assert bool((picks <= current[:, None]).all()), "a block after the query's current one"


def assert_same_picks(got, want, scores, q_start: int, l_sel: int, tol: float):
    """Two code paths' picks judged by one set of scores [B, H_kv, Tq, N_b]: the same number kept per query, and the
    kept blocks' scores equal within tol (the paths' rounding): a block may swap only with one it ties with."""
    g, r = kept_scores(got, scores, q_start, l_sel), kept_scores(want, scores, q_start, l_sel)
    finite = torch.isfinite(r)
    assert torch.equal(torch.isfinite(g), finite)
    torch.testing.assert_close(g[finite], r[finite], rtol=0, atol=tol)


# (B, Tq, H_kv, h, e, q_start, l_sel, n, per_token)
CASES = [
    pytest.param(1, 96, 2, 2, 32, 0, 8, 4, True, id="recall-geometry-scores"),
    pytest.param(1, 96, 2, 2, 32, 0, 8, 4, False, id="recall-geometry-keys"),
    pytest.param(2, 70, 1, 3, 24, 0, 16, 5, True, id="h3-e24-padded-scores"),
    pytest.param(2, 70, 1, 3, 24, 0, 16, 5, False, id="h3-e24-padded-keys"),
    pytest.param(1, 37, 2, 1, 16, 300, 64, 16, True, id="M7C-l'-chunk-scores"),
    pytest.param(1, 37, 2, 4, 64, 300, 64, 6, False, id="h4-e64-chunk-keys"),
]


@pytest.mark.parametrize("B, Tq, H_kv, h, e, q_start, l_sel, n, per_token", CASES)
def test_matches_oracle_float64(B, Tq, H_kv, h, e, q_start, l_sel, n, per_token):
    S = q_start + Tq
    q, w, keys = make_inputs(B, Tq, H_kv, h, e, S if per_token else -(-S // l_sel))
    got = indexer_topk.fused_indexer_picks(q, w, keys, q_start, l_sel, n, per_token)
    assert got.dtype == torch.long and got.shape == (B, H_kv, Tq, n)
    check_valid(got, q_start, l_sel, n)
    want = indexer_picks(q, w, keys, q_start, l_sel, n, per_token)
    # two code paths: the same sums in other orders (float64: 1e-12); exact ties (ReLU cutting every head: score 0)
    # break to the lower block in both
    assert_same_picks(got, want, index_block_scores(q, w, keys, l_sel, per_token), q_start, l_sel, 1e-12)
    assert (got != want).float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_token", [True, False])
def test_low_precision_keeps_blocks_as_good_as_the_oracles(dtype, per_token):
    """In float32 / bf16 the kernel's dot rounds otherwise than torch's einsum: a block may swap with one whose
    float64 score is within that rounding; the kept blocks' float64 scores equal the oracle's picks' scores."""
    B, Tq, H_kv, h, e, q_start, l_sel, n = 1, 80, 2, 2, 32, 40, 8, 5
    S = q_start + Tq
    q, w, keys = make_inputs(B, Tq, H_kv, h, e, S if per_token else -(-S // l_sel), seed=3, dtype=dtype)
    got = indexer_topk.fused_indexer_picks(q, w, keys, q_start, l_sel, n, per_token)
    check_valid(got, q_start, l_sel, n)
    exact = index_block_scores(q.double(), w.double(), keys.double(), l_sel, per_token)  # [B, H_kv, Tq, N_b]
    want = indexer_picks(q.double(), w.double(), keys.double(), q_start, l_sel, n, per_token)
    tol = 1e-4 if dtype == torch.float32 else 0.05 * float(exact.abs().max())  # bf16 inputs, fp32 accumulation
    assert_same_picks(got, want, exact, q_start, l_sel, tol)
    assert (got != want).float().mean() < 0.2  # a swap is the exception, not the rule


@pytest.mark.parametrize("per_token", [True, False])
def test_exact_ties_go_to_lower_blocks(per_token):
    """q = 0: every score is exactly 0, so every competing block ties: block 0, the previous and the current block,
    then the lowest others, as select_blocks breaks ties."""
    B, Tq, H_kv, h, e, q_start, l_sel, n = 1, 70, 1, 2, 16, 30, 8, 5
    S = q_start + Tq
    q, w, keys = make_inputs(B, Tq, H_kv, h, e, S if per_token else -(-S // l_sel), dtype=torch.float32)
    q = torch.zeros_like(q)
    got = indexer_topk.fused_indexer_picks(q, w, keys, q_start, l_sel, n, per_token)
    rows = []
    for p in range(q_start, S):
        c = p // l_sel
        picked = (sorted({0, max(c - 1, 0), c}) + list(range(1, c - 1)))[: min(n, c + 1)]
        rows.append(sorted(picked) + [-1] * (n - len(picked)))
    assert torch.equal(got[0, 0].cpu(), torch.tensor(rows))


def test_picks_read_no_future_key():
    """Keys after a query's position (per-token keys) change its scores only in its current block, which is forced:
    perturbing every key from position t on leaves the picks of queries before t unchanged."""
    B, Tq, H_kv, h, e, l_sel, n = 1, 64, 2, 2, 16, 8, 5
    q, w, keys = make_inputs(B, Tq, H_kv, h, e, Tq, seed=5)
    before = indexer_topk.fused_indexer_picks(q, w, keys, 0, l_sel, n, True)
    t = 20
    keys2 = keys.clone()
    keys2[:, t:] = 10 * torch.randn_like(keys2[:, t:])
    after = indexer_topk.fused_indexer_picks(q, w, keys2, 0, l_sel, n, True)
    assert torch.equal(after[:, :, :t], before[:, :, :t])
    assert not torch.equal(after[:, :, t:], before[:, :, t:])  # the perturbation reaches later queries' picks


@pytest.mark.parametrize("Tq, q_start", [(70, 0), (40, 33)])
def test_token_keys_pooled_in_the_kernel(Tq, q_start):
    """token_keys (one key per block, pooled from the token keys in the launch): the picks equal the oracle's on the
    block keys pooled in torch (impl/index_scores.block_max), float64; the last block partial."""
    from nsa.attention.impl.index_scores import block_max

    S, l_sel = q_start + Tq, 8
    q, w, tokens = make_inputs(1, Tq, 2, 2, 16, S, seed=11)
    got = indexer_topk.fused_indexer_picks(q, w, tokens, q_start, l_sel, 5, False, token_keys=True)
    keys = block_max(tokens, l_sel)
    want = indexer_picks(q, w, keys, q_start, l_sel, 5, False)
    assert_same_picks(got, want, index_block_scores(q, w, keys, l_sel, False), q_start, l_sel, 1e-12)
    # the op's torch path pools the same way (the same code: bit for bit)
    assert torch.equal(ops.indexer_picks(q, w, tokens, q_start, l_sel, 5, False, "torch", token_keys=True), want)


def test_op_chooses_the_kernel_and_the_torch_path_alike():
    """ops.indexer_picks with kernel=triton and kernel=torch: the same picks up to the scores' rounding (float64, the
    layer's entry point)."""
    q, w, keys = make_inputs(1, 50, 2, 2, 16, 50, seed=9)
    a = ops.indexer_picks(q, w, keys, 0, 8, 4, True, "triton")
    b = ops.indexer_picks(q, w, keys, 0, 8, 4, True, "torch")
    assert_same_picks(a, b, index_block_scores(q, w, keys, 8, True), 0, 8, 1e-12)


@pytest.mark.parametrize("pool", ["keys", "scores"])
def test_layer_on_the_triton_path_matches_the_float64_reference(pool):
    """An indexer layer with nsa.kernel=triton (its picks from this kernel) equals the per-token float64 reference:
    the same blocks and outputs (tests/nsa/test_indexer.py's check, on the Triton path)."""
    from tests.nsa.test_indexer import test_layer_matches_the_float64_reference

    test_layer_matches_the_float64_reference(80, pool, kernel="triton")


def document_frame(starts: list[list[int]], T: int) -> torch.Tensor:
    """Packed windows whose documents begin at `starts` (one list per batch row, 0 first) -> frame [3, B, T]
    (q_pos, k_base; the compressed base, unread by the picks, 0)."""
    first = torch.zeros(len(starts), T, dtype=torch.long)
    for b, row in enumerate(starts):
        for s in row:
            first[b, s:] = s
    pos = torch.arange(T) - first
    return torch.stack((pos, first, torch.zeros_like(first))).to(DEV)


def assert_same_document_picks(got, want, scores, frame, tol: float):
    """assert_same_picks for packed documents: forced blocks and counts in each query's own document."""
    current = (frame[0] // 8)[:, None, :, None]  # [B, 1, Tq, 1] (l' = 8 in these tests)

    def kept(picks):
        forced = (picks == 0) | (picks == current) | (picks == current - 1)
        s = torch.where(forced, float("inf"), scores.gather(-1, picks.clamp_min(0)))
        return torch.where(picks >= 0, s, float("-inf")).sort(dim=-1, descending=True).values

    g, r = kept(got), kept(want)
    finite = torch.isfinite(r)
    assert torch.equal(torch.isfinite(g), finite)
    torch.testing.assert_close(g[finite], r[finite], rtol=0, atol=tol)


@pytest.mark.parametrize("per_token", [True, False])
def test_documents_match_the_oracle_and_each_document_alone(per_token):
    """Packed documents (a frame): each query picks among its own document's blocks, counted from the document's first
    token, in one launch. Against the torch oracle (impl/index_scores.document_picks, float64), and each document's
    picks against the same kernel run on that document alone from position 0. Documents start off tile and block
    boundaries, one is shorter than a block, and a tile of queries straddles two or three of them."""
    from nsa.attention.impl.index_scores import block_max, document_index_scores, document_picks

    T, H_kv, h, e, l_sel, n = 90, 2, 2, 16, 8, 4
    starts = [[0, 5, 11, 50], [0, 33]]
    frame = document_frame(starts, T)
    q, w, tokens = make_inputs(2, T, H_kv, h, e, T, seed=21)
    got = indexer_topk.fused_indexer_picks(q, w, tokens, 0, l_sel, n, per_token, token_keys=True, frame=frame)
    want = document_picks(q, w, tokens, frame, l_sel, n, per_token)
    scores = document_index_scores(q, w, tokens, frame, -(-T // l_sel), l_sel, per_token)
    assert_same_document_picks(got, want, scores, frame, 1e-12)
    assert (got != want).float().mean() < 0.01
    # the op's torch path is the oracle's (the layer's entry point)
    assert torch.equal(ops.indexer_picks(q, w, tokens, 0, l_sel, n, per_token, "torch", token_keys=True, frame=frame),
                       want)
    for b, row in enumerate(starts):
        for lo, hi in zip(row, row[1:] + [T]):
            alone = indexer_topk.fused_indexer_picks(q[b:b + 1, lo:hi], w[b:b + 1, lo:hi], tokens[b:b + 1, lo:hi], 0,
                                                     l_sel, n, per_token, token_keys=True)
            check_valid(alone, 0, l_sel, n)
            packed = got[b:b + 1, :, lo:hi]
            assert_same_picks(packed, alone, index_block_scores(
                q[b:b + 1, lo:hi], w[b:b + 1, lo:hi],
                tokens[b:b + 1, lo:hi] if per_token else block_max(tokens[b:b + 1, lo:hi], l_sel), l_sel, per_token),
                0, l_sel, 1e-12)


def test_documents_read_no_other_documents_key():
    """Perturbing every key of one document leaves the other documents' picks unchanged (and changes its own)."""
    T, l_sel, n = 90, 8, 4
    frame = document_frame([[0, 13, 70]], T)
    q, w, tokens = make_inputs(1, T, 2, 2, 16, T, seed=23)
    before = indexer_topk.fused_indexer_picks(q, w, tokens, 0, l_sel, n, True, frame=frame)
    tokens2 = tokens.clone()
    tokens2[:, 13:70] = 10 * torch.randn_like(tokens2[:, 13:70])
    after = indexer_topk.fused_indexer_picks(q, w, tokens2, 0, l_sel, n, True, frame=frame)
    assert torch.equal(after[:, :, :13], before[:, :, :13]) and torch.equal(after[:, :, 70:], before[:, :, 70:])
    assert not torch.equal(after[:, :, 13:70], before[:, :, 13:70])  # a 57-token document: 1 free pick of 5-6


def test_layer_over_packed_documents_on_the_triton_path():
    """An indexer layer over packed documents with nsa.kernel=triton (its picks from this kernel, every document of
    the window in one launch) equals each document alone and the float64 per-token reference (tests/nsa/
    test_indexer.py's check, on the Triton path; token scores: one key per block is held on the Triton path by
    test_indexer_kl_op.py's layer test and the kernel tests above, at a third of this test's time)."""
    from tests.nsa.test_indexer import test_packed_documents_equal_each_document_alone_and_the_reference as check

    check("scores", kernel="triton")
