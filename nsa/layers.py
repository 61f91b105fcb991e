"""Building blocks shared by every model: norms, rotary embeddings, MLPs."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from nsa.config import ModelConfig


def make_norm(cfg: ModelConfig, dim: int | None = None) -> nn.Module:
    """LayerNorm (GPT-2, bias optional) or RMSNorm (LLaMA / Qwen3)."""
    dim = cfg.dim if dim is None else dim
    if cfg.norm == "layernorm":
        return nn.LayerNorm(dim, eps=cfg.norm_eps, bias=cfg.bias)
    return nn.RMSNorm(dim, eps=cfg.norm_eps)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding with optional linear position interpolation.

    `rope_scale` > 1 divides positions by the scale (Chen et al. 2023, "position interpolation"),
    so a model trained at context T runs at context T * scale with positions inside its range.
    """

    def __init__(self, head_dim: int, theta: float, scale: float = 1.0):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [hd/2] float64
        self.scale = scale

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] (or [B, T] per row: packed documents) int64 -> (cos, sin), each [..., T, hd/2] float32.

        Angles are formed in float64: at position 65536 float32 would already be off by ~1e-2 rad.
        """
        t = positions.to(torch.float64) / self.scale
        angles = t[..., None] * self.inv_freq.to(device=positions.device, dtype=torch.float64)  # [..., T, hd/2]
        return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :hd/2], x[..., hd/2:]) ("rotate half" layout).

    x: [..., T, hd]; cos, sin: [T, hd/2], or [B, T, hd/2] per row for x [B, H, T, hd] (positions that
    restart in every packed document). Computed in float32 (float64 for float64 inputs, so the
    float64 test oracles stay exact), returned in x's dtype.
    """
    if cos.dim() == 3 and x.dim() == 4:  # per-row positions: broadcast over heads
        cos, sin = cos[:, None], sin[:, None]
    compute = torch.promote_types(x.dtype, torch.float32)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].to(compute), x[..., half:].to(compute)
    cos, sin = cos.to(compute), sin.to(compute)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


class MLP(nn.Module):
    """GELU MLP (GPT-2) or SwiGLU (LLaMA / Qwen3): dim -> ffn_dim -> dim."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.kind = cfg.mlp
        if cfg.mlp == "swiglu":
            # gate and up projections fused into one matmul: [dim] -> [2 * ffn_dim]
            self.w_in = nn.Linear(cfg.dim, 2 * cfg.ffn_dim, bias=cfg.bias)
        else:
            self.w_in = nn.Linear(cfg.dim, cfg.ffn_dim, bias=cfg.bias)
        self.w_out = nn.Linear(cfg.ffn_dim, cfg.dim, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, dim] -> [B, T, dim]
        h = self.w_in(x)
        if self.kind == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")
        return self.dropout(self.w_out(h))
