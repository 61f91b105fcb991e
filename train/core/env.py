"""The one place where the Python side reads environment variables (standard library only).

The command line, usage and details: train/env.py (its docstring).
"""
from __future__ import annotations

import os
from pathlib import Path


def environment() -> dict[str, str]:
    """A copy of the process environment (the pre-flight inspects NCCL_* and friends)."""
    return dict(os.environ)


def launch_ranks() -> tuple[int, int, int]:
    """(world size, global rank, local rank) as torchrun sets them; (1, 0, 0) for a plain process."""
    return (int(os.environ.get("WORLD_SIZE", "1") or 1), int(os.environ.get("RANK", "0") or 0),
            int(os.environ.get("LOCAL_RANK", "0") or 0))


def artifacts_dir() -> Path:
    """ARTIFACTS_DIR (default artifacts/), where the runbooks put run dirs, handoffs and post-runs."""
    return Path(os.environ.get("ARTIFACTS_DIR") or "artifacts")


def default_config() -> str | None:
    """CONFIG, the runbooks' way to name the YAML config (scripts/train_showcase.py's default)."""
    return os.environ.get("CONFIG") or None


def one_gpu_environment(index: int) -> dict[str, str]:
    """The environment for a child process that sees only GPU `index` (CUDA_VISIBLE_DEVICES)."""
    return {**os.environ, "CUDA_VISIBLE_DEVICES": str(index)}


def text(name: str, default: str) -> str:
    return os.environ.get(name) or default


def number(name: str, default: float) -> float:
    """A numeric setting (the monitor's WINDOW, STALE_S, LOSS_FLOOR, ...); unset or not a number: default."""
    try:
        return float(os.environ[name])
    except (KeyError, ValueError):
        return default

# env var -> (config key, value translation)
def _flag(value: str) -> bool:
    lowered = value.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(value)


ENV_TO_CONFIG: dict[str, tuple[str, object]] = {
    "NSA_DDP_COMPRESS": ("runtime.ddp_compress", lambda v: v.lower()),
    "NSA_DDP_BUCKET_MB": ("runtime.ddp_bucket_mb", int),
    "NSA_DDP_DISABLE_GC": ("runtime.disable_gc", _flag),
    "NSA_NVTX": ("runtime.nvtx", _flag),
    "NSA_SDPA_AUDIT": ("runtime.sdpa_audit", _flag),
}
# knobs of the earlier system whose code paths no longer exist: the vectorised path is the only path
UNNECESSARY = {
    "NSA_PREFILL_BATCHED": "the batched prefill is the only NSA path",
    "NSA_SEL_RANGES_V2": "vectorised selection is the only NSA path",
}


def env_overrides(environ: dict[str, str] | None = None) -> tuple[list[str], list[str]]:
    """-> (['--runtime.ddp_compress=bf16', ...], ['note: ...']) from the environment."""
    environ = os.environ if environ is None else environ
    overrides, notes = [], []
    for name, (key, convert) in ENV_TO_CONFIG.items():
        raw = environ.get(name)
        if raw is None or raw == "":
            continue
        try:
            value = convert(raw)
        except ValueError:
            from train.core.errors import ConfigError

            raise ConfigError(f"environment {name}={raw!r} is not valid for {key}") from None
        overrides.append(f"--{key}={str(value).lower() if isinstance(value, bool) else value}")
    for name, why in UNNECESSARY.items():
        if name in environ:
            notes.append(f"note: {name} is accepted but unnecessary: {why}")
    return overrides, notes


def disable_triton_interpreter() -> None:
    """Triton's interpreter off for what this process defines next. Call it before triton is imported:
    triton builds its own library functions at import, interpreted when the switch is on, and then no
    kernel compiles for a GPU in this process (scripts/compile_kernels.py, which a test may start with
    TRITON_INTERPRET=1 inherited)."""
    os.environ.pop("TRITON_INTERPRET", None)
