"""nsa.indexer_every = k > 1 (GLM-5's IndexShare): an indexer in layers 0, k, 2k, ..; the layers between select the
picks of the last one before them. A reusing layer against the float64 per-token reference given those picks (plain
and packed documents); the model threading the picks (and not a reusing layer's own pooled scores) through its
blocks, under activation checkpointing, over packed documents (packed == each document alone) and in cached
decoding (chunked prefill and steps == one forward); the warm-up (every layer selects by its own pooled scores, as
with k = 1); the KL only in indexer layers; the config's refusals."""
from __future__ import annotations

import pytest
import torch

from nsa.attention.documents import Documents
from nsa.attention.nsa import NativeSparseAttention
from nsa.attention.reference import reference_forward
from nsa.config import ModelConfig, ModelConfigError, NSAConfig
from nsa.model import Transformer
from tests.nsa._nsa_helpers import (DEVICE, L_SEL, N_SEL, decode_in_pieces, distinct_ids, make_input, make_layer,
                                    rope_for, small_cfg, sorted_blocks, starts_of)

REUSE = dict(selector="indexer", indexer_heads=2, indexer_dim=8, gate_init="equal", indexer_pool="scores",
             indexer_target="dense", indexer_every=2)


def _model(n_layers: int = 3, **nsa) -> Transformer:
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64,
                      max_seq_len=256, attention="nsa",
                      nsa=NSAConfig(l=8, d=4, l_sel=8, n_sel=4, w=8, **{**REUSE, **nsa}))
    torch.manual_seed(0)
    model = Transformer(cfg).double()
    with torch.no_grad():  # scores of both signs and sizes: the indexers' picks differ from pooled ones
        for name, p in model.named_parameters():
            if ".indexer." in name:
                p.normal_(0.0, 0.5)
    return model


def _valid_picks(B: int, H_kv: int, T: int, frame_pos: torch.Tensor, seed: int) -> torch.Tensor:
    """[B, H_kv, T, N_SEL] ascending, -1 padded: for the query at (document) position p, blocks 0, its own and the
    one before, and random earlier ones (what any selector may return)."""
    g = torch.Generator().manual_seed(seed)
    picks = torch.full((B, H_kv, T, N_SEL), -1, dtype=torch.long)
    for b in range(B):
        for t in range(T):
            cur = int(frame_pos[b, t]) // L_SEL
            for h in range(H_kv):
                forced = {0, cur, max(cur - 1, 0)}
                rest = [j for j in torch.randperm(cur + 1, generator=g).tolist() if j not in forced]
                blocks = sorted(forced | set(rest[: N_SEL - len(forced)]))
                picks[b, h, t, : len(blocks)] = torch.tensor(blocks)
    return picks


def test_config_and_which_layers_have_an_indexer():
    with pytest.raises(ModelConfigError, match="indexer_every must be >= 1"):
        NSAConfig(selector="indexer", indexer_every=0).validate()
    with pytest.raises(ModelConfigError, match="indexer_every=2 needs nsa.selector=indexer"):
        NSAConfig(indexer_every=2).validate()
    model = _model(n_layers=5)
    owners = [i for i, blk in enumerate(model.blocks) if blk.attn.indexer is not None]
    assert owners == [0, 2, 4]
    assert {k.split(".")[1] for k in model.state_dict() if ".indexer." in k} == {"0", "2", "4"}


@pytest.mark.parametrize("documents", [False, True])
def test_a_reusing_layer_selects_the_given_picks(documents):
    """The layer after an indexer layer computes, with given picks, what the float64 per-token reference computes
    with them (plain, and packed documents with document-relative picks); it passes them on unchanged."""
    T = 70
    assert make_layer(nsa_overrides=REUSE).indexer is not None  # layer 0: an indexer of its own
    torch.manual_seed(3)
    reuser = NativeSparseAttention(small_cfg(REUSE), layer=1).double().to(DEVICE)
    assert reuser.indexer is None
    x = make_input(2, T, seed=4)
    if documents:
        docs = Documents(starts_of([[20, 37, 13], [70]]))
        positions, kwargs, ref_kwargs = docs.positions, dict(documents=docs), dict(doc_start=docs.start)
        rope = (rope_for(T)[0][positions], rope_for(T)[1][positions])
    else:
        positions, kwargs, ref_kwargs, rope = torch.arange(T).expand(2, T), {}, {}, rope_for(T)
    picks = _valid_picks(2, reuser.n_kv_heads, T, positions, seed=5)
    with torch.no_grad():
        y, idx = reuser(x, rope, return_indices=True, picks=picks, **kwargs)
        assert torch.equal(idx, picks) and reuser.picks_out is picks
        own, own_idx = reuser(x, rope, return_indices=True, **kwargs)  # no picks given: its own pooled scores
    ref, ref_idx = reference_forward(reuser, x, rope_for(T), picks=picks, **ref_kwargs)
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-10)
    assert torch.equal(sorted_blocks(idx), ref_idx)
    assert not torch.equal(own_idx, picks) and reuser.picks_out is None  # the picks decide


