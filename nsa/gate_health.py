"""Gate health of a model's NSA layers: switch statistics recording on or off in every NativeSparseAttention
layer, aggregate what the layers recorded last (the statistics and their definitions:
nsa/attention/gate_stats.py, nsa/attention/selection_health.py, docs/NSA.md "Gate health"), and give the
selection health of each layer (`selection_health`: computes sel_recall from the copies the layers kept, so
the trainer calls it after the step, off its clock). Kept on device (no host sync) for the trainer to log.
`knock_out` zeroes chosen branches' gates of a trained model for a probe (what the model loses without them);
`selected_blocks` lets its selection pick more (or fewer) blocks than trained (what the ranking finds with more picks);
`distance_capped` lets its selected branch read far keys at one distance it trained on (what reading costs beyond it).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn

from nsa.attention.gate_stats import BRANCHES
from nsa.attention.nsa import NativeSparseAttention
from nsa.config import ModelConfig
from nsa.attention.selection_health import selection_recall

# per-layer statistics selection_health returns, in this order (train/core/artifacts.py: SELECTION_HEALTH)
LAYER_STATS = ("sel_recall", "sel_outside_window", "gate_mean_cmp", "gate_mean_sel", "gate_mean_win")


def _nsa_layers(model: nn.Module):
    return [m for m in model.modules() if isinstance(m, NativeSparseAttention)]


def set_gate_stats(model: nn.Module, enabled: bool) -> int:
    """Turn stats recording on/off in every NSA layer; returns how many layers were switched."""
    layers = _nsa_layers(model)
    for layer in layers:
        layer.stats_enabled = enabled
        if not enabled:
            layer.last_stats = None
            layer.last_sample = None
    return len(layers)


def gate_health(model: nn.Module) -> dict[str, torch.Tensor]:
    """Aggregate the last recorded stats over all NSA layers: min of `*_min`, mean of the rest.

    Returns 0-dim device tensors; empty when no layer has recorded stats (stats_enabled False).
    """
    per_layer = [layer.last_stats for layer in _nsa_layers(model) if layer.last_stats]
    if not per_layer:
        return {}
    out = {}
    for key in per_layer[0]:
        values = torch.stack([stats[key] for stats in per_layer])
        out[key] = values.amin() if key.endswith("_min") else values.mean()
    return out


@torch.no_grad()
def selection_health(model: nn.Module) -> dict[str, torch.Tensor]:
    """Per NSA layer (model order), of the last recorded forward: name (LAYER_STATS) -> [L] float32 device
    tensor. sel_recall is computed now from each layer's recall sample (chunked over queries: T = 8192 stays
    within nsa/attention/selection_health.py's RECALL_SCORES per chunk), NaN for a layer without one; the others
    are the forward's own. Empty when no layer has recorded stats. No host sync; not training work: call it
    after the step, off the training clock."""
    layers = [layer for layer in _nsa_layers(model) if layer.last_stats]
    if not layers:
        return {}
    recall = [selection_recall(layer.last_sample, layer.cfg.l_sel) if layer.last_sample is not None
              else torch.full((), float("nan"), device=layer.last_stats["gate_mean_win"].device) for layer in layers]
    out = {"sel_recall": torch.stack(recall)}  # [L]
    for key in LAYER_STATS[1:]:
        out[key] = torch.stack([layer.last_stats[key].float() for layer in layers])  # [L]
    return out


@contextmanager
def knock_out(model: nn.Module, branches: tuple[str, ...]) -> Iterator[int]:
    """Within the block, every learned-gate NSA layer of `model` multiplies the gates of `branches` (names from
    BRANCHES: cmp, sel, win) by 0 and keeps its other gates as learned: what a trained model loses without a
    branch (a probe of the mechanism; the weights are untouched). Yields the number of layers changed; restores
    them on exit. ValueError for an unknown branch name or a model without such layers."""
    unknown = sorted(set(branches) - set(BRANCHES))
    if unknown:
        raise ValueError(f"unknown NSA branch {', '.join(unknown)}; valid: {', '.join(BRANCHES)}")
    layers = [layer for layer in _nsa_layers(model) if not layer.cfg.window_only]
    if branches and not layers:
        raise ValueError("the model has no NSA layer with learned gates to knock a branch out of")
    before = [layer.knocked_out for layer in layers]
    try:
        for layer in layers:
            layer.knocked_out = frozenset(branches)
        yield len(layers)
    finally:
        for layer, prior in zip(layers, before):
            layer.knocked_out = prior


@contextmanager
def selected_blocks(model: nn.Module, n_sel: int | None) -> Iterator[int]:
    """Within the block, every NSA layer of `model` selects n_sel blocks per query instead of its trained nsa.n_sel
    (the same forced blocks, n_sel - forced free picks, the trained scorer ranking them): what the ranking finds when
    it may pick more (a probe; the weights are untouched). None: as trained. Yields the number of layers changed;
    restores them on exit. ValueError when n_sel is invalid for a layer (NSAConfig's own check) or the model has no
    selecting NSA layer."""
    if n_sel is None:
        yield 0
        return
    layers = [layer for layer in _nsa_layers(model) if not layer.cfg.window_only]
    if not layers:
        raise ValueError("the model has no NSA layer that selects blocks")
    changed = [dataclasses.replace(layer.cfg, n_sel=n_sel) for layer in layers]
    for cfg in changed:
        cfg.validate()  # ModelConfigError (a ValueError) before any layer changes
    before = [layer.cfg for layer in layers]
    try:
        for layer, cfg in zip(layers, changed):
            layer.cfg = cfg
        yield len(layers)
    finally:
        for layer, prior in zip(layers, before):
            layer.cfg = prior


@contextmanager
def distance_capped(model: nn.Module, cap: int | None) -> Iterator[int]:
    """Within the block, the selected branch of every NSA layer of `model` reads a key more than `cap` positions
    before its query as if it were `cap` positions before it (nsa/attention/impl/capped.py; the blocks picked and
    every other branch as trained): whether what was found beyond the training length is read wrong because of its
    RoPE distance (a probe; the weights are untouched; forwards from position 0 without a cache, packed documents too).
    None: as trained. Yields the number of layers changed; restores them on exit. ValueError for cap < 1, a model
    ModelConfig.distance_cap_problem refuses (learned positions, YaRN) or one without a selecting NSA layer."""
    if cap is None:
        yield 0
        return
    if cap < 1:
        raise ValueError(f"the distance cap must be >= 1, got {cap}")
    cfg = getattr(model, "cfg", None)  # a Transformer's ModelConfig; its RoPE tables give position cap's rotation
    problem = cfg.distance_cap_problem() if isinstance(cfg, ModelConfig) else "the distance cap needs a Transformer"
    if problem:
        raise ValueError(problem)
    layers = [layer for layer in _nsa_layers(model) if not layer.cfg.window_only]
    if not layers:
        raise ValueError("the model has no NSA layer that selects blocks")
    cos, sin = model.rope(torch.tensor([cap], device=model.rope.inv_freq.device))  # [1, hd/2] each: position cap
    before = [layer.distance_cap for layer in layers]
    try:
        for layer in layers:
            layer.distance_cap = (cap, (cos[0], sin[0]))
        yield len(layers)
    finally:
        for layer, prior in zip(layers, before):
            layer.distance_cap = prior
