"""Trainer end to end on CPU: artefacts, exact resume, checkpoints, run safety, bad input."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from train.checkpoint import io as ckpt_io
from train.core.artifacts import checkpoint_files
from train.core.errors import CheckpointError, ConfigError, DataError
from train.trainer.lr_schedule import lr_at
from train.trainer.runner import EXIT_ANOMALY, run_training

from .helpers import halt_while_step_runs, read_csv, read_jsonl, tiny_config

REPO = Path(__file__).resolve().parents[2]


def test_run_writes_every_artefact(tmp_path):
    out = tmp_path / "run"
    assert run_training(tiny_config(out, "--train.eval_every=4", "--train.save_every=4")) == 0
    for name in ("training.csv", "val.csv", "heartbeat_rank0.jsonl", "metrics.json", "config.yaml",
                 "checkpoint_step4.pt", "checkpoint_step8.pt", "latest.pt"):
        assert (out / name).exists(), name
    assert any((out / "tb").iterdir())
    rows = read_csv(out / "training.csv")
    assert [int(r["step"]) for r in rows] == [2, 4, 6, 8]
    assert {"step", "loss", "lr", "toks_per_s", "grad_norm", "dt_step_s", "dt_fetch_s"} <= set(rows[0])
    assert all(float(r["toks_per_s"]) > 0 and math.isfinite(float(r["loss"])) for r in rows)
    assert float(rows[-1]["loss"]) < float(rows[0]["loss"])
    val = read_csv(out / "val.csv")
    assert [int(r["step"]) for r in val] == [4, 8]
    assert float(val[0]["ppl"]) == pytest.approx(math.exp(float(val[0]["val_loss"])), rel=1e-4)
    beats = read_jsonl(out / "heartbeat_rank0.jsonl")
    kinds = [b["kind"] for b in beats]
    assert kinds[0] == "start" and kinds[-1] == "end" and "eval" in kinds and "checkpoint" in kinds
    train_beat = next(b for b in beats if b["kind"] == "train")
    assert {"ts", "step", "loss", "toks_per_s", "mem_alloc_mib", "dt_fetch_s"} <= set(train_beat)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["status"] == "finished" and metrics["step"] == 8
    assert metrics["tokens_seen"] == 8 * 4 * 32
    assert os.readlink(out / "latest.pt") == "checkpoint_step8.pt"


def test_checkpoint_holds_full_state(tmp_path):
    out = tmp_path / "run"
    run_training(tiny_config(out, "--train.accumulate_grad_batches=2"))
    ck = torch.load(out / "checkpoint_step8.pt", weights_only=True)
    assert ck["step"] == 8 and ck["tokens_seen"] == 8 * 2 * 4 * 32
    assert {"model", "optimizer", "rng", "rng_per_rank", "data", "config"} <= set(ck)
    assert {"torch", "numpy", "python", "cuda"} <= set(ck["rng"])
    assert ck["config"]["train"]["accumulate_grad_batches"] == 2
    assert len(ck["optimizer"]["state"]) > 0 and len(ck["data"]) == 1


def test_two_fresh_runs_write_the_same_rng_states(tmp_path):
    """Python's and NumPy's generators are seeded from train.seed (per rank) as torch's is: the same command writes
    the same RNG states, whatever the process drew before (here: two runs in one process, draws in between)."""
    import random

    import numpy as np

    states = []
    for name in ("a", "b"):
        random.random(), np.random.random()  # what an earlier caller left behind must not matter
        assert run_training(tiny_config(tmp_path / name, "--train.steps=2")) == 0
        states.append(torch.load(tmp_path / name / "checkpoint_step2.pt", weights_only=True)["rng"])
    for key in ("python", "numpy", "torch"):
        assert repr(states[0][key]) == repr(states[1][key]), key


@pytest.mark.parametrize("accum", [1, 2])
def test_exact_resume_is_bit_identical(tmp_path, accum):
    """N steps, then resume for N more == 2N uninterrupted (losses, grad norms, weights)."""
    common = ("--train.steps=8", f"--train.accumulate_grad_batches={accum}", "--model.dropout=0.1",
              "--train.eval_every=4")
    full, split = tmp_path / "full", tmp_path / "split"
    assert run_training(tiny_config(full, *common)) == 0
    assert run_training(tiny_config(split, *common, "--train.stop_after=4")) == 0
    assert [int(r["step"]) for r in read_csv(split / "training.csv")] == [2, 4]
    assert run_training(tiny_config(split, *common)) == 0
    a, b = read_csv(full / "training.csv"), read_csv(split / "training.csv")
    assert [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in a] == \
           [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in b]
    assert read_csv(full / "val.csv") == read_csv(split / "val.csv")
    wa = torch.load(full / "checkpoint_step8.pt", weights_only=True)["model"]
    wb = torch.load(split / "checkpoint_step8.pt", weights_only=True)["model"]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_lr_schedule_counts_optimizer_steps():
    from train.core.config import TrainConfig

    cfg = TrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1, accumulate_grad_batches=8)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(55, cfg) == pytest.approx(0.55)  # cosine midpoint between 1.0 and the 0.1 floor
    assert lr_at(99, cfg) == pytest.approx(0.1, abs=1e-3)
    assert lr_at(500, cfg) == pytest.approx(0.1)


def test_weight_decay_only_on_matrices(tmp_path):
    from nsa.model import Transformer
    from train.trainer.optim import build_optimizer

    cfg = tiny_config(tmp_path / "x", "--model.bias=true", "--model.norm=layernorm")
    opt = build_optimizer(Transformer(cfg.model), cfg.train, "cpu")
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] > 0 and no_decay["weight_decay"] == 0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert len(no_decay["params"]) > 0


def test_retention_keeps_last_k_or_all(tmp_path):
    out = tmp_path / "keep2"
    run_training(tiny_config(out, "--train.save_every=2", "--train.keep_last=2"))
    assert [p.name for _, p in checkpoint_files(out)] == ["checkpoint_step6.pt", "checkpoint_step8.pt"]
    out = tmp_path / "all"
    run_training(tiny_config(out, "--train.save_every=2", "--keep_all_checkpoints=true"))
    assert len(checkpoint_files(out)) == 4


def test_halt_file_stops_gracefully_and_resume_continues(tmp_path, monkeypatch):
    from train.data.synthetic import SyntheticStream

    out = tmp_path / "run"
    original = halt_while_step_runs(monkeypatch, out, 3)
    assert run_training(tiny_config(out)) == 0
    assert [p.name for _, p in checkpoint_files(out)] == ["checkpoint_step3.pt"]
    assert json.loads((out / "metrics.json").read_text())["stop_reason"] == "HALT file"
    monkeypatch.setattr(SyntheticStream, "next_batch", original)
    with pytest.raises(ConfigError, match=r"\.HALT exists .*remove it to resume"):
        run_training(tiny_config(out))  # a stale .HALT is refused, not a silent one-step run
    (out / ".HALT").unlink()
    assert run_training(tiny_config(out)) == 0
    assert ckpt_io.latest_checkpoint(out).name == "checkpoint_step8.pt"
    assert [int(r["step"]) for r in read_csv(out / "training.csv")] == [2, 3, 4, 6, 8]


def test_eval_only_evaluates_a_checkpoint(tmp_path):
    out = tmp_path / "run"
    run_training(tiny_config(out, "--train.eval_every=8"))
    before = sorted(p.name for p in out.iterdir())
    assert run_training(tiny_config(out, "--eval_only=true")) == 0
    result = json.loads((out / "eval_step8.json").read_text())
    assert result["val_loss"] == pytest.approx(float(read_csv(out / "val.csv")[-1]["val_loss"]), rel=1e-5)
    assert sorted(p.name for p in out.iterdir()) == sorted(before + ["eval_step8.json"])


def _nan_after(monkeypatch, first_bad: int, bad_count: int):
    """Make the model's loss NaN for forward calls first_bad .. first_bad + bad_count - 1."""
    from nsa.model import Transformer

    original, calls = Transformer.forward, {"n": 0}

    def forward(self, idx, targets=None, **kw):
        out = original(self, idx, targets, **kw)
        if targets is not None and self.training:
            calls["n"] += 1
            if first_bad <= calls["n"] < first_bad + bad_count:
                return out * float("nan")
        return out

    monkeypatch.setattr(Transformer, "forward", forward)


