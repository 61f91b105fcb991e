"""Per-row RoPE tables (cos, sin [B, T, hd/2]; issue 39 item 6): NativeSparseAttention.forward and
DenseAttention.forward take `rope` as [T, hd/2] or [B, T, hd/2], on every path the module can run on a CPU:
without documents (torch path, Triton kernels in the interpreter, FlexAttention), with packed documents (the
torch path's masked and segments implementations, the Triton kernels, FlexAttention), the window-only layer,
and the decode cache (chunked prefill, then one token at a time). In float64:
  (a) rows that all equal a shared [T, hd/2] table give the shared table's output;
  (b) rows that differ (row b's positions shifted by b*K behind a left padding at position 0, or restarting in
      every document and shifted by b*K: no row is a pure shift of another, which RoPE could not tell apart)
      give, for each row b, what row b gives alone with its own [T, hd/2] table, selected blocks included;
  (c) changing row 1's table changes row 1's output only (rows are not mixed), exactly.
The plain path's compressed keys used to be rotated at rope[0][at], which indexes a per-row table's batch
dimension (IndexError)."""
from __future__ import annotations

import pytest
import torch

from nsa.attention import ops
from nsa.attention.dense import DenseAttention, KVCache
from nsa.attention.documents import Documents
from nsa.attention.impl import masked
from nsa.config import ModelConfig
from nsa.layers import RotaryEmbedding
from tests.nsa._nsa_helpers import DEVICE, DIM, HEAD_DIM, make_input, make_layer, starts_of

TOL = 1e-10  # float64
B, T, K = 3, 40, 7
HEADS, KV_HEADS = 2, 1  # few heads: the Triton interpreter's time grows with B * H_kv; B differs from both
L_SEL = 8  # T = 5 selection blocks with n = 4 (3 forced): queries in block 4 pick one by score
LAYOUTS = [[13, 27], [40], [20, 1, 19]]  # per row, document lengths (sum T)
PATHS = {  # name -> (documents, nsa.kernel, packed-documents implementation)
    "plain-torch": (False, "torch", None),
    "plain-triton": (False, "triton", None),
    "plain-flex": (False, "flex", None),
    "documents-masked": (True, "torch", "masked"),
    "documents-segments": (True, "torch", "segments"),
    "documents-triton": (True, "triton", "masked"),
    "documents-flex": (True, "flex", "masked"),
}


def nsa_layer(seed: int, **nsa_overrides):
    return make_layer(seed, nsa_overrides={"l_sel": L_SEL, **nsa_overrides}, n_heads=HEADS, n_kv_heads=KV_HEADS)


def tables(positions: torch.Tensor):
    """positions [T] or [B, T] -> cos, sin [T or B, T, hd/2]."""
    return RotaryEmbedding(HEAD_DIM, 10000.0).to(DEVICE)(positions.to(DEVICE))


def row_positions(documents: Documents | None) -> torch.Tensor:
    """[B, T] positions that differ per row and are no pure shift of each other: row b shifted by b*K, behind a
    left padding at position 0 (no documents) or restarting in every document (documents)."""
    t = torch.arange(T, device=DEVICE)
    shift = K * torch.arange(B, device=DEVICE)[:, None]  # [B, 1]
    if documents is None:
        return (t - shift).clamp_min(0)  # [B, T]
    return documents.positions + shift


def row_of(rope, b: int):
    """Row b of per-row tables: cos, sin [T, hd/2]."""
    return rope[0][b], rope[1][b]


def skip_without_triton():
    pytest.importorskip("triton")
    from nsa.attention.kernels.interpreter import interpreter_active

    if DEVICE.type == "cpu" and not interpreter_active():
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET=1 before triton is imported)")
    from tests.nsa.interpreter_probe import interpreter_loop_problem

    if reason := interpreter_loop_problem():  # a Triton interpreter limit, not the kernels'
        pytest.skip(reason)


