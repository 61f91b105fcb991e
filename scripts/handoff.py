#!/usr/bin/env python3
"""Pack a training run for a person to look at: one tarball with the run record, logs, CSVs,
metrics, effective config, heartbeats, a checkpoint manifest (names, sizes, sha256) and PNG plots.

    python scripts/handoff.py [RUN_OR_OUT_DIR] [--with-weights | --all-weights] [--out-dir DIR]
    make handoff RUN=artifacts/train_runs/m7c_20250101_120000

RUN_OR_OUT_DIR: a run dir (artifacts/train_runs/m7c_*, run.info names the out_dir) or a trainer
out_dir; default: the newest run dir under artifacts/train_runs. Output:
artifacts/handoff/<run>_<timestamp>.tar.gz, holding <run>_<timestamp>/ with
  MANIFEST.txt      every file of the tarball: size, sha256, path; then the checkpoint manifest
  run/              run.info, launch_info.txt, smoke.log, train.log, preflight.log, causality.log
  segments/<run>/   the same files of every launch that wrote to this out_dir (a resumed run), oldest first
  out/              config.yaml, training.csv, val.csv, metrics.json, heartbeat_rank*.jsonl, flags,
                    stack dumps, eval results (top-level files of the out_dir; no tb/, no weights)
  checkpoints.json  the checkpoint manifest (name, step, bytes, sha256)
  plots/            loss.png (train + val), throughput.png, lr.png, gates.png (NSA runs)
  compare/          report.json / .md / .png when the out_dir is an arm of python -m train.compare
  weights/          only with --with-weights (newest checkpoint) or --all-weights
Weights are large (params x 12 bytes); the manifest lets a receiver check copies made separately.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from train.core.env import artifacts_dir
from train.observe.runs import newest_run
from train.workflows.handoff import HandoffError, build


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Pack a training run into artifacts/handoff/<run>_<ts>.tar.gz")
    ap.add_argument("target", nargs="?", help="run dir (run.info) or trainer out_dir; default: newest run dir")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--with-weights", action="store_true", help="include the newest checkpoint")
    g.add_argument("--all-weights", action="store_true", help="include every kept checkpoint")
    ap.add_argument("--out-dir", default=None, help="where the tarball goes (default ARTIFACTS_DIR/handoff)")
    args = ap.parse_args(argv)
    artifacts = artifacts_dir()
    if not artifacts.is_absolute():
        artifacts = Path.cwd() / artifacts
    try:
        target = Path(args.target) if args.target else newest_run(artifacts)  # as the monitor picks
        if target is None:
            raise HandoffError(f"no run given and no run dir under {artifacts / 'train_runs'}")
        if not target.exists():
            raise HandoffError(f"{target} does not exist")
        weights = "all" if args.all_weights else "latest" if args.with_weights else "none"
        tar_path, manifest = build(target, Path(args.out_dir) if args.out_dir else artifacts / "handoff", weights,
                                   artifacts=artifacts)
    except HandoffError as exc:
        print(f"handoff: error: {exc}", file=sys.stderr)
        return 2
    print(manifest, end="")
    print(f"handoff: {tar_path} ({tar_path.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
