"""Custom ops that eager calls reach without the dispatcher: `custom_op` registers a torch.library custom op and
returns an `Op` that is called in its place.

A torch.library custom op's call goes through the dispatcher, a Python autograd kernel that re-dispatches below
autograd, a torch._dynamo.disable wrapper around the body and a pass that fills in default arguments. Measured on
this project's CPU (torch 2.13, a tiny rotary call with a gradient): ~145 µs a call, against ~55 µs for the body
alone and ~60 µs for the body under a plain autograd.Function. An NSA layer makes ~15 such calls forward and
backward, and a GPU's host path is what keeps the device waiting at 8k (docs/BENCHMARKS.md "Host time per layer").

`Op.__call__` runs the same Python body directly, under an autograd.Function made of the same setup_context and
backward where a gradient is needed, when nothing needs the dispatcher:
  - not compiling (torch.compiler.is_compiling(): Dynamo must see the op, a node with a fake implementation);
  - no TorchDispatchMode active (FakeTensorMode, make_fx / AOTAutograd tracing, FlopCounterMode, selective
    activation checkpointing, the op and launch counters of bench/ and the tests) and no functorch transform;
  - every tensor argument a plain torch.Tensor (or Parameter) on the CPU or a CUDA device (not meta, not a subclass
    such as DTensor or FakeTensor), none inside a list where a gradient is needed, and no keyword arguments.
Every other call goes to the custom op. The two run the same body, setup and backward, so their results are the
same bit for bit (tests/nsa/test_custom_op.py); the custom op itself (`Op.op`) is what torch.library.opcheck, the
meta device and torch.compile see.
"""
from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

_DEVICES = ("cpu", "cuda")
_PLAIN = (Tensor, torch.nn.Parameter)
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)
_always_dispatch = False  # set inside through_dispatcher()
REGISTRY: dict[str, Op] = {}  # "nsa::name" -> its Op (nsa/launch_count.py runs an op's body through it)


@contextlib.contextmanager
def through_dispatcher() -> Iterator[None]:
    """Inside the block every call goes through the custom op, as before the direct path: what the benchmarks time
    beside the direct calls (bench/bench_host.py, bench/gpu_nsa_speed.py)."""
    global _always_dispatch
    before, _always_dispatch = _always_dispatch, True
    try:
        yield
    finally:
        _always_dispatch = before


def _dispatcher_needed() -> bool:
    """Whether the state of this thread needs the dispatcher (see the module docstring)."""
    return (_always_dispatch or torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0
            or _functorch_active())


class _Direct(torch.autograd.Function):
    """An Op's body, setup_context and backward as an autograd.Function. Outputs that are lists of tensors are
    returned flat (autograd tracks tensors, not lists); `shape` (a list the call passes in) receives each output's
    list length (-1: a tensor), from which the call and the backward put them back together."""

    @staticmethod
    def forward(ctx, op: Op, shape: list, *args):
        out = op.fn(*args)
        op.setup_context(ctx, args, out)
        ctx.nsa_op = op
        if isinstance(out, tuple) and any(isinstance(o, list) for o in out):
            shape.extend(len(o) if isinstance(o, list) else -1 for o in out)
            out = tuple(t for o in out for t in (o if isinstance(o, list) else (o,)))
        ctx.nsa_shape = shape
        return out

    @staticmethod
    def backward(ctx, *grads):
        needs = ctx.needs_input_grad
        ctx.needs_input_grad = needs[2:]  # the op's own arguments, as its backward expects
        try:
            result = ctx.nsa_op.backward(ctx, *_regroup(grads, ctx.nsa_shape))
        finally:
            ctx.needs_input_grad = needs
        result = result if isinstance(result, tuple) else (result,)
        # a list argument's gradients: None here (the direct path takes no list whose tensors need a gradient)
        return (None, None, *(None if isinstance(r, list) else r for r in result))


def _regroup(flat: tuple, shape: list[int]) -> tuple:
    """Flat outputs (or their gradients) -> the op's structure: output i a list of shape[i] items where >= 0 (an
    empty shape: flat as it is)."""
    if not shape:
        return flat
    out, at = [], 0
    for n in shape:
        out.append(list(flat[at:at + n]) if n >= 0 else flat[at])
        at += n if n >= 0 else 1
    return tuple(out)


class Op:
    """A custom op (`op`, a torch.library CustomOpDef) and its Python body (`fn`), called directly where allowed."""

    def __init__(self, name: str, fn: Callable):
        self.op = torch.library.custom_op(name, mutates_args=())(fn)
        self.fn = fn
        REGISTRY[name] = self
        params = list(inspect.signature(fn).parameters.values())
        self._arity = len(params)
        self._defaults = tuple(p.default for p in params if p.default is not inspect.Parameter.empty)
        self.backward: Callable | None = None
        self.setup_context: Callable | None = None

    def register_fake(self, fake: Callable) -> Callable:
        return self.op.register_fake(fake)

    def register_autograd(self, backward: Callable, setup_context: Callable) -> None:
        self.op.register_autograd(backward, setup_context=setup_context)
        self.backward, self.setup_context = backward, setup_context

    def __call__(self, *args, **kwargs):
        if kwargs or _dispatcher_needed():
            return self.op(*args, **kwargs)
        grad = torch.is_grad_enabled()
        needs_grad = False
        for a in args:
            if isinstance(a, Tensor):
                if type(a) not in _PLAIN or a.device.type not in _DEVICES:
                    return self.op(*args)
                needs_grad |= a.requires_grad
            elif isinstance(a, list):
                for t in a:
                    if isinstance(t, Tensor) and (type(t) not in _PLAIN or t.device.type not in _DEVICES
                                                  or (grad and t.requires_grad)):
                        return self.op(*args)
        if len(args) < self._arity:  # the defaults, as the custom op's setup_context receives them
            missing = self._arity - len(args)
            if missing > len(self._defaults):  # a required argument left out: the custom op's error
                return self.op(*args)
            args = args + self._defaults[len(self._defaults) - missing:]
        if not (grad and needs_grad):
            return self.fn(*args)
        if self.backward is None:  # no autograd formula: the custom op's own handling
            return self.op(*args)
        shape: list[int] = []
        out = _Direct.apply(self, shape, *args)
        return _regroup(out, shape)


def custom_op(name: str) -> Callable[[Callable], Op]:
    """Decorator: `@custom_op("nsa::name")` over the op's body (typed as torch.library.custom_op requires; no
    argument mutated) -> an Op. Register its fake, and its autograd formula if it has one, on the Op."""
    return lambda fn: Op(name, fn)
