"""phi, NSA's block compressor (paper §3.3.1): a block of l raw keys (or values) -> one compressed token.

A module with parameters (NativeSparseAttention's compress_k / compress_v); the tensor work around it
(which blocks, RoPE of the compressed keys, attention over them) is nsa/attention/impl/compression.py.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from nsa.attention.impl.compression import phi


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

    def weights(self) -> tuple:
        """(E [l, hd], W1 [hd, l*hd], b1 [hd] | None, W2 [hd, hd], b2 [hd] | None): impl/compression.py `phi`'s
        arguments, as nsa/attention/ops.py `compress_blocks` takes them."""
        return self.pos_enc, self.fc_in.weight, self.fc_in.bias, self.fc_out.weight, self.fc_out.bias

    def forward(self, blocks: torch.Tensor) -> torch.Tensor:  # [..., l, hd] -> [..., hd]
        return phi(blocks, *self.weights())
