"""Activation checkpointing (model.checkpoint_every): same gradients, less memory held for backward."""
from __future__ import annotations

import pytest
import torch

from nsa.config import ModelConfig, NSAConfig
from nsa.model import Transformer

DENSE = dict(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=64)
NSA = dict(DENSE, attention="nsa", nsa=NSAConfig(l=8, d=4, l_sel=16, n_sel=3, w=16))


def grads_and_saved_bytes(cfg: dict, every: int) -> tuple[dict, int]:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**cfg)).double()
    model.checkpoint_every = every
    idx = torch.randint(0, cfg["vocab_size"], (2, 48))
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(idx, idx)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, sum(saved)


@pytest.mark.parametrize("cfg", [DENSE, NSA], ids=["dense", "nsa"])
@pytest.mark.parametrize("every", [1, 2])
def test_checkpointing_keeps_gradients_and_saves_memory(cfg, every):
    ref, ref_bytes = grads_and_saved_bytes(cfg, 0)
    got, got_bytes = grads_and_saved_bytes(cfg, every)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=1e-12, msg=name)
    # tensors held for backward during the forward pass (recomputation happens later, in backward)
    assert got_bytes < (0.5 if every == 1 else 0.8) * ref_bytes, (got_bytes, ref_bytes)


def test_checkpointing_is_off_in_eval_and_decode():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**DENSE)).eval()
    model.checkpoint_every = 1
    idx = torch.randint(0, 64, (1, 10))
    caches = model.new_caches()
    torch.testing.assert_close(model(idx, start_pos=0, caches=caches), model(idx))


def test_checkpointing_under_torch_compile_matches_eager():
    torch.manual_seed(0)
    cfg = ModelConfig(**{**DENSE, "n_layers": 2})
    compiled_model, eager = Transformer(cfg), Transformer(cfg)
    eager.load_state_dict(compiled_model.state_dict())
    compiled_model.checkpoint_every = 1
    idx = torch.randint(0, cfg.vocab_size, (2, 16))
    torch.compile(compiled_model)(idx, idx).backward()
    eager(idx, idx).backward()
    for a, b in zip(compiled_model.parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6)
