"""The compressed and sliding-window branches through FlexAttention (CUDA; nsa.kernel auto | triton).

Same semantics as the portable path (compression.compressed_attention, window.sliding_window_attention),
written as mask_mods:
  compressed: query at position p sees compressed token i iff i*d + l - 1 <= p (rows that see nothing
              give a zero output, as FlexAttention returns for fully masked rows);
  window:     query at position p sees key position s iff p - w < s <= p.
The block masks are derived from that geometry, not by evaluating the mask over [Tq x Tk]: for each
128 x 128 tile the bounds of its query and key positions say "no key visible" (skipped), "every key
visible" (a full tile: no mask_mod call) or "the boundary crosses it" (mask_mod applied). That is
O(Tq/128 * Tk/128) integer work per call, so under torch.compile it costs nothing next to attention;
in eager mode masks are cached per geometry.

FlexAttention has no CPU backward in PyTorch 2.13, so the layer uses these only on CUDA
(`use_flex`); tests check the forward on CPU and the backward on CUDA (tests/nsa/test_nsa_gpu.py).
"""
from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from nsa.profiling import audit

BLOCK = 128  # FlexAttention's tile (queries x keys)
_MASK_CACHE: OrderedDict[tuple, BlockMask] = OrderedDict()
_MASK_CACHE_SIZE = 64  # geometries kept in eager mode (chunked prefill meets one per chunk offset)
_compiled_flex: Callable | None = None


def use_flex(kernel: str, q: torch.Tensor) -> bool:
    """The compressed and window branches run through FlexAttention for CUDA tensors unless nsa.kernel is
    torch; float64 (the tests' oracle dtype, which the fused kernels do not take) stays on the SDPA path."""
    return kernel != "torch" and q.device.type == "cuda" and q.dtype != torch.float64


def _run_flex(site: str, q, k, v, block_mask: BlockMask) -> torch.Tensor:
    """flex_attention fused by torch.compile: inside a compiled model directly, in eager mode through one
    compiled wrapper (dynamic=False: one kernel per shape). On CPU (forward tests) the unfused eager path."""
    global _compiled_flex
    gqa = q.shape[1] != k.shape[1]
    audit(site, "flex_attention", q, k)
    if torch.compiler.is_compiling():
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=gqa)
    if q.device.type != "cuda":
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=gqa)
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=gqa)


def _tile_bounds(n: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """First and last index of each 128-tile of a length-n axis, and whether the tile is whole."""
    lo = torch.arange(0, n, BLOCK, device=device)
    hi = torch.clamp(lo + BLOCK, max=n) - 1
    return lo, hi, (hi - lo + 1) == BLOCK


def _compact(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[nq, nk] bool -> FlexAttention's (num_blocks [1, 1, nq], indices [1, 1, nq, nk]): per query tile, the
    count of True columns and their indices first, ascending."""
    order = torch.sort((~tiles).to(torch.int8), dim=-1, stable=True).indices
    return tiles.sum(-1).to(torch.int32)[None, None], order.to(torch.int32)[None, None]


def _block_mask(kind: str, Tq: int, Tk: int, q_start: int, k_start: int, a: int, b: int, device) -> BlockMask:
    """kind "cmp": a = l, b = d (token i covers [i*d, i*d + l)); kind "win": a = w (b unused)."""
    key = (kind, Tq, Tk, q_start, k_start, a, b, str(device))
    caching = not torch.compiler.is_compiling()
    if caching and key in _MASK_CACHE:
        _MASK_CACHE.move_to_end(key)
        return _MASK_CACHE[key]
    q_lo, q_hi, q_whole = _tile_bounds(Tq, device)  # [nq] query rows
    k_lo, k_hi, k_whole = _tile_bounds(Tk, device)  # [nk] key rows
    q_lo, q_hi = (q_lo + q_start)[:, None], (q_hi + q_start)[:, None]  # absolute positions, [nq, 1]
    if kind == "cmp":
        l, d = a, b
        end_lo, end_hi = k_lo * d + l - 1, k_hi * d + l - 1  # last position covered by a tile's first / last token

        def mask_mod(batch, head, qi, ki):
            return ki * d + (l - 1) <= qi + q_start

        some, every = end_lo <= q_hi, end_hi <= q_lo  # [nq, nk]
    elif kind == "win":
        w = a
        s_lo, s_hi = k_lo + k_start, k_hi + k_start

        def mask_mod(batch, head, qi, ki):
            s, p = ki + k_start, qi + q_start
            return (s <= p) & (s > p - w)

        some = (s_lo <= q_hi) & (s_hi > q_lo - w)
        every = (s_hi <= q_lo) & (s_lo > q_hi - w)
    else:
        raise ValueError(f"unknown branch {kind!r}")
    every = every & q_whole[:, None] & k_whole[None, :]  # ragged edge tiles always take the mask_mod
    mask = BlockMask.from_kv_blocks(
        *_compact(some & ~every), *_compact(every), BLOCK_SIZE=BLOCK, mask_mod=mask_mod, seq_lengths=(Tq, Tk)
    )
    if caching:
        _MASK_CACHE[key] = mask
        while len(_MASK_CACHE) > _MASK_CACHE_SIZE:
            _MASK_CACHE.popitem(last=False)
    return mask


def flex_compressed_attention(
    q: torch.Tensor,  # [B, H, Tq, hd] queries at positions q_start .. (RoPE applied)
    ck: torch.Tensor,  # [B, H_kv, N_c, hd] compressed keys (RoPE applied)
    cv: torch.Tensor,  # [B, H_kv, N_c, hd]
    q_start: int,
    l: int,
    d: int,
) -> torch.Tensor:  # [B, H, Tq, hd]; rows that see no compressed token are zero
    if ck.shape[2] == 0:
        return torch.zeros_like(q)
    mask = _block_mask("cmp", q.shape[2], ck.shape[2], q_start, 0, l, d, q.device)
    return _run_flex("nsa.compressed", q, ck, cv, mask)


def flex_window_attention(
    q: torch.Tensor,  # [B, H, Tq, hd] queries at positions q_start ..
    k: torch.Tensor,  # [B, H_kv, Tk, hd] keys at positions k_start .. k_start+Tk-1
    v: torch.Tensor,  # [B, H_kv, Tk, hd]
    q_start: int,
    k_start: int,
    w: int,
) -> torch.Tensor:  # [B, H, Tq, hd]
    mask = _block_mask("win", q.shape[2], k.shape[2], q_start, k_start, w, 0, q.device)
    return _run_flex("nsa.window", q, k, v, mask)