@pytest.fixture(params=list(PATHS))
def path(request, monkeypatch):
    """-> (layer overrides, documents or None). "flex": the compressed and window branches through FlexAttention
    (CUDA only in the module: use_flex is patched; forward only on CPU); "segments": packed documents through
    impl/segments.py (masked.MAX_ELEMENTS = 0); "triton": block selection and selected attention through the
    Triton kernels (Triton's interpreter on CPU)."""
    use_documents, kernel, documents_impl = PATHS[request.param]
    if kernel == "triton":
        skip_without_triton()
    if kernel == "flex":
        monkeypatch.setattr(ops, "use_flex", lambda kernel, q: kernel != "torch")
        kernel = "auto"
    if documents_impl == "segments":
        monkeypatch.setattr(masked, "MAX_ELEMENTS", 0)
    documents = Documents(starts_of(LAYOUTS).to(DEVICE)) if use_documents else None
    return {"kernel": kernel}, documents


def run(layer, x, rope, documents: Documents | None):
    """-> (y [B', T, dim], selected blocks [B', H_kv, T, n])."""
    return layer(x, rope, return_indices=True, documents=documents)


def row_documents(documents: Documents | None, b: int) -> Documents | None:
    return None if documents is None else Documents(documents.start[b : b + 1])


@torch.no_grad()
def test_rows_equal_to_the_shared_table_give_its_output(path):
    nsa_overrides, documents = path
    layer = nsa_layer(3, **nsa_overrides)
    x = make_input(B, T, seed=4)
    shared = tables(torch.arange(T))  # cos, sin [T, hd/2]
    rows = tuple(r.expand(B, T, -1) for r in shared)  # [B, T, hd/2], every row the shared table
    y_shared, idx_shared = run(layer, x, shared, documents)
    y_rows, idx_rows = run(layer, x, rows, documents)
    torch.testing.assert_close(y_rows, y_shared, rtol=0, atol=TOL)
    assert torch.equal(idx_rows, idx_shared)


