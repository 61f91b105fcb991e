"""The one place where the Python side reads environment variables (standard library only).

- Config knobs: the source guides' runbooks set them in the environment (NSA_DDP_COMPRESS=bf16,
  NSA_NVTX=1, ...); they map onto config keys here, and command-line overrides come after and win.
  Knobs that named optional code paths of the earlier system are accepted and reported as unnecessary.
- Launch facts: torchrun's WORLD_SIZE / RANK / LOCAL_RANK (`launch_ranks`); CUDA_VISIBLE_DEVICES for a
  child that gets one GPU (`one_gpu_environment`, train.compare --side_by_side).
- Tool settings: ARTIFACTS_DIR (`artifacts_dir`), CONFIG (`default_config`), the monitor's thresholds
  and NVIDIA_SMI (`number`, `text`).
`environment()` hands a copy of the whole environment to the pre-flight, which inspects it.
tests/tools/test_package.py checks that no other module of train/, nsa/, scripts/ or bench/ reads it.
"""
from __future__ import annotations

from train.core.env import env_overrides


def main() -> int:
    """`python -m train.env`: print the overrides the environment implies (used by the bash runbooks)."""
    import sys

    from train.core.errors import UserError, print_error

    try:
        overrides, notes = env_overrides()
    except UserError as exc:
        print_error(exc)
        return exc.exit_code
    for note in notes:
        print(note, file=sys.stderr)
    print(" ".join(overrides))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
