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
import sys
from pathlib import Path

from train.core.env import artifacts_dir
from train.core.errors import UserError, print_error
from train.workflows.postrun import archive, resolve_out_dir, validate_checkpoint, write_record


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
        print_error(exc)
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
