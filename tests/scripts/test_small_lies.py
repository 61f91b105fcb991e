"""Small things that must not lie: the bootstrap's Python minimum is pyproject's, a config's stated size is
its real size, and what the README tells you to write is git-ignored."""
from __future__ import annotations

import re
import subprocess

import torch

from nsa.model import Transformer
from tests.scripts.helpers import REPO
from train.core.config import load_config


def test_bootstrap_refuses_the_python_pyproject_refuses(tmp_path):
    fake = tmp_path / "python3.9"
    fake.write_text("#!/usr/bin/env bash\necho 3.9\n")  # answers the version query like a Python 3.9
    fake.chmod(0o755)
    res = subprocess.run(["bash", "scripts/prime_bootstrap.sh"], cwd=REPO, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHON": str(fake), "VENV": str(tmp_path / "venv")}, timeout=60)
    minimum = re.search(r'requires-python = ">=([0-9.]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    assert res.returncode == 1 and not (tmp_path / "venv").exists()
    assert res.stderr.strip() == (f"[bootstrap] error: Python >= {minimum} required (pyproject.toml); {fake} is 3.9: "
                                  f"set PYTHON=python{minimum}")


def test_a_config_that_states_its_size_states_it_right():
    checked = 0
    for path in sorted((REPO / "configs").glob("*.yaml")):
        stated = re.search(r"([0-9.]+)\s*([MB]) params", path.read_text().split("\nmodel:")[0])
        if not stated:
            continue
        with torch.device("meta"):
            real = sum(p.numel() for p in Transformer(load_config(path).model).parameters())
        claimed = float(stated.group(1)) * (1e6 if stated.group(2) == "M" else 1e9)
        assert abs(real - claimed) <= 0.05 * real, f"{path.name} says {stated.group(0)}, has {real:,}"
        checked += 1
    assert checked >= 1


def test_the_readme_export_dir_is_git_ignored():
    exported = re.search(r"python -m train\.export_hf OUT_DIR (\S+)/", (REPO / "README.md").read_text()).group(1)
    res = subprocess.run(["git", "check-ignore", "-q", f"{exported}/model.safetensors"], cwd=REPO)
    assert res.returncode == 0, f"{exported}/ is not git-ignored"
