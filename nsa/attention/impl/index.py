"""The selected-attention inverted index's keys, counts and tile layout in torch ops: the oracles of the one-launch
kernels in nsa/attention/kernels/index_tiles.py (same arguments, same integers; selected_attention.inverted_index
documents the layout)."""
from __future__ import annotations

import torch


def frame_block_keys_torch(idx: torch.Tensor, k_base: torch.Tensor, l_sel: int, Tk: int):
    """The oracle of kernels/index_tiles.frame_block_keys (same arguments and results), in torch ops: ~11 launches."""
    first = k_base[:, None, :, None] + idx.long() * l_sel  # [B, H_kv, Tq, n] the block's first key
    ok = (idx >= 0) & (first >= 0) & (first < Tk)
    home = torch.where(ok, first.div(l_sel, rounding_mode="floor"), -1)
    return home.to(torch.int32), torch.where(ok, first % l_sel, 0).to(torch.int32)


def segment_keys_torch(block_idx: torch.Tensor, n_blocks: int, by_slot: bool, sub: torch.Tensor | None = None,
                       n_sub: int = 1):
    """The oracle of kernels/index_tiles.segment_keys (same arguments and results), in torch ops: ~12 launches."""
    BH, Tq, n = block_idx.shape
    dev, S, P = block_idx.device, BH * n_blocks, n if by_slot else 1
    seg = block_idx.long() + (torch.arange(BH, device=dev) * n_blocks).view(BH, 1, 1)
    if by_slot:
        seg = seg + (torch.arange(n, device=dev) * S).view(1, 1, n)
    seg = torch.where(block_idx >= 0, seg, P * S).flatten()  # empty slots -> spare segment P*S (sorted last)
    key = seg if sub is None else seg * n_sub + sub.flatten()
    counts = torch.zeros(P * S + 1, dtype=torch.long, device=dev).index_add_(0, seg, torch.ones_like(seg))[:P * S]
    return key, counts


def sorted_entries_torch(order: torch.Tensor, sorted_key: torch.Tensor, Tq: int, n: int, n_sub: int | None = None):
    """The oracle of kernels/index_tiles.sorted_entries (same arguments and results), in torch ops: 3-5 launches."""
    queries = ((order // n) % Tq).to(torch.int32)
    return queries, (sorted_key % n_sub).to(torch.int32) if n_sub is not None else None


def tile_layout_torch(counts: torch.Tensor, seg_tiles: torch.Tensor, P: int, S: int, n_tiles: int, kv_tile: int):
    """The oracle of kernels/index_tiles.tile_layout (same arguments and results), in torch ops: ~25 launches."""
    dev = counts.device
    seg_first = torch.cumsum(counts, 0) - counts
    tiles = seg_tiles.view(P, S)
    used = tiles.sum(1, keepdim=True)  # [P, 1]
    local_first = torch.cumsum(tiles, 1) - tiles  # [P, S]: first tile of a segment within its part
    zero = counts.new_zeros(P, 1)
    ext = torch.arange(P * (S + 1), device=dev)  # (part, segment or the part's spare column S)
    tile_ext = torch.repeat_interleave(ext, torch.cat((tiles, n_tiles - used), 1).flatten(), output_size=P * n_tiles)
    rank = torch.arange(P * n_tiles, device=dev) % n_tiles - torch.cat((local_first, used), 1).flatten()[tile_ext]
    tile_start = torch.cat((seg_first.view(P, S), zero), 1).flatten()[tile_ext] + rank * kv_tile
    tile_count = (torch.cat((counts.view(P, S), zero), 1).flatten()[tile_ext] - rank * kv_tile).clamp(0, kv_tile)
    tile_seg = (tile_ext % (S + 1)).clamp_max(S - 1)
    seg_tile_first = (local_first + torch.arange(P, device=dev).view(P, 1) * n_tiles).flatten()
    return tile_seg, tile_start, tile_count, seg_tile_first
