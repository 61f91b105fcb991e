"""The optimizer a run trains with (train.optimizer): AdamW, or Muon for the hidden matrices with AdamW for the rest
(train/trainer/muon.py); which parameter goes where: train/core/param_groups.py. `set_lr` applies the schedule's
value (train/trainer/lr_schedule.py); `step_unless_nonfinite` is the one way the loop steps."""
from __future__ import annotations

import torch
import torch.nn as nn

from train.core.config import TrainConfig
from train.core.param_groups import ADAMW, MUON, ROW_SPLITS, adamw_groups, muon_names, muon_row_splits


def build_optimizer(model: nn.Module, cfg: TrainConfig, device_type: str, zero1: bool = False) -> torch.optim.Optimizer:
    """AdamW, fused on CPU and CUDA: one kernel over all parameters (on an idle 2-core CPU, 20 ms
    against 111 ms for foreach on a 30M-parameter model), and it skips a step on-device through
    `found_inf` (no host sync). Other devices get the foreach implementation. train.optimizer=muon: `MuonAdamW`
    (the same AdamW over what Muon does not train).

    zero1: shard the optimizer state across data-parallel ranks (ZeroRedundancyOptimizer).
    """
    fused = device_type in ("cpu", "cuda")
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps, fused=fused, foreach=None if fused else True)
    if cfg.optimizer == MUON:
        return _build_muon(model, cfg, kwargs, zero1)
    groups = adamw_groups(model, cfg.weight_decay)
    if zero1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=torch.optim.AdamW,
                                      weight_decay=groups[0]["weight_decay"], **kwargs)
        for group in groups[1:]:
            opt.add_param_group(group)
        return opt
    return torch.optim.AdamW(groups, **kwargs)


def muon_groups(model: nn.Module, cfg: TrainConfig, adamw: dict) -> list[dict]:
    """MuonAdamW's groups, each with every setting of its optimizer: AdamW's groups (adamw_groups, AdamW settings
    `adamw`) over what Muon does not train, then one Muon group (weight decay train.weight_decay, lr scale
    train.muon_lr_ratio)."""
    names = muon_names(model)
    params = dict(model.named_parameters())
    groups = [{**adamw, **group, "optimizer": ADAMW} for group in adamw_groups(model, cfg.weight_decay, frozenset(names))]
    groups.append({"params": [params[n] for n in names], "optimizer": MUON, "lr": cfg.lr,
                   "weight_decay": cfg.weight_decay, "lr_scale": cfg.muon_lr_ratio, "momentum": cfg.muon_momentum,
                   "nesterov": cfg.muon_nesterov, "ns_steps": cfg.muon_ns_steps, "adjust_lr_fn": cfg.muon_adjust_lr})
    return groups


def _build_muon(model: nn.Module, cfg: TrainConfig, adamw: dict, zero1: bool) -> torch.optim.Optimizer:
    from train.trainer.muon import MuonAdamW  # torch >= 2.9, which the config checked (train/core/versions.py)

    groups = muon_groups(model, cfg, adamw)
    params = dict(model.named_parameters())
    for name, rows in muon_row_splits(model).items():  # Muon steps each stacked projection as its own matrix
        if sum(rows) != params[name].shape[0]:
            raise ValueError(f"{name}: muon_row_splits {rows} do not add up to its {params[name].shape[0]} rows")
        setattr(params[name], ROW_SPLITS, rows)
    if zero1:  # every rank builds a MuonAdamW over its share of each group: whole matrices
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(groups, optimizer_class=MuonAdamW)
    return MuonAdamW(groups)


def step_unless_nonfinite(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """Apply the update unless found_inf is 1. Fused AdamW and MuonAdamW (train/trainer/muon.py) take the flag
    on-device; others (CPU) read it on the host, which costs nothing there. ZeRO-1 wraps the optimizer in `.optim`."""
    inner = getattr(optimizer, "optim", optimizer)
    if inner.defaults.get("fused") or getattr(inner, "takes_found_inf", False):
        inner.found_inf = found_inf
        optimizer.step()
    elif not found_inf.item():
        optimizer.step()


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every group's lr: `lr` times the group's lr_scale (nsa.aux_lr_scale's groups: param_groups.py; Muon's group:
    train.muon_lr_ratio)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def optimizer_resume_refusal(saved: TrainConfig, new: TrainConfig, checkpoint: str) -> str | None:
    """Why `new` must not continue a checkpoint written under `saved` (one line), or None: another train.optimizer
    (its state holds the other optimizer's moments). Muon's settings and the lr may change, as train.lr may."""
    if saved.optimizer == new.optimizer:
        return None
    return (f"checkpoint {checkpoint} was trained with train.optimizer={saved.optimizer} but this run has "
            f"train.optimizer={new.optimizer}; its optimizer state cannot continue under another optimizer: resume "
            f"with --train.optimizer={saved.optimizer}, or start from its weights in a new out_dir with "
            f"train.init_from={checkpoint}")
