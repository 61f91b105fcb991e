"""Decode caches of a fixed size and the one-token step over them: what a CUDA graph can replay.

A CUDA graph replays a recorded sequence of kernels on the same buffers: between steps no shape, no Python branch
and no host value may change. The growing caches (nsa_cache.NSACache, dense.KVCache) branch on the position as a
Python int and grow; these hold every buffer at its final size, and the step takes the position as a 0-dim int64
device tensor: each write goes to a slot computed on the device, what a query may not see is masked.

    dense layer: K, V [B, H_kv, L, hd]; the step at p writes slot p and attends to slots <= p.
    NSA layer:   selection K, V [B, H_kv, L', hd], every raw position (L' = L rounded up to whole blocks of l');
                 window K, V [B, H_kv, w, hd], a ring: position s in slot s % w;
                 compression: the raw K, V of the last l positions [B, H_kv, l, hd] (a ring, s in slot s % l) and
                 the compressed K, V [B, H_kv, C + 1, hd], C = num_compressed(L); a step that ends a block (p + 1 - l
                 a multiple of d) writes its compressed token to slot (p + 1 - l) / d, any other step writes the
                 candidate it computed to slot C, which nothing reads.
A step reads the buffers whole, masked slots included: L keys for dense, C + n * l' + w for NSA, what a growing
cache's step reads at the buffers' capacity (decode benchmarks fill them). Selection is the growing cache's: the
compressed branch's probabilities summed over the group, overlap-weighted into block scores (Eq. 9), block 0, the
previous and the current block forced, a stable descending sort (ties to the lower block), the first n picks;
blocks after the current one score -inf and, when fewer than n blocks exist, are picked last; every key after p is
masked (the current block's tail, and those blocks whole).

nsa.selector=indexer: the index keys of every token (indexer_pool=scores: each block scores its best token; slots
after p lie in the current block, forced whatever it scores, or in later ones, masked) or of every block (the
current block's key the running elementwise max of its tokens' keys), the indexer's scores ranked like pooled ones;
nsa.indexer_every > 1: the step takes and returns the picks as the layer does; nsa.sel_distance_cap: the gathered
keys more than cap back read at the cap (decode.py's arithmetic).

`load` copies a growing cache after a prefill (nsa/static_decode.py prefills with the model's own chunked path).
Not supported (static_decode_problem says so in one line): window-only layers, a distance-cap probe.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from nsa.attention import ops
from nsa.attention.decode import attend_capped
from nsa.attention.dense import DenseAttention, KVCache
from nsa.attention.impl.compression import num_compressed
from nsa.attention.impl.index_scores import weighted_scores
from nsa.attention.impl.selection import selection_block_scores
from nsa.attention.nsa import NativeSparseAttention
from nsa.attention.nsa_cache import NSACache
from nsa.config import NSAConfig


def static_decode_problem(attn) -> str | None:
    """Why this attention layer cannot decode over static caches, in one line, or None."""
    if isinstance(attn, DenseAttention):
        return None
    if not isinstance(attn, NativeSparseAttention):
        return f"{type(attn).__name__}: no static decode step"
    if attn.cfg.window_only:
        return "nsa.gates=window: static decoding covers NSA's three branches (window-only layers decode eagerly)"
    if attn.distance_cap is not None:
        return "a distance-cap probe: cached decoding is not supported (the probe runs full forwards only)"
    return None


def _attend_masked(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor):
    """qg [B, H_kv, G, hd] pre-scaled; k, v [B, H_kv, N, hd]; visible [N] or [B, H_kv, N] bool, >= 1 True per row
    -> out [B, H_kv, G, hd], probabilities [B, H_kv, G, N] (float32 or wider; 0 where not visible)."""
    s = torch.matmul(qg, k.transpose(-1, -2))  # [B, H_kv, G, N]
    mask = visible if visible.dim() == 1 else visible[:, :, None]
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1, dtype=torch.promote_types(s.dtype, torch.float32))
    return torch.matmul(p.to(v.dtype), v), p


class StaticKVCache:
    """A dense layer's keys and values at every position up to `max_len`."""

    def __init__(self, attn: DenseAttention, batch: int, max_len: int, dtype: torch.dtype, device) -> None:
        shape = (batch, attn.n_kv_heads, max_len, attn.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def load(self, cache: KVCache) -> None:
        k, v = cache.view()  # [B, H_kv, t, hd]
        self.k[:, :, : cache.length] = k
        self.v[:, :, : cache.length] = v

    def step(self, attn: DenseAttention, x: torch.Tensor, rope, at: StepIndex,
             picks: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        """x [B, 1, dim] at position at.pos -> ([B, 1, dim], None: a dense layer passes no picks on)."""
        q, k, v = attn.project(x, rope)  # q [B, H, 1, hd], k, v [B, H_kv, 1, hd]
        self.k[:, :, at.pos1] = k.to(self.k.dtype)  # an index_put_ (compiles to an in-place scatter)
        self.v[:, :, at.pos1] = v.to(self.v.dtype)
        B, H, _, hd = q.shape
        qg = q.view(B, attn.n_kv_heads, H // attn.n_kv_heads, hd) * (1.0 / math.sqrt(hd))
        y, _ = _attend_masked(qg, self.k, self.v, at.dense_visible)  # [B, H_kv, G, hd]
        return attn.output(y.view(B, H, 1, hd)), None


class StaticNSACache:
    """An NSA layer's branch caches at their final sizes (module docstring)."""

    def __init__(self, attn: NativeSparseAttention, batch: int, max_len: int, dtype: torch.dtype, device,
                 fused: bool = True) -> None:
        c = attn.cfg
        self.fused = fused
        H_kv, hd = attn.n_kv_heads, attn.head_dim
        self.n_blocks = -(-max_len // c.l_sel)  # selection blocks N_b
        self.n_cmp = num_compressed(max_len, c.l, c.d)  # compressed slots C (slot C: scratch)

        def buf(n: int) -> torch.Tensor:
            return torch.zeros(batch, H_kv, n, hd, dtype=dtype, device=device)

        self.sel_k, self.sel_v = buf(self.n_blocks * c.l_sel), buf(self.n_blocks * c.l_sel)
        self.win_k, self.win_v = buf(c.w), buf(c.w)
        self.raw_k, self.raw_v = buf(c.l), buf(c.l)
        self.cmp_k, self.cmp_v = buf(self.n_cmp + 1), buf(self.n_cmp + 1)
        self.key_offsets = torch.arange(c.l_sel, device=device)  # [l'] a key's offset in its block
        # q_proj, kv_proj and the gate MLP's first layer as one matmul: (weight, bias, widths), a copy of the weights
        # as they are now (the decoder serves the model it was built for); weights, not cache state
        self.input_projection = attn.fused_input_projection()
        # nsa.selector=indexer: every token's index key (indexer_pool=scores), or each block's (the elementwise max
        # of its tokens' keys so far: the current block's grows a step at a time)
        self.index_tokens = self.index_blocks = None
        if attn.indexer is not None:
            e, w_dtype = attn.indexer.index_dim, attn.indexer.projection.weight.dtype
            n = self.n_blocks * c.l_sel if attn.indexer.pool == "scores" else self.n_blocks
            keys = torch.zeros(batch, n, e, dtype=w_dtype, device=device)
            if attn.indexer.pool == "scores":
                self.index_tokens = keys
            else:
                self.index_blocks = keys
        # nsa.sel_distance_cap: the RoPE tables of position cap (cos, sin [hd/2]), once
        self.at_cap = (tuple(t[0] for t in attn.cap_rope(torch.full((1,), c.sel_distance_cap, device=device)))
                       if attn.cap_rope is not None else None)

    def load(self, cache: NSACache) -> None:
        """Take a growing cache's state after a prefill of cache.t positions."""
        c, t = cache.cfg, cache.t
        self.sel_k[:, :, :t] = cache.sel_k.view()
        self.sel_v[:, :, :t] = cache.sel_v.view()
        self.win_k.copy_(cache.win_k.data)  # the same ring: position s in slot s % w
        self.win_v.copy_(cache.win_v.data)
        n_c = cache.n_compressed
        if n_c:
            self.cmp_k[:, :, :n_c] = cache.cmp_k.view()
            self.cmp_v[:, :, :n_c] = cache.cmp_v.view()
        if cache.cmp_raw_k is not None:  # positions t - r .. t - 1 that the next compressed token needs
            r = cache.cmp_raw_k.shape[2]
            at = torch.arange(t - r, t, device=self.raw_k.device) % c.l
            self.raw_k.index_copy_(2, at, cache.cmp_raw_k)
            self.raw_v.index_copy_(2, at, cache.cmp_raw_v)
        if self.index_tokens is not None:
            self.index_tokens[:, :t] = cache.index_tokens
        if self.index_blocks is not None:
            done = 0 if cache.index_blocks is None else cache.index_blocks.shape[1]
            if done:
                self.index_blocks[:, :done] = cache.index_blocks
            if cache.index_open is not None:  # the block being filled: the max of its keys so far
                self.index_blocks[:, done] = cache.index_open.amax(dim=1)

    def step(self, attn: NativeSparseAttention, x: torch.Tensor, rope, at: StepIndex,
             picks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [B, 1, dim] at position at.pos -> ([B, 1, dim], the picks [B, H_kv, n] the next layers reuse or None).
        picks: the last indexer layer's of this step (nsa.indexer_every > 1), or None."""
        c = attn.cfg
        given = picks is not None
        if attn.indexer is not None:
            picks = None  # an indexer layer picks its own
        weight, bias, widths = self.input_projection
        q_lin, kv_lin, gate_hidden = F.linear(x, weight, bias).split(widths, dim=-1)
        q, br = attn.project_from(q_lin, kv_lin, rope)  # q [B, H, 1, hd]; br {branch: (k, v) [B, H_kv, 1, hd]}
        g = attn.gates_from(gate_hidden)  # [B, 1, H, 3]
        B, H, _, hd = q.shape
        H_kv = attn.n_kv_heads
        qg = q.view(B, H_kv, H // H_kv, hd) * (1.0 / math.sqrt(hd))  # [B, H_kv, G, hd], scale folded in
        for buf, new, slot in ((self.sel_k, br["sel"][0], at.pos1), (self.sel_v, br["sel"][1], at.pos1),
                               (self.win_k, br["win"][0], at.win_slot), (self.win_v, br["win"][1], at.win_slot),
                               (self.raw_k, br["cmp"][0], at.raw_slot), (self.raw_v, br["cmp"][1], at.raw_slot)):
            buf[:, :, slot] = new.to(buf.dtype)  # an index_put_ (compiles to an in-place scatter)

        # compression: the block ending at pos, compressed from the raw ring in position order and rotated at pos
        if self.n_cmp:
            ck, cv = attn._compress(self.raw_k.index_select(2, at.raw_order), self.raw_v.index_select(2, at.raw_order),
                                    0, 1)  # [B, H_kv, 1, hd]
            if rope is not None:
                ck = ops.rotary(ck, *rope, c.kernel)
            self.cmp_k[:, :, at.cmp_slot] = ck.to(self.cmp_k.dtype)
            self.cmp_v[:, :, at.cmp_slot] = cv.to(self.cmp_v.dtype)
        fused = None
        if (self.fused and picks is None and attn.indexer is None
                and not (self.at_cap is not None and attn.distance_cap_on)):
            # pooled selection: the three branches as the decode kernels where Triton runs (else None)
            fused = ops.decode_branches(qg, self.cmp_k, self.cmp_v, self.sel_k, self.sel_v, self.win_k, self.win_v,
                                        at.pos, c.l, c.d, c.l_sel, c.n_sel, c.kernel)
        if fused is not None:
            shape = (B, H, 1, hd)
            y = attn._combine(x, *(o.view(shape) for o in fused), None, None, False, g)
            return y, None  # a pooled layer passes nothing on
        o_cmp = torch.zeros_like(qg)
        p_group = qg.new_zeros(B, H_kv, self.n_cmp)
        if self.n_cmp:
            o, probs = _attend_masked(qg, self.cmp_k[:, :, : self.n_cmp], self.cmp_v[:, :, : self.n_cmp],
                                      at.cmp_visible)
            o_cmp = torch.where(at.any_compressed, o, 0)  # before the first block ends: zero output
            p_group = torch.where(at.any_compressed, probs, 0).sum(dim=2)  # [B, H_kv, C], Eq. 10

        # selection: block scores (Eq. 9 from the compressed branch, or the learned indexer's), blocks after the
        # current one -inf, forced blocks +inf, the first n of a stable descending sort; or the given picks
        index_scores = self._index_scores(attn, x, at)  # [B, H_kv, N_b] or None
        if picks is None:
            scores = index_scores if index_scores is not None and attn.indexer_selects else selection_block_scores(
                p_group, c.l, c.d, c.l_sel, self.n_blocks)  # [B, H_kv, N_b]
            scores = scores.masked_fill(at.future_blocks, float("-inf")).masked_fill(at.forced_blocks, float("inf"))
            n = min(c.n_sel, self.n_blocks)
            picks = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :n]  # [B, H_kv, n]
        key_pos = (picks[..., None] * c.l_sel + self.key_offsets).flatten(-2)  # [B, H_kv, n*l'] positions
        visible = key_pos <= at.pos  # also hides the picks after the current block (fewer than n blocks exist)
        index = key_pos[..., None].expand(-1, -1, -1, hd)  # < N_b * l': every pick is a block of the buffer
        kg, vg = self.sel_k.gather(2, index), self.sel_v.gather(2, index)  # [B, H_kv, n*l', hd]
        if self.at_cap is not None and attn.distance_cap_on:  # the gathered keys more than cap back read at the cap
            capped = (c.sel_distance_cap, self.at_cap, attn.cap_rope)
            o_sel = attend_capped(qg, kg, vg, key_pos, at.pos, capped, visible)
        else:
            o_sel, _ = _attend_masked(qg, kg, vg, visible)

        # window: the ring holds the last w positions; before w are written, the slots after pos are empty
        o_win, _ = _attend_masked(qg, self.win_k, self.win_v, at.win_visible)

        shape = (B, H, 1, hd)
        y = attn._combine(x, o_cmp.view(shape), o_sel.view(shape), o_win.view(shape), None, None, False, g)
        # nsa.indexer_every > 1 (as NativeSparseAttention._pass_on): an indexer layer passes its picks on while its
        # indexer selects, a reusing layer the picks it was given
        passes = attn.cfg.shares_picks and (attn.indexer_selects if attn.indexer is not None else given)
        return y, picks if passes else None

    def _index_scores(self, attn: NativeSparseAttention, x: torch.Tensor, at: StepIndex) -> torch.Tensor | None:
        """nsa.selector=indexer: this step's index key joins the cache; -> the indexer's block scores of the query at
        at.pos [B, H_kv, N_b] (blocks after the current one: whatever the buffer holds; selection masks them), else
        None."""
        if attn.indexer is None:
            return None
        q_I, w_I, k_I, _ = attn.indexer.project(x.detach())  # [B, 1, H_kv, h, e], [B, 1, H_kv, h], [B, 1, e]
        if self.index_tokens is not None:  # indexer_pool=scores: every token scored, each block its best token's
            # (slots after pos lie in the current block, forced whatever it scores, or in later ones, masked)
            self.index_tokens[:, at.pos1] = k_I.to(self.index_tokens.dtype)
            per_token = weighted_scores(q_I, w_I, self.index_tokens)  # [B, H_kv, 1, N_b * l']
            return per_token.unflatten(-1, (self.n_blocks, attn.cfg.l_sel)).amax(dim=-1)[:, :, 0]
        key = torch.where(at.block_opens, k_I, torch.maximum(self.index_blocks[:, at.block1], k_I))  # [B, 1, e]
        self.index_blocks[:, at.block1] = key.to(self.index_blocks.dtype)
        return weighted_scores(q_I, w_I, self.index_blocks)[:, :, 0]  # [B, H_kv, N_b]


class StepIndex:
    """What a step's position decides, computed once per step on the device for every layer: the slots it writes
    and the masks it reads with (max_len and the NSA geometry fixed; pos a 0-dim int64 tensor)."""

    def __init__(self, max_len: int, nsa: NSAConfig | None, device) -> None:
        self.max_len, self.nsa = max_len, nsa
        self.slots = torch.arange(max_len, device=device)  # [L]
        if nsa is not None:
            c = nsa
            self.n_cmp = num_compressed(max_len, c.l, c.d)
            n_blocks = -(-max_len // c.l_sel)
            self.win_slots, self.raw_slots = torch.arange(c.w, device=device), torch.arange(c.l, device=device)
            self.cmp_slots, self.blocks = torch.arange(self.n_cmp, device=device), torch.arange(n_blocks, device=device)

    def update(self, pos: torch.Tensor) -> StepIndex:
        """The indices and masks of position pos (device ops only)."""
        self.pos, self.pos1 = pos, pos.view(1)
        self.dense_visible = self.slots <= pos  # [L]
        c = self.nsa
        if c is None:
            return self
        self.win_slot, self.raw_slot = self.pos1 % c.w, self.pos1 % c.l
        self.raw_order = (self.pos1 + 1 + self.raw_slots) % c.l  # [l] slots of positions pos - l + 1 .. pos
        n_done = torch.where(pos + 1 >= c.l, torch.div(pos + 1 - c.l, c.d, rounding_mode="floor") + 1, 0)
        ends = (pos + 1 >= c.l) & ((pos + 1 - c.l) % c.d == 0)  # a compressed block ends at pos
        self.cmp_slot = torch.where(ends, n_done - 1, self.n_cmp).view(1)  # else the scratch slot
        self.cmp_visible, self.any_compressed = self.cmp_slots < n_done, n_done > 0  # [C], []
        current = torch.div(pos, c.l_sel, rounding_mode="floor")
        self.block1, self.block_opens = current.view(1), pos % c.l_sel == 0  # the learned indexer's block keys
        self.future_blocks = self.blocks > current  # [N_b]
        self.forced_blocks = (self.blocks == 0) | ((self.blocks >= current - 1) & (self.blocks <= current))
        self.win_visible = self.win_slots <= pos  # [w]
        return self


def static_cache(attn, batch: int, max_len: int, dtype: torch.dtype, device, fused: bool = True):
    """The static cache of one attention layer (static_decode_problem(attn) must be None). fused: an NSA layer with
    pooled selection runs its three branches as the decode kernels where Triton runs (ops.decode_branches)."""
    if isinstance(attn, NativeSparseAttention):
        return StaticNSACache(attn, batch, max_len, dtype, device, fused)
    return StaticKVCache(attn, batch, max_len, dtype, device)
