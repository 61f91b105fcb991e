"""Triton code only: kernels, their host launch wrappers, tile configs and the Triton autograd Function.

Imports only torch, triton and the other modules of this package (never the torch paths of impl/, the
ops or the layers). Each kernel module holds `@triton.jit` kernels and host wrappers that derive the grid
and the compile-time constants from tensor shapes and plain integer arguments (no host syncs, no config
reading):
  select_topk.py         fused top-n block selection (nsa::select_blocks on CUDA);
  selected_attention.py  selected attention: query-centric forward / dQ and block-centric dK/dV kernels,
                         tile configs, host wrappers, TritonSelectedAttention;
  block_centric.py       the block-centric forward / dQ kernels launched by selected_attention.py;
  interpreter.py         `interpreter_active()`: whether the kernels were built for Triton's interpreter.
Choosing a kernel, reading NSAConfig and registering custom ops happen in nsa/attention/ops.py, which
imports these modules only when a Triton kernel is chosen (the package works without triton).
"""
