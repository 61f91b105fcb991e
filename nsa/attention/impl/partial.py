"""Attention over one part of a query's keys (a "partial"): the softmax output and its log-sum-exp, so
parts merge per query, and the gradients of a part given the merged output and log-sum-exp (recomputed
scores, flash-attention style). Two backends: PyTorch's CPU flash kernels (they return the log-sum-exp)
and plain matmuls (any device; `use_flash_kernels = False` forces them). Shared by the compressed,
selected and sliding-window branches (impl/compression.py, impl/selection.py, impl/window.py).
"""
from __future__ import annotations

import functools

import torch

from nsa.profiling import audit


# ---------------------------------------------------------------- attention partials (two backends)
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
use_flash_kernels = True  # tests switch this off to check the portable (matmul) backend on CPU


def _use_flash(q: torch.Tensor) -> bool:
    """PyTorch's CPU flash-attention kernels return the log-sum-exp that merging needs."""
    return (
        use_flash_kernels and _FLASH_CPU is not None and q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.float64, torch.bfloat16)
    )


@functools.cache
def _flash_takes_gqa() -> bool:
    """Whether the CPU flash kernels take fewer key heads than query heads as they are. torch 2.7's do not: they
    return garbage for grouped-query shapes (values of 1e34, NaN), so there the key heads are expanded first. Decided
    once per process by a 2-head, 1-key-head call against the same call with the key head repeated."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 3, 4, generator=gen) for h in (2, 1, 1))
    grouped = _FLASH_CPU(q, k, v, 0.0, False, scale=0.5)[0]
    expanded = _FLASH_CPU(q, k.expand(1, 2, 3, 4), v.expand(1, 2, 3, 4), 0.0, False, scale=0.5)[0]
    return bool(torch.allclose(grouped, expanded))


def _expand_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[N, Hk, S, E] -> [N, heads, S, E]: each of the Hk key heads serves heads // Hk query heads (GQA)."""
    if t.shape[1] == heads:
        return t
    if t.shape[1] == 1:
        return t.expand(-1, heads, -1, -1)
    return t.repeat_interleave(heads // t.shape[1], dim=1)


def _reduce_heads(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[N, Hq, S, E] per-query-head gradients -> [N, kv_heads, S, E], summed over each GQA group."""
    N, Hq = t.shape[:2]
    return t if Hq == kv_heads else t.view(N, kv_heads, Hq // kv_heads, *t.shape[2:]).sum(2)


def attention_partial(q, k, v, mask, scale: float, site: str = "nsa.selected"):
    """q [N, Hq, L, E]; k, v [N, Hk, S, E] (Hk divides Hq: GQA); mask additive (0 = attend, -inf = not;
    >= 1 key per row) in q's dtype, broadcastable to [N, Hq, L, S], or None
    -> out [N, Hq, L, E], lse [N, Hq, L] (float32 or wider)."""
    heads = q.shape[1]
    if _use_flash(q):  # the CPU flash kernels take GQA (fewer key heads) as they are, where they can
        audit(site, "cpu_flash_kernel_with_lse", q, k)
        if k.shape[1] != heads and not _flash_takes_gqa():
            k, v = _expand_heads(k, heads), _expand_heads(v, heads)
        return _FLASH_CPU(q, k, v, 0.0, False, attn_mask=mask, scale=scale)
    audit(site, "matmul_softmax_with_lse", q, k)
    compute = torch.promote_types(q.dtype, torch.float32)
    k, v = _expand_heads(k, heads), _expand_heads(v, heads)
    s = torch.matmul(q.to(compute), k.to(compute).transpose(-1, -2)) * scale  # [N, Hq, L, S]
    if mask is not None:
        s = s + mask
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse[..., None]), v.to(compute))
    return out.to(q.dtype), lse


def attention_partial_backward(d_out, q, k, v, out, lse, mask, scale: float):
    """Gradients of one partial given the MERGED out and lse of its queries, i.e. the gradients of the
    full softmax restricted to these keys. Returns dq, dk, dv shaped like q, k, v (k, v: [N, Hk, S, E])."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if _use_flash(q):  # GQA as it is: dk, dv come back with the key heads
        if kv_heads == heads or _flash_takes_gqa():
            return _FLASH_CPU_BWD(d_out, q, k, v, out, lse, 0.0, False, attn_mask=mask, scale=scale)
        dq, dk, dv = _FLASH_CPU_BWD(d_out, q, _expand_heads(k, heads), _expand_heads(v, heads), out, lse, 0.0, False,
                                    attn_mask=mask, scale=scale)
        return dq, _reduce_heads(dk, kv_heads), _reduce_heads(dv, kv_heads)
    k, v = _expand_heads(k, heads), _expand_heads(v, heads)
    compute = torch.promote_types(q.dtype, torch.float32)
    q, k, v, d_out, out = (t.to(compute) for t in (q, k, v, d_out, out))
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        s = s + mask
    p = torch.exp(s - lse[..., None].to(compute))  # probabilities of the merged softmax
    delta = (d_out * out).sum(dim=-1, keepdim=True)  # [N, Hq, L, 1]
    ds = p * (torch.matmul(d_out, v.transpose(-1, -2)) - delta) * scale
    dv = torch.matmul(p.transpose(-1, -2), d_out)
    dk = torch.matmul(ds.transpose(-1, -2), q)
    return torch.matmul(ds, k), _reduce_heads(dk, kv_heads), _reduce_heads(dv, kv_heads)
