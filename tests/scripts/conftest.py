"""Fixtures for the runbook-script tests (tests/scripts/helpers.py has the rest)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests import forkserver
from tests.scripts.helpers import FAKE_NVIDIA_SMI, SCRUB, SCRUB_PREFIXES


@pytest.fixture
def fake_smi(tmp_path):
    """make(gpus, apps="") -> the fake nvidia-smi's directory (put it first on PATH)."""

    def make(gpus: list[tuple[str, int]], apps: str = "") -> Path:
        d = tmp_path / "fakebin"
        d.mkdir(exist_ok=True)
        (d / "gpus.csv").write_text("".join(f"{name}, {mib}\n" for name, mib in gpus))
        (d / "apps.csv").write_text(apps)
        smi = d / "nvidia-smi"
        smi.write_text(FAKE_NVIDIA_SMI)
        smi.chmod(0o755)
        return d

    return make


@pytest.fixture
def script_env(tmp_path):
    """env(bin_dir=None, **vars): a clean environment; without bin_dir there is no nvidia-smi."""

    def make(bin_dir: Path | None = None, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in SCRUB and not k.startswith(SCRUB_PREFIXES)}
        env.update(forkserver.environment())  # the suite's own (VENV: the fork server's python), not a developer's
        env["ARTIFACTS_DIR"] = str(tmp_path / "artifacts")
        if bin_dir is not None:
            env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
        else:
            env["NVIDIA_SMI"] = str(tmp_path / "no-such-dir" / "nvidia-smi")
        env.update({k: str(v) for k, v in extra.items()})
        return env

    return make

