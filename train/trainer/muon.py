"""Muon for the hidden matrices and AdamW for the rest, as one optimizer (train.optimizer=muon).

`MuonAdamW` is one `torch.optim.Optimizer` to the loop, `set_lr`, ZeRO-1 and the checkpoints: one `param_groups`
list (each group says which optimizer steps it in its "optimizer" key: "adamw" or "muon"), one `state` keyed by
parameter, the base class's `state_dict()` / `load_state_dict()`, so the trainer's checkpoint code stores it by
parameter name like AdamW's (train/checkpoint/state_dicts.py) and ZeroRedundancyOptimizer can build it per rank
from its share of the groups (each rank owns whole parameters, so Muon sees whole matrices). Its `step()` runs a
fused AdamW over the "adamw" groups and `SkippableMuon` over the "muon" ones, both pointed at these groups and
this state at each step (a `load_state_dict` replaces both).

Needs torch.optim.Muon (torch >= 2.9): imported only when train.optimizer=muon, which the config refuses in one
line on an older torch (train/core/versions.py).

The skip path (a non-finite or spike-skipped step, train/trainer/optim.py `step_unless_nonfinite`): set
`found_inf` (0-dim float tensor on the parameters' device, 1.0 = skip) before `step()`, as for fused AdamW. The
AdamW part hands it to the fused kernel (no update, no step count); `SkippableMuon` computes the step out of place
and keeps the old momentum buffer and weights where found_inf is 1 (`torch.where` on the device: no host sync).
A skipped step leaves weights, momentum buffers, AdamW moments and step counts bitwise as they were.
"""
from __future__ import annotations

import torch
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz  # torch >= 2.9 (train/core/versions.py)

from train.core.param_groups import ADAMW, MUON, ROW_SPLITS


class SkippableMuon(torch.optim.Muon):
    """torch.optim.Muon whose step takes an on-device skip flag, like fused AdamW: with `found_inf` set (0-dim
    float tensor, 1.0 = skip) the step is applied only where the flag is 0; unset (None), it is torch's own step.

    Per matrix p [m, n] with gradient g and momentum buffer b, the same operations as torch.optim.Muon's
    `_single_tensor_muon` (bitwise the same result when not skipped; tests/train/test_muon.py checks it), but
    out of place:
        b' = b.lerp(g, 1 - momentum);  u = g.lerp(b', momentum) (nesterov) or b'
        p' = p * (1 - lr * wd) - adjusted_lr * NS(u)
        b <- where(skip, b, b');  p <- where(skip, p, p')
    Cost against torch's in-place step: two transient fp32 [m, n] tensors (b' and p') for the matrix being
    updated, freed before the next (the Newton-Schulz iteration already holds several bf16 ones of that size; no
    persistent memory), and two `torch.where` passes per matrix (read 2, write 1 each: 12 bytes per element of
    memory traffic), next to Newton-Schulz's 3 matmuls per iteration (ns_steps of them). Measured on the KJV twin's
    NSA model (20 matrices, 3.7M parameters; one thread of a shared 2-core CPU, bench/bench_muon.py): 125-135 ms a
    step as torch runs it, 133-139 ms masked, within the run-to-run noise."""

    @torch.no_grad()
    def step(self, closure=None):
        found_inf = getattr(self, "found_inf", None)
        if found_inf is None and not any(hasattr(p, ROW_SPLITS) for g in self.param_groups for p in g["params"]):
            return super().step(closure)
        if closure is not None:
            raise RuntimeError("SkippableMuon with found_inf or fused matrices takes no closure")
        skip = None if found_inf is None else found_inf > 0  # 0-dim bool, on the device
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            bufs: list[torch.Tensor] = []
            self._init_group(group, params, grads, bufs)  # torch's: checks, zero buffers on a first step
            for p, g, b in zip(params, grads, bufs):
                _masked_update(p, g, b, skip, group)
        return None


def _masked_update(p: torch.Tensor, g: torch.Tensor, b: torch.Tensor, skip: torch.Tensor | None, group: dict) -> None:
    """One matrix's Muon step, kept only where `skip` is False (None: always). p, g, b: [m, n]; skip: 0-dim bool.
    A fused matrix (attribute ROW_SPLITS) is orthogonalised and its lr adjusted per stacked matrix: rows [r_i, n]."""
    lr, momentum = group["lr"], group["momentum"]
    new_b = b.lerp(g, 1 - momentum)  # [m, n]
    update = g.lerp(new_b, momentum) if group["nesterov"] else new_b  # [m, n]
    new_p = p.mul(1 - lr * group["weight_decay"])  # [m, n]
    rows = getattr(p, ROW_SPLITS, None) or (p.shape[0],)
    for part, part_p in zip(update.split(rows), new_p.split(rows)):  # [r_i, n] each; part_p a view of new_p
        ortho = _zeropower_via_newtonschulz(part, group["ns_coefficients"], group["ns_steps"], group["eps"])  # bf16
        part_p.add_(ortho, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], part.shape))
    if skip is None:
        b.copy_(new_b)
        p.copy_(new_p)
        return
    torch.where(skip, b, new_b, out=b)
    torch.where(skip, p, new_p, out=p)


class MuonAdamW(torch.optim.Optimizer):
    """Muon and AdamW as one optimizer (module docstring). params: parameter groups, each with "optimizer"
    ("adamw" or "muon") and that optimizer's settings (train/trainer/optim.py builds them); AdamW's are fused when
    they say fused=True. Empty groups are fine (ZeRO-1 hands each rank every group, some with no parameters)."""

    def __init__(self, params: list[dict]):
        groups = list(params)
        kinds = {group.get("optimizer") for group in groups}
        if not kinds <= {ADAMW, MUON}:
            raise ValueError(f"every group needs optimizer={ADAMW!r} or {MUON!r}, got {sorted(map(str, kinds))}")
        adamw = [g for g in groups if g["optimizer"] == ADAMW]
        muon = [g for g in groups if g["optimizer"] == MUON]
        fused = bool(adamw) and all(g.get("fused") for g in adamw)
        # each part fills its own defaults into its groups' dicts (the same dicts this optimizer keeps)
        self._parts = {ADAMW: torch.optim.AdamW(adamw or [{"params": []}], fused=fused or None),
                       MUON: SkippableMuon(muon or [{"params": []}])}
        super().__init__(groups, defaults={})
        self.takes_found_inf = fused  # step_unless_nonfinite hands found_inf over instead of reading it on the host
        self._step_supports_amp_scaling = fused  # GradScaler.step sets found_inf too (after unscale_)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise RuntimeError("MuonAdamW takes no closure")
        if getattr(self, "grad_scale", None) is not None:
            raise RuntimeError("MuonAdamW needs unscaled gradients: call GradScaler.unscale_ before step")
        found_inf = getattr(self, "found_inf", None)
        for kind, part in self._parts.items():
            part.param_groups = [g for g in self.param_groups if g["optimizer"] == kind]
            part.state = self.state
            part.found_inf = found_inf
            part.step()
        return None
