"""Count the ops one forward + backward dispatches: on CUDA each is at least one kernel launch.

Run on the meta device (shapes only, nothing computed), so a CPU machine measures the launch structure a
GPU will see. Not counted: views (`OpOverload.is_view`), `detach`, `alias` and `empty*` allocations
(they launch nothing). A custom op (nsa::*) counts once: its implementation is one fused kernel (or, on
CPU, a loop the GPU path does not have).
"""
from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_FREE = {"detach", "alias", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


def launches(func) -> bool:
    """Whether an ATen / custom op overload counts as a launch."""
    return not (func.is_view or func.overloadpacket.__name__ in _FREE)


class LaunchCounter(TorchDispatchMode):
    """`with LaunchCounter() as c: ...` then c.total and c.by_op (op name -> count)."""

    def __init__(self):
        super().__init__()
        self.by_op: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if launches(func):
            self.by_op[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.by_op.values())


def count_forward_backward(module, x: torch.Tensor, *args) -> LaunchCounter:
    """Ops of module(x, *args) forward and backward (for a given output gradient, made outside the count),
    parameter gradients included."""
    x = x.detach().requires_grad_(True)
    with torch.no_grad():
        grad = module(x, *args)
    grad = torch.ones_like(grad)
    with LaunchCounter() as counter:
        module(x, *args).backward(grad)
    return counter


def packed_starts(batch: int, T: int, n_documents: int, seed: int = 0) -> torch.Tensor:
    """[batch, T] document starts (nsa.attention.documents) of n_documents of uneven lengths per window."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        opens = torch.zeros(T, dtype=torch.bool)
        opens[torch.randperm(T - 1, generator=g)[: n_documents - 1] + 1] = True
        opens[0] = True
        rows.append(torch.where(opens, torch.arange(T), 0).cummax(0).values)
    return torch.stack(rows)


def attention_layer_launches(cfg, T: int, batch: int = 1, documents: int = 0, device: str = "meta") -> LaunchCounter:
    """One attention layer of `cfg` (a ModelConfig; dense or NSA), forward and backward at sequence length T
    with RoPE, built on `device` (meta: shapes only). documents > 0: a packed window of that many documents
    (document masking; on the meta device their count cannot change anything: use device="cpu" to show it)."""
    from nsa.attention.documents import Documents
    from nsa.layers import RotaryEmbedding
    from nsa.model import build_attention

    starts = packed_starts(batch, T, documents) if documents else None
    with torch.device(device):
        layer = build_attention(cfg)
        x = torch.randn(batch, T, cfg.dim) if device != "meta" else torch.empty(batch, T, cfg.dim)
        docs = Documents(starts.to(device)) if starts is not None else None
        if docs is not None and cfg.attention == "nsa":  # built once per batch for all layers: not the layer's
            docs.compressed(cfg.nsa.l, cfg.nsa.d)
        positions = docs.positions if docs is not None else torch.arange(T)
        rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)(positions)
    if docs is None:
        return count_forward_backward(layer, x, rope)
    return count_forward_backward(lambda x_, rope_: layer(x_, rope_, documents=docs), x, rope)
