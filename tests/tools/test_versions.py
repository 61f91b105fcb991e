"""The supported versions (train/core/versions.py) and what needs more than the floor: README and pyproject state
the same range as the table; a feature that needs a newer torch is refused in one line at config time, before
anything is written; the Triton kernels refuse a Triton older than they support (nsa/triton_support.py).

The refusals themselves run where the machine is old enough to cause them: `make test-stack STACK=launch-plan`
(torch 2.7.1, Triton 3.3.1); on a newer stack those tests check that the feature is accepted instead."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nsa.config import ModelConfigError, NSAConfig
from nsa.triton_support import TRITON_NEEDED, triton_unavailable
from train.core.versions import NEEDS_TORCH, SUPPORTED, outside_supported, torch_refusal, version_tuple

REPO = Path(__file__).resolve().parents[2]


def stated_range(text: str, name: str) -> str:
    found = re.search(rf"{name}\s*=?\s*\"?(\d[\d.]*) - (\d[\d.]*)", text, re.IGNORECASE)
    assert found, f"no {name} range found"
    return f"{found[1]} - {found[2]}"


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_readme_and_pyproject_state_the_tables_range(name):
    table = " - ".join(SUPPORTED[name])
    readme = (REPO / "README.md").read_text()
    supported_line = next(line for line in readme.splitlines() if line.startswith("Supported:"))
    assert stated_range(supported_line, name) == table
    pyproject = (REPO / "pyproject.toml").read_text()
    section = pyproject.split("[tool.nsa-train.supported]")[1].split("\n[")[0]
    assert stated_range(section, name) == table
    assert f'requires-python = ">={SUPPORTED["python"][0]}"' in pyproject


def test_versions_are_compared_as_numbers_at_the_stated_precision():
    assert version_tuple("2.11.0+cu130") == (2, 11, 0)
    assert version_tuple("2.12.0a0+git123") == (2, 12, 0)
    assert version_tuple("3.10") == (3, 10)
    low, high = SUPPORTED["python"]
    assert outside_supported({"python": low + ".0"}) == []
    assert outside_supported({"python": high + ".9"}) == []  # 3.13.9 lies within "3.13"
    newer = f"{version_tuple(high)[0]}.{version_tuple(high)[1] + 1}.0"
    assert outside_supported({"python": newer, "torch": SUPPORTED["torch"][1]}) == [
        f"untested: python {newer} (tested: {low} - {high}, docs/STACKS.md)"]
    assert outside_supported({"torch": "2.4.0"})[0].startswith("untested: torch 2.4.0")


@pytest.mark.parametrize("feature", sorted(NEEDS_TORCH))
def test_a_feature_names_the_torch_it_needs(feature):
    need, what = NEEDS_TORCH[feature]
    older = (need[0], need[1] - 1, 1)
    line = torch_refusal(feature, have=older)
    assert line == (f"{feature} needs torch >= {'.'.join(map(str, need))} ({what}); this machine has torch "
                    f"{'.'.join(map(str, older))}")
    assert torch_refusal(feature, have=need + (0,)) is None
    assert torch_refusal(feature, have=(need[0] + 1, 0)) is None


def test_muon_on_this_torch_is_refused_at_config_time_or_trains(tmp_path):
    """A real launch with train.optimizer=muon: on a torch older than Muon needs, exit 2 with the table's one line and
    an out_dir never made; on a newer one it trains."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "train", "--model.n_layers=1", "--model.dim=32", "--model.n_heads=2",
           "--model.vocab_size=64", "--train.seq_len=16", "--train.batch_size=2", "--train.steps=2",
           "--train.eval_every=0", "--runtime.device=cpu", "--runtime.threads=1", "--data.source=synthetic",
           "--train.optimizer=muon", f"--train.out_dir={out}"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    refusal = torch_refusal("train.optimizer=muon")
    if refusal:
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert refusal in proc.stderr
        assert not out.exists()
    else:
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert (out / "training.csv").exists()


def test_the_triton_kernels_refuse_an_older_triton_or_are_chosen():
    """nsa.kernel=triton is refused at config time where the Triton is too old (or missing), and nsa.kernel=auto then
    runs the torch path on CUDA tensors; with a supported Triton both choose the kernels."""
    import torch

    from nsa.attention.ops import resolve_kernel

    problem = triton_unavailable()
    cuda = torch.device("cuda")  # a device object only: no CUDA needed to ask which kernel it would get
    if problem:
        with pytest.raises(ModelConfigError, match=re.escape(f"nsa.kernel=triton: {problem}")):
            NSAConfig(kernel="triton")
        assert resolve_kernel("auto", cuda) == "torch"
        import importlib.metadata

        try:
            version = version_tuple(importlib.metadata.version("triton"))
        except importlib.metadata.PackageNotFoundError:
            return
        assert version[:2] < TRITON_NEEDED
        assert f"triton >= {'.'.join(map(str, TRITON_NEEDED))}" in problem
    else:
        assert NSAConfig(kernel="triton").kernel == "triton"
        assert resolve_kernel("auto", cuda) == "triton"


def test_the_packages_report_names_versions_outside_the_range():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "train.packages"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    untested = [line for line in proc.stdout.splitlines() if line.startswith("untested:")]
    import importlib.metadata
    import platform

    expected = outside_supported({"python": platform.python_version(), "torch": importlib.metadata.version("torch")})
    assert [line for line in untested if not line.startswith("untested: triton")] == expected
    problem = triton_unavailable()
    if problem and "not installed" not in problem:  # a Triton the kernels refuse: said, in the kernels' words
        assert f"triton: {problem}" in proc.stdout.splitlines()
    else:
        assert not any(line.startswith("triton:") for line in proc.stdout.splitlines())


def test_the_kernel_choice_reads_the_installed_triton_once_per_process(monkeypatch):
    """resolve_kernel runs on every NSA op call (~10 per layer forward + backward): the installed Triton's version is
    read from the package metadata once per process, not per call (each read took ~0.25-1 ms of host time on this
    project's CPU VMs: half a layer's host path; bench/bench_host.py)."""
    import importlib.metadata

    import torch

    from nsa.attention.ops import resolve_kernel

    triton_unavailable()  # the process's one read (already made by any earlier NSA op)
    reads = []
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: reads.append(name) or real(name))
    for _ in range(20):
        resolve_kernel("auto", torch.device("cuda"))  # a device object only: no CUDA needed to ask
    assert reads == []
