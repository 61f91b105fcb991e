"""The compressed and sliding-window branches through FlexAttention (CUDA; nsa.kernel auto | triton).

Same semantics as the portable path (impl/compression.py, impl/window.py: ops.compressed_attention and
ops.window_attention with nsa.kernel=torch), written as mask_mods:
  compressed: query at position p sees compressed token i iff i*d + l - 1 <= p (rows that see nothing
              give a zero output, as FlexAttention returns for fully masked rows);
  window:     query at position p sees key position s iff p - w < s <= p.
The block masks are derived from that geometry, not by evaluating the mask over [Tq x Tk]: for each
128 x 128 tile the bounds of its query and key positions say "no key visible" (skipped), "every key
visible" (a full tile: no mask_mod call) or "the boundary crosses it" (mask_mod applied). That is
O(Tq/128 * Tk/128) integer work per call, so under torch.compile it costs nothing next to attention;
in eager mode masks are cached per geometry.

One compile per shape family, not per chunk offset. In eager mode the calls go through one
`torch.compile(flex_attention, dynamic=False)` wrapper, and what Dynamo guards on decides when it compiles
again. For the BlockMask's mask_mod it guards on the function's `__code__` (ID_MATCH), not on the function
object, and on each closure cell: a tensor cell by TENSOR_MATCH (dtype, device, shape, stride: never its
value), an int cell by EQUALS_MATCH (its value). So:
  - the offsets q_start, k_start change with every chunk of a chunked prefill: they are captured as 0-dim
    int64 tensors on the query's device (new data, not new code; the fused kernel reads them as inputs);
  - l, d, w stay Python ints: they are per-model constants, so their value guards hold across calls (one
    compile per (l, d, w), i.e. per model config) and the kernel gets them folded in as constants;
  - the mask_mods are built by module-level factories (`_compressed_mask_mod`, `_window_mask_mod`), one code
    object each, so a fresh closure per geometry (or per call, under compile) reuses the compiled graph.
The block-mask tensors are guarded by metadata only, their seq_lengths by value (= the shapes). What still
compiles again is a new shape (dynamic=False): (B, H, Tq, Tk, hd, dtype) and the tile counts that follow.
In a chunked prefill the compressed branch's key count N_c grows with every chunk: its keys are padded to the
next power of two (`_pad_keys`; the padded tokens are masked by the geometry), so that branch meets log2(N_c)
shapes, not one per chunk; the window branch's keys (w - 1 + Tq after the first chunk) keep one shape.

Packed documents (nsa/attention/documents.py). With a frame [3, B, Tq] (q_pos, k_base, c_base) each query
reads only its own document, counted from the document's first token:
  compressed: query (b, t) at document position p = q_pos[b, t] sees compressed token ki iff
              c_base[b, t] <= ki < c_base[b, t] + num_compressed(p + 1, l, d), i.e. j = ki - c_base >= 0 and
              j*d + l - 1 <= p (rows that see nothing: zero output, as without a frame);
  window:     query (b, t) sees key index ki iff the window condition above holds (positions q_start + t,
              k_start + ki) and ki >= k_base[b, t]: the window stops at the document's first key;
  dense:      `flex_document_attention` (dense.py's CUDA path): query t sees key s iff start[b, t] <= s <= t.
The frame's rows are tensors captured by the mask_mod (data, guarded by metadata: a new batch of documents
does not recompile), and the block masks get a batch dimension (one tile list per row, [B, 1, nq, nk]),
derived from each query tile's min / max of the frame's bounds (a few reductions over [B, Tq], no host
sync): a key tile outside every query's range in the tile is skipped, one inside all of them is full.
Those masks depend on the data, so they are never cached.

FlexAttention has no CPU backward in PyTorch 2.13, so the layer uses these only on CUDA
(`use_flex`); tests check the forward on CPU and the backward on CUDA (tests/nsa/test_nsa_gpu.py).
Eager calls on CPU run FlexAttention unfused unless "cpu" is added to `COMPILE_DEVICES` (the tests do,
with `COMPILE_BACKEND = "aot_eager"`, to count Dynamo compiles: the guards are the same for every backend).
"""
from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

try:  # torch >= 2.9: auxiliary outputs by request (return_lse is deprecated there)
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # older torch: return_lse
    AuxRequest = None

from nsa.profiling import audit

