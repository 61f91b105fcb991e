"""The torch path's packed documents at small sizes: every document of a batch at once, each branch one
attention over an explicit mask built from the frame.

impl/segments.py runs each document alone (a host loop over documents), which is exact by construction but
issues a dozen small ops per document: with many short documents per window (the recall corpus: ~2 per
64-token window, 256 windows a step) the loop, not the arithmetic, is the cost. Here the frame
[3, B, Tq] (q_pos, k_base, c_base; nsa/attention/documents.py) becomes one mask per branch, so a call is a
fixed number of ops whatever the number of documents, and memory is O(B * H * Tq * Tk): nsa/attention/ops.py
picks this path for short windows (`fits`: MAX_KEYS, MAX_ELEMENTS) and impl/segments.py beyond them.

Masks, for the query of row b at index t (document position p = q_pos, k_base, c_base) and a key index s:
  window:     r = s - k_base in [0, p] and p - r < w
  selected:   r in [0, p] and block r // l' among the query's selected blocks (document-relative)
  compressed: c_base <= c < c_base + num_compressed(p + 1)
Block selection scores the compressed tokens under the compressed mask, shifts each query's probabilities
to its document's first compressed token and then selects exactly as the unmasked path does, with each
query's own document position in place of q_start.
"""
from __future__ import annotations

import math

import torch

from nsa.attention.impl.partial import attention_partial, attention_partial_backward
from nsa.attention.impl.selection import select_blocks as top_n_blocks
from nsa.attention.impl.selection import selection_block_scores

MAX_KEYS = 256  # the most keys (Tk) per query this path reads: beyond, the sparse reads of impl/segments.py win
MAX_ELEMENTS = 1 << 24  # the largest B * H * Tq * Tk (a score tensor, ~64 MiB in fp32) this path handles


def fits(q: torch.Tensor, heads: int, k_len: int) -> bool:
    """Whether a call with q's batch and query length, `heads` query heads and k_len keys takes this path:
    k_len <= MAX_KEYS and B * heads * Tq * k_len <= MAX_ELEMENTS (q [B, ..., Tq, hd]). Every query scores all
    k_len keys here, where impl/segments.py reads only its branch's (w, n * l', T / d); measured on a 2-core CPU
    (bench/bench_document_paths.py, NSA l=8 d=4 l'=8 n=4 w=8, a whole training step, docs/BENCHMARKS.md): with
    ~29-token documents masks are 2.9x faster at 64 tokens and 2.0x at 256; at 512 0.85-1.1x; at 1024 0.44-0.51x."""
    return k_len <= MAX_KEYS and q.shape[0] * heads * q.shape[-2] * k_len <= MAX_ELEMENTS


def _frame(frame: torch.Tensor):
    """frame [3, B, Tq] -> q_pos, k_base, c_base, each [B, 1, Tq, 1] (broadcast over heads and keys)."""
    return (f[:, None, :, None] for f in frame.unbind(0))


