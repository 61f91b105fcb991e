"""Preflight refuses exactly what the launch refuses, in the launch's words: each fault is planted for real
(a real checkpoint of another architecture, a real live trainer holding the out_dir, ...) and both the
pre-flight checklist and a real `python -m train` launch are asked."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.train.helpers import TINY_MODEL
from train.core.config import load_config
from train.workflows.preflight import OK, run_preflight
from train.trainer.start_checks import BatchSplit, fit_global_batch, start_checks

REPO = Path(__file__).resolve().parents[2]
BASE = TINY_MODEL + ["--train.seq_len=32", "--train.log_every=1", "--runtime.device=cpu",
                     "--runtime.threads=1", "--data.source=synthetic", "--train.save_every=4"]
# the batch comes from the YAML, as in a runbook config: a command-line batch would be an explicit choice
CONFIG = REPO / "tests" / "tools" / "start_checks.yaml"
NSA = ["--model.attention=nsa", "--nsa.l=8", "--nsa.d=4", "--nsa.l_sel=16", "--nsa.n_sel=3", "--nsa.w=32"]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def launch(out: Path, *args: str, wait: bool = True):
    cmd = [sys.executable, "-m", "train", str(CONFIG), *BASE, f"--train.out_dir={out}", *args]
    if not wait:
        return subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=240)


def preflight(out: Path, *args: str, gpus: int = 1):
    cfg = load_config(CONFIG, BASE + [f"--train.out_dir={out}", *args])
    return run_preflight(cfg, gpus=gpus, free_bytes=lambda p: 10**15,
                         env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, cuda=False)


def refusal(result) -> str:
    failed = result.failures
    assert failed, result.render()
    return failed[0].detail


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory) -> Path:
    """A real dense run: 4 steps, checkpoint at step 4."""
    out = tmp_path_factory.mktemp("start") / "out"
    proc = launch(out, "--train.steps=4")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def snapshot(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file() and p.name != ".lock"}


@pytest.mark.parametrize("args, words", [
    (NSA + ["--train.steps=8"], "does not match the config's architecture"),  # dense checkpoint, NSA config
    (["--train.steps=2"], "train.steps=2 is below the step of checkpoint"),  # the run would "finish" at once
    (["--train.steps=8", "--data.tokenizer=byte"], "was trained on data.tokenizer=gpt2"),
], ids=["architecture", "steps-below-checkpoint", "tokenizer"])
def test_preflight_fails_with_the_line_the_launch_exits_2_with(dense_run, args, words):
    before = snapshot(dense_run)
    detail = refusal(preflight(dense_run, *args))
    assert words in detail
    proc = launch(dense_run, *args)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == f"error: {detail}"
    assert snapshot(dense_run) == before  # nothing rewritten: config.yaml, metrics.json, CSVs, checkpoints


def test_preflight_names_the_batch_split_a_resume_on_more_ranks_uses(dense_run):
    result = preflight(dense_run, "--train.steps=8", gpus=2)
    (resume,) = result.find("resume")
    assert resume.status == OK, result.render()
    assert "keeping the checkpoint's global batch 4 on 2 rank(s): train.batch_size 2 x accumulate_grad_batches 1" \
        in resume.detail
    detail = refusal(preflight(dense_run, "--train.steps=8", gpus=3))
    assert "global batch 4, which 3 rank(s) cannot split evenly; resume on 1 / 2 / 4 rank(s)" in detail


def test_a_live_trainer_fails_preflight_as_it_fails_a_second_launch(tmp_path):
    out = tmp_path / "out"
    first = launch(out, "--train.steps=100000", "--train.save_every=0", wait=False)
    try:
        deadline = time.time() + 120
        while not (out / "training.csv").exists():
            assert first.poll() is None and time.time() < deadline, first.stderr.read()
            time.sleep(0.2)
        detail = refusal(preflight(out))
        assert "is in use by another trainer (host" in detail and f"pid {first.pid}" in detail
        second = launch(out)
        assert second.returncode == 2 and second.stderr.strip().splitlines()[-1] == f"error: {detail}"
    finally:
        first.kill()
        first.wait()


def test_start_checks_cli_says_what_the_launch_will_do(dense_run):
    cmd = [sys.executable, "-m", "train.start_checks", str(CONFIG), *BASE,
           f"--train.out_dir={dense_run}", "--train.steps=8", "--world-size", "2"]
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"resume: {dense_run / 'checkpoint_step4.pt'} (step 4)"
    assert lines[1].startswith("resume: keeping the checkpoint's global batch 4 on 2 rank(s)")
    assert lines[-1] == "data: synthetic tokens"
    bad = subprocess.run(cmd + ["--data.source=text:/no/such/*.txt"], cwd=REPO, env=ENV,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip() == "error: text:/no/such/*.txt: the pattern matched no files"


@pytest.mark.parametrize("saved, config, ranks, want", [
    (8, (8, 1), 2, (4, 1)),  # 1 -> 2 GPUs: the micro-batch halves
    (16, (8, 1), 1, (8, 2)),  # 2 -> 1 GPU: accumulation doubles, the micro-batch never grows
    (12, (8, 1), 2, (6, 1)),
    (12, (4, 1), 2, (3, 2)),  # largest divisor of 6 that is <= 4
    (8, (4, 1), 2, (4, 1)),  # unchanged: no note
])
def test_fit_keeps_the_global_batch_and_never_grows_the_micro_batch(saved, config, ranks, want):
    split, note = fit_global_batch(saved, BatchSplit(*config, ranks), explicit=False, checkpoint="c.pt")
    assert (split.batch_size, split.accumulate) == want and split.global_batch == saved
    assert (note is None) == (BatchSplit(*config, ranks).global_batch == saved)


def test_an_explicit_batch_wins_with_a_note():
    split, note = fit_global_batch(8, BatchSplit(8, 1, 2), explicit=True, checkpoint="c.pt")
    assert split == BatchSplit(8, 1, 2) and "global batch changes from the checkpoint's 8 to 16" in note


def test_start_checks_read_only(dense_run):
    before = snapshot(dense_run)
    (dense_run / "checkpoint_step9.pt").write_bytes(b"garbage")  # resume=auto would move it to corrupt/
    try:
        lines = start_checks(load_config(CONFIG, BASE + [f"--train.out_dir={dense_run}", "--train.steps=8"]), 1)
        assert any("failed validation" in line for line in lines)
        assert (dense_run / "checkpoint_step9.pt").exists() and not (dense_run / "corrupt").exists()
    finally:
        (dense_run / "checkpoint_step9.pt").unlink()
    assert snapshot(dense_run) == before
    assert json.loads((dense_run / "metrics.json").read_text())["status"] == "finished"
