"""Dense attention over packed documents (nsa/attention/dense.py, doc_start = Documents.start).

Rule: query t sees key s iff doc_start[b, t] <= s <= t. Proved in float64 on every CPU path (manual, the SDPA
split by document, SDPA with a boolean mask as torch.compile runs it, FlexAttention's forward) and through
DenseAttention: (a) a packed batch equals each document run alone from position 0, outputs and gradients
(q, k, v; the layer's parameters); (b) changing a token of another document changes nothing, exactly;
(c) a window with no EOS gives exactly today's result. FlexAttention's backward: CUDA only.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from nsa.attention.dense import (
    DenseAttention,
    KVCache,
    causal_attention,
    document_causal_mask,
    manual_attention,
)
from nsa.attention.documents import Documents
from nsa.attention.impl.flex import flex_document_attention
from nsa.config import ModelConfig
from nsa.layers import RotaryEmbedding
from tests.nsa._nsa_helpers import starts_of

EOS = 0
# per row, document lengths: not multiples of 16 / 32 / 64 / 128, a 1-token document, documents that start
# mid-window and cross 128-tiles, rows of one batch with different layouts
LAYOUTS = {
    "mixed": [[37, 1, 151, 111], [133, 167]],
    "many": [[5, 17, 1, 31, 33, 47, 1, 66, 99], [300]],
}
T = 300


def spans(rows):  # (b, first, end) of every document
    for b, lengths in enumerate(rows):
        ends = torch.tensor(lengths).cumsum(0).tolist()
        yield from ((b, e - n, e) for n, e in zip(lengths, ends))


def qkv(B, H, H_kv, hd=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, hd, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, H_kv, T, hd, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    return q, k, v


def alone(attend, q, k, v, rows):
    """Each document through `attend` (no documents) from position 0, concatenated back into [B, H, T, hd]."""
    parts = [[] for _ in rows]
    for b, a, e in spans(rows):
        parts[b].append(attend(q[b:b + 1, :, a:e], k[b:b + 1, :, a:e], v[b:b + 1, :, a:e]))
    return torch.cat([torch.cat(p, dim=2) for p in parts], dim=0)


def grads(out, *xs, seed=1):
    # drawn in float64 whatever out's dtype (randn's draws differ by dtype), on the CPU generator whatever its device
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    w = w.to(out.device, out.dtype)
    return torch.autograd.grad((out * w).sum(), xs)


def _compiled(backend):  # the SDPA-with-mask path: torch.compile cannot run the host-side split
    torch._dynamo.reset()
    return torch.compile(functools.partial(causal_attention, backend=backend), fullgraph=True, backend="eager")


PATHS = {
    "manual": lambda q, k, v, s: causal_attention(q, k, v, "manual", s),
    "sdpa_split": lambda q, k, v, s: causal_attention(q, k, v, "sdpa", s),
    "auto": lambda q, k, v, s: causal_attention(q, k, v, "auto", s),
    "sdpa_mask_compiled": lambda q, k, v, s: _compiled("sdpa")(q, k, v, doc_start=s),
}


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_packed_equals_alone_with_gradients(path, layout):
    rows = LAYOUTS[layout]
    q, k, v = qkv(len(rows), H=4, H_kv=2)  # GQA: groups of 2
    start = starts_of(rows)
    out = PATHS[path](q, k, v, start)
    ref = alone(lambda *a: manual_attention(*a), q, k, v, rows)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
    for g, r in zip(grads(out, q, k, v), grads(ref, q, k, v)):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-10)
    # the test can fail: without the documents the packed batch is not the documents alone
    assert not torch.allclose(causal_attention(q, k, v, "manual"), ref, atol=1e-3)


def test_flex_document_attention_forward_equals_alone_and_mask():
    rows = LAYOUTS["mixed"] + LAYOUTS["many"][:1]
    q, k, v = (x.detach() for x in qkv(len(rows), H=6, H_kv=2))
    start = starts_of(rows)
    out = flex_document_attention(q, k, v, start)
    torch.testing.assert_close(out, alone(manual_attention, q, k, v, rows), rtol=0, atol=1e-12)
    torch.testing.assert_close(out, manual_attention(q, k, v, start), rtol=0, atol=1e-12)


@pytest.mark.parametrize("path", sorted(PATHS) + ["flex"])
def test_other_documents_change_nothing(path):
    rows = LAYOUTS["mixed"]
    q, k, v = (x.detach() for x in qkv(len(rows), H=4, H_kv=1, seed=3))
    start = starts_of(rows)
    run = (lambda q, k, v, s: flex_document_attention(q, k, v, s)) if path == "flex" else PATHS[path]
    ref = run(q, k, v, start)
    g = torch.Generator().manual_seed(4)
    for b, a, e in spans(rows):
        q2, k2, v2 = q.clone(), k.clone(), v.clone()
        for x in (q2, k2, v2):
            x[b, :, a:e] = torch.randn(x[b, :, a:e].shape, generator=g, dtype=x.dtype)
        out = run(q2, k2, v2, start)
        inside = torch.zeros(T, dtype=torch.bool)
        inside[a:e] = True
        assert torch.equal(out[b][:, ~inside], ref[b][:, ~inside]), (path, b, a, e)
        assert torch.equal(out[1 - b], ref[1 - b])
        assert not torch.equal(out[b][:, inside], ref[b][:, inside])


@pytest.mark.parametrize("backend", ["manual", "sdpa", "auto"])
def test_one_document_per_window_is_todays_result(backend):
    q, k, v = (x.detach() for x in qkv(2, H=4, H_kv=2, seed=5))
    start = torch.zeros(2, T, dtype=torch.long)  # no EOS: one document per window
    assert torch.equal(causal_attention(q, k, v, backend, start), causal_attention(q, k, v, backend))


def rope_tables(hd, n):  # float64 cos, sin [n, hd/2] (the model's tables are float32: ~1e-8 relative)
    angles = torch.arange(n, dtype=torch.float64)[:, None] * RotaryEmbedding(hd, 10000.0).inv_freq
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("backend", ["manual", "sdpa"])
def test_dense_attention_layer_packed_equals_alone_with_parameter_gradients(backend):
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=T,
                      qk_norm=True, bias=True, attn_backend=backend)
    torch.manual_seed(0)
    attn = DenseAttention(cfg).double()
    rows = LAYOUTS["mixed"]
    x = torch.randn(len(rows), T, cfg.dim, dtype=torch.float64, requires_grad=True)
    w = torch.randn(x.shape, dtype=torch.float64)
    params = list(attn.parameters())
    packed = attn(x, rope_tables(cfg.head_dim, T), documents=Documents(starts_of(rows)))  # RoPE: window positions
    g_packed = torch.autograd.grad((packed * w).sum(), [x, *params])
    loss, outs = 0.0, []
    for b, a, e in spans(rows):  # each document alone, from position 0
        y = attn(x[b:b + 1, a:e], rope_tables(cfg.head_dim, e - a))
        outs.append((b, a, e, y))
        loss = loss + (y * w[b:b + 1, a:e]).sum()
    g_alone = torch.autograd.grad(loss, [x, *params])
    for b, a, e, y in outs:
        torch.testing.assert_close(packed[b:b + 1, a:e], y, rtol=0, atol=1e-10)
    for name, gp, ga in zip(["x"] + [n for n, _ in attn.named_parameters()], g_packed, g_alone):
        torch.testing.assert_close(gp, ga, rtol=0, atol=1e-10, msg=name)
    one = attn(x, rope_tables(cfg.head_dim, T), documents=Documents(torch.zeros(len(rows), T, dtype=torch.long)))
    assert torch.equal(one, attn(x, rope_tables(cfg.head_dim, T)))


def test_documents_are_refused_with_a_cache_or_unequal_lengths():
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=T)
    attn = DenseAttention(cfg)
    x = torch.randn(1, 8, cfg.dim)
    with pytest.raises(ValueError, match="cache"):
        attn(x, cache=KVCache(), documents=Documents(torch.zeros(1, 8, dtype=torch.long)))
    q, k = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 8, 16)
    for backend in ("manual", "sdpa", "auto"):
        with pytest.raises(ValueError, match="Tq == Tk"):
            causal_attention(q, k, k, backend, torch.zeros(1, 3, dtype=torch.long))


def test_document_mask_is_the_rule():
    start = starts_of([[3, 1, 4], [8]])
    mask = document_causal_mask(start)  # [B, 1, T, T]
    for b in range(2):
        for t in range(8):
            for s in range(8):
                assert bool(mask[b, 0, t, s]) == (int(start[b, t]) <= s <= t)


def test_compiled_layer_with_documents_has_no_graph_break_and_no_recompile():
    """torch.compile(fullgraph=True) of DenseAttention with documents: one graph (fullgraph raises on a break),
    reused by a batch with other documents (doc_start is data), equal to eager, gradients included."""
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=T,
                      attn_backend="sdpa")
    torch.manual_seed(0)
    attn = DenseAttention(cfg).double()
    compiled = torch.compile(attn, fullgraph=True, backend="aot_eager")
    rope = rope_tables(cfg.head_dim, T)
    torch._dynamo.reset()
    counters.clear()
    try:
        for layout in sorted(LAYOUTS):
            docs = Documents(starts_of(LAYOUTS[layout]))
            x = torch.randn(2, T, cfg.dim, dtype=torch.float64, requires_grad=True)
            out, ref = compiled(x, rope, documents=docs), attn(x, rope, documents=docs)
            torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
            (g_out,), (g_ref,) = torch.autograd.grad(out.sum(), [x]), torch.autograd.grad(ref.sum(), [x])
            torch.testing.assert_close(g_out, g_ref, rtol=0, atol=1e-10)
        assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
        assert not counters["graph_break"], dict(counters["graph_break"])
    finally:
        torch._dynamo.reset()
        counters.clear()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's backward needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_flex_documents_forward_and_backward(dtype):
    rows = LAYOUTS["mixed"]
    q, k, v = (x.detach().cuda().requires_grad_() for x in qkv(len(rows), H=4, H_kv=2))
    start = starts_of(rows).cuda()
    ref = manual_attention(q, k, v, start)  # float64 oracle
    g_ref = grads(ref, q, k, v)
    ql, kl, vl = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
    out = causal_attention(ql, kl, vl, "auto", start)  # FlexAttention
    tol = 2e-3 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=tol)
    for g, r in zip(grads(out, ql, kl, vl), g_ref):
        torch.testing.assert_close(g.double(), r, rtol=0, atol=tol * 4)
