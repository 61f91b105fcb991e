"""nsa.selector=indexer (nsa/attention/indexer.py): the layer against the float64 per-token reference (which spells
the indexer's scores out), causality by perturbing the future, the KL term moving the indexer and nothing else, the
warm-up falling back to pooled picks, decode and chunked prefill equal to one prefill, and the config's refusals."""
from __future__ import annotations

import pytest
import torch

from nsa.attention.impl import index_scores as index_scores_module
from nsa.attention.impl.index_scores import candidate_mask, dense_block_mass, indexer_kl
from nsa.attention.reference import reference_forward
from nsa.config import ModelConfig, ModelConfigError, NSAConfig
from nsa.model import Transformer
from tests.nsa._nsa_helpers import L_SEL, make_input, make_layer, rope_for, sorted_blocks

INDEXER = dict(selector="indexer", indexer_heads=2, indexer_dim=8, gate_init="equal")


def indexer_layer(seed: int = 3, **overrides):
    layer = make_layer(seed=seed, nsa_overrides={**INDEXER, **overrides})
    with torch.no_grad():  # scores of both signs and sizes: ReLU and the head weights both matter
        for p in layer.indexer.parameters():
            p.normal_(0.0, 0.5)
    return layer


POOLS = ["keys", "scores"]


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize("T", [17, 64, 100])
def test_layer_matches_the_float64_reference(T, pool, kernel="auto"):
    layer = indexer_layer(indexer_pool=pool, kernel=kernel)
    x, rope = make_input(2, T, seed=4), rope_for(T)
    with torch.no_grad():
        y, idx = layer(x, rope, return_indices=True)
    ref, ref_idx = reference_forward(layer, x, rope)
    assert torch.equal(sorted_blocks(idx), ref_idx)
    torch.testing.assert_close(y, ref, rtol=1e-9, atol=1e-9)
    # the indexer really decides: pooled scoring picks other blocks for some queries
    pooled = make_layer(seed=3, nsa_overrides={"gate_init": "equal"})
    pooled.load_state_dict({k: v for k, v in layer.state_dict().items() if not k.startswith("indexer.")})
    with torch.no_grad():
        _, pooled_idx = pooled(x, rope, return_indices=True)
    if T > 4 * L_SEL:  # from 5 blocks on a query has 2 or more candidates for its one free place
        assert not torch.equal(pooled_idx, idx)


@pytest.mark.parametrize("pool", POOLS)
def test_no_pick_reads_the_future(pool):
    T, t = 100, 57
    layer = indexer_layer(indexer_pool=pool)
    x = make_input(1, T, seed=5)
    changed = x.clone()
    changed[:, t + 1:] = torch.randn_like(changed[:, t + 1:]) * 10
    with torch.no_grad():
        y, idx = layer(x, rope_for(T), return_indices=True)
        y2, idx2 = layer(changed, rope_for(T), return_indices=True)
    assert torch.equal(idx[:, :, : t + 1], idx2[:, :, : t + 1])
    torch.testing.assert_close(y[:, : t + 1], y2[:, : t + 1], rtol=0, atol=1e-12)
    assert not torch.equal(idx[:, :, t + 1:], idx2[:, :, t + 1:])  # the perturbation does reach later queries


def tiny_model(selector: str, kl: float = 1.0, seed: int = 0, **nsa) -> Transformer:
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64,
                      max_seq_len=128, attention="nsa",
                      nsa=NSAConfig(l=8, d=4, l_sel=8, n_sel=4, w=8, selector=selector, indexer_kl=kl,
                                    gate_init="equal", **nsa))
    torch.manual_seed(seed)
    return Transformer(cfg).double()


@pytest.mark.parametrize("target", ["compressed", "dense"])
def test_the_kl_term_moves_the_indexer_only_and_leaves_the_loss_value(target):
    idx, tgt = torch.randint(0, 64, (2, 96), generator=torch.Generator().manual_seed(1)).chunk(2, dim=0)
    grads, losses = {}, {}
    for kl in (1.0, 0.0):
        model = tiny_model("indexer", kl=kl, indexer_target=target)
        loss = model(idx, tgt)
        loss.backward()
        losses[kl] = loss.detach()
        grads[kl] = {n: p.grad for n, p in model.named_parameters()}
        if kl:
            kls = [blk.attn.indexer_loss.detach().sum() for blk in model.blocks]
            assert all(v > 0 for v in kls)  # a real KL, in every layer
    assert torch.equal(losses[1.0], losses[0.0])  # the term adds its gradient, not its value
    for name, g in grads[1.0].items():
        if ".indexer." in name:
            assert g is not None and g.abs().sum() > 0, name
            assert grads[0.0][name] is None, name  # the language-model loss never reaches the indexer
        else:
            assert torch.equal(g, grads[0.0][name]), name  # and the KL reaches nothing else


