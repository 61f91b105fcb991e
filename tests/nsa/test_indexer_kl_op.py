"""The indexer's KL term as one op (nsa::indexer_kl, ops.indexer_kl): its closed-form backward
(impl/index_scores.kl_loss_backward) against autograd through the torch formula (kl_loss), in float64, for both
poolings, with blocks whose tokens tie for the max; the op's value and gradient on the torch path."""
from __future__ import annotations

import pytest
import torch

from nsa.attention import ops
from nsa.attention.impl.index_scores import counted_kl_rows, kl_loss, kl_loss_backward

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
    terms, stats = kl_loss(x, target, H_KV, HEADS, DIM, R, l_sel, per_token, weight)
    loss = terms.sum()
    assert terms.shape == (1, H_KV, R) and loss.item() > 0 and stats.shape == (1, H_KV, R, 2)
    grad = torch.tensor(1.3, dtype=torch.float64)
    (want,) = torch.autograd.grad(loss, x, grad, retain_graph=True)
    got = kl_loss_backward(grad.expand(1, H_KV, R), out, target, H_KV, HEADS, DIM, R, l_sel, per_token, weight)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13)
    per_row = torch.rand(1, H_KV, R, generator=torch.Generator().manual_seed(1), dtype=torch.float64)  # any weights
    (want_rows,) = torch.autograd.grad(terms, x, per_row)
    got_rows = kl_loss_backward(per_row, out, target, H_KV, HEADS, DIM, R, l_sel, per_token, weight)
    torch.testing.assert_close(got_rows, want_rows, rtol=1e-10, atol=1e-13)
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
    want.sum().backward()
    got.sum().backward()
    torch.testing.assert_close(b.grad, a.grad, rtol=1e-10, atol=1e-13)


try:
    from nsa.attention.kernels import indexer_kl as kl_kernels
    from tests.nsa.interpreter_probe import interpreter_loop_problem
except ImportError:  # triton not installed
    kl_kernels = None


def _kernels_problem() -> str | None:
    if kl_kernels is None:
        return "triton is not importable"
    if not torch.cuda.is_available() and not kl_kernels.interpreter_active():
        return "Triton's interpreter is off (TRITON_INTERPRET=1 must be set before triton is imported)"
    return interpreter_loop_problem()


@pytest.mark.parametrize("per_token", [True, False])
@pytest.mark.parametrize("T, R, l_sel, ties", [(64, 64, 8, False), (70, 23, 8, True), (100, 17, 16, False),
                                               (300, 29, 64, False)])  # l' = 64: one block per backward chunk
def test_kernels_match_the_oracle_float64(per_token, T, R, l_sel, ties):
    """One launch forward (value and row statistics) and one backward (every element of d out) against the torch
    oracle, float64: the same sums in another order (1e-10); a poisoned gradient buffer shows an element unwritten."""
    if reason := _kernels_problem():
        pytest.skip(reason)
    out, target = make(T, R, l_sel, seed=5, ties=ties)
    want, want_stats = kl_loss(out, target, H_KV, HEADS, DIM, R, l_sel, per_token, 0.7)
    got, got_stats, _ = kl_kernels.indexer_kl_forward(out, target, H_KV, HEADS, DIM, R, l_sel, per_token, 0.7)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    has_candidates = torch.isfinite(want_stats[..., 0])  # rows with no candidate: no log-sum-exp to compare
    torch.testing.assert_close(got_stats[has_candidates], want_stats[has_candidates], rtol=1e-10, atol=1e-12)
    grad = torch.rand(1, H_KV, R, generator=torch.Generator().manual_seed(2), dtype=torch.float64)  # per-row
    want_d = kl_loss_backward(grad, out, target, H_KV, HEADS, DIM, R, l_sel, per_token, 0.7)
    poisoned = torch.full_like(out, float("nan"))
    got_d = kl_kernels.indexer_kl_backward(grad, out, target, got_stats, H_KV, HEADS, DIM, R, l_sel, per_token, 0.7,
                                           d_out=poisoned)
    torch.testing.assert_close(got_d, want_d, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("per_token", [True, False])
def test_kernels_in_low_precision_against_float64(dtype, tol, per_token):
    """fp32 / bf16 projection outputs: the loss and its gradient within the inputs' rounding of the float64 oracle
    on the same (rounded) values (relative to the gradient's largest element)."""
    if reason := _kernels_problem():
        pytest.skip(reason)
    T, R, l_sel = 96, 40, 8
    out, target = make(T, R, l_sel, seed=7)
    low = out.to(dtype)
    want, _ = kl_loss(low.double(), target, H_KV, HEADS, DIM, R, l_sel, per_token, 1.0)
    got, stats, _ = kl_kernels.indexer_kl_forward(low, target.float(), H_KV, HEADS, DIM, R, l_sel, per_token, 1.0)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.sum().double(), want.sum(), rtol=tol, atol=tol)
    grad = torch.ones(1, H_KV, R)
    want_d = kl_loss_backward(grad.double(), low.double(), target, H_KV, HEADS, DIM, R, l_sel, per_token, 1.0)
    got_d = kl_kernels.indexer_kl_backward(grad, low, target.float(), stats, H_KV, HEADS, DIM, R, l_sel, per_token, 1.0)
    assert got_d.dtype == dtype
    scale = want_d.abs().max()
    torch.testing.assert_close(got_d.double() / scale, want_d / scale, rtol=0, atol=4 * tol)


