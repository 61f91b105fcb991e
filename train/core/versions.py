"""The software this project supports, and what needs more than its floor: the one place for both.

SUPPORTED is the range tested (on CPU, every stack of scripts/test_stack.sh; results in docs/STACKS.md); README.md
and pyproject.toml state it too, and tests/tools/test_versions.py keeps them equal to this table. A machine outside
it is told so by `python -m train.packages` (one line), and nothing is refused for that alone.

NEEDS_TORCH lists each feature that needs a newer torch than the floor: the config refuses it in one line naming
the version (`torch_refusal`), at config time, before anything is written.
"""
from __future__ import annotations

import re

# what is tested: (oldest, newest) of each
SUPPORTED = {
    "python": ("3.10", "3.13"),
    "torch": ("2.9.1", "2.15.0"),  # torch 2.7.1 (the production launch plan's) is not: docs/STACKS.md
    "triton": ("3.5.1", "3.9.0"),  # the Triton kernels (nsa/triton_support.py); below it NSA runs its torch path
}
# feature (as the config names it) -> (the oldest torch that has it, what it is)
NEEDS_TORCH = {
    "train.optimizer=muon": ((2, 9), "torch.optim.Muon"),
}


def version_tuple(text: str) -> tuple[int, ...]:
    """'2.11.0+cu130' -> (2, 11, 0); '3.10' -> (3, 10); a pre-release ('2.12.0a0') counts as its release."""
    return tuple(int(part) for part in re.findall(r"\d+", text.split("+")[0])[:3])


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


def torch_version() -> tuple[int, ...]:
    import torch

    return version_tuple(torch.__version__)


def torch_refusal(feature: str, have: tuple[int, ...] | None = None) -> str | None:
    """One line when this torch (or `have`) is older than `feature` needs; None when it may be used."""
    need, what = NEEDS_TORCH[feature]
    have = torch_version() if have is None else have
    if have[:len(need)] >= need:
        return None
    return f"{feature} needs torch >= {_dotted(need)} ({what}); this machine has torch {_dotted(have)}"


def outside_supported(installed: dict[str, str]) -> list[str]:
    """One line per package whose version ({name: version}) lies outside SUPPORTED."""
    lines = []
    for name, version in installed.items():
        low, high = (version_tuple(end) for end in SUPPORTED[name])
        have = version_tuple(version)
        # compared at the precision each end is stated in: Python 3.13.2 is within "3.13"
        if not low <= have[:len(low)] or not have[:len(high)] <= high:
            lines.append(f"untested: {name} {version} (tested: {' - '.join(SUPPORTED[name])}, docs/STACKS.md)")
    return lines
