"""The Triton kernels with document frames (nsa/attention/documents.py): packed equals alone.

A frame [3, B, Tq] (q_pos, k_base, c_base) tells fused_select_blocks and selected_attention_fwd / _bwd
where each query's document lives. Packed windows of random documents (lengths no multiple of any
block size, documents shorter than one compression block, documents starting mid-window, two rows
with different layouts, GQA groups of 2 and 3) in float64 must give:
  (a) what each document gives alone through the same kernels without a frame (q_start = 0, keys and
      compressed tokens sliced to the document): block indices exactly, o / lse / dq / dk / dv to 1e-10,
      on both forward / dQ paths (SELECTION_PATH "query" and "block"; dK/dV is shared);
  (b) what the torch path (impl/block_select.select_by_score, impl/selection.selected_attention_fwd /
      _bwd) gives per document;
  (c) nothing a document reads changes when the keys, values and compressed tokens of the other
      documents change (exactly), while theirs do.
Triton's interpreter without CUDA (tests/conftest.py); shapes stay tiny (the interpreter is slow).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from nsa.attention.documents import compressed_layout, plain_frame
from nsa.attention.impl import selection
from nsa.attention.impl.block_select import select_by_score
from nsa.attention.impl.compression import num_compressed

try:
    from tests.nsa.interpreter_probe import interpreter_loop_problem
    from nsa.attention.kernels import selected_attention as ts
    from nsa.attention.kernels.select_topk import fused_select_blocks
except ImportError as exc:  # triton not installed
    pytest.skip(f"triton is not importable ({exc})", allow_module_level=True)

DEV = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
if DEV.type == "cpu" and not ts.interpreter_active():
    pytest.skip("Triton's interpreter is off (TRITON_INTERPRET=1 must be set before triton is imported)",
                allow_module_level=True)
if reason := interpreter_loop_problem():  # tests/nsa/interpreter_probe.py: a Triton interpreter limit
    pytest.skip(reason, allow_module_level=True)

ATOL = 1e-10  # float64
HD = 16
L, D = 8, 4  # compression block and stride
Q_TILE, KV_TILE = 8, 16  # small tiles: a block's queries span several tiles, a tile several documents
CASES = {  # H_kv, G, l', n, document lengths of row 0 and row 1 (T = their sum)
    # l' = 8: documents of 37, 31 and 51 tokens have free picks (n - 3 = 1 place)
    "G2_lsel8_n4": (1, 2, 8, 4, ([5, 37, 3, 31, 14], [51, 2, 7, 30])),
    # l' = 12 (padded to 16 keys per block tile): a 70-token document has 6 blocks for n = 5 places
    "G3_lsel12_n5": (1, 3, 12, 5, ([9, 39, 6, 25, 11], [3, 70, 17])),
}


def window_starts(lengths: tuple[list[int], ...]) -> torch.Tensor:
    """[B, T] int64: each token's document start (documents.document_starts' output) for these lengths."""
    rows = []
    for lens in lengths:
        firsts = torch.tensor([0, *lens[:-1]]).cumsum(0)
        rows.append(torch.repeat_interleave(firsts, torch.tensor(lens)))
    return torch.stack(rows)


def documents(lengths) -> list[tuple[int, int, int]]:
    """(row, first token, length) of every document."""
    out = []
    for b, lens in enumerate(lengths):
        first = 0
        for n_tok in lens:
            out.append((b, first, n_tok))
            first += n_tok
    return out


def make_inputs(H_kv: int, G: int, lengths, seed: int):
    """float64 q [B, H_kv, G, T, hd], k, v [B, H_kv, T, hd], d_o like q, the compressed keys ck [B, H_kv,
    C, hd] (slot i: the mean of the l keys from block_start[b, i], 0 in unused slots, so a document's
    slots hold what it alone has at its positions 0 .. count-1) and the window's frame [3, B, T]."""
    start = window_starts(lengths)
    B, T = start.shape
    layout = compressed_layout(start, L, D)
    g = torch.Generator().manual_seed(seed)
    q = 2 * torch.randn(B, H_kv, G, T, HD, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, H_kv, T, HD, generator=g, dtype=torch.float64) for _ in range(2))
    d_o = torch.randn(q.shape, generator=g, dtype=torch.float64)
    ck = compress(k, layout)
    return [t.to(DEV) for t in (q, k, v, d_o, ck, layout.frame)] + [layout]


def compress(k: torch.Tensor, layout) -> torch.Tensor:
    """k [B, H_kv, T, hd] -> [B, H_kv, C, hd]: the mean of each slot's block of l keys (0 if unused)."""
    T = k.shape[2]
    rows = (layout.block_start[:, :, None] + torch.arange(L)).clamp_max(T - 1)  # [B, C, l]
    blocks = torch.stack([k[b][:, rows[b].to(k.device)] for b in range(k.shape[0])])  # [B, H_kv, C, l, hd]
    return blocks.mean(3) * layout.valid[:, None, :, None].to(k.device)