def _attention_picks(model: Transformer, run) -> list[torch.Tensor | None]:
    """Each layer's picks_out after `run()`."""
    run()
    return [blk.attn.picks_out for blk in model.blocks]


def test_the_model_threads_each_indexer_layers_picks():
    model = _model(n_layers=4).eval()
    ids = torch.randint(1, 64, (2, 96), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        out = _attention_picks(model, lambda: model(ids))
    assert out[1] is out[0] and out[3] is out[2]  # layer 1 reused layer 0's picks, layer 3 layer 2's
    assert not torch.equal(out[2], out[0])  # layer 2 picked with its own indexer
    # the warm-up: indexers learn, every layer selects by its own pooled scores and nothing is passed on; the model
    # then computes what k = 1 computes during its warm-up on the same weights
    every = _model(n_layers=4, indexer_every=1).eval()
    every.load_state_dict(model.state_dict(), strict=False)  # k = 1 has indexers in layers 1 and 3 too (unused)
    for m in (model, every):
        m.set_indexer_selects(False)
    with torch.no_grad():
        warm = _attention_picks(model, lambda: model(ids))
        torch.testing.assert_close(model(ids), every(ids), rtol=0, atol=1e-12)
    assert warm == [None] * 4


def test_training_forward_kl_only_in_indexer_layers_and_checkpointing_keeps_the_picks():
    """A training forward leaves a KL term in layers 0 and 2 only; with every block's activations recomputed in the
    backward (model.checkpoint_every = 1) the loss and every gradient are those of the plain backward."""
    model = _model(n_layers=4).train()
    ids = torch.randint(1, 64, (2, 80), generator=torch.Generator().manual_seed(7))
    grads = []
    for every in (0, 1):
        model.zero_grad()
        model.checkpoint_every = every
        loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
        assert [blk.attn.indexer_loss is not None for blk in model.blocks] == [True, False, True, False]
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=0, atol=1e-12)
    assert grads[0][1].keys() == grads[1][1].keys() and any(".indexer." in n for n in grads[0][1])
    for name, g in grads[0][1].items():
        torch.testing.assert_close(grads[1][1][name], g, rtol=0, atol=1e-12, msg=name)


def test_packed_documents_equal_each_document_alone():
    model = _model().eval()
    model.document_eos_id = 0
    lengths = [29, 50, 17]
    # no token repeated within a document: no exact tie between a document's indexer scores, which the packed and
    # the alone paths (matmuls of different shapes) could break apart differently on some CPUs (distinct_ids)
    ids = torch.cat([distinct_ids(1, n, 64, seed=8 + i)[0] for i, n in enumerate(lengths)])
    ids[torch.tensor(lengths).cumsum(0)[:-1]] = 0
    with torch.no_grad():
        packed = model(ids[None])
        alone = torch.cat([model(doc[None]) for doc in ids.split(lengths)], dim=1)
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-10)


def test_cached_decoding_equals_the_full_forward():
    """Chunked prefill (the second chunk from position 21) and one-token steps: the reusing layer takes the indexer
    layer's picks of the same step, as the full forward's layers do."""
    model = _model().eval()
    ids = distinct_ids(2, 60, 64, seed=9)  # no repeated token: no exact tie between indexer scores (distinct_ids)
    with torch.no_grad():
        full = model(ids)
    torch.testing.assert_close(decode_in_pieces(model, ids), full, rtol=0, atol=1e-10)