def test_nonfinite_steps_are_skipped(tmp_path, monkeypatch):
    _nan_after(monkeypatch, first_bad=3, bad_count=2)
    out = tmp_path / "run"
    assert run_training(tiny_config(out, "--train.nonfinite_skip_limit=3")) == 0
    rows = read_csv(out / "training.csv")
    assert int(rows[-1]["skipped_steps"]) == 2
    # the interval of steps 3-4 had no finite step: its loss reads nan; the others are finite
    assert [math.isfinite(float(r["loss"])) for r in rows] == [True, False, True, True]
    ck = torch.load(out / "checkpoint_step8.pt", weights_only=True)
    assert all(torch.isfinite(v).all() for v in ck["model"].values())


def test_nonfinite_limit_halts_with_anomaly_flag(tmp_path, monkeypatch):
    out = tmp_path / "run"
    run_training(tiny_config(out, "--train.steps=8", "--train.stop_after=2"))
    good = (out / "checkpoint_step2.pt").read_bytes()
    _nan_after(monkeypatch, first_bad=1, bad_count=100)
    assert run_training(tiny_config(out, "--train.steps=8", "--train.nonfinite_skip_limit=2")) == EXIT_ANOMALY
    assert "nonfinite_loss" in (out / ".anomaly_type").read_text()
    assert ckpt_io.latest_checkpoint(out).name == "checkpoint_step2.pt"
    assert (out / "checkpoint_step2.pt").read_bytes() == good
    assert read_jsonl(out / "heartbeat_rank0.jsonl")[-1]["kind"] == "anomaly"


