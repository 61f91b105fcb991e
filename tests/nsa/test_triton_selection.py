"""Triton selected-attention kernels (nsa/attention/kernels/selected_attention.py) against float64 references.

Without CUDA the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1
before anything imports the kernels). The interpreter is slow: sizes stay small (T <= 64).
References: an explicit dense-mask float64 attention built from the block indices, the portable torch
path (nsa/attention/impl/selection.py), and the per-token layer reference (nsa/attention/reference.py).
"""
from __future__ import annotations

import math
import sys

import pytest
import torch

import nsa.attention.kernels
from nsa.attention.impl.selection import select_blocks
from nsa.attention.ops import resolve_kernel, selected_attention
from nsa.attention.reference import reference_forward
from nsa.config import ModelConfigError, NSAConfig
from tests.nsa import _nsa_helpers as helpers
from tests.nsa._nsa_helpers import sorted_blocks

try:
    from tests.nsa.interpreter_probe import interpreter_loop_problem
    from nsa.attention.kernels import selected_attention as ts
except ImportError as exc:  # triton not installed (CUDA torch brings it; CPU machines: bootstrap installs it)
    pytest.skip(f"triton is not importable ({exc}); the Triton selection kernels are untested here", allow_module_level=True)
# compiled kernels on a CUDA machine (whatever NSA_TEST_DEVICE says), the interpreter elsewhere
DEV = torch.device("cuda") if torch.cuda.is_available() else helpers.DEVICE
if DEV.type == "cpu" and not ts.interpreter_active():
    pytest.skip("Triton's interpreter is off (TRITON_INTERPRET=1 must be set before the kernels are imported)",
                allow_module_level=True)
if reason := interpreter_loop_problem():  # tests/nsa/interpreter_probe.py: a Triton interpreter limit
    pytest.skip(reason, allow_module_level=True)

ATOL, RTOL = 2e-5, 1e-4  # fp32 against float64


def make_layer(seed: int, kernel: str, dtype=torch.float64):
    return helpers.make_layer(seed=seed, nsa_overrides=dict(kernel=kernel)).to(DEV, dtype)


def make_input(B: int, T: int, seed: int = 1, dtype=torch.float64):
    rope = tuple(r.to(DEV, dtype) for r in helpers.rope_for(T))
    return helpers.make_input(B, T, seed).to(DEV, dtype), rope


