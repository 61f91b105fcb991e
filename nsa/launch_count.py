"""Count the kernels one forward + backward launches, on a CPU: the structure a GPU runs.

Two counts (`LaunchCounter`):
  ops        every ATen op dispatched, on the meta device (shapes only, nothing computed). A custom op (nsa::*)
             counts once, whatever it launches inside.
  launches   (`open_custom_ops=True`, real CPU tensors, nsa.kernel=triton under Triton's interpreter) the same,
             except that the custom ops in OPENED (RoPE, phi, selection, selected attention, the gated sum) are opened:
             the ATen ops their implementation dispatches and every Triton kernel they launch (a spy on the
             launcher) are counted instead of the op. That is the Triton path a CUDA run takes, kernel by kernel.
             The compressed and window branches run FlexAttention on CUDA (nsa/attention/impl/flex.py), which has
             no CPU backward: on a CPU they run the torch path's custom op, counted as one launch per direction
             (a compiled FlexAttention forward is one Triton kernel; its backward is counted on the GPU by
             bench/gpu_nsa_speed.py).
Host syncs (`LaunchCounter.syncs`): the ops that on a GPU make the host wait for the device (a value read back to
Python: `.item()`, `bool()`, `int()`; an output whose size depends on the data: nonzero, a boolean-mask index,
unique, repeat_interleave without output_size), recorded by name wherever they run, opened ops' bodies included. A
step with one cannot be captured as a CUDA graph, and it stalls the launch queue in eager mode.
Not counted, in both: views (`OpOverload.is_view`), `_unsafe_view` (a reshape's result that aliases nothing),
`detach`, `alias`, `empty*` allocations and `promote_types` (a dtype computation): none launches a kernel.
"""
from __future__ import annotations

import contextlib
import re
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_FREE = {"detach", "alias", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view",
         "promote_types"}
TRITON = "triton."  # prefix of a Triton kernel's entry in LaunchCounter.by_op


def launches(func) -> bool:
    """Whether an ATen / custom op overload counts as a launch (`aten.to`, declared aliasing, is _converted's)."""
    return not (func.is_view or func.overloadpacket.__name__ in _FREE)


def _converted(func, args, out) -> bool:
    """aten.to that converted (a dtype or device change: a copy kernel), not the alias it returns when nothing
    changes; its schema says it may alias its input, so `launches` alone would call every .to() free."""
    return (func.overloadpacket.__name__ == "to" and isinstance(out, torch.Tensor) and isinstance(args[0], torch.Tensor)
            and out is not args[0])


# ops whose result the host must wait for on a GPU (a scalar read back, or an output size that depends on the data)
SYNCING = frozenset({"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten._unique", "aten._unique2",
                     "aten.unique_dim", "aten.unique_consecutive", "aten.unique_dim_consecutive", "aten.equal",
                     "aten.is_nonzero", "aten.bincount"})


def _syncs(func, args, kwargs) -> bool:
    """Whether this dispatched op waits for the device on a GPU (SYNCING, a boolean-mask index or index_put, a
    repeat_interleave by a tensor of counts without output_size)."""
    name = str(func.overloadpacket)
    if name in SYNCING:
        return True
    if name in ("aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"):
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ()))
    if name == "aten.repeat_interleave":
        repeats = args[1] if len(args) > 1 else args[0]
        return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
    return False


# the custom ops whose CUDA implementation is the one a CPU runs in Triton's interpreter (nsa.kernel=triton); the
# compressed and window branches' ops are the torch path, which CUDA replaces by FlexAttention: they stay closed
OPENED = ("nsa::rotary", "nsa::compress_blocks", "nsa::compress_blocks_backward", "nsa::gated_combine",
          "nsa::gated_combine_backward", "nsa::select_blocks", "nsa::indexer_picks", "nsa::pooled_mass_rows",
          "nsa::dense_mass_rows", "nsa::indexer_kl", "nsa::indexer_kl_backward", "nsa::selected_attention",
          "nsa::selected_attention_backward", "nsa::decode_branches")


def _custom_op_body(func):
    """The Python implementation of an OPENED custom op (what its CPU kernel runs), or None for other ops."""
    from nsa.custom_op import REGISTRY

    name = func.name().split(".")[0]  # "nsa::selected_attention"
    return REGISTRY[name].fn if name in OPENED else None


