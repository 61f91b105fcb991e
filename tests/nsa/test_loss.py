"""Chunked linear + cross-entropy (nsa/loss.py): equal to F.cross_entropy on full logits (loss and the
gradients of hidden states and head weight), in the model (tied head, activation checkpointing,
torch.compile, eval), and it never holds logits for all rows."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import nsa.loss
import nsa.model
from nsa.config import ModelConfig, ModelConfigError
from nsa.loss import IGNORE_INDEX, linear_cross_entropy
from nsa.model import Transformer

N, D, V = 37, 16, 50  # 37 rows: not a multiple of any chunk size below
TINY = dict(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=32)


def inputs(dtype=torch.float32, ignored=slice(None, None, 4)):
    torch.manual_seed(0)
    hidden = torch.randn(N, D, dtype=dtype, requires_grad=True)  # [N, D]
    weight = (0.5 * torch.randn(V, D, dtype=dtype)).requires_grad_()  # [V, D]
    targets = torch.randint(0, V, (N,))
    targets[ignored] = IGNORE_INDEX
    return hidden, weight, targets


def loss_and_grads(loss_fn, hidden, weight, targets, grad_scale=0.25):
    """grad_scale != 1 checks that backward scales by the incoming gradient (gradient accumulation)."""
    hidden.grad = weight.grad = None
    loss = loss_fn(hidden, weight, targets)
    (loss * grad_scale).backward()
    return loss.detach(), hidden.grad.clone(), weight.grad.clone()


def full_logits(hidden, weight, targets):
    return F.cross_entropy(F.linear(hidden, weight).float(), targets, ignore_index=IGNORE_INDEX)


def chunked(chunk_rows):
    return lambda hidden, weight, targets: linear_cross_entropy(hidden, weight, targets, chunk_rows)


@pytest.mark.parametrize("chunk_rows", [1, 5, 16, 37, 64])  # 64 > N: a single partial chunk
@pytest.mark.parametrize("ignored", [slice(0, 0), slice(None, None, 4), slice(3, 30)], ids=["none", "every4th", "block"])
def test_equals_cross_entropy_on_full_logits_fp32(chunk_rows, ignored):
    args = inputs(ignored=ignored)
    ref = loss_and_grads(full_logits, *args)
    got = loss_and_grads(chunked(chunk_rows), *args)
    for name, a, b in zip(("loss", "grad_hidden", "grad_weight"), got, ref):
        assert a.dtype == b.dtype, name
        rtol = 1e-6 if name == "loss" else 0  # the loss (~6) differs by an ulp or two of summation order
        torch.testing.assert_close(a, b, rtol=rtol, atol=1e-6, msg=name)


def test_equals_cross_entropy_in_float64():
    args = inputs(torch.float64)
    ref = loss_and_grads(lambda h, w, t: F.cross_entropy(h @ w.T, t), *args)
    got = loss_and_grads(chunked(5), *args)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)


def test_all_rows_ignored_behaves_like_cross_entropy():
    args = inputs(ignored=slice(None))
    ref = loss_and_grads(full_logits, *args)
    got = loss_and_grads(chunked(8), *args)
    assert ref[0].isnan() and got[0].isnan()
    torch.testing.assert_close(got[1:], ref[1:], rtol=0, atol=0)


def test_no_grad_gives_the_same_loss():
    hidden, weight, targets = inputs()
    with torch.no_grad():
        got = linear_cross_entropy(hidden, weight, targets, 5)
        ref = full_logits(hidden, weight, targets)
    assert got.grad_fn is None
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("slab", [None, 7], ids=["one_slab", "slabs_of_7"])
def test_autocast_bf16_matches_the_old_path_and_is_close_to_fp32(slab, monkeypatch):
    """Under autocast the head's matmuls run in bf16 as nn.Linear's do; logits and softmax stay fp32;
    the bf16 weight-gradient products are summed in fp32 (slab: vocabulary rows per update)."""
    if slab:
        monkeypatch.setattr(nsa.loss, "WEIGHT_GRAD_SLAB", slab)
    args = inputs()
    fp32 = loss_and_grads(full_logits, *args)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        old = loss_and_grads(full_logits, *args)
        got = loss_and_grads(chunked(5), *args)
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == torch.float32
    torch.testing.assert_close(got[0], old[0], rtol=1e-6, atol=1e-6)  # same bf16 logits, same fp32 softmax
    for a, b in zip(got[1:], old[1:]):  # gradients up to 0.04: differ only where bf16 products are rounded
        torch.testing.assert_close(a, b, rtol=0, atol=5e-4)
    torch.testing.assert_close(got[0], fp32[0], rtol=1e-3, atol=0)
    for a, b in zip(got[1:], fp32[1:]):
        torch.testing.assert_close(a, b, rtol=0, atol=5e-4)
    assert not torch.equal(got[2], fp32[2])  # the matmuls really ran in bf16


def test_a_second_backward_through_the_scaled_gradients_fails_loudly():
    hidden, weight, targets = inputs()
    loss = linear_cross_entropy(hidden, weight, targets, 5)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):
        loss.backward()


def test_bad_chunk_sizes_are_rejected():
    hidden, weight, targets = inputs()
    with pytest.raises(ValueError, match="chunk_rows"):
        linear_cross_entropy(hidden, weight, targets, 0)
    with pytest.raises(ModelConfigError, match="loss_chunk"):
        ModelConfig(**TINY, loss_chunk=-1)


# ---- in the model ---------------------------------------------------------------------------------

def build(**overrides) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(**{**TINY, **overrides}))


def batch():
    torch.manual_seed(1)
    idx = torch.randint(0, TINY["vocab_size"], (2, 24))
    targets = torch.roll(idx, -1, dims=1)
    targets[:, -1] = IGNORE_INDEX
    targets[0, :5] = IGNORE_INDEX
    return idx, targets


def model_loss_and_grads(model: Transformer, idx, targets) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = model(idx, targets)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same(got, ref, atol=1e-6):
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=atol)
    assert got[1].keys() == ref[1].keys()
    for name in ref[1]:
        torch.testing.assert_close(got[1][name], ref[1][name], rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize("preset", [
    dict(), dict(tie_embeddings=True), dict(norm="layernorm", mlp="gelu", pos_emb="learned", tie_embeddings=True, bias=True),
], ids=["untied", "tied", "gpt2"])
def test_model_chunked_loss_equals_full_logits(preset):
    idx, targets = batch()
    ref = model_loss_and_grads(build(loss_chunk=0, **preset), idx, targets)
    got = model_loss_and_grads(build(loss_chunk=7, **preset), idx, targets)
    assert_same(got, ref)
    if preset.get("tie_embeddings"):  # the shared matrix gets embedding + head gradients, as before
        assert "lm_head.weight" not in got[1] and got[1]["tok_emb.weight"].abs().sum() > 0


def test_model_loss_chunk_takes_effect_and_never_saves_full_logits(monkeypatch):
    """loss_chunk > 0 routes through linear_cross_entropy, and no [B*T, V] tensor is kept for backward."""
    idx, targets = batch()
    rows, vocab = idx.numel(), TINY["vocab_size"]
    calls = []
    real = nsa.model.linear_cross_entropy
    monkeypatch.setattr(nsa.model, "linear_cross_entropy", lambda *a, **k: calls.append(a[3]) or real(*a, **k))

    def largest_saved_numel(model):
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            model(idx, targets)
        return max(sizes)

    assert largest_saved_numel(build(loss_chunk=0)) >= rows * vocab and calls == []
    assert largest_saved_numel(build(loss_chunk=7)) < rows * vocab and calls == [7]


def test_model_eval_loss_equals_full_logits_and_logits_are_unchanged():
    idx, targets = batch()
    full, chunk = build(loss_chunk=0).eval(), build(loss_chunk=7).eval()
    with torch.no_grad():
        torch.testing.assert_close(chunk(idx, targets), full(idx, targets), rtol=1e-6, atol=1e-6)
        assert torch.equal(chunk(idx), full(idx))  # no targets: logits [B, T, V] as before


def test_model_with_activation_checkpointing_equals_without():
    idx, targets = batch()
    ref = model_loss_and_grads(build(loss_chunk=0), idx, targets)
    model = build(loss_chunk=7)
    model.checkpoint_every = 1
    assert_same(model_loss_and_grads(model, idx, targets), ref)


def test_model_under_torch_compile_equals_eager():
    idx, targets = batch()
    ref = model_loss_and_grads(build(loss_chunk=0, n_layers=1), idx, targets)
    compiled = build(loss_chunk=7, n_layers=1)
    got = model_loss_and_grads(torch.compile(compiled), idx, targets)
    got = (got[0], {n.removeprefix("_orig_mod."): g for n, g in got[1].items()})
    assert_same(got, ref, atol=1e-5)
