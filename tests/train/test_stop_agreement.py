"""Stops agreed by all ranks: `.HALT` and SIGTERM to torchrun at random moments, 2 gloo ranks.

Each trial must end within 60 s, with both ranks reporting the same final checkpoint step and a
valid checkpoint of that step on disk; nothing may hang. Short form in `make test` (1 + 1 trials);
`NSA_CHAOS_LONG=1` runs the long form (20 + 20).
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from train.checkpoint import io as ckpt_io
from train.core.artifacts import checkpoint_name

from .helpers import read_jsonl

REPO = Path(__file__).resolve().parents[2]
LONG = os.environ.get("NSA_CHAOS_LONG") == "1"
TRIALS = 20 if LONG else 1
ARGS = ["--model.vocab_size=128", "--model.dim=32", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
        "--model.ffn_dim=64", "--model.max_seq_len=64", "--runtime.device=cpu", "--train.steps=100000",
        "--train.seq_len=16", "--train.batch_size=2", "--train.log_every=5", "--train.save_every=50"]


def launch(out: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "train",
           *ARGS, f"--train.out_dir={out}"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not predicate():
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def final_checkpoint_steps(out: Path) -> list[int | None]:
    steps = []
    for rank in (0, 1):
        beats = read_jsonl(out / f"heartbeat_rank{rank}.jsonl")
        assert beats[-1]["kind"] == "end", (rank, beats[-3:])
        saves = [b["step"] for b in beats if b["kind"] == "checkpoint"]
        steps.append(saves[-1] if saves else None)
    return steps


@pytest.mark.fresh_python  # counts torchrun's workers as its process's children
@pytest.mark.parametrize("how", ["halt", "sigterm"])
def test_stop_requests_at_random_moments_end_both_ranks_after_the_same_step(tmp_path, how):
    rng = random.Random(7 if how == "halt" else 11)
    for trial in range(TRIALS):
        out = tmp_path / f"{how}{trial}"
        proc = launch(out)
        try:
            if how == "halt":
                # .HALT present at start is refused as stale; it arrives once rank 0 is running
                wait_until(lambda: (out / "heartbeat_rank0.jsonl").exists(), 120, "rank 0 to start")
                time.sleep(rng.uniform(0.0, 2.0))
                (out / ".HALT").touch()
            else:
                # torchrun forwards SIGTERM to its workers once they run; any moment after that,
                # worker start-up included, must give a graceful stop
                wait_until(lambda: len(children(proc.pid)) == 2, 120, "torchrun's workers")
                time.sleep(rng.uniform(0.3, 6.0))
                proc.send_signal(signal.SIGTERM)
            t0 = time.time()
            _, err = proc.communicate(timeout=60)
            assert time.time() - t0 < 60
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        if how == "halt":
            assert proc.returncode == 0, err[-3000:]
        steps = final_checkpoint_steps(out)
        assert steps[0] == steps[1] and steps[0] is not None, (trial, steps, err[-2000:])
        assert ckpt_io.checkpoint_problem(out / checkpoint_name(steps[0])) is None
        reasons = {read_jsonl(out / f"heartbeat_rank{r}.jsonl")[-1]["reason"] for r in (0, 1)}
        assert len(reasons) == 1 and reasons <= {"HALT file", "SIGTERM"}, reasons
