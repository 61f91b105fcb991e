"""nsa.gates=window, the window-only control: the layer is its sliding-window branch alone (gates pinned to
(cmp, sel, win) = (0, 0, 1)), with no compression, selection or gate modules. Checked against an explicit-mask
float64 reference (packed documents too), against the learned layer with its gates forced to the window, under
perturbation of keys beyond the window, through the decode cache and generation, and in what the model tools
(statistics, FLOPs, parameter and launch counts, checkpoints' architecture check) make of it."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import yaml

from nsa.attention.documents import Documents
from nsa.config import NON_ARCHITECTURE_FIELDS, ModelConfig, ModelConfigError, NSAConfig
from nsa.layers import apply_rotary
from nsa.model import Transformer
from tests.nsa._nsa_helpers import (
    DEVICE,
    DIM,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    W,
    make_input,
    make_layer,
    rope_for,
    small_cfg,
    starts_of,
)

WINDOW = {"gates": "window"}
KV_DIM = KV_HEADS * HEAD_DIM


def window_reference(layer, x: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """float64 sliding-window attention from the layer's weights and an explicit [T, T] mask per row: query t reads
    key s iff t - w < s <= t and s is in t's document (start [B, T]: index of each token's document's first token);
    RoPE at the position within the document. x [B, T, dim] -> [B, T, dim]."""
    B, T, _ = x.shape
    G = HEADS // KV_HEADS
    q = F.linear(x, layer.q_proj.weight, layer.q_proj.bias).view(B, T, HEADS, HEAD_DIM).transpose(1, 2)
    kv = F.linear(x, layer.kv_proj.weight, layer.kv_proj.bias).view(B, T, 2, KV_HEADS, HEAD_DIM)
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)  # [B, H_kv, T, hd]
    if layer.q_norm is not None:
        q, k = layer.q_norm(q), layer.k_norm(k)
    t = torch.arange(T, device=x.device)
    cos, sin = rope_for(T)
    positions = t - start  # [B, T]
    q, k = apply_rotary(q, cos[positions], sin[positions]), apply_rotary(k, cos[positions], sin[positions])
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)  # query head h reads KV head h // G
    s = t[None, None, :]  # keys
    visible = (s <= t[None, :, None]) & (s > t[None, :, None] - layer.cfg.w) & (s >= start[:, :, None])  # [B, T, T]
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(HEAD_DIM)  # [B, H, T, T]
    o = torch.softmax(scores.masked_fill(~visible[:, None], float("-inf")), dim=-1) @ v  # [B, H, T, hd]
    return F.linear(o.transpose(1, 2).reshape(B, T, -1), layer.proj.weight, layer.proj.bias)


def doc_rope(start: torch.Tensor, T: int):
    cos, sin = rope_for(T)
    positions = torch.arange(T, device=start.device) - start
    return cos[positions], sin[positions]


# ---- the config key --------------------------------------------------------------------------------------
def test_gates_is_validated_and_is_an_architecture_field():
    from train.checkpoint.io import check_architecture
    from train.core.config import load_config
    from train.core.errors import ConfigError

    with pytest.raises(ModelConfigError, match=r"nsa.gates='pinned'; valid: learned, window"):
        NSAConfig(gates="pinned").validate()
    with pytest.raises(ConfigError) as err:
        load_config(None, ["--model.attention=nsa", "--nsa.gates=windows"])
    assert "\n" not in str(err.value) and "nsa.gates='windows'; valid: learned, window" in str(err.value)
    assert "gates" not in NON_ARCHITECTURE_FIELDS
    learned = {"config": {"model": {"attention": "nsa"}, "nsa": {"l": 16, "gates": "learned"}}}
    with pytest.raises(Exception, match="nsa.gates: checkpoint 'learned' vs config 'window'"):
        check_architecture(learned, {"attention": "nsa", "nsa": {"l": 16, "gates": "window"}}, "ckpt")
    legacy = {"config": {"model": {"attention": "nsa"}, "nsa": {"l": 16}}}  # saved before the key existed: learned
    check_architecture(legacy, {"attention": "nsa", "nsa": {"l": 16, "gates": "learned"}}, "ckpt")
    with pytest.raises(Exception, match="nsa.gates: checkpoint 'learned' vs config 'window'"):
        check_architecture(legacy, {"attention": "nsa", "nsa": {"l": 16, "gates": "window"}}, "ckpt")
    # a window-only model is fixed by the keys it reads: others (l here) may differ, w may not
    window = {"config": {"model": {"attention": "nsa"}, "nsa": {"l": 16, "w": 64, "gates": "window"}}}
    check_architecture(window, {"attention": "nsa", "nsa": {"l": 32, "w": 64, "gates": "window"}}, "ckpt")
    with pytest.raises(Exception, match="nsa.w: checkpoint 64 vs config 128"):
        check_architecture(window, {"attention": "nsa", "nsa": {"l": 16, "w": 128, "gates": "window"}}, "ckpt")
    from train.hf.importer import architecture_diffs

    source, run = small_cfg(WINDOW), small_cfg({**WINDOW, "l": 16})
    assert architecture_diffs(source, run) == [] and architecture_diffs(source, small_cfg({**WINDOW, "w": 32})) == \
        [f"nsa.w: {W} in the source vs 32 in the run"]


def test_the_effective_config_keeps_only_the_keys_a_window_layer_reads():
    from train.core.config import dump_config, load_config

    cfg = load_config(None, ["--model.attention=nsa", "--nsa.gates=window", "--nsa.w=64", "--nsa.gate_bias=12"])
    assert yaml.safe_load(dump_config(cfg))["nsa"] == {"w": 64, "win_block": 128, "kernel": "auto", "gates": "window"}


# ---- what the layer is -------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides", [{}, {"bias": True, "qk_norm": True}], ids=["plain", "bias+qk_norm"])
def test_the_layer_has_the_parameters_of_sliding_window_attention(overrides):
    layer = make_layer(nsa_overrides=WINDOW, **overrides)
    names = {name for name, _ in layer.named_parameters()}
    expected = {"q_proj.weight", "kv_proj.weight", "proj.weight"}
    if overrides:
        expected |= {"q_proj.bias", "kv_proj.bias", "proj.bias", "q_norm.weight", "k_norm.weight"}
    assert names == expected and layer.kv_proj.weight.shape == (2 * KV_DIM, DIM)  # (win k, win v) only
    assert layer.aux_parameter_names() == [] and layer.lr_scales() == {}
    # the model has exactly the dense twin's parameter count (q, k, v, o), and nsa.flops counts it
    from nsa.flops import param_count

    cfg = small_cfg(WINDOW, n_layers=2, vocab_size=64, **overrides)
    dense = ModelConfig(**{**cfg.__dict__, "attention": "dense", "nsa": NSAConfig()})
    with torch.device("meta"):
        n_window, n_dense = Transformer(cfg).num_params(), Transformer(dense).num_params()
    assert n_window == n_dense == param_count(cfg) == param_count(dense)
    layer(make_input(2, 40), rope_for(40)).square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.parameters())


@pytest.mark.parametrize("T", [1, 9, 16, 17, 64])
def test_equals_an_explicit_mask_sliding_window_reference(T):
    layer = make_layer(seed=2, nsa_overrides=WINDOW, bias=True, qk_norm=True)
    x = make_input(2, T, seed=3)
    start = torch.zeros(2, T, dtype=torch.long, device=DEVICE)
    torch.testing.assert_close(layer(x, rope_for(T)), window_reference(layer, x, start), rtol=0, atol=1e-10)


def test_equals_the_reference_with_packed_documents():
    T = 64
    layer = make_layer(seed=4, nsa_overrides=WINDOW)
    x = make_input(2, T, seed=5)
    start = starts_of([[20, 3, 41], [5, 59]]).to(DEVICE)  # documents shorter and longer than w = 16
    docs = Documents(start)
    y = layer(x, doc_rope(start, T), documents=docs)
    torch.testing.assert_close(y, window_reference(layer, x, start), rtol=0, atol=1e-10)
    # and a document computes what it computes alone
    alone = layer(x[:1, 23:], rope_for(41))
    torch.testing.assert_close(y[:1, 23:], alone, rtol=0, atol=1e-10)


@pytest.mark.parametrize("packed", [False, True], ids=["one-document", "packed"])
def test_equals_the_learned_layer_with_its_gates_forced_to_the_window(packed):
    T = 64
    learned = make_layer(seed=6, bias=True)
    learned.forced_gates = (0.0, 0.0, 1.0)
    window = make_layer(seed=7, nsa_overrides=WINDOW, bias=True)
    with torch.no_grad():  # the same window weights: q, the window branch's rows of kv_proj, the output projection
        for name in ("q_proj", "proj"):
            getattr(window, name).load_state_dict(getattr(learned, name).state_dict())
        window.kv_proj.weight.copy_(learned.kv_proj.weight[4 * KV_DIM:])
        window.kv_proj.bias.copy_(learned.kv_proj.bias[4 * KV_DIM:])
    x = make_input(2, T, seed=8)
    if packed:
        start = starts_of([[30, 34], [64]]).to(DEVICE)
        kwargs = {"documents": Documents(start)}
        rope = doc_rope(start, T)
    else:
        kwargs, rope = {}, rope_for(T)
    torch.testing.assert_close(window(x, rope, **kwargs), learned(x, rope, **kwargs), rtol=0, atol=1e-12)


def test_a_key_beyond_the_window_changes_nothing():
    T = 64
    layer = make_layer(seed=9, nsa_overrides=WINDOW)
    x, rope = make_input(1, T, seed=10), rope_for(T)
    y = layer(x, rope)
    for s in (0, 20, 40):
        x2 = x.clone()
        x2[:, s] += 1.0
        y2 = layer(x2, rope)
        assert torch.equal(y2[:, :s], y[:, :s]), s  # causal
        assert torch.equal(y2[:, s + W:], y[:, s + W:]), s  # s is outside the window of queries t >= s + w
        assert not torch.allclose(y2[:, s:s + W], y[:, s:s + W]), s  # inside the window it is read
    learned = make_layer(seed=9)  # the same perturbation reaches NSA's far queries (compressed / selected branches)
    assert not torch.allclose(learned(x2, rope)[:, 40 + W:], learned(x, rope)[:, 40 + W:])


# ---- decode -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunks", [[1] * 40, [3, 14, 1, 1, 21], [40]], ids=["token-by-token", "irregular", "one-chunk"])
def test_decode_and_chunked_prefill_equal_full_prefill(chunks):
    T = 40  # crosses w = 16 twice
    layer = make_layer(seed=11, nsa_overrides=WINDOW, qk_norm=True)
    x, rope = make_input(2, T, seed=12), rope_for(T)
    cache, outs, t = layer.new_cache(), [], 0
    with torch.no_grad():
        full = layer(x, rope)
        for n in chunks:
            outs.append(layer(x[:, t:t + n], (rope[0][t:t + n], rope[1][t:t + n]), cache))
            t += n
            assert cache.reads_per_step() == min(W, t)  # the window alone
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=0, atol=1e-12)
    assert cache.t == T and cache.win_k.data.shape[2] == W and cache.sel_k.data is None and cache.cmp_k.data is None


def test_generation_equals_the_cache_free_forward():
    from nsa.generate import generate

    torch.manual_seed(0)
    model = Transformer(small_cfg(WINDOW, vocab_size=97, n_layers=2, ffn_dim=96, max_seq_len=128)).double().to(DEVICE)
    model.eval()
    prompt = torch.randint(0, 97, (21,)).tolist()
    out = generate(model, prompt, 30, temperature=0.0, prefill_chunk=8)  # greedy, prompt prefilled in chunks of 8
    ids = torch.tensor([prompt + out.ids[0]], device=DEVICE)
    with torch.no_grad():
        greedy = model(ids[:, :-1]).argmax(-1)[0, len(prompt) - 1:]  # what the cache-free forward predicts
        full = model(ids)
        caches = model.new_caches()
        steps = [model(ids[:, :21], caches=caches)] + [model(ids[:, t:t + 1], start_pos=t, caches=caches)
                                                        for t in range(21, ids.shape[1])]
    assert greedy.tolist() == out.ids[0]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-10)


# ---- statistics and model tools ----------------------------------------------------------------------------
def test_statistics_record_pinned_gates_and_no_selection():
    from nsa.gate_health import gate_health, selection_health, set_gate_stats
    from train.trainer.loop import GateStats

    model = Transformer(small_cfg(WINDOW, vocab_size=97, n_layers=2, ffn_dim=64, max_seq_len=64)).to(DEVICE)
    ids = torch.randint(0, 97, (2, 40), device=DEVICE)
    assert set_gate_stats(model, True) == 2
    model(ids)
    stats = model.blocks[0].attn.last_stats
    means = [stats[f"gate_mean_{b}"].item() for b in ("cmp", "sel", "win")]
    shares = [stats[f"gate_share_{b}"].item() for b in ("cmp", "sel", "win")]
    assert means == shares == [0.0, 0.0, 1.0]
    assert math.isnan(stats["sel_outside_window"]) and model.blocks[0].attn.last_sample is None
    assert not {"sel_free_frac", "gate_entropy_mean", "gate_collapse_frac"} & set(stats)  # no selection, no learned gates
    health = selection_health(model)
    assert torch.isnan(health["sel_recall"]).all() and health["gate_mean_win"].tolist() == [1.0, 1.0]
    assert gate_health(model)["gate_share_win"] == 1
    row = GateStats(model).read()  # what the trainer logs: a host-side row, NaN where there is no selection
    assert row["gate_mean_win"] == 1.0 and math.isnan(row["sel_recall"]) and row["gate_mean_cmp_layers"] == [0.0, 0.0]
    from train.core.config import load_config
    from train.observe.alerts import Alerts

    alerts = Alerts(load_config(None, ["--model.attention=nsa", "--nsa.gates=window"]))
    assert alerts.observe({"step": 10, "loss": 3.0, "toks_per_s": 100.0, **row}) == []  # pinned gates alert nothing


def test_flops_launches_and_memory_count_the_window_branch_only():
    from nsa.flops import dense_attention_flops, flops_per_token, nsa_attention_flops
    from nsa.launch_count import attention_layer_launches

    m7c = dict(dim=768, n_heads=12, n_kv_heads=2, head_dim=64)
    paper = dict(l=32, d=16, l_sel=64, n_sel=16, w=512)
    learned = ModelConfig(**m7c, attention="nsa", nsa=NSAConfig(**paper))
    window = ModelConfig(**m7c, attention="nsa", nsa=NSAConfig(**paper, gates="window"))
    S = 8192
    w_flops, n_flops, d_flops = (nsa_attention_flops(window, S), nsa_attention_flops(learned, S),
                                 dense_attention_flops(ModelConfig(**m7c), S))
    assert set(w_flops) == {"attn_q", "attn_k", "attn_v", "attn_win", "attn_o"}
    assert all(w_flops[k] == d_flops[k] for k in ("attn_q", "attn_k", "attn_v", "attn_o"))
    assert w_flops["attn_win"] == n_flops["attn_win"]
    assert flops_per_token(window, S).flops_per_token < flops_per_token(learned, S).flops_per_token
    counts = {T: attention_layer_launches(window, T) for T in (2048, 65536)}
    counts["packed"] = attention_layer_launches(window, 2048, documents=8)
    assert len({c.total for c in counts.values()}) == 1  # constant in length and document count
    ops = {name: n for name, n in counts[65536].by_op.items() if name.startswith("nsa.")}
    assert ops == {"nsa.rotary": 2, "nsa.window_attention": 1, "nsa.window_attention_backward": 1}
    assert counts[2048].total < attention_layer_launches(learned, 2048).total
    # the memory planner saves what a dense layer saves for it
    from train.core.config import load_config
    from train.planning.memory import activation_bytes_per_token

    plans = {name: activation_bytes_per_token(load_config(None, flags), 2) for name, flags in (
        ("dense", []), ("window", ["--model.attention=nsa", "--nsa.gates=window"]), ("nsa", ["--model.attention=nsa"]))}
    assert plans["window"] == plans["dense"] < plans["nsa"]
