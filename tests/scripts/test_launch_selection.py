"""scripts/train_m7c_prime.sh DRY_RUN=1 under a fake nvidia-smi: config choice by the largest GPU's
memory, the launcher (python for 0/1 GPU, torchrun --standalone over every visible GPU), the
environment knobs (CONFIG, DATASET, EXTRA_ARGS, NSA_* -> overrides, NCCL defaults) and the venv check."""
from __future__ import annotations

import subprocess

import pytest

from tests.scripts.helpers import (
    A100_40, A100_80, A6000, H100_80, REPO, RTX4090, V100_32, run_script, venv_python,
)


def dry(env) -> tuple[dict[str, str], subprocess.CompletedProcess]:
    res = run_script("train_m7c_prime.sh", env | {"DRY_RUN": "1"}, timeout=60)
    assert res.returncode == 0, res.stderr
    fields: dict[str, str] = {}
    for line in res.stdout.splitlines():
        key, _, value = line.partition(": ")
        if key == "env":
            fields[f"env:{value.split('=', 1)[0]}"] = value.split("=", 1)[1]
        else:
            fields[key] = value
    return fields, res


@pytest.mark.parametrize("gpus, config, nproc", [
    ([RTX4090], "configs/m7c_125m_24g.yaml", 1),
    ([V100_32], "configs/m7c_125m_24g.yaml", 1),            # 32 GiB = 34.4 GB < 35 GB
    ([A100_40], "configs/m7c_125m_40g.yaml", 1),
    ([A100_40, A100_40], "configs/m7c_125m_40g.yaml", 2),
    ([RTX4090, A6000], "configs/m7c_125m_40g.yaml", 2),     # the largest GPU decides
    ([A100_80], "configs/m7c_125m_80g.yaml", 1),
    ([A100_80, A100_80], "configs/m7c_125m_80g.yaml", 2),
    ([H100_80] * 8, "configs/m7c_125m_80g.yaml", 8),        # more than two GPUs are all used
    ([RTX4090] * 8, "configs/m7c_125m_24g.yaml", 8),
])
def test_config_and_launcher_follow_the_gpus(fake_smi, script_env, gpus, config, nproc):
    fields, _ = dry(script_env(fake_smi(gpus)))
    assert fields["config"].split(" ")[0] == config
    assert fields["gpus"].startswith(f"{nproc} |")
    launch = fields["launch"]
    if nproc >= 2:
        assert launch.startswith(f"{venv_python()} -m train.launch --standalone --nproc_per_node={nproc} -m train {config}")
        assert "--runtime.ddp_compress=bf16" in launch  # the M7C runbook's default for DDP
        assert fields["smoke"].startswith(f"{venv_python()} -m train.launch --standalone --nproc_per_node={nproc} -m train "
                                          "configs/train_showcase.yaml")
    else:
        assert launch.startswith(f"{venv_python()} -m train {config}")
        assert "torchrun" not in launch and "ddp_compress" not in launch
    assert "--train.steps=50" in fields["smoke"]


def test_no_gpu_means_the_cpu_config(script_env, fake_smi):
    fields, _ = dry(script_env())  # no nvidia-smi at all
    assert fields["config"] == "configs/m7c_cpu.yaml (no GPU found: CPU config)"
    assert fields["launch"] == f"{venv_python()} -m train configs/m7c_cpu.yaml"
    fields, res = dry(script_env(fake_smi([])))  # nvidia-smi present, "No devices were found"
    assert fields["config"].startswith("configs/m7c_cpu.yaml")
    assert "treating this machine as having no GPU" in res.stderr


def test_cuda_visible_devices_limits_the_gpus(fake_smi, script_env):
    bin_dir = fake_smi([RTX4090] * 6 + [A100_80] * 2)
    fields, _ = dry(script_env(bin_dir, CUDA_VISIBLE_DEVICES="6,7"))
    assert fields["config"].startswith("configs/m7c_125m_80g.yaml") and "--nproc_per_node=2" in fields["launch"]
    fields, _ = dry(script_env(bin_dir, CUDA_VISIBLE_DEVICES="0,1,2"))
    assert fields["config"].startswith("configs/m7c_125m_24g.yaml") and "--nproc_per_node=3" in fields["launch"]
    fields, _ = dry(script_env(bin_dir, CUDA_VISIBLE_DEVICES=""))
    assert fields["config"].startswith("configs/m7c_cpu.yaml")