def run_kernels(path, q, k, v, d_o, ck, l_sel, n, frame, q_start=0, q_tile=Q_TILE, kv_tile=KV_TILE, idx=None):
    """Block selection (unless idx is given), then selected attention forward and backward:
    (idx, o, lse, dq, dk, dv)."""
    ts.SELECTION_PATH = path  # restored by the autouse fixture
    if idx is None:
        idx = fused_select_blocks(q, ck, q_start, L, D, l_sel, n, frame=frame)
    o, lse = ts.selected_attention_fwd(q, k, v, idx, q_start, l_sel, q_tile=q_tile, frame=frame)
    grads = ts.selected_attention_bwd(q, k, v, idx, o, lse, d_o, q_start, l_sel, kv_tile=kv_tile, q_tile=q_tile,
                                      frame=frame)
    return (idx, o, lse, *grads)


def run_torch(q, k, v, d_o, ck, l_sel, n):
    """The torch path on one document alone: (idx, o, lse, dq, dk, dv)."""
    idx = select_by_score(q, ck, 0, L, D, l_sel, n, q_chunk=16)
    o, lse = selection.selected_attention_fwd(q, k, v, idx, 0, l_sel, 16, 128)
    return (idx, o, lse, *selection.selected_attention_bwd(d_o, q, k, v, idx, o, lse, 0, l_sel, 16, 128))


def doc_parts(b: int, first: int, n_tok: int, c_base: int, count: int):
    """Index tuples of one document in (idx, o, lse, dq, dk, dv) and in the inputs."""
    rows, t = slice(b, b + 1), slice(first, first + n_tok)
    q_like = (rows, slice(None), slice(None), t)
    k_like = (rows, slice(None), t)
    outputs = ((rows, slice(None), t), q_like, q_like, q_like, k_like, k_like)
    return outputs, q_like, k_like, (rows, slice(None), slice(c_base, c_base + count))


NAMES = ("idx", "o", "lse", "dq", "dk", "dv")


def assert_same(got, want, where: str):
    for name, a, b in zip(NAMES, got, want):
        if name == "idx":
            assert torch.equal(a, b), f"{where}: block indices differ"
        else:
            assert a.dtype == b.dtype and torch.isfinite(a).all(), (where, name)
            torch.testing.assert_close(a, b, rtol=0, atol=ATOL, msg=lambda m: f"{where}, {name}: {m}")


@pytest.fixture(autouse=True)
def _restore_path(monkeypatch):
    monkeypatch.setattr(ts, "SELECTION_PATH", ts.SELECTION_PATH)


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_packed_equals_each_document_alone(case, monkeypatch):
    H_kv, G, l_sel, n, lengths = CASES[case]
    if l_sel > 8:  # dK/dV programs of 8 keys (grid axis 1): their stores must not overlap across documents
        config = ts.tile_config
        monkeypatch.setattr(ts, "tile_config", lambda kernel, *a: dataclasses.replace(config(kernel, *a), keys=8)
                            if kernel == "dkv" else config(kernel, *a))
    q, k, v, d_o, ck, frame, layout = make_inputs(H_kv, G, lengths, seed=len(case))
    _covers_the_hard_layouts(frame, lengths, l_sel, n, q_tile=Q_TILE)
    idx = fused_select_blocks(q, ck, 0, L, D, l_sel, n, frame=frame)  # the same for both paths
    packed = {path: run_kernels(path, q, k, v, d_o, ck, l_sel, n, frame, idx=idx) for path in ("query", "block")}
    for b, first, n_tok in documents(lengths):
        count = num_compressed(n_tok, L, D)
        outs, qs, ks, cs = doc_parts(b, first, n_tok, int(layout.frame[2, b, first]), count)
        alone_in = (q[qs], k[ks], v[ks], d_o[qs], ck[cs])
        reference = run_torch(*alone_in, l_sel, n)
        alone_idx = fused_select_blocks(q[qs], ck[cs], 0, L, D, l_sel, n)
        for path, got in packed.items():
            where = f"{case} row {b} document at {first} (length {n_tok}), {path} path"
            mine = [t[s] for t, s in zip(got, outs)]
            alone = run_kernels(path, *alone_in, l_sel, n, None, idx=alone_idx)
            assert_same(mine, alone, where + " vs alone")
            assert_same(mine, reference, where + " vs torch path")


def _covers_the_hard_layouts(frame, lengths, l_sel: int, n: int, q_tile: int):
    """The layout exercises what a frame changes: documents shorter than l, starts not aligned to l',
    lengths no multiple of l, d or l'."""
    lens = [x for row in lengths for x in row]
    assert min(lens) < L and all(x % D and x % l_sel for x in lens)
    assert (frame[1] % l_sel != 0).any()
    assert len(set(map(tuple, lengths))) == len(lengths)  # rows differ


