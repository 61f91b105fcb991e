"""NSA's branches as pure torch functions of tensors and integers: no custom ops, no Triton, no modules
with parameters. nsa/attention/ops.py registers them as the torch path of its custom ops (and calls the
FlexAttention branches of flex.py on CUDA); they import only torch, each other and nsa.profiling.
"""
