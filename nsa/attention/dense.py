"""Causal grouped-query attention: SDPA (default), flash-attn (when importable on CUDA), or an
explicit masked reference ("manual").

Alignment rule: a query at absolute position p sees keys at positions <= p. When the query
block is shorter than the key block (decode, chunked prefill) the mask is aligned bottom-right,
built explicitly; SDPA's `is_causal=True` (top-left aligned) is used only when the two lengths
are equal, where both alignments agree. One query (a decode step) sees every cached key, so it
runs with no mask at all, and never on cuDNN: cuDNN builds an execution plan per new shape, and a
decode step's key count is new every step (65 ms of host time a step at 32k on an H200, for 12 us
of attention; bench/profile_cuda.py).

Packed documents (nsa/attention/documents.py; training / prefill from position 0, Tq == Tk):
doc_start [B, T] (Documents.start) makes attention block-causal by document: query t sees key s iff
doc_start[b, t] <= s <= t, so each document computes exactly what it computes alone. Per backend:
  manual:       the explicit mask [B, 1, T, T];
  CUDA (auto, flash; fp16 / bf16 / fp32): FlexAttention with a per-row block mask derived from the
                documents (impl/flex.flex_document_attention): tiles outside a query tile's documents
                are skipped, tiles inside one are full. No host sync.
                flash-attn's varlen kernel is not used: flash_attn_varlen_func takes cu_seqlens with one
                entry per document (a shape only the host knows: reading it is a device-to-host sync) and
                max_seqlen as a host int. Padding cu_seqlens to a static B*T + 1 entries would avoid the
                sync, but then launches B*T mostly empty sequences (a grid of B*T * T/128 * H blocks).
  SDPA on CPU, eager: each document on its own with is_causal (the windows' rows flattened into one
                sequence and split by document length: one split / cat, so the backward is one cat too),
                measured faster than a boolean mask on 2 cores for every layout tried (B 4-8, T 1024-2048,
                H 4-12, hd 64; 1, 8 and 64 documents per window: 1.6-7.6x forward, 1.4-7.9x forward+backward;
                with one document per window it is the is_causal call itself). The split reads the
                document lengths on the host (free for CPU tensors).
  SDPA otherwise (CUDA float64, backend sdpa on CUDA, and under torch.compile, where the split's
                data-dependent lengths would break the graph): a boolean mask [B, 1, T, T].
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from nsa.attention.documents import Documents
from nsa.attention.impl.flex import flex_document_attention
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


def document_causal_mask(doc_start: torch.Tensor) -> torch.Tensor:
    """doc_start [B, T] int64 -> [B, 1, T, T] bool, True = may attend: query t sees key s iff
    doc_start[b, t] <= s <= t (block-causal by document)."""
    s = torch.arange(doc_start.shape[1], device=doc_start.device)
    return ((s[None, None, :] >= doc_start[:, :, None]) & (s[None, None, :] <= s[None, :, None]))[:, None]


def manual_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     doc_start: torch.Tensor | None = None) -> torch.Tensor:
    """Reference causal attention with an explicit mask (block-causal by document with doc_start [B, T]).

    q: [B, H, Tq, hd]; k, v: [B, H_kv, Tk, hd] -> [B, H, Tq, hd]. Computed in float32 or wider.
    """
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    compute = torch.promote_types(q.dtype, torch.float32)
    scores = q.to(compute) @ k.to(compute).transpose(-1, -2) / math.sqrt(q.shape[-1])  # [B,H,Tq,Tk]
    if doc_start is None:
        mask = causal_mask(q.shape[2], k.shape[2], q.device)  # [Tq, Tk]
    else:
        mask = document_causal_mask(doc_start)  # [B, 1, T, T]
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(dim=-1) @ v.to(compute)).to(q.dtype)


def _sdpa_documents_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_start: torch.Tensor) -> torch.Tensor:
    """CPU: each document alone through SDPA is_causal. q [B, H, T, hd], k, v [B, H_kv, T, hd] -> [B, H, T, hd].
    Row b's documents are consecutive in the flattened axis b*T + t (every row opens a document at t = 0), so
    one split by document lengths (read on the host) covers all rows. One document per row: the plain call."""
    B, H, T, hd = q.shape
    H_kv, gqa = k.shape[1], q.shape[1] != k.shape[1]
    opens = (doc_start == torch.arange(T, device=doc_start.device)).flatten()  # [B*T] document starts
    firsts = opens.nonzero().flatten()  # [n_docs] host data: CPU only
    if firsts.numel() == B:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    lengths = torch.diff(firsts, append=firsts.new_full((1,), B * T)).tolist()
    qs = q.transpose(0, 1).reshape(H, B * T, hd).split(lengths, dim=1)  # n_docs x [H, L, hd]
    ks = k.transpose(0, 1).reshape(H_kv, B * T, hd).split(lengths, dim=1)  # n_docs x [H_kv, L, hd]
    vs = v.transpose(0, 1).reshape(H_kv, B * T, hd).split(lengths, dim=1)
    out = torch.cat([F.scaled_dot_product_attention(qd[None], kd[None], vd[None], is_causal=True, enable_gqa=gqa)
                     for qd, kd, vd in zip(qs, ks, vs)], dim=2)  # [1, H, B*T, hd]
    return out.view(H, B, T, hd).transpose(0, 1)


def _document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str,
                        doc_start: torch.Tensor) -> torch.Tensor:
    """Block-causal attention by document (module docstring): q [B, H, T, hd], k, v [B, H_kv, T, hd]."""
    B, _, T, _ = q.shape
    if k.shape[2] != T:
        raise ValueError(f"documents need Tq == Tk (training / prefill from 0), got Tq={T}, Tk={k.shape[2]}")
    if doc_start.shape != (B, T):
        raise ValueError(f"doc_start must be [B, T] = [{B}, {T}], got {list(doc_start.shape)}")
    if backend == "manual":
        audit("dense.causal_attention[documents]", "manual", q, k)
        return manual_attention(q, k, v, doc_start)
    gqa = q.shape[1] != k.shape[1]
    if backend in ("auto", "flash") and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16, torch.float32):
        return flex_document_attention(q, k, v, doc_start)  # audited as dense.causal_attention[documents]
    if q.device.type == "cpu" and not torch.compiler.is_compiling():
        audit("dense.causal_attention[documents]", "sdpa_split_by_document", q, k, requested=backend)
        return _sdpa_documents_split(q, k, v, doc_start)
    audit("dense.causal_attention[documents]", "sdpa_document_mask", q, k, requested=backend)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=document_causal_mask(doc_start), enable_gqa=gqa)


DECODE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]  # not CUDNN_ATTENTION


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "auto",
                     doc_start: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, H, Tq, hd]; k, v: [B, H_kv, Tk, hd] with Tq <= Tk -> [B, H, Tq, hd].

    backend: auto / flash use flash-attn when it is importable and the inputs are CUDA bf16/fp16
    (otherwise SDPA); sdpa: always SDPA; manual: the explicit-mask reference.
    doc_start [B, T] int64 (Documents.start; only with Tq == Tk): query t sees key s iff
    doc_start[b, t] <= s <= t (block-causal by document; the paths per backend: module docstring).
    """
    if doc_start is not None:
        return _document_attention(q, k, v, backend, doc_start)
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
    if t_q == 1:  # a decode step: every key is visible; a new key count every call (module docstring: no cuDNN)
        audit("dense.causal_attention[Tq=1]", "sdpa_no_mask", q, k, requested=backend)
        with sdpa_kernel(DECODE_BACKENDS):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
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

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:  # k, v [B, H_kv, t, hd]
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

    def muon_row_splits(self) -> dict[str, tuple[int, ...]]:
        """Fused matrices (names relative to this module) and the rows of the projections they stack: q, k, v.
        An optimizer that treats each projection as its own matrix (Muon) reads this."""
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return {"qkv.weight": (q_dim, kv_dim, kv_dim)}

    def forward(
        self,
        x: torch.Tensor,  # [B, T, dim]
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,  # cos, sin [T or B, T, hd/2] for x's positions
        cache: KVCache | None = None,
        documents: Documents | None = None,  # packed documents of x (training / prefill from 0, no cache)
    ) -> torch.Tensor:  # [B, T, dim]
        if documents is not None and cache is not None:
            raise ValueError("documents are for training / prefill from position 0, not with a KV cache (decode)")
        B, T, _ = x.shape
        q, k, v = self.project(x, rope)
        if cache is not None:
            k, v = cache.append(k, v)
        doc_start = documents.start if documents is not None else None  # [B, T]
        y = causal_attention(q, k, v, self.backend, doc_start)  # [B, H, T, hd]
        return self.output(y)

    def project(self, x: torch.Tensor, rope=None):
        """x [B, T, dim] -> q [B, H, T, hd], k, v [B, H_kv, T, hd] (QK-norm and RoPE applied)."""
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
        return q, k, v

    def output(self, y: torch.Tensor) -> torch.Tensor:  # the heads' outputs [B, H, T, hd] -> [B, T, dim]
        B, _, T, _ = y.shape
        return self.dropout(self.proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)))
