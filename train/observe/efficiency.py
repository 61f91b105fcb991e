"""How well the hardware is used: the training.csv columns that follow from an interval's tokens/s
(per GPU, TFLOP/s, MFU against the GPU's dense peak; nsa/flops.py) and the peak CUDA memory."""
from __future__ import annotations

import torch

from nsa.config import ModelConfig


class Efficiency:
    def __init__(self, model_cfg: ModelConfig, seq_len: int, device: torch.device, amp_dtype: torch.dtype,
                 world_size: int):
        self.device, self.world_size = device, world_size
        self.report, self.peak = None, None  # FLOPs per token (metrics.json, run_*.json); peak FLOP/s per GPU
        try:
            from nsa.flops import flops_per_token, peak_flops
        except ImportError:
            return
        self.report = flops_per_token(model_cfg, seq_len)
        if device.type == "cuda":
            dtype = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "tf32"}[amp_dtype]
            self.peak = peak_flops(torch.cuda.get_device_name(device), dtype)

    def columns(self, toks_per_s: float) -> dict:
        """toks_per_s_per_gpu, mfu, tflops, mem_alloc_mib, mem_reserved_mib (None where unknown: CPU, unknown GPUs)."""
        out = {"toks_per_s_per_gpu": toks_per_s / self.world_size, "mfu": None, "tflops": None}
        if self.report is not None:
            from nsa.flops import mfu

            fpt = self.report.flops_per_token
            out["tflops"] = toks_per_s * fpt / 1e12 / self.world_size
            out["mfu"] = mfu(toks_per_s, fpt, self.peak, self.world_size)
        return out | self._memory_mib()

    def _memory_mib(self) -> dict:
        if self.device.type != "cuda":
            return {"mem_alloc_mib": None, "mem_reserved_mib": None}
        return {"mem_alloc_mib": torch.cuda.max_memory_allocated(self.device) / 2**20,
                "mem_reserved_mib": torch.cuda.max_memory_reserved(self.device) / 2**20}
