"""nsa.custom_op: eager calls run an op's body without the dispatcher, every other call goes through the custom op,
and the two give the same results.

The mechanism is read from the body's caller (nsa.custom_op's frames, or torch's custom-op wrapper); the equivalence
is bit for bit, as the same Python body, setup_context and backward run on both paths.
"""
from __future__ import annotations

import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nsa.attention.documents import Documents
from nsa.custom_op import custom_op
from tests.nsa._nsa_helpers import make_input, make_layer, rope_for

CALLERS: list[str] = []  # the module that called the probe's body, one entry a call
NEEDS: list[tuple] = []  # ctx.needs_input_grad as the probe's backward saw it


@custom_op("nsa_test::probe")
def _probe(x: torch.Tensor, scale: float, shift: float = 0.5) -> torch.Tensor:
    """-> x * scale + shift: a default argument (the dispatcher drops it; setup_context sees it on both paths)."""
    CALLERS.append(sys._getframe(1).f_globals["__name__"])
    return x * scale + shift


@_probe.register_fake
def _(x, scale, shift=0.5):
    return torch.empty_like(x)


def _probe_setup(ctx, inputs, output):
    _, scale, shift = inputs
    ctx.scale = scale + 0 * shift


def _probe_backward(ctx, d_y):
    NEEDS.append(tuple(ctx.needs_input_grad))
    return d_y * ctx.scale, None, None


_probe.register_autograd(_probe_backward, setup_context=_probe_setup)


