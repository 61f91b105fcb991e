"""nsa::compress_blocks (nsa/attention/ops.py), phi for keys and values: the torch path is the BlockCompressor modules'
computation bit for bit (the same code); the Triton kernels (kernels/compress_blocks.py, Triton's interpreter on CPU)
equal it to float64 rounding in float64, and in bfloat16 are no further from a float64 oracle than the torch path
itself; a raw row moves exactly the tokens whose blocks cover it; packed documents' unused slots are zero and move
nothing."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from nsa.attention import ops
from nsa.attention.compressor import BlockCompressor
from nsa.attention.documents import compressed_layout
from nsa.attention.impl.compression import compress, gather_blocks
from tests.nsa._nsa_helpers import KERNEL_DEVICE, kernels_unavailable

L, D, HD = 8, 4, 16
B, H, R = 2, 2, 45


def _phis(bias: bool, seed: int = 0, dtype=torch.float64):
    torch.manual_seed(seed)
    pk, pv = BlockCompressor(L, HD, bias), BlockCompressor(L, HD, bias)
    with torch.no_grad():  # larger than the init, so the MLP part matters beside the mean
        for p in (*pk.parameters(), *pv.parameters()):
            p.normal_(0, 0.3)
    return pk.to(dtype), pv.to(dtype)


def _raw(seed: int = 1, dtype=torch.float64):
    """Raw keys and values as the layer's projection makes them: strided views of one [B, R, 2, H, HD] tensor."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(B, R, 2, H, HD, generator=g, dtype=torch.float64).to(dtype).permute(2, 0, 3, 1, 4)
    return kv[0], kv[1]


def _packed_layout():
    start = torch.tensor([[0] * 20 + [20] * 3 + [23] * 22, [0] * R])  # documents of 20, 3 (no block) and 22; one of 45
    return compressed_layout(start, L, D)


def _to(layout, dev):
    return dataclasses.replace(layout, **{f.name: getattr(layout, f.name).to(dev) for f in dataclasses.fields(layout)
                                          if torch.is_tensor(getattr(layout, f.name))})


def _run(kernel, raw_k, raw_v, pk, pv, lo, count, layout=None, use_v=True, seed=2, dev=torch.device("cpu"), fn=None):
    """Outputs and every gradient (zeros where autograd leaves None) for a fixed random output gradient (zero on a
    layout's unused slots). fn(rk, rv, pk, pv) -> ck, cv replaces the op."""
    rk, rv = (t.detach().to(dev).clone().requires_grad_(True) for t in (raw_k, raw_v))
    pk, pv = pk.to(dev), pv.to(dev)
    layout = _to(layout, dev) if layout is not None else None
    for p in (*pk.parameters(), *pv.parameters()):
        p.grad = None
    if fn is None:
        ck, cv = ops.compress_blocks(rk, rv, pk.weights(), pv.weights(), lo, count, L, D, kernel, layout)
    else:
        ck, cv = fn(rk, rv, pk, pv)
    g = torch.Generator().manual_seed(seed)
    dk, dv = (torch.randn(ck.shape, generator=g, dtype=torch.float64).to(dev, ck.dtype) for _ in range(2))
    if layout is not None:
        seen = layout.valid[:, None, :, None]
        dk, dv = dk * seen, dv * seen
    ((ck * dk).sum() + ((cv * dv).sum() if use_v else 0)).backward()
    leaves = [rk, rv, *pk.parameters(), *pv.parameters()]
    return [ck.detach(), cv.detach()] + [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]


@pytest.mark.parametrize("bias", [False, True])
def test_torch_path_is_the_modules_computation(bias):
    pk, pv = _phis(bias)
    raw_k, raw_v = _raw()
    lo, count = 3, (R - 3 - L) // D + 1
    got = _run("torch", raw_k, raw_v, pk, pv, lo, count)
    # the layer's code before the op: the modules over strided blocks (compress) or gathered ones (packed documents)
    want = _run(None, raw_k, raw_v, pk, pv, lo, count, fn=lambda rk, rv, pk_, pv_: (
        compress(pk_, rk, -lo, 0, count, L, D), compress(pv_, rv, -lo, 0, count, L, D)))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    layout = _packed_layout()
    got = _run("torch", raw_k, raw_v, pk, pv, 0, R // D, layout)
    want = _run(None, raw_k, raw_v, pk, pv, 0, R // D, layout, fn=lambda rk, rv, pk_, pv_: (
        pk_(gather_blocks(rk, layout.block_rows, L)), pv_(gather_blocks(rv, layout.block_rows, L))))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


DEV = KERNEL_DEVICE
UNAVAILABLE = kernels_unavailable("compress_blocks")
needs_kernels = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))
NAMES = ["ck", "cv", "d_raw_k", "d_raw_v"]


def _assert_close_to(got, want, tol, what):
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape, (what, i)
        torch.testing.assert_close(a.cpu(), b.cpu(), atol=tol, rtol=tol, msg=f"{what} #{i}")


