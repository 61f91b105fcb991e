"""Post-run (the best-practices guide §4): validate the final checkpoint in eval-only mode, then archive the run.

    python -m train.postrun OUT_DIR [--no-eval] [--archive-dir DIR] [--with-weights] [--skip-steps N]

1. Validation: the newest checkpoint is evaluated with the run's own config.yaml and
   --train.eval_only=true (W&B off); the trainer writes OUT_DIR/eval_step{N}.json.
2. Record: OUT_DIR/postrun.json holds the checkpoint, its validation, the git SHA the run recorded
   (metrics.json) and the current one, and train.analyze's summary (MFU with its calculation_method).
3. Archive: config, run_*.json, CSVs, metrics, heartbeats, logs, eval results and postrun.json in
   one tarball, built by scripts/handoff.py's build() (plots and a checkpoint manifest included).
   Without scripts/handoff.py a minimal tarball of the same top-level files is written instead.
The tarball goes to DIR (default $ARTIFACTS_DIR/handoff, i.e. artifacts/handoff).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import yaml

from train.artifacts import (CONFIG_YAML, EVAL_JSON_GLOB, HEARTBEAT_GLOB, METRICS_JSON, POSTRUN_JSON, RUN_SUMMARY_GLOB,
                             checkpoint_files)
from train.env import artifacts_dir
from train.errors import CheckpointError, ConfigError, UserError

REPO = Path(__file__).resolve().parents[1]
HANDOFF = REPO / "scripts" / "handoff.py"
ARCHIVE_PATTERNS = (CONFIG_YAML, RUN_SUMMARY_GLOB, METRICS_JSON, EVAL_JSON_GLOB, POSTRUN_JSON, "*.csv",
                    HEARTBEAT_GLOB, "*.log", "*.txt")


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
    from train.config import load_config

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
    from train import checkpoint as ckpt_io
    from train.runner import run_training

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
    from train.analyze import find_run_json, load_run, summarize
    from train.summary import git_sha

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


def _load_handoff():
    """scripts/handoff.py as a module, or None when it is absent or has no build()."""
    if not HANDOFF.is_file():
        return None
    spec = importlib.util.spec_from_file_location("_handoff", HANDOFF)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module if hasattr(module, "build") else None


def minimal_archive(out_dir: Path, dest: Path) -> Path:
    """A tarball of the out_dir's top-level run files (ARCHIVE_PATTERNS); no weights, no plots."""
    base = f"{out_dir.resolve().name}_{time.strftime('%Y%m%d_%H%M%S')}"
    files = sorted({p for pattern in ARCHIVE_PATTERNS for p in out_dir.glob(pattern) if p.is_file()})
    dest.mkdir(parents=True, exist_ok=True)
    path, tmp = dest / f"{base}.tar.gz", dest / f".{base}.tar.gz.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        for f in files:
            tar.add(f, arcname=f"{base}/out/{f.name}", recursive=False)
    os.replace(tmp, path)
    return path


def archive(out_dir: Path, dest: Path, with_weights: bool = False) -> tuple[Path, str]:
    """-> (tarball, how it was built)."""
    handoff = _load_handoff()
    if handoff is None:
        return minimal_archive(out_dir, dest), "minimal archive (scripts/handoff.py not found)"
    try:
        path, _ = handoff.build(out_dir, dest, "latest" if with_weights else "none")
    except handoff.HandoffError as exc:
        raise ConfigError(f"archive: {exc}") from None
    return path, "scripts/handoff.py"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.postrun", description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="the trainer out_dir")
    parser.add_argument("--no-eval", action="store_true", help="archive without validating the checkpoint")
    parser.add_argument("--archive-dir", type=Path, default=None, help="where the tarball goes")
    parser.add_argument("--with-weights", action="store_true", help="put the newest checkpoint in the tarball")
    parser.add_argument("--skip-steps", type=int, default=50, help="warm-up steps left out of the MFU summary")
    args = parser.parse_args(argv)
    artifacts = artifacts_dir()
    try:
        out_dir = resolve_out_dir(args.run)
        validation = None if args.no_eval else validate_checkpoint(out_dir)
        record = write_record(out_dir, validation, args.skip_steps)
        tarball, how = archive(out_dir, args.archive_dir or artifacts / "handoff", args.with_weights)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    if validation:
        print(f"✓ validated {Path(validation['checkpoint']).name}: val loss {validation['val_loss']:.4f} "
              f"(ppl {validation['ppl']:.2f}) -> {out_dir / validation['file']}")
    a = record["analysis"]
    if "error" not in a:
        mfu = f"{a['avg_mfu']:.1%}" if a.get("avg_mfu") is not None else "n/a"
        loss = f"{a['final_loss']:.4f}" if a.get("final_loss") is not None else "n/a"
        print(f"✓ summary: avg MFU {mfu} ({a['calculation_method']}), "
              f"{a['avg_toks_per_s'] or 0:,.0f} tokens/s, final loss {loss}")
    print(f"✓ git SHA of the run: {record['git_sha_run']} (now {record['git_sha_now']})")
    print(f"✓ archive: {tarball} ({how})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
