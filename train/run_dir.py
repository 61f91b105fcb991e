"""One out_dir, one owner, one lineage: who may write it, what a start resumes from, where old files go.

Nothing a run wrote is deleted here. A start under the exclusive lock sorts the directory first:
- newer checkpoints than the one resumed (and checkpoints of another lineage) -> `superseded/`
- checkpoints that fail validation under `resume=auto` -> `corrupt/`
- an earlier attempt's logs when no valid checkpoint is left (a crash before the first save)
  -> `attempts/<timestamp>/`, then training starts fresh
Partial writes (`.checkpoint_step*.pt.tmp<pid>`) are deleted: they never were checkpoints, and
under the lock no writer can still own them. `plan_start` decides and reads only (preflight shows its
plan); `apply_start` moves.
"""
from __future__ import annotations

from pathlib import Path

from train.checkpoint import io as ckpt_io


def main(argv: list[str] | None = None) -> int:
    """`python -m train.run_dir newest-valid OUT_DIR`: the checkpoint resume=auto would take (for the
    bash runners' run.info), or nothing."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "newest-valid":
        print("usage: python -m train.run_dir newest-valid OUT_DIR", file=sys.stderr)
        return 2
    newest = ckpt_io.latest_checkpoint(Path(args[1]))
    if newest is not None:
        print(newest)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
