"""The installable package (pyproject.toml): console scripts resolve and run, dependencies are
requirements.txt's pins, and no tool edits sys.path to find the packages."""
from __future__ import annotations

import importlib
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="Python 3.10 has no tomllib to read pyproject.toml with")

from train.core.optional import installed

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
if not installed(PYPROJECT["project"]["name"]):  # a stack that runs the repository with PYTHONPATH=. (test_stack.sh)
    pytest.skip(f"{PYPROJECT['project']['name']} is not pip-installed here: its metadata and console scripts are "
                f"not there to check", allow_module_level=True)


def test_console_scripts_name_callables_and_run():
    scripts = PYPROJECT["project"]["scripts"]
    assert {"nsa-train", "nsa-prepare", "nsa-preflight", "nsa-plan"} <= set(scripts)
    for name, target in scripts.items():
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), name
    bin_dir = Path(sys.executable).parent
    missing = [name for name in scripts if not (bin_dir / name).exists()]
    assert not missing, f"{missing} not installed beside {sys.executable}: run bash scripts/prime_bootstrap.sh"
    out = subprocess.run([str(bin_dir / "nsa-train"), "--help"], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0 and "usage:" in out.stdout
    out = subprocess.run([str(bin_dir / "nsa-plan"), str(REPO / "configs" / "train_showcase.yaml")],
                         capture_output=True, text=True, timeout=120, cwd="/")  # from anywhere: no PYTHONPATH
    assert out.returncode == 0 and "tokens/iteration" in out.stdout, out.stderr


def test_dependencies_are_the_requirements_pins():
    lines = [re.split(r"\s+#", line)[0].strip() for line in (REPO / "requirements.txt").read_text().splitlines()]
    pins = sorted(line for line in lines if line and not line.startswith("#"))
    required = [r for r in importlib.metadata.requires("nsa-train") if "extra ==" not in r]
    assert sorted(required) == pins


def test_no_tool_edits_sys_path():
    offenders = [str(p.relative_to(REPO)) for folder in ("bench", "scripts", "tests", "train", "nsa")
                 for p in (REPO / folder).rglob("*.py") if "sys.path.insert" in p.read_text()
                 and p.name != "test_package.py"]
    assert not offenders


def test_environment_is_read_in_one_place():
    """train/core/env.py is the only module that reads os.environ (passing it on to a child process is fine)."""
    reads = re.compile(r"os\.environ(?!\s*[,)}])|os\.getenv")
    offenders = []
    for folder in ("train", "nsa", "scripts", "bench"):
        for path in (REPO / folder).rglob("*.py"):
            if path == REPO / "train" / "core" / "env.py":
                continue
            for line in path.read_text().splitlines():
                code = line.split("#", 1)[0].replace("**os.environ", "")
                if reads.search(code):
                    offenders.append(f"{path.relative_to(REPO)}: {line.strip()}")
    assert not offenders, offenders
