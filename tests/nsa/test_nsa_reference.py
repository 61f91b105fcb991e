"""The vectorised NSA path against the per-token float64 reference (nsa/attention/reference.py)."""
from __future__ import annotations

import pytest
import torch

import nsa.attention.impl.partial as partial
import nsa.attention.impl.selection as selection
from nsa.attention.reference import reference_forward
from tests.nsa._nsa_helpers import DEVICE, T_VALUES, make_input, make_layer, rope_for, sorted_blocks

TOL = 1e-10


@pytest.fixture(params=["flash", "flash-expanded-heads", "matmul"])
def backend(request, monkeypatch):
    """Both selected-attention backends: PyTorch's CPU flash kernels and the portable matmul one; and the flash
    kernels given expanded key heads, as on a torch whose kernels cannot take grouped-query shapes (torch 2.7)."""
    if request.param.startswith("flash") and DEVICE.type != "cpu":
        pytest.skip("the flash-kernel backend is CPU only")
    monkeypatch.setattr(partial, "use_flash_kernels", request.param.startswith("flash"))
    if request.param == "flash-expanded-heads":
        monkeypatch.setattr(partial, "_flash_takes_gqa", lambda: False)
    return request.param


@pytest.mark.parametrize("T", T_VALUES)
def test_outputs_and_indices_match_reference(T):
    layer = make_layer()
    x, rope = make_input(2 if T <= 33 else 1, T), rope_for(T)
    with torch.no_grad():
        y, idx = layer(x, rope, return_indices=True)
        y_ref, idx_ref = reference_forward(layer, x, rope)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, y_ref.to(DEVICE), rtol=0, atol=TOL)
    assert torch.equal(sorted_blocks(idx).cpu(), idx_ref)


def _grads(layer, x, out, g):
    return torch.autograd.grad((out * g).sum(), [x, *layer.parameters()])


@pytest.mark.parametrize(
    "overrides",
    [{}, {"bias": True, "qk_norm": True}],
    ids=["plain", "bias+qk_norm"],
)
def test_gradients_match_reference(backend, overrides):
    T = 57  # 4 selection blocks: free (non-forced) picks exist from position 48 on
    layer = make_layer(seed=3, **overrides)
    x = make_input(1, T, seed=4).requires_grad_(True)
    rope = rope_for(T)
    y = layer(x, rope)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(5), dtype=y.dtype).to(DEVICE)
    y_ref, _ = reference_forward(layer, x, rope)
    torch.testing.assert_close(y, y_ref.to(DEVICE), rtol=0, atol=TOL)
    names = ["x"] + [name for name, _ in layer.named_parameters()]
    for name, a, b in zip(names, _grads(layer, x, y, g), _grads(layer, x, y_ref.to(DEVICE), g)):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, rtol=0, atol=TOL, msg=lambda m: f"{name}: {m}")


def test_without_rope_matches_reference():
    layer = make_layer(seed=6)
    x = make_input(1, 40, seed=7)
    with torch.no_grad():
        y, idx = layer(x, None, return_indices=True)
        y_ref, idx_ref = reference_forward(layer, x, None)
    torch.testing.assert_close(y, y_ref.to(DEVICE), rtol=0, atol=TOL)
    assert torch.equal(sorted_blocks(idx).cpu(), idx_ref)


@pytest.mark.parametrize("chunks", [dict(q_chunk=1, sel_chunk=1, sel_tile=1, win_block=1), dict(q_chunk=100, sel_chunk=100, sel_tile=64, win_block=100)])
def test_chunk_and_tile_sizes_do_not_change_results(chunks):
    T = 100
    x, rope = make_input(2, T), rope_for(T)
    with torch.no_grad():
        y0, i0 = make_layer(seed=2)(x, rope, return_indices=True)
        y1, i1 = make_layer(seed=2, nsa_overrides=chunks)(x, rope, return_indices=True)
    torch.testing.assert_close(y1, y0, rtol=0, atol=1e-12)
    assert torch.equal(i1, i0)


def test_gradients_match_reference_short_sequence_gathered_path():
    """T <= GATHER_MAX_QUERIES takes the query-centric (decode) selection path."""
    T = min(selection.GATHER_MAX_QUERIES, 16)
    layer = make_layer(seed=8)
    x = make_input(2, T, seed=9).requires_grad_(True)
    rope = rope_for(T)
    y, y_ref = layer(x, rope), reference_forward(layer, x, rope)[0].to(DEVICE)
    g = torch.randn_like(y)
    for a, b in zip(_grads(layer, x, y, g), _grads(layer, x, y_ref, g)):
        torch.testing.assert_close(a, b, rtol=0, atol=TOL)


@pytest.fixture(scope="module")
def tiled_reference():
    """The float64 per-token reference for the tile-batch tests, computed once: it depends on neither the
    tile batching nor the backend those tests vary (the reference is the slow part: loops over tokens)."""
    T = 100
    layer = make_layer(seed=10, nsa_overrides=dict(sel_tile=3))
    x = make_input(2, T, seed=11).requires_grad_(True)
    rope = rope_for(T)
    y_ref = reference_forward(layer, x, rope)[0].to(DEVICE)
    g = torch.randn_like(y_ref)
    return T, y_ref.detach(), g, [t.detach() for t in _grads(layer, x, y_ref, g)]


@pytest.mark.parametrize("batch_rows", [1, 40])
def test_tile_batches_merge_online_to_the_reference(backend, batch_rows, monkeypatch, tiled_reference):
    """Tiles run in batches with an online softmax merge; one tile per batch is the hardest case."""
    monkeypatch.setattr(selection, "TILE_BATCH_ROWS", batch_rows)
    T, y_ref, g, ref_grads = tiled_reference
    layer = make_layer(seed=10, nsa_overrides=dict(sel_tile=3))
    x = make_input(2, T, seed=11).requires_grad_(True)
    y = layer(x, rope_for(T))
    torch.testing.assert_close(y, y_ref, rtol=0, atol=TOL)
    for a, b in zip(_grads(layer, x, y, g), ref_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=TOL)
