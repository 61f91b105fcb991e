"""Training on a data mixture: per-source validation in val.csv, the realised shares in training.csv, and exact resume
(bitwise losses and weights) across .HALT, kill -9 and a stage boundary; a resume whose mixture changed is refused."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from train.core.errors import DataError
from train.data.mixture import MixtureStream
from train.trainer.runner import run_training

from .helpers import TINY_CLI, kill9_after, read_csv, run_reference_and_resume, tiny_config

MIX = ["--data.mixture=[{name: easy, source: synthetic, weight: 3}, {name: hard, source: synthetic, weight: 1}]",
       "--data.stages=[{at: 6, weights: {easy: 1, hard: 3}}]"]
ROW_KEYS = ("step", "loss", "grad_norm", "lr", "share_easy", "share_hard")


def rows(out: Path) -> list[tuple]:
    return [tuple(r[k] for k in ROW_KEYS) for r in read_csv(out / "training.csv")]


def same_weights(a: Path, b: Path) -> bool:
    ca, cb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return all(torch.equal(ca["model"][k], cb["model"][k]) for k in ca["model"]) and ca["data"] == cb["data"]


def test_val_csv_has_each_sources_loss_and_the_weighted_total(tmp_path):
    out = tmp_path / "run"
    assert run_training(tiny_config(out, *MIX, "--train.steps=8", "--train.eval_every=4")) == 0
    val = read_csv(out / "val.csv")
    assert [int(r["step"]) for r in val] == [4, 8]
    for row, weights in zip(val, ((0.75, 0.25), (0.25, 0.75))):  # step 4: the first stage; step 8: the second
        easy, hard = float(row["val_loss_easy"]), float(row["val_loss_hard"])
        assert easy != hard
        assert float(row["val_loss"]) == pytest.approx(weights[0] * easy + weights[1] * hard, rel=1e-12)
        assert math.isnan(float(row["bpb_easy"]))  # synthetic tokens have no text bytes
    train = read_csv(out / "training.csv")
    shares = [(float(r["share_easy"]), float(r["share_hard"])) for r in train]
    assert all(abs(a + b - 1) < 1e-12 for a, b in shares)


def test_halt_then_resume_across_a_stage_boundary_is_bit_for_bit(tmp_path, monkeypatch):
    args = (*MIX, "--train.steps=10", "--train.log_every=1", "--train.eval_every=5")
    full, split = tmp_path / "full", tmp_path / "split"
    assert run_training(tiny_config(full, *args)) == 0
    original, calls = MixtureStream.next_batch, {"n": 0}

    def next_batch(self):
        calls["n"] += 1
        if calls["n"] == 4:
            (split / ".HALT").touch()
        return original(self)

    monkeypatch.setattr(MixtureStream, "next_batch", next_batch)
    assert run_training(tiny_config(split, *args)) == 0
    monkeypatch.setattr(MixtureStream, "next_batch", original)
    assert [int(r["step"]) for r in read_csv(split / "training.csv")] == [1, 2, 3, 4]
    (split / ".HALT").unlink()
    assert run_training(tiny_config(split, *args)) == 0  # steps 5-10: over the stage boundary at step 6
    assert rows(split) == rows(full)
    assert read_csv(split / "val.csv") == read_csv(full / "val.csv")
    assert same_weights(full / "checkpoint_step10.pt", split / "checkpoint_step10.pt")


def test_kill9_then_resume_across_a_stage_boundary_is_bit_for_bit(tmp_path):
    args = [*TINY_CLI, "--data.mixture=[{name: a, source: synthetic, weight: 1}, {name: b, source: synthetic, weight: 1}]",
            "--data.stages=[{at: 100, weights: {b: 1}}]", "--train.steps=150", "--train.warmup_steps=5",
            "--train.save_every=10", "--train.eval_every=0"]
    reference, out = tmp_path / "reference", tmp_path / "killed"
    assert 60 <= kill9_after([*args, "--train.save_every=10"], out, "checkpoint_step60.pt") < 150
    run_reference_and_resume(args, reference, out)
    keys = ("step", "loss", "grad_norm", "lr", "share_a", "share_b")
    assert [tuple(r[k] for k in keys) for r in read_csv(out / "training.csv")] == \
        [tuple(r[k] for k in keys) for r in read_csv(reference / "training.csv")]
    assert same_weights(reference / "checkpoint_step150.pt", out / "checkpoint_step150.pt")


def test_a_resume_whose_mixture_changed_is_refused_before_anything_is_written(tmp_path):
    out = tmp_path / "run"
    assert run_training(tiny_config(out, *MIX, "--train.steps=8", "--train.stop_after=4")) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != ".lock"}
    changed = ["--data.mixture=[{name: easy, source: synthetic, weight: 1}, {name: hard, source: synthetic, weight: 1}]",
               "--data.stages=[{at: 6, weights: {easy: 1, hard: 3}}]"]
    with pytest.raises(DataError, match="another data mixture"):
        run_training(tiny_config(out, *changed, "--train.steps=8"))
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != ".lock"} == before
