"""Process group, device choice and model wrapping (DDP with compression hooks, ZeRO-1, FSDP2).

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK; without them the run is a single process.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

from train.core.config import RuntimeConfig
from train.core.data_config import AGREEMENT_TIMEOUT_S
from train.core.env import launch_ranks
from train.core.errors import ConfigError


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    control_group: object = None  # a CPU (gloo) group for small host-side agreements; None: one process

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def resolve_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("runtime.device=cuda but no CUDA device is available")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(runtime: RuntimeConfig) -> DistInfo:
    world, rank, local_rank = launch_ranks()
    device = resolve_device(runtime.device, local_rank)
    control = None
    if world > 1:
        agreement = timedelta(seconds=AGREEMENT_TIMEOUT_S)
        if not dist.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(backend=backend, device_id=device if device.type == "cuda" else None,
                                    **({"timeout": agreement} if backend == "gloo" else {}))
        # stop votes and start-up decisions travel as CPU tensors: no device sync, no NCCL stream. A rank whose data
        # reads are failing joins its vote within data.retry_max_s (checked against this timeout at config time)
        control = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo", timeout=agreement)
    return DistInfo(rank, world, local_rank, device, control)


def shutdown_distributed(clean_exit: bool) -> None:
    """Leave together after a clean run: a rank that tears gloo down while its peer is still
    writing files can abort ("terminate called without an active exception"). After an error,
    leave at once (a barrier could wait on a peer that is busy elsewhere)."""
    if dist.is_initialized():
        try:
            if clean_exit:
                dist.barrier()
        finally:
            dist.destroy_process_group()


def resolve_precision(precision: str, device: torch.device) -> torch.dtype:
    if precision == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    if dtype == torch.float16 and device.type != "cuda":
        raise ConfigError("runtime.precision=fp16 needs CUDA; use bf16 or fp32 on CPU")
    return dtype


def autocast_context(device: torch.device, dtype: torch.dtype):
    """bf16/fp16 autocast with fp32 master weights; nothing for fp32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def wrap_model(model: nn.Module, info: DistInfo, runtime: RuntimeConfig, compute_dtype: torch.dtype) -> nn.Module:
    """DDP (optionally with a bf16/fp16 gradient-compression hook) or FSDP2 when world_size > 1.

    FSDP2 shards each block and the root in place; parameters are gathered in `compute_dtype`
    (bf16 under bf16 precision) and gradients reduced in fp32 onto fp32 master shards.
    """
    if not info.enabled:
        return model
    if runtime.fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        param_dtype = None if compute_dtype == torch.float32 else compute_dtype
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(
        model,
        device_ids=[info.local_rank] if info.device.type == "cuda" else None,
        bucket_cap_mb=runtime.ddp_bucket_mb,
        gradient_as_bucket_view=True,
        static_graph=runtime.ddp_static_graph,
    )
    if runtime.ddp_compress == "bf16" and info.device.type != "cuda":
        raise ConfigError("runtime.ddp_compress=bf16 needs CUDA/NCCL (PyTorch's bf16 hook); use fp16 or none on CPU")
    if runtime.ddp_compress != "none":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = default_hooks.bf16_compress_hook if runtime.ddp_compress == "bf16" else default_hooks.fp16_compress_hook
        ddp.register_comm_hook(state=None, hook=hook)
    return ddp


def no_sync(model: nn.Module, skip_sync: bool):
    """Skip the gradient all-reduce on accumulation micro-steps (DDP)."""
    if skip_sync and hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()


def all_reduce_mean(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t = t / info.world_size
    return t


def gather_objects(obj, info: DistInfo) -> list:
    """Every rank's obj, on every rank (small objects: data-sampler states)."""
    if not info.enabled:
        return [obj]
    out = [None] * info.world_size
    dist.all_gather_object(out, obj, group=info.control_group)  # over the CPU group: no device sync
    return out


def broadcast_from_main(obj, info: DistInfo):
    """Rank 0's obj on every rank (small picklable objects, over the CPU control group)."""
    if not info.enabled:
        return obj
    box = [obj if info.is_main else None]
    dist.broadcast_object_list(box, src=0, group=info.control_group)
    return box[0]


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()
