"""Optional Weights & Biases logging (runtime.wandb: true).

    logger = WandbLogger(cfg, out_dir)     # rank 0 only; never constructed when runtime.wandb is false
    logger.log(step, {"train/loss": 3.2, "train/mfu": None})   # None values are dropped
    logger.finish()

`wandb` is imported lazily, so the trainer does not need the package unless W&B is on. A missing
package or a failing wandb.init (no login, no network) is a one-line ConfigError; pre-flight
(`python -m train.preflight`) reports the missing package before launch.

The W&B run id is kept in OUT_DIR/wandb_run_id.txt: a resumed run continues the same W&B run.
"""
from __future__ import annotations

import importlib
import secrets
from pathlib import Path

from train.core.config import RunConfig
from train.core.errors import ConfigError

RUN_ID_FILE = "wandb_run_id.txt"
MISSING = ("runtime.wandb is true but the wandb package is not installed; "
           "pip install wandb, or set --runtime.wandb=false")


def require_wandb():
    """The wandb module, or a ConfigError saying how to fix its absence."""
    try:
        return importlib.import_module("wandb")
    except ImportError:
        raise ConfigError(MISSING) from None


def _run_id(out_dir: Path) -> str:
    path = out_dir / RUN_ID_FILE
    if path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    run_id = secrets.token_hex(4)
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(run_id + "\n")
    return run_id


def _clean(metrics: dict) -> dict:
    """Drop None (CPU runs have no MFU); keep numbers, including nan/inf (W&B shows them)."""
    out = {}
    for key, value in metrics.items():
        if value is None:
            continue
        if isinstance(value, str):
            try:
                value = float(value)  # heartbeat-style "nan" / "inf"
            except ValueError:
                continue
        out[key] = value
    return out


class WandbLogger:
    def __init__(self, cfg: RunConfig, out_dir: str | Path):
        wandb = require_wandb()
        out_dir = Path(out_dir)
        self.run_id = _run_id(out_dir)
        rt = cfg.runtime
        try:
            self._run = wandb.init(project=rt.wandb_project, name=rt.wandb_run_name or out_dir.name,
                                   id=self.run_id, resume="allow", dir=str(out_dir), config=cfg.to_dict())
        except Exception as exc:  # wandb raises its own error types (UsageError, CommError, ...)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"wandb.init failed ({first}); run `wandb login`, set WANDB_MODE=offline, "
                              f"or set --runtime.wandb=false") from None
        self._finished = False

    def log(self, step: int, metrics: dict) -> None:
        values = _clean(metrics)
        if values and not self._finished:
            self._run.log(values, step=int(step))

    def finish(self) -> None:
        if not self._finished:
            self._finished = True
            self._run.finish()
