"""Whether the Triton kernels of this package were built for Triton's interpreter.

`triton.jit` builds an interpreted function instead of a GPU kernel when Triton's interpret switch
(TRITON_INTERPRET=1, `triton.knobs.runtime.interpret`) is on at the moment a kernel is defined, i.e. when
its module is imported. Every kernel module here imports this one before it defines its kernels, so the
switch as read at this module's import is the one their kernels were built with. No kernels here.
"""
from __future__ import annotations

from triton import knobs

_INTERPRETED = bool(knobs.runtime.interpret)  # read once, as triton.jit reads it when the kernels are defined


def interpreter_active() -> bool:
    """True when the kernels were built for Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    return _INTERPRETED
