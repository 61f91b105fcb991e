"""Opt-in instrumentation for the model library: NVTX ranges and an attention-kernel audit.

Both are process-wide switches set by the trainer (runtime.nvtx, runtime.sdpa_audit). When off,
`nvtx_range` returns one shared no-op context and `audit` returns after a single bool check.
"""
from __future__ import annotations

import contextlib

import torch

_NVTX = False
_RANGES_TO_PROFILER = False  # ranges as torch.profiler record_function (CUDA too): bench/profile_cuda.py
_AUDIT = False
_AUDIT_LOG: dict[str, dict] = {}
_NOOP = contextlib.nullcontext()


def set_nvtx(enabled: bool, to_profiler: bool = False) -> None:
    """to_profiler: the ranges go to torch.profiler (record_function) on every device, not to NVTX."""
    global _NVTX, _RANGES_TO_PROFILER
    _NVTX, _RANGES_TO_PROFILER = enabled, to_profiler


def nvtx_range(name: str):
    """An NVTX range on CUDA (visible in nsys), a torch.profiler record_function on CPU."""
    if not _NVTX:
        return _NOOP
    if torch.cuda.is_available() and not _RANGES_TO_PROFILER:
        return torch.cuda.nvtx.range(name)
    return torch.autograd.profiler.record_function(name)


def set_sdpa_audit(enabled: bool) -> None:
    global _AUDIT
    _AUDIT = enabled
    _AUDIT_LOG.clear()


def audit(site: str, path: str, q: torch.Tensor, k: torch.Tensor | None = None, **extra) -> None:
    """Record, once per call site, which attention path ran and on what (device, dtype, shapes)."""
    if not _AUDIT or site in _AUDIT_LOG:
        return
    entry = {"path": path, "device": q.device.type, "dtype": str(q.dtype).replace("torch.", ""),
             "q_shape": list(q.shape), "k_shape": list(k.shape) if k is not None else None, **extra}
    if q.is_cuda and path.startswith("sdpa"):
        entry["cuda_flash_enabled"] = torch.backends.cuda.flash_sdp_enabled()
        entry["cuda_mem_efficient_enabled"] = torch.backends.cuda.mem_efficient_sdp_enabled()
        entry["cuda_cudnn_enabled"] = torch.backends.cuda.cudnn_sdp_enabled()
    _AUDIT_LOG[site] = entry


def audit_log() -> dict[str, dict]:
    return dict(_AUDIT_LOG)