def test_the_kl_is_zero_where_the_indexer_ranks_as_the_target_and_positive_elsewhere():
    T, n_b = 40, 5
    target = torch.rand(1, 1, T, n_b, dtype=torch.float64)
    cand = candidate_mask(torch.arange(T), 8, n_b)
    assert not cand[:16].any() and cand[39].tolist() == [False, True, True, False, False]  # blocks 1, 2 at p=39
    same = torch.log(target)  # softmax(log p) = p on the candidates
    positions = torch.arange(T)
    assert indexer_kl(same, target, 8, positions).abs() < 1e-12
    assert indexer_kl(torch.zeros_like(target), target, 8, positions) > 1e-4


def dense_mass_by_loops(q, k, rows, l_sel, n_blocks, base):
    """dense_block_mass spelled out one (row, KV group, query) at a time: the softmax of each head over the keys
    base .. t, the heads summed, each key's probability added to block (key - base) // l'."""
    B, H_kv, G, R, hd = q.shape
    out = torch.zeros(B, H_kv, R, n_blocks, dtype=q.dtype)
    for b in range(B):
        for h in range(H_kv):
            for i, t in enumerate(rows.tolist()):
                first = int(base[b, i])
                keys = k[b, h, first:t + 1]  # [visible, hd]
                probs = torch.softmax(q[b, h, :, i] @ keys.T / hd ** 0.5, dim=-1).sum(0)  # [visible]
                for offset, p in enumerate(probs):
                    out[b, h, i, offset // l_sel] += p
    return out


@pytest.mark.parametrize("documents", [False, True])
def test_dense_target_is_each_querys_attention_summed_per_block(documents, monkeypatch):
    """nsa.indexer_target=dense: against the per-query loops (with packed documents: keys from the query's document
    start, blocks counted from it), across row slices (DENSE_ROWS made small); keys after a query, or before its
    document, change nothing of its row; a visible key does."""
    monkeypatch.setattr(index_scores_module, "DENSE_ROWS", 4)  # 11 rows: slices of 4, 4 and 3
    g = torch.Generator().manual_seed(4)
    B, H_kv, G, T, hd, l_sel = 2, 2, 3, 45, 8, 8
    q = torch.randn(B, H_kv, G, 11, hd, generator=g, dtype=torch.float64) * 2
    k = torch.randn(B, H_kv, T, hd, generator=g, dtype=torch.float64)
    rows = torch.arange(11) * T // 11  # [11], as kl_row_indices spaces them
    base = (torch.div(rows, 13, rounding_mode="floor") * 13).expand(B, -1) if documents else None  # 13-token documents
    n_blocks = -(-T // l_sel)
    got = dense_block_mass(q, k, rows, l_sel, n_blocks, base=base)
    starts = torch.zeros(B, 11, dtype=torch.long) if base is None else base
    torch.testing.assert_close(got, dense_mass_by_loops(q, k, rows, l_sel, n_blocks, starts), rtol=0, atol=1e-12)
    every_head_sums_to_one = torch.full((B, H_kv, 11), float(G), dtype=torch.float64)
    torch.testing.assert_close(got.sum(-1), every_head_sums_to_one, rtol=0, atol=1e-12)
    i, t = 6, int(rows[6])
    first = int(base[0, i]) if documents else 0
    later, earlier = k.clone(), k.clone()
    later[:, :, t + 1:] += 5.0  # after the query: not visible
    if documents:
        later[:, :, :first] -= 5.0  # another document's keys
    earlier[:, :, first + 1] += 5.0  # a visible key
    assert torch.equal(dense_block_mass(q, later, rows, l_sel, n_blocks, base=base)[:, :, i], got[:, :, i])
    assert not torch.allclose(dense_block_mass(q, earlier, rows, l_sel, n_blocks, base=base)[:, :, i], got[:, :, i])


def test_warm_up_picks_by_pooled_scores():
    T = 100
    layer = indexer_layer()
    pooled = make_layer(seed=3, nsa_overrides={"gate_init": "equal"})
    pooled.load_state_dict({k: v for k, v in layer.state_dict().items() if not k.startswith("indexer.")})
    x, rope = make_input(2, T, seed=6), rope_for(T)
    layer.indexer_selects = False
    with torch.no_grad():
        y, idx = layer(x, rope, return_indices=True)
        y_pooled, idx_pooled = pooled(x, rope, return_indices=True)
    assert torch.equal(idx, idx_pooled) and torch.equal(y, y_pooled)


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize("chunks", [[1] * 70, [3, 5, 4, 4, 16, 1, 7, 30], [70]],
                         ids=["token-by-token", "irregular", "one-chunk"])
def test_decode_and_chunked_prefill_equal_full_prefill(chunks, pool):
    T = 70
    layer = indexer_layer(seed=7, indexer_pool=pool)
    x = make_input(2, T, seed=8)
    rope = rope_for(T)
    with torch.no_grad():
        y_full, idx_full = layer(x, rope, return_indices=True)
        cache, outs, idxs, t = layer.new_cache(), [], [], 0
        for n in chunks:
            y, idx = layer(x[:, t: t + n], (rope[0][t: t + n], rope[1][t: t + n]), cache, return_indices=True)
            outs.append(y)
            idxs.append(idx)
            t += n
    assert torch.equal(torch.cat(idxs, 2), idx_full)
    torch.testing.assert_close(torch.cat(outs, 1), y_full, rtol=0, atol=1e-12)
    if pool == "keys":
        assert cache.index_blocks.shape[1] == T // L_SEL and cache.index_tokens is None  # a key per block
    else:
        assert cache.index_tokens.shape[1] == T and cache.index_blocks is None  # a key per token


@pytest.mark.parametrize("overrides, message", [
    (dict(selector="learned"), "nsa.selector='learned'; valid: pooled, indexer"),
    (dict(selector="indexer", indexer_heads=0), "nsa.indexer_heads must be positive, got 0"),
    (dict(selector="indexer", indexer_dim=-1), "nsa.indexer_dim must be positive, got -1"),
    (dict(selector="indexer", indexer_pool="mean"), "nsa.indexer_pool='mean'; valid: keys, scores"),
    (dict(selector="indexer", indexer_kl=-0.5), "nsa.indexer_kl must be >= 0, got -0.5"),
    (dict(selector="indexer", indexer_target="sparse"), "nsa.indexer_target='sparse'; valid: compressed, dense"),
    (dict(selector="indexer", indexer_warmup_steps=-1), "nsa.indexer_warmup_steps must be >= 0, got -1"),
    (dict(selector="indexer", indexer_lr_scale=0.0), "nsa.indexer_lr_scale must be positive, got 0.0"),
    (dict(selector="indexer", gates="window"), "nsa.selector=indexer needs selection: nsa.gates=window has none"),
])
def test_bad_indexer_keys_are_refused_in_one_line(overrides, message):
    with pytest.raises(ModelConfigError) as err:
        NSAConfig(**overrides).validate()
    assert str(err.value) == message


def test_pooled_layers_have_no_indexer():
    layer = make_layer(seed=3)
    assert layer.indexer is None and not any(k.startswith("indexer.") for k in layer.state_dict())


@pytest.mark.parametrize("pool", POOLS)
def test_packed_documents_equal_each_document_alone_and_the_reference(pool, kernel="auto"):
    """The indexer over packed documents scores each query's own document's blocks, keyed from the document's start:
    a packed window picks and computes what each document does alone, and what the per-token reference spells out."""
    from nsa.attention.documents import Documents
    from tests.nsa.test_nsa_documents import LAYOUTS, _alone, _doc_rope, _starts

    layer = indexer_layer(seed=5, indexer_pool=pool, kernel=kernel)
    T = 100
    x = make_input(2, T, seed=6).requires_grad_(True)
    docs = Documents(_starts(LAYOUTS))
    y, idx = layer(x, _doc_rope(docs), documents=docs, return_indices=True)
    assert layer.indexer_loss is not None and layer.indexer_loss.sum() > 0  # the KL over every document's queries
    alone = _alone(layer, x, LAYOUTS, rope=True)
    torch.testing.assert_close(y, alone, rtol=0, atol=1e-10)
    g = torch.randn_like(y)
    lm = [p for n, p in layer.named_parameters() if not n.startswith("indexer.")]
    for a, b in zip(torch.autograd.grad((y * g).sum(), [x, *lm]), torch.autograd.grad((alone * g).sum(), [x, *lm])):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    with torch.no_grad():
        y_ref, idx_ref = reference_forward(layer, x, rope_for(T), doc_start=docs.start)
    torch.testing.assert_close(y.detach(), y_ref, rtol=0, atol=1e-10)
    assert torch.equal(sorted_blocks(idx), idx_ref)


def test_checkpoints_with_three_indexer_projections_load():
    """Before the indexer had one projection its checkpoints held q_proj, w_proj and k_proj: they load into
    `projection` (stacked in its output order) and the layer computes what it did."""
    layer = indexer_layer(indexer_pool="scores")
    state = layer.state_dict()
    H_kv, h, e = layer.n_kv_heads, layer.cfg.indexer_heads, layer.cfg.indexer_dim
    q_w, w_w, k_w = state.pop("indexer.projection.weight").split((H_kv * h * e, H_kv * h, e), dim=0)
    old = {**state, "indexer.q_proj.weight": q_w, "indexer.w_proj.weight": w_w, "indexer.k_proj.weight": k_w}
    loaded = make_layer(seed=11, nsa_overrides={**INDEXER, "indexer_pool": "scores"})
    loaded.load_state_dict(old)  # strict: no key missing or left over
    x, rope = make_input(1, 70, seed=2), rope_for(70)
    with torch.no_grad():
        y, idx = layer(x, rope, return_indices=True)
        y2, idx2 = loaded(x, rope, return_indices=True)
    assert torch.equal(idx, idx2) and torch.equal(y, y2)
