"""Parameters, determinism, batch independence and gate-health statistics."""
from __future__ import annotations

import math

import pytest
import torch

from nsa.attention.gate_stats import gate_statistics
from nsa.config import ModelConfigError, NSAConfig
from nsa.gate_health import gate_health, set_gate_stats
from nsa.model import Transformer
from tests.nsa._nsa_helpers import DEVICE, decode_last_with_stats, make_input, make_layer, rope_for, small_cfg


@pytest.mark.parametrize("overrides", [{}, {"bias": True, "qk_norm": True}], ids=["plain", "bias+qk_norm"])
def test_every_parameter_gets_a_finite_nonzero_gradient(overrides):
    layer = make_layer(seed=1, **overrides)
    T = 70
    x = make_input(2, T)
    layer(x, rope_for(T)).square().sum().backward()
    names = {name for name, _ in layer.named_parameters()}
    for expected in ("kv_proj.weight", "compress_k.pos_enc", "compress_v.pos_enc", "compress_k.fc_in.weight",
                     "compress_v.fc_out.weight", "gate_mlp.0.weight", "gate_mlp.2.bias", "q_proj.weight", "proj.weight"):
        assert expected in names
    for name, p in layer.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name
    # each branch's K and V rows of the fused projection learn: (cmp k, cmp v, sel k, sel v, win k, win v)
    for i, rows in enumerate(layer.kv_proj.weight.grad.chunk(6, dim=0)):
        assert rows.abs().sum() > 0, f"kv_proj slice {i}"


def test_deterministic_and_batch_independent():
    T = 64
    layer = make_layer(seed=2)
    x, rope = make_input(3, T), rope_for(T)
    with torch.no_grad():
        y1, y2 = layer(x, rope), layer(x, rope)
        assert torch.equal(y1, y2)
        for b in range(3):
            torch.testing.assert_close(layer(x[b : b + 1], rope), y1[b : b + 1], rtol=0, atol=1e-12)
        x2 = x.clone()
        x2[1] = torch.randn_like(x2[1])
        y3 = layer(x2, rope)
        assert torch.equal(y3[0], y1[0]) and torch.equal(y3[2], y1[2])


def test_config_validation_errors_are_clear():
    for bad, msg in [(dict(d=3), "must divide nsa.l"), (dict(l=64, l_sel=32, d=16), "must be <="),
                     (dict(n_sel=2), "n_sel"), (dict(w=0), "nsa.w"), (dict(l_sel=24, d=16, l=16), "l_sel")]:
        with pytest.raises(ModelConfigError, match=msg):
            NSAConfig(**bad).validate()


def test_gate_stats_recorded_on_device_only_when_enabled():
    layer = make_layer(seed=3)
    T = 100
    x, rope = make_input(2, T), rope_for(T)
    layer(x, rope)
    assert layer.last_stats is None
    layer.stats_enabled = True
    layer(x, rope)
    stats = layer.last_stats
    for key in ("gate_entropy_mean", "gate_entropy_min", "gate_max_mean", "gate_collapse_frac", "gate_share_cmp",
                "gate_share_sel", "gate_share_win", "sel_free_frac", "sel_distance_mean", "sel_free_distance_mean"):
        assert stats[key].dim() == 0 and stats[key].device.type == DEVICE.type, key
    assert 0 < stats["gate_entropy_min"] <= stats["gate_entropy_mean"] <= math.log(2)
    shares = stats["gate_share_cmp"] + stats["gate_share_sel"] + stats["gate_share_win"]
    torch.testing.assert_close(shares, torch.ones_like(shares))
    # T=100, l'=16, n=4: queries in blocks >= 3 make 1 free pick out of 4; earlier ones none
    n_valid = sum(min(4, p // 16 + 1) for p in range(T))
    n_free = sum(1 for p in range(T) if p // 16 >= 3)
    torch.testing.assert_close(stats["sel_free_frac"].double().cpu(), torch.tensor(n_free / n_valid, dtype=torch.float64))
    assert stats["sel_free_distance_mean"] >= 2  # free picks lie at or before block current-2


def test_gate_stats_detect_collapse_and_balance():
    layer = make_layer(seed=3)
    layer.stats_enabled = True
    x, rope = make_input(1, 20), rope_for(20)
    layer.forced_gates = (1.0, 0.0, 0.0)
    layer(x, rope)
    s = layer.last_stats
    assert s["gate_collapse_frac"] == 1 and s["gate_entropy_mean"] == 0 and s["gate_share_cmp"] == 1
    layer.forced_gates = (0.5, 0.5, 0.5)
    layer(x, rope)
    s = layer.last_stats
    assert s["gate_collapse_frac"] == 0
    torch.testing.assert_close(s["gate_entropy_min"].double().cpu(), torch.tensor(math.log(2), dtype=torch.float64))
    torch.testing.assert_close(s["gate_share_win"].double().cpu(), torch.tensor(1 / 3, dtype=torch.float64))


def test_gate_health_aggregates_over_layers():
    model = Transformer(small_cfg(vocab_size=97, n_layers=3, ffn_dim=64, max_seq_len=64)).to(DEVICE)
    ids = torch.randint(0, 97, (2, 40), device=DEVICE)
    assert set_gate_stats(model, True) == 3
    model(ids)
    health = gate_health(model)
    layers = [blk.attn.last_stats for blk in model.blocks]
    assert torch.equal(health["gate_entropy_min"], torch.stack([s["gate_entropy_min"] for s in layers]).amin())
    torch.testing.assert_close(health["gate_max_mean"], torch.stack([s["gate_max_mean"] for s in layers]).mean())
    assert all(v.dim() == 0 for v in health.values())
    set_gate_stats(model, False)
    assert gate_health(model) == {}


def test_gate_stats_recorded_by_a_decode_step():
    """The one-query decode path records gate and selection statistics for its query."""
    T = 70
    layer = make_layer(seed=4)
    x, rope = make_input(1, T), rope_for(T)
    idx = decode_last_with_stats(layer, x, rope)
    step = layer.last_stats
    with torch.no_grad():
        expected = gate_statistics(layer.gates(x[:, T - 1 :]))
    for key, value in expected.items():
        torch.testing.assert_close(step[key], value, msg=key)
    # position 69, l'=16, n=4: blocks 0, 3 and 4 are forced, one free pick at distance >= 2
    free = [j for j in idx[0, :, 0].flatten().tolist() if j not in (0, 3, 4)]
    assert len(free) == 2  # one per KV group
    torch.testing.assert_close(step["sel_free_frac"].double().cpu(), torch.tensor(0.25, dtype=torch.float64))
    expected_distance = sum(4 - j for j in free) / 2
    torch.testing.assert_close(step["sel_free_distance_mean"].double().cpu(), torch.tensor(expected_distance, dtype=torch.float64))