def test_knobs_become_overrides(fake_smi, script_env):
    env = script_env(fake_smi([A100_80, A100_80]), CONFIG="configs/m7c_125m_40g.yaml", DATASET="text:data/*.txt",
                     EXTRA_ARGS="--train.steps=10  --train.lr=1e-4", SMOKE_STEPS="7", SMOKE_ARGS="--train.seq_len=32",
                     NSA_DDP_COMPRESS="fp16", NSA_DDP_BUCKET_MB="50", NSA_DDP_DISABLE_GC="1", NSA_PREFILL_BATCHED="1",
                     NSA_SEL_RANGES_V2="1", NCCL_DEBUG="INFO")
    fields, res = dry(env)
    assert fields["config"] == "configs/m7c_125m_40g.yaml (forced by CONFIG)"
    assert fields["launch"] == (
        f"{venv_python()} -m train.launch --standalone --nproc_per_node=2 -m train configs/m7c_125m_40g.yaml "
        "--data.source=text:data/\\*.txt --runtime.ddp_compress=fp16 --runtime.ddp_bucket_mb=50 "
        "--runtime.disable_gc=true --train.steps=10 --train.lr=1e-4")
    assert "--train.steps=7 --train.seq_len=32" in fields["smoke"]
    # the M7C runbook's NCCL settings are exported; the caller's value wins
    assert fields["env:NCCL_P2P_DISABLE"] == "1" and fields["env:NCCL_IB_DISABLE"] == "1"
    assert fields["env:TORCH_NCCL_BLOCKING_WAIT"] == "1" and fields["env:NCCL_DEBUG"] == "INFO"
    assert fields["env:PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    # the no-op knobs are accepted with a one-line note each
    notes = [line for line in res.stderr.splitlines() if "note:" in line]
    assert len(notes) == 2 and "NSA_PREFILL_BATCHED" in notes[0] and "NSA_SEL_RANGES_V2" in notes[1]


def test_smoke_can_be_skipped(script_env):
    fields, _ = dry(script_env(SMOKE_STEPS="0"))
    assert fields["smoke"] == "skipped (SMOKE_STEPS=0)"


@pytest.mark.parametrize("var, value", [("NSA_DDP_BUCKET_MB", "big"), ("SMOKE_STEPS", "-1")])
def test_bad_knob_values_fail_with_one_line(script_env, var, value):
    res = run_script("train_m7c_prime.sh", script_env(DRY_RUN="1", **{var: value}), timeout=60)
    assert res.returncode != 0
    errors = [line for line in res.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and var in errors[0]


def test_env_overrides_come_from_the_trainers_table(script_env):
    """scripts/lib/env_overrides.sh prints, one per line, what train/core/env.py (the one table) maps the
    environment to; nothing when no NSA_* knob is set."""
    def overrides(**env):
        cmd = "set -euo pipefail; PY=.venv/bin/python; source scripts/lib/env_overrides.sh; nsa_env_overrides"
        res = subprocess.run(["bash", "-c", cmd], cwd=REPO, env=script_env(**env), text=True, capture_output=True,
                             timeout=30)
        assert res.returncode == 0, res.stderr
        return res.stdout.splitlines(), res.stderr
    assert overrides() == ([], "")
    out, _ = overrides(NSA_DDP_COMPRESS="BF16", NSA_DDP_BUCKET_MB="25", NSA_DDP_DISABLE_GC="1")
    assert out == ["--runtime.ddp_compress=bf16", "--runtime.ddp_bucket_mb=25", "--runtime.disable_gc=true"]
    out, err = overrides(NSA_NVTX="1", NSA_SDPA_AUDIT="1")
    assert out == ["--runtime.nvtx=true", "--runtime.sdpa_audit=true"] and err == ""


def test_missing_venv_is_a_clear_error(script_env, tmp_path):
    res = run_script("train_m7c_prime.sh", script_env(DRY_RUN="1", VENV=str(tmp_path / "no-venv")), timeout=60)
    assert res.returncode == 1
    assert res.stderr.strip().endswith("run bash scripts/prime_bootstrap.sh")
    assert res.stdout == ""
