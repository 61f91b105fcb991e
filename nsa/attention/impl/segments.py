"""The torch path's view of a document frame: runs of queries that share one document ("segments").

A frame [3, B, Tq] int64 (q_pos, k_base, c_base; nsa/attention/documents.py) says where each query's
document lives. The torch implementations run each segment as if its document were alone (the unmasked
code with q_start = the segment's first document position, keys and compressed tokens sliced to the
document), which makes "packed equals alone" hold by construction. The loop over segments runs inside
one custom op (the dispatcher still sees one op per stage) and reads the frame on the host: free for CPU
tensors; on CUDA the torch path (nsa.kernel=torch) pays one sync per call, the Triton and FlexAttention
paths read the frame on the device instead.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from nsa.attention.impl.block_select import select_by_score
from nsa.attention.impl.compression import compressed_attention_bwd, compressed_attention_fwd, num_compressed
from nsa.attention.impl.selection import selected_attention_bwd, selected_attention_fwd
from nsa.attention.impl.window import sliding_window_bwd, sliding_window_fwd


class Segment(NamedTuple):
    b: int  # batch row
    t0: int  # first query (index into Tq)
    t1: int  # one past the last query
    p0: int  # document position of query t0 (queries t0 .. t1-1 sit at p0 .. p0 + t1 - t0 - 1)
    k_base: int  # index of the document's first key
    c_base: int  # index of the document's first compressed token

    @property
    def p_last(self) -> int:
        return self.p0 + self.t1 - self.t0 - 1


def segments(frame: torch.Tensor) -> list[Segment]:
    """frame [3, B, Tq] -> the maximal runs of consecutive queries of one row in one document."""
    f = frame.cpu()
    q_pos, k_base, c_base = f.unbind(0)  # [B, Tq] each
    B, Tq = q_pos.shape
    new = torch.ones(B, Tq, dtype=torch.bool)
    new[:, 1:] = (k_base[:, 1:] != k_base[:, :-1]) | (c_base[:, 1:] != c_base[:, :-1]) | (q_pos[:, 1:] != q_pos[:, :-1] + 1)
    out = []
    for b in range(B):  # a loop over documents (host ints), never over tokens
        starts = new[b].nonzero().flatten().tolist() + [Tq]
        qp, kb, cb = q_pos[b].tolist(), k_base[b].tolist(), c_base[b].tolist()
        out.extend(Segment(b, t0, t1, qp[t0], kb[t0], cb[t0]) for t0, t1 in zip(starts[:-1], starts[1:]))
    return out


# ---------------------------------------------------------------- the torch path, one document at a time
def _zeros(*like: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Contiguous zeros shaped like each input: the layout the ops' fake kernels declare for gradients
    (zeros_like would copy a strided input's layout, e.g. the keys unbound from one projection)."""
    return tuple(torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in like)


def _rows(s: Segment) -> tuple:
    return (slice(s.b, s.b + 1), slice(None), slice(s.t0, s.t1))


def _keys(s: Segment, lo: int = 0) -> tuple:  # the document's keys at document positions lo .. p_last
    return (slice(s.b, s.b + 1), slice(None), slice(s.k_base + lo, s.k_base + s.p_last + 1))


def _compressed(s: Segment, l: int, d: int) -> tuple:  # the document's compressed tokens its queries may see
    return (slice(s.b, s.b + 1), slice(None), slice(s.c_base, s.c_base + num_compressed(s.p_last + 1, l, d)))


def select_blocks(q, ck, l: int, d: int, l_sel: int, n: int, q_chunk: int, frame):
    """block_select.select_by_score per document: q [B, H_kv, G, Tq, hd] -> [B, H_kv, Tq, n] document-relative."""
    B, H_kv, _, Tq, _ = q.shape
    out = torch.full((B, H_kv, Tq, n), -1, dtype=torch.long, device=q.device)
    for s in segments(frame):
        b, _, t = _rows(s)
        out[b, :, t] = select_by_score(q[b, :, :, t], ck[_compressed(s, l, d)], s.p0, l, d, l_sel, n, q_chunk)
    return out


def compressed_fwd(q, ck, cv, l: int, d: int, chunk: int, frame):
    """compression.compressed_attention_fwd per document: q [B, H, Tq, hd] -> o, lse."""
    o = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.zeros(q.shape[:3], dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
    for s in segments(frame):
        r, c = _rows(s), _compressed(s, l, d)
        o[r], lse[r] = compressed_attention_fwd(q[r], ck[c], cv[c], s.p0, l, d, chunk)
    return o, lse


def compressed_bwd(d_o, q, ck, cv, o, lse, l: int, d: int, chunk: int, frame):
    dq, dck, dcv = _zeros(q, ck, cv)
    for s in segments(frame):
        r, c = _rows(s), _compressed(s, l, d)
        dq_s, dck_s, dcv_s = compressed_attention_bwd(d_o[r], q[r], ck[c], cv[c], o[r], lse[r], s.p0, l, d, chunk)
        dq[r] = dq_s
        dck[c] += dck_s
        dcv[c] += dcv_s
    return dq, dck, dcv


def _selected_rows(s: Segment) -> tuple:  # [B, H_kv, G, Tq, ...] query tensors
    return (slice(s.b, s.b + 1), slice(None), slice(None), slice(s.t0, s.t1))


def selected_fwd(q, k, v, block_idx, l_sel: int, tile: int, chunk: int, frame):
    """selection.selected_attention_fwd per document: q [B, H_kv, G, Tq, hd], block_idx document-relative."""
    o = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.zeros(q.shape[:4], dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
    for s in segments(frame):
        r, kk = _selected_rows(s), _keys(s)
        o[r], lse[r] = selected_attention_fwd(q[r], k[kk], v[kk], block_idx[_rows(s)], s.p0, l_sel, tile, chunk)
    return o, lse


def selected_bwd(d_o, q, k, v, block_idx, o, lse, l_sel: int, tile: int, chunk: int, frame):
    dq, dk, dv = _zeros(q, k, v)
    for s in segments(frame):
        r, kk = _selected_rows(s), _keys(s)
        dq_s, dk_s, dv_s = selected_attention_bwd(d_o[r], q[r], k[kk], v[kk], block_idx[_rows(s)], o[r], lse[r], s.p0,
                                                  l_sel, tile, chunk)
        dq[r] = dq_s
        dk[kk] += dk_s
        dv[kk] += dv_s
    return dq, dk, dv


def window_fwd(q, k, v, w: int, chunk: int, frame):
    """window.sliding_window_fwd per document (keys at index = position, k_start 0): q [B, H, Tq, hd]."""
    o = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.zeros(q.shape[:3], dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
    for s in segments(frame):
        lo = max(0, s.p0 - w + 1)
        r, kk = _rows(s), _keys(s, lo)
        o[r], lse[r] = sliding_window_fwd(q[r], k[kk], v[kk], s.p0, lo, w, chunk)
    return o, lse


def window_bwd(d_o, q, k, v, o, lse, w: int, chunk: int, frame):
    dq, dk, dv = _zeros(q, k, v)
    for s in segments(frame):
        lo = max(0, s.p0 - w + 1)
        r, kk = _rows(s), _keys(s, lo)
        dq_s, dk_s, dv_s = sliding_window_bwd(d_o[r], q[r], k[kk], v[kk], o[r], lse[r], s.p0, lo, w, chunk)
        dq[r] = dq_s
        dk[kk] += dk_s
        dv[kk] += dv_s
    return dq, dk, dv
