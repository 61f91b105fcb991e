"""What a compiled graph launches (nsa/launch_count.py `wrapper_launches`, read from inductor's generated wrapper) and
what NSA leaves to inductor under torch.compile (nsa/attention/ops.py left_to_inductor): RoPE and the gated sum
are torch ops in a compiled graph, for inductor to fuse with their neighbours, and custom ops in eager calls; the
attention branches stay custom ops in both. bench/bench_launches.py --compiled counts the whole decode step."""
from __future__ import annotations

import torch
from torch._inductor.utils import run_and_get_code

from nsa.attention import ops
from nsa.config import ModelConfig, NSAConfig
from nsa.launch_count import LaunchCounter, wrapper_launches
from nsa.layers import RotaryEmbedding
from nsa.model import build_attention


def test_the_wrapper_count_reads_inductors_kernels_library_calls_and_custom_ops():
    """A matmul (a library call), a pointwise op before and after a custom op (no fusion crosses it: two kernels),
    the custom op counted as what its body launches where given."""
    torch._dynamo.reset()
    cos, sin = RotaryEmbedding(8, 10000.0)(torch.arange(4))

    def f(x, w):  # x [1, 2, 4, 8], w [8, 8]
        h = torch.relu(x @ w) * 3.0
        return ops._rotary.op(h, cos, sin, False, "torch", None) + 1.0  # the custom op itself, as ops.rotary was

    x, w = torch.randn(1, 2, 4, 8), torch.randn(8, 8)
    out, codes = run_and_get_code(torch.compile(f, fullgraph=True), x, w)
    torch.testing.assert_close(out, f(x, w))
    assert len(codes) == 1
    assert wrapper_launches(codes[0]) == {"extern.mm": 1, "fused": 2, "nsa.rotary": 1}
    assert wrapper_launches(codes[0], {"nsa.rotary": 3.0}) == {"extern.mm": 1, "fused": 2, "nsa.rotary": 3.0}


def _graph_ops(fn, *args) -> set[str]:
    """The call_function targets of the graph Dynamo traces from fn(*args) (fullgraph), by name."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, fullgraph=True, backend=record)(*args)
    return {str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"}


def test_rope_and_the_gated_sum_are_torch_ops_when_compiled_and_custom_ops_eager():
    cfg = ModelConfig(dim=32, n_heads=4, n_kv_heads=2, head_dim=8, attention="nsa",
                      nsa=NSAConfig(l=8, d=4, l_sel=8, n_sel=3, w=8))
    torch.manual_seed(0)
    layer = build_attention(cfg)
    x = torch.randn(1, 32, 32)
    rope = RotaryEmbedding(8, 10000.0)(torch.arange(32))
    compiled = _graph_ops(layer, x, rope)
    assert not {name for name in compiled if name.startswith(("nsa.rotary", "nsa.gated_combine"))}, compiled
    assert {"nsa.selected_attention.default", "nsa.select_blocks.default"} <= compiled  # still custom ops
    with LaunchCounter() as eager:
        layer(x, rope)
    assert eager.by_op["nsa.rotary"] == 2 and eager.by_op["nsa.gated_combine"] == 1  # q and keys; compressed keys
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(layer, fullgraph=True, backend="aot_eager")(x, rope), layer(x, rope),
                                   rtol=1e-5, atol=1e-6)


def test_rope_compiled_is_the_same_rotation_without_a_concatenation():
    """apply_rotary under torch.compile (x * cos + roll(x, hd/2) * (-sin, sin), no cat: inductor realizes a cat as a
    buffer of its own, a kernel between the rotation and what reads it) equals the eager rotation: the same products
    and sums in the same order (negation is exact), so within a few ulps of the compute dtype, shared tables and
    per-row tables (packed documents) alike; its graph holds no cat."""
    from nsa.layers import apply_rotary

    g = torch.Generator().manual_seed(0)
    rope = RotaryEmbedding(16, 10000.0)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        x = torch.randn(2, 3, 5, 16, generator=g).to(dtype)
        for cos, sin in (rope(torch.arange(5)), rope(torch.tensor([[0, 1, 2, 0, 1], [3, 4, 0, 1, 2]]))):
            eager = apply_rotary(x, cos, sin)
            compiled = torch.compile(apply_rotary, fullgraph=True, backend="aot_eager")(x, cos, sin)
            eps = torch.finfo(dtype).eps
            torch.testing.assert_close(compiled, eager, rtol=4 * eps, atol=4 * eps)
    cos, sin = rope(torch.arange(5))
    names = _graph_ops(apply_rotary, torch.randn(1, 2, 5, 16), cos, sin)
    assert "aten.cat" not in " ".join(names) and "<built-in method cat" not in " ".join(names), names
