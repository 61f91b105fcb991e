"""Per-token NSA reference in plain loops and float64: the test oracle for nsa.py.

Uses only the module's parameters (never its helper functions) and spells every mask out per query:
for each batch row b, position p, KV group g and head h it lists the keys that (q_p, h) may read.
Slow by design (T ~ 100 at most). Differentiable with respect to the module's parameters and x.
nsa.selector=indexer: the indexer's block scores (per token, then max per document block, spelled out) rank the
blocks instead of the compressed probabilities.
Packed documents (doc_start): every rule is applied in the query's document, counted from its first token
(compressed blocks, selection blocks and forced blocks, the window's lower end), as docs/NSA.md states;
positions restart in every document (RoPE rotates at the position within the document).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _linear(x, params, prefix):
    y = x @ params[prefix + ".weight"].T
    bias = params.get(prefix + ".bias")
    return y if bias is None else y + bias


def _rotate(vec, cos, sin):  # vec [hd], cos/sin [hd/2]: "rotate half" layout, as nsa.layers.apply_rotary
    half = vec.shape[-1] // 2
    x1, x2 = vec[:half], vec[half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin))


def _rms_norm(vec, weight, eps):
    return vec / torch.sqrt((vec * vec).mean() + eps) * weight


def _phi(block, params, prefix):  # block [l, hd] -> [hd]: mean + W2 gelu(W1 flatten(block + E))
    h = (block + params[prefix + ".pos_enc"]).flatten()
    hidden = F.gelu(_linear(h, params, prefix + ".fc_in"))
    return block.mean(dim=0) + _linear(hidden, params, prefix + ".fc_out")


def _attend(q, keys, values):  # q [hd], keys/values [n, hd] (n >= 1) -> ([hd], probabilities [n])
    scores = torch.stack([torch.dot(q, k) for k in keys]) / math.sqrt(q.shape[0])
    probs = torch.softmax(scores, dim=0)
    return (probs[:, None] * values).sum(dim=0), probs


def _overlap(i, j, l, d, l_sel):  # |[i*d, i*d+l) & [j*l', (j+1)*l')|, in units of d positions
    return max(0, min(i * d + l, (j + 1) * l_sel) - max(i * d, j * l_sel)) / d


def _select(p_group, p, c, index_score=None):
    """p_group: python floats over the visible compressed tokens -> sorted list of selected blocks. index_score
    (nsa.selector=indexer): block -> the indexer's score, which ranks the blocks instead."""
    current = p // c.l_sel
    score = index_score if index_score is not None else {
        j: sum(pr * _overlap(i, j, c.l, c.d, c.l_sel) for i, pr in enumerate(p_group)) for j in range(current + 1)}
    forced = {0, current} | ({current - 1} if current >= 1 else set())
    rest = sorted((j for j in score if j not in forced), key=lambda j: (-score[j], j))  # ties -> lower j
    return sorted(forced | set(rest[: c.n_sel - len(forced)]))