@torch.no_grad()
def test_rows_that_differ_give_each_row_alone_and_are_not_mixed(path):
    nsa_overrides, documents = path
    layer = nsa_layer(5, **nsa_overrides)
    x = make_input(B, T, seed=6)
    positions = row_positions(documents)  # [B, T]
    rope = tables(positions)  # cos, sin [B, T, hd/2]
    y, idx = run(layer, x, rope, documents)
    for b in range(B):
        y_alone, idx_alone = run(layer, x[b : b + 1], row_of(rope, b), row_documents(documents, b))
        torch.testing.assert_close(y[b : b + 1], y_alone, rtol=0, atol=TOL, msg=f"row {b}")
        assert torch.equal(idx[b : b + 1], idx_alone), f"row {b}"
    bumped = positions.clone()
    bumped[1, T // 2 :] += 5  # row 1's positions jump mid-row: no shift of the old ones
    y_bumped, _ = run(layer, x, tables(bumped), documents)
    assert (y_bumped[1] - y[1]).abs().max() > 1e-6
    assert torch.equal(y_bumped[0], y[0]) and torch.equal(y_bumped[2], y[2])


@pytest.mark.parametrize("with_documents", [False, True], ids=["plain", "documents"])
@torch.no_grad()
def test_window_only_layer_takes_per_row_tables(with_documents):
    layer = nsa_layer(9, gates="window")
    x = make_input(B, T, seed=10)
    documents = Documents(starts_of(LAYOUTS).to(DEVICE)) if with_documents else None
    shared = tables(torch.arange(T))
    rows = tuple(r.expand(B, T, -1) for r in shared)
    torch.testing.assert_close(run(layer, x, rows, documents)[0], run(layer, x, shared, documents)[0],
                               rtol=0, atol=TOL)
    rope = tables(row_positions(documents))
    y, _ = run(layer, x, rope, documents)
    for b in range(B):
        y_alone, _ = run(layer, x[b : b + 1], row_of(rope, b), row_documents(documents, b))
        torch.testing.assert_close(y[b : b + 1], y_alone, rtol=0, atol=TOL, msg=f"row {b}")


def decode(layer, x, rope, chunks):
    """x's chunks through a cache (prefills of several tokens, decode steps of one), rope sliced per call (its T
    axis is -2): -> (y [B', T, dim], selected blocks [B', H_kv, T, n])."""
    cache, outs, idxs, t = layer.new_cache(), [], [], 0
    for n in chunks:
        y, idx = layer(x[:, t : t + n], tuple(r[..., t : t + n, :] for r in rope), cache, return_indices=True)
        outs.append(y)
        idxs.append(idx)
        t += n
    assert t == x.shape[1]
    return torch.cat(outs, 1), torch.cat(idxs, 2)


# chunks end mid compression block and mid selection block, so compressed keys are rotated at offsets into
# each call's table; two are decode steps (T = 1), one of which emits a compressed token
CHUNKS = [19, 1, 14, 1, 5]


@torch.no_grad()
def test_decode_cache_takes_per_row_tables():
    """The cache path's compressed keys are rotated before any kernel runs (the kernels see rotated keys only):
    the torch path stands for all."""
    layer = nsa_layer(11, kernel="torch")
    x = make_input(B, T, seed=12)
    shared = tables(torch.arange(T))
    rows = tuple(r.expand(B, T, -1) for r in shared)
    y_shared, idx_shared = decode(layer, x, shared, CHUNKS)
    y_rows, idx_rows = decode(layer, x, rows, CHUNKS)
    torch.testing.assert_close(y_rows, y_shared, rtol=0, atol=TOL)
    assert torch.equal(idx_rows, idx_shared)
    rope = tables(row_positions(None))
    y, idx = decode(layer, x, rope, CHUNKS)
    y_full, idx_full = layer(x, rope, return_indices=True)  # one prefill with the same tables
    torch.testing.assert_close(y, y_full, rtol=0, atol=TOL)
    assert torch.equal(idx, idx_full)
    for b in range(B):
        y_alone, idx_alone = decode(layer, x[b : b + 1], row_of(rope, b), CHUNKS)
        torch.testing.assert_close(y[b : b + 1], y_alone, rtol=0, atol=TOL, msg=f"row {b}")
        assert torch.equal(idx[b : b + 1], idx_alone), f"row {b}"


@pytest.mark.parametrize("backend", ["sdpa", "manual"])
@pytest.mark.parametrize("with_documents", [False, True], ids=["plain", "documents"])
@torch.no_grad()
def test_dense_attention_takes_per_row_tables(backend, with_documents):
    torch.manual_seed(13)
    cfg = ModelConfig(dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM, attn_backend=backend)
    layer = DenseAttention(cfg).double().to(DEVICE)
    x = make_input(B, T, seed=14)
    documents = Documents(starts_of(LAYOUTS).to(DEVICE)) if with_documents else None
    shared = tables(torch.arange(T))
    rows = tuple(r.expand(B, T, -1) for r in shared)
    torch.testing.assert_close(layer(x, rows, documents=documents), layer(x, shared, documents=documents),
                               rtol=0, atol=TOL)
    rope = tables(row_positions(documents))
    y = layer(x, rope, documents=documents)
    for b in range(B):
        y_alone = layer(x[b : b + 1], row_of(rope, b), documents=row_documents(documents, b))
        torch.testing.assert_close(y[b : b + 1], y_alone, rtol=0, atol=TOL, msg=f"row {b}")
    if not with_documents:  # the KV cache: x's chunks (prefills and decode steps) append to it
        cache, t, outs = KVCache(), 0, []
        for n in CHUNKS:
            outs.append(layer(x[:, t : t + n], tuple(r[:, t : t + n] for r in rope), cache))
            t += n
        torch.testing.assert_close(torch.cat(outs, 1), y, rtol=0, atol=TOL)
