"""Whether Triton's interpreter can run this package's kernels here (on CPU, TRITON_INTERPRET=1).

The kernels loop over runtime bounds (`for n0 in range(0, n_vis, BN)`, n_vis computed from a loaded value). Triton's
interpreter holds a kernel's scalars as 1-element NumPy arrays and, up to Triton 3.6, turned them into Python ints
with int(array), which NumPy 2.4 made an error ("only 0-dimensional arrays can be converted to Python scalars";
triton-lang/triton#9171, fixed by squeezing first, as Triton 3.9 does). The kernels are not at fault: compiled for a
GPU they never go through NumPy. A stack with both (the GPU image's Triton 3.6 and NumPy >= 2.4) cannot interpret
them, and the kernel tests skip there with this reason instead of failing; with NumPy < 2.4 they run and pass.
"""
from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl

from nsa.attention.kernels.interpreter import interpreter_active
from nsa.triton_support import triton_unavailable


@triton.jit
def _count_to_loaded_bound(bound_ptr, out_ptr):
    n = tl.load(bound_ptr + tl.program_id(0))  # a runtime scalar, as the kernels' loop bounds are
    count = 0
    for _ in range(0, n):
        count += 1
    tl.store(out_ptr, count)


@functools.cache
def interpreter_loop_problem() -> str | None:
    """None when the kernels can run here (compiled, or interpreted with runtime loop bounds); else why not."""
    if problem := triton_unavailable():  # a Triton older than the kernels support
        return problem
    if torch.cuda.is_available() or not interpreter_active():
        return None
    bound, out = torch.tensor([3], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    try:
        _count_to_loaded_bound[(1,)](bound, out)
    except Exception as exc:  # noqa: BLE001 - any failure of the interpreter itself
        detail = " ".join(str(exc).split())[:160]
        return (f"Triton {triton.__version__}'s interpreter cannot loop to a runtime bound with NumPy {np.__version__} "
                f"({detail}; triton-lang/triton#9171): a Triton interpreter limit, not the kernels'; run these tests with "
                f"numpy<2.4 or a newer Triton")
    if int(out) != 3:
        return f"Triton {triton.__version__}'s interpreter counted {int(out)} iterations of a 3-step loop"
    return None