def triton_launch_points() -> dict[str, tuple[type, str]]:
    """{"compiled": ..., "interpreted": ...}: the (class, method) through which every Triton kernel launch passes. A
    compiled kernel's is `JITFunction.run`; in Triton's interpreter it is `GridExecutor.__call__`, which
    `kernel[grid](...)` reaches in every Triton from 3.5 (3.5's `InterpretedFunction.run` is a per-instance closure
    that `__getitem__` bypasses; 3.6 and 3.9 go through a class-level `run`). Each instance holds the kernel's Python
    function as `.fn`. Empty without Triton."""
    try:
        from triton.runtime import interpreter, jit
    except ImportError:  # no Triton: nothing can launch a Triton kernel
        return {}
    return {"compiled": (jit.JITFunction, "run"), "interpreted": (interpreter.GridExecutor, "__call__")}


@contextlib.contextmanager
def _triton_launch_spy(counter: "LaunchCounter"):
    """Inside the block, every Triton kernel launch (compiled or interpreted) is recorded in `counter`, and nothing
    the launch itself dispatches (the interpreter's host copies: no kernel on a GPU) is."""
    patched = [(cls, name, getattr(cls, name)) for cls, name in triton_launch_points().values()]

    def spying(launch):
        def spy(self, *args, **kwargs):
            if kwargs.get("warmup"):
                return launch(self, *args, **kwargs)
            if not counter.paused:
                counter.by_op[TRITON + self.fn.__name__] += 1
            counter.paused += 1
            try:
                return launch(self, *args, **kwargs)
            finally:
                counter.paused -= 1
        return spy

    for cls, name, launch in patched:
        setattr(cls, name, spying(launch))
    try:
        yield
    finally:
        for cls, name, launch in patched:
            setattr(cls, name, launch)


class LaunchCounter(TorchDispatchMode):
    """`with LaunchCounter() as c: ...` then c.total and c.by_op (op name -> count; Triton kernels "triton.<name>"),
    and c.syncs (the host syncs among them, by name: SYNCING and `_syncs`).
    open_custom_ops: count what each nsa:: custom op dispatches and launches instead of the op (module docstring)."""

    def __init__(self, open_custom_ops: bool = False):
        super().__init__()
        self.by_op: Counter[str] = Counter()
        self.syncs: Counter[str] = Counter()
        self.open_custom_ops = open_custom_ops
        self.inside: Counter[str] = Counter()  # opened op ("nsa.name") -> the launches counted inside its calls
        self.opened_calls: Counter[str] = Counter()  # opened op -> its calls
        self.paused = 0  # > 0 while a Triton kernel runs (in the interpreter: host copies, not launches)
        self._spy = contextlib.ExitStack()

    def __enter__(self):
        if self.open_custom_ops:
            self._spy.enter_context(_triton_launch_spy(self))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._spy.close()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.open_custom_ops and (body := _custom_op_body(func)) is not None:
            name, before = str(func.overloadpacket), self.total
            with self:  # the body's own ops come back through this mode
                out = body(*args, **kwargs)
            self.inside[name] += self.total - before
            self.opened_calls[name] += 1
            return out
        out = func(*args, **kwargs)
        if not self.paused and _syncs(func, args, kwargs):
            self.syncs[str(func.overloadpacket)] += 1
        if not self.paused and (launches(func) or _converted(func, args, out)):
            self.by_op[str(func.overloadpacket)] += 1
        return out

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    @property
    def triton(self) -> int:
        """Triton kernel launches among the total."""
        return sum(n for name, n in self.by_op.items() if name.startswith(TRITON))

    def per_call(self) -> dict[str, float]:
        """Opened op ("nsa.name") -> the launches one of its calls made (the mean over its calls)."""
        return {name: self.inside[name] / calls for name, calls in self.opened_calls.items()}