def test_block_centric_tiles_hold_several_documents():
    """With frames the block-centric index keys blocks by their first key: a tile's entries then come
    from several documents (runs of equal offsets), which the kernels walk one by one."""
    H_kv, G, l_sel, n, lengths = CASES["G3_lsel12_n5"]
    q, k, v, d_o, ck, frame, _ = make_inputs(H_kv, G, lengths, seed=1)
    idx = fused_select_blocks(q, ck, 0, L, D, l_sel, n, frame=frame)
    index = ts.slot_index(idx.to(torch.int32), q.shape[3], l_sel, Q_TILE, frame)
    _, offs, _, _, tile_start, tile_count, *_ = ts._slot_index(index, q.shape[3], l_sel, n)
    runs = [len(set(offs[s:s + c].tolist())) for s, c in zip(tile_start.tolist(), tile_count.tolist()) if c]
    assert max(runs) >= 2
    home, off = ts._block_keys(idx, l_sel, q.shape[3], frame)
    assert ((off > 0) & (idx >= 0)).any()


def test_other_documents_change_nothing():
    """Perturb the keys, values and compressed tokens of every other document (both rows): the kept
    document's block indices, outputs, log-sum-exps and all gradients of its queries and keys are
    bit-identical, while the other documents' change. Two KV heads; the block-centric path, whose tiles
    mix documents (the query-centric programs read one query each); tiles large enough to hold a whole
    block's queries, so the kept document's rows are grouped alike in both runs."""
    _, G, l_sel, n, lengths = CASES["G2_lsel8_n4"]
    q, k, v, d_o, ck, frame, layout = make_inputs(2, G, lengths, seed=5)
    b, first, n_tok = 0, 45, 31  # row 0's fourth document, from window index 45 (not aligned to l' = 8)
    keep = torch.zeros(q.shape[0], q.shape[3], dtype=torch.bool, device=DEV)
    keep[b, first:first + n_tok] = True
    c_keep = torch.zeros(ck.shape[0], ck.shape[2], dtype=torch.bool, device=DEV)
    c_base = int(layout.frame[2, b, first])
    c_keep[b, c_base:c_base + num_compressed(n_tok, L, D)] = True
    g = torch.Generator().manual_seed(6)
    k2, v2 = (torch.where(keep[:, None, :, None], t, t + torch.randn(t.shape, generator=g, dtype=t.dtype).to(DEV))
              for t in (k, v))
    ck2 = torch.where(c_keep[:, None, :, None], ck, 5 * torch.randn(ck.shape, generator=g, dtype=ck.dtype).to(DEV))
    outs, *_ = doc_parts(b, first, n_tok, 0, 0)
    base = run_kernels("block", q, k, v, d_o, ck, l_sel, n, frame, q_tile=64, kv_tile=512)
    other = run_kernels("block", q, k2, v2, d_o, ck2, l_sel, n, frame, q_tile=64, kv_tile=512)
    for name, a, c, s in zip(NAMES, base, other, outs):
        assert torch.equal(a[s], c[s]), f"{name} of the kept document changed"
        assert not torch.equal(a, c), f"{name} of the other documents did not change"


def test_one_document_frame_equals_q_start():
    """plain_frame (one document, queries at q_start ..) gives what q_start gives without a frame: a
    later chunk of queries against all keys so far, exactly, on both paths."""
    B, H_kv, G, Tq, q_start, l_sel, n = 1, 1, 2, 19, 21, 8, 5
    g = torch.Generator().manual_seed(3)
    q = 2 * torch.randn(B, H_kv, G, Tq, HD, generator=g, dtype=torch.float64).to(DEV)
    k, v = (torch.randn(B, H_kv, q_start + Tq, HD, generator=g, dtype=torch.float64).to(DEV) for _ in range(2))
    d_o = torch.randn(q.shape, generator=g, dtype=torch.float64).to(DEV)
    ck = torch.randn(B, H_kv, num_compressed(q_start + Tq, L, D), HD, generator=g, dtype=torch.float64).to(DEV)
    frame = plain_frame(B, Tq, q_start, DEV)
    for path in ("query", "block"):
        with_frame = run_kernels(path, q, k, v, d_o, ck, l_sel, n, frame)
        without = run_kernels(path, q, k, v, d_o, ck, l_sel, n, None, q_start=q_start)
        for name, a, c in zip(NAMES, with_frame, without):
            assert torch.equal(a, c), f"{path} path: {name}"


def test_rejects_a_malformed_frame():
    H_kv, G, l_sel, n, lengths = CASES["G2_lsel8_n4"]
    q, k, v, d_o, ck, frame, _ = make_inputs(H_kv, G, lengths, seed=0)
    idx = torch.zeros(*q.shape[:2], q.shape[3], n, dtype=torch.long, device=DEV)
    for bad in (frame[:, :1], frame.int(), frame[:2]):
        with pytest.raises(ValueError, match="frame"):
            fused_select_blocks(q, ck, 0, L, D, l_sel, n, frame=bad)
        with pytest.raises(ValueError, match="frame"):
            ts.selected_attention_fwd(q, k, v, idx, 0, l_sel, frame=bad)