# ---- bad input: one line, non-zero exit, nothing lost --------------------------------------------

def _cli(*args: str, cwd: Path = REPO, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "train", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO)})


TINY_CLI = ["--model.vocab_size=320", "--model.dim=32", "--model.n_layers=1", "--model.n_heads=2",
            "--model.ffn_dim=32", "--train.steps=2", "--train.seq_len=16", "--train.batch_size=2",
            "--train.log_every=1", "--runtime.device=cpu"]


def _assert_one_line_error(proc: subprocess.CompletedProcess, needle: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], proc.stderr


def test_cli_bad_yaml_and_unknown_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  dim: [1\n")
    _assert_one_line_error(_cli(str(bad)), "malformed YAML")
    bad.write_text("train:\n  stepz: 3\n")
    _assert_one_line_error(_cli(str(bad)), "unknown key 'stepz'")
    _assert_one_line_error(_cli(str(tmp_path / "missing.yaml")), "config file not found")


def test_mismatched_checkpoint_is_a_clear_error(tmp_path):
    out = tmp_path / "run"
    run_training(tiny_config(out))
    with pytest.raises(CheckpointError, match="does not match the config's architecture.*n_kv_heads"):
        run_training(tiny_config(out, "--train.steps=10", "--model.n_kv_heads=4"))


def test_a_checkpoint_saved_before_a_model_key_existed_resumes_with_the_keys_default(tmp_path):
    """A checkpoint whose stored model section lacks model.rope_scaling (written before the key existed) was built
    with linear interpolation, the key's default: it resumes, and it refuses a config that asks for yarn."""
    from train.checkpoint.io import check_architecture

    out = tmp_path / "run"
    assert run_training(tiny_config(out, "--train.steps=4")) == 0
    path = out / "checkpoint_step4.pt"
    ckpt = torch.load(path, weights_only=False)
    del ckpt["config"]["model"]["rope_scaling"]
    torch.save(ckpt, path)
    assert run_training(tiny_config(out, "--train.steps=6")) == 0
    assert (out / "checkpoint_step6.pt").exists()
    model = {**ckpt["config"]["model"], "rope_scaling": "yarn"}
    with pytest.raises(CheckpointError, match="model.rope_scaling: checkpoint 'linear' vs config 'yarn'"):
        check_architecture(ckpt, model, path)


def test_fresh_run_refuses_to_overwrite_previous_run(tmp_path):
    out = tmp_path / "run"
    run_training(tiny_config(out))

    def written():  # the run's files; .lock only names the latest start's owner (host, pid, time)
        return {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != ".lock"}

    before = written()
    with pytest.raises(ConfigError, match="already holds a run"):
        run_training(tiny_config(out, "--train.resume=none"))
    assert written() == before


def test_unwritable_out_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="not writable"):
        run_training(tiny_config(blocker / "sub"))


def test_missing_bin_dataset(tmp_path):
    proc = _cli(*TINY_CLI, f"--train.out_dir={tmp_path / 'r'}", f"--data.source=bin:{tmp_path / 'nope'}")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


# ---- signals ---------------------------------------------------------------------------------------

def _wait_for(path: Path, predicate, timeout: float = 90.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and predicate(path):
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {path}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_finishes_step_checkpoints_and_exits_zero(tmp_path, sig):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "train", *TINY_CLI, f"--train.out_dir={out}",
                             "--train.steps=100000"], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    beat = out / "heartbeat_rank0.jsonl"
    _wait_for(beat, lambda p: '"kind": "train"' in p.read_text())
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    ck = ckpt_io.latest_checkpoint(out)
    assert ck is not None and ck.name != "checkpoint_step100000.pt"
    assert read_jsonl(beat)[-1]["kind"] == "end"
    assert read_jsonl(beat)[-1]["reason"] == signal.Signals(sig).name