def reference_forward(attn, x: torch.Tensor, rope=None, doc_start: torch.Tensor | None = None,
                      picks: torch.Tensor | None = None):
    """attn: NativeSparseAttention; x [B, T, dim]; rope (cos, sin) [T, hd/2] for positions 0 .. T-1;
    doc_start [B, T] (optional): the window index where each token's document starts (token t then sits
    at position t - doc_start[t], which is where it is rotated); picks [B, H_kv, T, n] (optional, a layer without an
    indexer of its own under nsa.indexer_every > 1): the blocks each query selects, document-relative, -1 = none.

    Returns (out [B, T, dim] float64, selected blocks [B, H_kv, T, n] int64 ascending, -1 padded).
    """
    c = attn.cfg
    H, H_kv, hd, G = attn.n_heads, attn.n_kv_heads, attn.head_dim, attn.n_groups
    params = {name: p.double() for name, p in attn.named_parameters()}
    eps = attn.q_norm.eps if attn.q_norm is not None else None
    x = x.double()
    B, T, _ = x.shape
    cos, sin = (rope[0].double(), rope[1].double()) if rope is not None else (None, None)
    starts = doc_start.tolist() if doc_start is not None else [[0] * T for _ in range(B)]
    rows = []  # out[b][p]: [dim]
    selected = torch.full((B, H_kv, T, c.n_sel), -1, dtype=torch.long)
    for b in range(B):
        rows.append([])
        # per-token projections: Q[t][h], K[branch][t][g], V[branch][t][g]
        Q, K, V = [], {br: [] for br in ("cmp", "sel", "win")}, {br: [] for br in ("cmp", "sel", "win")}
        for t in range(T):
            qt = _linear(x[b, t], params, "q_proj").view(H, hd)
            kvt = _linear(x[b, t], params, "kv_proj").view(6, H_kv, hd)
            if eps is not None:
                qt = torch.stack([_rms_norm(qt[h], params["q_norm.weight"], eps) for h in range(H)])
                kvt = torch.stack([
                    torch.stack([_rms_norm(kvt[r, g], params["k_norm.weight"], eps) for g in range(H_kv)])
                    if r % 2 == 0 else kvt[r] for r in range(6)
                ])
            if cos is not None:
                at = t - starts[b][t]  # position within the document
                qt = torch.stack([_rotate(qt[h], cos[at], sin[at]) for h in range(H)])
            Q.append(qt)
            for r, br in enumerate(("cmp", "sel", "win")):
                kt = kvt[2 * r]
                if cos is not None and br != "cmp":  # compression keys are rotated after phi
                    kt = torch.stack([_rotate(kt[g], cos[t - starts[b][t]], sin[t - starts[b][t]]) for g in range(H_kv)])
                K[br].append(kt)
                V[br].append(kvt[2 * r + 1])
        # compressed token i of a document starting at s0 and ending before e0: phi over positions
        # [s0 + i*d, s0 + i*d + l) (inside the document), key rotated at document position i*d + l - 1
        CK, CV = {}, {}  # document start -> list over i
        for s0 in sorted(set(starts[b])):
            e0 = s0 + starts[b].count(s0)
            CK[s0], CV[s0] = [], []
            for i in range(0 if e0 - s0 < c.l else (e0 - s0 - c.l) // c.d + 1):
                span = range(s0 + i * c.d, s0 + i * c.d + c.l)
                ck = torch.stack([_phi(torch.stack([K["cmp"][s][g] for s in span]), params, "compress_k") for g in range(H_kv)])
                if cos is not None:
                    end = i * c.d + c.l - 1  # the block's last position within the document
                    ck = torch.stack([_rotate(ck[g], cos[end], sin[end]) for g in range(H_kv)])
                CK[s0].append(ck)
                CV[s0].append(torch.stack([_phi(torch.stack([V["cmp"][s][g] for s in span]), params, "compress_v") for g in range(H_kv)]))
        if attn.indexer is not None:  # index key of each token, then of each document's selection block
            e, h_I = attn.cfg.indexer_dim, attn.cfg.indexer_heads  # (the elementwise max of its tokens' keys)
            # one projection per token: [q (H_kv * h * e) | w (H_kv * h) | k (e)]
            index_out = [_linear(x[b, t], params, "indexer.projection") for t in range(T)]
            k_I = [out[H_kv * h_I * (e + 1):] for out in index_out]
            block_key = {}  # (document start, document-relative block) -> [e]
            for s0 in sorted(set(starts[b])):
                e0 = s0 + starts[b].count(s0)
                for j in range(-(-(e0 - s0) // c.l_sel)):
                    block_key[s0, j] = torch.stack(k_I[s0 + j * c.l_sel: min(s0 + (j + 1) * c.l_sel, e0)]).amax(dim=0)
        for p in range(T):
            s0 = starts[b][p]
            rel = p - s0  # the query's position in its document
            if attn.forced_gates is not None:
                gates = torch.tensor(attn.forced_gates, dtype=torch.float64, device=x.device).expand(H, 3)
            else:
                hidden = F.silu(_linear(x[b, p], params, "gate_mlp.0"))
                gates = torch.sigmoid(_linear(hidden, params, "gate_mlp.2")).view(H, 3)
            visible = [i for i in range(len(CK[s0])) if i * c.d + c.l - 1 <= rel]
            window = list(range(max(s0, p - c.w + 1), p + 1))
            heads = [None] * H
            for g in range(H_kv):
                group_heads = range(g * G, (g + 1) * G)
                o_cmp, p_group = {}, [0.0] * len(visible)
                for h in group_heads:
                    if visible:
                        o_cmp[h], probs = _attend(Q[p][h], torch.stack([CK[s0][i][g] for i in visible]),
                                                  torch.stack([CV[s0][i][g] for i in visible]))
                        p_group = [acc + pr for acc, pr in zip(p_group, probs.tolist())]  # Eq. 10
                    else:
                        o_cmp[h] = torch.zeros(hd, dtype=torch.float64, device=x.device)  # sees no compressed token
                index_score = None
                if attn.indexer is not None and attn.indexer_selects:  # I(p, j) = sum_h w_h ReLU(q_h . K_j) / sqrt(e)
                    q_I = index_out[p][: H_kv * h_I * e].view(H_kv, h_I, e)[g]
                    w_I = index_out[p][H_kv * h_I * e: H_kv * h_I * (e + 1)].view(H_kv, h_I)[g]
                    def token_score(key):
                        return sum(w_I[h].item() * max(0.0, torch.dot(q_I[h], key).item()) / math.sqrt(e)
                                   for h in range(h_I))

                    if attn.cfg.indexer_pool == "keys":  # one key per block: the max of its tokens' keys
                        index_score = {j: token_score(block_key[s0, j]) for j in range(rel // c.l_sel + 1)}
                    else:  # every token of the query's document scored; a block's score is its tokens' max
                        end = s0 + starts[b].count(s0)  # the query's document ends before this index
                        index_score = {j: max(token_score(k_I[s]) for s in range(s0 + j * c.l_sel,
                                                                                 min(s0 + (j + 1) * c.l_sel, end)))
                                       for j in range(rel // c.l_sel + 1)}
                if picks is not None:  # given (an earlier indexer layer's)
                    blocks = sorted(j for j in picks[b, g, p].tolist() if j >= 0)
                else:
                    blocks = _select(p_group, rel, c, index_score)  # document-relative block indices
                selected[b, g, p, : len(blocks)] = torch.tensor(blocks)
                keys = [s0 + r for j in blocks for r in range(j * c.l_sel, (j + 1) * c.l_sel) if r <= rel]
                for h in group_heads:
                    o_sel, _ = _attend(Q[p][h], torch.stack([K["sel"][s][g] for s in keys]), torch.stack([V["sel"][s][g] for s in keys]))
                    o_win, _ = _attend(Q[p][h], torch.stack([K["win"][s][g] for s in window]), torch.stack([V["win"][s][g] for s in window]))
                    heads[h] = gates[h, 0] * o_cmp[h] + gates[h, 1] * o_sel + gates[h, 2] * o_win
            rows[b].append(_linear(torch.cat(heads), params, "proj"))
    return torch.stack([torch.stack(r) for r in rows]), selected