BLOCK = 128  # FlexAttention's tile (queries x keys)
_MASK_CACHE: OrderedDict[tuple, BlockMask] = OrderedDict()
_MASK_CACHE_SIZE = 64  # geometries kept in eager mode (chunked prefill meets one per chunk offset)
# Eager calls on these device types go through torch.compile(flex_attention); others run it unfused. Tests add
# "cpu" (with a cheap backend) to check that chunk offsets do not recompile.
COMPILE_DEVICES: frozenset[str] = frozenset({"cuda"})
COMPILE_BACKEND = "inductor"
_compiled_flex: dict[str, Callable] = {}  # backend -> compiled wrapper
FOLD_QUERIES = 2048  # the compressed branch's queries per folded batch row (fold_count); 0: never fold


def use_flex(kernel: str, q: torch.Tensor) -> bool:
    """The compressed and window branches run through FlexAttention for CUDA tensors unless nsa.kernel is
    torch; float64 (the tests' oracle dtype, which the fused kernels do not take) stays on the SDPA path."""
    return kernel != "torch" and q.device.type == "cuda" and q.dtype != torch.float64


def _run_flex(site: str, q, k, v, block_mask: BlockMask, return_lse: bool = False):
    """flex_attention fused by torch.compile: inside a compiled model directly, in eager mode through one
    compiled wrapper (dynamic=False: one kernel per shape; offsets live in the mask_mod's captured tensors, so
    a new chunk offset reuses it). Devices outside COMPILE_DEVICES (CPU forward tests) run the unfused path.
    return_lse: also the rows' log-sum-exps [B, H, Tq] (natural log, fp32; -inf where a row sees no key)."""
    gqa = q.shape[1] != k.shape[1]
    kw = dict(block_mask=block_mask, enable_gqa=gqa, kernel_options=_kernel_options(q, k))
    if return_lse and AuxRequest is not None:
        kw["return_aux"] = AuxRequest(lse=True)
    elif return_lse:
        kw["return_lse"] = True
    audit(site, "flex_attention", q, k)
    if torch.compiler.is_compiling():
        out = flex_attention(q, k, v, **kw)
    elif q.device.type not in COMPILE_DEVICES:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            out = flex_attention(q, k, v, **kw)
    else:
        if COMPILE_BACKEND not in _compiled_flex:
            _compiled_flex[COMPILE_BACKEND] = torch.compile(flex_attention, dynamic=False, backend=COMPILE_BACKEND)
        out = _compiled_flex[COMPILE_BACKEND](q, k, v, **kw)
    return (out[0], out[1].lse) if return_lse and AuxRequest is not None else out


