"""Tiny run configs for trainer tests (CPU, seconds per run)."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

from train.core.config import RunConfig, load_config

REPO = Path(__file__).resolve().parents[2]
# the trainer's command line for subprocess runs: a model small enough for hundreds of steps a second
TINY_CLI = ["--model.vocab_size=320", "--model.dim=32", "--model.n_layers=1", "--model.n_heads=2",
            "--model.ffn_dim=32", "--train.seq_len=16", "--train.batch_size=2", "--train.log_every=1",
            "--runtime.device=cpu", "--runtime.threads=1"]


def cli(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "train", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO)})


def spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "train", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})


def wait_for(predicate, timeout: float = 90.0, what: str = "condition") -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


TINY_MODEL = ["--model.vocab_size=320", "--model.dim=32", "--model.n_layers=2", "--model.n_heads=4",
              "--model.n_kv_heads=2", "--model.ffn_dim=64", "--model.max_seq_len=64"]


def tiny_config(out_dir: Path, *extra: str) -> RunConfig:
    args = TINY_MODEL + [
        f"--train.out_dir={out_dir}", "--train.steps=8", "--train.seq_len=32", "--train.batch_size=4",
        "--train.lr=3e-3", "--train.warmup_steps=2", "--train.log_every=2", "--train.eval_steps=2",
        "--runtime.device=cpu", "--runtime.threads=1", *extra,
    ]
    return load_config(None, args)


def fake_wandb(monkeypatch) -> list[tuple[int | None, dict]]:
    """Install a stand-in `wandb` module for the test; returns the list its run's log() appends (step, values) to."""
    logged: list = []
    wandb = types.ModuleType("wandb")
    wandb.init = lambda **kw: types.SimpleNamespace(log=lambda values, step=None: logged.append((step, values)),
                                                   finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    return logged


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def halt_while_step_runs(monkeypatch, out_dir: Path, step: int):
    """The operator's `touch OUT_DIR/.HALT` lands while optimizer step `step` (1-based) of a synthetic-data run
    fetches its batch (one micro-batch a step). Returns the unpatched next_batch, for a caller that restores it."""
    from train.data.synthetic import SyntheticStream

    original, calls = SyntheticStream.next_batch, {"n": 0}

    def next_batch(self):
        calls["n"] += 1
        if calls["n"] == step:
            (out_dir / ".HALT").touch()
        return original(self)

    monkeypatch.setattr(SyntheticStream, "next_batch", next_batch)
    return original


def kill9_after(args: list[str], out: Path, checkpoint: str) -> int:
    """`python -m train *args` into out, killed with SIGKILL (no handler runs) once out/checkpoint exists; the last
    step its training.csv logged. AssertionError when the run finished before the kill."""
    proc = spawn(*args, f"--train.out_dir={out}")
    try:
        wait_for(lambda: (out / checkpoint).exists() or proc.poll() is not None, what=checkpoint)
    finally:
        proc.kill()
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == -9, f"the run ended before the kill (exit {proc.returncode}): {stderr[-2000:]}"
    return max(int(r["step"]) for r in read_csv(out / "training.csv"))


def run_reference_and_resume(args: list[str], reference: Path, out: Path) -> None:
    """The reference run (the same command uninterrupted, into `reference`) and the resumed one (resume=auto into
    out) both exit 0."""
    for target in (reference, out):
        done = cli(*args, f"--train.out_dir={target}")
        assert done.returncode == 0, done.stderr[-2000:]


def byte_dir(path: Path, text: str) -> Path:
    """A prepared bin: directory of `text` in byte tokens (one token per UTF-8 byte), the last tenth as val."""
    import json

    import numpy as np

    from train.data.meta import FORMAT, FORMAT_VERSION

    data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)
    cut = len(data) * 9 // 10
    path.mkdir(parents=True)
    data[:cut].tofile(path / "train.bin")
    data[cut:].tofile(path / "val.bin")
    splits = {"train": {"file": "train.bin", "tokens": cut, "text_bytes": cut},
              "val": {"file": "val.bin", "tokens": len(data) - cut, "text_bytes": len(data) - cut}}
    (path / "meta.json").write_text(json.dumps({"format": FORMAT, "version": FORMAT_VERSION, "tokenizer": "byte",
                                                "eos_id": 256, "vocab_size": 257, "dtype": "uint16",
                                                "max_token_id": int(data.max()), "splits": splits}))
    return path


def one_rank_then_two(args: list[str], one: Path, moved: Path, stop_after: int) -> tuple[list[dict], list[dict]]:
    """The run of `args` on one rank x 8 rows into `one`; the same into `moved` stopped after `stop_after` steps and
    resumed by torchrun on two gloo ranks x 4 rows (the same global batch). Both training.csv's rows."""
    from train.trainer.runner import run_training

    assert run_training(load_config(None, [*args, f"--train.out_dir={one}", "--train.batch_size=8"])) == 0
    assert run_training(load_config(None, [*args, f"--train.out_dir={moved}", "--train.batch_size=8",
                                           f"--train.stop_after={stop_after}"])) == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "train", *args,
           "--train.batch_size=4", f"--train.out_dir={moved}"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_csv(one / "training.csv"), read_csv(moved / "training.csv")
