"""Decoder-only Transformer: GPT-2, LLaMA-2/3, Qwen3 and M7C (NSA) are configurations of this one model.

    tokens [B, T] -> embedding (+ learned positions) -> n_layers x Block -> final norm -> logits [B, T, V]
    Block: x + attn(norm(x)), then x + mlp(norm(x))   (pre-norm)
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from nsa.attention.documents import Documents
from nsa.config import ModelConfig
from nsa.layers import MLP, RotaryEmbedding, make_norm
from nsa.loss import linear_cross_entropy
from nsa.profiling import nvtx_range


def build_attention(cfg: ModelConfig, layer: int = 0) -> nn.Module:
    """The attention module of Block `layer`: NativeSparseAttention (attention: nsa) or DenseAttention. Every one
    takes (x [B, T, dim], rope, cache=None, documents=None) and returns [B, T, dim]."""
    if cfg.attention == "nsa":
        from nsa.attention.nsa import NativeSparseAttention

        return NativeSparseAttention(cfg, layer)
    from nsa.attention.dense import DenseAttention

    return DenseAttention(cfg)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = build_attention(cfg, layer)
        self.mlp_norm = make_norm(cfg)
        self.mlp = MLP(cfg)
        # nsa.indexer_every > 1: the attention takes the picks of the last indexer layer and says what it passes on
        self.shares_picks = cfg.attention == "nsa" and cfg.nsa.shares_picks

    def forward(self, x: torch.Tensor, rope=None, cache=None, documents: Documents | None = None,
                picks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [B, T, dim] -> (same, the picks [B, H_kv, T, n] the next layers reuse, or None). picks: those of the
        last indexer layer before this one (nsa.indexer_every > 1), else None."""
        with nvtx_range("attention"):
            if self.shares_picks:
                x = x + self.attn(self.attn_norm(x), rope, cache, documents=documents, picks=picks)
                picks = self.attn.picks_out
            else:
                x = x + self.attn(self.attn_norm(x), rope, cache, documents=documents)
        with nvtx_range("mlp"):
            return x + self.mlp(self.mlp_norm(x)), picks


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.dim) if cfg.pos_emb == "learned" else None
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scale, cfg.rope_scaling, cfg.max_seq_len) \
            if cfg.pos_emb == "rope" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, layer) for layer in range(cfg.n_layers))
        self.norm = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        # activation checkpointing: every k-th block (k=1: all blocks; 0: none). Set by the trainer.
        self.checkpoint_every = 0
        # document masking (data.document_mask): the EOS id that opens a document, or None (one text per
        # window). Set by whoever runs the model on packed data (trainer, evaluation); see `documents_of`.
        self.document_eos_id: int | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, init_std) weights, zero biases; residual output projections scaled by 1/sqrt(2L)."""
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if p.dim() < 2:
                if name.endswith(".bias"):
                    nn.init.zeros_(p)
                elif "norm" in name:
                    nn.init.ones_(p)
                continue  # other vectors (e.g. NSA position encodings) keep their module's own init
            is_residual_out = name.endswith(("attn.proj.weight", "mlp.w_out.weight"))
            nn.init.normal_(p, mean=0.0, std=std / math.sqrt(2 * self.cfg.n_layers) if is_residual_out else std)
        for module in self.modules():
            if module is not self and hasattr(module, "reset_extra_parameters"):
                module.reset_extra_parameters()

    def set_positions(self, rope_theta: float, rope_scale: float) -> None:
        """The RoPE base and linear interpolation from now on (a sequence-length stage: train short, then long);
        the weights are untouched. The model's cfg becomes a copy that says so (the run's config stays as given)."""
        if self.rope is None:
            raise ValueError("set_positions needs pos_emb=rope")
        device = self.rope.inv_freq.device
        self.rope = RotaryEmbedding(self.cfg.head_dim, rope_theta, rope_scale, self.cfg.rope_scaling,
                                    self.cfg.max_seq_len).to(device)
        self.cfg = dataclasses.replace(self.cfg, rope_theta=rope_theta, rope_scale=rope_scale)

    def set_window(self, w: int) -> None:
        """NSA's sliding window from now on (its other geometry and the weights unchanged); a dense model has none."""
        nsa = dataclasses.replace(self.cfg.nsa, w=w)
        nsa.validate()
        for blk in self.blocks:
            if hasattr(blk.attn, "branches"):  # an NSA layer reads its geometry from its cfg
                blk.attn.cfg = nsa
        self.cfg = dataclasses.replace(self.cfg, nsa=nsa)

    def set_indexer_selects(self, on: bool) -> None:
        """nsa.selector=indexer: whether the indexers pick the blocks (else pooled scores do, while the indexers
        learn: nsa.indexer_warmup_steps). The trainer sets it before every step from the step number."""
        for blk in self.blocks:
            if getattr(blk.attn, "indexer", None) is not None:
                blk.attn.indexer_selects = on

    def set_distance_cap_on(self, on: bool) -> None:
        """nsa.sel_distance_cap: whether the selected branches read far keys at the cap (else at their distance:
        nsa.sel_distance_cap_from_step's first steps). The trainer sets it before every step from the step number."""
        for blk in self.blocks:
            if getattr(blk.attn, "cap_rope", None) is not None:
                blk.attn.distance_cap_on = on

    def num_params(self, include_embeddings: bool = True) -> int:
        """Unique parameters (a tied head counts once). Without embeddings: no token/position tables."""
        n = sum(p.numel() for p in self.parameters())
        if not include_embeddings:
            n -= self.tok_emb.weight.numel()
            if self.pos_emb is not None:
                n -= self.pos_emb.weight.numel()
        return n

    def new_caches(self) -> list:
        """One decode cache per layer (dense: KV cache; NSA: per-branch caches)."""
        return [blk.attn.new_cache() if hasattr(blk.attn, "new_cache") else _dense_cache() for blk in self.blocks]

    def forward(
        self,
        idx: torch.Tensor,  # [B, T] int64 token ids
        targets: torch.Tensor | None = None,  # [B, T] int64 next-token ids
        start_pos: int = 0,  # absolute position of idx[:, 0] (decode / chunked prefill)
        caches: list | None = None,
        documents: Documents | None = None,  # packed documents of idx; default: documents_of(idx)
    ) -> torch.Tensor:
        """Mean cross-entropy if targets are given (-100: ignored), else logits [B, T, V] (float32)."""
        B, T = idx.shape
        if start_pos + T > self.cfg.max_seq_len and self.pos_emb is not None:
            raise ValueError(f"sequence end {start_pos + T} exceeds max_seq_len={self.cfg.max_seq_len}")
        if documents is None and caches is None and start_pos == 0:
            documents = self.documents_of(idx)
        x = self.tok_emb(idx)  # [B, T, dim]
        # [T]; with documents [B, T]: positions restart at 0 in every document (learned and RoPE alike)
        positions = torch.arange(start_pos, start_pos + T, device=idx.device) if documents is None else documents.positions
        if self.pos_emb is not None:
            x = x + self.pos_emb(positions)
        rope = self.rope(positions) if self.rope is not None else None  # cos, sin [T or B, T, hd/2]
        x = self.drop(x)
        indexed = [blk.attn for blk in self.blocks if getattr(blk.attn, "indexer", None) is not None]
        for attn in indexed:
            attn.indexer_loss = None  # set again by this forward's layers (a training forward from position 0)
        picks = None  # nsa.indexer_every > 1: the last indexer layer's picks, reused by the layers up to the next
        for i, blk in enumerate(self.blocks):
            cache = caches[i] if caches is not None else None
            k = self.checkpoint_every
            if k and self.training and cache is None and i % k == 0 and torch.is_grad_enabled():
                x, picks = checkpoint(blk, x, rope, None, documents, picks, use_reentrant=False)
            else:
                x, picks = blk(x, rope, cache, documents, picks)
        x = self.norm(x)  # [B, T, dim]
        if targets is None:
            return self.lm_head(x).float()  # [B, T, V]
        if self.cfg.loss_chunk == 0:  # full fp32 logits [B*T, V]
            logits = self.lm_head(x).float()
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        else:  # chunked: fp32 logits for loss_chunk rows at a time, never for all B*T (nsa/loss.py)
            loss = linear_cross_entropy(x.reshape(B * T, -1), self.lm_head.weight, targets.reshape(-1),
                                        self.cfg.loss_chunk)
        aux = [attn.indexer_loss for attn in indexed if attn.indexer_loss is not None]
        if aux:  # the indexers' KL terms: their gradient joins the loss's, their value does not (kl - kl is 0);
            kl = torch.cat([a.reshape(-1) for a in aux]).sum()  # every layer's per-row terms summed at once
            loss = loss + (kl - kl.detach())
        return loss


    def documents_of(self, idx: torch.Tensor) -> Documents | None:
        """The documents of a batch of packed windows idx [B, T] under this model's rule: EOS opens a
        document when document_eos_id is set (nsa/attention/documents.py), else None (one text per window)."""
        return None if self.document_eos_id is None else Documents.from_tokens(idx, self.document_eos_id)


def _dense_cache():
    from nsa.attention.dense import KVCache

    return KVCache()
