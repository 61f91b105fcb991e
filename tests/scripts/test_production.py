"""scripts/production_50k_launch.sh -> scripts/run_2xa100_production.sh under a fake nvidia-smi:
the pre-flight (GPUs idle and never killed, the NSA correctness suite, config assertions, disk for
the kept checkpoints), launch_info.txt and the torchrun command over every GPU (DRY_RUN=1)."""
from __future__ import annotations

import hashlib
import subprocess
import sys

from tests.scripts.helpers import A100_80, H100_80, REPO, kv_file, only_run_dir, run_script, venv_python

PROD_CONFIG = "configs/m7c_125m_2xa100_production.yaml"
# The production config keeps 10 checkpoints (~16 GB with the temporary one): more than a CI machine's
# disk may hold. Tests that pass the pre-flight keep one (~2.9 GB); the disk refusal has its own test.
KEEP_ONE = "--train.keep_last=1"


def causality_script(tmp_path, passed: bool = True):
    """A stand-in for scripts/run_gpu_causality_test.sh that records its arguments."""
    path = tmp_path / "causality.sh"
    summary = "causality: 3/3 passed, 1 skipped" if passed else "causality: 2/3 passed, 1 skipped"
    path.write_text(f'#!/usr/bin/env bash\necho "$*" >"{tmp_path}/causality.args"\necho "{summary}"\n'
                    f"exit {0 if passed else 1}\n")
    return path