def dense_reference(q, k, v, block_idx, q_start: int, l_sel: int):
    """float64 attention with an explicit [Tq, Tk] mask per (batch, KV head): key s is visible to the
    query at position p iff block s // l' is among p's blocks and s <= p. Returns (out, lse)."""
    q, k, v = q.double(), k.double(), v.double()
    B, H_kv, G, Tq, hd = q.shape
    pos_k = torch.arange(k.shape[2], device=q.device)
    pos_q = q_start + torch.arange(Tq, device=q.device)
    chosen = (block_idx[..., None] == (pos_k // l_sel)).any(dim=-2)  # [B, H_kv, Tq, Tk]; -1 matches nothing
    mask = chosen & (pos_k[None, :] <= pos_q[:, None])
    s = torch.einsum("bhgtd,bhkd->bhgtk", q, k) / math.sqrt(hd)
    s = s.masked_fill(~mask[:, :, None], float("-inf"))
    return torch.einsum("bhgtk,bhkd->bhgtd", torch.softmax(s, dim=-1), v), torch.logsumexp(s, dim=-1)


def make_case(B, H_kv, G, Tq, hd, l_sel, n, q_start=0, dtype=torch.float32, shuffle=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    Tk = q_start + Tq
    q, k, v = (torch.randn(*shape, generator=g, dtype=dtype).to(DEV)
               for shape in ((B, H_kv, G, Tq, hd), (B, H_kv, Tk, hd), (B, H_kv, Tk, hd)))
    scores = torch.rand(B, H_kv, Tq, -(-Tk // l_sel), generator=g).to(DEV)
    idx = select_blocks(scores, q_start, l_sel, n)  # the layer's own selection, -1 = empty slot
    if shuffle:  # empty slots and blocks in any order
        idx = idx.gather(-1, torch.rand(idx.shape, generator=g).argsort(-1).to(DEV))
    return q, k, v, idx


def grads(fn, q, k, v, d_o):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), d_o.to(out.dtype)))


CASES = {  # B, H_kv, G, Tq, hd, l', n, q_start, shuffle
    "G1_T40": (1, 2, 1, 40, 16, 16, 4, 0, False),  # T not a multiple of l'
    "G4_batch2_free_picks": (2, 1, 4, 37, 16, 8, 4, 0, False),  # 5 blocks: non-forced picks exist
    "G6_hd24_shuffled": (1, 1, 6, 45, 24, 16, 4, 0, True),  # group and head dim padded; -1 anywhere
    "T_below_l_n16": (2, 1, 2, 11, 16, 16, 16, 0, False),  # one block, n far above the blocks available
    "chunk_q_start": (1, 2, 4, 19, 20, 8, 16, 21, False),  # queries at 21 .. 39 (a later chunk)
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_kernel_matches_dense_reference_and_torch_path(case, monkeypatch):
    monkeypatch.setattr(ts, "KV_TILE", 5)  # several dK/dV tiles per block, partial last tiles
    monkeypatch.setattr(ts, "BLOCK_ROWS", 16)  # several row steps per tile
    B, H_kv, G, Tq, hd, l_sel, n, q_start, shuffle = CASES[case]
    q, k, v, idx = make_case(B, H_kv, G, Tq, hd, l_sel, n, q_start, shuffle=shuffle)
    d_o = torch.randn(q.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64).to(DEV)

    out, lse = ts.selected_attention_fwd(q, k, v, idx, q_start, l_sel)  # the kernels without autograd
    tri = (out, *ts.selected_attention_bwd(q, k, v, idx, out, lse, d_o.float(), q_start, l_sel))
    ref = grads(lambda *t: dense_reference(*t, idx, q_start, l_sel)[0], q.double(), k.double(), v.double(), d_o)
    _, lse_ref = dense_reference(q, k, v, idx, q_start, l_sel)
    tor = grads(lambda *t: selected_attention(*t, idx, q_start, l_sel, 4, kernel="torch"), q, k, v, d_o)

    torch.testing.assert_close(lse.double(), lse_ref, atol=ATOL, rtol=RTOL)
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), tri, ref, tor):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a.double(), b, atol=ATOL, rtol=RTOL, msg=lambda m: f"{name} vs float64: {m}")
        torch.testing.assert_close(a, c, atol=ATOL, rtol=RTOL, msg=lambda m: f"{name} vs torch path: {m}")


def test_dkv_tiling_does_not_change_gradients_and_is_deterministic(monkeypatch):
    q, k, v, idx = make_case(1, 1, 2, 24, 16, 8, 4, seed=3)
    d_o = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).to(DEV)
    runs = {}
    for kv_tile in (1, 3, 1000):
        monkeypatch.setattr(ts, "KV_TILE", kv_tile)
        runs[kv_tile] = grads(lambda *t: ts.triton_selected_attention(*t, idx, 0, 8), q, k, v, d_o)
    again = grads(lambda *t: ts.triton_selected_attention(*t, idx, 0, 8), q, k, v, d_o)
    assert all(torch.equal(a, b) for a, b in zip(runs[1000], again))  # no atomics: bit-identical reruns
    for kv_tile in (1, 3):
        for a, b in zip(runs[kv_tile], runs[1000]):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.fixture
def triton_calls(monkeypatch):
    """Records every Triton forward launch: proves a layer test really ran the kernels."""
    calls, fwd = [], ts.selected_attention_fwd

    def counted(q, *args, **kwargs):
        calls.append((tuple(q.shape), q.dtype))
        return fwd(q, *args, **kwargs)

    monkeypatch.setattr(ts, "selected_attention_fwd", counted)
    return calls


def _layer_grads(layer, x, out, g):
    return torch.autograd.grad((out * g).sum(), [x, *layer.parameters()])


def test_layer_with_triton_kernel_matches_reference(triton_calls):
    """float64 layer (the kernels accumulate in fp64 then): outputs, indices and every gradient vs the
    per-token reference at 1e-10, indices identical to the torch path. T = 57: free picks from 48 on.
    The Triton path takes every query in one launch (sel_chunk bounds only the torch path's buffers)."""
    T = 57
    layer = make_layer(3, "triton")
    x, rope = make_input(1, T, seed=4)
    x.requires_grad_(True)
    y, idx = layer(x, rope, return_indices=True)
    y_ref, idx_ref = reference_forward(layer, x, rope)
    assert [shape[3] for shape, _ in triton_calls] == [57]  # one op per layer: all queries in one call
    torch.testing.assert_close(y, y_ref.to(DEV), rtol=0, atol=1e-10)
    assert torch.equal(sorted_blocks(idx).cpu(), idx_ref)
    layer.cfg.kernel = "torch"
    with torch.no_grad():
        _, idx_torch = layer(x, rope, return_indices=True)
    assert torch.equal(idx, idx_torch)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(5), dtype=y.dtype).to(DEV)
    names = ["x"] + [name for name, _ in layer.named_parameters()]
    for name, a, b in zip(names, _layer_grads(layer, x, y, g), _layer_grads(layer, x, y_ref.to(DEV), g)):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("T", [5, 40])  # 5 < l: no compressed token yet, one selection block
