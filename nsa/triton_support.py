"""Whether this machine's Triton can run the Triton kernels (nsa/attention/kernels/): the one place for the oldest
Triton they support. Reads the installed version only; imports neither triton nor torch.

Triton 3.5 is the oldest the kernels are tested with (in its interpreter, against the float64 reference) and compiled
for sm_80 / sm_90 ahead of time (docs/STACKS.md). Older ones are refused, not guessed at: Triton 3.3's interpreter
has no float64 dot, so the kernels could not be checked against the reference there. torch 2.7 pins Triton 3.3:
with it NSA runs its torch path and FlexAttention (nsa.kernel=auto), and nsa.kernel=triton is refused in one line.
"""
from __future__ import annotations

import functools
import importlib.metadata
import re

TRITON_NEEDED = (3, 5)


@functools.cache
def triton_unavailable() -> str | None:
    """None when the Triton kernels may be used here; else one line saying why not. Read once per process: the
    installed version does not change while it runs, and nsa/attention/ops.py asks on every op call (the package
    metadata read took ~1 ms a call, ~10 calls per NSA layer forward + backward: measured, fourteenth session)."""
    try:
        version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return "the triton package is not installed"
    have = tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:2])
    if have < TRITON_NEEDED:
        return (f"the Triton kernels need triton >= {'.'.join(map(str, TRITON_NEEDED))} (this machine has triton "
                f"{version}; torch >= 2.9 brings one)")
    return None