def test_launch_preflight_and_launch_info(fake_smi, script_env, tmp_path):
    out_dir = tmp_path / "prod_out"
    env = script_env(fake_smi([A100_80, A100_80]), DRY_RUN="1", CAUSALITY_SCRIPT=causality_script(tmp_path),
                     CAUSALITY_ARGS="--full", EXTRA_ARGS=f"--train.out_dir={out_dir} {KEEP_ONE}",
                     NSA_PREFILL_BATCHED="1")
    res = run_script("production_50k_launch.sh", env)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "causality.args").read_text().strip() == "--full"
    run_dir = only_run_dir(tmp_path / "artifacts")
    assert run_dir.name.startswith("m7c_prod50k_")
    info = kv_file(run_dir / "run.info")
    assert info["preflight"] == "ok" and info["out_dir"] == str(out_dir)
    assert info["causality"] == "causality: 3/3 passed, 1 skipped"
    assert info["resume_from"].startswith("none (fresh start")
    # checkpoint estimate: params x 4 bytes x 3 (weights + AdamW moments); 121.7M params -> 1.46 GB
    assert "params 121657776" in info["disk"] and "checkpoint ~1.46 GB" in info["disk"] and "keep 1 (+1 temporary" in info["disk"]
    launch = kv_file(run_dir / "launch_info.txt")
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert launch["git_sha"] == sha
    assert launch["config_sha256"] == hashlib.sha256((REPO / PROD_CONFIG).read_bytes()).hexdigest()
    expected = (f"{venv_python()} -m train.launch --standalone --nproc_per_node=2 -m train {PROD_CONFIG} "
                f"--runtime.ddp_compress=bf16 --runtime.ddp_bucket_mb=25 --train.out_dir={out_dir} {KEEP_ONE}")
    assert launch["command"] == expected
    assert f"launch: {expected}" in res.stdout
    text = (run_dir / "launch_info.txt").read_text()
    for var in ("NCCL_ALGO=Ring", "NCCL_PROTO=Simple", "NCCL_IB_DISABLE=1", "NSA_DDP_COMPRESS=bf16",
                "NSA_PREFILL_BATCHED=1", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"):
        assert var in text.splitlines(), var
    notes = [line for line in res.stderr.splitlines() if "note:" in line]
    assert len(notes) == 1 and "NSA_PREFILL_BATCHED" in notes[0]  # once, not again in the hand-over
    assert "DRY_RUN=1: pre-flight passed; not launching" in res.stdout
    assert not (run_dir / "train.log").exists()


def test_direct_launch_runs_its_own_preflight_on_all_gpus(fake_smi, script_env, tmp_path):
    out_dir = tmp_path / "prod_out"
    env = script_env(fake_smi([H100_80] * 8), DRY_RUN="1", SKIP_CAUSALITY="1", NSA_DDP_COMPRESS="none",
                     EXTRA_ARGS=f"--train.out_dir={out_dir} {KEEP_ONE}")
    res = run_script("run_2xa100_production.sh", env)
    assert res.returncode == 0, res.stderr
    assert "pre-flight (run directly" in res.stdout
    launch = kv_file(only_run_dir(tmp_path / "artifacts") / "launch_info.txt")
    assert launch["command"].startswith(f"{venv_python()} -m train.launch --standalone --nproc_per_node=8 -m train {PROD_CONFIG} "
                                        "--runtime.ddp_compress=none --runtime.ddp_bucket_mb=25")
    assert launch["causality"] == "skipped (SKIP_CAUSALITY=1)"


def test_busy_gpus_are_reported_and_never_killed(fake_smi, script_env, tmp_path):
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        apps = f"GPU-fake-0, {victim.pid}, python train_showcase.py, 30000\n"
        env = script_env(fake_smi([A100_80, A100_80], apps=apps), SKIP_CAUSALITY="1", FAKE_GPU_USED_MIB="30000")
        res = run_script("production_50k_launch.sh", env, timeout=60)
        assert res.returncode == 1
        assert f"gpu process: GPU-fake-0, {victim.pid}, python train_showcase.py, 30000" in res.stdout
        assert "gpu 0 busy: 30000 MiB in use" in res.stdout
        assert "GPUs are not idle" in res.stderr and "never kills" in res.stderr
        assert victim.poll() is None  # still alive
        run_dir = only_run_dir(tmp_path / "artifacts")
        assert kv_file(run_dir / "run.info")["preflight"].startswith("FAILED: GPUs are not idle")
        assert not (run_dir / "launch_info.txt").exists()
    finally:
        victim.kill()
        victim.wait()


def test_failing_correctness_suite_stops_the_launch(fake_smi, script_env, tmp_path):
    env = script_env(fake_smi([A100_80, A100_80]), CAUSALITY_SCRIPT=causality_script(tmp_path, passed=False))
    res = run_script("production_50k_launch.sh", env, timeout=60)
    assert res.returncode == 1
    assert "NSA correctness suite failed (exit 1, causality: 2/3 passed, 1 skipped)" in res.stderr
    run_dir = only_run_dir(tmp_path / "artifacts")
    assert (run_dir / "causality.log").read_text().strip() == "causality: 2/3 passed, 1 skipped"
    assert not (run_dir / "launch_info.txt").exists()


def test_missing_correctness_suite_is_an_error(fake_smi, script_env, tmp_path):
    env = script_env(fake_smi([A100_80]), CAUSALITY_SCRIPT=str(tmp_path / "nope.sh"))
    res = run_script("production_50k_launch.sh", env, timeout=60)
    assert res.returncode == 1 and "SKIP_CAUSALITY=1" in res.stderr


def test_config_assertions(fake_smi, script_env, tmp_path):
    env = script_env(fake_smi([A100_80, A100_80]), SKIP_CAUSALITY="1", EXPECT_STEPS="60000",
                     EXTRA_ARGS=f"--train.out_dir={tmp_path}/o --runtime.precision=fp32 --train.save_every=0")
    res = run_script("production_50k_launch.sh", env)
    assert res.returncode == 1
    err = res.stderr.strip().splitlines()[-1]
    assert kv_file(only_run_dir(tmp_path / "artifacts") / "run.info")["preflight"].startswith("FAILED: config")
    assert "runtime.precision=fp32 (expected bf16)" in err
    assert "train.save_every=0 (expected > 0" in err
    assert "train.steps=50000 (expected 60000" in err


def test_disk_space_for_kept_checkpoints(fake_smi, script_env, tmp_path):
    env = script_env(fake_smi([A100_80, A100_80]), SKIP_CAUSALITY="1",
                     EXTRA_ARGS=f"--train.out_dir={tmp_path}/o --train.keep_last=1000000")
    res = run_script("production_50k_launch.sh", env)
    assert res.returncode == 1
    assert "not enough disk for checkpoints" in res.stderr and "keep 1000000" in res.stderr


def test_bad_config_is_recorded(fake_smi, script_env, tmp_path):
    env = script_env(fake_smi([A100_80]), SKIP_CAUSALITY="1", NSA_DDP_BUCKET_MB="50", EXTRA_ARGS="--train.nope=1")
    res = run_script("run_2xa100_production.sh", env)
    assert res.returncode == 2 and "unknown key 'nope'" in res.stderr.strip().splitlines()[-1]
    info = kv_file(only_run_dir(tmp_path / "artifacts") / "run.info")
    assert info["preflight"] == "FAILED (exit 2; see the launcher's output)" and info["exit_code"] == "2"


def test_no_gpu_refuses(script_env):
    res = run_script("production_50k_launch.sh", script_env(SKIP_CAUSALITY="1"), timeout=60)
    assert res.returncode == 1 and "no NVIDIA GPU visible" in res.stderr
