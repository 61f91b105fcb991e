"""Native Sparse Attention (Yuan et al. 2025), vectorised training / prefill path and cached decode.

    o_p = sum_c g_p^c * Attn(q_p, K_p^c, V_p^c),  c in {cmp, sel, win};  then the output projection.

nsa.gates=window makes the same layer the window-only control: the gates pinned to (cmp, sel, win) = (0, 0, 1),
so o_p = Attn(q_p, K_p^win, V_p^win); the compression, selection and gate modules are not built and not run
(the parameters of a sliding-window attention layer: q, the window branch's k and v, the output projection).

One query projection; each branch has its own key/value projection (paper §3.3.3). Gates: MLP on the
layer input -> sigmoid, one gate per head per branch. GQA: the G = H / H_kv query heads of a group
share K/V and the selected blocks (Eq. 10). Semantics and choices: docs/NSA.md. The oracle this must
match is nsa/attention/reference.py (plain per-token loops, float64).

No Python loop runs over tokens and nothing syncs with the host. Training and prefill call one custom op
per stage (nsa/attention/ops.py) on every device, so the layer is a constant number of ops whatever T.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from nsa.attention import ops
from nsa.attention.compressor import BlockCompressor
from nsa.attention.decode import decode_branches, decode_window
from nsa.attention.documents import Documents
from nsa.attention.gate_stats import BRANCHES, gate_shares, gate_statistics, selection_counts, selection_statistics
from nsa.attention.impl.capped import capped_queries, capped_selected_attention, unrotated
from nsa.attention.impl.compression import num_compressed
from nsa.attention.impl.masked import document_block_count, document_block_scores
from nsa.attention.impl.index_scores import dense_block_mass, kl_row_indices
from nsa.attention.indexer import BlockIndexer, kl_row_count, shared_counted_rows
from nsa.attention.nsa_cache import NSACache
from nsa.attention.selection_health import gate_means, outside_window_counts, outside_window_share, recall_sample
from nsa.config import ModelConfig, ModelConfigError, NSAConfig
from nsa.layers import RotaryEmbedding
from nsa.profiling import nvtx_range

WINDOW_GATES = (0.0, 0.0, 1.0)  # nsa.gates=window: the (cmp, sel, win) gates, pinned


def window_gate_biases(cfg: NSAConfig) -> tuple[float, float, float]:
    """nsa.gate_init=window: the (cmp, sel, win) pre-sigmoid biases -b, -b, +b with b = nsa.gate_bias."""
    return (-cfg.gate_bias, -cfg.gate_bias, cfg.gate_bias)


def initial_gate_entropy(cfg: NSAConfig) -> float:
    """Mean binary entropy (nats) of the gates at step 0 (gate_stats' gate_entropy_mean): ln 2 for equal
    gates (all ~0.5); for the window init H(sigmoid(b)), 0.090 at b = 4 (0.365 at b = 2; H is symmetric: 0.12 and 0.88 alike)."""
    if cfg.gate_init == "equal":
        return math.log(2.0)
    g = 1.0 / (1.0 + math.exp(-cfg.gate_bias))
    return -g * math.log(g) - (1 - g) * math.log(1 - g)


class NativeSparseAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        cfg.nsa.validate()
        self.cfg = cfg.nsa
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.n_groups = cfg.n_heads // cfg.n_kv_heads
        q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        # the branches with keys and values of their own: all three, or the window alone (nsa.gates=window)
        self.branches = ("win",) if self.cfg.window_only else BRANCHES
        self.q_proj = nn.Linear(cfg.dim, q_dim, bias=cfg.bias)
        # keys and values of the branches in one matmul: (cmp k, cmp v, sel k, sel v, win k, win v), or (win k, win v)
        self.kv_proj = nn.Linear(cfg.dim, 2 * len(self.branches) * kv_dim, bias=cfg.bias)
        if not self.cfg.window_only:
            self.compress_k = BlockCompressor(self.cfg.l, cfg.head_dim, cfg.bias)  # phi_K
            self.compress_v = BlockCompressor(self.cfg.l, cfg.head_dim, cfg.bias)  # phi_V
            gate_hidden = self.cfg.gate_hidden or max(1, cfg.dim // 4)
            self.gate_mlp = nn.Sequential(
                nn.Linear(cfg.dim, gate_hidden), nn.SiLU(), nn.Linear(gate_hidden, 3 * cfg.n_heads)
            )
        # nsa.selector=indexer: a learned block indexer picks the free blocks (nsa/attention/indexer.py); it learns by
        # the KL term the forward leaves in self.indexer_loss (the model adds it to the loss: nsa/model.py). With
        # nsa.indexer_every = k > 1 only every k-th layer has one; the layers between reuse its picks
        self.indexer = (BlockIndexer(cfg.dim, cfg.n_kv_heads, self.cfg.indexer_heads, self.cfg.indexer_dim,
                                     self.cfg.l_sel, self.cfg.indexer_pool) if self.cfg.owns_indexer(layer) else None)
        self.indexer_selects = True  # False during nsa.indexer_warmup_steps: pooled scores pick, the indexer learns
        # nsa.indexer_every > 1: what the last forward passes on to the layers that reuse picks (the Block reads it
        # right after the call): an indexer layer's picks while its indexer selects, a reusing layer's given ones
        self.picks_out: torch.Tensor | None = None
        # the last training forward's weighted KL as terms whose sum it is ([B, H_kv, R] per row, or 0-dim)
        self.indexer_loss: torch.Tensor | None = None

        self.proj = nn.Linear(q_dim, cfg.dim, bias=cfg.bias)
        self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.dropout = nn.Dropout(cfg.dropout)
        self.stats_enabled = False  # record self.last_stats and self.last_sample (device tensors) on every forward
        self.last_stats: dict[str, torch.Tensor] | None = None
        # a detached copy of row 0's queries, selection keys and blocks for sel_recall, computed after the step
        # (nsa/attention/selection_health.py: recall_sample, selection_recall)
        self.last_sample: dict[str, torch.Tensor] | None = None
        self.forced_gates: tuple[float, float, float] | None = None  # tests: fixed (cmp, sel, win) gates (learned mode)
        # probes: branches whose learned gate is multiplied by 0, the others kept (nsa.gate_health.knock_out)
        self.knocked_out: frozenset[str] = frozenset()
        # nsa.sel_distance_cap: the selected branch reads keys more than cap positions back as if cap back
        # (impl/capped.py); the RoPE tables of position cap come from this model's RoPE (its inv_freq a buffer that
        # is not saved: checkpoints are unchanged)
        self.cap_rope = (RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scale, cfg.rope_scaling,
                                         cfg.max_seq_len) if self.cfg.sel_distance_cap else None)
        # False during nsa.sel_distance_cap_from_step's first training steps: the selected branch reads uncapped
        self.distance_cap_on = True
        # probes: the same for a model trained without it, (cap, (cos, sin) [hd/2] of position cap)
        # (nsa.gate_health.distance_capped); None: nsa.sel_distance_cap's
        self.distance_cap: tuple[int, tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def last_indexer_kl(self) -> torch.Tensor | None:
        """The last training forward's KL of the indexer to its target (unweighted, detached; 0-dim), or None."""
        if self.indexer_loss is None:
            return None
        return self.indexer_loss.detach().sum() / self.cfg.indexer_kl  # off the hot path: read with statistics

    def reset_extra_parameters(self) -> None:
        """Called by Transformer.reset_parameters after its generic init: phi position encodings, and the
        gates' output layer for nsa.gate_init=window (weights 0, biases -b / -b / +b per head, b = nsa.gate_bias: at b = 4 every token
        starts at sigmoid = 0.018 / 0.018 / 0.982 for cmp / sel / win, local context first). A window-only layer
        has neither."""
        if self.cfg.window_only:
            return
        self.compress_k.reset_extra_parameters()
        self.compress_v.reset_extra_parameters()
        if self.cfg.gate_init == "window":
            out = self.gate_mlp[2]
            nn.init.zeros_(out.weight)
            with torch.no_grad():
                out.bias.copy_(torch.tensor(window_gate_biases(self.cfg), dtype=out.bias.dtype).repeat(self.n_heads))

    def aux_parameter_names(self) -> list[str]:
        """The gate MLP's and phi's parameters (relative to this module): NSA's additions to attention, whatever
        nsa.aux_decay / aux_lr_scale say (the trainer keeps them on AdamW under train.optimizer=muon)."""
        return [name for name, _ in self.named_parameters() if name.startswith(("gate_mlp.", "compress_k.", "compress_v."))]

    def muon_row_splits(self) -> dict[str, tuple[int, ...]]:
        """Fused matrices (names relative to this module) and the rows of the projections they stack: kv_proj's
        key and value projections of each branch. An optimizer that treats each projection as its own matrix
        (Muon) reads this."""
        kv_dim = self.n_kv_heads * self.head_dim
        return {"kv_proj.weight": (kv_dim,) * (2 * len(self.branches))}

    def no_weight_decay(self) -> set[str]:
        """Names (relative to this module) of matrices the optimizer must not decay: the gate MLP's and phi's
        with nsa.aux_decay=false (the trainer's param_groups asks every module that has this method)."""
        if self.cfg.aux_decay:
            return set()
        params = dict(self.named_parameters())
        return {name for name in self.aux_parameter_names() if params[name].dim() >= 2}

    def lr_scales(self) -> dict[str, float]:
        """Names (relative to this module) of parameters whose learning rate is train.lr's times a factor: the
        gate MLP's and phi's with nsa.aux_lr_scale != 1, the indexer's with nsa.indexer_lr_scale != 1 (the
        trainer's param_groups asks every module)."""
        scales = {}
        if self.cfg.aux_lr_scale != 1.0:
            scales.update({name: self.cfg.aux_lr_scale for name in self.aux_parameter_names()})
        if self.indexer is not None and self.cfg.indexer_lr_scale != 1.0:
            scales.update({f"indexer.{name}": self.cfg.indexer_lr_scale for name, _ in self.indexer.named_parameters()})
        return scales

    def new_cache(self) -> NSACache:
        return NSACache(self.cfg)

    # ---------------------------------------------------------------- projections
    def project(self, x: torch.Tensor, rope=None):
        """x [B, T, dim] -> q [B, H, T, hd] (rotated), {branch: (k, v)} each [B, H_kv, T, hd] for self.branches.

        Selection and window keys are rotated at their positions; compression keys are returned raw
        (phi compresses un-rotated keys; the compressed key is rotated afterwards, see `forward`).
        """
        return self.project_from(self.q_proj(x), self.kv_proj(x), rope)

    def project_from(self, q_lin: torch.Tensor, kv_lin: torch.Tensor, rope=None):
        """`project` after its two matmuls: q_lin [B, T, H*hd] (q_proj's output), kv_lin [B, T, 2*n*H_kv*hd]
        (kv_proj's) -> what `project` returns. The static decoder runs the matmuls as one (fused_input_projection)."""
        B, T, _ = q_lin.shape
        H, H_kv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        n_kv = 2 * len(self.branches)
        q = q_lin.view(B, T, H, hd).transpose(1, 2)
        # unbind (backward: one stack) rather than strided slices (backward: zero-filled scatters)
        kv = kv_lin.view(B, T, n_kv, H_kv, hd).permute(2, 0, 3, 1, 4).unbind(0)  # n_kv x [B, H_kv, T, hd]
        keys, values = list(kv[0::2]), kv[1::2]
        if self.q_norm is not None:
            q, keys = self.q_norm(q), [self.k_norm(k) for k in keys]
        if rope is not None and ops.left_to_inductor():  # RoPE is torch ops here: each rotation fused into what
            # reads it, no concatenated copy
            q = ops.rotary(q, *rope, self.cfg.kernel)
            keys = [k if name == "cmp" else ops.rotary(k, *rope, self.cfg.kernel) for name, k in zip(self.branches, keys)]
        elif rope is not None:  # one rotation for q and the selection and window keys; compression keys
            # stay raw (rotated after phi)
            rotate = [i for i, name in enumerate(self.branches) if name != "cmp"]
            qk = torch.cat((q, *(keys[i] for i in rotate)), dim=1)  # [B, H + n*H_kv, T, hd]
            rotated = ops.rotary(qk, *rope, self.cfg.kernel)
            q, *rotated_keys = rotated.split((H,) + (H_kv,) * len(rotate), dim=1)
            for i, k in zip(rotate, rotated_keys):
                keys[i] = k
        return q, dict(zip(self.branches, zip(keys, values)))

    def fused_input_projection(self) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int]]:
        """The matmuls that read the layer's input, stacked for one matmul: (weight [q + kv + gate_hidden, dim],
        bias [q + kv + gate_hidden], the three widths): q_proj, kv_proj and the gate MLP's first layer, whose outputs
        project_from and gates_from take. A detached copy (a missing bias as zeros: adding 0 changes nothing), made
        by the static decoder when it is built: at batch 1 a decode step is launch-bound, and one matmul is two
        launches fewer than three (docs/BENCHMARKS.md, "the compiled decode step's kernels")."""
        linears = (self.q_proj, self.kv_proj, self.gate_mlp[0])
        weight = torch.cat([m.weight.detach() for m in linears])
        bias = torch.cat([m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features)
                          for m in linears])
        return weight, bias, tuple(m.out_features for m in linears)

    @property
    def _pinned_gates(self) -> tuple[float, float, float] | None:
        return WINDOW_GATES if self.cfg.window_only else self.forced_gates

    def gates(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, dim] -> [B, T, H, 3] in [0, 1]
        return self.gates_from(x if self._pinned_gates is not None else self.gate_mlp[0](x))

    def gates_from(self, hidden: torch.Tensor) -> torch.Tensor:
        """`gates` after the gate MLP's first matmul: hidden [B, T, gate_hidden] (gate_mlp[0]'s output; with pinned
        gates any [B, T, *] tensor, unread) -> [B, T, H, 3]."""
        pinned = self._pinned_gates
        if pinned is not None:
            g = torch.tensor(pinned, dtype=hidden.dtype, device=hidden.device)
            return g.expand(hidden.shape[0], hidden.shape[1], self.n_heads, 3)
        g = torch.sigmoid(self.gate_mlp[2](self.gate_mlp[1](hidden))).view(*hidden.shape[:2], self.n_heads, 3)
        if self.knocked_out:
            keep = torch.tensor([name not in self.knocked_out for name in BRANCHES], dtype=g.dtype, device=g.device)
            g = g * keep  # [B, T, H, 3]
        return g

    # ---------------------------------------------------------------- forward
    def forward(
        self,
        x: torch.Tensor,  # [B, T, dim]
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,  # cos, sin [T or B, T, hd/2] for x's positions
        cache: NSACache | None = None,  # appends x's tokens when given
        return_indices: bool = False,  # also return the selected blocks [B, H_kv, T, n] (-1 = none)
        documents: Documents | None = None,  # packed documents of x (training / prefill from 0, no cache)
        # [B, H_kv, T, n] the last indexer layer's picks (nsa.indexer_every > 1): a layer without an indexer of its
        # own selects these blocks (document-relative with packed documents); None: it selects by its pooled scores
        picks: torch.Tensor | None = None,
    ):
        if self.cfg.window_only:
            return self._forward_window(x, rope, cache, documents, return_indices)
        if self.indexer is not None:
            picks = None  # an indexer layer picks its own
        if documents is not None:
            return self._forward_documents(x, rope, documents, return_indices, picks)
        q, br = self.project(x, rope)
        if cache is None:
            t0 = 0
            o_cmp, o_sel, o_win, block_idx = self.sparse_attention(q, br, rope, x, picks)
        else:
            t0 = cache.t
            o_cmp, o_sel, o_win, block_idx = self._cached_branches(q, br, rope, cache, x, picks)
        self._pass_on(block_idx, picks)
        record = None
        if self.stats_enabled:  # every query's position: t0 .. t_end-1 (one document); sel_k holds positions 0 ..
            record = self._selection_record(q, br["sel"][0] if cache is None else cache.sel_k.data, block_idx,
                                            torch.arange(t0, t0 + x.shape[1], device=x.device))
        return self._combine(x, o_cmp, o_sel, o_win, block_idx, record, return_indices)

    def _pass_on(self, block_idx: torch.Tensor, picks: torch.Tensor | None) -> None:
        """nsa.indexer_every > 1: what this forward passes on (self.picks_out): an indexer layer's picks while its
        indexer selects (None during the warm-up: the next layers select by their own pooled scores, as it does), a
        reusing layer's given picks."""
        if self.cfg.shares_picks:
            selects = picks is not None if self.indexer is None else self.indexer_selects
            self.picks_out = block_idx if selects else None

    def sparse_attention(self, q: torch.Tensor, br: dict, rope=None, x: torch.Tensor | None = None,
                         picks: torch.Tensor | None = None):
        """The three branches over a fresh sequence (positions 0 .. T-1, no cache, one document): everything between
        the projections and the gates, which bench/gpu_nsa_speed.py times beside SDPA. q [B, H, T, hd] and br
        {branch: (k, v)} as `project` returns them, x [B, T, dim] the layer's input (the indexer's, when there is
        one), picks [B, H_kv, T, n] the blocks to select (an earlier indexer layer's) or None
        -> o_cmp, o_sel, o_win [B, H, T, hd], block_idx [B, H_kv, T, n]."""
        c = self.cfg
        T = q.shape[2]
        raw_k, raw_v = br["cmp"]
        count = num_compressed(T, c.l, c.d)
        ck, cv = self._compress(raw_k, raw_v, 0, count)  # [B, H_kv, count, hd]
        if rope is not None and count > 0:  # rotate compressed key i at position i*d + l - 1
            # cos, sin [T, hd/2] or per row [B, T, hd/2]: positions l-1, l-1+d, .. of the T axis, a strided view
            # (no index op) -> [count, hd/2] or [B, count, hd/2]
            at = slice(c.l - 1, c.l - 1 + (count - 1) * c.d + 1, c.d)
            ck = ops.rotary(ck, rope[0][..., at, :], rope[1][..., at, :], c.kernel)
        index = None
        if self.indexer is not None:  # the language-model loss never moves the indexer: its input is detached
            q_I, w_I, k_I, out = self.indexer.project(x.detach())
            index = (q_I, w_I, k_I, out, True)  # token keys: the ops pool them to block keys themselves
        return self._branches(q, ck, cv, *br["sel"], *br["win"], 0, T, index, self._distance_cap(rope, q.device),
                              picks)

    def _distance_cap(self, rope, device: torch.device, keys: int | None = None):
        """(cap, RoPE tables (cos, sin) [hd/2] of position cap, the key positions' tables) when the selected branch
        reads far keys at a capped distance (a probe's, else nsa.sel_distance_cap), else None. The key tables: the
        forward's own rope (a forward from position 0), or with `keys` (a call over a cache of that many keys,
        nsa.sel_distance_cap only) those of positions 0 .. keys - 1."""
        if rope is None:
            return None
        if self.distance_cap is not None:
            return (*self.distance_cap, rope)
        if self.cap_rope is None or not self.distance_cap_on:
            return None
        cap = self.cfg.sel_distance_cap
        cos, sin = self.cap_rope(torch.full((1,), cap, device=device))  # a fill on the device, no host copy
        if keys is not None:
            rope = self.cap_rope(torch.arange(keys, device=device))  # [keys, hd/2] each
        return cap, (cos[0], sin[0]), rope

    def _capped_selected(self, qg, sel_k, sel_v, block_idx, capped, frame=None, q_start: int = 0):
        """The selected branch with far keys read at the distance cap: qg [B, H_kv, G, Tq, hd] at positions
        q_start .., sel_k, sel_v [B, H_kv, >= q_start + Tq, hd] from position 0 (a cache's may be padded after),
        capped = _distance_cap's (cap, at_cap, key tables) -> o_sel [B, H, Tq, hd]."""
        B, H_kv, G, T, hd = qg.shape
        cap, at_cap, rope = capped
        keys = q_start + T
        o = capped_selected_attention(qg, sel_k[:, :, :keys], sel_v[:, :, :keys], block_idx, rope, at_cap,
                                      self.cfg.l_sel, cap, frame, q_start)
        return o.view(B, H_kv * G, T, hd)

    def _compress(self, raw_k: torch.Tensor, raw_v: torch.Tensor, lo: int, count: int, layout=None):
        """phi_K and phi_V over `count` blocks of the raw keys and values [B, H_kv, R, hd], block i from raw row
        lo + i*d (or a packed documents' layout's slots) -> ck, cv [B, H_kv, count, hd] (ops.compress_blocks)."""
        c = self.cfg
        return ops.compress_blocks(raw_k, raw_v, self.compress_k.weights(), self.compress_v.weights(), lo, count,
                                   c.l, c.d, c.kernel, layout)

    def _cached_branches(self, q, br, rope, cache: NSACache, x: torch.Tensor, picks: torch.Tensor | None = None):
        """The three branches of x's tokens appended to `cache` (prefill chunks and decode steps): compressed tokens
        are emitted for every block that ends inside this call, the caches grow, then `_branches`."""
        c = self.cfg
        if self.distance_cap is not None:
            raise ModelConfigError("a distance-cap probe: cached decoding is not supported (the probe runs full "
                                   "forwards only)")
        T = q.shape[2]
        t0 = cache.t  # absolute position of x[:, 0]
        t_end = t0 + T
        raw_k, raw_v = br["cmp"]
        if cache.cmp_raw_k is not None:
            raw_k, raw_v = torch.cat((cache.cmp_raw_k, raw_k), 2), torch.cat((cache.cmp_raw_v, raw_v), 2)
        raw_start = t_end - raw_k.shape[2]
        first = cache.n_compressed
        count = num_compressed(t_end, c.l, c.d) - first
        emit = count > 0 or cache.cmp_k.data is None  # else reuse the cache's tokens
        if emit:
            ck, cv = self._compress(raw_k, raw_v, first * c.d - raw_start, count)  # [B, H_kv, count, hd]
        if rope is not None and count > 0:  # rotate compressed key i at position i*d + l - 1 (in x)
            at = torch.arange(count, device=q.device) * c.d + (first * c.d + c.l - 1 - t0)  # [count]
            ck = ops.rotary(ck, rope[0][..., at, :], rope[1][..., at, :], c.kernel)
        if emit:
            cache.cmp_k.append(ck)
            cache.cmp_v.append(cv)
        ck, cv = cache.cmp_k.view(), cache.cmp_v.view()
        keep = (first + count) * c.d - raw_start  # raw positions the next compressed token needs
        cache.cmp_raw_k, cache.cmp_raw_v = raw_k[:, :, keep:], raw_v[:, :, keep:]
        cache.sel_k.append(br["sel"][0])
        cache.sel_v.append(br["sel"][1])
        sel_k, sel_v = cache.sel_k.data, cache.sel_v.data  # whole zero-padded blocks, positions 0 ..
        win_k, win_v = cache.window(*br["win"])
        cache.t = t_end
        index = None
        if self.indexer is not None:  # the new tokens' index keys join their blocks; the queries score every block
            q_I, w_I, k_I, out = self.indexer.project(x.detach())
            index = (q_I, w_I, cache.index_keys(k_I, per_token=self.indexer.pool == "scores"), out, False)
        # a prefill chunk reads every cached key: the tables of positions 0 .. t_end - 1 (a decode step: its picks')
        capped = self._distance_cap(rope, q.device, keys=t_end if T > 1 else None)
        return self._branches(q, ck, cv, sel_k, sel_v, win_k, win_v, t0, t_end, index, capped, picks)

    def _branches(self, q, ck, cv, sel_k, sel_v, win_k, win_v, t0: int, t_end: int, index=None, capped=None,
                  picks=None):
        """q [B, H, T, hd] at positions t0 .. t_end-1 over compressed ck, cv [B, H_kv, C, hd], selection keys and
        values from position 0 and the window's keys and values ending at t_end - 1 -> the three branch outputs
        [B, H, T, hd] and block_idx [B, H_kv, T, n]. index: the indexer's index queries [B, T, H_kv, h, e], head
        weights [B, T, H_kv, h], keys (block keys [B, N_b, e], or token keys [B, S, e]), its projection output
        [B, T, P] and whether the keys are token keys (pooled to blocks by the ops), or None. Its scores pick the
        blocks while self.indexer_selects (ops.indexer_picks, no graph), and a training forward from position 0
        leaves the KL to its target (nsa.indexer_target) in self.indexer_loss (ops.indexer_kl over the KL's rows,
        per-row terms; its backward recomputes their scores: nothing of size [T, N_b] is kept).
        capped: _distance_cap's, when the selected branch reads far keys at the cap (its key tables from position 0).
        picks [B, H_kv, T, n]: the blocks to select (an earlier indexer layer's, nsa.indexer_every > 1), or None."""
        c = self.cfg
        B, _, T, _ = q.shape
        indexer_picks = index is not None and self.indexer_selects
        if T == 1:  # one query (a decode step): every cached key is visible, no chunking or masks
            with nvtx_range("nsa.decode"):
                scores = None
                if indexer_picks:
                    with torch.no_grad():
                        q_I, w_I, keys, _, token_keys = index
                        keys = self.indexer.block_keys(keys) if token_keys else keys
                        scores = self.indexer.scores(q_I, w_I, keys)  # [B, H_kv, 1, N_b]
                # nsa.sel_distance_cap: the step's gathered keys un-rotated by their positions' tables
                cap = None if capped is None else (*capped[:2], self.cap_rope)
                return decode_branches(q, ck, cv, sel_k, sel_v, win_k, win_v, t0, c, scores, cap, picks)
        # one custom op per stage (nsa/attention/ops.py): a constant number of launches per layer
        with nvtx_range("nsa.compressed"):
            # [B, H, T, hd], and its log-sum-exps [B, H, T]: selection's scores share its softmax (Eq. 8)
            o_cmp, cmp_lse = ops.compressed_attention(q, ck, cv, t0, c.l, c.d, c.q_chunk, c.kernel, return_lse=True)
        qg = q.view(B, self.n_kv_heads, self.n_groups, T, self.head_dim)  # [B, H_kv, G, T, hd]
        with nvtx_range("nsa.select"):
            if picks is not None:  # an earlier indexer layer's
                block_idx = picks
            elif indexer_picks:  # [B, H_kv, T, n] by the indexer's scores (one op; no [T, N_b] scores on the Triton path)
                block_idx = ops.indexer_picks(*index[:3], t0, c.l_sel, c.n_sel, self.indexer.pool == "scores",
                                              c.kernel, token_keys=index[4])
            else:
                block_idx = ops.select_blocks(qg, ck, t0, c.l, c.d, c.l_sel, c.n_sel, c.q_chunk, c.kernel,
                                              lse=cmp_lse.view(B, self.n_kv_heads, self.n_groups, T))
            if index is not None and t0 == 0 and torch.is_grad_enabled() and c.indexer_kl > 0:
                self._indexer_term(index[3], qg, ck, sel_k, cmp_lse.view(B, self.n_kv_heads, self.n_groups, T),
                                   -(-T // c.l_sel), capped=capped)
        with nvtx_range("nsa.selected"):
            if capped is not None:
                o_sel = self._capped_selected(qg, sel_k, sel_v, block_idx, capped, q_start=t0)
            else:
                o_sel = ops.selected_attention(qg, sel_k, sel_v, block_idx, t0, c.l_sel, c.sel_tile, kernel=c.kernel,
                                               chunk=c.sel_chunk)
                o_sel = o_sel.view(B, self.n_heads, T, self.head_dim)
        with nvtx_range("nsa.window"):
            o_win = ops.window_attention(q, win_k, win_v, t0, t_end - win_k.shape[2], c.w, c.win_block, c.kernel)
        return o_cmp, o_sel, o_win, block_idx

    def _selection_record(self, q, sel_k, block_idx, q_pos, k_base=None):
        """With statistics on: what the forward records of its selection (device tensors, no host sync):
        (selection stats, sel_outside_window, recall sample). q [B, H, Tq, hd], sel_k [B, H_kv, Tk, hd],
        block_idx [B, H_kv, Tq, n], q_pos [Tq] or [B, Tq] (positions in the document), k_base None or [B, Tq]."""
        c = self.cfg
        stats = {**selection_statistics(selection_counts(block_idx, 0, c.l_sel, q_pos=q_pos)),
                 **outside_window_share(outside_window_counts(block_idx, q_pos, c.l_sel, c.w))}
        return stats, recall_sample(q, sel_k, block_idx, q_pos, k_base)

    def _combine(self, x, o_cmp, o_sel, o_win, block_idx, record, return_indices: bool, g=None):
        """Gate the branch outputs (each [B, H, T, hd]) and project: -> y [B, T, dim] (and block_idx).
        record: _selection_record's (stats, sample) when statistics are on, else None. g: the gates [B, T, H, 3]
        where the caller has them (the static decoder: gates_from), else computed from x."""
        B, T, _ = x.shape
        g = self.gates(x) if g is None else g  # [B, T, H, 3]
        y = ops.gated_combine(g, o_cmp, o_sel, o_win, self.cfg.kernel)  # [B, T, H, hd]
        y = self.dropout(self.proj(y.view(B, T, -1)))
        if record is not None:
            selection, self.last_sample = record
            self.last_stats = {**gate_statistics(g), **selection, **gate_means(g)}
            if self.indexer is not None and self.indexer_loss is not None:  # the indexer's KL to its target
                self.last_stats["indexer_kl"] = self.last_indexer_kl
        return (y, block_idx) if return_indices else y

    def _forward_documents(self, x, rope, documents: Documents, return_indices: bool, picks=None):
        """Training / prefill of packed documents: every branch reads only the query's own document,
        counted from its first token (nsa/attention/documents.py), so a packed window computes what each
        document computes alone. Compressed tokens are formed per document (CompressedLayout's slots)."""
        c = self.cfg
        B, T, _ = x.shape
        q, br = self.project(x, rope)
        layout = documents.compressed(c.l, c.d)  # computed once per batch, shared by the layers
        frame = layout.frame  # [3, B, T]
        raw_k, raw_v = br["cmp"]
        ck, cv = self._compress(raw_k, raw_v, 0, layout.block_start.shape[1], layout)  # [B, H_kv, T // d, hd]
        if rope is not None:  # rotate each compressed key at the last position of its block: the rope tables' rows
            ck = ops.rotary(ck, *rope, c.kernel, at=layout.block_end)  # at [B, C] (per-row, document positions)
        with nvtx_range("nsa.compressed"):
            o_cmp, cmp_lse = ops.compressed_attention(q, ck, cv, 0, c.l, c.d, c.q_chunk, c.kernel, frame=frame,
                                                      return_lse=True)
        qg = q.view(B, self.n_kv_heads, self.n_groups, T, self.head_dim)  # [B, H_kv, G, T, hd]
        cmp_lse = cmp_lse.view(B, self.n_kv_heads, self.n_groups, T)
        sel_k, sel_v = br["sel"]
        capped = self._distance_cap(rope, x.device)
        with nvtx_range("nsa.select"):
            if picks is not None:  # an earlier indexer layer's (document-relative, as every layer's)
                block_idx = picks
            elif self.indexer is None:
                block_idx = ops.select_blocks(qg, ck, 0, c.l, c.d, c.l_sel, c.n_sel, c.q_chunk, c.kernel, frame=frame,
                                              lse=cmp_lse)
            else:
                block_idx = self._index_documents(x, qg, ck, sel_k, frame, cmp_lse, capped, documents)
        self._pass_on(block_idx, picks)
        with nvtx_range("nsa.selected"):
            if capped is not None:
                o_sel = self._capped_selected(qg, sel_k, sel_v, block_idx, capped, frame)
            else:
                o_sel = ops.selected_attention(qg, sel_k, sel_v, block_idx, 0, c.l_sel, c.sel_tile, kernel=c.kernel,
                                               chunk=c.sel_chunk, frame=frame).view(B, self.n_heads, T, self.head_dim)
        win_k, win_v = br["win"]
        with nvtx_range("nsa.window"):
            o_win = ops.window_attention(q, win_k, win_v, 0, 0, c.w, c.win_block, c.kernel, frame=frame)
        record = self._selection_record(q, sel_k, block_idx, frame[0], frame[1]) if self.stats_enabled else None
        return self._combine(x, o_cmp, o_sel, o_win, block_idx, record, return_indices)

    @torch.no_grad()
    def indexer_target(self, qg, ck, sel_k, n_blocks: int, frame=None, capped=None, lse=None,
                       all_rows: bool = False) -> torch.Tensor:
        """The indexer's KL target (nsa.indexer_target; nsa/attention/indexer.py) for the KL's rows (kl_row_indices: the
        queries at r * T // R) of a forward from position 0: qg [B, H_kv, G, T, hd] the queries, ck [B, H_kv, N_c, hd]
        the compressed keys, sel_k [B, H_kv, T, hd] the selected branch's keys; frame [3, B, T] with packed documents
        (blocks document-relative); capped: _distance_cap's, when the selected branch reads far keys at the cap (the
        dense target reads them so too); lse [B, H_kv, G, T] the compressed branch's log-sum-exps (shared by the
        compressed target's kernel); all_rows: every query's target (R = T; probes), not the KL's rows.
        -> [B, H_kv, R, N_b] (N_b = n_blocks, or the compressed target's own count with documents)."""
        c = self.cfg
        T = qg.shape[3]
        R = T if all_rows else kl_row_count(T)
        if c.indexer_target == "compressed" and frame is None:  # one op (the rows read in place on the Triton path)
            return ops.pooled_mass_rows(qg, ck, R, c.l, c.d, c.l_sel, n_blocks, c.kernel, lse=lse)
        if c.indexer_target == "dense" and frame is None and capped is None:  # one op (no [R, T] scores on Triton)
            return ops.dense_mass_rows(qg, sel_k, R, c.l_sel, n_blocks, c.kernel)
        rows = kl_row_indices(T, R, qg.device)  # [R]
        q_rows = qg[:, :, :, rows]
        if c.indexer_target == "dense":
            far = None
            if capped is not None:
                cap, at_cap, rope = capped
                far = (capped_queries(q_rows, rope, at_cap, rows), unrotated(sel_k, rope), cap)
            return dense_block_mass(q_rows, sel_k, rows, c.l_sel, n_blocks,
                                    base=None if frame is None else frame[1][:, rows], far=far)
        return document_block_scores(q_rows, ck, c.l, c.d, c.l_sel, frame[:, :, rows])

    def _index_documents(self, x, qg, ck, sel_k, frame, cmp_lse, capped=None, documents: Documents | None = None):
        """nsa.selector=indexer over packed documents: the indexer's scores over each query's own document's blocks
        pick them (pooled scores during the warm-up, sharing the compressed branch's log-sum-exps cmp_lse
        [B, H_kv, G, T]), and a training forward leaves the KL to its target per document block (nsa.indexer_target;
        sel_k [B, H_kv, T, hd] the selected branch's keys, for the dense one) in self.indexer_loss.
        -> block_idx [B, H_kv, T, n], document-relative."""
        c = self.cfg
        T = x.shape[1]
        n_blocks = document_block_count(ck.shape[2], T, c.l, c.d, c.l_sel)
        per_token = self.indexer.pool == "scores"
        q_I, w_I, k_I, out = self.indexer.project(x.detach())  # the language-model loss never moves the indexer
        if self.indexer_selects:  # one op (the Triton path: one launch, every document of the window at once)
            block_idx = ops.indexer_picks(q_I, w_I, k_I, 0, c.l_sel, c.n_sel, per_token, c.kernel, token_keys=True,
                                          frame=frame)
        else:
            block_idx = ops.select_blocks(qg, ck, 0, c.l, c.d, c.l_sel, c.n_sel, c.q_chunk, c.kernel, frame=frame,
                                          lse=cmp_lse)
        if torch.is_grad_enabled() and c.indexer_kl > 0:
            counted = shared_counted_rows(documents, frame, c.l_sel) if documents is not None else None
            self._indexer_term(out, qg, ck, sel_k, cmp_lse, n_blocks, frame, capped, counted)
        return block_idx

    def _indexer_term(self, out, qg, ck, sel_k, lse, n_blocks: int, frame=None, capped=None, counted=None) -> None:
        """A training forward's KL of the indexer to its target (nsa.indexer_target) -> self.indexer_loss: weight * KL
        over the KL's rows (every query up to KL_ROWS, else evenly spaced ones) as per-row terms [B, H_kv, R], scored
        from the projection output out [B, T, P] (one op each way; with packed documents, frame [3, B, T], each row
        over its own document, counted: impl/index_scores.counted_kl_rows). The target is computed in the KL's own
        launch on the Triton path (from qg, ck and the compressed branch's log-sum-exps lse [B, H_kv, G, T], or qg
        and sel_k), or, with the selected branch's distance capped, by torch ops (the dense target reading far keys
        at the cap)."""
        c = self.cfg
        target, source = None, None
        if capped is not None:
            target = self.indexer_target(qg, ck, sel_k, n_blocks, frame, capped=capped, lse=lse)
        elif c.indexer_target == "compressed":
            source = ("compressed", qg, ck, lse, c.l, c.d)
        else:
            source = ("dense", qg, sel_k)
        self.indexer_loss = ops.indexer_kl(out, target, self.n_kv_heads, c.indexer_heads, c.indexer_dim,
                                           kl_row_count(qg.shape[3]), c.l_sel, self.indexer.pool == "scores",
                                           c.indexer_kl, c.kernel, source=source, frame=frame, counted=counted)

    def _forward_window(self, x, rope, cache: NSACache | None, documents: Documents | None, return_indices: bool):
        """nsa.gates=window: the sliding-window branch alone, projected (the gates pinned to WINDOW_GATES, so
        nothing is mixed). x [B, T, dim] -> y [B, T, dim]; with packed documents the window stops at the
        document's first token; with a cache x's tokens are appended to its window ring."""
        c = self.cfg
        B, T, _ = x.shape
        q, br = self.project(x, rope)  # q [B, H, T, hd]
        win_k, win_v = br["win"]  # [B, H_kv, T, hd]
        t0, frame = 0, None  # t0: absolute position of x[:, 0]
        if documents is not None:  # the frame is built once per batch and shared by the layers; the window reads
            frame = documents.compressed(c.l, c.d).frame  # its q_pos and k_base rows: [3, B, T]
        elif cache is not None:
            t0 = cache.t
            win_k, win_v = cache.window(win_k, win_v)  # T = 1: the last min(w, t) keys; else the w-1 before x and x's
            cache.t = t0 + T
        with nvtx_range("nsa.window"):
            if T == 1 and frame is None:  # one query: every key of its window is visible, no mask
                o_win = decode_window(q, win_k, win_v)
            else:
                o_win = ops.window_attention(q, win_k, win_v, t0, t0 + T - win_k.shape[2], c.w, c.win_block, c.kernel,
                                             frame=frame)  # [B, H, T, hd]
        y = self.dropout(self.proj(o_win.transpose(1, 2).reshape(B, T, -1)))
        if self.stats_enabled:  # the pinned gates' shares and means (0, 0, 1); no selection: no recall sample, and
            g = self.gates(x)  # sel_outside_window NaN (selection_health reads it for every layer)
            nan = torch.full((), float("nan"), device=x.device)
            self.last_stats, self.last_sample = {**gate_shares(g), **gate_means(g), "sel_outside_window": nan}, None
        if not return_indices:
            return y
        return y, torch.full((B, self.n_kv_heads, T, c.n_sel), -1, dtype=torch.long, device=x.device)  # no blocks
