"""scripts/train_m7c_prime.sh end to end on CPU (no GPU: configs/m7c_cpu.yaml, tiny overrides):
a failing smoke stops everything; a real-text run (the KJV corpus, byte tokenizer) with its run dir,
a graceful .HALT, the leftover-.HALT guard, an automatic resume from the checkpoint, the monitor
showing the run and a handoff tarball holding what its manifest lists."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from tests.scripts.helpers import REPO, TINY_SMOKE, TINY_TRAIN, kv_file, only_run_dir, run_script, venv_python

PY = sys.executable  # the venv's python (under the suite, the fork server's: tests/forkserver.py)


def data_rows(csv_path: Path) -> int:
    if not csv_path.exists():
        return 0
    return max(0, len(csv_path.read_text().strip().splitlines()) - 1)


def test_failing_smoke_stops_the_runner(script_env, tmp_path):
    out = tmp_path / "out"
    env = script_env(SMOKE_STEPS="2", SMOKE_ARGS=f"{TINY_SMOKE} --train.no_such_key=1",
                     EXTRA_ARGS=f"--train.out_dir={out} {TINY_TRAIN}")
    res = run_script("train_m7c_prime.sh", env)
    assert res.returncode == 1
    assert "smoke test failed (exit 2" in res.stderr and "training not started" in res.stderr
    run_dir = only_run_dir(tmp_path / "artifacts")
    assert "no_such_key" in (run_dir / "smoke.log").read_text()
    info = kv_file(run_dir / "run.info")
    assert info["smoke"].startswith("FAILED (exit 2") and info["exit_code"] == "1"
    assert not (run_dir / "train.log").exists()
    assert not (out / "training.csv").exists()


@pytest.mark.parametrize("knob, message", [({"EXTRA_ARGS": "--train.steps=-3"}, "train.steps must be positive"),
                                           ({"NSA_DDP_COMPRESS": "int8"}, "runtime.ddp_compress='int8'")])
def test_bad_config_fails_before_anything_runs(script_env, tmp_path, knob, message):
    res = run_script("train_m7c_prime.sh", script_env(**knob), timeout=120)
    assert res.returncode == 2
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("[train_m7c] error: config configs/m7c_cpu.yaml: ") and message in last
    assert not (tmp_path / "artifacts" / "train_runs").exists()


def test_train_halt_resume_monitor_handoff(script_env, corpus_path, tmp_path):
    out = tmp_path / "out"
    common = (f"--train.out_dir={out} {TINY_TRAIN} --train.steps=100000 --train.log_every=1 "
              "--train.eval_every=0 --train.save_every=0 --train.eval_steps=1 --train.warmup_steps=2")
    env = script_env(SMOKE_STEPS="3", SMOKE_ARGS=TINY_SMOKE, DATASET=f"text:{corpus_path}", EXTRA_ARGS=common)

    # 1. first launch: smoke, then real-text training until the operator touches .HALT
    log1 = open(tmp_path / "first.log", "w")
    proc = subprocess.Popen(["bash", "scripts/train_m7c_prime.sh"], cwd=REPO, env=env, stdout=log1,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 180
        while data_rows(out / "training.csv") < 2:
            assert proc.poll() is None, (tmp_path / "first.log").read_text()
            assert time.time() < deadline, "training never logged"
            time.sleep(0.2)
        (out / ".HALT").touch()
        assert proc.wait(timeout=180) == 0, (tmp_path / "first.log").read_text()
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait()
        log1.close()
    run1 = only_run_dir(tmp_path / "artifacts")
    info1 = kv_file(run1 / "run.info")
    assert info1["config"] == "configs/m7c_cpu.yaml" and info1["config_reason"] == "no GPU found: CPU config"
    assert info1["gpu_count"] == "0" and info1["out_dir"] == str(out)
    assert info1["smoke"].startswith("ok (3 steps") and info1["resume_from"].startswith("none (fresh start")
    assert info1["final_status"] == "stopped" and info1["exit_code"] == "0"
    assert info1["git_sha"] and info1["torch"].startswith("2.") and "started" in info1 and "end" in info1
    assert info1["train_cmd"].startswith(f"{venv_python()} -m train configs/m7c_cpu.yaml --data.source=text:")
    assert "step" in (run1 / "train.log").read_text() and "done" in (run1 / "smoke.log").read_text()
    assert not list((run1 / "smoke").glob("*.pt"))  # smoke weights are dropped
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["status"] == "stopped" and metrics["data"]["source"] == f"text:{corpus_path}"
    halted_at = metrics["step"]
    checkpoint = out / f"checkpoint_step{halted_at}.pt"
    assert checkpoint.exists()

    # 2. a leftover .HALT is refused (it would stop the new run at once)
    res = run_script("train_m7c_prime.sh", env | {"SMOKE_STEPS": "0"})
    assert res.returncode == 2 and ".HALT exists" in res.stderr and "rm " in res.stderr
    assert len(list((tmp_path / "artifacts" / "train_runs").iterdir())) == 1

    # 3. remove it and launch again: resumes from the checkpoint (recorded in run.info), 2 more steps
    (out / ".HALT").unlink()
    res = run_script("train_m7c_prime.sh", env | {"SMOKE_STEPS": "0", "EXTRA_ARGS": f"{common} --train.stop_after=2"})
    assert res.returncode == 0, res.stderr + res.stdout
    run2 = max((tmp_path / "artifacts" / "train_runs").iterdir())
    info2 = kv_file(run2 / "run.info")
    assert info2["resume_from"] == str(checkpoint) and info2["smoke"] == "skipped (SMOKE_STEPS=0)"
    assert not (run2 / "smoke.log").exists()
    starts = [json.loads(line) for line in (out / "heartbeat_rank0.jsonl").read_text().splitlines()
              if '"start"' in line]
    assert starts[-1]["resumed_from"] == str(checkpoint) and starts[-1]["step"] == halted_at
    assert json.loads((out / "metrics.json").read_text())["step"] == halted_at + 2
    assert f"resumed at step {halted_at}" in (run2 / "train.log").read_text()

    # 4. the monitor shows the run
    res = run_script("monitor_run.sh", env, "--once", str(run2), timeout=60)
    assert res.returncode == 0, res.stderr
    frame = res.stdout
    assert f"== {out}  (run {run2})" in frame
    assert "status      stopped" in frame
    assert f"progress    step {halted_at + 2:,} / 100,000" in frame
    assert f"checkpoint  checkpoint_step{halted_at + 2}.pt" in frame
    assert f"resume {checkpoint}" in frame

    # 5. handoff of the first run dir: the tarball holds what its MANIFEST lists
    res = subprocess.run([PY, "scripts/handoff.py", str(run1), "--out-dir", str(tmp_path / "handoff")], cwd=REPO,
                         text=True, capture_output=True, timeout=120)
    assert res.returncode == 0, res.stderr
    tar_path = Path(res.stdout.strip().splitlines()[-1].split()[1])
    with tarfile.open(tar_path) as tar:
        members = {m.name.split("/", 1)[1]: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    manifest = members.pop("MANIFEST.txt").decode()
    listed = {}
    section = None
    for line in manifest.splitlines():
        if line.startswith("#"):
            section = "files" if line.startswith("# files") else "ckpt" if line.startswith("# checkpoints") else section
            continue
        size, digest, path = line.split()
        listed.setdefault(section, {})[path] = (int(size), digest)
    assert set(listed["files"]) == set(members)
    for path, (size, digest) in listed["files"].items():
        assert len(members[path]) == size and hashlib.sha256(members[path]).hexdigest() == digest
    for path in ("run/run.info", "run/smoke.log", "run/train.log", "out/training.csv", "out/metrics.json",
                 "out/config.yaml", "out/heartbeat_rank0.jsonl", "checkpoints.json", "plots/loss.png"):
        assert path in members, path
    final = out / f"checkpoint_step{halted_at + 2}.pt"
    assert listed["ckpt"][final.name] == (final.stat().st_size, hashlib.sha256(final.read_bytes()).hexdigest())


def signal_the_launch(env: dict, out: Path, tmp_path: Path, sig: int) -> None:
    """Start the runner in its own session, wait for two logged steps, send `sig` to the whole group
    (as Ctrl-C or a scheduler does) and require exit 0."""
    with open(tmp_path / "launcher.log", "w") as log:
        proc = subprocess.Popen(["bash", "scripts/train_m7c_prime.sh"], cwd=REPO, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.time() + 120
            while data_rows(out / "training.csv") < 2:
                assert proc.poll() is None and time.time() < deadline, (tmp_path / "launcher.log").read_text()
                time.sleep(0.2)
            os.killpg(proc.pid, sig)
            assert proc.wait(timeout=120) == 0, (tmp_path / "launcher.log").read_text()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_ctrl_c_stops_gracefully(script_env, tmp_path):
    """Ctrl-C in the tmux pane (SIGINT to the whole foreground group): the trainer checkpoints and
    exits 0, the log writer survives (tee -i), the launcher records the end in run.info."""
    out = tmp_path / "out"
    env = script_env(SMOKE_STEPS="0", EXTRA_ARGS=f"--train.out_dir={out} {TINY_TRAIN} --train.steps=100000 "
                                                 "--train.log_every=1 --train.eval_every=0 --train.save_every=0")
    signal_the_launch(env, out, tmp_path, signal.SIGINT)
    info = kv_file(only_run_dir(tmp_path / "artifacts") / "run.info")
    assert info["final_status"] == "stopped" and info["exit_code"] == "0" and "end" in info
    assert info["last_checkpoint"] == str(out / f"checkpoint_step{info['final_step']}.pt")
    assert "(SIGINT)" in (only_run_dir(tmp_path / "artifacts") / "train.log").read_text()


def test_anomaly_halt_exits_3_and_the_monitor_says_why(script_env, tmp_path):
    """An absurd learning rate makes the losses non-finite: the trainer halts itself (.anomaly_type),
    the launcher exits 3 and records why, the monitor raises the NaN alerts from the real files."""
    out = tmp_path / "out"
    env = script_env(SMOKE_STEPS="0", EXTRA_ARGS=f"--train.out_dir={out} {TINY_TRAIN} --train.steps=50 "
                                                 "--train.log_every=1 --train.lr=1e30 --train.warmup_steps=0 "
                                                 "--train.grad_clip=0")
    res = run_script("train_m7c_prime.sh", env)
    assert res.returncode == 3, res.stderr
    assert "training halted on an anomaly (nonfinite_loss" in res.stderr.strip().splitlines()[-1]
    run_dir = only_run_dir(tmp_path / "artifacts")
    info = kv_file(run_dir / "run.info")
    assert info["exit_code"] == "3" and info["final_status"] == "anomaly"
    assert info["failure"].startswith("anomaly halt: nonfinite_loss")
    frame = run_script("monitor_run.sh", env, "--once", str(run_dir), timeout=60).stdout
    assert "ANOMALY: nonfinite_loss" in frame and "! nan: non-finite loss at step" in frame


def test_sigterm_to_a_torchrun_launch_is_a_graceful_stop(fake_smi, script_env, tmp_path):
    """A scheduler's SIGTERM to the whole job under torchrun (2 ranks): both ranks stop after the
    same step and checkpoint; the launcher (train/launch.py) reports its own signal in one line as exit 143, with no
    traceback, which the runner reads against this launch's metrics.json (stopped) and turns into exit 0."""
    from tests.scripts.helpers import A6000

    out = tmp_path / "out"
    env = script_env(fake_smi([A6000, A6000]), SMOKE_STEPS="0", NSA_DDP_COMPRESS="none",
                     CONFIG="configs/train_showcase.yaml", DATASET="synthetic",
                     EXTRA_ARGS=f"--train.out_dir={out} {TINY_TRAIN} --model.vocab_size=256 --runtime.device=cpu "
                                "--train.steps=100000 "
                                "--train.log_every=1 --train.eval_every=0 --train.save_every=0")
    signal_the_launch(env, out, tmp_path, signal.SIGTERM)
    info = kv_file(only_run_dir(tmp_path / "artifacts") / "run.info")
    assert info["final_status"] == "stopped" and info["exit_code"] == "0"
    assert info["last_checkpoint"] == str(out / f"checkpoint_step{info['final_step']}.pt")
    log = (only_run_dir(tmp_path / "artifacts") / "train.log").read_text()
    assert "launch: SIGTERM received and passed to the workers" in log and "Traceback" not in log, log[-3000:]
    ends = [json.loads((out / f"heartbeat_rank{r}.jsonl").read_text().splitlines()[-1]) for r in (0, 1)]
    assert [e["kind"] for e in ends] == ["end", "end"] and ends[0]["step"] == ends[1]["step"]