def test_the_op_chooses_the_kernels_with_kernel_triton():
    """ops.indexer_kl with kernel=triton: the kernels' value and gradient; kernel=torch: the oracle's (float64)."""
    if reason := _kernels_problem():
        pytest.skip(reason)
    T, R, l_sel = 72, 72, 8
    out, target = make(T, R, l_sel, seed=8)
    grads = {}
    for kernel in ("triton", "torch"):
        x = out.clone().requires_grad_()
        loss = ops.indexer_kl(x, target, H_KV, HEADS, DIM, R, l_sel, True, 1.5, kernel).sum()
        loss.backward()
        grads[kernel] = (loss.detach(), x.grad)
    torch.testing.assert_close(grads["triton"][0], grads["torch"][0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads["triton"][1], grads["torch"][1], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("pool, target, documents", [("keys", "dense", False), ("scores", "dense", False),
                                                      ("keys", "compressed", False), ("scores", "compressed", True),
                                                      ("keys", "dense", True)])
def test_a_layer_on_the_triton_path_learns_as_on_the_torch_path(pool, target, documents):
    """An indexer layer's training forward with nsa.kernel=triton (picks, the KL with its target in the same launch,
    every other Triton op, in the interpreter) against nsa.kernel=torch on the same weights, float64: the same KL
    term and indexer gradient; also over packed documents (the picks and the KL over each row's own document)."""
    if reason := _kernels_problem():
        pytest.skip(reason)
    from nsa.attention.documents import Documents
    from tests.nsa._nsa_helpers import make_input, make_layer, rope_for

    T = 150 if documents else 72  # l' = 16: a row needs position >= 64 for two candidate blocks
    x, rope = make_input(1, T, seed=4), rope_for(T)
    layer_kwargs = {}
    if documents:  # three documents, per-document positions (RoPE restarts in each)
        from tests.nsa.test_nsa_documents import _doc_rope

        docs = Documents(torch.tensor([[0] * 5 + [5] * 95 + [100] * 50]))
        rope, layer_kwargs = _doc_rope(docs), {"documents": docs}
    results = {}
    for kernel in ("triton", "torch"):
        layer = make_layer(seed=3, nsa_overrides=dict(selector="indexer", indexer_heads=2, indexer_dim=8,
                                                      gate_init="equal", indexer_pool=pool, kernel=kernel,
                                                      indexer_target=target))
        with torch.no_grad():
            for p in layer.indexer.parameters():
                p.normal_(0.0, 0.5)
        layer(x, rope, **layer_kwargs)
        layer.indexer_loss.sum().backward()
        results[kernel] = (layer.indexer_loss.detach().sum(), layer.indexer.projection.weight.grad)
    assert results["torch"][0] > 0
    torch.testing.assert_close(results["triton"][0], results["torch"][0], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(results["triton"][1], results["torch"][1], rtol=1e-8, atol=1e-11)


@pytest.mark.parametrize("G, T, R, hd, l_sel", [(6, 150, 37, 24, 16), (2, 96, 96, 16, 8), (3, 200, 50, 32, 64)])
def test_dense_mass_rows_matches_the_torch_target(G, T, R, hd, l_sel):
    """The indexer's dense target for the KL's rows (kernels/dense_mass.py: the rows r * T // R read in place, every
    block written) against impl/index_scores.dense_block_mass on the gathered rows, float64; and through the op."""
    if reason := _kernels_problem():
        pytest.skip(reason)
    from nsa.attention.impl.index_scores import dense_block_mass, kl_row_indices
    from nsa.attention.kernels.dense_mass import dense_block_mass_rows

    g = torch.Generator().manual_seed(6)
    q = (2 * torch.randn(1, T, 2, G, hd, generator=g, dtype=torch.float64)).permute(0, 2, 3, 1, 4)  # strided
    k = torch.randn(1, 2, T, hd, generator=g, dtype=torch.float64)
    rows = kl_row_indices(T, R, q.device)
    n_blocks = -(-T // l_sel)
    want = dense_block_mass(q[:, :, :, rows], k, rows, l_sel, n_blocks)
    got = dense_block_mass_rows(q, k, R, l_sel, n_blocks)
    assert got.shape == (1, 2, R, n_blocks)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got.sum(-1), torch.full_like(got.sum(-1), float(G)))  # each head's mass is 1
    torch.testing.assert_close(ops.dense_mass_rows(q, k, R, l_sel, n_blocks, "triton"),
                               ops.dense_mass_rows(q, k, R, l_sel, n_blocks, "torch"), rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- packed documents
def make_documents(starts: list[list[int]], T: int, R: int, l_sel: int, seed: int = 0, extra_blocks: int = 2):
    """Packed windows (documents beginning at `starts`, one list per batch row) -> out [B, T, P], a target
    [B, H_kv, R, N_b] counting extra_blocks more blocks than ceil(T / l') (as the layer's document targets do), and the
    frame [3, B, T] (q_pos, k_base, an unread compressed base), float64."""
    g = torch.Generator().manual_seed(seed)
    B, P = len(starts), H_KV * HEADS * (DIM + 1) + DIM
    out = torch.randn(B, T, P, generator=g, dtype=torch.float64)
    out[0, 9, -DIM:] = out[0, 10, -DIM:]  # tied index keys in a block: its max ties in every dim and every score
    target = torch.rand(B, H_KV, R, -(-T // l_sel) + extra_blocks, generator=g, dtype=torch.float64)
    target[..., 2] = 0.0
    first = torch.zeros(B, T, dtype=torch.long)
    for b, row in enumerate(starts):
        for s in row:
            first[b, s:] = s
    frame = torch.stack((torch.arange(T) - first, first, torch.zeros_like(first)))
    return out, target, frame


STARTS = [[0, 37, 41, 100], [0, 70]]  # off block boundaries; one document shorter than a block


@pytest.mark.parametrize("per_token", [True, False])
def test_documents_oracle_equals_each_document_alone(per_token):
    """The torch oracle over packed documents (impl/index_scores.kl_loss with a frame; every query a KL row, R = T)
    against each document alone from position 0 (the plain oracle on its slice): a row's term times the counted rows
    is its KL either way, and so is every gradient element times the count."""
    T, l_sel = 150, 8
    out, target, frame = make_documents(STARTS, T, T, l_sel, seed=3)
    terms, _ = kl_loss(out, target, H_KV, HEADS, DIM, T, l_sel, per_token, 1.0, frame)
    count = (frame[0] >= 4 * l_sel).sum() * H_KV
    assert terms.abs().sum() > 0
    grad = torch.rand(2, H_KV, T, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    d_packed = kl_loss_backward(grad, out, target, H_KV, HEADS, DIM, T, l_sel, per_token, 1.0, frame)
    x = out.clone().requires_grad_()  # the closed form is autograd's through the packed formula
    (want,) = torch.autograd.grad(kl_loss(x, target, H_KV, HEADS, DIM, T, l_sel, per_token, 1.0, frame)[0], x, grad)
    torch.testing.assert_close(d_packed, want, rtol=1e-10, atol=1e-13)
    for b, row in enumerate(STARTS):
        for lo, hi in zip(row, row[1:] + [T]):
            n = hi - lo
            alone_target = target[b:b + 1, :, lo:hi, : -(-n // l_sel)]
            alone, _ = kl_loss(out[b:b + 1, lo:hi], alone_target, H_KV, HEADS, DIM, n, l_sel, per_token, 1.0)
            alone_count = max(int((torch.arange(n) >= 4 * l_sel).sum()) * H_KV, 1)
            torch.testing.assert_close(terms[b:b + 1, :, lo:hi] * count, alone * alone_count, rtol=1e-10, atol=1e-12)
            d_alone = kl_loss_backward(grad[b:b + 1, :, lo:hi], out[b:b + 1, lo:hi], alone_target, H_KV, HEADS, DIM,
                                       n, l_sel, per_token, 1.0)
            torch.testing.assert_close(d_packed[b:b + 1, lo:hi] * count, d_alone * alone_count, rtol=1e-9,
                                       atol=1e-12)


@pytest.mark.parametrize("per_token", [True, False])
@pytest.mark.parametrize("T, R, l_sel", [(150, 150, 8), (150, 41, 8), (200, 37, 16)])
def test_document_kernels_match_the_oracle_float64(per_token, T, R, l_sel):
    """Packed documents: the one-launch forward and backward (each row over its own document's blocks, the counted
    rows counted in the launch, each key's gradient written by the program holding its block's first token) against
    the torch oracle, float64, into a gradient buffer poisoned with NaN."""
    if reason := _kernels_problem():
        pytest.skip(reason)
    out, target, frame = make_documents(STARTS, T, R, l_sel, seed=5)
    want, want_stats = kl_loss(out, target, H_KV, HEADS, DIM, R, l_sel, per_token, 0.7, frame)
    counted = counted_kl_rows(frame, R, l_sel)  # the layers share it (once per batch)
    got, got_stats, _ = kl_kernels.indexer_kl_forward(out, target, H_KV, HEADS, DIM, R, l_sel, per_token, 0.7,
                                                      frame=frame, counted=counted)
    assert want.abs().sum() > 0
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    has_candidates = torch.isfinite(want_stats[..., 0])
    torch.testing.assert_close(got_stats[has_candidates], want_stats[has_candidates], rtol=1e-10, atol=1e-12)
    grad = torch.rand(2, H_KV, R, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    want_d = kl_loss_backward(grad, out, target, H_KV, HEADS, DIM, R, l_sel, per_token, 0.7, frame)
    poisoned = torch.full_like(out, float("nan"))
    got_d = kl_kernels.indexer_kl_backward(grad, out, target, got_stats, H_KV, HEADS, DIM, R, l_sel, per_token, 0.7,
                                           d_out=poisoned, frame=frame, counted=counted)
    torch.testing.assert_close(got_d, want_d, rtol=1e-9, atol=1e-12)
    # through the op, both paths: the same value and gradient
    results = {}
    for kernel in ("triton", "torch"):
        x = out.clone().requires_grad_()
        loss = ops.indexer_kl(x, target, H_KV, HEADS, DIM, R, l_sel, per_token, 0.7, kernel, frame=frame).sum()
        loss.backward()
        results[kernel] = (loss.detach(), x.grad)
    torch.testing.assert_close(results["triton"][0], results["torch"][0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(results["triton"][1], results["torch"][1], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("kind", ["compressed", "dense"])
def test_document_targets_in_the_launch_match_the_torch_targets(kind):
    """Packed documents: the KL's target computed in its forward launch (each row's compressed mass over its own
    document's compressed tokens, or its dense attention over its own document's keys, blocks counted from the
    document's first token) against the torch targets on the gathered rows (impl/masked.document_block_scores,
    impl/index_scores.dense_block_mass with the documents' bases), float64; and the KL that follows against the
    torch path's."""
    if reason := _kernels_problem():
        pytest.skip(reason)
    from nsa.attention.documents import Documents

    T, R, l, d, l_sel, G, hd = 150, 41, 8, 4, 8, 3, 16
    start = torch.zeros(2, T, dtype=torch.long)
    for b, row in enumerate(STARTS):
        for s in row:
            start[b, s:] = s
    layout = Documents(start).compressed(l, d)
    frame = layout.frame  # [3, B, T]
    g = torch.Generator().manual_seed(9)
    q = (2 * torch.randn(2, T, H_KV, G, hd, generator=g, dtype=torch.float64)).permute(0, 2, 3, 1, 4)  # strided
    n_keys = layout.block_start.shape[1] if kind == "compressed" else T
    keys = torch.randn(2, H_KV, n_keys, hd, generator=g, dtype=torch.float64)
    out, _, _ = make_documents(STARTS, T, R, l_sel, seed=10)
    source = (kind, q, keys, None, l, d)
    terms, _, got = kl_kernels.indexer_kl_forward(out, None, H_KV, HEADS, DIM, R, l_sel, True, 0.5, source, frame,
                                                  counted_kl_rows(frame, R, l_sel))
    want = ops._target_rows_torch(kind, q, keys, R, l, d, l_sel, -(-T // l_sel), frame)
    assert got.shape == want.shape and want.sum() > 0
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    want_terms, _ = kl_loss(out, want, H_KV, HEADS, DIM, R, l_sel, True, 0.5, frame)
    torch.testing.assert_close(terms, want_terms, rtol=1e-10, atol=1e-12)