def _contiguous(tensors) -> tuple[torch.Tensor, ...]:
    """The layout the ops' fake kernels declare (the CPU flash kernels return strided views)."""
    return tuple(t.contiguous() for t in tensors)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def _seen_keys(frame: torch.Tensor, k_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """r [B, 1, Tq, Tk]: each key's position in the query's document, and [B, 1, Tq, Tk] bool: 0 <= r <= p."""
    q_pos, k_base, _ = _frame(frame)
    r = torch.arange(k_len, device=frame.device) - k_base  # [B, 1, Tq, Tk]
    return r, (r >= 0) & (r <= q_pos)


# ---------------------------------------------------------------- sliding window
def _window_mask(frame: torch.Tensor, k_len: int, w: int, dtype) -> torch.Tensor:  # [B, 1, Tq, Tk] additive
    q_pos = frame[0][:, None, :, None]
    r, seen = _seen_keys(frame, k_len)
    return _additive(seen & (q_pos - r < w), dtype)


def window_fwd(q, k, v, w: int, frame):
    """q [B, H, Tq, hd]; k, v [B, H_kv, Tk, hd] -> o [B, H, Tq, hd], lse [B, H, Tq]."""
    mask = _window_mask(frame, k.shape[2], w, q.dtype)
    o, lse = attention_partial(q, k, v, mask, 1.0 / math.sqrt(q.shape[-1]), site="nsa.window")
    return o.contiguous(), lse.contiguous()


def window_bwd(d_o, q, k, v, o, lse, w: int, frame):
    mask = _window_mask(frame, k.shape[2], w, q.dtype)
    return _contiguous(attention_partial_backward(d_o, q, k, v, o, lse, mask, 1.0 / math.sqrt(q.shape[-1])))


# ---------------------------------------------------------------- compressed tokens
def _compressed_visible(frame: torch.Tensor, n_c: int, l: int, d: int) -> torch.Tensor:
    """[B, 1, Tq, N_c] bool: compressed token c is one of the query's document's that end at or before it."""
    q_pos, _, c_base = _frame(frame)
    count = torch.where(q_pos + 1 >= l, torch.div(q_pos + 1 - l, d, rounding_mode="floor") + 1, 0)
    c = torch.arange(n_c, device=frame.device) - c_base  # [B, 1, Tq, N_c] document-relative index
    return (c >= 0) & (c < count)


def _compressed_mask(frame, n_c: int, l: int, d: int, dtype):
    """Additive mask [B, 1, Tq, N_c] and sees_any [B, 1, Tq, 1] in dtype. A query that sees no token attends
    to token 0 instead (no NaN); its output and gradient are zeroed, as on the unmasked path."""
    visible = _compressed_visible(frame, n_c, l, d)
    sees_any = visible.any(dim=-1, keepdim=True)
    visible[..., :1] |= ~sees_any
    return _additive(visible, dtype), sees_any.to(dtype)


def compressed_fwd(q, ck, cv, l: int, d: int, frame):
    """q [B, H, Tq, hd]; ck, cv [B, H_kv, N_c, hd] -> o [B, H, Tq, hd] (zero where nothing is seen), lse [B, H, Tq]."""
    B, H, Tq, hd = q.shape
    if ck.shape[2] == 0:
        return torch.zeros(q.shape, dtype=q.dtype, device=q.device), torch.zeros(B, H, Tq, dtype=torch.promote_types(q.dtype, torch.float32),
                                                device=q.device)
    mask, sees_any = _compressed_mask(frame, ck.shape[2], l, d, q.dtype)
    o, lse = attention_partial(q, ck, cv, mask, 1.0 / math.sqrt(hd), site="nsa.compressed")
    return (o * sees_any).contiguous(), lse.contiguous()


def compressed_bwd(d_o, q, ck, cv, o, lse, l: int, d: int, frame):
    if ck.shape[2] == 0:
        return tuple(torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (q, ck, cv))
    mask, sees_any = _compressed_mask(frame, ck.shape[2], l, d, q.dtype)
    return _contiguous(attention_partial_backward((d_o * sees_any).contiguous(), q, ck, cv, o, lse, mask,
                                                  1.0 / math.sqrt(q.shape[-1])))


# ---------------------------------------------------------------- block selection
@torch.no_grad()
def select_blocks(q, ck, l: int, d: int, l_sel: int, n: int, frame):
    """q [B, H_kv, G, Tq, hd]; ck [B, H_kv, N_c, hd] -> [B, H_kv, Tq, n] document-relative blocks, ascending."""
    block_scores = document_block_scores(q, ck, l, d, l_sel, frame)  # [B, H_kv, Tq, n_blocks]
    return top_n_blocks(block_scores, 0, l_sel, n, positions=frame[0][:, None, :]).contiguous()


def document_block_count(n_c: int, T: int, l: int, d: int, l_sel: int) -> int:
    """Selection blocks a packed window's queries may reach (document-relative): T queries over n_c compressed slots."""
    return -(-max(n_c * d + l, T) // l_sel) + 1


def document_block_scores(q, ck, l: int, d: int, l_sel: int, frame):
    """Eq. 9-10 per document: q [B, H_kv, G, Tq, hd]; ck [B, H_kv, N_c, hd] -> the group's compressed probability
    mass per document-relative selection block [B, H_kv, Tq, n_blocks] (every block a query of this call may reach)."""
    B, H_kv, G, Tq, hd = q.shape
    n_c = ck.shape[2]
    n_blocks = document_block_count(n_c, Tq, l, d, l_sel)  # every block a query of this call may reach
    if n_c == 0:
        p_rel = q.new_zeros(B, H_kv, Tq, 0)
    else:
        visible = _compressed_visible(frame, n_c, l, d)  # [B, 1, Tq, N_c]
        scores = torch.einsum("bkgtd,bknd->bkgtn", q, ck) / math.sqrt(hd)  # [B, H_kv, G, Tq, N_c]
        scores = scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores
        sees_any = visible.any(dim=-1, keepdim=True)
        probs = torch.softmax(scores.masked_fill(~(visible | ~sees_any)[:, :, None], float("-inf")), dim=-1)
        p_abs = (probs * sees_any[:, :, None]).sum(dim=2)  # [B, H_kv, Tq, N_c], Eq. 10: the group's sum
        c_base = frame[2][:, None, :, None]  # [B, 1, Tq, 1]
        at = (torch.arange(n_c, device=q.device) + c_base).clamp_max(n_c)  # [B, 1, Tq, N_c]; n_c = zero column
        padded = torch.cat((p_abs, p_abs.new_zeros(B, H_kv, Tq, 1)), dim=-1)
        p_rel = padded.gather(-1, at.expand(B, H_kv, Tq, n_c))  # document-relative compressed index
    return selection_block_scores(p_rel, l, d, l_sel, n_blocks)  # [B, H_kv, Tq, n_blocks]


# ---------------------------------------------------------------- selected attention
def selected_keys(frame, block_idx, k_len: int, l_sel: int) -> torch.Tensor:
    """[B, H_kv, Tq, Tk] bool: keys of the query's document up to it, in its selected blocks (block_idx
    [B, H_kv, Tq, n], document-relative, -1 = none)."""
    B, H_kv, Tq, n = block_idx.shape
    r, seen = _seen_keys(frame, k_len)  # [B, 1, Tq, Tk]
    n_blocks = -(-k_len // l_sel)
    slot = torch.where(block_idx >= 0, block_idx, n_blocks)  # -1 (none) -> a discard column
    chosen = torch.zeros(B, H_kv, Tq, n_blocks + 1, dtype=torch.bool, device=block_idx.device)
    chosen.scatter_(-1, slot, True)  # [B, H_kv, Tq, n_blocks + 1]
    key_block = torch.div(r.clamp(0, k_len - 1), l_sel, rounding_mode="floor")  # [B, 1, Tq, Tk]
    return chosen.gather(-1, key_block.expand(B, H_kv, Tq, k_len)) & seen


def _selected_mask(frame, block_idx, k_len: int, l_sel: int, dtype) -> torch.Tensor:
    """[B * H_kv, 1, Tq, Tk] additive: `selected_keys` as a mask."""
    B, H_kv, Tq, _ = block_idx.shape
    return _additive(selected_keys(frame, block_idx, k_len, l_sel), dtype).reshape(B * H_kv, 1, Tq, k_len)


def _flat(q, k, v):
    """[B, H_kv, G, Tq, hd] queries and [B, H_kv, Tk, hd] keys -> one attention problem per KV head."""
    B, H_kv, G, Tq, hd = q.shape
    return q.reshape(B * H_kv, G, Tq, hd), k.reshape(B * H_kv, 1, -1, hd), v.reshape(B * H_kv, 1, -1, hd)


def selected_fwd(q, k, v, block_idx, l_sel: int, frame):
    """q [B, H_kv, G, Tq, hd]; k, v [B, H_kv, Tk, hd]; block_idx [B, H_kv, Tq, n] -> o like q, lse [B, H_kv, G, Tq]."""
    mask = _selected_mask(frame, block_idx, k.shape[2], l_sel, q.dtype)
    o, lse = attention_partial(*_flat(q, k, v), mask, 1.0 / math.sqrt(q.shape[-1]), site="nsa.selected")
    return _contiguous((o.reshape(q.shape), lse.reshape(q.shape[:4])))


def selected_bwd(d_o, q, k, v, block_idx, o, lse, l_sel: int, frame):
    mask = _selected_mask(frame, block_idx, k.shape[2], l_sel, q.dtype)
    G, Tq = q.shape[2], q.shape[3]
    dq, dk, dv = attention_partial_backward(
        d_o.reshape(-1, G, Tq, q.shape[-1]), *_flat(q, k, v), o.reshape(-1, G, Tq, q.shape[-1]),
        lse.reshape(-1, G, Tq), mask, 1.0 / math.sqrt(q.shape[-1]))
    return _contiguous((dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)))
