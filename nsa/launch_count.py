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


def count_forward_backward(module: torch.nn.Module, x: torch.Tensor, *args) -> LaunchCounter:
    """Ops of module(x, *args) forward and backward (for a given output gradient, made outside the count),
    parameter gradients included."""
    x = x.detach().requires_grad_(True)
    with torch.no_grad():
        grad = module(x, *args)
    grad = torch.ones_like(grad)
    with LaunchCounter() as counter:
        module(x, *args).backward(grad)
    return counter


def attention_layer_launches(cfg, T: int, batch: int = 1) -> LaunchCounter:
    """One attention layer of `cfg` (a ModelConfig; dense or NSA), built on the meta device, forward and
    backward at sequence length T with RoPE."""
    from nsa.layers import RotaryEmbedding
    from nsa.model import build_attention

    with torch.device("meta"):
        layer = build_attention(cfg)
        rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)(torch.arange(T))
        x = torch.empty(batch, T, cfg.dim)
    return count_forward_backward(layer, x, rope)
