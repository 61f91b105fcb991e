"""Triton kernels only: pure functions of tensors and constexprs, no config reading.

Each module here holds `@triton.jit` kernels and a thin host wrapper that derives the grid and the
compile-time constants from tensor shapes and plain integer arguments (no host syncs). Choosing a
kernel, reading NSAConfig and registering custom ops happen elsewhere (nsa/attention/ops.py).
"""
