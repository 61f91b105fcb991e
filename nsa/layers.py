"""Building blocks shared by every model: norms, rotary embeddings, MLPs."""
from __future__ import annotations

import math

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
    """Rotary position embedding, stretched by `scale` >= 1 for a context `scale` times the one trained at.

    scaling "linear": positions divided by the scale (Chen et al. 2023, "position interpolation").
    scaling "yarn" (Peng et al. 2023, YaRN): each frequency by how often it turns within the trained context
    L0 = context / scale: r = L0 / wavelength. Frequencies that turn more than YARN_BETA times keep theirs, those
    turning less than YARN_ALPHA times are divided by the scale, a linear ramp in r between ("NTK-by-parts"); and
    cos / sin are multiplied by 0.1 ln(scale) + 1, so every q.k logit by its square (the paper's temperature).
    """

    def __init__(self, head_dim: int, theta: float, scale: float = 1.0, scaling: str = "linear",
                 context: int | None = None):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))  # [hd/2]
        self.position_divisor, self.magnitude = scale, 1.0
        if scaling == "yarn" and scale > 1.0:
            if context is None:
                raise ValueError("YaRN needs the context length it runs at (the model's max_seq_len)")
            turns = (context / scale) * inv_freq / (2 * math.pi)  # [hd/2] rotations within the trained context
            keep = ((turns - YARN_ALPHA) / (YARN_BETA - YARN_ALPHA)).clamp(0.0, 1.0)  # 1: keep, 0: interpolate
            inv_freq = inv_freq * keep + inv_freq / scale * (1.0 - keep)
            self.position_divisor, self.magnitude = 1.0, 0.1 * math.log(scale) + 1.0
        elif scaling not in ("linear", "yarn"):
            raise ValueError(f"RoPE scaling {scaling!r}; valid: linear, yarn")
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [hd/2] float64
        self.scale = scale

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] (or [B, T] per row: packed documents) int64 -> (cos, sin), each [..., T, hd/2] float32.

        Angles are formed in float64: at position 65536 float32 would already be off by ~1e-2 rad.
        """
        t = positions.to(torch.float64) / self.position_divisor
        angles = t[..., None] * self.inv_freq.to(device=positions.device, dtype=torch.float64)  # [..., T, hd/2]
        if self.magnitude != 1.0:
            return (angles.cos() * self.magnitude).float(), (angles.sin() * self.magnitude).float()
        return angles.cos().float(), angles.sin().float()


YARN_ALPHA, YARN_BETA = 1.0, 32.0  # YaRN's ramp bounds, in rotations within the trained context (the paper's LLaMA values)


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
    cos, sin = cos.to(compute), sin.to(compute)
    if torch.compiler.is_compiling():
        # the same products and sums with no concatenation, which inductor realizes as a buffer of its own: as one
        # pointwise expression the rotation fuses into whatever reads it (a cache write, a scale). x[i] * cos[i] +
        # x[i + hd/2] * -sin[i] is x1 * cos - x2 * sin to the bit (negation is exact), likewise the second half
        i = torch.arange(2 * half, device=x.device)
        cos_i, sin_i = cos[..., i % half], sin[..., i % half]
        xc = x.to(compute)
        return (xc * cos_i + torch.roll(xc, half, dims=-1) * torch.where(i < half, -sin_i, sin_i)).to(x.dtype)
    x1, x2 = x[..., :half].to(compute), x[..., half:].to(compute)
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