@custom_op("nsa_test::probe_pair")
def _probe_pair(x: torch.Tensor, scale: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """-> x * scale and [x * x, x + 1]: a list output (as nsa::selected_attention's)."""
    CALLERS.append(sys._getframe(1).f_globals["__name__"])
    return x * scale, [x * x, x + 1]


@_probe_pair.register_fake
def _(x, scale):
    return torch.empty_like(x), [torch.empty_like(x), torch.empty_like(x)]


def _pair_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.scale = inputs[1]
    ctx.set_materialize_grads(False)


def _pair_backward(ctx, d_y, d_list):
    NEEDS.append(tuple(ctx.needs_input_grad))
    (x,) = ctx.saved_tensors
    parts = [d_y * ctx.scale if d_y is not None else None, d_list[0] * 2 * x if d_list[0] is not None else None,
             d_list[1]]
    parts = [p for p in parts if p is not None]
    return (sum(parts[1:], parts[0]) if parts else None), None


_probe_pair.register_autograd(_pair_backward, setup_context=_pair_setup)


@custom_op("nsa_test::probe_list")
def _probe_list(x: torch.Tensor, extra: list[torch.Tensor]) -> torch.Tensor:
    """-> x + the sum of extra's tensors: a list input (no autograd formula)."""
    CALLERS.append(sys._getframe(1).f_globals["__name__"])
    return x + sum(extra)


@_probe_list.register_fake
def _(x, extra):
    return torch.empty_like(x)


class _Through(TorchDispatchMode):
    """Every op dispatched as it is: what a counter or a tracer in a TorchDispatchMode does to the path taken."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _direct(caller: str) -> bool:
    return caller == "nsa.custom_op"


@pytest.mark.parametrize("grad", [True, False])
def test_an_eager_call_runs_the_body_directly(grad):
    CALLERS.clear()
    x = torch.randn(5, dtype=torch.float64, requires_grad=grad)
    y = _probe(x, 3.0)
    s, (sq, inc) = _probe_pair(x, 2.0)
    assert [_direct(c) for c in CALLERS] == [True, True]
    assert torch.equal(y, x * 3.0 + 0.5) and torch.equal(s, x * 2.0)
    assert torch.equal(sq, x * x) and torch.equal(inc, x + 1)
    assert y.requires_grad == s.requires_grad == sq.requires_grad == inc.requires_grad == grad
    if grad:
        NEEDS.clear()
        y.sum().backward()
        assert NEEDS == [(True, False, False)]  # the op's own three arguments, the default filled in
        torch.testing.assert_close(x.grad, torch.full_like(x, 3.0), rtol=0, atol=0)


def test_modes_compiling_meta_and_keywords_go_through_the_custom_op():
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    CALLERS.clear()
    with _Through():
        _probe(x, 3.0)
    _probe(x, 3.0, shift=0.5)  # keyword arguments: the dispatcher's binding
    assert CALLERS and not any(_direct(c) for c in CALLERS)
    CALLERS.clear()
    out = _probe(torch.randn(5, device="meta"), 3.0)  # the fake implementation: no body runs
    assert out.device.type == "meta" and CALLERS == []
    compiled = torch.compile(lambda t: _probe(t, 3.0), backend="eager", fullgraph=True)
    CALLERS.clear()
    torch.testing.assert_close(compiled(x.detach()), x.detach() * 3.0 + 0.5, rtol=0, atol=0)
    assert CALLERS and not any(_direct(c) for c in CALLERS)


def test_a_list_input_that_needs_a_gradient_goes_through_the_custom_op():
    x = torch.randn(5, dtype=torch.float64)
    e = torch.randn(5, dtype=torch.float64, requires_grad=True)
    CALLERS.clear()
    with torch.no_grad():
        assert torch.equal(_probe_list(x, [e]), x + e.detach())
    assert _direct(CALLERS[-1])
    _probe_list(x, [e])
    assert not _direct(CALLERS[-1])


def test_the_direct_path_differentiates_as_the_custom_op_does():
    """Gradients through the list output and the tensor output, an unused one left None (set_materialize_grads),
    ctx.needs_input_grad over the op's own arguments; gradcheck against finite differences."""
    x = torch.randn(6, dtype=torch.float64, requires_grad=True)
    grads, NEEDS[:] = [], []
    for through in (False, True):
        CALLERS.clear()
        with _Through() if through else torch.autograd.set_grad_enabled(True):
            y, (sq, inc) = _probe_pair(x, 3.0)
            g_all, = torch.autograd.grad((y * y).sum() + (sq * inc).sum(), x, retain_graph=True)
            g_sq, = torch.autograd.grad(sq.sum(), x)  # y and inc unused: their gradients stay None
        assert _direct(CALLERS[0]) != through
        grads.append((g_all, g_sq))
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    torch.testing.assert_close(grads[0][1], 2 * x.detach(), rtol=0, atol=0)
    assert NEEDS == [(True, False)] * 4

    def f(t):
        y, (sq, inc) = _probe_pair(t, 3.0)
        return y * sq + inc + _probe(t, 2.0)

    assert torch.autograd.gradcheck(f, (x,))


def _layer_run(kernel: str, documents: bool, through: bool):
    layer = make_layer(nsa_overrides={"kernel": kernel})
    B, T = 2, 40
    x = make_input(B, T).requires_grad_(True)
    docs = None
    if documents:  # two documents in row 0, one in row 1
        ids = torch.ones(B, T, dtype=torch.long)
        ids[0, 17] = 0
        docs = Documents.from_tokens(ids, eos_id=0)
    with _Through() if through else torch.autograd.set_grad_enabled(True):
        y = layer(x, rope_for(T), documents=docs)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(2), dtype=y.dtype))
    return [y.detach(), x.grad] + [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("documents", [False, True], ids=["one_document", "packed"])
@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_the_layer_gives_the_custom_ops_results_bit_for_bit(kernel, documents):
    """Every nsa op of an NSA layer forward and backward, on the torch path and on the Triton kernels (the
    interpreter; the selected attention's op returns a list), without and with packed documents."""
    if kernel == "triton":
        pytest.importorskip("triton")
    direct, dispatched = (_layer_run(kernel, documents, through) for through in (False, True))
    assert len(direct) == len(dispatched)
    for i, (a, b) in enumerate(zip(direct, dispatched)):
        assert (a is None) == (b is None), i
        assert a is None or torch.equal(a, b), i
