"""Attention modules. Every one takes (x [B, T, dim], rope, cache=None) and returns [B, T, dim]."""
from __future__ import annotations

import torch.nn as nn

from nsa.config import ModelConfig


def build_attention(cfg: ModelConfig) -> nn.Module:
    if cfg.attention == "nsa":
        from nsa.attention.nsa import NativeSparseAttention

        return NativeSparseAttention(cfg)
    from nsa.attention.dense import DenseAttention

    return DenseAttention(cfg)
