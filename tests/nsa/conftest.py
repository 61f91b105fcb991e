"""NSA test set-up. Without CUDA the Triton selection kernels run in Triton's interpreter: the switch is
read when a kernel is defined (nsa.attention.kernels' modules' import), so it is set here, before any
NSA test module is imported."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
