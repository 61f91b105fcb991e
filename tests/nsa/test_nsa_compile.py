"""torch.compile sees through NSA: the custom ops (nsa/attention/ops.py) trace with their fake
implementations, so a whole NSA model compiles with fullgraph=True (zero graph breaks), forward and
backward, and equals eager. Switching statistics or train/eval recompiles at most once per mode."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from nsa.attention import ops
from nsa.attention.documents import compressed_layout
from nsa.config import ModelConfig, NSAConfig
from nsa.gate_health import set_gate_stats
from nsa.model import Transformer

NSA_SMALL = NSAConfig(l=8, d=4, l_sel=16, n_sel=4, w=16, q_chunk=32, sel_chunk=64, sel_tile=8, win_block=16, gate_hidden=16)


def small_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
                      max_seq_len=128, attention="nsa", nsa=NSA_SMALL)
    return Transformer(cfg)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _loss_and_grads(model, idx):
    loss = model(idx).float().square().mean()
    return loss.detach(), torch.autograd.grad(loss, list(model.parameters()))


def test_whole_nsa_model_compiles_fullgraph_and_matches_eager():
    model = small_model()
    idx = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    loss, grads = _loss_and_grads(model, idx)
    # aot_eager: Dynamo + AOTAutograd trace forward and backward through the fake implementations
    # (inductor adds only code generation; opcheck below checks the fakes' strides)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # raises on any graph break
    loss_c, grads_c = _loss_and_grads(compiled, idx)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]
    torch.testing.assert_close(loss_c, loss, rtol=1e-4, atol=1e-5)
    for a, b in zip(grads_c, grads):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


def test_packed_documents_compile_with_inductor_and_match_eager():
    """Inductor checks every custom op's output strides against its fake kernel (aot_eager does not): the torch
    path's per-document backward once returned gradients in the keys' strided layout and failed here."""
    model = small_model()
    model.document_eos_id = 0
    idx = torch.randint(1, 256, (2, 64), generator=torch.Generator().manual_seed(2))
    idx[0, 21], idx[1, 40] = 0, 0  # three documents over two rows, one starting mid-window
    loss, grads = _loss_and_grads(model, idx)
    loss_c, grads_c = _loss_and_grads(torch.compile(model, fullgraph=True), idx)
    torch.testing.assert_close(loss_c, loss, rtol=1e-4, atol=1e-5)
    for a, b in zip(grads_c, grads):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


def test_statistics_and_eval_recompile_once_per_mode():
    model = small_model()
    compiled = torch.compile(model, fullgraph=True, backend="eager")  # Dynamo guards decide recompiles
    idx = torch.randint(0, 256, (1, 48))

    def graphs_after(step) -> int:
        step()
        return counters["stats"]["unique_graphs"]

    run = lambda: compiled(idx).sum().backward()  # noqa: E731
    assert graphs_after(run) == 1
    assert graphs_after(run) == 1  # the same mode again: cached
    set_gate_stats(model, True)
    assert graphs_after(run) == 2  # statistics on: one more graph ...
    assert all(t.device.type == "cpu" for layer in model.modules() if getattr(layer, "last_stats", None)
               for t in layer.last_stats.values())
    set_gate_stats(model, False)
    assert graphs_after(run) == 2  # ... and back: no recompile
    model.eval()
    with torch.no_grad():
        assert graphs_after(lambda: compiled(idx)) == 3  # eval: once
        assert graphs_after(lambda: compiled(idx)) == 3


def _interpreted_kernels() -> bool:
    """Whether the Triton kernels run here (Triton importable, its interpreter on for CPU tensors)."""
    try:
        from nsa.attention.kernels.selected_attention import interpreter_active
    except ImportError:
        return False
    return interpreter_active()


def test_custom_ops_pass_opcheck():
    """torch.library.opcheck: schemas, fake implementations (shapes, strides, dtypes) and registered
    autograd agree with the real implementations."""
    g, dtype = torch.Generator().manual_seed(0), torch.float64
    B, H_kv, G, T, hd, l, d, l_sel, n, w = 1, 2, 2, 40, 8, 8, 4, 16, 3, 12
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=dtype, requires_grad=True)  # noqa: E731
    q, k, v = rnd(B, H_kv * G, T, hd), rnd(B, H_kv, T, hd), rnd(B, H_kv, T, hd)
    n_c = (T - l) // d + 1
    ck, cv = rnd(B, H_kv, n_c, hd), rnd(B, H_kv, n_c, hd)
    qg = q.detach().view(B, H_kv, G, T, hd).requires_grad_(True)
    idx = ops.select_blocks(qg, ck, 0, l, d, l_sel, n, 16, "torch")
    cases = [
        (ops._select_blocks, (qg.detach(), ck.detach(), 0, l, d, l_sel, n, 16, "torch", None, None)),
        # with the compressed branch's log-sum-exps [B, H_kv, G, T] (the Triton path reads them)
        (ops._select_blocks, (qg.detach(), ck.detach(), 0, l, d, l_sel, n, 16, "torch", None,
                              ops._compressed(q, ck, cv, 0, l, d, 16, None)[1].detach().view(B, H_kv, G, T))),
        (ops._compressed, (q, ck, cv, 0, l, d, 16, None)),
        (ops._selected, (qg, k, v, idx, 0, l_sel, 4, 24, "torch", None)),
        (ops._window, (q, k, v, 0, 0, w, 16, None)),
    ]
    # packed documents (lengths 5, 23, 12): the frame argument, compressed tokens in T // d slots
    start = torch.tensor([[0] * 5 + [5] * 23 + [28] * 12])
    frame = compressed_layout(start, l, d).frame
    ck_docs, cv_docs = rnd(B, H_kv, T // d, hd), rnd(B, H_kv, T // d, hd)
    idx_docs = ops.select_blocks(qg, ck_docs, 0, l, d, l_sel, n, 16, "torch", frame=frame)
    cases += [
        (ops._select_blocks, (qg.detach(), ck_docs.detach(), 0, l, d, l_sel, n, 16, "torch", frame, None)),
        (ops._compressed, (q, ck_docs, cv_docs, 0, l, d, 16, frame)),
        (ops._selected, (qg, k, v, idx_docs, 0, l_sel, 4, 24, "torch", frame)),
        (ops._window, (q, k, v, 0, 0, w, 16, frame)),
    ]
    if _interpreted_kernels():  # the Triton path's forward also returns the slot index its backward reuses
        cases += [(ops._selected, (qg, k, v, idx, 0, l_sel, 4, 24, "triton", None)),
                  (ops._selected, (qg, k, v, idx_docs, 0, l_sel, 4, 24, "triton", frame))]
    for op, args in [c for c in cases if c[0] is not ops._select_blocks]:  # each backward op on the forward's outputs
        o, lse, *index = op(*args)
        o, lse = o.detach(), lse.detach()
        tensors = [t.detach() for t in args[:3]]
        d_o = torch.randn(o.shape, generator=g, dtype=dtype)
        backward = {ops._compressed: ops._compressed_bwd, ops._selected: ops._selected_bwd, ops._window: ops._window_bwd}[op]
        if op is ops._selected:
            assert bool(index[0]) == (args[8] == "triton")  # the torch path has no index to hand over
            cases.append((backward, (d_o, *tensors, args[3], o, lse, index[0], *args[4:])))
        else:
            cases.append((backward, (d_o, *tensors, o, lse, *args[3:])))
    for op, args in cases:
        torch.library.opcheck(op.op, args)


@pytest.mark.parametrize("pool, target", [("keys", "compressed"), ("scores", "dense")])
def test_an_indexer_model_compiles_fullgraph_and_matches_eager(pool, target):
    """nsa.selector=indexer's ops (picks, the KL with its target inside, its backward) trace through their fakes: a
    training loss (the KL term's gradient included) compiles with zero graph breaks and equals eager; the ops pass
    torch.library.opcheck (schemas, fakes, autograd registration)."""
    import dataclasses

    torch.manual_seed(0)
    nsa = dataclasses.replace(NSA_SMALL, selector="indexer", indexer_heads=2, indexer_dim=8, indexer_pool=pool,
                              indexer_target=target)
    model = Transformer(ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                                    ffn_dim=128, max_seq_len=128, attention="nsa", nsa=nsa))
    idx, tgt = torch.randint(0, 256, (2, 2, 80), generator=torch.Generator().manual_seed(3))

    def loss_and_grads(m):
        loss = m(idx, tgt)
        return loss.detach(), torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)

    loss, grads = loss_and_grads(model)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    loss_c, grads_c = loss_and_grads(compiled)
    assert not counters["graph_break"]
    torch.testing.assert_close(loss_c, loss, rtol=1e-5, atol=1e-6)
    named = [n for n, _ in model.named_parameters()]
    assert any(g is not None and ".indexer." in n for n, g in zip(named, grads))
    for a, b in zip(grads_c, grads):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
    # the ops on their own: a projection output [1, 40, P] (H_kv 2, h 2, e 8), the KL's rows and target
    P = 2 * 2 * 9 + 8
    out = torch.randn(1, 40, P, dtype=torch.float64, requires_grad=True)
    target = torch.rand(1, 2, 40, 5, dtype=torch.float64)
    torch.library.opcheck(ops._indexer_kl.op, (out, target, "given", None, None, None, 0, 0, 2, 2, 8, 40, 8,
                                            pool == "scores", 1.0, "torch"))
    q, w, k = out.detach()[..., :32].unflatten(-1, (2, 2, 8)), out.detach()[..., 32:36].unflatten(-1, (2, 2)), \
        out.detach()[..., 36:]
    torch.library.opcheck(ops._indexer_picks.op, (q, w, k, 0, 8, 3, pool == "scores", True, "torch"))
    qg = torch.randn(1, 2, 3, 40, 8, dtype=torch.float64)  # [B, H_kv, G, T, hd]
    ck = torch.randn(1, 2, 9, 8, dtype=torch.float64)  # l = 8, d = 4: 9 compressed tokens over 40
    sel_k = torch.randn(1, 2, 40, 8, dtype=torch.float64)
    torch.library.opcheck(ops._pooled_mass_rows.op, (qg, ck, None, 40, 8, 4, 8, 5, "torch"))
    torch.library.opcheck(ops._dense_mass_rows.op, (qg, sel_k, 40, 8, 5, "torch"))
    source = ("compressed", qg, ck, None, 8, 4) if target == "compressed" else ("dense", qg, sel_k, None, 0, 0)
    torch.library.opcheck(ops._indexer_kl.op, (out, None, *source, 2, 2, 8, 40, 8, pool == "scores", 1.0, "torch"))
