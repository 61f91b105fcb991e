"""NSA selection branch, torch path: block importance (Eq. 9-10), top-n with forced blocks, selected attention.

Selected attention is split in two parts whose softmax partials (out, log-sum-exp) are merged per query:
  local: the forced blocks (block 0, previous, current). All queries of query block c share them, so
         this is a batch of [l' x 3l'] problems (keys: block 0 | block c-1 | block c, causal in block c,
         duplicates masked) with no per-query gather;
  tiles: every other selected (query, block) pair. Such blocks lie wholly before the query (no mask).
         Pairs are sorted by block and packed into tiles of `tile` pairs sharing one key block
         (block-centric: each block's K/V is read once per tile); one batched call runs all tiles.
All shapes are static (bounded by the worst case): no host syncs. The backward pass recomputes scores
(flash-attention style) from the merged output and log-sum-exp; nothing quadratic is stored.
`selected_attention_fwd` / `_bwd` are the torch implementation of the custom op nsa::selected_attention
(nsa/attention/ops.py), which chooses per call (`ops.resolve_kernel`): NSAConfig.kernel "auto" runs the
Triton kernels of nsa/attention/kernels/selected_attention.py on CUDA tensors and this torch path
elsewhere. The attention partials (`attention_partial`, impl/partial.py: PyTorch's CPU flash kernels or
plain matmuls) also serve the compressed and window branches.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from nsa.attention.impl.partial import attention_partial, attention_partial_backward


def selection_block_scores(
    p_cmp: torch.Tensor,  # [..., N_c] compression probabilities (already summed over a GQA group)
    l: int,
    d: int,
    l_sel: int,
    n_blocks: int,
) -> torch.Tensor:  # [..., n_blocks]
    """Eq. 9 read with 1-based indices = overlap-weighted sum.

    p_slc[j] = sum_i p_cmp[i] * |[i*d, i*d+l) & [j*l', (j+1)*l')| / d. In stride units u (d positions
    each): token i covers units [i, i+m) with m = l/d, block j covers [j*r, (j+1)*r) with r = l'/d, so
    p_slc[j] = sum_{u in block j} sum_{k<m} p_cmp[u-k]. Defaults: p[4j-1] + 2p[4j] + 2p[4j+1] + 2p[4j+2] + p[4j+3].
    """
    m, r = l // d, l_sel // d
    n_c = p_cmp.shape[-1]
    n_units = n_blocks * r
    assert n_c <= n_units, (n_c, n_units)
    padded = F.pad(p_cmp, (m - 1, n_units - n_c))  # [..., m-1 + n_units]
    per_unit = padded[..., m - 1 : m - 1 + n_units]  # k = 0 term; then k = 1 .. m-1, in that order
    for k in range(1, m):
        per_unit = per_unit + padded[..., m - 1 - k : m - 1 - k + n_units]  # [..., n_units]
    return per_unit.unflatten(-1, (n_blocks, r)).sum(dim=-1)


@torch.no_grad()
def select_blocks(
    scores: torch.Tensor,  # [B, H_kv, Tq, N_b] block importance for queries q_start ..
    q_start: int,
    l_sel: int,
    n: int,
    positions: torch.Tensor | None = None,  # [B, 1, Tq] each query's own position (packed documents); default q_start ..
) -> torch.Tensor:  # [B, H_kv, Tq, n] int64 block indices, ascending; -1 pads |I_p| < n
    """Top-n blocks per query; block 0, the current and the previous block are forced (and counted).

    Only blocks starting at or before p compete; |I_p| = min(n, p // l' + 1); ties -> lower index.
    Exact without a full sort: the k-th largest score v is a top-k value; every block above v is in,
    and of the blocks equal to v the lowest-indexed ones fill the remaining places.
    """
    Tq, n_b = scores.shape[-2], scores.shape[-1]
    dev = scores.device
    if positions is None:
        positions = torch.arange(q_start, q_start + Tq, device=dev)
    current = torch.div(positions, l_sel, rounding_mode="floor")[..., None]  # [Tq, 1] or [B, 1, Tq, 1]
    blk = torch.arange(n_b, device=dev)[None, :]  # [1, N_b]
    forced = (blk == 0) | (blk == current) | (blk == current - 1)
    allowed = blk <= current
    ranked = torch.where(forced, float("inf"), scores.masked_fill(~allowed, float("-inf")))
    k = min(n, n_b)
    kth = ranked.topk(k, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)  # [..., Tq, 1]
    above, tied = ranked > kth, ranked == kth
    places = k - above.sum(dim=-1, keepdim=True)  # for tied blocks, lowest index first
    chosen = (above | (tied & (tied.cumsum(dim=-1) <= places))) & allowed  # exactly min(k, c+1) per row
    slot = torch.where(chosen, chosen.cumsum(dim=-1) - 1, n)  # ascending compaction; n = discard column
    out = torch.full((*scores.shape[:-1], n + 1), -1, dtype=torch.long, device=dev)
    return out.scatter_(-1, slot, blk.expand_as(slot))[..., :n]


# ---------------------------------------------------------------- local part (forced blocks)
@torch.no_grad()
def _local_layout(BH: int, n_blocks: int, q_start: int, Tq: int, l_sel: int, dtype, device):
    """Query blocks c0 .. c0+n_loc-1 cover the chunk. Returns
      lead: rows of block c0 before q_start; n_loc: query blocks;
      key_rows [BH*n_loc, 3]: block rows (block 0, c-1, c) in [0, BH*n_blocks);
      mask [BH*n_loc, 1, l', 3l'] additive (0 / -inf) in `dtype`: block 0 only if c >= 2, block c-1
      only if c >= 1 (no duplicate keys), block c causal. Built once; the backward pass reuses it.
    """
    c0 = q_start // l_sel
    lead = q_start - c0 * l_sel
    n_loc = (q_start + Tq - 1) // l_sel - c0 + 1
    c = c0 + torch.arange(n_loc, device=device)  # [n_loc]
    blocks = torch.stack((torch.zeros_like(c), (c - 1).clamp_min(0), c), dim=1)  # [n_loc, 3]
    key_rows = (torch.arange(BH, device=device)[:, None, None] * n_blocks + blocks).reshape(BH * n_loc, 3)
    r = torch.arange(l_sel, device=device)
    causal = r[None, :] <= r[:, None]  # [l', l']
    visible = torch.cat((
        (c >= 2)[:, None, None].expand(n_loc, l_sel, l_sel),
        (c >= 1)[:, None, None].expand(n_loc, l_sel, l_sel),
        causal.expand(n_loc, l_sel, l_sel),
    ), dim=2)  # [n_loc, l', 3l']
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
    mask = mask[None].expand(BH, -1, -1, -1).reshape(BH * n_loc, 1, l_sel, 3 * l_sel)
    return lead, n_loc, key_rows, mask


def _to_local(rows: torch.Tensor, BH: int, lead: int, n_loc: int, l_sel: int) -> torch.Tensor:
    """[BH*Tq, G, ...] query rows -> [BH*n_loc, G, l', ...], zero-padded to whole query blocks."""
    Tq = rows.shape[0] // BH
    x = rows.view(BH, Tq, *rows.shape[1:])
    pad = [0, 0] * (x.dim() - 2) + [lead, n_loc * l_sel - Tq - lead]
    x = F.pad(x, pad).view(BH * n_loc, l_sel, *rows.shape[1:])
    return x.transpose(1, 2)


def _from_local(x: torch.Tensor, BH: int, lead: int, Tq: int) -> torch.Tensor:
    """Inverse of _to_local: [BH*n_loc, G, l', ...] -> [BH*Tq, G, ...]."""
    x = x.transpose(1, 2)
    x = x.reshape(BH, -1, *x.shape[2:])[:, lead : lead + Tq]
    return x.reshape(BH * Tq, *x.shape[2:])


# ---------------------------------------------------------------- tiles (free picks)
@torch.no_grad()
def _build_tiles(block_idx: torch.Tensor, n_blocks: int, q_start: int, l_sel: int, tile: int):
    """Pack the non-forced (query, block) pairs into tiles of `tile` pairs sharing one key block.

    block_idx: [BH, Tq, n] (-1 = none). Returns
      tile_query [n_tiles * tile] int64: query row in [0, BH*Tq), or BH*Tq (a dummy row) on padding slots
      tile_block [n_tiles] int64: key block row in [0, BH*n_blocks)
    n_tiles is a static bound (no sync): sum_s ceil(c_s / tile) <= min(P, ceil(P / tile) + #segments).
    """
    BH, Tq, n = block_idx.shape
    dev = block_idx.device
    n_seg, R = BH * n_blocks, BH * Tq
    current = ((q_start + torch.arange(Tq, device=dev)) // l_sel).view(1, Tq, 1)
    free = (block_idx > 0) & (block_idx < current - 1)  # not block 0, previous or current, not empty
    query_row = torch.arange(R, device=dev).view(BH, Tq, 1).expand(BH, Tq, n)
    seg = block_idx + (torch.arange(BH, device=dev) * n_blocks).view(BH, 1, 1)
    seg = torch.where(free, seg, n_seg).flatten()  # forced / empty pairs -> dummy segment n_seg
    seg_sorted, order = torch.sort(seg, stable=True)
    q_sorted = query_row.flatten()[order]
    counts = torch.zeros(n_seg + 1, dtype=torch.long, device=dev).index_add_(0, seg, torch.ones_like(seg))
    counts[n_seg] = 0  # the dummy segment gets no tiles
    seg_first = torch.cumsum(counts, 0) - counts  # first sorted position of each segment
    tiles_per_seg = (counts + tile - 1) // tile
    tile_first = torch.cumsum(tiles_per_seg, 0) - tiles_per_seg
    pairs = R * max(0, n - 3)  # at most n - 3 free picks per query
    reachable = max(0, min(n_blocks, (q_start + Tq - 1) // l_sel - 1) - 1)  # blocks 1 .. current-2
    n_tiles = max(1, min(pairs, -(-pairs // tile) + BH * reachable))
    rank = torch.arange(seg.numel(), device=dev) - seg_first[seg_sorted]
    real = seg_sorted < n_seg
    slot = torch.where(real, tile_first[seg_sorted] * tile + rank, n_tiles * tile)  # dummy -> dropped
    tile_query = torch.full((n_tiles * tile + 1,), R, dtype=torch.long, device=dev).scatter_(0, slot, q_sorted)
    tile_seg = torch.zeros(n_tiles * tile + 1, dtype=torch.long, device=dev).scatter_(0, slot, seg_sorted * real)
    # a tile's block: all its real slots hold the same segment; padding slots hold 0
    tile_block = tile_seg[:-1].view(n_tiles, tile).amax(dim=1).clamp_max(n_seg - 1)
    return tile_query[:-1], tile_block


TILE_BATCH_ROWS = 16384  # query rows (pairs x heads) per batched tile call on CPU: transients ~4 MB


def _tiles_per_batch(tile: int, G: int, device: torch.device) -> int:
    """Tiles per batched call: CPU keeps transients cache-sized; a GPU takes 16x more per launch."""
    rows = TILE_BATCH_ROWS * (1 if device.type == "cpu" else 16)
    return max(1, rows // (tile * G))


def _with_dummy_row(x: torch.Tensor) -> torch.Tensor:
    """[R, ...] -> [R+1, ...] with a zero row R, the target of padding slots."""
    return torch.cat((x, x.new_zeros(1, *x.shape[1:])))


def _tiled_forward(q_rows, k_blocks, v_blocks, tile_query, tile_block, key_rows, local_mask, layout, scale):
    """q_rows [R=BH*Tq, G, hd]; k/v_blocks [BH*N_b, 1, l', hd] -> out [R, G, hd], lse [R, G] (fp32 or wider).

    The tiles run in batches of about TILE_BATCH_ROWS query rows so every transient stays small (cache
    resident, reused by the allocator); the partial softmaxes are merged online (running max, denominator
    and numerator per query), starting from the local part that every query has.
    """
    BH, lead, n_loc = layout
    R, G, hd = q_rows.shape
    n_tiles = tile_block.shape[0]
    tile = tile_query.shape[0] // n_tiles
    l_sel = k_blocks.shape[2]
    compute = torch.promote_types(q_rows.dtype, torch.float32)
    # local part: query block c against blocks (0, c-1, c) -> [BH*n_loc, 1, 3l', hd]
    k_loc = k_blocks.index_select(0, key_rows.flatten()).view(-1, 1, 3 * l_sel, hd)
    v_loc = v_blocks.index_select(0, key_rows.flatten()).view(-1, 1, 3 * l_sel, hd)
    out_l, lse_l = attention_partial(_to_local(q_rows, BH, lead, n_loc, l_sel), k_loc, v_loc, local_mask, scale)
    # running merge state over rows 0..R (row R collects the padding slots and is dropped)
    m = _with_dummy_row(_from_local(lse_l, BH, lead, R // BH).to(compute))  # [R+1, G]
    num = _with_dummy_row(_from_local(out_l, BH, lead, R // BH).to(compute))  # [R+1, G, hd]
    den = torch.ones_like(m)
    q_ext = _with_dummy_row(q_rows)
    step = _tiles_per_batch(tile, G, q_rows.device)
    for a in range(0, n_tiles, step):  # loop over tile batches (count fixed by shapes), not tokens
        blocks = tile_block[a : a + step]
        dest = tile_query[a * tile : (a + blocks.shape[0]) * tile]  # [nb*tile]
        qt = q_ext.index_select(0, dest).view(-1, 1, tile * G, hd)
        out_t, lse_t = attention_partial(qt, k_blocks.index_select(0, blocks), v_blocks.index_select(0, blocks), None, scale)
        out_t, lse_t = out_t.view(-1, G, hd), lse_t.view(-1, G).to(compute)
        m_new = m.scatter_reduce(0, dest[:, None].expand(-1, G), lse_t, reduce="amax")
        alpha = torch.exp(m - m_new)  # [R+1, G] rescales what was merged so far
        num.mul_(alpha[..., None])
        den.mul_(alpha)
        w_t = torch.exp(lse_t - m_new.index_select(0, dest))  # [nb*tile, G]
        den.index_add_(0, dest, w_t)
        num.index_add_(0, dest, out_t.to(compute).mul_(w_t[..., None]))
        m = m_new
    out = (num[:R] / den[:R, :, None]).to(q_rows.dtype)
    return out, m[:R] + torch.log(den[:R])  # lse [R, G]: log-sum-exp over all selected keys


def _tiled_backward(d_out, q_rows, k_blocks, v_blocks, tile_query, tile_block, key_rows, local_mask, layout, scale,
                    out, lse):
    """Gradients of _tiled_forward: dq [R, G, hd] (q's dtype), dk, dv [BH*N_b, 1, l', hd] (k's dtype).
    Scores are recomputed from the merged out and lse (flash-attention style); nothing quadratic is stored."""
    BH, lead, n_loc = layout
    R, G, hd = q_rows.shape
    n_tiles = tile_block.shape[0]
    tile = tile_query.shape[0] // n_tiles
    l_sel = k_blocks.shape[2]
    dk, dv = torch.zeros_like(k_blocks), torch.zeros_like(v_blocks)

    def local(t):
        return _to_local(t, BH, lead, n_loc, l_sel)

    rows = key_rows.flatten()
    dq_l, dk_l, dv_l = attention_partial_backward(
        local(d_out), local(q_rows),
        k_blocks.index_select(0, rows).view(-1, 1, 3 * l_sel, hd), v_blocks.index_select(0, rows).view(-1, 1, 3 * l_sel, hd),
        local(out), local(lse), local_mask, scale,
    )
    dq = _with_dummy_row(_from_local(dq_l, BH, lead, R // BH).to(q_rows.dtype))  # [R+1, G, hd]
    dk.index_add_(0, rows, dk_l.reshape(-1, 1, l_sel, hd).to(dk.dtype))
    dv.index_add_(0, rows, dv_l.reshape(-1, 1, l_sel, hd).to(dv.dtype))
    # padding slots read the zero row R: dO = 0 there, so they contribute nothing
    q_ext, do_ext, out_ext, lse_ext = (_with_dummy_row(t) for t in (q_rows, d_out, out, lse))
    step = _tiles_per_batch(tile, G, q_rows.device)
    for a in range(0, n_tiles, step):
        blocks = tile_block[a : a + step]
        dest = tile_query[a * tile : (a + blocks.shape[0]) * tile]
        dq_t, dk_t, dv_t = attention_partial_backward(
            do_ext.index_select(0, dest).view(-1, 1, tile * G, hd),
            q_ext.index_select(0, dest).view(-1, 1, tile * G, hd),
            k_blocks.index_select(0, blocks), v_blocks.index_select(0, blocks),
            out_ext.index_select(0, dest).view(-1, 1, tile * G, hd),
            lse_ext.index_select(0, dest).view(-1, 1, tile * G),
            None, scale,
        )
        dq.index_add_(0, dest, dq_t.reshape(-1, G, hd).to(dq.dtype))
        dk.index_add_(0, blocks, dk_t.to(dk.dtype))
        dv.index_add_(0, blocks, dv_t.to(dv.dtype))
    return dq[:R], dk, dv


def _gathered_layout(block_idx, n_blocks: int, q_start: int, l_sel: int, dtype):
    """block_idx [BH, Tq, n] -> key block rows [BH*Tq*n] into [BH*N_b] and the additive mask
    [BH*Tq, 1, 1, n*l'] (0 = key visible: its block is selected and its position <= the query's)."""
    BH, Tq, n = block_idx.shape
    dev = block_idx.device
    rows = (block_idx.clamp_min(0) + (torch.arange(BH, device=dev) * n_blocks).view(BH, 1, 1)).flatten()
    k_pos = (block_idx[..., None] * l_sel + torch.arange(l_sel, device=dev)).flatten(-2)  # [BH, Tq, n*l']
    q_pos = q_start + torch.arange(Tq, device=dev)[:, None]
    visible = (k_pos <= q_pos) & (block_idx >= 0).repeat_interleave(l_sel, dim=-1)
    mask = torch.zeros(visible.shape, dtype=dtype, device=dev).masked_fill_(~visible, float("-inf"))
    return rows, mask.view(BH * Tq, 1, 1, n * l_sel)


GATHER_MAX_QUERIES = 16  # chunks with at most this many queries use the gathered (decode) variant


def _key_blocks(k: torch.Tensor, l_sel: int) -> torch.Tensor:
    """[B, H_kv, Tk, hd] keys (or values) -> [B*H_kv*N_b, 1, l', hd], zero-padded to whole blocks (the
    padded keys lie after every query). A view when Tk is a multiple of l' and k is contiguous."""
    B, H_kv, Tk, hd = k.shape
    n_blocks = -(-Tk // l_sel)
    if n_blocks * l_sel != Tk:
        k = F.pad(k, (0, 0, 0, n_blocks * l_sel - Tk))
    return k.reshape(B * H_kv * n_blocks, 1, l_sel, hd)


def _chunk_plan(idx, n_blocks: int, q_start: int, l_sel: int, tile: int, dtype):
    """How one chunk of queries runs: ("gathered", rows, mask) for a few queries (decode-like), else
    ("tiled", tiles, key_rows, local_mask, layout). idx [BH, C, n]."""
    BH, C, _ = idx.shape
    if C <= GATHER_MAX_QUERIES:
        return ("gathered", *_gathered_layout(idx, n_blocks, q_start, l_sel, dtype))
    lead, n_loc, key_rows, local_mask = _local_layout(BH, n_blocks, q_start, C, l_sel, dtype, idx.device)
    tiles = _build_tiles(idx, n_blocks, q_start, l_sel, min(tile, C))
    return ("tiled", tiles, key_rows, local_mask, (BH, lead, n_loc))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[B, H_kv, G, C, ...] -> [B*H_kv*C, G, ...] (query rows, the G heads of a group together)."""
    B, H_kv, G, C = x.shape[:4]
    return x.transpose(2, 3).reshape(B * H_kv * C, G, *x.shape[4:])


def selected_attention_fwd(q, k, v, block_idx, q_start: int, l_sel: int, tile: int, chunk: int):
    """The torch path: q [B, H_kv, G, Tq, hd], k/v [B, H_kv, Tk, hd], block_idx [B, H_kv, Tq, n]
    -> o [B, H_kv, G, Tq, hd] (q's dtype), lse [B, H_kv, G, Tq] (fp32 or wider). Queries run in chunks of
    `chunk` (bounds the tile index buffers); a chunk of at most GATHER_MAX_QUERIES queries gathers its
    keys per query, longer ones run block-centric tiles."""
    B, H_kv, G, Tq, hd = q.shape
    BH, scale = B * H_kv, 1.0 / math.sqrt(hd)
    k_blocks, v_blocks = _key_blocks(k, l_sel), _key_blocks(v, l_sel)
    n_blocks = k_blocks.shape[0] // BH
    o = torch.empty(B, H_kv, Tq, G, hd, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H_kv, Tq, G, dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
    for a in range(0, Tq, chunk):
        q_rows = _rows(q[:, :, :, a : a + chunk])  # [BH*C, G, hd]
        idx = block_idx[:, :, a : a + chunk].reshape(BH, -1, block_idx.shape[-1])
        C = idx.shape[1]
        plan = _chunk_plan(idx, n_blocks, q_start + a, l_sel, tile, q.dtype)
        if plan[0] == "gathered":
            rows, mask = plan[1:]
            kg, vg = (t.index_select(0, rows).view(BH * C, 1, -1, hd) for t in (k_blocks, v_blocks))
            out, lse_c = attention_partial(q_rows.unsqueeze(2), kg, vg, mask, scale)  # [BH*C, G, 1, hd]
        else:
            tiles, key_rows, local_mask, layout = plan[1:]
            out, lse_c = _tiled_forward(q_rows, k_blocks, v_blocks, *tiles, key_rows, local_mask, layout, scale)
        o[:, :, a : a + C] = out.view(B, H_kv, C, G, hd)
        lse[:, :, a : a + C] = lse_c.view(B, H_kv, C, G)
    return o.transpose(2, 3).contiguous(), lse.transpose(2, 3).contiguous()


def selected_attention_bwd(d_o, q, k, v, block_idx, o, lse, q_start: int, l_sel: int, tile: int, chunk: int):
    """Gradients of selected_attention_fwd: dq [B, H_kv, G, Tq, hd], dk, dv [B, H_kv, Tk, hd]."""
    B, H_kv, G, Tq, hd = q.shape
    BH, Tk, scale = B * H_kv, k.shape[2], 1.0 / math.sqrt(hd)
    k_blocks, v_blocks = _key_blocks(k, l_sel), _key_blocks(v, l_sel)
    n_blocks = k_blocks.shape[0] // BH
    dk, dv = torch.zeros_like(k_blocks), torch.zeros_like(v_blocks)
    dq = torch.empty(B, H_kv, Tq, G, hd, dtype=q.dtype, device=q.device)
    for a in range(0, Tq, chunk):
        part = (slice(None), slice(None), slice(None), slice(a, a + chunk))
        q_rows, do_rows, o_rows, lse_rows = (_rows(t[part]) for t in (q, d_o, o, lse))
        idx = block_idx[:, :, a : a + chunk].reshape(BH, -1, block_idx.shape[-1])
        C = idx.shape[1]
        plan = _chunk_plan(idx, n_blocks, q_start + a, l_sel, tile, q.dtype)
        if plan[0] == "gathered":
            rows, mask = plan[1:]
            kg, vg = (t.index_select(0, rows).view(BH * C, 1, -1, hd) for t in (k_blocks, v_blocks))
            dq_c, dk_c, dv_c = attention_partial_backward(
                do_rows.unsqueeze(2), q_rows.unsqueeze(2), kg, vg, o_rows.unsqueeze(2), lse_rows.unsqueeze(2), mask, scale
            )
            dk.index_add_(0, rows, dk_c.reshape(-1, 1, l_sel, hd).to(dk.dtype))
            dv.index_add_(0, rows, dv_c.reshape(-1, 1, l_sel, hd).to(dv.dtype))
        else:
            tiles, key_rows, local_mask, layout = plan[1:]
            dq_c, dk_c, dv_c = _tiled_backward(
                do_rows, q_rows, k_blocks, v_blocks, *tiles, key_rows, local_mask, layout, scale, o_rows, lse_rows
            )
            dk += dk_c
            dv += dv_c
        dq[:, :, a : a + C] = dq_c.reshape(B, H_kv, C, G, hd)
    unblock = (lambda t: t.view(B, H_kv, n_blocks * l_sel, hd)[:, :, :Tk])
    return dq.transpose(2, 3).contiguous(), unblock(dk).contiguous(), unblock(dv).contiguous()
