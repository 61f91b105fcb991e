"""What this machine lacks of the packages beyond the core (the table: train/core/optional.py).

    python -m train.packages      one line per missing package and what needs it; exit 1 when the core is missing

scripts/prime_bootstrap.sh and scripts/test_stack.sh print it.
"""
from __future__ import annotations

import sys

from train.core.optional import missing


def main() -> int:
    core, lines = missing()
    for line in lines:
        print(line)
    if core:
        print(f"error: the core is missing {', '.join(core)}: nothing runs without it", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
