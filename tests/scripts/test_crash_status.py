"""A crashed run reads as crashed everywhere an operator looks, at once: kill -9 the real trainer under the
M7C runner (and without one), then ask run.info, metrics.json, the monitor and the handoff. The relaunch
resumes without a second smoke and records only its own facts; a misspelled data source costs nothing."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from tests.scripts.helpers import REPO, TINY_SMOKE, TINY_TRAIN, kv_file, only_run_dir, run_script

PY = sys.executable  # the venv's python (under the suite, the fork server's: tests/forkserver.py)


def rows(csv_path: Path) -> list[str]:
    return csv_path.read_text().strip().splitlines()[1:] if csv_path.exists() else []


def wait_for_rows(proc: subprocess.Popen, out: Path, n: int, log: Path) -> None:
    deadline = time.time() + 180
    while len(rows(out / "training.csv")) < n or not list(out.glob("checkpoint_step*.pt")):
        assert proc.poll() is None and time.time() < deadline, log.read_text()
        time.sleep(0.2)


def kill9_the_trainer(out: Path) -> int:
    pid = json.loads((out / ".lock").read_text())["pid"]  # the owner the trainer recorded (train/checkpoint/run_dir.py)
    os.kill(pid, signal.SIGKILL)
    return pid


def last_step(out: Path) -> int:
    return int(rows(out / "training.csv")[-1].split(",")[0])


def test_kill9_under_the_runner_reads_crashed_everywhere_and_the_relaunch_resumes(script_env, tmp_path):
    out = tmp_path / "out"
    common = (f"--train.out_dir={out} {TINY_TRAIN} --train.log_every=1 --train.eval_every=0 "
              "--train.save_every=2 --train.warmup_steps=2")
    env = script_env(SMOKE_STEPS="2", SMOKE_ARGS=TINY_SMOKE, STALE_S="100000",
                     EXTRA_ARGS=f"{common} --train.steps=100000")
    log = tmp_path / "launcher.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(["bash", "scripts/train_m7c_prime.sh"], cwd=REPO, env=env, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for_rows(proc, out, 3, log)
            kill9_the_trainer(out)
            assert proc.wait(timeout=120) == 137, log.read_text()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    step = last_step(out)
    said = f"crashed (exit 137 at step {step})"
    assert log.read_text().strip().splitlines()[-1].startswith(f"[train_m7c] error: training {said}: see ")
    run_dir = only_run_dir(tmp_path / "artifacts")
    info = kv_file(run_dir / "run.info")
    assert info["final_status"] == said and info["exit_code"] == "137" and info["final_step"] == str(step)
    metrics = json.loads((out / "metrics.json").read_text())
    assert (metrics["status"], metrics["exit_code"], metrics["crashed_at_step"]) == ("crashed", 137, step)

    frame = run_script("monitor_run.sh", env, "--once", str(run_dir), timeout=60).stdout
    assert f"status      {said}" in frame and "ETA" not in frame
    assert "! crashed: the trainer is gone" in frame and "alerts      none" not in frame

    handoff = subprocess.run([PY, "scripts/handoff.py", str(run_dir), "--out-dir", str(tmp_path / "handoff")], cwd=REPO,
                             env=env, capture_output=True, text=True, timeout=120)
    assert handoff.returncode == 0, handoff.stderr
    (tarball,) = (tmp_path / "handoff").glob("*.tar.gz")
    with tarfile.open(tarball) as tar:
        manifest = next(m for m in tar.getmembers() if m.name.endswith("MANIFEST.txt"))
        assert f"# status: {said}" in tar.extractfile(manifest).read().decode()

    # the relaunch: resumes from the newest checkpoint, no second smoke, and its run.info holds its own facts
    newest = max(out.glob("checkpoint_step*.pt"), key=lambda p: int(p.stem.removeprefix("checkpoint_step")))
    res = run_script("train_m7c_prime.sh", env | {"EXTRA_ARGS": f"{common} --train.steps=100000 --train.stop_after=1"})
    assert res.returncode == 0, res.stderr
    run2 = max((tmp_path / "artifacts" / "train_runs").iterdir())
    info2 = kv_file(run2 / "run.info")
    assert info2["resume_from"] == str(newest) and info2["smoke"].startswith("skipped (resuming")
    assert not (run2 / "smoke.log").exists()
    assert info2["final_status"] == "stopped" and info2["final_step"] == str(int(newest.stem[15:]) + 1)
    assert json.loads((out / "metrics.json").read_text())["status"] == "stopped"


def test_kill9_without_a_launcher_reads_crashed_at_once(tmp_path):
    out = tmp_path / "out"
    cmd = [PY, "-m", "train", "configs/train_showcase.yaml", *TINY_TRAIN.split(), f"--train.out_dir={out}",
           "--train.steps=100000", "--train.log_every=1", "--train.save_every=2"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_for_rows(proc, out, 2, Path(os.devnull))
        describe = [PY, "-m", "train.run_status", "describe", str(out)]
        assert subprocess.run(describe, cwd=REPO, capture_output=True, text=True).stdout.strip() == "running"
        kill9_the_trainer(out)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    said = f"crashed (process gone, exit code unknown at step {last_step(out)})"
    assert subprocess.run(describe, cwd=REPO, capture_output=True, text=True).stdout.strip() == said
    frame = subprocess.run([PY, "scripts/monitor_frame.py", str(out), "--stale-s", "100000"], cwd=REPO,
                           capture_output=True, text=True, timeout=60).stdout
    assert f"status      {said}" in frame and "ETA" not in frame
    assert json.loads((out / "metrics.json").read_text())["status"] == "running"  # nobody wrote it: read-only tools


def test_a_misspelled_data_source_fails_before_the_smoke_and_writes_nothing(script_env, tmp_path):
    out = tmp_path / "out"
    env = script_env(SMOKE_STEPS="50", DATASET="text:/no/such/corpus/*.txt", EXTRA_ARGS=f"--train.out_dir={out}")
    t0 = time.time()
    res = run_script("train_m7c_prime.sh", env, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1] == \
        "[train_m7c] error: text:/no/such/corpus/*.txt: the pattern matched no files"
    assert not (tmp_path / "artifacts" / "train_runs").exists() and not out.exists()
    assert time.time() - t0 < 60  # no 50-step smoke ran first


def test_config_a_directory_or_missing_exits_2(script_env, tmp_path):
    for config, words in (("configs", "is a directory"), ("configs/no_such.yaml", "not found")):
        res = run_script("train_m7c_prime.sh", script_env(CONFIG=config), timeout=60)
        assert res.returncode == 2 and words in res.stderr.strip().splitlines()[-1], res.stderr
