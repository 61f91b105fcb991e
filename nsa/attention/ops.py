"""NSA's stages as torch.library custom ops: the layer calls the same six functions on every device.
The only module that registers custom ops and chooses a kernel (`resolve_kernel`).

    rotary(x, cos, sin)                    -> x rotated          nsa::rotary (its backward: the inverse rotation)
    compress_blocks(raw_k, raw_v, phi_k, phi_v) -> ck, cv        nsa::compress_blocks (+ _backward), Triton path only
    gated_combine(g, o_cmp, o_sel, o_win)  -> y                  nsa::gated_combine (+ _backward)
    decode_branches(qg, static caches)     -> o_cmp, o_sel, o_win  nsa::decode_branches (no autograd; Triton only)
    select_blocks(q, ck)                   -> block_idx          nsa::select_blocks (no autograd)
    indexer_picks(q_I, w, keys)            -> block_idx          nsa::indexer_picks (no autograd; nsa.selector=indexer)
    indexer_kl(out, target)                -> loss               nsa::indexer_kl (+ _backward; the indexer's KL term)
    pooled_mass_rows(q, ck)                -> target             nsa::pooled_mass_rows (no autograd; the KL's target)
    dense_mass_rows(q, k)                  -> target             nsa::dense_mass_rows (no autograd; the KL's target)
    compressed_attention(q, ck, cv)        -> o                  nsa::compressed_attention (+ _backward)
    selected_attention(q, k, v, block_idx) -> o                  nsa::selected_attention (+ _backward)
    window_attention(q, k, v)              -> o                  nsa::window_attention (+ _backward)

Packed documents: every op takes an optional frame [3, B, Tq] (nsa/attention/documents.py: each query's
position in its document and where its document's keys and compressed tokens start). The Triton kernels and
FlexAttention read it on the device; the torch path runs all documents at once through explicit masks while
the problem is small (impl/masked.py, `masked.fits`) and each document as if alone beyond that (impl/segments.py).

Each op is one node for the dispatcher, for torch.compile (no graph break: every op has a fake
implementation that only computes shapes) and for the meta device, so what is counted on a CPU (ops per
layer, graph breaks, recompiles) is the structure a GPU runs: a constant number of launches per layer,
whatever the sequence length. Eager calls outside any dispatch mode run the same bodies without the
dispatcher (nsa/custom_op.py: ~90 µs less host time a call), with the same results bit for bit. Implementations, chosen per call by NSAConfig.kernel
(`resolve_kernel`: "auto" = Triton on CUDA tensors, torch elsewhere):
  torch:  the chunked paths of impl/compression.py, impl/selection.py, impl/window.py and
          impl/block_select.py; forward ops return (o, log-sum-exp) and the backward ops recompute scores
          from them (flash-attention style);
  triton: selection and selected attention run Triton kernels (kernels/select_topk.py,
          kernels/selected_attention.py), imported only when chosen; on CPU tensors only in Triton's
          interpreter (the tests);
  CUDA compressed / window branches: FlexAttention (impl/flex.py). flex_attention is itself a higher-order
          op that torch.compile traces with its own autograd; it is called directly rather than inside a
          custom op, whose kernel runs below autograd, where FlexAttention's backward cannot be reached.
"""
from __future__ import annotations

import torch
from torch import Tensor

from nsa.attention.impl import block_select, combine, compression, index_scores, masked, segments, selection, window
from nsa.attention.impl.flex import flex_compressed_attention, flex_window_attention, use_flex
from nsa.custom_op import custom_op
from nsa.layers import apply_rotary
from nsa.triton_support import triton_unavailable

KERNELS = ("auto", "triton", "torch")


def resolve_kernel(kernel: str, device: torch.device) -> str:
    """NSAConfig.kernel -> "triton" or "torch" for tensors on `device`, decided at call time.

    auto: Triton on CUDA tensors when a Triton the kernels support imports (nsa/triton_support.py), else
    the torch path. triton: CUDA tensors, or CPU
    tensors when the Triton interpreter is on (TRITON_INTERPRET=1 before triton is imported).
    """
    if kernel == "torch" or (kernel == "auto" and device.type != "cuda"):
        return "torch"
    if kernel not in KERNELS:
        raise ValueError(f"nsa.kernel={kernel!r}; valid: {', '.join(KERNELS)}")
    if problem := triton_unavailable():
        if kernel == "auto":
            return "torch"
        raise RuntimeError(f"nsa.kernel='triton': {problem}")
    try:  # imports triton (only here: the package works without it)
        from nsa.attention.kernels import selected_attention as triton_selection
    except ImportError as exc:
        if kernel == "auto":
            return "torch"
        raise RuntimeError(f"nsa.kernel='triton' needs the triton package, which failed to import ({exc})") from None
    if device.type != "cuda" and not triton_selection.interpreter_active():
        raise RuntimeError(
            f"nsa.kernel='triton' on a {device.type} tensor needs Triton's interpreter (TRITON_INTERPRET=1 before the "
            "kernels are imported); use kernel='auto' or 'torch' there"
        )
    return "triton"


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _triton(kernel: str, x: Tensor) -> bool:
    return resolve_kernel(kernel, x.device) == "triton"


def left_to_inductor() -> bool:
    """Whether the elementwise stages (RoPE, the gated sum) run as plain torch ops instead of their custom ops: under
    torch.compile, for inductor to fuse them with their neighbours (a custom op is a launch of its own and a wall no
    fusion crosses). Eager, the custom ops' one launch per direction is fewer than the torch ops' several. With RoPE's
    compiled form (nsa.layers.apply_rotary) and the static decoder's one input matmul, an M7C layer's compiled decode
    step is 25 launches, 34 before (bench/bench_launches.py --compiled; docs/BENCHMARKS.md "The compiled decode
    step's kernels")."""
    return torch.compiler.is_compiling()


# ---------------------------------------------------------------- rotary position embedding
@custom_op("nsa::rotary")
def _rotary(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool, kernel: str, at: Tensor | None = None) -> Tensor:
    if _triton(kernel, x):
        from nsa.attention.kernels.rotary import rotary

        return rotary(x, cos, sin, inverse, at)
    return _rotary_torch(x, cos, sin, inverse, at)


