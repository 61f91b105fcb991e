"""The learned block indexer's scores and picks in torch ops (nsa.selector=indexer; the module and its projections:
nsa/attention/indexer.py). The oracle of the one-launch kernel nsa/attention/kernels/indexer_topk.py (same
arguments; picks equal up to the scores' rounding)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from nsa.attention.impl.selection import select_blocks, selection_block_scores


def head_scores(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [B, Tq, H_kv, h, e], keys [B, N, e] -> every head's q . k / sqrt(e) [B, H_kv, h, Tq, N] (float32, or float64
    for float64 inputs): one batched matmul into that layout, no permuted copy of the [.., Tq, N] result."""
    B, Tq, H_kv, h, e = q.shape
    rows = q.permute(0, 2, 3, 1, 4).reshape(B, H_kv * h * Tq, e) / math.sqrt(e)  # [B, H_kv*h*Tq, e] (small)
    s = torch.bmm(rows, keys.transpose(1, 2))  # [B, H_kv*h*Tq, N]
    return s.to(torch.promote_types(s.dtype, torch.float32)).view(B, H_kv, h, Tq, -1)


def weighted_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [B, Tq, H_kv, h, e], w [B, Tq, H_kv, h], keys [B, N, e] (shared by the queries) or [B, Tq, N, e] (each
    query's own) -> sum_h w_h ReLU(q_h . k_n) / sqrt(e): [B, H_kv, Tq, N] (float32, or float64 for float64 inputs)."""
    if keys.dim() == 3:
        s = head_scores(q, keys)  # [B, H_kv, h, Tq, N]
    else:
        s = torch.einsum("btkhe,btne->bkhtn", q, keys)
        s = s.to(torch.promote_types(s.dtype, torch.float32)) / math.sqrt(q.shape[-1])
    return (F.relu(s) * w.to(s.dtype).permute(0, 2, 3, 1)[..., None]).sum(2)


def max_over_blocks(per_token: torch.Tensor, l_sel: int) -> torch.Tensor:
    """per_token [..., S] token scores from position 0 -> [..., ceil(S / l')] each block's best token (a partial
    last block's over its real tokens)."""
    S = per_token.shape[-1]
    n_blocks = -(-S // l_sel)
    per_token = F.pad(per_token, (0, n_blocks * l_sel - S), value=float("-inf"))
    return per_token.unflatten(-1, (n_blocks, l_sel)).amax(dim=-1)


def index_block_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, l_sel: int,
                       per_token: bool) -> torch.Tensor:
    """The indexer's block scores I [B, H_kv, Tq, N_b]: keys [B, N_b, e] one per block, or per_token [B, S, e] one per
    token from position 0 (a block scores its best token)."""
    scores = weighted_scores(q, w, keys)
    return max_over_blocks(scores, l_sel) if per_token else scores


@torch.no_grad()
def indexer_picks(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, q_start: int, l_sel: int, n: int,
                  per_token: bool) -> torch.Tensor:
    """Top-n blocks per query of queries at positions q_start .. by the indexer's scores (block 0, the previous and
    the current block forced; ties -> lower index) -> [B, H_kv, Tq, n] int64, ascending, -1 pads."""
    return select_blocks(index_block_scores(q, w, keys, l_sel, per_token), q_start, l_sel, n)


def document_index_scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, frame: torch.Tensor, n_blocks: int,
                          l_sel: int, per_token: bool, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Packed documents (frame [3, B, T]: each token's position in its document, its document's first index;
    nsa/attention/documents.py): index queries q [B, R, H_kv, h, e] and head weights w [B, R, H_kv, h] of the queries
    `rows` [R] (default all T), token keys k [B, T, e] -> I [B, H_kv, R, n_blocks] over each query's own document's
    blocks 0 .. n_blocks-1 (document-relative, as the selection counts them). Block j of the document starting at
    index k0 holds that document's tokens k0 + j*l' .. . pool=keys: its key is stored at index k0 + j (distinct for
    every (document, block): j <= a position in the document); per_token: its tokens' scores gathered from k0 + j*l'
    on. A block past a query's current one reads unrelated keys or tokens: selection and the KL never let it
    compete."""
    B, T, e = k.shape
    q_pos, k_base = frame[0], frame[1]  # [B, T] each
    kq = k_base if rows is None else k_base[:, rows]  # [B, R] the scored queries' document bases
    R, H_kv = q.shape[1], q.shape[2]
    if per_token:
        per_tok = weighted_scores(q, w, k)  # [B, H_kv, R, T]
        at = kq[..., None] + torch.arange(n_blocks * l_sel, device=k.device)  # [B, R, n_blocks * l']
        at = at.clamp_max(T - 1)[:, None].expand(-1, H_kv, -1, -1)
        return per_tok.gather(-1, at).unflatten(-1, (n_blocks, l_sel)).amax(dim=-1)
    slot = (k_base + torch.div(q_pos, l_sel, rounding_mode="floor"))[..., None].expand_as(k)
    keys = k.new_zeros(k.shape).scatter_reduce(1, slot, k, "amax", include_self=False)  # [B, T, e]
    at = (kq[..., None] + torch.arange(n_blocks, device=k.device)).clamp_max(T - 1)  # [B, R, n_blocks]
    block_keys = keys.gather(1, at.reshape(B, -1, 1).expand(-1, -1, e)).view(B, R, n_blocks, -1)
    return weighted_scores(q, w, block_keys)  # [B, H_kv, R, n_blocks]


@torch.no_grad()
def document_picks(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, frame: torch.Tensor, l_sel: int, n: int,
                   per_token: bool) -> torch.Tensor:
    """Top-n blocks per query of packed documents by the indexer's scores over its own document's blocks
    (`document_index_scores`; forced blocks and ties as `indexer_picks`, document-relative) -> [B, H_kv, T, n]."""
    scores = document_index_scores(q, w, k, frame, -(-k.shape[1] // l_sel), l_sel, per_token)
    return select_blocks(scores, 0, l_sel, n, positions=frame[0][:, None, :])


def kl_row_indices(T: int, R: int, device) -> torch.Tensor:
    """The sequence indices of the R (<= T) evenly spaced queries the indexer's KL is taken over: r * T // R."""
    return torch.arange(R, device=device) * T // R  # [R]


def counted_kl_rows(frame: torch.Tensor, R: int, l_sel: int) -> torch.Tensor:
    """Packed documents (frame [3, B, T]): how many of the KL's rows (kl_row_indices(T, R) of every batch row) have
    two or more candidate blocks (a position in the document >= 4 l'): the KL mean's count per KV group, a 0-dim
    int64 tensor (no host sync)."""
    rows = kl_row_indices(frame.shape[2], R, frame.device)
    return (frame[0][:, rows] >= 4 * l_sel).sum()


def candidate_mask(positions: torch.Tensor, l_sel: int, n_blocks: int) -> torch.Tensor:
    """positions [Tq] (or [B, 1, Tq]: each query's position in its document) -> [Tq, N_b] (or [B, 1, Tq, N_b])
    bool: the blocks that compete for a query's free places (not forced: block 0, the current and the previous one;
    and not after the current one)."""
    current = torch.div(positions, l_sel, rounding_mode="floor")[..., None]  # [..., Tq, 1]
    blk = torch.arange(n_blocks, device=positions.device)
    return (blk >= 1) & (blk <= current - 2)


def indexer_kl(scores: torch.Tensor, target: torch.Tensor, l_sel: int, positions: torch.Tensor) -> torch.Tensor:
    """Mean over the (batch, KV group, query) rows with >= 2 candidate blocks of KL(target || softmax(scores)) over
    those candidates; scores and target [B, H_kv, R, N_b] for queries at positions [R] (or [B, 1, R]: each query's
    position in its document) -> a 0-dim tensor in the scores' dtype (0 when no row has two)."""
    return indexer_kl_terms(scores, target, l_sel, positions).sum()


def indexer_kl_terms(scores: torch.Tensor, target: torch.Tensor, l_sel: int, positions: torch.Tensor) -> torch.Tensor:
    """`indexer_kl` before its sum: each row's share of the mean [B, H_kv, R] (its KL / the counted rows; 0 for a row
    with fewer than 2 candidate blocks)."""
    n_blocks = scores.shape[-1]
    cand = candidate_mask(positions, l_sel, n_blocks).expand(scores.shape)  # [B, H_kv, R, N_b]
    rows = (cand.sum(-1) >= 2).to(scores.dtype)  # [B, H_kv, R]: one candidate has nothing to rank
    p = torch.where(cand, target.to(scores.dtype), 0.0)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
    log_q = torch.log_softmax(scores.masked_fill(~cand, -1e30), dim=-1)  # finite everywhere: no inf * 0
    kl = torch.where(p > 0, p * (torch.log(p.clamp_min(1e-30)) - log_q), 0.0).sum(-1)  # [B, H_kv, R]
    return kl * rows / rows.sum().clamp_min(1.0)  # a masked mean's terms: no host sync


def split_projection(out: torch.Tensor, n_kv_heads: int, heads: int, index_dim: int):
    """The indexer's projection output out [B, T, H_kv*h*e + H_kv*h + e] -> views: index queries [B, T, H_kv, h, e],
    head weights [B, T, H_kv, h], index keys [B, T, e]."""
    q, w, k = out.split((n_kv_heads * heads * index_dim, n_kv_heads * heads, index_dim), dim=-1)
    return q.unflatten(-1, (n_kv_heads, heads, index_dim)), w.unflatten(-1, (n_kv_heads, heads)), k


def block_max(k: torch.Tensor, l_sel: int) -> torch.Tensor:
    """Token keys k [B, T, e] from position 0 -> block keys [B, ceil(T / l'), e], each the elementwise max of its
    block's keys (a partial last block's over its real keys)."""
    B, T, e = k.shape
    n_blocks = -(-T // l_sel)
    pad = n_blocks * l_sel - T
    if pad:
        k = F.pad(k, (0, 0, 0, pad), value=float("-inf"))
    return k.reshape(B, n_blocks, l_sel, e).amax(dim=2)


def kl_loss(out: torch.Tensor, target: torch.Tensor, n_kv_heads: int, heads: int, index_dim: int, R: int, l_sel: int,
            per_token: bool, weight: float, frame: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """weight * the indexer's KL to its target (`indexer_kl`) over the R queries at kl_row_indices(T, R), scored
    from the projection output out [B, T, P] (`split_projection`; pool=keys: block keys by `block_max` of its
    token keys) against target [B, H_kv, R, N_b] -> (the loss's terms [B, H_kv, R], one per row: their sum is the
    loss, taken once for every layer by the model; row statistics [B, H_kv, R, 2]: each row's
    log-sum-exp of its candidates' scores and its target's total over them, what a backward reuses; the scores'
    dtype: float32, or float64 for float64 inputs). frame [3, B, T] (packed documents): each row scores its own
    document's blocks (`document_index_scores`) against a target counted so (target [B, H_kv, R, N_b >= ceil(T / l')]),
    its candidates by its position in the document. The oracle of nsa::indexer_kl's kernel; the loss is
    differentiable by autograd (`kl_loss_backward` is its closed form)."""
    q, w, k = split_projection(out, n_kv_heads, heads, index_dim)
    rows = kl_row_indices(out.shape[1], R, out.device)
    if frame is None:
        scores = index_block_scores(q[:, rows], w[:, rows], k if per_token else block_max(k, l_sel), l_sel, per_token)
        positions = rows  # [R]
    else:
        scores = document_index_scores(q[:, rows], w[:, rows], k, frame, target.shape[-1], l_sel, per_token, rows)
        positions = frame[0][:, None, rows]  # [B, 1, R]
    with torch.no_grad():
        cand = candidate_mask(positions, l_sel, scores.shape[-1]).expand(scores.shape)
        stats = torch.stack((torch.logsumexp(scores.masked_fill(~cand, float("-inf")), dim=-1),
                             torch.where(cand, target.to(scores.dtype), 0.0).sum(-1)), dim=-1)
    return weight * indexer_kl_terms(scores, target, l_sel, positions), stats


def _argmax_share(values: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
    """values [..., n, m] against their max best [..., n, 1 or m broadcast]: 1 / (ties) where a value is the max,
    else 0 (how autograd splits a max's gradient among tied values)."""
    is_max = (values == best).to(values.dtype)
    return is_max / is_max.sum(-2, keepdim=True)


def kl_loss_backward(grad: torch.Tensor, out: torch.Tensor, target: torch.Tensor, n_kv_heads: int, heads: int,
                     index_dim: int, R: int, l_sel: int, per_token: bool, weight: float,
                     frame: torch.Tensor | None = None) -> torch.Tensor:
    """d kl_loss / d out [B, T, P] for the terms' gradient grad [B, H_kv, R] (any strides: an expanded scalar), in
    closed form:
        dL/dI(r, j) = grad(r) * weight * valid(r) / count * (softmax(I(r, .))(j) * [sum of target > 0] - p(r, j))
    on the candidate blocks (p the target normalised over them), 0 elsewhere; a block's max (pool=scores: over its
    tokens' scores; pool=keys: each dim of its key over its tokens) passes it to its argmax, split among ties; then
    through I = sum_h w_h ReLU(q_h . k) / sqrt(e) to q, w (the R rows; 0 at other positions) and k. With packed
    documents (frame): `_kl_loss_backward_documents`."""
    if frame is not None:
        return _kl_loss_backward_documents(grad, out, target, n_kv_heads, heads, index_dim, R, l_sel, per_token,
                                           weight, frame)
    return _kl_loss_backward(grad, out, target, n_kv_heads, heads, index_dim, R, l_sel, per_token, weight)


def _score_gradient(grad: torch.Tensor, scores: torch.Tensor, target: torch.Tensor, positions: torch.Tensor,
                    l_sel: int, weight: float) -> torch.Tensor:
    """dL/dI [B, H_kv, R, N_b] of kl_loss's terms (their gradient grad [B, H_kv, R]) for the rows at `positions` [R]
    (or [B, 1, R] in their documents): grad * weight * valid / count * (softmax(I) * [target's total > 0] - p) on
    the candidate blocks, 0 elsewhere (p the target normalised over the candidates)."""
    acc = scores.dtype
    cand = candidate_mask(positions, l_sel, scores.shape[-1]).expand(scores.shape)
    valid = (cand.sum(-1, keepdim=True) >= 2).to(acc)  # [B, H_kv, R, 1]
    p = torch.where(cand, target.to(acc), 0.0)
    total = p.sum(-1, keepdim=True)
    p = p / total.clamp_min(1e-30)
    soft = torch.softmax(scores.masked_fill(~cand, -1e30), dim=-1)
    row_grad = grad.to(acc)[..., None] * weight / valid.sum().clamp_min(1.0)  # [B, H_kv, R, 1]
    return torch.where(cand, soft * (total > 0) - p, 0.0) * valid * row_grad


@torch.no_grad()
def _kl_loss_backward_documents(grad, out, target, n_kv_heads, heads, index_dim, R, l_sel, per_token, weight,
                                frame) -> torch.Tensor:
    """kl_loss_backward over packed documents (frame [3, B, T]) in closed form: as the one-document form, with each
    row's scores gathered from its own document (`document_index_scores`), their gradient scattered back."""
    B, T, P = out.shape
    e, H_kv = index_dim, n_kv_heads
    q, w, k = split_projection(out, n_kv_heads, heads, index_dim)
    rows = kl_row_indices(T, R, out.device)
    q_r, w_r = q[:, rows], w[:, rows]  # [B, R, H_kv, h, e], [B, R, H_kv, h]
    acc = torch.promote_types(out.dtype, torch.float32)
    n_blocks = target.shape[-1]
    q_pos, k_base = frame[0], frame[1]  # [B, T]
    kq = k_base[:, rows]  # [B, R]
    w_h = w_r.to(acc).permute(0, 2, 3, 1)[..., None]  # [B, H_kv, h, R, 1]
    if per_token:
        keys = k  # [B, T, e]: every row scores every token, then gathers its document's
        s = head_scores(q_r, keys)  # [B, H_kv, h, R, T]
        a = F.relu(s)
        per_tok = (a * w_h).sum(2)  # [B, H_kv, R, T]
        at = (kq[..., None] + torch.arange(n_blocks * l_sel, device=out.device)).clamp_max(T - 1)  # [B, R, N_b*l']
        at = at[:, None].expand(-1, H_kv, -1, -1)
        tok = per_tok.gather(-1, at).unflatten(-1, (n_blocks, l_sel))  # [B, H_kv, R, N_b, l']
        scores = tok.amax(-1)  # [B, H_kv, R, N_b]
    else:  # each (document, block) key at index k_base + block (document_index_scores), gathered per row
        slot = (k_base + torch.div(q_pos, l_sel, rounding_mode="floor"))[..., None].expand_as(k)  # [B, T, e]
        keys_doc = k.new_zeros(k.shape).scatter_reduce(1, slot, k, "amax", include_self=False)  # [B, T, e]
        at = (kq[..., None] + torch.arange(n_blocks, device=out.device)).clamp_max(T - 1)  # [B, R, N_b]
        keys = keys_doc.gather(1, at.reshape(B, -1, 1).expand(-1, -1, e)).view(B, R, n_blocks, e).to(acc)
        s = torch.einsum("brkhe,brne->bkhrn", q_r.to(acc), keys) / math.sqrt(e)  # [B, H_kv, h, R, N_b]
        a = F.relu(s)
        scores = (a * w_h).sum(2)  # [B, H_kv, R, N_b]
    d_scores = _score_gradient(grad, scores, target, q_pos[:, None, rows], l_sel, weight)  # [B, H_kv, R, N_b]
    d_out = torch.zeros(B, T, P, dtype=acc, device=out.device)
    qw = n_kv_heads * heads * e
    if per_token:
        is_max = (tok == scores[..., None]).to(acc)
        d_tok = (d_scores[..., None] * is_max / is_max.sum(-1, keepdim=True)).flatten(-2)  # [B, H_kv, R, N_b*l']
        d_key = torch.zeros_like(per_tok).scatter_add_(-1, at, d_tok)  # [B, H_kv, R, T]
        d_w = (d_key[:, :, None] * a).sum(-1).permute(0, 3, 1, 2)  # [B, R, H_kv, h]
        d_s = (d_key[:, :, None] * w_h * (s > 0)).flatten(1, 3)  # [B, H_kv*h*R, T], head_scores' row layout
        d_q = torch.bmm(d_s, keys.to(acc) / math.sqrt(e)).view(B, H_kv, heads, R, e).permute(0, 3, 1, 2, 4)
        q_rows = q_r.to(acc).permute(0, 2, 3, 1, 4).reshape(B, H_kv * heads * R, e) / math.sqrt(e)
        d_out[..., qw + n_kv_heads * heads:] = torch.bmm(d_s.transpose(1, 2), q_rows)  # [B, T, e]
    else:
        d_w = (d_scores[:, :, None] * a).sum(-1).permute(0, 3, 1, 2)  # [B, R, H_kv, h]
        d_s = d_scores[:, :, None] * w_h * (s > 0)  # [B, H_kv, h, R, N_b]
        d_q = torch.einsum("bkhrn,brne->brkhe", d_s, keys) / math.sqrt(e)  # [B, R, H_kv, h, e]
        d_block = torch.einsum("bkhrn,brkhe->brne", d_s, q_r.to(acc)) / math.sqrt(e)  # [B, R, N_b, e]
        d_keys_doc = torch.zeros(B, T, e, dtype=acc, device=out.device).scatter_add_(
            1, at.reshape(B, -1, 1).expand(-1, -1, e), d_block.reshape(B, -1, e))  # [B, T, e] per (document, block)
        is_max = (k.to(acc) == keys_doc.to(acc).gather(1, slot)).to(acc)  # [B, T, e]: a token holding its block's max
        ties = torch.zeros(B, T, e, dtype=acc, device=out.device).scatter_add_(1, slot, is_max)
        d_out[..., qw + n_kv_heads * heads:] = d_keys_doc.gather(1, slot) * is_max / ties.gather(1, slot)
    d_out[:, rows, :qw] = d_q.flatten(2)
    d_out[:, rows, qw: qw + n_kv_heads * heads] = d_w.flatten(2)
    return d_out.to(out.dtype)


@torch.no_grad()
def _kl_loss_backward(grad, out, target, n_kv_heads, heads, index_dim, R, l_sel, per_token, weight) -> torch.Tensor:
    B, T, P = out.shape
    e = index_dim
    q, w, k = split_projection(out, n_kv_heads, heads, index_dim)
    rows = kl_row_indices(T, R, out.device)
    q_r, w_r = q[:, rows], w[:, rows]  # [B, R, H_kv, h, e], [B, R, H_kv, h]
    acc = torch.promote_types(out.dtype, torch.float32)
    keys = k if per_token else block_max(k, l_sel)  # [B, N, e]
    s = head_scores(q_r, keys)  # [B, H_kv, h, R, N]
    a = F.relu(s)
    w_h = w_r.to(acc).permute(0, 2, 3, 1)[..., None]  # [B, H_kv, h, R, 1]
    per_key = (a * w_h).sum(2)  # [B, H_kv, R, N]
    scores = max_over_blocks(per_key, l_sel) if per_token else per_key  # [B, H_kv, R, N_b]
    n_blocks = scores.shape[-1]
    d_scores = _score_gradient(grad, scores, target, rows, l_sel, weight)  # [B, H_kv, R, N_b]
    if per_token:  # each block's gradient to its best token(s)
        N = per_key.shape[-1]
        pad = n_blocks * l_sel - N
        tok = F.pad(per_key, (0, pad), value=float("-inf")).unflatten(-1, (n_blocks, l_sel))  # [B, H_kv, R, N_b, l']
        is_max = (tok == scores[..., None]).to(acc)
        d_key = (d_scores[..., None] * is_max / is_max.sum(-1, keepdim=True)).flatten(-2)[..., :N]  # [B, H_kv, R, N]
    else:
        d_key = d_scores
    d_w = (d_key[:, :, None] * a).sum(-1).permute(0, 3, 1, 2)  # [B, R, H_kv, h]
    d_s = (d_key[:, :, None] * w_h * (s > 0)).flatten(1, 3)  # [B, H_kv*h*R, N], head_scores' row layout
    H_kv = n_kv_heads
    d_q = torch.bmm(d_s, keys.to(acc) / math.sqrt(e)).view(B, H_kv, heads, R, e).permute(0, 3, 1, 2, 4)
    q_rows = q_r.to(acc).permute(0, 2, 3, 1, 4).reshape(B, H_kv * heads * R, e) / math.sqrt(e)
    d_keys = torch.bmm(d_s.transpose(1, 2), q_rows)  # [B, N, e]
    if per_token:
        d_k = d_keys
    else:  # each dim of a block key to its block's best token(s) in that dim
        pad = n_blocks * l_sel - T
        tok = F.pad(k, (0, 0, 0, pad), value=float("-inf")).reshape(B, n_blocks, l_sel, e)
        share = _argmax_share(tok, keys[:, :, None, :])  # [B, N_b, l', e]
        d_k = (d_keys[:, :, None, :] * share).reshape(B, n_blocks * l_sel, e)[:, :T]
    d_out = torch.zeros(B, T, P, dtype=acc, device=out.device)
    qw = n_kv_heads * heads * e
    d_out[:, rows, :qw] = d_q.flatten(2)
    d_out[:, rows, qw: qw + n_kv_heads * heads] = d_w.flatten(2)
    d_out[..., qw + n_kv_heads * heads:] = d_k
    return d_out.to(out.dtype)


DENSE_ROWS = 128  # nsa.indexer_target=dense: queries whose [T] attention rows are held at once


@torch.no_grad()
def pooled_block_mass(q: torch.Tensor, ck: torch.Tensor, positions: torch.Tensor, l: int, d: int, l_sel: int,
                      n_blocks: int) -> torch.Tensor:
    """The compressed branch's probability mass per selection block, summed over each GQA group's heads (Eq. 9-10):
    q [B, H_kv, G, R, hd] at `positions` [R] (of a sequence from 0), ck [B, H_kv, N_c, hd] -> [B, H_kv, R, N_b]."""
    n_c = ck.shape[2]
    if n_c == 0:
        return q.new_zeros(q.shape[0], q.shape[1], q.shape[3], n_blocks)
    scores = torch.einsum("bkgtd,bknd->bkgtn", q, ck) / math.sqrt(q.shape[-1])  # [B, H_kv, G, R, N_c]
    scores = scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores
    visible = torch.arange(n_c, device=q.device) * d + (l - 1) <= positions[:, None]  # [R, N_c]
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    probs = torch.where(visible.any(-1, keepdim=True), probs, 0.0)  # a query that sees no token: no mass (not NaN)
    return selection_block_scores(probs.sum(dim=2), l, d, l_sel, n_blocks)  # [B, H_kv, R, N_b]


@torch.no_grad()
def dense_block_mass(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, l_sel: int, n_blocks: int,
                     base: torch.Tensor | None = None, far: tuple | None = None) -> torch.Tensor:
    """Dense attention's probability mass per selection block, summed over each GQA group's heads: q [B, H_kv, G, R, hd]
    of the queries at sequence indices `rows` [R], k [B, H_kv, T, hd] the selected branch's keys from index 0; base
    [B, R] (packed documents) the index of each query's document's first token: keys before it are another
    document's, and its blocks count from it (document-relative, as the picks are). -> [B, H_kv, R, n_blocks]
    (float32 for half-precision inputs). A query sees the keys base .. its own index (causal). far (nsa.sel_distance_cap:
    keys more than cap back scored at distance cap, as the selected branch reads them): (the queries rotated at the
    cap [B, H_kv, G, R, hd], the keys un-rotated [B, H_kv, T, hd], cap) (nsa/attention/impl/capped.py)."""
    B, H_kv, G, R, hd = q.shape
    T = k.shape[2]
    key = torch.arange(T, device=q.device)
    start = torch.zeros(1, R, dtype=torch.long, device=q.device) if base is None else base  # [B or 1, R]
    visible = (key >= start[..., None]) & (key <= rows[:, None])  # [B or 1, R, T]: never empty (a query sees itself)
    out = []
    for r in range(0, R, DENSE_ROWS):  # at most KL_ROWS / DENSE_ROWS slices: [DENSE_ROWS, T] scores at a time
        part = slice(r, r + DENSE_ROWS)
        scores = torch.einsum("bkgrd,bktd->bkgrt", q[:, :, :, part], k) / math.sqrt(hd)  # [B, H_kv, G, r, T]
        if far is not None:
            q_cap, k_raw, cap = far
            capped = torch.einsum("bkgrd,bktd->bkgrt", q_cap[:, :, :, part], k_raw) / math.sqrt(hd)
            scores = torch.where((rows[part, None] - key) > cap, capped.to(scores.dtype), scores)
        scores = scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores
        probs = torch.softmax(scores.masked_fill(~visible[:, None, None, part], float("-inf")), dim=-1).sum(2)
        # a block's mass as a difference of the running sum (in float64: exact enough for blocks of tiny mass) at
        # its first and one-past-last key, both counted from the query's document start
        cum = F.pad(probs.double().cumsum(-1), (1, 0))  # [B, H_kv, r, T + 1]
        first = (start[:, part, None] + l_sel * torch.arange(n_blocks + 1, device=q.device)).clamp_max(T)
        at = first.expand(B, -1, -1)[:, None].expand(-1, H_kv, -1, -1)  # [B, H_kv, r, n_blocks + 1]
        edge = cum.gather(-1, at)
        out.append((edge[..., 1:] - edge[..., :-1]).to(probs.dtype))
    return torch.cat(out, dim=2)  # [B, H_kv, R, n_blocks]
