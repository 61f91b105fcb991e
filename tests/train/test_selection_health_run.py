"""Selection health over training (nsa/attention/selection_health.py via train/trainer/loop.py GateStats): a tiny
NSA run writes it to the heartbeat, the run summary, TensorBoard and W&B, and its recall, computed after the
logged step, is not training time (train/trainer/clock.py)."""
from __future__ import annotations

import json
import math
import time

import pytest

import nsa.gate_health
from train.core.artifacts import SELECTION_HEALTH, layer_key, read_csv, read_heartbeat
from train.observe.sinks import scalars

from .helpers import fake_wandb, tiny_config

NSA = ["--model.attention=nsa", "--nsa.l=8", "--nsa.d=4", "--nsa.l_sel=8", "--nsa.n_sel=3", "--nsa.w=8"]


def test_an_nsa_run_logs_selection_health_per_layer(tmp_path, monkeypatch):
    logged = fake_wandb(monkeypatch)
    out = tmp_path / "run"
    cfg = tiny_config(out, *NSA, "--train.steps=4", "--runtime.wandb=true")  # 2 layers, seq 32: 4 blocks of 8, n = 3
    from train.trainer.runner import run_training

    assert run_training(cfg) == 0
    train = [r for r in read_heartbeat(out / "heartbeat_rank0.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == [2, 4]
    for record in train:
        for name in SELECTION_HEALTH:
            per_layer = record[layer_key(name)]
            assert len(per_layer) == 2 and all(isinstance(v, float) and 0 <= v <= 1 for v in per_layer), (name, per_layer)
            assert record[name] == pytest.approx(sum(per_layer) / 2, abs=1e-6), name
        assert record["sel_recall"] < 1  # queries past 3 blocks have one unchosen
        assert record["gate_mean_win"] > record["gate_mean_cmp"]  # the default window init: 0.98 vs 0.02
    (summary,) = out.glob("run_*.json")
    iterations = json.loads(summary.read_text())["training_iterations"]
    assert iterations[-1]["sel_recall_layers"] == train[-1]["sel_recall_layers"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tb"), size_guidance={"scalars": 0, "tensors": 0}).Reload()
    tags = events.Tags()["scalars"]
    for tag in ("selection/recall/layer0", "selection/recall/layer1", "selection/outside_window/layer1",
                "gates/mean_cmp/layer0", "gates/mean_win/layer1", "gates/sel_recall", "gates/gate_mean_sel"):
        assert tag in tags, (tag, tags)
    assert [e.step for e in events.Scalars("selection/recall/layer1")] == [2, 4]
    assert events.Scalars("selection/recall/layer0")[-1].value == pytest.approx(train[-1]["sel_recall_layers"][0])
    at_4 = {k: v for step, values in logged if step == 4 for k, v in values.items()}
    assert at_4["selection/recall/layer1"] == train[-1]["sel_recall_layers"][1]
    assert at_4["gates/sel_outside_window"] == train[-1]["sel_outside_window"]


def test_scalars_spread_per_layer_lists():
    row = {"kind": "train", "step": 2, "loss": 1.0, "sel_recall": 0.7, "sel_recall_layers": [0.6, 0.8],
           "gate_mean_win_layers": [0.9, 0.5]}
    assert scalars(row) == {"train/loss": 1.0, "gates/sel_recall": 0.7, "selection/recall/layer0": 0.6,
                            "selection/recall/layer1": 0.8, "gates/mean_win/layer0": 0.9, "gates/mean_win/layer1": 0.5}


def test_selection_recall_is_not_training_time(tmp_path, monkeypatch):
    """The recall of each layer sleeps 0.5 s: were it on the clock, the interval of steps 3-4 (two layers' recall
    at step 4) would take >= 0.5 s per step; a tiny CPU step takes milliseconds."""
    calls = []
    real = nsa.gate_health.selection_recall

    def slow(*args, **kwargs):
        calls.append(1)
        time.sleep(0.5)
        return real(*args, **kwargs)

    monkeypatch.setattr(nsa.gate_health, "selection_recall", slow)
    out = tmp_path / "run"
    from train.trainer.runner import run_training

    assert run_training(tiny_config(out, *NSA, "--train.steps=4", "--train.eval_every=0")) == 0
    assert len(calls) == 4  # 2 layers x 2 log intervals
    rows = read_csv(out / "training.csv")
    assert [r["step"] for r in rows] == ["2", "4"]
    assert float(rows[1]["dt_step_s"]) < 0.5, rows[1]
    last = [r for r in read_heartbeat(out / "heartbeat_rank0.jsonl") if r["kind"] == "train"][-1]
    assert math.isfinite(last["sel_recall"])
