"""Selection health (nsa/attention/selection_health.py, nsa/gate_health.py): the oracle recall of the selection
against a float64 brute force built from masks, the share of chosen blocks outside the window against a case
worked by hand, the raw gate means against forced gates, and what the layer records for them."""
from __future__ import annotations

import math

import pytest
import torch

import nsa.attention.selection_health as sh
from nsa.attention.documents import Documents
from nsa.attention.selection_health import (
    gate_means,
    outside_window_counts,
    outside_window_share,
    recall_sample,
    selection_recall,
)
from nsa.gate_health import gate_health, selection_health, set_gate_stats
from nsa.model import Transformer
from tests.nsa._nsa_helpers import DEVICE, L_SEL, decode_last_with_stats, N_SEL, W, make_input, make_layer, rope_for, small_cfg, starts_of


def brute_recall(q, k, block_idx, q_pos, k_base, l_sel: int) -> torch.Tensor:
    """float64, whole matrices: q [H, Tq, hd], k [H_kv, Tk, hd], block_idx [H_kv, Tq, n] (-1 none), q_pos and
    k_base [Tq] -> mean over (head, query) of the softmax mass (over the query's visible keys) in its chosen blocks."""
    q, k = q.double(), k.double()
    H, Tq, hd = q.shape
    G = H // k.shape[0]
    kh = k.repeat_interleave(G, dim=0)  # [H, Tk, hd]: query head h reads KV head h // G
    bh = block_idx.repeat_interleave(G, dim=0)  # [H, Tq, n]: a group shares its KV head's blocks
    pos = torch.arange(k.shape[1], device=k.device)[None, :] - k_base[:, None]  # [Tq, Tk] position in the document
    visible = (pos >= 0) & (pos <= q_pos[:, None])  # [Tq, Tk]
    key_block = torch.div(pos, l_sel, rounding_mode="floor")  # [Tq, Tk]
    chosen = (key_block[None, :, :, None] == bh[:, :, None, :]).any(-1) & visible  # [H, Tq, Tk]
    a = torch.softmax((q @ kh.transpose(1, 2) / math.sqrt(hd)).masked_fill(~visible, -math.inf), dim=-1)
    return (a * chosen).sum(-1).mean()


def _doc_rope(docs: Documents, T: int):
    cos, sin = rope_for(T)
    return cos[docs.positions], sin[docs.positions]


# ---- recall -----------------------------------------------------------------------------------------
def test_recall_matches_brute_force_with_gqa_documents_and_empty_picks():
    g = torch.Generator().manual_seed(0)
    H, H_kv, hd, n, l_sel = 6, 2, 8, 3, 4
    lengths = [13, 30, 1, 20]  # packed documents of one row; T = 64
    T = sum(lengths)
    start = torch.tensor([sum(lengths[:i]) for i, m in enumerate(lengths) for _ in range(m)])  # [T]
    q_pos, k_base = torch.arange(T) - start, start  # the frame: frame[0], frame[1]
    q, k = torch.randn(H, T, hd, generator=g, dtype=torch.float64), torch.randn(H_kv, T, hd, generator=g, dtype=torch.float64)
    current = q_pos // l_sel  # [T]
    block_idx = torch.randint(0, 10**6, (H_kv, T, n), generator=g) % (current[:, None] + 2) - 1  # in [-1, current]
    assert (block_idx == -1).any() and (block_idx > 0).any()
    sample = {"q": q, "k": k, "block_idx": block_idx, "q_pos": q_pos, "k_base": k_base}
    expected = brute_recall(q, k, block_idx, q_pos, k_base, l_sel)
    assert 0.2 < expected < 0.95  # a case where the picks matter
    for max_scores in (H * T * 5, 1 << 24):  # 13 chunks (the last short), one chunk
        got = selection_recall(sample, l_sel, max_scores=max_scores)
        assert got.dtype == torch.float32 and got.dim() == 0
        torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-6)
    # a bf16 sample (the trainer's autocast) computes in float32
    low = selection_recall({**sample, "q": q.bfloat16(), "k": k.bfloat16()}, l_sel)
    torch.testing.assert_close(low.double(), brute_recall(q.bfloat16(), k.bfloat16(), block_idx, q_pos, k_base, l_sel),
                               rtol=0, atol=1e-5)


def test_recall_is_one_when_the_chosen_blocks_cover_every_visible_key():
    """T = 40 with l' = 16 and n = 4: no query has more than 3 blocks, so every one is chosen."""
    layer = make_layer(seed=3)
    layer.stats_enabled = True
    T = 40
    x = make_input(2, T)
    layer(x, rope_for(T))
    assert selection_recall(layer.last_sample, L_SEL).item() == pytest.approx(1.0, abs=1e-6)
    docs = Documents(starts_of([[17, 23], [40]]).to(DEVICE))
    layer(x, _doc_rope(docs, T), documents=docs)
    assert selection_recall(layer.last_sample, L_SEL).item() == pytest.approx(1.0, abs=1e-6)


