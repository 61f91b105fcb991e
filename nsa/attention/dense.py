"""Causal grouped-query attention: SDPA (default), flash-attn (when importable on CUDA), or an
explicit masked reference ("manual").

Alignment rule: a query at absolute position p sees keys at positions <= p. When the query
block is shorter than the key block (decode, chunked prefill) the mask is aligned bottom-right,
built explicitly; SDPA's `is_causal=True` (top-left aligned) is used only when the two lengths
are equal, where both alignments agree.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from nsa.attention.kv_buffer import GrowingBuffer
from nsa.config import ModelConfig
from nsa.layers import apply_rotary
from nsa.profiling import audit

try:  # optional; never required
    from flash_attn import flash_attn_func  # type: ignore
except Exception:  # ImportError, or a broken CUDA build
    flash_attn_func = None


def causal_mask(t_q: int, t_k: int, device: torch.device) -> torch.Tensor:
    """Bottom-right aligned causal mask: [t_q, t_k] bool, True = may attend.

    Query i (of the last t_q positions) sits at absolute position t_k - t_q + i.
    """
    q_pos = torch.arange(t_k - t_q, t_k, device=device)[:, None]
    k_pos = torch.arange(t_k, device=device)[None, :]
    return k_pos <= q_pos


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, H_kv, T, hd] -> [B, H_kv * n_rep, T, hd] (each KV head serves n_rep query heads)."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def manual_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Reference causal attention with an explicit mask.

    q: [B, H, Tq, hd]; k, v: [B, H_kv, Tk, hd] -> [B, H, Tq, hd]. Computed in float32 or wider.
    """
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    compute = torch.promote_types(q.dtype, torch.float32)
    scores = q.to(compute) @ k.to(compute).transpose(-1, -2) / math.sqrt(q.shape[-1])  # [B,H,Tq,Tk]
    mask = causal_mask(q.shape[2], k.shape[2], q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(dim=-1) @ v.to(compute)).to(q.dtype)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """q: [B, H, Tq, hd]; k, v: [B, H_kv, Tk, hd] with Tq <= Tk -> [B, H, Tq, hd].

    backend: auto / flash use flash-attn when it is importable and the inputs are CUDA bf16/fp16
    (otherwise SDPA); sdpa: always SDPA; manual: the explicit-mask reference.
    """
    if backend == "manual":
        audit("dense.causal_attention", "manual", q, k)
        return manual_attention(q, k, v)
    t_q, t_k = q.shape[2], k.shape[2]
    if backend in ("auto", "flash") and flash_attn_func is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        # flash-attn aligns the causal mask bottom-right and handles GQA natively; layout [B, T, H, hd]
        audit("dense.causal_attention", "flash_attn", q, k)
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        return out.transpose(1, 2)
    gqa = q.shape[1] != k.shape[1]
    if t_q == t_k:
        audit("dense.causal_attention", "sdpa_is_causal", q, k, requested=backend)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    audit("dense.causal_attention[Tq<Tk]", "sdpa_explicit_mask", q, k, requested=backend)
    mask = causal_mask(t_q, t_k, q.device)  # never is_causal here: it would align top-left
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class KVCache:
    """Key/value cache for dense decoding: k, v [B, H_kv, t, hd], appended in amortised O(1)
    (capacity doubles; a step writes one position instead of copying the whole cache)."""

    def __init__(self) -> None:
        self._k, self._v = GrowingBuffer(), GrowingBuffer()

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._k.append(k)
        self._v.append(v)
        return self._k.view(), self._v.view()

    @property
    def length(self) -> int:
        return self._k.length


class DenseAttention(nn.Module):
    """Multi-head / grouped-query causal self-attention with optional QK-norm (Qwen3)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.backend = cfg.attn_backend
        q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.qkv = nn.Linear(cfg.dim, q_dim + 2 * kv_dim, bias=cfg.bias)  # fused Q, K, V projections
        self.proj = nn.Linear(q_dim, cfg.dim, bias=cfg.bias)
        self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, dim]
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,  # cos, sin: [T, hd/2] for x's positions
        cache: KVCache | None = None,
    ) -> torch.Tensor:  # [B, T, dim]
        B, T, _ = x.shape
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = self.qkv(x).split((q_dim, kv_dim, kv_dim), dim=-1)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # [B, H, T, hd]
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, H_kv, T, hd]
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if cache is not None:
            k, v = cache.append(k, v)
        y = causal_attention(q, k, v, self.backend)  # [B, H, T, hd]
        y = y.transpose(1, 2).reshape(B, T, q_dim)
        return self.dropout(self.proj(y))
