"""Shared set-up for the NSA tests: a small float64 configuration and helpers.

NSA_TEST_DEVICE=cuda runs the suite on a GPU (scripts/run_gpu_causality_test.sh sets it).
"""
from __future__ import annotations

import os

import torch

from nsa.attention.nsa import NativeSparseAttention
from nsa.config import ModelConfig, NSAConfig
from nsa.layers import RotaryEmbedding

DEVICE = torch.device(os.environ.get("NSA_TEST_DEVICE", "cpu"))
T_VALUES = (1, 7, 8, 9, 15, 16, 17, 31, 33, 64, 100)
L, D, L_SEL, N_SEL, W = 8, 4, 16, 4, 16  # small NSA: l, d, l', n, w
DIM, HEADS, KV_HEADS, HEAD_DIM = 64, 8, 2, 16


def small_cfg(nsa_overrides: dict | None = None, **overrides) -> ModelConfig:
    nsa = dict(l=L, d=D, l_sel=L_SEL, n_sel=N_SEL, w=W, q_chunk=8, sel_chunk=32, sel_tile=4, win_block=8, gate_hidden=16)
    nsa.update(nsa_overrides or {})
    base = dict(dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM, attention="nsa", nsa=NSAConfig(**nsa))
    base.update(overrides)
    return ModelConfig(**base)


def make_layer(seed: int = 0, nsa_overrides: dict | None = None, **overrides) -> NativeSparseAttention:
    torch.manual_seed(seed)
    return NativeSparseAttention(small_cfg(nsa_overrides, **overrides)).double().to(DEVICE)


def make_input(B: int, T: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, DIM, generator=g, dtype=torch.float64).to(DEVICE)


def rope_for(T: int, start: int = 0, head_dim: int = HEAD_DIM):
    return RotaryEmbedding(head_dim, 10000.0).to(DEVICE)(torch.arange(start, start + T, device=DEVICE))


def sorted_blocks(idx: torch.Tensor) -> torch.Tensor:
    """Selected blocks ascending with the -1 padding last (the reference's layout)."""
    big = torch.iinfo(idx.dtype).max
    s = torch.where(idx < 0, big, idx).sort(dim=-1).values
    return torch.where(s == big, -1, s)


@torch.no_grad()
def decode_last_with_stats(layer: NativeSparseAttention, x: torch.Tensor, rope) -> torch.Tensor:
    """Prefill x[:, :-1] into a cache, then decode the last token with statistics on: -> its blocks [B, H_kv, 1, n]."""
    T = x.shape[1]
    cache = layer.new_cache()
    layer(x[:, : T - 1], (rope[0][: T - 1], rope[1][: T - 1]), cache)
    layer.stats_enabled = True
    _, idx = layer(x[:, T - 1 :], (rope[0][T - 1 :], rope[1][T - 1 :]), cache, return_indices=True)
    return idx


@torch.no_grad()
def decode_in_pieces(model, ids: torch.Tensor, first: int = 21, steps_from: int = 40) -> torch.Tensor:
    """A Transformer over ids [B, T] with its caches: prefill ids[:, :first], then ids[:, first:steps_from] (a chunk
    from a later position), then one token a step -> logits [B, T, V], to compare with one full forward."""
    caches = model.new_caches()
    outs = [model(ids[:, :first], start_pos=0, caches=caches),
            model(ids[:, first:steps_from], start_pos=first, caches=caches)]
    outs += [model(ids[:, t:t + 1], start_pos=t, caches=caches) for t in range(steps_from, ids.shape[1])]
    return torch.cat(outs, 1)


def distinct_ids(rows: int, T: int, vocab: int, seed: int, low: int = 1) -> torch.Tensor:
    """[rows, T] token ids from low .. vocab - 1 with no repeat in a row. A learned indexer's first-layer keys carry
    no position, so a repeated token gives two blocks the same score bit for bit: a tie that two code paths (a
    one-token matmul in decode, a whole-sequence one in prefill) may break apart by a rounding step, differently on
    different CPUs. Tests that compare the two use distinct tokens."""
    assert T <= vocab - low, (T, vocab, low)
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(vocab - low, generator=g)[:T] + low for _ in range(rows)])


def starts_of(rows: list[list[int]], eos: int = 0) -> torch.Tensor:
    """Document lengths per row -> Documents.start [B, T] through the EOS rule (EOS opens a document)."""
    from nsa.attention.documents import document_starts

    idx = torch.ones(len(rows), sum(rows[0]), dtype=torch.long)
    for b, lengths in enumerate(rows):
        assert sum(lengths) == idx.shape[1]
        for s in torch.tensor(lengths).cumsum(0)[:-1].tolist():
            idx[b, s] = eos
    return document_starts(idx, eos)


KERNEL_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # compiled on CUDA, the interpreter elsewhere


def kernels_unavailable(module_name: str) -> str | None:
    """Why the Triton kernels of nsa.attention.kernels.<module_name> cannot run on KERNEL_DEVICE here (triton missing,
    or on CPU its interpreter off), else None. For pytest.mark.skipif(reason := ..., reason=reason)."""
    import importlib

    try:
        module = importlib.import_module(f"nsa.attention.kernels.{module_name}")
    except ImportError as exc:
        return f"triton is not importable ({exc})"
    if KERNEL_DEVICE.type == "cpu" and not module.interpreter_active():
        return "Triton's interpreter is off (TRITON_INTERPRET=1 before the kernels are imported)"
    return None
