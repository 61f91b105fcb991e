"""Capture the Triton launches of host wrappers and compile them ahead of time for a GPU target, without a GPU.

    with capture_launches() as launches:          # kernel[grid](...) records instead of launching
        selected_attention_fwd(q, k, v, idx, 0, 64)  # the real wrapper, on meta tensors
    kernel, usage = compile_with_usage(launches[0], 90)  # triton.compile for sm_90 (ptxas ships with
                                                         # triton); registers and spills from `ptxas -v`
    mma_family(kernel)                                   # "wgmma" | "mma.sync" | "none (FMA)"

How a launch is specialized is Triton's own code, not a copy of it: `compile_launch` binds the recorded
arguments with the binder `JITFunction.run` builds (create_function_from_signature: tensor -> "*bf16",
int -> "i32"/"i64" by magnitude, an int equal to 1 -> constexpr, ints divisible by 16 and 16-byte aligned
pointers -> tt.divisibility), then `_pack_args` (signature, constexprs, attrs, options such as num_warps
and num_stages passed by the wrapper), exactly as a launch on that GPU would compile it. Compiles go
through Triton's cache (TRITON_CACHE_DIR, default ~/.triton/cache): a second run is fast. Registers and
spills are Triton's own `ptxas -v` log of a fresh compile; they are kept beside the kernel in that cache
(ptxas_usage.json) for cache hits, which run no ptxas.

Wrappers run on meta tensors: they have shapes, dtypes and strides but no storage, so the wrappers' torch
ops (allocations, index building) cost nothing, and their data pointer (0) is aligned like a CUDA
allocation. A device check that refuses CPU tensors without Triton's interpreter does not fire on them,
so no wrapper is patched. TRITON_INTERPRET must be unset when the kernel modules are imported: only
JITFunction launches are recorded (an interpreted kernel would run, and fail on meta tensors).
Autotuned kernels (@triton.autotune) would benchmark on a GPU and are not supported: wrappers pass
fixed configs.
"""
from __future__ import annotations

import io
import json
import os
import re
import subprocess
import tempfile
from contextlib import contextmanager, redirect_stdout
from dataclasses import asdict, dataclass

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, CompiledKernel, make_backend
from triton.runtime.cache import get_cache_manager
from triton.runtime.jit import JITFunction, create_function_from_signature

WARP_SIZE = 32  # NVIDIA
USAGE_FILE = "ptxas_usage.json"  # beside a compiled kernel in Triton's cache


@dataclass
class Launch:
    """One `kernel[grid](*args, **kwargs)` call of a wrapper, recorded instead of run."""

    kernel: JITFunction
    args: tuple
    kwargs: dict
    grid: object

    @property
    def name(self) -> str:
        return self.kernel.__name__


@dataclass
class Usage:
    """What `ptxas -v` reports for one kernel."""

    registers: int  # per thread
    spill_stores: int  # bytes
    spill_loads: int  # bytes


@contextmanager
def capture_launches():
    """Within the block, every JITFunction launch appends a Launch to the yielded list and returns None."""
    launches: list[Launch] = []

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(self, args, dict(kwargs), grid))

    original = JITFunction.run
    JITFunction.run = record
    try:
        yield launches
    finally:
        JITFunction.run = original


def compile_launch(launch: Launch, capability: int) -> CompiledKernel:
    """Compile the recorded launch for sm_<capability> as JITFunction.run would on that GPU."""
    target = GPUTarget("cuda", capability, WARP_SIZE)
    backend = make_backend(target)
    fn = launch.kernel
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, launch.kwargs, bound, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def compile_with_usage(launch: Launch, capability: int) -> tuple[CompiledKernel, Usage]:
    """compile_launch plus the kernel's registers and spills: from the ptxas log Triton prints when it
    compiles afresh (knobs.nvidia.dump_ptxas_log), else as stored by an earlier run, else by running ptxas."""
    log = io.StringIO()
    with knobs.nvidia.scope(), redirect_stdout(log):
        knobs.nvidia.dump_ptxas_log = True
        kernel = compile_launch(launch, capability)
    cache = get_cache_manager(kernel.hash)
    if "Used" in log.getvalue():  # a fresh compile: Triton ran ptxas -v
        usage = parse_ptxas_log(log.getvalue())
    elif cache.get_file(USAGE_FILE):  # a cache hit
        with open(cache.get_file(USAGE_FILE)) as f:
            return kernel, Usage(**json.load(f))
    else:  # compiled by a run that did not record usage
        usage = ptxas_usage(kernel, capability)
    cache.put(json.dumps(asdict(usage)), USAGE_FILE, binary=False)
    return kernel, usage


def ptxas_usage(kernel: CompiledKernel, capability: int) -> Usage:
    """Run the ptxas Triton bundles on the kernel's PTX with the flags Triton's make_cubin uses."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    fmad = [] if kernel.metadata.enable_fp_fusion else ["--fmad=false"]
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(kernel.asm["ptx"])
        cmd = [get_ptxas(capability).path, "-lineinfo", *fmad, "-v", "--regAllocOptLevel=2",
               f"--gpu-name={sm_arch_from_capability(capability)}", src, "-o", os.path.join(tmp, "kernel.cubin")]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    return parse_ptxas_log(log)


def parse_ptxas_log(log: str) -> Usage:
    """'Used 168 registers' and '0 bytes stack frame, 28672 bytes spill stores, 28672 bytes spill loads'."""
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if not regs or not spills:
        raise ValueError(f"unexpected ptxas -v output:\n{log}")
    return Usage(int(regs.group(1)), int(spills.group(1)), int(spills.group(2)))


def mma_family(kernel: CompiledKernel) -> str:
    """The tensor-core instructions in the PTX: wgmma (sm_90 async warpgroup MMA), mma.sync, or none."""
    ptx = kernel.asm["ptx"]
    if "wgmma.mma_async" in ptx:
        return "wgmma"
    if "mma.sync" in ptx:
        return "mma.sync"
    return "none (FMA)"