def _rotary_torch(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool, at: Tensor | None) -> Tensor:
    """nsa::rotary's torch path: apply_rotary, the tables' rows gathered first where `at` is given."""
    if at is not None:  # rows at[b, t] of the tables [T', hd/2] or [B, T', hd/2] -> [B, T, hd/2]
        index = at[..., None].expand(-1, -1, cos.shape[-1])
        cos, sin = (r.expand(at.shape[0], *r.shape[-2:]).gather(1, index) for r in (cos, sin))
    return apply_rotary(x, cos, -sin if inverse else sin).contiguous()


@_rotary.register_fake
def _(x, cos, sin, inverse, kernel, at=None):
    return x.new_empty(x.shape)


def _rotary_setup(ctx, inputs, output):
    _, cos, sin, inverse, kernel, at = inputs
    ctx.save_for_backward(cos, sin, at)
    ctx.inverse, ctx.kernel = inverse, kernel


def _rotary_backward(ctx, d_out):
    cos, sin, at = ctx.saved_tensors
    return _rotary(d_out, cos, sin, not ctx.inverse, ctx.kernel, at), None, None, None, None, None  # the adjoint


_rotary.register_autograd(_rotary_backward, setup_context=_rotary_setup)


def rotary(
    x: Tensor,  # [B, H, T, hd]
    cos: Tensor,  # [T, hd/2], or per row [B, T, hd/2] (positions that restart in each packed document); no gradient
    sin: Tensor,  # like cos
    kernel: str = "torch",  # NSAConfig.kernel: the Triton kernel (kernels/rotary.py, one launch) or apply_rotary
    at: Tensor | None = None,  # [B, T] int64: position t of row b takes the tables' row at[b, t] (cos, sin [T' or B,
    # T', hd/2]); the Triton kernel reads it, the torch path gathers those rows first
) -> Tensor:  # [B, H, T, hd] contiguous, x's dtype
    """nsa.layers.apply_rotary as one op (forward and backward one launch each on the Triton path); the torch path
    runs apply_rotary itself, so CPU results are those of apply_rotary's, bit for bit. Under torch.compile the torch
    ops themselves (left_to_inductor)."""
    if left_to_inductor():
        return _rotary_torch(x, cos.detach(), sin.detach(), False, at)
    return _rotary(x, cos.detach(), sin.detach(), False, kernel, at)


