"""The selected-attention inverted index (selected_attention.inverted_index) in few launches: with packed documents
each entry's aligned block and offset (`frame_block_keys`: one launch), each entry's segment and sort key with the
segments' entry counts (`segment_keys`: one launch after a zero fill), after the sort each sorted entry's query and
second key (`sorted_entries`: one launch), and the tile layout (`tile_layout`: one launch after two cumulative sums).
Torch ops took ~11, ~12, 3-5 and ~25 launches for these.

Tile layout.

Given how many entries each segment holds and their sorted order, the kernels of selected attention read the entries
as tiles of at most `kv_tile` queries of one segment, a fixed number of tiles per part (static sizes, no host
sync). Built from torch ops that layout takes ~25 launches (a repeat_interleave, cumulative sums, gathers);
`tile_layout_kernel` writes it in one, each program finding its tiles' segments by binary search over the
part's cumulative tile counts. Pure integer arithmetic: it equals the torch layout (`inverted_index`'s oracle,
nsa/attention/impl/index.py tile_layout_torch) exactly. Kernels only; the launcher is `tile_layout`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa.attention.kernels.interpreter import interpreter_active  # noqa: F401  (kernels built as the switch says)

BLOCK = 256  # tiles, segments or entries per program


@triton.jit(do_not_specialize=["E", "Tq", "n_blocks", "S"])
def segment_keys_kernel(
    IDX, SUB, KEY, COUNTS,
    E, Tq, n, n_blocks, S, n_sub,
    BY_SLOT: tl.constexpr, HAS_SUB: tl.constexpr, BLOCK: tl.constexpr,
):
    """Entries e of IDX [BH, Tq, n] (flat; -1 = none): their segment bh * n_blocks + block (+ slot * S by slot; empty
    entries the spare segment P * S), stored as the sort key (segment * n_sub + SUB[e] with HAS_SUB) in KEY, and
    one count per entry into COUNTS[segment] ([P * S + 1], zeroed; integer atomics: the counts do not depend on
    their order)."""
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = e < E
    block = tl.load(IDX + e, mask=ok, other=-1).to(tl.int64)
    slot = e % n
    seg = (e // (Tq * n)) * n_blocks + block
    spare = S
    if BY_SLOT:
        seg += slot * S
        spare = n * S
    seg = tl.where(block >= 0, seg, spare)
    if HAS_SUB:
        tl.store(KEY + e, seg * n_sub + tl.load(SUB + e, mask=ok, other=0).to(tl.int64), mask=ok)
    else:
        tl.store(KEY + e, seg, mask=ok)
    tl.atomic_add(COUNTS + seg, tl.full((BLOCK,), 1, tl.int64), mask=ok)


def segment_keys(block_idx: torch.Tensor, n_blocks: int, by_slot: bool, sub: torch.Tensor | None = None,
                 n_sub: int = 1):
    """block_idx [BH, Tq, n] (-1 = none) -> the sort key [BH*Tq*n] int64 (each entry's segment in inverted_index's
    numbering, times n_sub plus sub where given) and counts [P * S] int64 (entries per segment, P = n by slot else 1,
    S = BH * n_blocks). Two launches (the counts' zero fill and the kernel); the oracle is
    nsa/attention/impl/index.py segment_keys_torch."""
    BH, Tq, n = block_idx.shape
    S, E = BH * n_blocks, block_idx.numel()
    P = n if by_slot else 1
    idx = block_idx.contiguous()
    key = torch.empty(E, dtype=torch.long, device=idx.device)
    counts = torch.zeros(P * S + 1, dtype=torch.long, device=idx.device)
    if E:
        segment_keys_kernel[(triton.cdiv(E, BLOCK),)](
            idx, idx if sub is None else sub.contiguous(), key, counts, E, Tq, n, n_blocks, S, n_sub,
            BY_SLOT=by_slot, HAS_SUB=sub is not None, BLOCK=BLOCK)
    return key, counts[:P * S]


@triton.jit(do_not_specialize=["E", "Tq", "H", "Tk"])
def frame_block_keys_kernel(
    IDX, FRAME, HOME, OFF,
    sfb, sft,
    E, Tq, n, H, l_sel, Tk,
    BLOCK: tl.constexpr,
):
    """Entries e of IDX [B, H, Tq, n] (flat, contiguous; -1 = none) with packed documents: block j of query (b, t)
    starts at key s = k_base + j*l' (k_base = FRAME[b, t], the frame's second row); HOME[e] = s // l' (its aligned
    block; -1 for an empty slot or a first key outside 0 .. Tk-1) and OFF[e] = s % l' (0 there), int32."""
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = e < E
    j = tl.load(IDX + e, mask=ok, other=-1).to(tl.int64)
    t = (e // n) % Tq
    b = e // (n * Tq * H)
    first = tl.load(FRAME + b * sfb + t * sft, mask=ok, other=0) + j * l_sel
    seen = (j >= 0) & (first >= 0) & (first < Tk)
    tl.store(HOME + e, tl.where(seen, first // l_sel, -1).to(tl.int32), mask=ok)
    tl.store(OFF + e, tl.where(seen, first % l_sel, 0).to(tl.int32), mask=ok)


def frame_block_keys(idx: torch.Tensor, k_base: torch.Tensor, l_sel: int, Tk: int):
    """idx [B, H_kv, Tq, n] (-1 = none), k_base [B, Tq] (the frame's second row, any strides) -> the aligned block
    each entry's block starts in, and its offset there, [B, H_kv, Tq, n] int32 each (as selected_attention's
    _block_keys documents them). One launch; the oracle is nsa/attention/impl/index.py frame_block_keys_torch."""
    B, H, Tq, n = idx.shape
    idx = idx.contiguous()
    home = torch.empty(idx.shape, dtype=torch.int32, device=idx.device)
    off = torch.empty_like(home)
    if idx.numel():
        frame_block_keys_kernel[(triton.cdiv(idx.numel(), BLOCK),)](
            idx, k_base, home, off, *k_base.stride(), idx.numel(), Tq, n, H, l_sel, Tk, BLOCK=BLOCK)
    return home, off


@triton.jit(do_not_specialize=["E", "Tq"])
def sorted_entries_kernel(
    ORDER, SORTED_KEY, QUERIES, SUB_SORTED,
    E, Tq, n, n_sub,
    HAS_SUB: tl.constexpr, BLOCK: tl.constexpr,
):
    """Sorted entries i: QUERIES[i] = the query position of entry ORDER[i] ((ORDER[i] // n) % Tq), and with HAS_SUB
    SUB_SORTED[i] = SORTED_KEY[i] % n_sub (the second key in sorted order); int32."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < E
    entry = tl.load(ORDER + i, mask=ok, other=0)
    tl.store(QUERIES + i, ((entry // n) % Tq).to(tl.int32), mask=ok)
    if HAS_SUB:
        tl.store(SUB_SORTED + i, (tl.load(SORTED_KEY + i, mask=ok, other=0) % n_sub).to(tl.int32), mask=ok)


def sorted_entries(order: torch.Tensor, sorted_key: torch.Tensor, Tq: int, n: int, n_sub: int | None = None):
    """The sort's order and sorted keys [E] int64 (entries of a [BH, Tq, n] index) -> queries [E] int32, and with
    n_sub the second key in sorted order [E] int32 (else None). One launch; the oracle is nsa/attention/impl/index.py
    sorted_entries_torch."""
    queries = torch.empty(order.shape, dtype=torch.int32, device=order.device)
    sub_sorted = torch.empty_like(queries) if n_sub is not None else None
    if order.numel():
        sorted_entries_kernel[(triton.cdiv(order.numel(), BLOCK),)](
            order, sorted_key, queries, queries if sub_sorted is None else sub_sorted, order.numel(), Tq, n,
            n_sub or 1, HAS_SUB=n_sub is not None, BLOCK=BLOCK)
    return queries, sub_sorted


@triton.jit(do_not_specialize=["S", "n_tiles", "search_steps"])
def tile_layout_kernel(
    COUNTS, CUM_COUNTS, CUM_TILES, TILE_SEG, TILE_START, TILE_COUNT, SEG_TILE_FIRST,
    P, S, n_tiles, search_steps, kv_tile,
    BLOCK: tl.constexpr,
):
    """Programs 0 .. cdiv(P * n_tiles, BLOCK) - 1: tiles i (part p = i // n_tiles, r = i % n_tiles): the segment s
    holding the part's r-th tile (the first with CUM_TILES[p, s] > r; none: a spare tile), its rank within the
    segment, its first entry and count. Then the segments g = p * S + s: SEG_TILE_FIRST[g], their first tile.
    COUNTS [P * S] entries per segment, CUM_COUNTS their inclusive cumulative sum (over all parts), CUM_TILES
    [P, S] the inclusive cumulative sum of each segment's tiles within its part. Spare tiles: segment S - 1,
    count 0, first entry rank * kv_tile past the part's last tile (as the torch layout writes them)."""
    pid = tl.program_id(0)
    i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < P * n_tiles
    p = i // n_tiles
    r = i % n_tiles
    row = CUM_TILES + p * S
    lo = tl.zeros((BLOCK,), dtype=tl.int64)
    hi = lo + S
    for _ in range(search_steps):  # smallest s in [0, S] with CUM_TILES[p, s] > r (S: none)
        mid = (lo + hi) // 2
        above = tl.load(row + mid, mask=ok & (mid < S), other=0) > r
        go_left = (mid < hi) & above
        hi = tl.where(go_left, mid, hi)
        lo = tl.where(go_left | (mid >= hi), lo, mid + 1)
    s = lo
    spare = s >= S
    s_c = tl.minimum(s, S - 1)
    g = p * S + s_c
    count = tl.load(COUNTS + g, mask=ok, other=0)
    tiles = (count + kv_tile - 1) // kv_tile
    first_tile = tl.load(row + s_c, mask=ok, other=0) - tiles  # the segment's first tile within the part
    used = tl.load(row + S - 1, mask=ok, other=0)  # the part's tiles in use
    rank = tl.where(spare, r - used, r - first_tile)
    first_entry = tl.where(spare, 0, tl.load(CUM_COUNTS + g, mask=ok, other=0) - count)
    left = tl.where(spare, 0, count - rank * kv_tile)
    tl.store(TILE_SEG + i, s_c, mask=ok)
    tl.store(TILE_START + i, first_entry + rank * kv_tile, mask=ok)
    tl.store(TILE_COUNT + i, tl.minimum(tl.maximum(left, 0), kv_tile), mask=ok)
    # segments: the same programs, over P * S
    g2 = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok2 = g2 < P * S
    count2 = tl.load(COUNTS + g2, mask=ok2, other=0)
    first2 = tl.load(CUM_TILES + g2, mask=ok2, other=0) - (count2 + kv_tile - 1) // kv_tile
    tl.store(SEG_TILE_FIRST + g2, first2 + (g2 // S) * n_tiles, mask=ok2)


def tile_layout(counts: torch.Tensor, seg_tiles: torch.Tensor, P: int, S: int, n_tiles: int, kv_tile: int):
    """counts [P * S] int64 (entries per segment, part-major) and seg_tiles = ceil(counts / kv_tile) -> tile_seg,
    tile_start, tile_count [P * n_tiles] and seg_tile_first [P * S], int64, as selected_attention.inverted_index
    documents them (its oracle: impl/index.py tile_layout_torch). n_tiles must bound every part's tiles
    (inverted_index's static bound). Three launches: two cumulative sums and the kernel."""
    cum_counts = torch.cumsum(counts, 0)  # [P * S]
    cum_tiles = torch.cumsum(seg_tiles.view(P, S), 1)  # [P, S]
    tile_seg, tile_start, tile_count = (counts.new_empty(P * n_tiles) for _ in range(3))
    seg_tile_first = counts.new_empty(P * S)
    grid = (triton.cdiv(max(P * n_tiles, P * S), BLOCK),)
    tile_layout_kernel[grid](counts, cum_counts, cum_tiles, tile_seg, tile_start, tile_count, seg_tile_first,
                             P, S, n_tiles, S.bit_length() + 1, kv_tile, BLOCK=BLOCK)
    return tile_seg, tile_start, tile_count, seg_tile_first