def test_the_layer_keeps_its_own_queries_keys_and_blocks_for_recall():
    """What the layer keeps (row 0) gives the brute-force recall of the forward's q, selection keys and blocks."""
    layer = make_layer(seed=5)
    layer.stats_enabled = True
    T = 100  # a 100-token document has 7 blocks of 16 > n = 4: recall < 1
    x = make_input(2, T, seed=2)
    docs = Documents(starts_of([[20, 80], [100]]).to(DEVICE))  # row 0 (the one kept) packed
    for documents, rope in ((None, rope_for(T)), (docs, _doc_rope(docs, T))):
        _, idx = layer(x, rope, return_indices=True, documents=documents)
        q, branches = layer.project(x, rope)
        frame = docs.compressed(layer.cfg.l, layer.cfg.d).frame if documents is not None else None
        q_pos = frame[0][0] if frame is not None else torch.arange(T, device=DEVICE)
        k_base = frame[1][0] if frame is not None else torch.zeros(T, dtype=torch.long, device=DEVICE)
        expected = brute_recall(q[0], branches["sel"][0][0], idx[0], q_pos, k_base, L_SEL)
        assert 0.3 < expected < 1 - 1e-3
        torch.testing.assert_close(selection_recall(layer.last_sample, L_SEL).double(), expected, rtol=0, atol=1e-6)
        assert layer.last_sample["q"].requires_grad is False


def test_the_sample_keeps_every_sth_query_when_the_sequence_is_long(monkeypatch):
    monkeypatch.setattr(sh, "RECALL_QUERIES", 8)
    layer = make_layer(seed=6)
    layer.stats_enabled = True
    T = 100  # s = ceil(100 / 8) = 13: queries 0, 13, ..., 91
    x, rope = make_input(1, T, seed=4), rope_for(T)
    _, idx = layer(x, rope, return_indices=True)
    s = layer.last_sample
    assert s["q_pos"].tolist() == list(range(0, T, 13)) and s["q"].shape == (8, 8, 16) and s["k"].shape[1] == T
    q, branches = layer.project(x, rope)
    picked = torch.arange(0, T, 13, device=DEVICE)
    expected = brute_recall(q[0][:, picked], branches["sel"][0][0], idx[0][:, picked], picked, torch.zeros_like(picked), L_SEL)
    torch.testing.assert_close(selection_recall(s, L_SEL).double(), expected, rtol=0, atol=1e-6)


def test_a_decode_step_keeps_its_query_and_the_cached_keys():
    T = 70
    layer = make_layer(seed=4)
    x, rope = make_input(1, T), rope_for(T)
    idx = decode_last_with_stats(layer, x, rope)
    with torch.no_grad():
        q, branches = layer.project(x, rope)
    last = torch.tensor([T - 1], device=DEVICE)
    expected = brute_recall(q[0][:, last], branches["sel"][0][0], idx[0], last, torch.zeros_like(last), L_SEL)
    assert expected < 1 - 1e-3  # 5 blocks, 4 chosen
    torch.testing.assert_close(selection_recall(layer.last_sample, L_SEL).double(), expected, rtol=0, atol=1e-6)


def test_recall_sample_is_row_zero_and_detached():
    q = torch.randn(2, 4, 10, 8, requires_grad=True)
    k = torch.randn(2, 2, 10, 8, requires_grad=True)
    idx = torch.zeros(2, 2, 10, 3, dtype=torch.long)
    frame_pos = torch.arange(10).expand(2, 10)
    s = recall_sample(q, k, idx, frame_pos, frame_pos * 0 + 1)
    assert torch.equal(s["q"], q[0].detach()) and torch.equal(s["k"], k[0].detach()) and not s["q"].requires_grad
    assert s["k_base"].tolist() == [1] * 10 and torch.equal(recall_sample(q, k, idx, torch.arange(10))["k_base"], torch.zeros(10, dtype=torch.long))


