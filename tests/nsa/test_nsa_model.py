"""NSA inside the full Transformer: causality over token ids, cached decode equals full forward."""
from __future__ import annotations

import torch

from nsa.model import Transformer
from tests.nsa._nsa_helpers import DEVICE, small_cfg

VOCAB = 97


def make_model(**overrides):
    torch.manual_seed(0)
    cfg = small_cfg(vocab_size=VOCAB, n_layers=2, ffn_dim=96, max_seq_len=128, **overrides)
    return Transformer(cfg).double().to(DEVICE).eval()


def test_model_is_causal_under_future_token_perturbation():
    model = make_model()
    T = 70
    ids = torch.randint(0, VOCAB, (2, T), device=DEVICE)
    with torch.no_grad():
        logits = model(ids)
        for t in (7, 15, 16, 31, 68):
            ids2 = ids.clone()
            ids2[:, t + 1 :] = (ids2[:, t + 1 :] + 1 + torch.randint_like(ids2[:, t + 1 :], VOCAB - 1)) % VOCAB
            logits2 = model(ids2)
            assert torch.equal(logits2[:, : t + 1], logits[:, : t + 1]), t
            assert not torch.equal(logits2[:, t + 1 :], logits[:, t + 1 :])


def test_model_decode_with_caches_equals_full_forward():
    model = make_model(qk_norm=True)
    T = 70
    ids = torch.randint(0, VOCAB, (2, T), device=DEVICE)
    with torch.no_grad():
        full = model(ids)
        caches = model.new_caches()
        prompt = 21
        outs = [model(ids[:, :prompt], start_pos=0, caches=caches)]
        for t in range(prompt, T):
            outs.append(model(ids[:, t : t + 1], start_pos=t, caches=caches))
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=0, atol=1e-10)


def test_model_trains_one_step_with_finite_gradients():
    model = make_model()
    model.train()
    ids = torch.randint(0, VOCAB, (2, 40), device=DEVICE)
    loss = model(ids[:, :-1], targets=ids[:, 1:])
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    # Transformer.reset_parameters re-ran NSA's own init: position encodings are small, not N(0, 1)
    pe = model.blocks[0].attn.compress_k.pos_enc
    assert 0 < pe.std() < 0.05