# one launch in the `call` function of the Python wrapper inductor generates for a compiled graph: a kernel it generated
# (C++ `cpp_fused_*` on a CPU, `triton_*.run` on a GPU), a library call (`extern_kernels.mm`), a fallback ATen op or a
# custom op (`torch.ops.<namespace>.<op>.<overload>`); the wrapper's other lines allocate, view or assert
_WRAPPER_LAUNCH = re.compile(r"^\s+(?:\w+ = )?(?P<call>cpp_fused_\w+|triton_\w+(?=\.run\()|extern_kernels\.\w+|"
                             r"torch\.ops\.\w+\.\w+)(?:\.\w+)?\(", re.M)


def wrapper_launches(code: str, per_call: dict[str, float] | None = None) -> Counter[str]:
    """Launches of one call of a compiled graph, read from its inductor wrapper's source (torch._inductor.utils.
    run_and_get_code): "fused" (kernels inductor generated), "extern.<name>", "aten.<name>" (fallbacks) and
    "nsa.<name>" (custom ops). A custom op counts as per_call["nsa.<name>"] launches where given (what its body
    launches: LaunchCounter.per_call of an eager run at the same shapes), else 1."""
    per_call = per_call or {}
    body = code[code.index("def call("):]
    end = re.search(r"^\S", body[body.index("\n"):], re.M)  # the next line that is not inside call()
    body = body[: body.index("\n") + end.start()] if end else body
    count: Counter[str] = Counter()
    for m in _WRAPPER_LAUNCH.finditer(body):
        call = m.group("call")
        if call.startswith(("cpp_fused_", "triton_")):
            count["fused"] += 1
        elif call.startswith("extern_kernels."):
            count["extern." + call.split(".", 1)[1]] += 1
        else:
            name = call[len("torch.ops."):]
            count[name] += per_call.get(name, 1)
    return count


def count_forward_backward(module, x: torch.Tensor, *args, open_custom_ops: bool = False, aux=None) -> LaunchCounter:
    """Ops of module(x, *args) forward and backward (for a given output gradient, made outside the count),
    parameter gradients included. aux: a function returning the forward's auxiliary loss terms or None, whose backward
    is counted with the output's (an NSA layer's indexer KL terms: nsa/model.py sums every layer's into the loss)."""
    x = x.detach().requires_grad_(True)
    with torch.no_grad():
        grad = module(x, *args)
    grad = torch.ones_like(grad)
    one = torch.ones((), device=grad.device)
    if aux is not None:  # its dtype is known once the forward ran
        one = one.to(torch.promote_types(grad.dtype, torch.float32))
    with LaunchCounter(open_custom_ops) as counter:
        y = module(x, *args)
        extra = aux() if aux is not None else None
        # the terms' gradient as the model's sum of them passes it: one value, expanded (a view, no launch)
        outputs, grads = ([y], [grad]) if extra is None else ([y, extra], [grad, one.expand_as(extra)])
        torch.autograd.backward(outputs, grads)
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


def attention_layer_launches(cfg, T: int, batch: int = 1, documents: int = 0, device: str = "meta",
                             open_custom_ops: bool = False) -> LaunchCounter:
    """One attention layer of `cfg` (a ModelConfig; dense or NSA), forward and backward at sequence length T
    with RoPE, built on `device` (meta: shapes only). documents > 0: a packed window of that many documents
    (document masking; on the meta device their count cannot change anything: use device="cpu" to show it).
    open_custom_ops: count inside the nsa:: ops (LaunchCounter; device="cpu", and for the Triton path's
    kernels cfg.nsa.kernel="triton" with Triton's interpreter on)."""
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
            if cfg.nsa.selector == "indexer":  # the KL mean's counted rows, shared by the layers too
                from nsa.attention.indexer import shared_counted_rows

                shared_counted_rows(docs, docs.compressed(cfg.nsa.l, cfg.nsa.d).frame, cfg.nsa.l_sel)
        positions = docs.positions if docs is not None else torch.arange(T)
        rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)(positions)
    aux = (lambda: layer.indexer_loss) if getattr(layer, "indexer", None) is not None else None  # its KL term
    if docs is None:
        return count_forward_backward(layer, x, rope, open_custom_ops=open_custom_ops, aux=aux)
    return count_forward_backward(lambda x_, rope_: layer(x_, rope_, documents=docs), x, rope,
                                  open_custom_ops=open_custom_ops, aux=aux)
