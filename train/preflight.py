"""Pre-flight checklist (the best-practices guide §1) as code: run it before every long run.

    python -m train.preflight CONFIG [--section.key=value ...] [--gpus N] [--no-checksums]
    make preflight CONFIG=configs/full_qwen3_1.8b_b200_50h.yaml PREFLIGHT_ARGS="--gpus 8"

Prints a checklist (✓ passed, ✗ failed) grouped as in the best-practices guide, then the warnings (⚠) and the
eye-test snippets. Exit 0 when nothing failed, 1 when a check failed, 2 for a config error.
`run_preflight(cfg, gpus=..., free_bytes=...)` is the same check for tests and launch scripts.
What each check covers, and what stays manual, is in docs/PRODUCTION.md.
"""
from __future__ import annotations

import argparse
import sys

from train.core.config import load_config
from train.core.errors import ConfigError, UserError, print_error
from train.workflows.preflight import run_preflight


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.preflight", allow_abbrev=False,
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="the run's YAML config; overrides (--section.key=value) may follow")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs of the launch (default $WORLD_SIZE or 1)")
    parser.add_argument("--no-checksums", action="store_true", help="skip hashing the token files (huge datasets)")
    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.gpus is not None and args.gpus < 1:
            raise ConfigError(f"--gpus must be >= 1, got {args.gpus}")
        cfg = load_config(args.config, overrides)
        result = run_preflight(cfg, gpus=args.gpus, checksums=not args.no_checksums)
    except UserError as exc:
        print_error(exc)
        return exc.exit_code
    print(result.render(), flush=True)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
