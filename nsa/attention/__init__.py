"""Attention: dense and Native Sparse Attention. Every attention module takes (x [B, T, dim], rope,
cache=None) and returns [B, T, dim]; nsa.model.build_attention picks one for a ModelConfig.

Layers, low to high; a module imports only from its own layer or lower ones (no import cycles, counting
imports inside functions):
  foundation  nsa.config, nsa.profiling, nsa.layers, nsa.loss
  kernels/    all Triton code: kernels, host launch wrappers, tile configs, the Triton autograd Function
              (imports only torch, triton and kernels/ itself)
  impl/       pure torch implementations of the branches: partial.py (attention partials),
              compression.py, selection.py, window.py, block_select.py, combine.py (the gated sum), index.py (the
              selection index's oracles), flex.py
              (FlexAttention), and for
              packed documents masked.py (all at once, small sizes) and segments.py (one at a time); never
              imports ops or kernels
  ops.py      the only module that registers custom ops (nsa::rotary, nsa::compress_blocks, nsa::select_blocks,
              nsa::compressed_attention, nsa::selected_attention, nsa::window_attention, nsa::gated_combine)
              and chooses the kernel (resolve_kernel)
  modules     nsa.py (NativeSparseAttention), compressor.py (BlockCompressor, phi), decode.py,
              nsa_cache.py, kv_buffer.py, dense.py, reference.py (the test oracle), gate_stats.py (pure
              gate / selection statistics), selection_health.py (selection recall, outside-window
              share, raw gate means); they import ops, impl and the foundation, never kernels
Above them: nsa.model (build_attention, Transformer), then the tools nsa.generate, nsa.flops,
nsa.launch_count and nsa.gate_health (walks a model for its NSA layers).

This package imports nothing itself: import the module you need.
"""
