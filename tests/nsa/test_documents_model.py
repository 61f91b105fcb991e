"""Whole models on packed documents (issue 28): the Transformer derives documents from EOS
(model.document_eos_id), restarts learned positions per document, and a packed window's logits and
parameter gradients equal each document's run alone; generation that crosses an EOS starts a fresh document."""
from __future__ import annotations

import pytest
import torch

from nsa.config import ModelConfig, NSAConfig
from nsa.generate import generate
from nsa.model import Transformer

EOS = 0
NSA_SMALL = NSAConfig(l=8, d=4, l_sel=16, n_sel=4, w=16, q_chunk=8, sel_chunk=32, sel_tile=4, win_block=8, gate_hidden=16)


def _model(attention: str, pos_emb: str, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, max_seq_len=128,
                      pos_emb=pos_emb, attention=attention, nsa=NSA_SMALL)
    model = Transformer(cfg).double()
    model.document_eos_id = EOS
    return model


def _packed(lengths: list[int], seed: int) -> torch.Tensor:
    """One window of documents: each after the first opens with EOS; the first is a cut-off tail (no EOS)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 64, (sum(lengths),), generator=g)
    at = 0
    for i, n in enumerate(lengths):
        if i:
            ids[at] = EOS
        at += n
    return ids


def _split(ids: torch.Tensor, lengths: list[int]):
    return list(ids.split(lengths))


CASES = [("nsa", "rope"), ("nsa", "learned"), ("dense", "rope"), ("dense", "learned")]


@pytest.mark.parametrize("attention,pos_emb", CASES, ids=[f"{a}-{p}" for a, p in CASES])
def test_packed_window_equals_each_document_alone(attention, pos_emb):
    lengths = [13, 2, 41, 5, 30]  # a tail, documents shorter than a compression block, one mid-window
    model = _model(attention, pos_emb)
    ids = _packed(lengths, seed=1)
    packed = model(ids[None])  # [1, T, V]
    alone = torch.cat([model(doc[None]) for doc in _split(ids, lengths)], dim=1)
    if pos_emb == "rope":  # RoPE at window positions: equal up to rounding of the rotation angles
        torch.testing.assert_close(packed, alone, rtol=0, atol=1e-10)
    else:
        torch.testing.assert_close(packed, alone, rtol=0, atol=1e-12)
    targets = torch.randint(0, 64, ids.shape, generator=torch.Generator().manual_seed(2))
    params = list(model.parameters())
    g_packed = torch.autograd.grad(model(ids[None], targets[None]), params)
    loss_alone = sum(model(d[None], t[None]) * len(d) for d, t in zip(_split(ids, lengths), _split(targets, lengths)))
    g_alone = torch.autograd.grad(loss_alone / len(ids), params)
    for (name, _), a, b in zip(model.named_parameters(), g_packed, g_alone):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=name)


@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_without_the_rule_documents_see_each_other(attention):
    """The switch matters: without document_eos_id the same window mixes documents (and with it, they don't)."""
    lengths = [20, 30]
    model = _model(attention, "rope")
    ids = _packed(lengths, seed=3)
    with torch.no_grad():
        on = model(ids[None])[:, 20:]
        model.document_eos_id = None
        off = model(ids[None])[:, 20:]
        second_alone = model(ids[20:][None])
    assert not torch.allclose(on, off)
    torch.testing.assert_close(on, second_alone, rtol=0, atol=1e-10)


@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_generation_crossing_eos_starts_a_fresh_document(attention):
    """Greedy decoding through an EOS equals, token by token, the argmax of a full (cache-free) forward of
    everything so far under the document rule, i.e. a fresh context after each EOS."""
    model = _model(attention, "learned", seed=4).eval()
    prompt = [5, 9, 17, 3, 22, 40, 11]
    with torch.no_grad():
        model.document_eos_id = None
        first = model(torch.tensor([prompt]))[0, -1].argmax().item()  # make the first new token the EOS
        model.document_eos_id = first
        out = generate(model, prompt, 24, temperature=0.0).ids[0]
        assert out[0] == first  # crossed at once
        seq = list(prompt)
        for tok in out:
            logits = model(torch.tensor([seq]))[0, -1]
            assert logits.argmax().item() == tok
            seq.append(tok)
    assert first in out


def test_prompt_context_is_its_last_document():
    model = _model("nsa", "learned", seed=5).eval()
    with torch.no_grad():
        a = generate(model, [7, 8, 9, EOS, 30, 31], 6, temperature=0.0).ids[0]
        b = generate(model, [EOS, 30, 31], 6, temperature=0.0).ids[0]
    assert a == b
