"""A leftover OUT_DIR/.HALT: one message (train/trainer/safety.py), printed by `python -m train.safety check-halt`
and used by the runners' guards (scripts/lib/common.sh check_halt, scripts/lib/production.sh)."""
from __future__ import annotations

import subprocess
import sys

from tests.scripts.helpers import A100_80, REPO, kv_file, only_run_dir, run_script
from train.trainer.safety import stale_halt_message


def check_halt_cli(out) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "train.safety", "check-halt", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def test_message_and_cli(tmp_path):
    out = tmp_path / "it's a run"
    out.mkdir()
    assert stale_halt_message(out) is None
    res = check_halt_cli(out)
    assert res.returncode == 0 and res.stderr == "" and res.stdout == ""
    (out / ".HALT").touch()
    msg = stale_halt_message(out)
    assert msg.startswith(f"{out}/.HALT exists (a graceful stop was requested earlier); remove it to resume: rm ")
    removal = subprocess.run(["bash", "-c", msg.split("remove it to resume: ", 1)[1]], capture_output=True)
    assert removal.returncode == 0 and not (out / ".HALT").exists()  # the quoted rm works as printed
    (out / ".HALT").touch()
    res = check_halt_cli(out)
    assert res.returncode == 2 and res.stderr == f"error: {msg}\n" and res.stdout == ""
    assert check_halt_cli(tmp_path / "missing").returncode == 0  # no out_dir yet: nothing stale
    usage = subprocess.run([sys.executable, "-m", "train.safety"], cwd=REPO, capture_output=True, text=True)
    assert usage.returncode == 2 and usage.stderr.startswith("usage: python -m train.safety check-halt")


def test_common_check_halt_prints_the_trainers_line(tmp_path, script_env):
    out = tmp_path / "out"
    out.mkdir()
    script = 'SCRIPT_TAG=t; source scripts/lib/common.sh; check_halt "$1"; echo passed'
    res = subprocess.run(["bash", "-c", script, "_", str(out)], cwd=REPO, env=script_env(), capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0 and res.stdout == "passed\n", res.stderr
    (out / ".HALT").touch()
    res = subprocess.run(["bash", "-c", script, "_", str(out)], cwd=REPO, env=script_env(), capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2 and res.stdout == ""  # bad input: exit 2, as docs/RUNBOOK.md says
    assert res.stderr == f"[t] error: {stale_halt_message(out)}\n"


def test_production_preflight_refuses_a_stale_halt(fake_smi, script_env, tmp_path):
    out = tmp_path / "prod_out"
    out.mkdir()
    (out / ".HALT").touch()
    env = script_env(fake_smi([A100_80, A100_80]), DRY_RUN="1", SKIP_CAUSALITY="1",
                     EXTRA_ARGS=f"--train.out_dir={out} --train.keep_last=1")  # ~2.9 GB of disk, not 16 GB
    res = run_script("production_50k_launch.sh", env)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1].endswith(f"error: {stale_halt_message(out)}")
    info = kv_file(only_run_dir(tmp_path / "artifacts") / "run.info")
    assert info["preflight"] == f"FAILED: {stale_halt_message(out)}" and info["exit_code"] == "2"


def test_a_failed_launch_drops_an_out_dir_holding_only_its_locks(tmp_path, script_env):
    script = 'SCRIPT_TAG=t; source scripts/lib/common.sh; drop_lock_only_out_dir "$1" "$2"'
    new, kept, used = tmp_path / "new", tmp_path / "kept", tmp_path / "used"
    for d in (new, kept, used):
        d.mkdir()
        (d / ".lock").write_text("{}")
        (d / ".launch.lock").write_text("")
    (used / "training.csv").write_text("step\n")
    for d, existed in ((new, "0"), (kept, "1"), (used, "0")):
        res = subprocess.run(["bash", "-c", script, "_", str(d), existed], cwd=REPO, env=script_env(),
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
    assert not new.exists()  # created by the launch, holds nothing else
    assert (kept / ".lock").exists() and (used / "training.csv").exists()  # there before / holds a run
