"""nsa.gate_init, and NSA's dense limit: with every gate on the window branch and w >= T, the layer is dense
causal attention over the window branch's keys and values (checked against an explicit-mask reference)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from nsa.attention.nsa import initial_gate_entropy
from nsa.config import ModelConfigError, NSAConfig
from nsa.model import Transformer
from tests.nsa._nsa_helpers import HEAD_DIM, HEADS, KV_HEADS, make_input, make_layer, rope_for, small_cfg
from train.checkpoint.io import check_architecture


def _init_gates(gate_init: str, T: int = 33, **nsa) -> torch.Tensor:  # [B, T, H, 3] of a fresh model's layer 0
    torch.manual_seed(0)
    model = Transformer(small_cfg({"gate_init": gate_init, **nsa}, n_layers=2, vocab_size=64)).double()
    return model.blocks[0].attn.gates(make_input(2, T))


@pytest.mark.parametrize("gate_bias, cmp_sel, win", [(2.0, 0.1192, 0.8808), (4.0, 0.0180, 0.9820)])
def test_window_gate_init_starts_every_token_on_the_window_branch(gate_bias, cmp_sel, win):
    gates = _init_gates("window", gate_bias=gate_bias)
    expected = torch.tensor([cmp_sel, cmp_sel, win], dtype=torch.float64)  # sigmoid(-b), sigmoid(-b), sigmoid(b)
    torch.testing.assert_close(gates, expected.expand_as(gates), rtol=0, atol=1e-4)
    entropy = -(gates * gates.log() + (1 - gates) * (1 - gates).log()).mean().item()  # gate_stats' definition
    assert initial_gate_entropy(NSAConfig(gate_init="window", gate_bias=gate_bias)) == pytest.approx(entropy)
    equal = _init_gates("equal")  # the generic init: every gate near 0.5, token-dependent
    assert (equal - 0.5).abs().max() < 0.05 and equal.std() > 0
    assert initial_gate_entropy(NSAConfig(gate_init="equal")) == pytest.approx(math.log(2))


def test_window_gate_init_still_learns_per_token_gates():
    torch.manual_seed(0)
    model = Transformer(small_cfg({"gate_init": "window"}, n_layers=1, vocab_size=64)).double()
    idx = torch.randint(0, 64, (2, 33))
    model(idx, targets=torch.roll(idx, -1, 1)).backward()
    assert model.blocks[0].attn.gate_mlp[2].weight.grad.abs().sum() > 0  # zero weights, non-zero gradient


def test_gate_init_is_validated_and_does_not_block_resume():
    with pytest.raises(ModelConfigError, match="gate_init"):
        NSAConfig(gate_init="windows").validate()
    with pytest.raises(ModelConfigError, match="gate_bias"):
        NSAConfig(gate_bias=0.0).validate()
    saved = {"config": {"model": {"attention": "nsa"}, "nsa": {"l": 16, "gate_init": "equal"}}}
    check_architecture(saved, {"attention": "nsa", "nsa": {"l": 16, "gate_init": "window"}}, "ckpt")  # no raise
    legacy = {"config": {"model": {"attention": "nsa"}, "nsa": {"l": 16}}}  # saved before the key existed
    check_architecture(legacy, {"attention": "nsa", "nsa": {"l": 16, "gate_init": "equal"}}, "ckpt")


def _dense_causal(q, k, v):  # q [B, H, T, hd], k/v [B, H_kv, T, hd] -> [B, H, T, hd], explicit mask
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    T = q.shape[2]
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    return F.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v


@pytest.mark.parametrize("T", [17, 64])
def test_gates_forced_to_the_window_with_w_at_least_T_is_dense_causal_attention(T):
    layer = make_layer(nsa_overrides={"w": 64})
    layer.forced_gates = (0.0, 0.0, 1.0)
    x, rope = make_input(2, T), rope_for(T)
    q, branches = layer.project(x, rope)
    win_k, win_v = branches["win"]
    y = _dense_causal(q, win_k, win_v)  # [B, H, T, hd]
    expected = layer.proj(y.transpose(1, 2).reshape(2, T, HEADS * HEAD_DIM))
    torch.testing.assert_close(layer(x, rope), expected, rtol=1e-10, atol=1e-10)
    # a shorter window is not dense: the first query to lose a key differs
    layer_short = make_layer(nsa_overrides={"w": 8})
    layer_short.forced_gates = (0.0, 0.0, 1.0)
    assert not torch.allclose(layer_short(x, rope)[:, 8:], expected[:, 8:])
    assert KV_HEADS < HEADS  # the reference shares K/V across each GQA group, as the layer must


@pytest.mark.parametrize("aux_decay", [True, False])
def test_aux_decay_moves_the_gate_and_phi_matrices_out_of_weight_decay(aux_decay):
    from train.core.config import TrainConfig
    from train.trainer.optim import build_optimizer

    model = Transformer(small_cfg({"aux_decay": aux_decay}, n_layers=2, vocab_size=64))
    names = {id(p): n for n, p in model.named_parameters()}
    decay, no_decay = build_optimizer(model, TrainConfig(weight_decay=0.1), "cpu").param_groups
    aux = {n for n, p in model.named_parameters() if p.dim() >= 2 and (".gate_mlp." in n or ".compress_" in n)}
    assert len(aux) == 2 * 8  # per layer: gate_mlp.0/.2, compress_k/v: fc_in, fc_out and the [l, hd] pos_enc
    in_decay = {names[id(p)] for p in decay["params"]}
    assert (aux <= in_decay) if aux_decay else not (aux & in_decay)
    assert "blocks.0.attn.q_proj.weight" in in_decay and decay["weight_decay"] == 0.1
    assert {names[id(p)] for p in no_decay["params"]} >= (set() if aux_decay else aux)


def _aux_names(model) -> set[str]:  # the gate MLP's and phi's parameters, every layer
    return {n for n, _ in model.named_parameters() if ".gate_mlp." in n or ".compress_" in n}


def _one_adamw_step(nsa_overrides: dict, seed: int = 0, fsdp: bool = False):
    from train.core.config import TrainConfig
    from train.trainer.optim import build_optimizer, set_lr

    torch.manual_seed(seed)
    model = Transformer(small_cfg(nsa_overrides, n_layers=2, vocab_size=64))
    if fsdp:  # FSDP2 as train/core/distributed.py wraps it (one rank: the load path is DCP's all the same)
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    opt = build_optimizer(model, TrainConfig(weight_decay=0.1), "cpu")
    set_lr(opt, 1e-3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    idx = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(1))
    model(idx, targets=torch.roll(idx, -1, 1)).backward()
    opt.step()
    return model, opt, {n: p.detach() - before[n] for n, p in model.named_parameters()}


def test_aux_lr_scale_moves_only_the_gate_and_phi_parameters_faster():
    with pytest.raises(ModelConfigError, match="aux_lr_scale"):
        NSAConfig(aux_lr_scale=0.0).validate()
    model, plain_opt, plain = _one_adamw_step({})
    assert len(plain_opt.param_groups) == 2  # scale 1: the layout checkpoints were always written with
    _, opt, scaled = _one_adamw_step({"aux_lr_scale": 3.0})
    aux = _aux_names(model)
    assert len(aux) == 2 * 10  # per layer: gate_mlp.0/.2 weight and bias; compress_k/v: fc_in, fc_out, pos_enc
    for name, delta in scaled.items():
        # AdamW's update (weight decay included) is proportional to lr: the aux steps are exactly 3x as long,
        # up to fp32 rounding of the updated parameter (~2 ulp of its magnitude: the window gates' biases are +-4)
        ulps = 2 * torch.finfo(torch.float32).eps * model.get_parameter(name).detach().abs().max().item()
        torch.testing.assert_close(delta, plain[name] * (3.0 if name in aux else 1.0), rtol=1e-4, atol=max(3e-8, ulps))
    assert sorted(g["lr"] for g in opt.param_groups) == pytest.approx([1e-3, 1e-3, 3e-3, 3e-3])


def test_indexer_lr_scale_moves_only_the_indexer_faster():
    """nsa.indexer_lr_scale: the learned block indexer's parameters (trained by its KL alone) on their own lr."""
    with pytest.raises(ModelConfigError, match="indexer_lr_scale"):
        NSAConfig(indexer_lr_scale=-1.0).validate()
    indexer = {"selector": "indexer", "indexer_heads": 2, "indexer_dim": 8}
    model, _, plain = _one_adamw_step(indexer)
    _, opt, scaled = _one_adamw_step({**indexer, "indexer_lr_scale": 5.0})
    fast = {n for n in plain if ".attn.indexer." in n}
    assert len(fast) == 2  # per layer: one projection for the index queries, head weights and index key
    assert all(plain[n].abs().sum() > 0 for n in fast)  # the KL moved them: the factor below is not 5 x 0
    for name, delta in scaled.items():
        ulps = 2 * torch.finfo(torch.float32).eps * model.get_parameter(name).detach().abs().max().item()
        torch.testing.assert_close(delta, plain[name] * (5.0 if name in fast else 1.0), rtol=1e-4, atol=max(3e-8, ulps))
    assert sorted(g["lr"] for g in opt.param_groups) == pytest.approx([1e-3, 1e-3, 5e-3])


