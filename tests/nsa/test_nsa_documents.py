"""NSA on packed documents (issue 28): a packed window with document masking computes what each document
computes alone from position 0, outputs and parameter gradients (float64, 1e-10), on the torch path; the
per-token reference (spelling every mask out per query) agrees; another document's tokens change nothing.
The torch path has two implementations for packed documents (nsa/attention/ops.py picks by size): every
document at once through explicit masks (impl/masked.py) and one document at a time (impl/segments.py);
the `documents_path` fixture runs each test on both."""
from __future__ import annotations

import pytest
import torch

from nsa.attention.documents import Documents, compressed_layout
from nsa.attention.impl import masked
from nsa.attention.reference import reference_forward
from tests.nsa._nsa_helpers import DEVICE, make_input, make_layer, rope_for, sorted_blocks

TOL = 1e-10
# document lengths per row (l=8, d=4, l'=16, w=16): not multiples of any block size, shorter than one
# compression block (3, 5), one token (1), longer than several selection blocks (70), a row of one document
LAYOUTS = [[3, 21, 1, 70, 5], [53, 47]]


@pytest.fixture(params=["masked", "segments"])
def documents_path(request, monkeypatch):
    """The torch path's implementation for packed documents: masked.MAX_ELEMENTS = 0 sends every call to
    impl/segments.py; the default keeps these small problems on impl/masked.py."""
    if request.param == "segments":
        monkeypatch.setattr(masked, "MAX_ELEMENTS", 0)
    return request.param


def _starts(lengths_per_row) -> torch.Tensor:
    rows = []
    for lengths in lengths_per_row:
        starts = []
        for i, n in enumerate(lengths):
            starts += [sum(lengths[:i])] * n
        rows.append(starts)
    return torch.tensor(rows, device=DEVICE)


def _pieces(lengths):
    at = 0
    for n in lengths:
        yield at, n
        at += n


def _alone(layer, x, lengths_per_row, rope: bool):
    """Each document run by itself from position 0."""
    out = []
    for b, lengths in enumerate(lengths_per_row):
        row = [layer(x[b : b + 1, s : s + n], rope_for(n) if rope else None) for s, n in _pieces(lengths)]
        out.append(torch.cat(row, dim=1))
    return torch.cat(out)


def _doc_rope(docs: Documents):
    """RoPE at each token's position within its document: cos, sin [B, T, hd/2]."""
    T = docs.start.shape[1]
    cos, sin = rope_for(T)
    return cos[docs.positions], sin[docs.positions]


@pytest.mark.parametrize("rope", [True, False], ids=["rope", "no-rope"])
def test_packed_equals_alone_outputs_and_gradients(rope, documents_path):
    layer = make_layer(seed=5)
    T = 100
    x = make_input(2, T, seed=6).requires_grad_(True)
    docs = Documents(_starts(LAYOUTS))
    y = layer(x, _doc_rope(docs) if rope else None, documents=docs)
    alone = _alone(layer, x, LAYOUTS, rope)
    torch.testing.assert_close(y, alone, rtol=0, atol=TOL)
    g = torch.randn_like(y)
    params = [x, *layer.parameters()]
    grads = torch.autograd.grad((y * g).sum(), params)
    grads_alone = torch.autograd.grad((alone * g).sum(), params)
    for name, a, b in zip(["x", *[n for n, _ in layer.named_parameters()]], grads, grads_alone):
        torch.testing.assert_close(a, b, rtol=0, atol=TOL, msg=name)


def test_packed_matches_reference_with_documents(documents_path):
    layer = make_layer(seed=7)
    T = 100
    x, rope = make_input(2, T, seed=8), rope_for(T)
    start = _starts(LAYOUTS)
    docs = Documents(start)
    with torch.no_grad():
        y, idx = layer(x, _doc_rope(docs), return_indices=True, documents=docs)
        y_ref, idx_ref = reference_forward(layer, x, rope, doc_start=start)
    torch.testing.assert_close(y, y_ref.to(DEVICE), rtol=0, atol=TOL)
    assert torch.equal(sorted_blocks(idx).cpu(), idx_ref)


def test_no_leak_across_documents_by_perturbation(documents_path):
    """Changing every token of the other documents changes nothing for a query, exactly."""
    layer = make_layer(seed=9)
    T = 100
    x = make_input(2, T, seed=10)
    docs = Documents(_starts(LAYOUTS))
    rope = _doc_rope(docs)
    with torch.no_grad():
        y = layer(x, rope, documents=docs)
        for b, lengths in enumerate(LAYOUTS):
            for s, n in _pieces(lengths):
                x2 = x.clone()
                x2[b, :s] += torch.randn_like(x2[b, :s])
                x2[b, s + n :] += torch.randn_like(x2[b, s + n :])
                x2[1 - b] += 1.0  # the other row too
                y2 = layer(x2, rope, documents=docs)
                assert torch.equal(y2[b, s : s + n], y[b, s : s + n]), (b, s, n)


def test_one_document_is_exactly_todays_path(documents_path):
    """A window without EOS (one document) computes what the unmasked path computes: bit for bit one document at
    a time (the same calls), to rounding through the masks (one attention over all keys instead of bands)."""
    layer = make_layer(seed=11)
    T = 77
    x, rope = make_input(2, T, seed=12), rope_for(T)
    docs = Documents(torch.zeros(2, T, dtype=torch.long, device=DEVICE))
    with torch.no_grad():
        packed, plain = layer(x, rope, documents=docs), layer(x, rope)
    if documents_path == "segments":
        assert torch.equal(packed, plain)
    else:
        torch.testing.assert_close(packed, plain, rtol=0, atol=TOL)


def test_compressed_layout_counts_each_document_from_its_start():
    start = _starts([[3, 21, 1, 70, 5]])
    layout = compressed_layout(start, 8, 4)
    # documents of 21 and 70 tokens: (21-8)//4+1 = 4 and (70-8)//4+1 = 16 tokens; the others none
    assert layout.valid.sum().item() == 20
    assert layout.block_start[0, :4].tolist() == [3, 7, 11, 15]
    assert layout.block_start[0, 4:20].tolist() == [25 + 4 * j for j in range(16)]
    q_pos, k_base, c_base = layout.frame[:, 0]
    assert q_pos[24].item() == 0 and k_base[24].item() == 24 and c_base[25].item() == 4