@pytest.mark.fresh_python  # dump files are named by the trainer's pid: the process's own
def test_sigusr1_dumps_stacks_and_training_continues(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "train", *TINY_CLI, f"--train.out_dir={out}",
                             "--train.steps=100000"], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    beat = out / "heartbeat_rank0.jsonl"
    try:
        _wait_for(beat, lambda p: '"kind": "train"' in p.read_text())
        proc.send_signal(signal.SIGUSR1)
        _wait_for(beat, lambda p: '"kind": "stackdump"' in p.read_text())
        n = len(read_jsonl(beat))
        _wait_for(beat, lambda p: len(p.read_text().splitlines()) > n + 2)  # still training
        dump = Path(next(b for b in read_jsonl(beat) if b["kind"] == "stackdump")["path"])
        assert dump == out / f"stackdump_rank0_{proc.pid}.txt"
        text = dump.read_text()
        assert "(most recent call first)" in text and "=MainThread" in text
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]


def test_watchdog_dumps_stacks_on_stall(tmp_path, monkeypatch):
    from train.data.synthetic import SyntheticStream

    original = SyntheticStream.next_batch
    calls = {"n": 0}

    def slow(self):
        calls["n"] += 1
        if calls["n"] == 3:
            time.sleep(3.0)
        return original(self)

    monkeypatch.setattr(SyntheticStream, "next_batch", slow)
    out = tmp_path / "run"
    # the threshold: well above a tiny step on a loaded 2-core machine, well below the stall
    assert run_training(tiny_config(out, "--train.steps=4", "--runtime.watchdog_s=1.0")) == 0
    beats = [b for b in read_jsonl(out / "heartbeat_rank0.jsonl") if b["kind"] == "watchdog"]
    assert len(beats) == 1 and beats[0]["idle_s"] > 1.0
    dump = Path(beats[0]["path"])
    assert dump.name.endswith("_watchdog.txt") and "in slow" in dump.read_text()  # the main thread's stack


# ---- real text (../shared/corpus, byte tokenizer) -------------------------------------------------

def test_real_text_training_learns_and_resumes_exactly(tmp_path, kjv_bin):
    common = (f"--data.source=bin:{kjv_bin}", "--data.tokenizer=byte", "--train.steps=30", "--train.log_every=5",
              "--train.eval_every=15", "--train.eval_steps=4", "--train.batch_size=8", "--train.seq_len=64",
              "--train.lr=1e-2")
    full, split = tmp_path / "full", tmp_path / "split"
    assert run_training(tiny_config(full, *common)) == 0
    rows = read_csv(full / "training.csv")
    val = read_csv(full / "val.csv")
    assert float(rows[-1]["loss"]) < 0.8 * math.log(257)  # below the uniform-byte loss
    assert float(val[-1]["val_loss"]) < float(val[0]["val_loss"])
    metrics = json.loads((full / "metrics.json").read_text())
    assert metrics["data"]["tokenizer"] == "byte"
    assert run_training(tiny_config(split, *common, "--train.stop_after=15")) == 0
    assert run_training(tiny_config(split, *common)) == 0
    assert [(r["step"], r["loss"]) for r in read_csv(split / "training.csv")] == [(r["step"], r["loss"]) for r in rows]
    assert read_csv(split / "val.csv") == val


def test_vocab_smaller_than_dataset_ids_fails_before_training(tmp_path, kjv_bin):
    cfg = tiny_config(tmp_path / "r", f"--data.source=bin:{kjv_bin}", "--data.tokenizer=byte", "--model.vocab_size=128")
    with pytest.raises(DataError, match="vocab"):
        run_training(cfg)
    assert not (tmp_path / "r" / "training.csv").exists()


def test_partial_log_intervals_are_marked_in_training_csv(tmp_path):
    """A stop between log intervals writes a row over fewer steps, and so does the first interval after the
    resume: interval_steps says how many steps each row averages, so a plot can tell them from full rows.
    A training.csv of an older version (without the column) gets the new header, its rows kept."""
    from train.trainer.runner import run_training

    out = tmp_path / "run"
    args = ("--train.steps=15", "--train.log_every=5")
    assert run_training(tiny_config(out, *args, "--train.stop_after=6")) == 0
    rows = read_csv(out / "training.csv")
    assert [(r["step"], r["interval_steps"]) for r in rows] == [("5", "5"), ("6", "1")]  # the stop's row: 1 step
    old_header = [k for k in rows[0] if k != "interval_steps"]
    with open(out / "training.csv", "w") as f:  # as an older version wrote it
        f.write(",".join(old_header) + "\n" + "".join(",".join(r[k] for k in old_header) + "\n" for r in rows))
    assert run_training(tiny_config(out, *args)) == 0
    rows = read_csv(out / "training.csv")
    assert [(r["step"], r["interval_steps"]) for r in rows] == [("5", ""), ("6", ""), ("10", "4"), ("15", "5")]