@needs_kernels
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_kernels_equal_the_torch_path_in_float64(bias, packed):
    pk, pv = _phis(bias, seed=3)
    raw_k, raw_v = _raw(seed=4)
    layout = _packed_layout() if packed else None
    lo, count = (0, R // D) if packed else (5, (R - 5 - L) // D + 1)
    want = _run("torch", raw_k, raw_v, pk, pv, lo, count, layout)
    got = _run("triton", raw_k, raw_v, pk, pv, lo, count, layout, dev=DEV)
    if packed:  # the op's unused slots are zero (the modules compute phi of clamped rows there; no query reads them)
        seen = layout.valid[:, None, :, None]
        assert torch.equal(got[0].cpu() * ~seen, torch.zeros_like(got[0].cpu()))
        want[:2] = [w * seen for w in want[:2]]
    _assert_close_to(got, want, 1e-11, "triton vs torch")


@needs_kernels
def test_only_keys_used():
    """The values' output unused: its gradient is not materialised (None into the backward); the values' inputs get
    zero gradients."""
    pk, pv = _phis(True, seed=5)
    raw_k, raw_v = _raw(seed=6)
    want = _run("torch", raw_k, raw_v, pk, pv, 0, (R - L) // D + 1, use_v=False)
    got = _run("triton", raw_k, raw_v, pk, pv, 0, (R - L) // D + 1, use_v=False, dev=DEV)
    _assert_close_to(got, want, 1e-11, "keys only")
    assert not got[3].any() and not any(g.any() for g in got[-5:])


@needs_kernels
def test_bfloat16_kernels_no_further_from_float64_than_the_torch_path():
    """bf16 inputs and parameters: every output and gradient's mean error against float64 on the same (rounded)
    numbers. The kernels keep float32 between the dots where torch rounds each op to bf16, so they are no worse;
    except that Triton's interpreter truncates float32 -> bf16 casts (round-to-nearest on a GPU: half the values
    differ, 2-2.5x the mean error), hence the wider bound there."""
    bound = 3.0 if DEV.type == "cpu" else 1.25
    pk, pv = (copy.deepcopy(p).to(torch.bfloat16) for p in _phis(True, seed=7))
    raw = [t.to(torch.bfloat16) for t in _raw(seed=8)]
    count = (R - L) // D + 1
    exact = _run("torch", *(t.double() for t in raw), copy.deepcopy(pk).double(), copy.deepcopy(pv).double(), 0, count)
    torch_bf = _run("torch", *raw, pk, pv, 0, count)
    kern_bf = _run("triton", *raw, pk, pv, 0, count, dev=DEV)
    for i, (e, t, k) in enumerate(zip(exact, torch_bf, kern_bf)):
        assert k.dtype == t.dtype == torch.bfloat16, i
        err_torch = (t.double() - e).abs().mean() / e.abs().mean()
        err_kern = (k.cpu().double() - e).abs().mean() / e.abs().mean()
        assert err_kern <= bound * err_torch + 1e-4, (i, err_kern.item(), err_torch.item())


@needs_kernels
def test_a_raw_row_moves_exactly_the_tokens_covering_it():
    pk, pv = _phis(False, seed=9)
    raw_k, raw_v = (t.to(DEV) for t in _raw(seed=10))
    lo, count = 2, (R - 2 - L) // D + 1
    base = ops.compress_blocks(raw_k, raw_v, pk.to(DEV).weights(), pv.to(DEV).weights(), lo, count, L, D, "triton")
    for p in (0, lo, lo + D + 1, R - 1, lo + (count - 1) * D + L - 1):
        for which in (0, 1):
            moved = [raw_k.clone(), raw_v.clone()]
            moved[which][:, :, p] += 1.0
            out = ops.compress_blocks(*moved, pk.weights(), pv.weights(), lo, count, L, D, "triton")
            changed = (out[which] != base[which]).any(-1).any(1).any(0).cpu()  # [count]
            covers = torch.tensor([lo + i * D <= p < lo + i * D + L for i in range(count)])
            assert torch.equal(changed, covers), (p, which)
            assert torch.equal(out[1 - which], base[1 - which])
    grads = _run("triton", raw_k, raw_v, pk, pv, lo, count, dev=DEV)
    covered = torch.zeros(R, dtype=torch.bool)
    for i in range(count):
        covered[lo + i * D: lo + i * D + L] = True
    for d_raw in grads[2:4]:
        rows_moved = d_raw.abs().sum((0, 1, 3)).cpu() != 0
        assert torch.equal(rows_moved, covered)


@needs_kernels
def test_unused_slots_move_nothing():
    """A packed layout's unused slots: any output gradient there leaves every input's gradient unchanged."""
    pk, pv = _phis(True, seed=11)
    raw_k, raw_v = _raw(seed=12)
    layout = _packed_layout()
    assert not layout.valid.all()
    lay = _to(layout, DEV)
    rk, rv = (t.to(DEV).requires_grad_(True) for t in (raw_k, raw_v))
    weights = [p.to(DEV).requires_grad_(True) for p in (*pk.weights(), *pv.weights())]
    ck, cv = ops.compress_blocks(rk, rv, weights[:5], weights[5:], 0, R // D, L, D, "triton", lay)
    g = torch.Generator().manual_seed(13)
    d = torch.randn(ck.shape, generator=g, dtype=torch.float64).to(DEV)
    unused = (~lay.valid)[:, None, :, None]
    first = torch.autograd.grad((ck * d).sum() + (cv * d).sum(), [rk, rv, *weights], retain_graph=True)
    d2 = torch.where(unused, 7.0, d)
    second = torch.autograd.grad((ck * d2).sum() + (cv * d2).sum(), [rk, rv, *weights])
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@needs_kernels
def test_compress_blocks_op_passes_opcheck():
    pk, pv = _phis(True, seed=14)
    raw_k, raw_v = (t.to(DEV).requires_grad_(True) for t in _raw(seed=15))
    weights = [p.detach().to(DEV).requires_grad_(True) for p in (*pk.weights(), *pv.weights())]
    count = (R - L) // D + 1
    torch.library.opcheck(ops._compress_blocks.op, (raw_k, raw_v, *weights, 0, count, L, D, None, None, None))


def _layer_outputs(layer, x, rope, documents=None):
    xg = x.clone().requires_grad_(True)
    y = layer(xg, rope, documents=documents)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(21), dtype=y.dtype).to(y.device)
    return [y.detach(), *torch.autograd.grad((y * g).sum(), [xg, *layer.parameters()])]


@needs_kernels
def test_layer_with_packed_documents_matches_the_torch_path():
    """The layer's packed-documents path with the Triton kernels (phi over the layout's slots, its backward through
    the documents' frame) equals the torch path (itself each document alone: test_nsa_documents) in float64,
    output and every gradient, phi's parameters included."""
    from nsa.attention.documents import Documents
    from tests.nsa._nsa_helpers import make_input, make_layer, rope_for, starts_of

    layer = make_layer(31, n_heads=2, n_kv_heads=1)
    documents = Documents(starts_of([[13, 27], [40], [20, 1, 19]]).to(layer.compress_k.pos_enc.device))
    x, rope = make_input(3, 40, seed=32), rope_for(40)
    pos = documents.positions
    rope = tuple(r[pos] for r in rope)  # positions restart in every document: [B, T, hd/2]
    layer.cfg.kernel = "torch"
    want = _layer_outputs(layer, x, rope, documents)
    layer.cfg.kernel = "triton"
    got = _layer_outputs(layer, x, rope, documents)
    names = ["y", "x"] + [name for name, _ in layer.named_parameters()]
    assert "compress_k.fc_in.weight" in names
    for name, a, b in zip(names, got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=lambda m: f"{name}: {m}")


@needs_kernels
def test_chunked_prefill_and_decode_with_the_kernels_equal_one_prefill():
    """The cache path emits compressed tokens from raw rows offset by the cache (lo > 0 and blocks straddling two
    calls): chunks of 7 then single tokens give the one-call output."""
    from tests.nsa._nsa_helpers import make_input, make_layer, rope_for

    layer = make_layer(33, {"kernel": "triton"}, n_heads=2, n_kv_heads=1)
    T = 37
    x, rope = make_input(1, T, seed=34), rope_for(T)
    with torch.no_grad():
        full = layer(x, rope)
        cache, outs, t = layer.new_cache(), [], 0
        for size in (7, 7, 7) + (1,) * (T - 21):
            outs.append(layer(x[:, t:t + size], tuple(r[t:t + size] for r in rope), cache=cache))
            t += size
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=0, atol=1e-10)


@needs_kernels
def test_head_dims_beyond_the_kernels_tiles_take_the_torch_path():
    """The kernels hold [hd, hd] weight tiles in registers (MAX_HEAD_DIM = 64): a larger head dim runs phi's torch ops
    even with kernel="triton", the same numbers as kernel="torch"."""
    from nsa.attention.kernels import compress_blocks as kernels

    assert kernels.fits(64) and not kernels.fits(80)
    torch.manual_seed(16)
    pk, pv = (BlockCompressor(L, 80, False).double().to(DEV) for _ in range(2))
    kv = torch.randn(2, 1, 2, 24, 80, dtype=torch.float64, device=DEV)  # keys, values [B, H_kv, T, hd]
    count = (24 - L) // D + 1
    launched = []
    real = kernels.compress_blocks_fwd
    kernels.compress_blocks_fwd = lambda *a, **k: launched.append(1) or real(*a, **k)
    try:
        got = ops.compress_blocks(kv[0], kv[1], pk.weights(), pv.weights(), 0, count, L, D, "triton")
    finally:
        kernels.compress_blocks_fwd = real
    want = ops.compress_blocks(kv[0], kv[1], pk.weights(), pv.weights(), 0, count, L, D, "torch")
    assert not launched and all(torch.equal(a, b) for a, b in zip(got, want))