def test_layer_fp32_triton_close_to_reference(T, triton_calls):
    layer = make_layer(6, "triton", torch.float32)
    x, rope = make_input(2, T, seed=7, dtype=torch.float32)
    with torch.no_grad():
        y = layer(x, rope)
        y_ref, _ = reference_forward(layer, x, rope)
    assert triton_calls and all(dtype == torch.float32 for _, dtype in triton_calls)
    torch.testing.assert_close(y.double(), y_ref.to(DEV), rtol=RTOL, atol=ATOL)


def test_future_tokens_change_no_earlier_output(triton_calls):
    """Perturb every token after t: outputs and indices up to t are bit-identical, and the gradient of
    the outputs up to t w.r.t. later inputs (through the Triton backward kernels) is exactly zero."""
    T, t = 50, 33
    layer = make_layer(12, "triton", torch.float32)
    x, rope = make_input(1, T, seed=13, dtype=torch.float32)
    x2 = x.clone()
    x2[:, t + 1 :] += torch.randn(x2[:, t + 1 :].shape, generator=torch.Generator().manual_seed(14)).to(DEV)
    with torch.no_grad():
        y1, i1 = layer(x, rope, return_indices=True)
        y2, i2 = layer(x2, rope, return_indices=True)
    assert torch.equal(y1[:, : t + 1], y2[:, : t + 1])
    assert torch.equal(i1[:, :, : t + 1], i2[:, :, : t + 1])
    assert not torch.equal(y1[:, t + 1 :], y2[:, t + 1 :])
    xg = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(layer(xg, rope)[:, : t + 1].square().sum(), xg)
    assert torch.count_nonzero(grad[:, t + 1 :]) == 0
    assert torch.count_nonzero(grad[:, : t + 1]) > 0
    assert len(triton_calls) == 3  # 3 forwards, one kernel call each


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_bf16_autocast_close_to_float64_reference(kernel, triton_calls):
    """Under CPU autocast (bf16 matmuls) the layer stays within 1% relative RMS of the float64 reference
    of its fp32 parameters. The Triton kernels in the interpreter upcast bf16 operands right before
    each dot (after the same roundings a GPU run makes). CUDA bf16: tests/nsa/test_nsa_gpu.py."""
    if DEV.type != "cpu":
        pytest.skip("CPU autocast")
    T = 64
    layer = make_layer(11, kernel, torch.float32)
    x, rope = make_input(1, T, dtype=torch.float32)
    xg = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(xg, rope)
    with torch.no_grad():
        ref, _ = reference_forward(layer, x, rope)
    rel_rms = ((y.double() - ref).square().mean().sqrt() / ref.square().mean().sqrt()).item()
    assert rel_rms < 1e-2, rel_rms
    assert [dtype for _, dtype in triton_calls] == ([torch.bfloat16] if kernel == "triton" else [])
    y.float().square().sum().backward()
    assert torch.isfinite(xg.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters())


def test_kernel_switch(monkeypatch):
    with pytest.raises(ModelConfigError, match="nsa.kernel='cuda'; valid: auto, triton, torch"):
        NSAConfig(kernel="cuda").validate()
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_kernel("auto", cpu) == "torch" and resolve_kernel("torch", cuda) == "torch"
    assert resolve_kernel("auto", cuda) == "triton"
    if ts.interpreter_active():
        assert resolve_kernel("triton", cpu) == "triton"
    monkeypatch.setattr(ts, "interpreter_active", lambda: False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        resolve_kernel("triton", cpu)
    monkeypatch.setitem(sys.modules, "nsa.attention.kernels.selected_attention", None)  # as if triton were missing
    monkeypatch.delattr(nsa.attention.kernels, "selected_attention")
    with pytest.raises(RuntimeError, match="needs the triton package"):
        resolve_kernel("triton", cuda)
    assert resolve_kernel("auto", cuda) == "torch"