# ---- outside the window ------------------------------------------------------------------------------
def test_outside_window_share_by_hand():
    """l' = 4, w = 6: the window of a query at p is p-5 .. p; block j (positions 4j .. 4j+3) is outside iff 4(j+1) <= p-5."""
    l_sel, w = 4, 6
    # row 0: p = 11 (window 6..11): blocks 0 out, 1 (4..7 holds 6, 7) in, 2 in            -> 1 of 3
    #        p = 13 (window 8..13): blocks 0 out, 1 (ends at 7) out, 3 in                  -> 2 of 3
    #        p = 5  (window 0..5):  blocks 0, 1 in                                         -> 0 of 2
    # row 1: p = 3  (window -2..3): block 0 in                                              -> 0 of 1
    #        p = 25 (window 20..25): blocks 0 out, 4 (16..19) out, 5 (20..23) in, 6 in      -> 2 of 4
    #        p = 9  (window 4..9): block 0 (ends at 3) out, 1 in, 2 in                      -> 1 of 3
    idx = torch.tensor([[[[0, 1, 2, -1], [0, 1, 3, -1], [0, 1, -1, -1]]],
                        [[[0, -1, -1, -1], [0, 4, 5, 6], [0, 1, 2, -1]]]])  # [B=2, H_kv=1, Tq=3, n=4]
    q_pos = torch.tensor([[11, 13, 5], [3, 25, 9]])  # [B, Tq]: packed documents
    counts = outside_window_counts(idx, q_pos, l_sel, w)
    assert counts.tolist() == [6.0, 16.0]
    assert outside_window_share(counts)["sel_outside_window"].item() == pytest.approx(6 / 16)
    assert outside_window_counts(idx[:1], q_pos[0], l_sel, w).tolist() == [3.0, 8.0]  # one document: q_pos [Tq]
    assert outside_window_share(torch.zeros(2))["sel_outside_window"].item() == 0.0  # no picks: 0, not NaN


def test_the_layer_records_the_outside_window_share_of_its_picks():
    layer = make_layer(seed=3)
    layer.stats_enabled = True
    T = 100
    _, idx = layer(make_input(2, T), rope_for(T), return_indices=True)
    picks = [(t, j) for b in idx.tolist() for h in b for t, row in enumerate(h) for j in row if j >= 0]
    outside = sum((j + 1) * L_SEL <= t - W + 1 for t, j in picks)
    assert 0 < outside < len(picks)
    torch.testing.assert_close(layer.last_stats["sel_outside_window"].double().cpu(),
                               torch.tensor(outside / len(picks), dtype=torch.float64))


# ---- gate means ----------------------------------------------------------------------------------------
def test_gate_means_are_the_raw_gates():
    layer = make_layer(seed=3)
    layer.stats_enabled = True
    x, rope = make_input(2, 30), rope_for(30)
    layer.forced_gates = (0.2, 0.7, 0.9)
    layer(x, rope)
    s = layer.last_stats
    for name, value in zip(("cmp", "sel", "win"), (0.2, 0.7, 0.9)):
        assert s[f"gate_mean_{name}"].item() == pytest.approx(value, abs=1e-6)  # float32 statistics
    assert s["gate_share_win"].item() == pytest.approx(0.9 / 1.8, abs=1e-6)  # the share is the normalised one
    layer.forced_gates = None
    layer(x, rope)
    means = layer.gates(x).double().mean(dim=(0, 1, 2))  # [3]
    for i, name in enumerate(("cmp", "sel", "win")):
        torch.testing.assert_close(layer.last_stats[f"gate_mean_{name}"].double(), means[i], rtol=0, atol=1e-6)
    assert sorted(gate_means(torch.rand(2, 5, 4, 3))) == ["gate_mean_cmp", "gate_mean_sel", "gate_mean_win"]


# ---- per layer, over a model ----------------------------------------------------------------------------
def test_selection_health_per_layer_of_a_model():
    torch.manual_seed(0)
    model = Transformer(small_cfg(vocab_size=97, n_layers=3, ffn_dim=64, max_seq_len=128)).to(DEVICE)
    ids = torch.randint(0, 97, (2, 100), device=DEVICE)
    assert selection_health(model) == {}
    set_gate_stats(model, True)
    model(ids)
    health, means = selection_health(model), gate_health(model)
    layers = [blk.attn for blk in model.blocks]
    assert list(health) == ["sel_recall", "sel_outside_window", "gate_mean_cmp", "gate_mean_sel", "gate_mean_win"]
    assert all(v.shape == (3,) for v in health.values())
    for i, layer in enumerate(layers):
        assert health["sel_recall"][i] == selection_recall(layer.last_sample, L_SEL)
        assert health["gate_mean_sel"][i] == layer.last_stats["gate_mean_sel"]
    assert ((health["sel_recall"] > 0) & (health["sel_recall"] < 1)).all()  # T = 100 > n l' = 64
    torch.testing.assert_close(means["sel_outside_window"], health["sel_outside_window"].mean())
    set_gate_stats(model, False)
    assert all(layer.last_sample is None for layer in layers) and selection_health(model) == {}
    assert N_SEL * L_SEL < 100
