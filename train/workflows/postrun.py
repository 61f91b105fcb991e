"""Post-run (the best-practices guide §4): validate the final checkpoint in eval-only mode, then archive the run.

    out_dir = resolve_out_dir(run); record = write_record(out_dir, validate_checkpoint(out_dir), skip_steps)
    tarball, how = archive(out_dir, dest)          # the command line: train/workflows/postrun.py

1. Validation: the newest checkpoint is evaluated with the run's own config.yaml and
   --train.eval_only=true (W&B off); the trainer writes OUT_DIR/eval_step{N}.json.
2. Record: OUT_DIR/postrun.json holds the checkpoint, its validation, the git SHA the run recorded
   (metrics.json) and the current one, and train.analyze's summary (MFU with its calculation_method).
3. Archive: config, run_*.json, CSVs, metrics, heartbeats, logs, eval results and postrun.json in
   one tarball, the handoff bundle (train/workflows/handoff.py, as scripts/handoff.py writes it: plots
   and a checkpoint manifest included).
The tarball goes to DIR (default $ARTIFACTS_DIR/handoff, i.e. artifacts/handoff).
"""
from __future__ import annotations

import json
import math
import tempfile
import time
from pathlib import Path

import yaml

from train.core.artifacts import CONFIG_YAML, METRICS_JSON, POSTRUN_JSON, checkpoint_files
from train.core.errors import CheckpointError, ConfigError
from train.workflows.handoff import HandoffError, build


def resolve_out_dir(run: Path) -> Path:
    """OUT_DIR, or a run_*.json / config.yaml inside it -> the out_dir."""
    out = run.parent if run.is_file() else run
    if not (out / CONFIG_YAML).is_file():
        raise ConfigError(f"{run}: no config.yaml (expected a trainer out_dir)")
    return out


def load_run_config(out_dir: Path, overrides: list[str]):
    """OUT_DIR/config.yaml + overrides -> RunConfig.

    The trainer's dump lists every section, including keys the strict loader refuses for this model
    (an nsa section on a dense model, rope_* with learned positions); those inert keys are dropped.
    """
    from train.core.config import load_config

    raw = yaml.safe_load((out_dir / "config.yaml").read_text()) or {}
    model = raw.get("model") or {}
    if model.get("attention", "dense") != "nsa":
        raw.pop("nsa", None)
    if model.get("pos_emb", "rope") != "rope":
        for key in ("rope_theta", "rope_scale"):
            model.pop(key, None)
    with tempfile.TemporaryDirectory(prefix="postrun_") as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(yaml.safe_dump(raw, sort_keys=False))
        return load_config(path, overrides)


def validate_checkpoint(out_dir: Path) -> dict:
    """Evaluate the newest checkpoint in eval-only mode; return eval_step{N}.json's content."""
    from train.trainer.runner import run_training

    found = checkpoint_files(out_dir)
    if not found:
        raise CheckpointError(f"{out_dir} holds no checkpoint_step*.pt to validate")
    step, latest = found[-1]
    cfg = load_run_config(out_dir, ["--train.eval_only=true", f"--train.resume={latest}",
                                    f"--train.out_dir={out_dir}", "--runtime.wandb=false"])
    code = run_training(cfg)
    result_path = out_dir / f"eval_step{step}.json"
    if code != 0 or not result_path.is_file():
        raise CheckpointError(f"eval-only validation of {latest} failed (exit {code}, no {result_path.name})")
    result = json.loads(result_path.read_text())
    if not math.isfinite(float(result.get("val_loss", math.nan))):
        raise CheckpointError(f"{latest} evaluates to a non-finite val loss ({result.get('val_loss')})")
    return {**result, "file": result_path.name}


def write_record(out_dir: Path, validation: dict | None, skip_steps: int) -> dict:
    """OUT_DIR/postrun.json: validation, git SHAs, and the analysis summary of the newest run JSON."""
    from train.analysis.analyze import find_run_json, load_run, summarize
    from train.observe.summary import git_sha

    metrics_path = out_dir / METRICS_JSON
    metrics = json.loads(metrics_path.read_text()) if metrics_path.is_file() else {}
    try:
        run_json = find_run_json(out_dir)
        analysis = {"run_json": run_json.name, **summarize(load_run(run_json), skip_steps=skip_steps)}
    except ConfigError as exc:
        analysis = {"error": str(exc)}
    record = {"out_dir": str(out_dir), "validation": validation, "git_sha_run": metrics.get("git_sha"),
              "git_sha_now": git_sha(), "status": metrics.get("status"), "analysis": analysis,
              "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    (out_dir / POSTRUN_JSON).write_text(json.dumps(record, indent=2) + "\n")
    return record


def archive(out_dir: Path, dest: Path, with_weights: bool = False) -> tuple[Path, str]:
    """-> (tarball, how it was built): the handoff bundle, the one scripts/handoff.py writes."""
    try:
        path, _ = build(out_dir, dest, "latest" if with_weights else "none")
    except HandoffError as exc:
        raise ConfigError(f"archive: {exc}") from None
    return path, "the handoff bundle of scripts/handoff.py"