@pytest.fixture
def one_rank_group():
    """A one-process gloo group: FSDP2 (and DCP's state-dict helpers) on CPU inside the test process."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # FSDP2 keeps moments as DTensors


@pytest.mark.parametrize("fsdp", [False, True], ids=["plain", "fsdp2"])
@pytest.mark.parametrize("change", [{"aux_lr_scale": 3.0}, {"aux_decay": False}])
def test_a_checkpoints_optimizer_state_loads_under_other_aux_settings(change, fsdp, request):
    from train.checkpoint.state_dicts import gather_states, load_states

    if fsdp:
        request.getfixturevalue("one_rank_group")
    model, opt, _ = _one_adamw_step({}, fsdp=fsdp)
    model_sd, optim_sd = gather_states(model, opt, is_main=True)
    new_model, new_opt, _ = _one_adamw_step(change, seed=1, fsdp=fsdp)
    load_states(new_model, new_opt, model_sd, optim_sd)
    names = {id(p): n for n, p in new_model.named_parameters()}
    old = {n: opt.state[p] for n, p in model.named_parameters()}
    for n, p in new_model.named_parameters():  # every parameter's moments come back, under its new group
        for moment in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(_full(new_opt.state[p][moment]), _full(old[n][moment]), rtol=0, atol=0)
    group_of = {names[id(p)]: g for g in new_opt.param_groups for p in g["params"]}
    gate_w = "blocks.0.attn.gate_mlp.0.weight"
    if "aux_lr_scale" in change:
        assert group_of[gate_w]["lr_scale"] == 3.0 and group_of["blocks.0.attn.q_proj.weight"]["lr_scale"] == 1.0
    else:
        assert group_of[gate_w]["weight_decay"] == 0.0 and group_of["blocks.0.attn.q_proj.weight"]["weight_decay"] == 0.1