# ---------------------------------------------------------------- phi, the block compressor (Triton path)
@custom_op("nsa::compress_blocks")
def _compress_blocks(raw_k: Tensor, raw_v: Tensor, ek: Tensor, w1k: Tensor, b1k: Tensor | None, w2k: Tensor,
                     b2k: Tensor | None, ev: Tensor, w1v: Tensor, b1v: Tensor | None, w2v: Tensor, b2v: Tensor | None,
                     lo: int, count: int, l: int, d: int, block_start: Tensor | None, valid: Tensor | None,
                     frame: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    from nsa.attention.kernels.compress_blocks import compress_blocks_fwd

    return compress_blocks_fwd(raw_k, raw_v, [ek, w1k, b1k, w2k, b2k], [ev, w1v, b1v, w2v, b2v], lo, count, l, d,
                               block_start, valid)


@_compress_blocks.register_fake
def _(raw_k, raw_v, ek, w1k, b1k, w2k, b2k, ev, w1v, b1v, w2v, b2v, lo, count, l, d, block_start, valid, frame):
    B, H, _, hd = raw_k.shape
    ck = raw_k.new_empty(B, H, count, hd)
    return ck, raw_v.new_empty(ck.shape), raw_k.new_empty(2, B, H, count, hd, dtype=_lse_dtype(raw_k.dtype))


@custom_op("nsa::compress_blocks_backward")
def _compress_blocks_bwd(d_ck: Tensor, d_cv: Tensor, raw_k: Tensor, raw_v: Tensor, weights: list[Tensor], a: Tensor,
                         has_bias: bool, lo: int, l: int, d: int, block_start: Tensor | None, valid: Tensor | None,
                         frame: Tensor | None) -> list[Tensor]:
    from nsa.attention.kernels.compress_blocks import compress_blocks_bwd

    phi_k, phi_v = _phi_lists(weights, has_bias)
    d_raw_k, d_raw_v, g_k, g_v = compress_blocks_bwd(d_ck, d_cv, raw_k, raw_v, phi_k, phi_v, a, lo, l, d,
                                                     block_start, valid, frame)
    return [d_raw_k, d_raw_v, *(g for g in g_k + g_v if g is not None)]


@_compress_blocks_bwd.register_fake
def _(d_ck, d_cv, raw_k, raw_v, weights, a, has_bias, lo, l, d, block_start, valid, frame):
    return [raw_k.new_empty(raw_k.shape), raw_v.new_empty(raw_v.shape), *(w.new_empty(w.shape) for w in weights)]


def _phi_lists(weights: list, has_bias: bool) -> tuple[list, list]:
    """The present parameters (E, W1, [b1,] W2, [b2]) of keys then values -> two lists of five (None: no bias)."""
    n = len(weights) // 2
    lists = []
    for part in (weights[:n], weights[n:]):
        lists.append(list(part) if has_bias else [part[0], part[1], None, part[2], None])
    return lists[0], lists[1]


def _compress_blocks_setup(ctx, inputs, output):
    raw_k, raw_v, *weights = inputs[:12]
    lo, count, l, d, block_start, valid, frame = inputs[12:]
    ctx.has_bias = weights[2] is not None
    present = [w for w in weights if w is not None]
    ctx.save_for_backward(raw_k, raw_v, output[2], *present)
    ctx.args = (lo, l, d, block_start, valid, frame)
    ctx.mark_non_differentiable(output[2])
    ctx.set_materialize_grads(False)  # the unused outputs' gradients stay None (no zero-filled tensors)


def _compress_blocks_backward(ctx, d_ck, d_cv, _d_a):
    raw_k, raw_v, a, *weights = ctx.saved_tensors
    if d_ck is None or d_cv is None:  # one of the two unused (gradients are not materialised)
        d_ck, d_cv = (g if g is not None else torch.zeros_like(a[0], dtype=raw_k.dtype) for g in (d_ck, d_cv))
    d_raw_k, d_raw_v, *d_weights = _compress_blocks_bwd(d_ck, d_cv, raw_k, raw_v, weights, a, ctx.has_bias,
                                                         *ctx.args)
    g_k, g_v = _phi_lists(d_weights, ctx.has_bias)
    return (d_raw_k, d_raw_v, *g_k, *g_v, None, None, None, None, None, None, None)


_compress_blocks.register_autograd(_compress_blocks_backward, setup_context=_compress_blocks_setup)


def _phi_kernels_fit(head_dim: int) -> bool:
    from nsa.attention.kernels.compress_blocks import fits

    return fits(head_dim)


def compress_blocks(
    raw_k: Tensor,  # [B, H_kv, R, hd] raw (un-rotated) keys of the compression branch
    raw_v: Tensor,  # [B, H_kv, R, hd] raw values
    phi_k: tuple,  # BlockCompressor.weights() of phi_K: (E, W1, b1 | None, W2, b2 | None)
    phi_v: tuple,  # of phi_V
    lo: int,  # raw row where compressed token 0's block starts (token i: lo + i*d)
    count: int,  # compressed tokens to emit
    l: int,
    d: int,
    kernel: str = "torch",  # NSAConfig.kernel
    layout=None,  # packed documents: a documents.CompressedLayout (then lo = 0, count = its slots)
) -> tuple[Tensor, Tensor]:  # ck, cv [B, H_kv, count, hd]
    """phi over every block of keys and values. Triton path: the op nsa::compress_blocks (kernels/compress_blocks.py:
    one launch forward and three backward for keys and values together; a layout's unused slots come out zero), for
    head dims up to its MAX_HEAD_DIM (64; larger ones take the torch path). Torch path: impl/compression.py `phi` over
    a strided view (or one gather per tensor with a layout), bit for bit the BlockCompressor modules' result."""
    if count <= 0:
        B, H, _, hd = raw_k.shape
        return raw_k.new_zeros(B, H, 0, hd), raw_v.new_zeros(B, H, 0, hd)
    if _triton(kernel, raw_k) and _phi_kernels_fit(raw_k.shape[-1]):
        packed = (layout.block_start, layout.valid, layout.frame) if layout is not None else (None, None, None)
        ck, cv, _ = _compress_blocks(raw_k, raw_v, *phi_k, *phi_v, lo, count, l, d, *packed)
        return ck, cv
    if layout is not None:
        return (compression.phi(compression.gather_blocks(raw_k, layout.block_rows, l), *phi_k),
                compression.phi(compression.gather_blocks(raw_v, layout.block_rows, l), *phi_v))
    return (compression.phi(compression.strided_blocks(raw_k, lo, count, l, d), *phi_k),
            compression.phi(compression.strided_blocks(raw_v, lo, count, l, d), *phi_v))


# ---------------------------------------------------------------- the gated combination of the branches
@custom_op("nsa::decode_branches")
def _decode_branches(qg: Tensor, cmp_k: Tensor, cmp_v: Tensor, sel_k: Tensor, sel_v: Tensor, win_k: Tensor,
                     win_v: Tensor, pos: Tensor, l: int, d: int, l_sel: int, n_sel: int) -> Tensor:
    from nsa.attention.kernels.decode_step import decode_branches

    return decode_branches(qg, cmp_k, cmp_v, sel_k, sel_v, win_k, win_v, pos, l, d, l_sel, n_sel)


@_decode_branches.register_fake
def _(qg, cmp_k, cmp_v, sel_k, sel_v, win_k, win_v, pos, l, d, l_sel, n_sel):
    return qg.new_empty(3, *qg.shape)  # o_cmp, o_sel, o_win stacked


def decode_branches(
    qg: Tensor,  # [B, H_kv, G, hd] one query per row at position pos, pre-scaled by 1/sqrt(hd)
    cmp_k: Tensor, cmp_v: Tensor,  # [B, H_kv, C + 1, hd] static caches (nsa/attention/static_cache.py)
    sel_k: Tensor, sel_v: Tensor,  # [B, H_kv, N_b * l', hd]
    win_k: Tensor, win_v: Tensor,  # [B, H_kv, w, hd]
    pos: Tensor,  # [] int64 on the device
    l: int, d: int, l_sel: int, n_sel: int, kernel: str,
) -> tuple[Tensor, Tensor, Tensor] | None:
    """A decode step's three branches over static caches with pooled selection as Triton kernels split over programs
    (kernels/decode_step.py, four launches: nsa::decode_branches) -> o_cmp, o_sel, o_win [B, H_kv, G, hd]; None where the kernel does
    not run (torch path, or a head dim or l' that is not a power of two >= 16): the caller's torch ops then."""
    hd = qg.shape[-1]
    if not _triton(kernel, qg) or hd & (hd - 1) or hd < 16 or l_sel & (l_sel - 1) or l_sel < 16:
        return None
    return tuple(_decode_branches(qg, cmp_k, cmp_v, sel_k, sel_v, win_k, win_v, pos, l, d, l_sel, n_sel).unbind(0))


@custom_op("nsa::gated_combine")
def _combine(g: Tensor, o_cmp: Tensor, o_sel: Tensor, o_win: Tensor, kernel: str) -> Tensor:
    if _triton(kernel, o_cmp):
        from nsa.attention.kernels.gated_combine import gated_combine_fwd

        return gated_combine_fwd(g, o_cmp, o_sel, o_win)
    return combine.gated_combine_fwd(g, o_cmp, o_sel, o_win)


@_combine.register_fake
def _(g, o_cmp, o_sel, o_win, kernel):
    B, H, T, hd = o_cmp.shape
    return o_cmp.new_empty(B, T, H, hd)


@custom_op("nsa::gated_combine_backward")
def _combine_bwd(d_y: Tensor, g: Tensor, o_cmp: Tensor, o_sel: Tensor, o_win: Tensor,
                 kernel: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if _triton(kernel, o_cmp):
        from nsa.attention.kernels.gated_combine import gated_combine_bwd

        return gated_combine_bwd(d_y, g, o_cmp, o_sel, o_win)
    return combine.gated_combine_bwd(d_y, g, o_cmp, o_sel, o_win)


@_combine_bwd.register_fake
def _(d_y, g, o_cmp, o_sel, o_win, kernel):
    return g.new_empty(g.shape), *(o.new_empty(o.shape) for o in (o_cmp, o_sel, o_win))


def _combine_setup(ctx, inputs, output):
    *tensors, kernel = inputs
    ctx.save_for_backward(*tensors)
    ctx.kernel = kernel


def _combine_backward(ctx, d_y):
    return (*_combine_bwd(d_y, *ctx.saved_tensors, ctx.kernel), None)


_combine.register_autograd(_combine_backward, setup_context=_combine_setup)


def gated_combine(
    g: Tensor,  # [B, T, H, 3] the gates (cmp, sel, win)
    o_cmp: Tensor,  # [B, H, T, hd] the branch outputs
    o_sel: Tensor,
    o_win: Tensor,
    kernel: str = "torch",  # NSAConfig.kernel: the Triton kernels (kernels/gated_combine.py) or impl/combine.py
) -> Tensor:  # [B, T, H, hd] contiguous: the output projection's layout
    """sum_i g_i o_i (paper Eq. 5) as one op per direction; the torch path's forward is gated_sum's, bit for bit.
    Under torch.compile the torch ops themselves (left_to_inductor)."""
    if not o_cmp.dtype == o_sel.dtype == o_win.dtype:  # autocast may mix them
        dtype = torch.promote_types(torch.promote_types(o_cmp.dtype, o_sel.dtype), o_win.dtype)
        o_cmp, o_sel, o_win = o_cmp.to(dtype), o_sel.to(dtype), o_win.to(dtype)
    if left_to_inductor():
        return combine.gated_combine_fwd(g, o_cmp, o_sel, o_win)
    return _combine(g, o_cmp, o_sel, o_win, kernel)


# ---------------------------------------------------------------- block selection (no autograd)
@custom_op("nsa::select_blocks")
def _select_blocks(q: Tensor, ck: Tensor, q_start: int, l: int, d: int, l_sel: int, n: int, q_chunk: int,
                   kernel: str, frame: Tensor | None, lse: Tensor | None) -> Tensor:
    # contiguous, as the fake below says: inductor asserts a custom op's strides (a torch path returns a slice)
    return _select_blocks_any_layout(q, ck, q_start, l, d, l_sel, n, q_chunk, kernel, frame, lse).contiguous()


def _select_blocks_any_layout(q, ck, q_start, l, d, l_sel, n, q_chunk, kernel, frame, lse) -> Tensor:
    if _triton(kernel, q):
        from nsa.attention.kernels import select_two_pass
        from nsa.attention.kernels.select_topk import fused_select_blocks

        if select_two_pass.applies(q_start, q.shape[3], l_sel):  # scores written out, then each row's top-n
            return select_two_pass.two_pass_select_blocks(q, ck, q_start, l, d, l_sel, n, frame=frame, lse=lse)
        return fused_select_blocks(q, ck, q_start, l, d, l_sel, n, frame=frame, lse=lse)
    if frame is not None:
        if masked.fits(q, q.shape[1] * q.shape[2], q.shape[3] + l_sel):
            return masked.select_blocks(q, ck, l, d, l_sel, n, frame)
        return segments.select_blocks(q, ck, l, d, l_sel, n, q_chunk, frame)
    return block_select.select_by_score(q, ck, q_start, l, d, l_sel, n, q_chunk)


@_select_blocks.register_fake
def _(q, ck, q_start, l, d, l_sel, n, q_chunk, kernel, frame, lse):
    B, H_kv, _, Tq, _ = q.shape
    return q.new_empty(B, H_kv, Tq, n, dtype=torch.long)


def select_blocks(
    q: Tensor,  # [B, H_kv, G, Tq, hd] queries (RoPE applied) at positions q_start ..
    ck: Tensor,  # [B, H_kv, N_c, hd] compressed keys (RoPE applied)
    q_start: int, l: int, d: int, l_sel: int, n: int, q_chunk: int, kernel: str,
    frame: Tensor | None = None,  # [3, B, Tq] documents (nsa/attention/documents.py); q_start then stays the absolute
    # position of query 0 (the layer's 0), which bounds every document position (the Triton path sizes its scores by it)
    lse: Tensor | None = None,  # [B, H_kv, G, Tq] the compressed branch's log-sum-exps over the same q, ck
) -> Tensor:  # [B, H_kv, Tq, n] int64, ascending, -1 = none (impl.selection.select_blocks' contract);
    # with a frame the blocks are counted from each query's document start. lse: the Triton kernel reuses the
    # compressed branch's softmax normaliser (Eq. 8 shared) instead of computing it again; the torch path ignores it
    lse = None if lse is None else lse.detach()
    return _select_blocks(q.detach(), ck.detach(), q_start, l, d, l_sel, n, q_chunk, kernel, frame, lse)


@custom_op("nsa::indexer_picks")
def _indexer_picks(q: Tensor, w: Tensor, keys: Tensor, q_start: int, l_sel: int, n: int, per_token: bool,
                   token_keys: bool, kernel: str, frame: Tensor | None = None) -> Tensor:
    if _triton(kernel, q):
        from nsa.attention.kernels.indexer_topk import fused_indexer_picks

        return fused_indexer_picks(q, w, keys, q_start, l_sel, n, per_token, token_keys, frame)
    if frame is not None:
        return index_scores.document_picks(q, w, keys, frame, l_sel, n, per_token).contiguous()
    if token_keys and not per_token:
        keys = index_scores.block_max(keys, l_sel)
    return index_scores.indexer_picks(q, w, keys, q_start, l_sel, n, per_token).contiguous()


@_indexer_picks.register_fake
def _(q, w, keys, q_start, l_sel, n, per_token, token_keys, kernel, frame=None):
    B, Tq, H_kv = q.shape[:3]
    return q.new_empty(B, H_kv, Tq, n, dtype=torch.long)


def indexer_picks(
    q: Tensor,  # [B, Tq, H_kv, h, e] index queries at positions q_start ..
    w: Tensor,  # [B, Tq, H_kv, h] their head weights
    keys: Tensor,  # [B, N_b, e] block keys, or (per_token or token_keys) [B, S, e] token keys from position 0
    q_start: int, l_sel: int, n: int, per_token: bool, kernel: str,
    token_keys: bool = False,  # with one key per block: pool the token keys to block keys here (no launch of its own)
    frame: Tensor | None = None,  # [3, B, Tq] packed documents (token keys from index 0; q_start unused): each query
    # scores its own document's blocks, counted from its first token
) -> Tensor:  # [B, H_kv, Tq, n] int64, ascending, -1 = none (impl.selection.select_blocks' contract)
    """nsa.selector=indexer: the top-n blocks by the learned indexer's scores (impl/index_scores.py; the Triton
    path kernels/indexer_topk.py: one launch, no [Tq, N_b] scores, with or without documents)."""
    return _indexer_picks(q.detach(), w.detach(), keys.detach(), q_start, l_sel, n, per_token, token_keys, kernel,
                          frame)


@custom_op("nsa::pooled_mass_rows")
def _pooled_mass_rows(q: Tensor, ck: Tensor, lse: Tensor | None, R: int, l: int, d: int, l_sel: int, n_blocks: int,
                      kernel: str) -> Tensor:
    if _triton(kernel, q):
        from nsa.attention.kernels.select_topk import pooled_block_mass_rows

        return pooled_block_mass_rows(q, ck, R, l, d, l_sel, n_blocks, lse=lse)
    return _target_rows_torch("compressed", q, ck, R, l, d, l_sel, n_blocks)


def _target_rows_torch(kind: str, q: Tensor, keys: Tensor, R: int, l: int, d: int, l_sel: int, n_blocks: int,
                       frame: Tensor | None = None) -> Tensor:
    """The KL's target for its R rows (r * T // R) in torch ops: kind "compressed" (keys: the compressed keys) or
    "dense" (keys: the selected branch's) -> [B, H_kv, R, n_blocks]; with a frame (packed documents) each row's
    within its document, its blocks counted from the document's first token."""
    rows = index_scores.kl_row_indices(q.shape[3], R, q.device)
    if frame is not None and kind == "compressed":
        return masked.document_block_scores(q[:, :, :, rows], keys, l, d, l_sel, frame[:, :, rows])[
            ..., :n_blocks].contiguous()
    if kind == "compressed":
        return index_scores.pooled_block_mass(q[:, :, :, rows], keys, rows, l, d, l_sel, n_blocks).contiguous()
    base = None if frame is None else frame[1][:, rows]
    return index_scores.dense_block_mass(q[:, :, :, rows], keys, rows, l_sel, n_blocks, base=base).contiguous()


@_pooled_mass_rows.register_fake
def _(q, ck, lse, R, l, d, l_sel, n_blocks, kernel):
    B, H_kv = q.shape[:2]
    return q.new_empty(B, H_kv, R, n_blocks, dtype=_lse_dtype(q.dtype))


def pooled_mass_rows(
    q: Tensor,  # [B, H_kv, G, T, hd] queries (RoPE applied) at positions 0 ..
    ck: Tensor,  # [B, H_kv, N_c, hd] compressed keys (RoPE applied)
    R: int, l: int, d: int, l_sel: int, n_blocks: int, kernel: str,
    lse: Tensor | None = None,  # [B, H_kv, G, T] the compressed branch's log-sum-exps (the Triton path reuses them)
) -> Tensor:  # [B, H_kv, R, n_blocks]
    """nsa.indexer_target=compressed: the compressed branch's mass per selection block summed over each group's heads
    (Eq. 9-10) for the KL's R rows, the queries at r * T // R (impl/index_scores.pooled_block_mass; the Triton path
    kernels/select_topk.pooled_block_mass_rows: one launch, the rows read in place)."""
    lse = None if lse is None else lse.detach()
    return _pooled_mass_rows(q.detach(), ck.detach(), lse, R, l, d, l_sel, n_blocks, kernel)


@custom_op("nsa::dense_mass_rows")
def _dense_mass_rows(q: Tensor, k: Tensor, R: int, l_sel: int, n_blocks: int, kernel: str) -> Tensor:
    if _triton(kernel, q):
        from nsa.attention.kernels.dense_mass import dense_block_mass_rows

        return dense_block_mass_rows(q, k, R, l_sel, n_blocks)
    return _target_rows_torch("dense", q, k, R, 0, 0, l_sel, n_blocks)


@_dense_mass_rows.register_fake
def _(q, k, R, l_sel, n_blocks, kernel):
    B, H_kv = q.shape[:2]
    return q.new_empty(B, H_kv, R, n_blocks, dtype=_lse_dtype(q.dtype))


def dense_mass_rows(
    q: Tensor,  # [B, H_kv, G, T, hd] queries (RoPE applied) at positions 0 ..
    k: Tensor,  # [B, H_kv, T, hd] the selected branch's keys (RoPE applied)
    R: int, l_sel: int, n_blocks: int, kernel: str,
) -> Tensor:  # [B, H_kv, R, n_blocks]
    """nsa.indexer_target=dense: dense causal attention's mass per selection block summed over each group's heads, for
    the KL's R rows, the queries at r * T // R (impl/index_scores.dense_block_mass; the Triton path
    kernels/dense_mass.py: one launch, no [R, T] scores)."""
    return _dense_mass_rows(q.detach(), k.detach(), R, l_sel, n_blocks, kernel)


def _counted_rows(frame: Tensor | None, counted: Tensor | None, R: int, l_sel: int) -> Tensor | None:
    """The KL mean's counted rows the Triton kernels read with packed documents: as given (the layers share one per
    batch), else counted here (index_scores.counted_kl_rows); None without a frame."""
    if frame is not None and counted is None:
        return index_scores.counted_kl_rows(frame, R, l_sel)
    return counted


@custom_op("nsa::indexer_kl")
def _indexer_kl(out: Tensor, target: Tensor | None, source: str, source_q: Tensor | None, source_k: Tensor | None,
                source_lse: Tensor | None, l: int, d: int, n_kv_heads: int, heads: int, index_dim: int, R: int,
                l_sel: int, per_token: bool, weight: float, kernel: str, frame: Tensor | None = None,
                counted: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    if _triton(kernel, out):
        from nsa.attention.kernels.indexer_kl import indexer_kl_forward

        spec = None if target is not None else (source, source_q, source_k, source_lse, l, d)
        counted = _counted_rows(frame, counted, R, l_sel)
        terms, stats, used = indexer_kl_forward(out, target, n_kv_heads, heads, index_dim, R, l_sel, per_token,
                                                weight, spec, frame, counted)
        return terms, stats, used if target is None else used.clone()  # outputs may not alias inputs
    if target is None:  # the target for the KL's rows from its source, as the target ops' torch path
        target = _target_rows_torch(source, source_q, source_k, R, l, d, l_sel, -(-out.shape[1] // l_sel), frame)
    with torch.no_grad():
        terms, stats = index_scores.kl_loss(out, target, n_kv_heads, heads, index_dim, R, l_sel, per_token, weight,
                                            frame)
    return terms, stats, target.clone()  # a custom op's outputs may not alias its inputs


@_indexer_kl.register_fake
def _(out, target, source, source_q, source_k, source_lse, l, d, n_kv_heads, heads, index_dim, R, l_sel, per_token,
      weight, kernel, frame=None, counted=None):
    acc, B = _lse_dtype(out.dtype), out.shape[0]
    n_blocks = target.shape[3] if target is not None else -(-out.shape[1] // l_sel)
    return (out.new_empty(B, n_kv_heads, R, dtype=acc), out.new_empty(B, n_kv_heads, R, 2, dtype=acc),
            out.new_empty(B, n_kv_heads, R, n_blocks, dtype=acc))


@custom_op("nsa::indexer_kl_backward")
def _indexer_kl_bwd(grad: Tensor, out: Tensor, target: Tensor, stats: Tensor, n_kv_heads: int, heads: int,
                    index_dim: int, R: int, l_sel: int, per_token: bool, weight: float, kernel: str,
                    frame: Tensor | None = None, counted: Tensor | None = None) -> Tensor:
    if _triton(kernel, out):
        from nsa.attention.kernels.indexer_kl import indexer_kl_backward

        counted = _counted_rows(frame, counted, R, l_sel)
        return indexer_kl_backward(grad, out, target, stats, n_kv_heads, heads, index_dim, R, l_sel, per_token, weight,
                                   frame=frame, counted=counted)
    return index_scores.kl_loss_backward(grad, out, target, n_kv_heads, heads, index_dim, R, l_sel, per_token, weight,
                                         frame)


@_indexer_kl_bwd.register_fake
def _(grad, out, target, stats, n_kv_heads, heads, index_dim, R, l_sel, per_token, weight, kernel, frame=None,
      counted=None):
    return torch.empty_like(out)


def _indexer_kl_setup(ctx, inputs, output):
    out = inputs[0]
    ctx.set_materialize_grads(False)  # the statistics' and target's gradients stay None (no zero-filled tensors)
    ctx.save_for_backward(out, output[2], output[1])  # the target as the forward used it
    ctx.rest = inputs[8:]  # n_kv_heads .. kernel, frame, counted


def _indexer_kl_backward(ctx, d_terms, _d_stats, _d_target):
    out, target, stats = ctx.saved_tensors
    return (_indexer_kl_bwd(d_terms, out, target, stats, *ctx.rest),) + (None,) * 17


_indexer_kl.register_autograd(_indexer_kl_backward, setup_context=_indexer_kl_setup)


def indexer_kl(
    out: Tensor,  # [B, T, H_kv*h*e + H_kv*h + e] the indexer's projection output (its input detached), positions 0 ..
    target: Tensor | None,  # [B, H_kv, R, N_b] the KL's target mass per block of the R queries at r * T // R
    n_kv_heads: int, heads: int, index_dim: int, R: int, l_sel: int, per_token: bool, weight: float, kernel: str,
    source: tuple | None = None,  # target None: ("compressed", q, ck, lse or None, l, d) or ("dense", q, sel_k)
    frame: Tensor | None = None,  # [3, B, T] packed documents: each row over its own document's blocks
    counted: Tensor | None = None,  # with a frame: impl/index_scores.counted_kl_rows (shared by the layers)
) -> Tensor:  # [B, H_kv, R]: terms whose sum is weight * the mean KL(target || softmax(scores)) over the rows
    # with >= 2 candidate blocks (the model sums every layer's terms at once: no reduction launch per layer)
    """nsa.selector=indexer's training term (impl/index_scores.kl_loss; the Triton path kernels/indexer_kl.py: one
    launch forward and one backward, no [R, N_b] scores kept). Its gradient reaches `out` only (the projection).
    With a source instead of a target, the target (ops.pooled_mass_rows' or ops.dense_mass_rows') is computed in the
    same launch: q [B, H_kv, G, T, hd] the layer's queries, ck / sel_k its compressed / selected keys, lse the
    compressed branch's log-sum-exps [B, H_kv, G, T]. With a frame each row scores its own document's blocks."""
    if target is not None:
        terms, _, _ = _indexer_kl(out, target.detach(), "given", None, None, None, 0, 0, n_kv_heads, heads, index_dim,
                                  R, l_sel, per_token, weight, kernel, frame, counted)
        return terms
    kind, q, keys, *rest = source
    lse, l, d = rest if rest else (None, 0, 0)
    terms, _, _ = _indexer_kl(out, None, kind, q.detach(), keys.detach(), None if lse is None else lse.detach(), l, d,
                              n_kv_heads, heads, index_dim, R, l_sel, per_token, weight, kernel, frame, counted)
    return terms


# ---------------------------------------------------------------- selected attention
@custom_op("nsa::selected_attention")
def _selected(q: Tensor, k: Tensor, v: Tensor, block_idx: Tensor, q_start: int, l_sel: int, tile: int,
              chunk: int, kernel: str, frame: Tensor | None) -> tuple[Tensor, Tensor, list[Tensor]]:
    """-> o, lse and what the backward reuses: the Triton block-centric path's slot index (built once per forward:
    one sort and ~45 index ops fewer in the backward), [] elsewhere."""
    if _triton(kernel, q):
        from nsa.attention.kernels.selected_attention import selected_attention_fwd

        o, lse, index = selected_attention_fwd(q, k, v, block_idx, q_start, l_sel, frame=frame, return_index=True)
        # a custom op's outputs may not alias its inputs: the index's keys are block_idx itself when it is int32
        return o, lse, [t.clone() if t.untyped_storage().data_ptr() == block_idx.untyped_storage().data_ptr()
                        else t for t in index]
    if frame is not None:
        if masked.fits(q, q.shape[1] * q.shape[2], k.shape[2]):
            return *masked.selected_fwd(q, k, v, block_idx, l_sel, frame), []
        return *segments.selected_fwd(q, k, v, block_idx, l_sel, tile, chunk, frame), []
    return *selection.selected_attention_fwd(q, k, v, block_idx, q_start, l_sel, tile, chunk), []


@_selected.register_fake
def _(q, k, v, block_idx, q_start, l_sel, tile, chunk, kernel, frame):
    index = []
    if q.shape[3] and _triton(kernel, q):
        from nsa.attention.kernels.selected_attention import slot_index_like, use_block_centric

        if use_block_centric(q.shape[2]):
            index = slot_index_like(block_idx, k.shape[2], l_sel, frame is not None)
    return q.new_empty(q.shape), q.new_empty(q.shape[:4], dtype=_lse_dtype(q.dtype)), index


@custom_op("nsa::selected_attention_backward")
def _selected_bwd(d_o: Tensor, q: Tensor, k: Tensor, v: Tensor, block_idx: Tensor, o: Tensor, lse: Tensor,
                  index: list[Tensor], q_start: int, l_sel: int, tile: int, chunk: int, kernel: str,
                  frame: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    if _triton(kernel, q):
        from nsa.attention.kernels.selected_attention import selected_attention_bwd

        return selected_attention_bwd(q, k, v, block_idx, o, lse, d_o, q_start, l_sel, frame=frame, index=index)
    if frame is not None:
        if masked.fits(q, q.shape[1] * q.shape[2], k.shape[2]):
            return masked.selected_bwd(d_o, q, k, v, block_idx, o, lse, l_sel, frame)
        return segments.selected_bwd(d_o, q, k, v, block_idx, o, lse, l_sel, tile, chunk, frame)
    return selection.selected_attention_bwd(d_o, q, k, v, block_idx, o, lse, q_start, l_sel, tile, chunk)


@_selected_bwd.register_fake
def _(d_o, q, k, v, block_idx, o, lse, index, q_start, l_sel, tile, chunk, kernel, frame):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _selected_setup(ctx, inputs, output):
    q, k, v, block_idx, *args = inputs
    o, lse, index = output
    ctx.save_for_backward(q, k, v, block_idx, o, lse, *index)
    ctx.args = args
    ctx.mark_non_differentiable(lse, *index)
    ctx.set_materialize_grads(False)  # the unused outputs' gradients stay None (no zero-filled tensors)


def _selected_backward(ctx, d_o, _d_lse, _d_index):
    q, k, v, block_idx, o, lse, *index = ctx.saved_tensors
    dq, dk, dv = _selected_bwd(d_o.contiguous(), q, k, v, block_idx, o, lse, index, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None


_selected.register_autograd(_selected_backward, setup_context=_selected_setup)


def selected_attention(
    q: Tensor,  # [B, H_kv, G, Tq, hd] queries at positions q_start ..
    k: Tensor,  # [B, H_kv, Tk, hd] selection keys at positions 0 .. Tk-1 (Tk >= q_start + Tq)
    v: Tensor,  # [B, H_kv, Tk, hd]
    block_idx: Tensor,  # [B, H_kv, Tq, n] from select_blocks (forced blocks included), -1 = none
    q_start: int,
    l_sel: int,
    tile: int,
    kernel: str = "torch",  # NSAConfig.kernel: auto | triton | torch (see resolve_kernel)
    chunk: int = 1 << 30,  # queries per chunk of the torch path (NSAConfig.sel_chunk)
    frame: Tensor | None = None,  # [3, B, Tq] documents: block j of a query = keys k_base + j*l' ..
) -> Tensor:  # [B, H_kv, G, Tq, hd]
    """Attention of each query over the keys of its selected blocks, keys after the query masked.
    Differentiable: the custom op nsa::selected_attention."""
    if not q.dtype == k.dtype == v.dtype:  # autocast may mix them
        dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    return _selected(q, k, v, block_idx, q_start, l_sel, tile, chunk, kernel, frame)[0]


# ---------------------------------------------------------------- compressed attention (torch path op)
@custom_op("nsa::compressed_attention")
def _compressed(q: Tensor, ck: Tensor, cv: Tensor, q_start: int, l: int, d: int, chunk: int,
                frame: Tensor | None) -> tuple[Tensor, Tensor]:
    if frame is not None:
        if masked.fits(q, q.shape[1], ck.shape[2]):
            return masked.compressed_fwd(q, ck, cv, l, d, frame)
        return segments.compressed_fwd(q, ck, cv, l, d, chunk, frame)
    return compression.compressed_attention_fwd(q, ck, cv, q_start, l, d, chunk)


@_compressed.register_fake
def _(q, ck, cv, q_start, l, d, chunk, frame):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=_lse_dtype(q.dtype))


@custom_op("nsa::compressed_attention_backward")
def _compressed_bwd(d_o: Tensor, q: Tensor, ck: Tensor, cv: Tensor, o: Tensor, lse: Tensor, q_start: int, l: int,
                    d: int, chunk: int, frame: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    if frame is not None:
        if masked.fits(q, q.shape[1], ck.shape[2]):
            return masked.compressed_bwd(d_o, q, ck, cv, o, lse, l, d, frame)
        return segments.compressed_bwd(d_o, q, ck, cv, o, lse, l, d, chunk, frame)
    return compression.compressed_attention_bwd(d_o, q, ck, cv, o, lse, q_start, l, d, chunk)


@_compressed_bwd.register_fake
def _(d_o, q, ck, cv, o, lse, q_start, l, d, chunk, frame):
    return q.new_empty(q.shape), ck.new_empty(ck.shape), cv.new_empty(cv.shape)


def _compressed_setup(ctx, inputs, output):
    q, ck, cv, *args = inputs
    ctx.save_for_backward(q, ck, cv, *output)
    ctx.args = args
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)  # the log-sum-exps' gradient stays None (no zero-filled tensor)


def _compressed_backward(ctx, d_o, _d_lse):
    q, ck, cv, o, lse = ctx.saved_tensors
    return (*_compressed_bwd(d_o.contiguous(), q, ck, cv, o, lse, *ctx.args), None, None, None, None, None)


_compressed.register_autograd(_compressed_backward, setup_context=_compressed_setup)


def compressed_attention(
    q: Tensor,  # [B, H, Tq, hd] queries at positions q_start .. (RoPE applied)
    ck: Tensor,  # [B, H_kv, N_c, hd] compressed keys (RoPE applied)
    cv: Tensor,  # [B, H_kv, N_c, hd] compressed values
    q_start: int, l: int, d: int, chunk: int,
    kernel: str = "torch",  # NSAConfig.kernel
    frame: Tensor | None = None,  # [3, B, Tq] documents: a query sees only its document's compressed tokens
    return_lse: bool = False,  # also the rows' log-sum-exps [B, H, Tq] (no gradient; -inf where none is seen)
):  # [B, H, Tq, hd]; rows that see no compressed token are exactly zero
    """The compression branch, differentiable: the custom op nsa::compressed_attention, or FlexAttention on CUDA."""
    if not use_flex(kernel, q):
        o, lse = _compressed(q, ck, cv, q_start, l, d, chunk, frame)
    elif return_lse:
        o, lse = flex_compressed_attention(q, ck, cv, q_start, l, d, frame=frame, return_lse=True)
    else:
        return flex_compressed_attention(q, ck, cv, q_start, l, d, frame=frame)
    return (o, lse.detach()) if return_lse else o


# ---------------------------------------------------------------- sliding window (torch path op)
@custom_op("nsa::window_attention")
def _window(q: Tensor, k: Tensor, v: Tensor, q_start: int, k_start: int, w: int, chunk: int,
            frame: Tensor | None) -> tuple[Tensor, Tensor]:
    if frame is not None:
        if masked.fits(q, q.shape[1], k.shape[2]):
            return masked.window_fwd(q, k, v, w, frame)
        return segments.window_fwd(q, k, v, w, chunk, frame)
    o, lse = window.sliding_window_fwd(q, k, v, q_start, k_start, w, chunk)
    return o.contiguous(), lse.contiguous()


@_window.register_fake
def _(q, k, v, q_start, k_start, w, chunk, frame):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=_lse_dtype(q.dtype))


@custom_op("nsa::window_attention_backward")
def _window_bwd(d_o: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, q_start: int, k_start: int,
                w: int, chunk: int, frame: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    if frame is not None:
        if masked.fits(q, q.shape[1], k.shape[2]):
            return masked.window_bwd(d_o, q, k, v, o, lse, w, frame)
        return segments.window_bwd(d_o, q, k, v, o, lse, w, chunk, frame)
    return window.sliding_window_bwd(d_o, q, k, v, o, lse, q_start, k_start, w, chunk)


@_window_bwd.register_fake
def _(d_o, q, k, v, o, lse, q_start, k_start, w, chunk, frame):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _window_setup(ctx, inputs, output):
    q, k, v, *args = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.args = args
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)  # the log-sum-exps' gradient stays None (no zero-filled tensor)


def _window_backward(ctx, d_o, _d_lse):
    q, k, v, o, lse = ctx.saved_tensors
    return (*_window_bwd(d_o.contiguous(), q, k, v, o, lse, *ctx.args), None, None, None, None, None)


_window.register_autograd(_window_backward, setup_context=_window_setup)


def window_attention(
    q: Tensor,  # [B, H, Tq, hd] queries at positions q_start ..
    k: Tensor,  # [B, H_kv, Tk, hd] keys at positions k_start .. k_start+Tk-1
    v: Tensor,  # [B, H_kv, Tk, hd]
    q_start: int, k_start: int, w: int, chunk: int,
    kernel: str = "torch",  # NSAConfig.kernel
    frame: Tensor | None = None,  # [3, B, Tq] documents (then k_start = 0): the window stops at the document start
) -> Tensor:  # [B, H, Tq, hd]
    """The sliding-window branch, differentiable: the custom op nsa::window_attention, or FlexAttention on CUDA."""
    if use_flex(kernel, q):
        return flex_window_attention(q, k, v, q_start, k_start, w, frame=frame)
    return _window(q, k, v, q_start, k_start, w, chunk, frame)[0]


def kernel_fit_problem(cfg, dtype: torch.dtype, shared_memory_limit: int) -> str | None:
    """One line saying why the Triton selection kernels of an NSA model `cfg` (a ModelConfig) cannot run
    in `dtype` on a GPU with `shared_memory_limit` bytes of shared memory per block (H100 232,448;
    A100 166,912), or None when they fit (or the model does not use them). Checked when a run starts on
    CUDA, before any kernel launches."""
    if cfg.attention != "nsa" or cfg.nsa.kernel == "torch":
        return None
    from nsa.attention.kernels.selected_attention import shared_memory_estimate

    need = shared_memory_estimate(cfg.head_dim, cfg.nsa.l_sel, cfg.n_groups, dtype)
    if need <= shared_memory_limit:
        return None
    return (f"NSA's Triton kernels need ~{need:,} B of shared memory at head_dim={cfg.head_dim}, "
            f"nsa.l_sel={cfg.nsa.l_sel}, G={cfg.n_groups} in {str(dtype).replace('torch.', '')}; this GPU allows "
            f"{shared_memory_limit:,} B: use bf16 (runtime.precision), a smaller head_dim or l_sel, or nsa.kernel=torch")
