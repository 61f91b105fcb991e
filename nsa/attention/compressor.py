"""phi, NSA's block compressor (paper §3.3.1): a block of l raw keys (or values) -> one compressed token.

A module with parameters (NativeSparseAttention's compress_k / compress_v); the tensor work around it
(which blocks, RoPE of the compressed keys, attention over them) is nsa/attention/impl/compression.py.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class BlockCompressor(nn.Module):
    """phi: a block of l raw keys (or values) -> one compressed token.

    phi(X) = mean_j X_j + W2 gelu(W1 flatten(X + E)), with E [l, hd] a learned intra-block position
    encoding. The mean-pooling shortcut makes a fresh phi a sensible summary; the MLP learns the rest.
    """

    def __init__(self, l: int, head_dim: int, bias: bool):
        super().__init__()
        self.pos_enc = nn.Parameter(torch.empty(l, head_dim))  # [l, hd]
        self.fc_in = nn.Linear(l * head_dim, head_dim, bias=bias)
        self.fc_out = nn.Linear(head_dim, head_dim, bias=bias)
        self.reset_extra_parameters()

    def reset_extra_parameters(self) -> None:
        nn.init.normal_(self.pos_enc, mean=0.0, std=0.02)

    def forward(self, blocks: torch.Tensor) -> torch.Tensor:  # [..., l, hd] -> [..., hd]
        h = (blocks + self.pos_enc.to(blocks.dtype)).flatten(-2)  # [..., l*hd]
        return blocks.mean(dim=-2) + self.fc_out(F.gelu(self.fc_in(h)))
