"""What this machine lacks of the packages beyond the core (the table: train/core/optional.py).

    python -m train.packages      one line per missing package and what needs it, one per version outside the tested
                                  range (train/core/versions.py), and whether the Triton kernels can run
                                  (nsa/triton_support.py); exit 1 when the core is missing

scripts/prime_bootstrap.sh and scripts/test_stack.sh print it.
"""
from __future__ import annotations

import sys

from nsa.triton_support import triton_unavailable
from train.core.optional import installed, installed_versions, missing
from train.core.versions import outside_supported


def main() -> int:
    core, lines = missing()
    lines += outside_supported(installed_versions())
    if installed("triton") and (problem := triton_unavailable()):
        lines.append(f"triton: {problem}")
    for line in lines:
        print(line)
    if core:
        print(f"error: the core is missing {', '.join(core)}: nothing runs without it", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
