"""The selected branch with its RoPE distance capped (nsa/attention/impl/capped.py; the recall probe's --distance_cap):
a key more than `cap` positions before its query is read as if exactly `cap` before it. Checked against a float64
oracle that rotates every (query, key) pair's key at its own position max(s, t - cap), against the selected-attention
op when no key is that far, and in a model: causal, restored after the block, refused in one line where it cannot
apply."""
from __future__ import annotations

import math

import pytest
import torch

from nsa.attention import ops
from nsa.attention.impl.capped import capped_selected_attention
from nsa.config import ModelConfig, NSAConfig
from nsa.gate_health import distance_capped
from nsa.layers import RotaryEmbedding
from nsa.model import Transformer
from tests.nsa._nsa_helpers import decode_in_pieces, distinct_ids

B, H_KV, G, HD, L_SEL, N_SEL = 2, 2, 2, 8, 4, 4


def _inputs(T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q_raw = torch.randn(B, H_KV, G, T, HD, generator=g, dtype=torch.float64)
    k_raw, v = (torch.randn(B, H_KV, T, HD, generator=g, dtype=torch.float64) for _ in range(2))
    # each query: block 0, its own block, the previous one, and random earlier blocks; -1 where there are none left
    block_idx = torch.full((B, H_KV, T, N_SEL), -1, dtype=torch.long)
    for b in range(B):
        for h in range(H_KV):
            for t in range(T):
                cur = t // L_SEL
                forced = sorted({0, cur, max(cur - 1, 0)})
                rest = [j for j in torch.randperm(cur + 1, generator=g).tolist() if j not in forced]
                picks = forced + rest[: N_SEL - len(forced)]
                block_idx[b, h, t, : len(picks)] = torch.tensor(picks)
    return q_raw, k_raw, v, block_idx


def _oracle(q_raw, k_raw, v, block_idx, rope: RotaryEmbedding, cap: int) -> torch.Tensor:
    """Per query and key, in float64: the query rotated at t, the key at max(s, t - cap)."""
    T = q_raw.shape[-2]
    cos, sin = rope(torch.arange(T))
    rot = lambda x, p: torch.cat((x[:HD // 2] * cos[p] - x[HD // 2:] * sin[p],  # noqa: E731
                                  x[HD // 2:] * cos[p] + x[:HD // 2] * sin[p]))
    out = torch.zeros_like(q_raw)
    for b in range(B):
        for h in range(H_KV):
            for t in range(T):
                blocks = {j for j in block_idx[b, h, t].tolist() if j >= 0}
                keys = [s for s in range(t + 1) if s // L_SEL in blocks]
                for gq in range(G):
                    q = rot(q_raw[b, h, gq, t], t)
                    scores = torch.stack([q @ rot(k_raw[b, h, s], max(s, t - cap)) for s in keys]) / math.sqrt(HD)
                    out[b, h, gq, t] = torch.softmax(scores, 0) @ v[b, h, keys]
    return out


@pytest.mark.parametrize("cap", [1, 5, 12])
def test_capped_equals_the_per_pair_oracle(cap):
    T = 29
    q_raw, k_raw, v, block_idx = _inputs(T, seed=cap)
    rope = RotaryEmbedding(HD, 10000.0)
    cos, sin = rope(torch.arange(T))
    q, k = ops.rotary(q_raw.flatten(1, 2), cos, sin).view_as(q_raw), ops.rotary(k_raw, cos, sin)
    at_cap = tuple(r[0] for r in rope(torch.tensor([cap])))
    got = capped_selected_attention(q, k, v, block_idx, (cos, sin), at_cap, L_SEL, cap)
    want = _oracle(q_raw, k_raw, v, block_idx, rope, cap)
    # the RoPE tables are float32 (cos^2 + sin^2 = 1 to ~1e-7): un-rotating a key and rotating the query again at
    # the cap carries that rounding, which the oracle (each key rotated once, at its capped position) does not
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
    uncapped = _oracle(q_raw, k_raw, v, block_idx, rope, T)
    assert (got - uncapped).abs().max() > 1e-3  # the cap changes what far keys score
    for q_start in (T - 1, 11):  # a decode step, a prefill chunk: the queries from q_start over every key before
        part = capped_selected_attention(q[..., q_start:, :], k, v, block_idx[:, :, q_start:], (cos, sin), at_cap,
                                         L_SEL, cap, q_start=q_start)
        torch.testing.assert_close(part, want[..., q_start:, :], rtol=0, atol=2e-6)


def test_a_cap_beyond_every_distance_is_the_selected_branch():
    T = 33
    q_raw, k_raw, v, block_idx = _inputs(T, seed=3)
    rope = RotaryEmbedding(HD, 10000.0)
    cos, sin = rope(torch.arange(T))
    q, k = ops.rotary(q_raw.flatten(1, 2), cos, sin).view_as(q_raw), ops.rotary(k_raw, cos, sin)
    want = ops.selected_attention(q, k, v, block_idx, 0, L_SEL, 16)
    for cap in (T - 1, T + 10):
        at_cap = tuple(r[0] for r in rope(torch.tensor([cap])))
        torch.testing.assert_close(capped_selected_attention(q, k, v, block_idx, (cos, sin), at_cap, L_SEL, cap),
                                   want, rtol=0, atol=1e-12)


def _model(**overrides) -> Transformer:
    fields = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64,
                  max_seq_len=128, attention="nsa", nsa=NSAConfig(l=8, d=4, l_sel=8, n_sel=4, w=8, gate_init="equal"))
    cfg = ModelConfig(**{**fields, **overrides})
    torch.manual_seed(0)
    return Transformer(cfg).double().eval()


def test_in_a_model_causal_and_restored():
    model = _model()
    T, t = 96, 50
    x = torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(1))
    changed = x.clone()
    changed[:, t + 1:] = (changed[:, t + 1:] + 7) % 64
    with torch.no_grad():
        trained = model(x)
        with distance_capped(model, 16) as layers:
            capped, capped_changed = model(x), model(changed)
        after = model(x)
        with distance_capped(model, T):
            far_cap = model(x)
    assert layers == 2
    assert all(layer.distance_cap is None for layer in model.modules() if hasattr(layer, "distance_cap"))
    assert torch.equal(after, trained)
    torch.testing.assert_close(far_cap, trained, rtol=0, atol=1e-10)
    assert not torch.allclose(capped, trained)  # keys beyond 16 positions are read otherwise
    torch.testing.assert_close(capped[:, : t + 1], capped_changed[:, : t + 1], rtol=0, atol=1e-12)  # no future key
    # before position cap + 1 no key is that far: the same model
    torch.testing.assert_close(capped[:, :17], trained[:, :17], rtol=0, atol=1e-10)


def test_refusals():
    with pytest.raises(ValueError, match="must be >= 1"):
        with distance_capped(_model(), 0):
            pass
    with pytest.raises(ValueError, match="plain RoPE"):
        with distance_capped(_model(pos_emb="learned"), 8):
            pass
    with pytest.raises(ValueError, match="plain RoPE"):
        with distance_capped(_model(rope_scale=4.0, rope_scaling="yarn"), 8):
            pass
    dense = _model(attention="dense")
    with pytest.raises(ValueError, match="no NSA layer"):
        with distance_capped(dense, 8):
            pass


def test_packed_documents_equal_each_document_alone():
    """With packed documents each query reads its own document's selected keys, distances counted in it: a packed
    window equals each document alone (the recall probe packs its documents this way)."""
    model = _model()
    eos = 0
    model.document_eos_id = eos
    lengths = [13, 40, 5, 38]  # a cut-off tail, documents longer and shorter than the cap
    ids = torch.randint(1, 64, (sum(lengths),), generator=torch.Generator().manual_seed(2))
    starts = torch.tensor(lengths).cumsum(0)[:-1]
    ids[starts] = eos
    with torch.no_grad(), distance_capped(model, 9):
        packed = model(ids[None])
        alone = torch.cat([model(doc[None]) for doc in ids.split(lengths)], dim=1)
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-10)
    with torch.no_grad():
        assert not torch.allclose(packed, model(ids[None]))  # the 40- and 38-token documents have far keys


def _capped_model(cap: int, **nsa) -> Transformer:
    fields = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64,
                  max_seq_len=128, attention="nsa",
                  nsa=NSAConfig(l=8, d=4, l_sel=8, n_sel=4, w=8, gate_init="equal", sel_distance_cap=cap, **nsa))
    torch.manual_seed(0)
    return Transformer(ModelConfig(**fields)).double()


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("selector", ["pooled", "indexer"])
def test_the_config_is_the_probe(documents, selector):
    """nsa.sel_distance_cap (trained with it) computes what the probe computes on the same weights; the checkpoint
    keys are the uncapped model's (the cap's RoPE buffer is not saved)."""
    extra = dict(selector="indexer", indexer_pool="scores", indexer_target="dense") if selector == "indexer" else {}
    capped, plain = _capped_model(12, **extra), _capped_model(0, **extra)
    assert capped.state_dict().keys() == plain.state_dict().keys()
    plain.load_state_dict(capped.state_dict())
    ids = torch.randint(1, 64, (2, 80), generator=torch.Generator().manual_seed(3))
    if documents:
        for model in (capped, plain):
            model.document_eos_id = 0
        ids[0, [17, 50]] = 0
        ids[1, 33] = 0
    with torch.no_grad():
        want = capped(ids)
        with distance_capped(plain, 12):
            got = plain(ids)
        uncapped = plain(ids)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert not torch.allclose(want, uncapped)
    if selector == "indexer":  # a training forward: the dense target reads far keys at the cap too
        kl = {}
        for name, model, cap in (("capped", capped, None), ("probe", plain, 12), ("plain", plain, None)):
            with distance_capped(model, cap):
                model(ids, ids)
            kl[name] = torch.stack([m.last_indexer_kl for m in model.modules() if getattr(m, "indexer", None)])
        torch.testing.assert_close(kl["probe"], kl["capped"], rtol=0, atol=1e-12)
        assert not torch.allclose(kl["plain"], kl["capped"])


def test_gradients_of_the_capped_branch():
    """The capped branch's backward is autograd's through its torch ops: checked against finite differences."""
    T = 14
    q_raw, k_raw, v, block_idx = _inputs(T, seed=4)
    rope = RotaryEmbedding(HD, 10000.0)
    cos, sin = rope(torch.arange(T))
    at_cap = tuple(r[0] for r in rope(torch.tensor([5])))
    q = ops.rotary(q_raw.flatten(1, 2), cos, sin).view_as(q_raw).requires_grad_()
    k, v = ops.rotary(k_raw, cos, sin).requires_grad_(), v.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda q, k, v: capped_selected_attention(q, k, v, block_idx, (cos, sin), at_cap, L_SEL, 5), (q, k, v))


def test_dense_target_reads_far_keys_at_the_cap():
    """The indexer's dense target with the cap (nsa/attention/indexer.py dense_block_mass, far=...): each query's
    softmax over its visible keys with far keys scored at the cap, summed per block and over the group's heads;
    against per-query loops in float64."""
    from nsa.attention.impl.capped import capped_queries, unrotated
    from nsa.attention.impl.index_scores import dense_block_mass

    T, cap = 30, 7
    q_raw, k_raw, _, _ = _inputs(T, seed=6)
    rope = RotaryEmbedding(HD, 10000.0)
    cos, sin = rope(torch.arange(T))
    at_cap = tuple(r[0] for r in rope(torch.tensor([cap])))
    q, k = ops.rotary(q_raw.flatten(1, 2), cos, sin).view_as(q_raw), ops.rotary(k_raw, cos, sin)
    rows = torch.tensor([0, 3, 9, 17, 29])
    n_blocks = -(-T // L_SEL)
    q_rows = q[:, :, :, rows]
    far = (capped_queries(q_rows, (cos, sin), at_cap, rows), unrotated(k, (cos, sin)), cap)
    got = dense_block_mass(q_rows, k, rows, L_SEL, n_blocks, far=far)
    rot = lambda x, p: torch.cat((x[:HD // 2] * cos[p] - x[HD // 2:] * sin[p],  # noqa: E731
                                  x[HD // 2:] * cos[p] + x[:HD // 2] * sin[p]))
    want = torch.zeros_like(got)
    for b in range(B):
        for h in range(H_KV):
            for i, t in enumerate(rows.tolist()):
                for gq in range(G):
                    qt = rot(q_raw[b, h, gq, t], t)
                    scores = torch.stack([qt @ rot(k_raw[b, h, s], max(s, t - cap)) for s in range(t + 1)])
                    probs = torch.softmax(scores / math.sqrt(HD), 0)
                    for s in range(t + 1):
                        want[b, h, i, s // L_SEL] += probs[s]
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)  # float32 RoPE tables: see the oracle test above


def test_config_refusals():
    from nsa.config import ModelConfigError

    with pytest.raises(ModelConfigError, match="sel_distance_cap must be >= 0"):
        NSAConfig(sel_distance_cap=-1).validate()
    with pytest.raises(ModelConfigError, match="needs selection"):
        NSAConfig(sel_distance_cap=8, gates="window").validate()
    with pytest.raises(ModelConfigError, match="sel_distance_cap_from_step must be >= 0"):
        NSAConfig(sel_distance_cap=8, sel_distance_cap_from_step=-1).validate()
    with pytest.raises(ModelConfigError, match="needs nsa.sel_distance_cap > 0"):
        NSAConfig(sel_distance_cap_from_step=5).validate()
    for bad in (dict(pos_emb="learned"), dict(rope_scale=2.0, rope_scaling="yarn")):
        with pytest.raises(ModelConfigError, match="needs plain RoPE"):
            ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, attention="nsa",
                        nsa=NSAConfig(sel_distance_cap=8), **bad)


@pytest.mark.parametrize("selector", ["pooled", "indexer"])
def test_cached_decoding_equals_the_full_forward(selector):
    """A model trained with nsa.sel_distance_cap decodes with its caches: a prefill in chunks (the second from a
    position past the cap) and one-token steps compute what one full forward computes, far keys read at the cap
    in both; the probe (a model trained without the cap) still runs full forwards only, refused in one line."""
    from nsa.config import ModelConfigError

    extra = dict(selector="indexer", indexer_pool="scores", indexer_target="dense") if selector == "indexer" else {}
    model, plain = _capped_model(12, **extra).eval(), _capped_model(0, **extra).eval()
    plain.load_state_dict(model.state_dict())
    ids = distinct_ids(2, 60, 64, seed=5)  # no repeated token: no exact tie between indexer scores (distinct_ids)
    with torch.no_grad():
        full = model(ids)
    torch.testing.assert_close(decode_in_pieces(model, ids), full, rtol=0, atol=1e-10)
    assert not torch.allclose(decode_in_pieces(plain, ids)[:, 21:], full[:, 21:])  # the cap is read in the steps
    with torch.no_grad(), distance_capped(plain, 12), pytest.raises(ModelConfigError, match="probe runs full"):
        plain(ids[:, :9], start_pos=0, caches=plain.new_caches())


def test_the_cap_switched_off_is_the_uncapped_model():
    """nsa.sel_distance_cap_from_step's first steps: a capped model with the cap switched off (set_distance_cap_on,
    as the trainer does before each step) computes what the uncapped model computes on the same weights, bit for
    bit, and switched back on what it computed before."""
    capped, plain = _capped_model(12), _capped_model(0)
    plain.load_state_dict(capped.state_dict())
    ids = torch.randint(1, 64, (2, 80), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        on = capped(ids)
        capped.set_distance_cap_on(False)
        off = capped(ids)
        capped.set_distance_cap_on(True)
        again = capped(ids)
        uncapped = plain(ids)
    assert torch.equal(off, uncapped) and torch.equal(again, on)
    assert not torch.allclose(on, off)
