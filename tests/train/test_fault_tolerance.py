"""Faults caused for real: truncated checkpoints, kill -9 before the first save, a second trainer on
the same out_dir, recovery from an older checkpoint. Nothing a run wrote may be lost."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from train.checkpoint import io as ckpt_io
from train.core.artifacts import checkpoint_files, checkpoint_name
from train.core.errors import CheckpointError, UserError
from train.trainer.runner import run_training

from .helpers import REPO, TINY_CLI, cli, read_csv, spawn, tiny_config, wait_for

def heartbeat_has(out: Path, kind: str) -> bool:
    beat = out / "heartbeat_rank0.jsonl"
    return beat.exists() and f'"kind": "{kind}"' in beat.read_text()


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def names(directory: Path) -> list[str]:
    return sorted(p.name for _, p in checkpoint_files(directory))


# ---- lineage and retention -------------------------------------------------------------------------

@pytest.mark.parametrize("keep_last", [1, 3])
def test_resuming_an_older_checkpoint_supersedes_newer_ones_and_keeps_good_ones(tmp_path, keep_last):
    out = tmp_path / "run"
    assert run_training(tiny_config(out, "--train.steps=38", "--train.save_every=5", "--train.log_every=5")) == 0
    assert names(out) == ["checkpoint_step30.pt", "checkpoint_step35.pt", "checkpoint_step38.pt"]
    truncate(out / "checkpoint_step38.pt")
    assert run_training(tiny_config(out, "--train.steps=38", "--train.save_every=5", "--train.log_every=5",
                                    f"--train.resume={out / 'checkpoint_step30.pt'}", "--train.stop_after=1",
                                    f"--train.keep_last={keep_last}")) == 0
    # the one just written and the one resumed from stay; newer ones are moved, not deleted
    assert names(out) == ["checkpoint_step30.pt", "checkpoint_step31.pt"]
    assert names(out / "superseded") == ["checkpoint_step35.pt", "checkpoint_step38.pt"]
    assert os.readlink(out / "latest.pt") == "checkpoint_step31.pt"
    assert ckpt_io.checkpoint_problem(out / "checkpoint_step31.pt") is None
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["checkpoints"] == ["checkpoint_step30.pt", "checkpoint_step31.pt"] and metrics["step"] == 31


def test_retention_never_counts_or_deletes_files_that_do_not_validate(tmp_path):
    out = tmp_path / "run"
    assert run_training(tiny_config(out, "--train.steps=6", "--train.save_every=2", "--train.keep_last=2")) == 0
    assert names(out) == ["checkpoint_step4.pt", "checkpoint_step6.pt"]
    (out / "checkpoint_step5.pt").write_bytes(b"not a checkpoint")  # junk in the middle of the lineage
    assert ckpt_io.apply_retention(out, keep_last=1, keep_all=False) == [out / "checkpoint_step4.pt"]
    assert names(out) == ["checkpoint_step5.pt", "checkpoint_step6.pt"]


def test_resume_from_a_foreign_checkpoint_moves_the_other_lineage_aside(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert run_training(tiny_config(a, "--train.steps=4", "--train.save_every=2")) == 0
    assert run_training(tiny_config(b, "--train.steps=4", "--train.save_every=2")) == 0
    assert run_training(tiny_config(b, "--train.steps=6", f"--train.resume={a / 'checkpoint_step4.pt'}")) == 0
    assert names(b) == ["checkpoint_step6.pt"]
    assert names(b / "superseded") == ["checkpoint_step2.pt", "checkpoint_step4.pt"]


# ---- auto-resume skips the broken --------------------------------------------------------------------

def test_auto_resume_moves_a_truncated_newest_checkpoint_to_corrupt_and_uses_the_previous(tmp_path):
    out = tmp_path / "run"
    assert cli(*TINY_CLI, f"--train.out_dir={out}", "--train.steps=6", "--train.save_every=2").returncode == 0
    truncate(out / "checkpoint_step6.pt")
    proc = cli(*TINY_CLI, f"--train.out_dir={out}", "--train.steps=8", "--train.save_every=2")
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "checkpoint_step6.pt" in warnings[0] and "resuming from checkpoint_step4.pt" in warnings[0]
    assert names(out / "corrupt") == ["checkpoint_step6.pt"]
    assert names(out) == ["checkpoint_step4.pt", "checkpoint_step6.pt", "checkpoint_step8.pt"]
    assert [int(r["step"]) for r in read_csv(out / "training.csv")] == list(range(1, 9))
    assert os.readlink(out / "latest.pt") == "checkpoint_step8.pt"


def test_explicit_resume_from_a_bad_file_is_one_complete_sentence(tmp_path):
    out = tmp_path / "run"
    assert cli(*TINY_CLI, f"--train.out_dir={out}", "--train.steps=2").returncode == 0
    truncate(out / "checkpoint_step2.pt")
    listing = {p.name: p.stat().st_size for p in out.iterdir() if p.name != ".lock"}  # .lock names each start
    proc = cli(*TINY_CLI, f"--train.out_dir={out}", "--train.steps=4", f"--train.resume={out / 'checkpoint_step2.pt'}")
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "checkpoint_step2.pt is incomplete or not a checkpoint" in lines[0] and lines[0].endswith(")")
    assert {p.name: p.stat().st_size for p in out.iterdir() if p.name != ".lock"} == listing  # nothing moved or lost
    with pytest.raises(CheckpointError, match="bytes"):
        ckpt_io.load_checkpoint(out / "checkpoint_step2.pt")


# ---- restart after an early crash -------------------------------------------------------------------

def test_kill9_before_the_first_checkpoint_restarts_fresh_and_keeps_the_attempt(tmp_path):
    out = tmp_path / "run"
    proc = spawn(*TINY_CLI, f"--train.out_dir={out}", "--train.steps=100000", "--train.save_every=100000")
    try:
        wait_for(lambda: (out / "training.csv").exists() and len(read_csv(out / "training.csv")) >= 2,
                 what="two logged steps")
    finally:
        proc.kill()  # SIGKILL: no handler runs
        proc.communicate(timeout=30)
    assert not checkpoint_files(out)
    first_rows = read_csv(out / "training.csv")
    again = cli(*TINY_CLI, f"--train.out_dir={out}", "--train.steps=3")
    assert again.returncode == 0, again.stderr
    attempts = list((out / "attempts").iterdir())
    assert len(attempts) == 1 and f"its files move to {attempts[0]}/" in again.stderr
    assert read_csv(attempts[0] / "training.csv")[: len(first_rows)] == first_rows
    assert (attempts[0] / "heartbeat_rank0.jsonl").exists()
    assert [int(r["step"]) for r in read_csv(out / "training.csv")] == [1, 2, 3]
    assert names(out) == ["checkpoint_step3.pt"]


# ---- one owner ----------------------------------------------------------------------------------------

@pytest.mark.fresh_python  # the lock names the trainer's pid: the process's own
def test_a_second_trainer_on_the_same_out_dir_exits_2_and_touches_nothing(tmp_path):
    out = tmp_path / "run"
    first = spawn(*TINY_CLI, f"--train.out_dir={out}", "--train.steps=100000", "--train.save_every=5")
    try:
        wait_for(lambda: ckpt_io.latest_checkpoint(out) is not None, what="a first checkpoint")
        second = cli(*TINY_CLI, f"--train.out_dir={out}", "--train.steps=100000")
        lines = [line for line in second.stderr.splitlines() if line.strip()]
        assert second.returncode == 2 and len(lines) == 1, second.stderr
        assert f"pid {first.pid}" in lines[0] and "in use by another trainer" in lines[0]
        assert not (out / "training.csv.superseded").exists() and not (out / "superseded").exists()
    finally:
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=60)
    assert first.returncode == 0, err
    steps = [int(r["step"]) for r in read_csv(out / "training.csv")]
    assert steps == list(range(1, len(steps) + 1))  # one writer: every step once, in order
    assert json.loads((out / "metrics.json").read_text())["status"] == "stopped"


def test_the_lock_dies_with_its_holder(tmp_path):
    out = tmp_path / "run"
    first = spawn(*TINY_CLI, f"--train.out_dir={out}", "--train.steps=100000", "--train.save_every=3")
    try:
        wait_for(lambda: ckpt_io.latest_checkpoint(out) is not None, what="a first checkpoint")
    finally:
        first.kill()
        first.communicate(timeout=30)
    proc = cli(*TINY_CLI, f"--train.out_dir={out}", "--train.steps=100000", "--train.stop_after=1")
    assert proc.returncode == 0, proc.stderr


# ---- stale .HALT ------------------------------------------------------------------------------------

def test_stale_halt_is_refused_by_the_trainer_with_the_runners_line(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / ".HALT").touch()
    proc = cli(*TINY_CLI, f"--train.out_dir={out}", "--train.steps=3")
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert ".HALT exists" in lines[0] and "rm " in lines[0]
    assert not (out / "training.csv").exists()
    shell = subprocess.run([sys.executable, "-m", "train.safety", "check-halt", str(out)], cwd=REPO,
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert shell.returncode == 2 and shell.stderr.strip() in lines[0]


def test_a_failed_start_frees_the_out_dir_in_the_same_process(tmp_path):
    out = tmp_path / "run"
    assert run_training(tiny_config(out, "--train.steps=2")) == 0
    with pytest.raises(CheckpointError, match="architecture"):
        run_training(tiny_config(out, "--train.steps=4", "--model.n_kv_heads=4"))
    assert run_training(tiny_config(out, "--train.steps=4")) == 0  # not "in use by another trainer"


def test_a_failed_start_leaves_no_out_dir_holding_only_its_lock(tmp_path):
    out = tmp_path / "new_run"
    with pytest.raises(UserError, match="meta.json|no such|not found|does not exist"):
        run_training(tiny_config(out, f"--data.source=bin:{tmp_path / 'no_data'}"))
    assert not out.exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    with pytest.raises(UserError):
        run_training(tiny_config(kept, f"--data.source=bin:{tmp_path / 'no_data'}"))
    assert kept.is_dir()  # a directory the operator made stays


def test_a_vanished_console_reader_does_not_cost_the_final_checkpoint(tmp_path):
    """`python -m train ... | head -2`, or a log writer that died: console lines fail with EPIPE;
    the run still stops gracefully on request and writes its checkpoint."""
    out = tmp_path / "run"
    proc = spawn(*TINY_CLI, f"--train.out_dir={out}", "--train.steps=100000")
    proc.stdout.readline()  # the run has started printing
    proc.stdout.close()  # the reader goes away
    wait_for(lambda: (out / "training.csv").exists() and len(read_csv(out / "training.csv")) >= 3, what="steps")
    proc.send_signal(signal.SIGTERM)
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 0, err
    steps = [int(r["step"]) for r in read_csv(out / "training.csv")]
    assert names(out) == [checkpoint_name(steps[-1])]
    assert json.loads((out / "metrics.json").read_text())["status"] == "stopped"
