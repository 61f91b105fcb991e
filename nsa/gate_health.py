"""Gate health of a model's NSA layers: switch statistics recording on or off in every NativeSparseAttention
layer, and aggregate what the layers recorded last (the statistics and their definitions:
nsa/attention/gate_stats.py, docs/NSA.md "Gate health"). Kept on device (no host sync) for the trainer to log.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from nsa.attention.nsa import NativeSparseAttention


def _nsa_layers(model: nn.Module):
    return [m for m in model.modules() if isinstance(m, NativeSparseAttention)]


def set_gate_stats(model: nn.Module, enabled: bool) -> int:
    """Turn stats recording on/off in every NSA layer; returns how many layers were switched."""
    layers = _nsa_layers(model)
    for layer in layers:
        layer.stats_enabled = enabled
        if not enabled:
            layer.last_stats = None
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
