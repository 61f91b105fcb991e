"""Model and optimizer state in one format, whatever the parallelism.

Checkpoints hold the full (unsharded) model state dict and an optimizer state keyed by parameter
name (FQN) rather than by position, so a checkpoint written by one rank, DDP, ZeRO-1 or FSDP2
loads into any of them.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from train.core.errors import CheckpointError


def _group_param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]


def _hyper_parameters(group: dict) -> dict:
    """A param group's settings (lr, weight_decay, lr_scale, ...): everything but its parameters."""
    return {k: v for k, v in group.items() if k != "params"}


def _index_to_fqn(state: dict, group_names: list[list[str]]) -> dict:
    flat = [n for g in group_names for n in g]
    groups = []
    for g, names in zip(state["param_groups"], group_names):
        groups.append({**_hyper_parameters(g), "params": names})
    return {"state": {flat[i]: s for i, s in state["state"].items()}, "param_groups": groups}


def _fqn_to_index(state: dict, optimizer: torch.optim.Optimizer, group_names: list[list[str]]) -> dict:
    """The saved per-parameter state (moments, step) in this optimizer's groups: hyper-parameters come from
    the optimizer as the current config built it (param_groups), so nsa.aux_decay or nsa.aux_lr_scale may
    change on resume like train.lr may."""
    index = {n: i for i, n in enumerate(n for g in group_names for n in g)}
    saved = [n for g in state["param_groups"] for n in g["params"]]
    if sorted(saved) != sorted(index):
        missing = sorted(set(index) - set(saved))[:3]
        raise CheckpointError(f"optimizer state does not cover the model's parameters (e.g. {missing})")
    groups = [{**_hyper_parameters(g), "params": [index[n] for n in names]}
              for g, names in zip(optimizer.param_groups, group_names)]
    return {"state": {index[n]: s for n, s in state["state"].items()}, "param_groups": groups}


def _join_indexer_projections(state: dict) -> dict:
    """An optimizer state (FQN-keyed) written before the NSA indexer had one projection: each layer's three
    projections' per-parameter states (moments: stacked along dim 0 as the weights are; the step: the first's) become
    the one projection's, in its place in its group (nsa/attention/indexer.py LEGACY_PROJECTIONS)."""
    from nsa.attention.indexer import LEGACY_PROJECTIONS, PROJECTION

    first = LEGACY_PROJECTIONS[0]
    prefixes = [n[: -len(first)] for n in state["state"] if n.endswith(first)]
    if not prefixes:
        return state
    per_param, groups = dict(state["state"]), [dict(g) for g in state["param_groups"]]
    for prefix in prefixes:
        old = [prefix + n for n in LEGACY_PROJECTIONS]
        if not all(n in per_param for n in old):
            continue
        parts = [per_param.pop(n) for n in old]
        per_param[prefix + PROJECTION] = {k: torch.cat([p[k] for p in parts], dim=0)
                                          if torch.is_tensor(v) and v.dim() > 0 else v for k, v in parts[0].items()}
        for g in groups:
            if old[0] in g["params"]:
                g["params"] = [prefix + PROJECTION if n == old[0] else n for n in g["params"] if n not in old[1:]]
    return {**state, "state": per_param, "param_groups": groups}


def is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def gather_states(model: nn.Module, optimizer: torch.optim.Optimizer, is_main: bool) -> tuple[dict | None, dict | None]:
    """Collective (call on every rank). Returns full model / FQN optimizer states on rank 0, else None."""
    if is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd, optim_sd = get_state_dict(model, optimizer, options=opts)
        return (model_sd, optim_sd) if is_main else (None, None)
    consolidate = getattr(optimizer, "consolidate_state_dict", None)
    if consolidate is not None:  # ZeRO-1: shards gathered to rank 0
        consolidate(to=0)
    if not is_main:
        return None, None
    optim_sd = _index_to_fqn(optimizer.state_dict(), _group_param_names(model, optimizer))
    return model.state_dict(), optim_sd


def load_states(model: nn.Module, optimizer: torch.optim.Optimizer | None, model_sd: dict, optim_sd: dict | None) -> None:
    """The checkpoint's weights and optimizer state into model and optimizer; optimizer None: the weights only
    (evaluation: a run that never steps needs no moments, whichever optimizer wrote them)."""
    if optimizer is None:
        if is_fsdp(model):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(model, model_sd, options=StateDictOptions(full_state_dict=True))
        else:
            model.load_state_dict(model_sd)
        return
    optim_sd = _join_indexer_projections(optim_sd)
    if is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        # DCP matches the moments by name but gives each group the saved hyper-parameters of its first
        # parameter's old group; the current config's (nsa.aux_lr_scale, weight decay) go back on after
        current = [_hyper_parameters(g) for g in optimizer.param_groups]
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                       options=StateDictOptions(full_state_dict=True))
        for group, hyper in zip(optimizer.param_groups, current):
            group.update(hyper)
        return
    model.load_state_dict(model_sd)
    optimizer.load_state_dict(_fqn_to_index(optim_sd, optimizer, _group_param_names(model, optimizer)))