def _kernel_options(q: torch.Tensor, k: torch.Tensor) -> dict | None:
    """Inductor lowers a query shorter than 128 to its flex-decoding kernel, whose row tile is the next power of
    two of Tq * (H / H_kv); when that tile exceeds the mask's 128-row block, every config is rejected and the
    compile fails with NoValidChoicesError (torch 2.9 - 2.15; first met on an H200: 33 queries x 4 heads per key
    head). Such shapes go to the main flex kernel, which takes any length; decode steps (Tq * groups <= 128)
    keep the decoding kernel."""
    rows_per_tile = q.shape[2] * (q.shape[1] // k.shape[1])
    return {"FORCE_USE_FLEX_ATTENTION": True} if q.shape[2] < BLOCK < rows_per_tile else None


def _compressed_mask_mod(q_start: torch.Tensor, l: int, d: int):
    """Query qi (position q_start + qi) sees compressed token ki iff ki*d + l - 1 <= q_start + qi. q_start is
    a 0-dim tensor (data to the compiled kernel); l, d are per-model ints (constants in it)."""

    def mask_mod(batch, head, qi, ki):
        return ki * d + (l - 1) <= qi + q_start

    return mask_mod


def _window_mask_mod(q_start: torch.Tensor, k_start: torch.Tensor, w: int):
    """Query at p = q_start + qi sees key at s = k_start + ki iff p - w < s <= p (offsets: 0-dim tensors)."""

    def mask_mod(batch, head, qi, ki):
        s, p = ki + k_start, qi + q_start
        return (s <= p) & (s > p - w)

    return mask_mod


def _compressed_frame_mask_mod(q_pos: torch.Tensor, c_base: torch.Tensor, l: int, d: int):
    """With documents: query (b, qi) at document position p = q_pos[b, qi] sees compressed token ki iff
    j = ki - c_base[b, qi] >= 0 and j*d + l - 1 <= p (the j-th token of its own document, whole in its past).
    q_pos, c_base [B, Tq] int64 are captured tensors (data to the compiled kernel, guarded by metadata)."""

    def mask_mod(batch, head, qi, ki):
        j = ki - c_base[batch, qi]
        return (j >= 0) & (j * d + (l - 1) <= q_pos[batch, qi])

    return mask_mod


def _window_frame_mask_mod(q_start: torch.Tensor, k_start: torch.Tensor, w: int, k_base: torch.Tensor):
    """With documents: the window of _window_mask_mod, cut at the document's first key: also ki >= k_base[b, qi]
    (k_base [B, Tq] int64, a captured tensor)."""

    def mask_mod(batch, head, qi, ki):
        s, p = ki + k_start, qi + q_start
        return (s <= p) & (s > p - w) & (ki >= k_base[batch, qi])

    return mask_mod


def _document_mask_mod(start: torch.Tensor):
    """Dense attention over packed documents: query qi sees key ki iff start[b, qi] <= ki <= qi
    (start [B, T] int64, Documents.start: a captured tensor)."""

    def mask_mod(batch, head, qi, ki):
        return (ki <= qi) & (ki >= start[batch, qi])

    return mask_mod


def _offset(x: int, device) -> torch.Tensor:
    return torch.full((), x, dtype=torch.int64, device=device)  # a fill, not a host-to-device copy


def _tile_bounds(n: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """First and last index of each 128-tile of a length-n axis, and whether the tile is whole."""
    lo = torch.arange(0, n, BLOCK, device=device)
    hi = torch.clamp(lo + BLOCK, max=n) - 1
    return lo, hi, (hi - lo + 1) == BLOCK


def _compact(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[nq, nk] or [B, nq, nk] bool -> FlexAttention's (num_blocks [1 or B, 1, nq], indices [1 or B, 1, nq, nk]):
    per query tile, the count of True columns and their indices first, ascending."""
    tiles = tiles if tiles.dim() == 3 else tiles[None]  # [B', nq, nk]
    order = torch.sort((~tiles).to(torch.int8), dim=-1, stable=True).indices
    return tiles.sum(-1).to(torch.int32)[:, None], order.to(torch.int32)[:, None]


def _tile_min_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, n] -> min and max over each 128-tile of the last axis, [B, nt] each (the ragged last tile
    reads its own values only: indices past n repeat index n - 1)."""
    B, n = x.shape
    nt = -(-n // BLOCK)
    at = torch.arange(nt * BLOCK, device=x.device).clamp_max(n - 1)
    tiles = x[:, at].view(B, nt, BLOCK)
    return tiles.amin(-1), tiles.amax(-1)


def _blocks(some: torch.Tensor, every: torch.Tensor, q_whole, k_whole, mask_mod, Tq: int, Tk: int) -> BlockMask:
    """Tile lists [.., nq, nk] (some key visible / every key visible) -> BlockMask; ragged edge tiles always
    take the mask_mod."""
    every = every & q_whole[:, None] & k_whole[None, :]
    return BlockMask.from_kv_blocks(
        *_compact(some & ~every), *_compact(every), BLOCK_SIZE=BLOCK, mask_mod=mask_mod, seq_lengths=(Tq, Tk)
    )


def _block_mask(kind: str, Tq: int, Tk: int, q_start: int, k_start: int, a: int, b: int, device) -> BlockMask:
    """kind "cmp": a = l, b = d (token i covers [i*d, i*d + l)); kind "win": a = w (b unused). The tiles come
    from the int geometry; the mask_mod reads the offsets from 0-dim tensors (see the module docstring), so the
    eager cache (_cached) only saves the tile arithmetic: it is not what keeps the compiled wrapper from
    recompiling."""

    def build() -> BlockMask:
        q_lo, q_hi, q_whole = _tile_bounds(Tq, device)  # [nq] query rows
        k_lo, k_hi, k_whole = _tile_bounds(Tk, device)  # [nk] key rows
        q_lo, q_hi = (q_lo + q_start)[:, None], (q_hi + q_start)[:, None]  # absolute positions, [nq, 1]
        some, every, mask_mod = _geometry(kind, q_lo, q_hi, k_lo, k_hi, q_start, k_start, a, b, device)
        return _blocks(some, every, q_whole, k_whole, mask_mod, Tq, Tk)

    return _cached((kind, Tq, Tk, q_start, k_start, a, b, str(device)), build)


def _cached(key: tuple, build: Callable[[], BlockMask]) -> BlockMask:
    """A geometry's BlockMask from the eager cache (_MASK_CACHE, least recently used out), built on a miss; under
    torch.compile always built (traced into the graph)."""
    if torch.compiler.is_compiling():
        return build()
    if key in _MASK_CACHE:
        _MASK_CACHE.move_to_end(key)
        return _MASK_CACHE[key]
    mask = _MASK_CACHE[key] = build()
    while len(_MASK_CACHE) > _MASK_CACHE_SIZE:
        _MASK_CACHE.popitem(last=False)
    return mask


def _geometry(kind: str, q_lo, q_hi, k_lo, k_hi, q_start: int, k_start: int, a: int, b: int, device):
    """The tiles of one document at query positions q_lo .. q_hi ([nq, 1]) and key tiles k_lo .. k_hi ([nk]):
    (some [nq, nk], every [nq, nk], mask_mod)."""
    if kind == "cmp":
        l, d = a, b
        end_lo, end_hi = k_lo * d + l - 1, k_hi * d + l - 1  # last position covered by a tile's first / last token
        mask_mod = _compressed_mask_mod(_offset(q_start, device), l, d)
        some, every = end_lo <= q_hi, end_hi <= q_lo  # [nq, nk]
    elif kind == "win":
        w = a
        s_lo, s_hi = k_lo + k_start, k_hi + k_start
        mask_mod = _window_mask_mod(_offset(q_start, device), _offset(k_start, device), w)
        some = (s_lo <= q_hi) & (s_hi > q_lo - w)
        every = (s_hi <= q_lo) & (s_lo > q_hi - w)
    else:
        raise ValueError(f"unknown branch {kind!r}")
    return some, every, mask_mod


def _check_frame(frame: torch.Tensor, q: torch.Tensor) -> None:
    B, _, Tq, _ = q.shape
    if frame.shape != (3, B, Tq) or frame.dtype != torch.int64:
        raise ValueError(f"frame must be int64 [3, {B}, {Tq}] (q_pos, k_base, c_base), "
                         f"got {frame.dtype} {list(frame.shape)}")


def _compressed_frame_block_mask(frame: torch.Tensor, Tk: int, l: int, d: int) -> BlockMask:
    """Per batch row [B, 1, nq, nk]: query (b, t) sees compressed tokens [c_base, end) with
    end = c_base + num_compressed(q_pos + 1, l, d). A key tile is visible to a query tile when it meets
    [min c_base, max end) over the tile's queries, and full when it lies inside [max c_base, min end)."""
    q_pos, c_base = frame[0].contiguous(), frame[2].contiguous()  # [B, Tq]
    Tq, device = q_pos.shape[1], q_pos.device
    count = torch.where(q_pos + 1 >= l, (q_pos + 1 - l).div(d, rounding_mode="floor") + 1, 0)  # [B, Tq]
    c_min, c_max = _tile_min_max(c_base)  # [B, nq]
    e_min, e_max = _tile_min_max(c_base + count)
    _, _, q_whole = _tile_bounds(Tq, device)
    k_lo, k_hi, k_whole = _tile_bounds(Tk, device)  # [nk]
    some = (k_lo < e_max[..., None]) & (k_hi >= c_min[..., None])  # [B, nq, nk]
    every = (k_lo >= c_max[..., None]) & (k_hi < e_min[..., None])
    return _blocks(some, every, q_whole, k_whole, _compressed_frame_mask_mod(q_pos, c_base, l, d), Tq, Tk)


def _window_frame_block_mask(frame: torch.Tensor, Tk: int, q_start: int, k_start: int, w: int) -> BlockMask:
    """Per batch row [B, 1, nq, nk]: the window's tiles, less the key tiles wholly before every query's
    document (k_hi < min k_base over the query tile); full only if also k_lo >= max k_base."""
    k_base = frame[1].contiguous()  # [B, Tq]
    Tq, device = k_base.shape[1], k_base.device
    q_lo, q_hi, q_whole = _tile_bounds(Tq, device)
    k_lo, k_hi, k_whole = _tile_bounds(Tk, device)
    q_lo, q_hi = (q_lo + q_start)[:, None], (q_hi + q_start)[:, None]
    some, every, _ = _geometry("win", q_lo, q_hi, k_lo, k_hi, q_start, k_start, w, 0, device)  # [nq, nk]
    b_min, b_max = _tile_min_max(k_base)  # [B, nq]
    some = some & (k_hi >= b_min[..., None])  # [B, nq, nk]
    every = every & (k_lo >= b_max[..., None])
    mask_mod = _window_frame_mask_mod(_offset(q_start, device), _offset(k_start, device), w, k_base)
    return _blocks(some, every, q_whole, k_whole, mask_mod, Tq, Tk)


def _document_block_mask(start: torch.Tensor) -> BlockMask:
    """Dense block-causal mask per batch row [B, 1, nq, nk]: query tile [q_lo, q_hi] reads key tiles that meet
    [min start, q_hi] (its queries' documents up to its last query), full ones inside [max start, q_lo]."""
    T, device = start.shape[1], start.device
    lo, hi, whole = _tile_bounds(T, device)
    s_min, s_max = _tile_min_max(start)  # [B, nq]
    some = (lo[None, :] <= hi[:, None]) & (hi >= s_min[..., None])  # [B, nq, nk]
    every = (hi[None, :] <= lo[:, None]) & (lo >= s_max[..., None])
    return _blocks(some, every, whole, whole, _document_mask_mod(start), T, T)


def flex_compressed_attention(
    q: torch.Tensor,  # [B, H, Tq, hd] queries at positions q_start .. (RoPE applied)
    ck: torch.Tensor,  # [B, H_kv, N_c, hd] compressed keys (RoPE applied)
    cv: torch.Tensor,  # [B, H_kv, N_c, hd]
    q_start: int,
    l: int,
    d: int,
    frame: torch.Tensor | None = None,  # [3, B, Tq] int64 documents (q_pos, k_base, c_base); then q_start is unused
    return_lse: bool = False,  # also the log-sum-exps [B, H, Tq] (fp32, -inf where a row sees no token)
):  # [B, H, Tq, hd]; rows that see no compressed token are zero
    """Without a frame query q_start + t sees tokens i with i*d + l - 1 <= q_start + t; with one, query (b, t)
    sees c_base <= ki < c_base + num_compressed(q_pos + 1, l, d) (its own document's tokens; module docstring)."""
    if frame is not None:
        _check_frame(frame, q)
    if ck.shape[2] == 0:
        empty = torch.zeros_like(q)
        return (empty, q.new_full(q.shape[:3], float("-inf"), dtype=torch.float32)) if return_lse else empty
    folds = fold_count(q.shape[2])
    if folds > 1:
        return _folded_compressed(q, ck, cv, q_start, l, d, frame, return_lse, folds)
    if frame is not None:
        return _run_flex("nsa.compressed[documents]", q, ck, cv, _compressed_frame_block_mask(frame, ck.shape[2], l, d),
                         return_lse)
    ck, cv = (_pad_keys(t) for t in (ck, cv))  # padded tokens i >= N_c fail i*d + l - 1 <= p for every query
    mask = _block_mask("cmp", q.shape[2], ck.shape[2], q_start, 0, l, d, q.device)
    return _run_flex("nsa.compressed", q, ck, cv, mask, return_lse)


def fold_count(Tq: int) -> int:
    """How many batch rows the compressed branch's queries are folded into (1: none): Tq / FOLD_QUERIES where that
    divides and is at least 2. FlexAttention's backward computes dK/dV with one program per (key tile, batch row,
    KV head), each looping over every query tile of the G heads that see it; the compressed branch has T/d keys
    (2,048 at 32k: 16 tiles x 2 KV heads = 32 programs, each over 512 query tiles x 6 heads on a 132-SM GPU).
    Folded, each batch row holds FOLD_QUERIES queries: NC times the programs, each 1/NC of the loop."""
    if not FOLD_QUERIES or Tq % FOLD_QUERIES or Tq < 2 * FOLD_QUERIES:
        return 1
    return Tq // FOLD_QUERIES


def _folded_compressed(q, ck, cv, q_start: int, l: int, d: int, frame, return_lse: bool, folds: int):
    """The compressed branch with its queries split into `folds` consecutive chunks, each its own batch row
    (q [B, H, Tq, hd] -> [B*NC, H, Tq/NC, hd]; the keys shared: expanded, their gradients summed back by autograd),
    each chunk's positions (and documents) in a frame [3, B*NC, Tq/NC]; outputs and log-sum-exps put back in order.
    The same attention row for row: what changes is how FlexAttention's backward spreads dK/dV over programs."""
    B, H, Tq, hd = q.shape
    Tc = Tq // folds
    if frame is None:  # one document from position 0: the mask depends on the geometry only (cached in eager mode)
        ck, cv = (_pad_keys(t) for t in (ck, cv))  # as unfolded: padded tokens are past every query
        mask = _folded_block_mask(B, Tq, q_start, folds, ck.shape[2], l, d, q.device)
    else:  # row b*NC + c: queries [c*Tc, (c+1)*Tc) of row b, in their documents
        mask = _compressed_frame_block_mask(frame.reshape(3, B * folds, Tc), ck.shape[2], l, d)
    qf = q.view(B, H, folds, Tc, hd).transpose(1, 2).reshape(B * folds, H, Tc, hd)
    ckf, cvf = (t[:, None].expand(B, folds, *t.shape[1:]).reshape(B * folds, *t.shape[1:]) for t in (ck, cv))
    out = _run_flex("nsa.compressed[folded]", qf, ckf, cvf, mask, return_lse)
    o, lse = out if return_lse else (out, None)
    o = o.view(B, folds, H, Tc, hd).transpose(1, 2).reshape(B, H, Tq, hd)
    if not return_lse:
        return o
    return o, lse.view(B, folds, H, Tc).transpose(1, 2).reshape(B, H, Tq)


def _folded_block_mask(B: int, Tq: int, q_start: int, folds: int, Tk: int, l: int, d: int, device) -> BlockMask:
    """The folded compressed branch's mask without documents: row b*NC + c holds queries at positions
    q_start + c*Tc + t, and every row reads compressed tokens from index 0 (a frame with q_pos those positions and
    c_base 0). Depends on the geometry only: cached like _block_mask's in eager mode."""

    def build() -> BlockMask:
        pos = torch.arange(q_start, q_start + Tq, device=device).expand(B, Tq)
        frame = torch.stack([pos, torch.zeros_like(pos), torch.zeros_like(pos)]).reshape(3, B * folds, Tq // folds)
        return _compressed_frame_block_mask(frame, Tk, l, d)

    return _cached(("folded", B, Tq, q_start, folds, Tk, l, d, str(device)), build)


def _pad_keys(x: torch.Tensor) -> torch.Tensor:
    """[B, H_kv, N, hd] -> [B, H_kv, N', hd], N' the next power of two (at least one tile), zero rows appended.
    A chunked prefill meets a new compressed-key count N_c every chunk: padded, it meets log2(N_c) shapes, so
    the compiled kernel compiles that often instead of once per chunk (and never runs into Dynamo's recompile
    limit, past which flex_attention falls back to the unfused kernel that materialises every score)."""
    n = x.shape[2]
    bucket = max(BLOCK, 1 << (n - 1).bit_length())
    return x if bucket == n else torch.nn.functional.pad(x, (0, 0, 0, bucket - n))


def flex_window_attention(
    q: torch.Tensor,  # [B, H, Tq, hd] queries at positions q_start ..
    k: torch.Tensor,  # [B, H_kv, Tk, hd] keys at positions k_start .. k_start+Tk-1
    v: torch.Tensor,  # [B, H_kv, Tk, hd]
    q_start: int,
    k_start: int,
    w: int,
    frame: torch.Tensor | None = None,  # [3, B, Tq] int64 documents: frame[1] (k_base) is the document's first key
) -> torch.Tensor:  # [B, H, Tq, hd]
    """Query q_start + t sees key k_start + ki iff it lies in (q_start + t - w, q_start + t]; with a frame also
    ki >= k_base[b, t] (the window stops at the document's first key)."""
    if frame is not None:
        _check_frame(frame, q)
        mask = _window_frame_block_mask(frame, k.shape[2], q_start, k_start, w)
        return _run_flex("nsa.window[documents]", q, k, v, mask)
    mask = _block_mask("win", q.shape[2], k.shape[2], q_start, k_start, w, 0, q.device)
    return _run_flex("nsa.window", q, k, v, mask)


def flex_document_attention(
    q: torch.Tensor,  # [B, H, T, hd]
    k: torch.Tensor,  # [B, H_kv, T, hd]
    v: torch.Tensor,  # [B, H_kv, T, hd]
    start: torch.Tensor,  # [B, T] int64: each token's document start (Documents.start)
) -> torch.Tensor:  # [B, H, T, hd]
    """Dense block-causal attention over packed documents: query t sees key s iff start[b, t] <= s <= t
    (dense.py's CUDA path). Every query sees itself, so no row is empty."""
    if start.shape != (q.shape[0], q.shape[2]) or k.shape[2] != q.shape[2]:
        raise ValueError(f"documents need Tq == Tk and start [B, T]: q {list(q.shape)}, k {list(k.shape)}, "
                         f"start {list(start.shape)}")
    return _run_flex("dense.causal_attention[documents]", q, k, v, _document_block_mask(start.contiguous()))
