"""Chaos: kill -9 the trainer at random moments (before the first checkpoint, during checkpoint
writes, between steps) and restart it with resume=auto, as the runners do. The run must finish with
exit 0, log every step once with the loss of an uninterrupted run, and never lose a valid checkpoint.

Short form in `make test` (3 kills: start-up, a checkpoint write, steps); `NSA_CHAOS_LONG=1` runs the long form (12 kills).
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from train.checkpoint import io as ckpt_io

from .helpers import read_csv

REPO = Path(__file__).resolve().parents[2]
LONG = os.environ.get("NSA_CHAOS_LONG") == "1"
KILLS = 12 if LONG else 3
STEPS = 60 if LONG else 30
# ~2.5M parameters: a checkpoint write (30 MB with Adam moments) lasts long enough to be hit
MODEL = ["--model.vocab_size=4096", "--model.dim=128", "--model.n_layers=2", "--model.n_heads=4",
         "--model.ffn_dim=256", "--model.max_seq_len=64"]
ARGS = [*MODEL, f"--train.steps={STEPS}", "--train.seq_len=32", "--train.batch_size=4", "--train.log_every=1",
        "--train.save_every=3", "--train.keep_all_checkpoints=true", "--train.eval_every=0",
        "--runtime.device=cpu", "--runtime.threads=1"]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def start(out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "train", *ARGS, f"--train.out_dir={out}", "--train.resume=auto"],
                            cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def valid_names(out: Path) -> set[str]:
    """Checkpoint files under out_dir (live or moved aside) that validate now."""
    return {p.name for p in out.rglob("checkpoint_step*.pt") if ckpt_io.checkpoint_problem(p) is None}


def writing(out: Path, pid: int) -> bool:
    """proc `pid` is inside a checkpoint write (its temporary file exists)."""
    return out.exists() and any(n.startswith(".checkpoint_step") and n.endswith(f".tmp{pid}") for n in os.listdir(out))


def started_since(out: Path, t0: float) -> bool:
    """This attempt has passed start-up (its `start` heartbeat is newer than t0)."""
    beat = out / "heartbeat_rank0.jsonl"
    if not beat.exists():
        return False
    return any(json.loads(line)["kind"] == "start" and json.loads(line)["ts"] >= t0
               for line in beat.read_text().splitlines() if line.strip())


def kill_at(proc: subprocess.Popen, out: Path, moment: str, t0: float, rng: random.Random) -> str:
    """SIGKILL proc at `moment`; returns what was actually hit."""
    deadline = time.time() + 60
    if moment == "startup":
        time.sleep(rng.uniform(0.0, 1.5))  # imports, model build, data: before any step
    else:
        while time.time() < deadline and proc.poll() is None and not started_since(out, t0):
            time.sleep(0.01)
        if moment == "write":
            while time.time() < deadline and proc.poll() is None and not writing(out, proc.pid):
                time.sleep(0.0005)
        else:  # "steps": some random number of steps into this attempt
            time.sleep(rng.uniform(0.0, 0.6))
    hit = "write" if writing(out, proc.pid) else "startup" if not started_since(out, t0) else "steps"
    proc.kill()
    proc.communicate(timeout=30)
    return hit


@pytest.mark.fresh_python  # kills at moments timed to a fresh start-up; reads the trainer's pid as the process's
def test_kill9_at_random_moments_loses_nothing(tmp_path):
    rng = random.Random(int(os.environ.get("NSA_CHAOS_SEED", "12")))
    reference = tmp_path / "reference"
    done = subprocess.run([sys.executable, "-m", "train", *ARGS, f"--train.out_dir={reference}"], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]

    out = tmp_path / "chaos"
    moments = ["startup", "write", "steps"] + [rng.choice(["steps", "write", "steps"]) for _ in range(KILLS - 3)]
    seen_valid: set[str] = set()
    hits = []
    for moment in moments:
        t0 = time.time() - 0.01
        proc = start(out)
        hits.append(kill_at(proc, out, moment, t0, rng))
        assert proc.returncode == -9, f"the trainer ended on its own before the kill ({moment})"
        seen_valid |= valid_names(out)
    final = subprocess.run([sys.executable, "-m", "train", *ARGS, f"--train.out_dir={out}", "--train.resume=auto"],
                           cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stderr[-2000:]

    print("kills hit:", hits)
    assert "write" in hits and "startup" in hits, hits  # inside a checkpoint write; before any step
    want = [(r["step"], r["loss"]) for r in read_csv(reference / "training.csv")]
    got = [(r["step"], r["loss"]) for r in read_csv(out / "training.csv")]
    assert got == want  # every step once, each with the uninterrupted run's loss
    lost = seen_valid - valid_names(out)
    assert not lost, f"valid checkpoints disappeared: {sorted(lost)}"
    assert not (out / "corrupt").exists()  # atomic writes: a kill never leaves a half checkpoint under its name
