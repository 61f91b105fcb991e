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
import torch

from tests.train.helpers import TINY_MODEL
from train.core.config import load_config
from train.core.errors import UserError
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


def start_checks_refusal(out: Path, *args: str, world_size: int = 1) -> str:
    with pytest.raises(UserError) as refused:
        start_checks(load_config(CONFIG, BASE + [f"--train.out_dir={out}", *args]), world_size)
    return str(refused.value)


def launch_here(capsys, out: Path, *args: str) -> tuple[int, str, str]:
    """`python -m train` in this process (its main(), as the command runs it): (exit code, stdout, stderr)."""
    from train.__main__ import main

    capsys.readouterr()
    code = main([str(CONFIG), *BASE, f"--train.out_dir={out}", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_all_refuse_alike(capsys, out: Path, args: list[str], words: str) -> None:
    """The launch exits 2 with one line; preflight fails with that line and start checks raise it, out_dir untouched."""
    before = snapshot(out)
    detail = refusal(preflight(out, *args))
    assert words in detail
    assert start_checks_refusal(out, *args) == detail
    code, _, err = launch_here(capsys, out, *args)
    assert code == 2, err[-2000:]
    assert err.strip().splitlines()[-1] == f"error: {detail}"
    assert snapshot(out) == before  # nothing rewritten: config.yaml, metrics.json, CSVs, checkpoints


# every refusal the trainer makes before its first step when resuming a synthetic-data run
@pytest.mark.parametrize("args, words", [
    (NSA + ["--train.steps=8"], "does not match the config's architecture"),  # dense checkpoint, NSA config
    (["--train.steps=2"], "train.steps=2 is below the step of checkpoint"),  # the run would "finish" at once
    (["--train.steps=8", "--data.tokenizer=byte"], "was trained on data.tokenizer=gpt2"),
    (["--train.steps=8", "--train.seed=7"], "data state was saved with seed=1337 but this run has seed=7"),
    (["--train.steps=8", "--train.lr_schedule=wsd", "--train.decay_steps=6", "--train.warmup_steps=1"],
     "would decay steps 3..8, but checkpoint"),
    (["--train.steps=8", "--train.optimizer=muon"], "was trained with train.optimizer=adamw"),
    (["--train.steps=8", "--data.document_mask=true"], "data.document_mask=true needs data whose tokenizer has an EOS"),
], ids=["architecture", "steps-below-checkpoint", "tokenizer", "data-seed", "wsd-horizon", "optimizer", "document-mask"])
def test_preflight_and_start_checks_refuse_with_the_line_the_launch_exits_2_with(dense_run, args, words, capsys):
    assert_all_refuse_alike(capsys, dense_run, args, words)


@pytest.fixture(scope="module")
def stream_run(tmp_path_factory, corpus_path) -> tuple[Path, str]:
    """A real run on a text stream (byte tokens): 4 steps, checkpoint at step 4; and its source."""
    root = tmp_path_factory.mktemp("stream")
    paragraphs = corpus_path.read_text(encoding="utf-8").split("\n\n")[:400]
    for i in range(4):
        (root / f"part{i}.txt").write_text("\n\n".join(paragraphs[i::4]), encoding="utf-8")
    source = f"text:{root}/part*.txt"
    out = root / "out"
    proc = launch(out, "--train.steps=4", f"--data.source={source}", "--data.tokenizer=byte",
                  "--data.text_sample_by=paragraph")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out, source


# ... and a text-stream run, whose reader positions hold only for the same source, tokens, shapes and readers
@pytest.mark.parametrize("change, words", [
    (["--train.seq_len=16"], "data state was saved with seq_len=32 but this run has seq_len=16"),
    (["--data.text_sample_by=paragraph", "--data.split_seed=3"], "was saved with split_seed=0 but this run has split_seed=3"),
    (["--data.text_sample_by=paragraph", "--data.num_workers=2"], "a stream source's position is kept per rank and per worker"),
    (["--data.source=text:{root}/part[01].txt", "--data.text_sample_by=paragraph"], "data state was saved with source="),
], ids=["seq-len", "split-seed", "readers", "source"])
def test_a_stream_resume_is_refused_alike(stream_run, change, words, capsys):
    out, source = stream_run
    common = ["--train.steps=8", "--data.tokenizer=byte", f"--data.source={source}"]
    args = common + [arg.format(root=Path(source[5:]).parent) for arg in change]
    assert_all_refuse_alike(capsys, out, args, words)


def test_restart_on_change_starts_the_data_afresh_and_records_it(tmp_path, capsys):
    out = tmp_path / "out"
    assert launch_here(capsys, out, "--train.steps=4")[0] == 0
    code, stdout, stderr = launch_here(capsys, out, "--train.steps=6", "--train.seed=7", "--data.restart_on_change=true")
    assert code == 0, stderr[-2000:]
    assert "data: starting the training data afresh (data.restart_on_change=true): data state was saved with " \
           "seed=1337 but this run has seed=7" in stdout
    restarts = [{"step": 4, "reason": "data state was saved with seed=1337 but this run has seed=7"}]
    assert json.loads((out / "metrics.json").read_text())["data_restarts"] == restarts
    ckpt = torch.load(out / "checkpoint_step6.pt", weights_only=True, map_location="cpu")
    assert ckpt["data_restarts"] == restarts
    assert ckpt["data"][0]["seed"] == 7 and ckpt["data"][0]["step"] == 2  # the new stream's own two steps
    code, stdout, _ = launch_here(capsys, out, "--train.steps=8", "--train.seed=7", "--data.restart_on_change=true")
    assert code == 0 and "afresh" not in stdout  # the same settings again: the data continues exactly
    assert json.loads((out / "metrics.json").read_text())["data_restarts"] == restarts


def test_preflight_names_the_batch_split_a_resume_on_more_ranks_uses(dense_run):
    result = preflight(dense_run, "--train.steps=8", gpus=2)
    (resume,) = result.find("resume")
    assert resume.status == OK, result.render()
    assert "keeping the checkpoint's global batch 4 on 2 rank(s): train.batch_size 2 x accumulate_grad_batches 1" \
        in resume.detail
    detail = refusal(preflight(dense_run, "--train.steps=8", gpus=3))
    assert "global batch 4, which 3 rank(s) cannot split evenly; resume on 1 / 2 / 4 rank(s)" in detail


@pytest.mark.fresh_python  # the lock names the trainer's pid: the process's own
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
