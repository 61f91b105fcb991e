"""One recorder for metrics: the sink fan-out (train/observe/sinks.py), hooks and their order (train/trainer/hooks.py), the
training clock (train/trainer/clock.py) and the trainer's own NSA gate alerts (train/observe/alerts.py)."""
from __future__ import annotations

import math
import time

import pytest
import torch

from nsa.attention.gate_stats import gate_statistics
from train.observe.alerts import Alerts
from train.trainer.clock import TrainingClock
from train.trainer.hooks import Hook, Hooks
from train.observe.sinks import ConsoleSink, CsvSink, HeartbeatSink, Recorder, scalars
from train.core.artifacts import TRAIN_FIELDS, read_csv, read_heartbeat

from .helpers import fake_wandb, read_jsonl, tiny_config

NSA = ["--model.attention=nsa", "--nsa.l=8", "--nsa.d=4", "--nsa.l_sel=8", "--nsa.n_sel=3", "--nsa.w=8"]


class FakeSink:
    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def log(self, step, row):
        self.calls.append((self.name, step, row["kind"]))

    def close(self):
        self.calls.append((self.name, "close"))


# ---- the fan-out ------------------------------------------------------------------------------------
def test_recorder_hands_every_row_to_every_sink_in_order():
    calls = []
    recorder = Recorder([FakeSink("a", calls), FakeSink("b", calls)])
    recorder.log(2, {"kind": "train", "step": 2, "loss": 3.0})
    recorder.log(2, {"kind": "alert", "alert": "loss_spike"})
    recorder.close()
    assert calls == [("a", 2, "train"), ("b", 2, "train"), ("a", 2, "alert"), ("b", 2, "alert"),
                     ("a", "close"), ("b", "close")]


def test_each_sink_writes_what_it_has_for_a_kind(tmp_path, capsys):
    train = {"kind": "train", "step": 4, "loss": 2.5, "lr": 1e-3, "toks_per_s": 1234.0, "grad_norm": 0.5,
             "mfu": None, "gate_entropy_mean": 0.6, "sel_free_frac": 0.3}
    alert = {"kind": "alert", "alert": "gate_entropy_low", "gate_entropy_mean": 0.2, "threshold": 0.5,
             "message": "gates saturating"}
    sample = {"kind": "sample", "samples": [{"prompt": "ab", "text": "cd", "tokens": [99, 100]}]}
    assert scalars(train) == {"train/loss": 2.5, "train/lr": 1e-3, "train/toks_per_s": 1234.0, "train/grad_norm": 0.5,
                              "train/mfu": None, "gates/gate_entropy_mean": 0.6, "gates/sel_free_frac": 0.3}
    assert scalars({"kind": "eval", "val_loss": 3.0, "ppl": 20.1}) == {"val/loss": 3.0, "val/ppl": 20.1}
    assert scalars(alert) == {"alerts/gate_entropy_low": 1.0} and scalars(sample) == {}

    csv = CsvSink(tmp_path / "training.csv", TRAIN_FIELDS, "train", None)
    beat = HeartbeatSink(tmp_path / "hb.jsonl", rank=0)
    recorder = Recorder([csv, beat, ConsoleSink(tmp_path)])
    for row in (train, alert, sample, {"kind": "eval", "val_loss": 3.0, "ppl": 20.1}):
        recorder.log(4, row)
    recorder.close()
    (written,) = read_csv(tmp_path / "training.csv")  # the train row only, schema columns only
    assert written["step"] == "4" and written["loss"] == "2.5" and "gate_entropy_mean" not in written
    records = read_heartbeat(tmp_path / "hb.jsonl")
    assert [r["kind"] for r in records] == ["train", "alert", "eval"]  # 'sample' is no heartbeat kind
    assert records[0]["gate_entropy_mean"] == 0.6 and "kind" not in list(records[0])[5:]
    assert records[1]["alert"] == "gate_entropy_low" and records[1]["message"] == "gates saturating"
    out = capsys.readouterr().out.splitlines()
    assert out == ["step      4 | loss 2.5000 | lr 1.00e-03 | 1,234 tok/s | norm 0.500",
                   "step      4 | alert gate_entropy_low: gate_entropy_mean 0.2, threshold 0.5 | gates saturating",
                   "step      4 | sample: 'abcd'",
                   "step      4 | val loss 3.0000 | ppl 20.10"]


# ---- hooks ------------------------------------------------------------------------------------------
def test_hooks_run_in_list_order_and_close_in_reverse_only_when_opened():
    calls = []

    class Named(Hook):
        def __init__(self, name, fail_open=False):
            self.name, self.fail_open = name, fail_open

        def open(self, step):
            if self.fail_open:
                raise RuntimeError("cannot open")
            calls.append(("open", self.name))

        def after_log(self, step, row):
            calls.append(("after_log", self.name))

        def close(self, step):
            calls.append(("close", self.name))

    hooks = Hooks([Named("gc"), Named("profiler"), Named("alerts")])
    hooks.open(0)
    hooks.after_log(2, {})
    hooks.close(2)
    assert calls == [("open", "gc"), ("open", "profiler"), ("open", "alerts"), ("after_log", "gc"),
                     ("after_log", "profiler"), ("after_log", "alerts"),
                     ("close", "alerts"), ("close", "profiler"), ("close", "gc")]
    calls.clear()
    broken = Hooks([Named("gc"), Named("watchdog", fail_open=True), Named("alerts")])
    with pytest.raises(RuntimeError):
        broken.open(0)
    broken.close(0)
    assert calls == [("open", "gc"), ("close", "gc")]


# ---- what counts as training time ------------------------------------------------------------------
def test_clock_excludes_time_off_the_clock():
    now = {"t": 100.0}
    clock = TrainingClock(now=lambda: now["t"])
    now["t"] += 2.0  # training
    with clock.off_the_clock():  # evaluation, with a nested checkpoint: counted once
        now["t"] += 5.0
        with clock.off_the_clock():
            now["t"] += 1.0
    now["t"] += 3.0
    assert clock.lap() == pytest.approx(5.0)
    with clock.off_the_clock():  # a lap inside: each interval loses only its own part
        now["t"] += 4.0
        assert clock.lap() == pytest.approx(1e-9)
        now["t"] += 6.0
    now["t"] += 1.0
    assert clock.lap() == pytest.approx(1.0)


def test_clock_with_real_sleeps():
    clock = TrainingClock()
    with clock.off_the_clock():
        time.sleep(0.4)
    time.sleep(0.02)
    assert 0.02 <= clock.lap() < 0.3


def test_eval_sampling_and_checkpoint_time_is_not_training_time(tmp_path, monkeypatch):
    """Each of evaluation, sampling and saving sleeps 0.3 s at step 2: were it counted, the interval of
    steps 3-4 would take >= 0.45 s per step; a tiny CPU step takes milliseconds."""
    from train.trainer.build_run import Run
    from train.trainer.loop import Loop
    from train.generation.sampling import TrainingSampler

    def slow(method):
        def wrapped(*args, **kwargs):
            time.sleep(0.3)
            return method(*args, **kwargs)
        return wrapped

    for cls, name in ((Loop, "evaluate"), (TrainingSampler, "sample"), (Run, "save")):
        monkeypatch.setattr(cls, name, slow(getattr(cls, name)))
    out = tmp_path / "run"
    cfg = tiny_config(out, "--train.steps=4", "--train.eval_every=2", "--train.save_every=2", "--train.sample_every=2",
                      "--data.tokenizer=byte", "--train.sample_tokens=2", "--train.eval_steps=1")
    from train.trainer.runner import run_training

    assert run_training(cfg) == 0
    rows = read_csv(out / "training.csv")
    assert [r["step"] for r in rows] == ["2", "4"]
    assert float(rows[1]["dt_step_s"]) < 0.3, rows[1]


# ---- the trainer's own gate alerts -------------------------------------------------------------------
def gate_row(step, gates):
    stats = {k: v.item() for k, v in gate_statistics(gates).items()}
    return {"step": step, "loss": 3.0, "toks_per_s": 1000.0, **stats}


def test_gate_alerts_fire_on_crossing_and_again_after_recovery(tmp_path):
    cfg = tiny_config(tmp_path, "--runtime.gate_collapse_alert=0.01", "--runtime.gate_entropy_alert=0.5")
    alerts = Alerts(cfg)
    healthy = torch.full((2, 8, 4, 3), 0.5)  # [B, T, H, 3]: every gate at 0.5, entropy ln 2
    collapsed = torch.tensor([0.999, 0.001, 0.001]).expand(2, 8, 4, 3)  # the compressed branch took over
    assert alerts.observe(gate_row(1, healthy)) == []
    fired = alerts.observe(gate_row(2, collapsed))
    assert [a["alert"] for a in fired] == ["gate_collapse", "gate_entropy_low"]
    assert fired[0]["gate_collapse_frac"] == 1.0 and fired[0]["threshold"] == 0.01 and fired[0]["message"]
    assert fired[1]["gate_entropy_mean"] < 0.5 and fired[1]["message"]
    assert alerts.observe(gate_row(3, collapsed)) == []  # still collapsed: said once
    assert alerts.observe(gate_row(4, healthy)) == []
    assert [a["alert"] for a in alerts.observe(gate_row(5, collapsed))] == ["gate_collapse", "gate_entropy_low"]
    off = Alerts(tiny_config(tmp_path, "--runtime.gate_collapse_alert=0", "--runtime.gate_entropy_alert=0"))
    assert off.observe(gate_row(1, collapsed)) == []
    assert Alerts(cfg).observe({"step": 1, "loss": 3.0, "toks_per_s": 1.0}) == []  # dense: no gate statistics


def test_the_entropy_alert_keeps_its_fraction_of_the_gate_inits_starting_entropy(tmp_path):
    """0.5 nats is 72% of ln 2 (gates starting equal); the window init at b = 2 starts at 0.365 nats, so its
    threshold is 72% of that: its own step 0 is healthy, a drop to 0.2 nats is not."""
    window_start = torch.tensor([0.12, 0.12, 0.88]).expand(2, 8, 4, 3)  # [B, T, H, 3] (cmp, sel, win)
    dropped = torch.tensor([0.03, 0.03, 0.97]).expand(2, 8, 4, 3)  # entropy ~0.13 nats
    drifted = torch.tensor([0.08, 0.08, 0.92]).expand(2, 8, 4, 3)  # ~0.28 nats: above 0.72 x 0.365
    window = Alerts(tiny_config(tmp_path, "--runtime.gate_entropy_alert=0.5", "--model.attention=nsa",
                                    "--nsa.gate_init=window", "--nsa.gate_bias=2"))
    assert window.gate_entropy_threshold == pytest.approx(0.5 * 0.365 / math.log(2), abs=1e-3)
    assert window.observe(gate_row(1, window_start)) == [] and window.observe(gate_row(2, drifted)) == []
    assert [a["alert"] for a in window.observe(gate_row(3, dropped))] == ["gate_entropy_low"]
    equal = Alerts(tiny_config(tmp_path, "--runtime.gate_entropy_alert=0.5", "--model.attention=nsa",
                               "--nsa.gate_init=equal"))
    assert equal.gate_entropy_threshold == 0.5
    assert [a["alert"] for a in equal.observe(gate_row(1, window_start))] == ["gate_entropy_low"]


def test_an_nsa_run_alerts_console_heartbeat_tensorboard_and_wandb(tmp_path, monkeypatch, capsys):
    """gate_entropy_alert above ln 2 forces a low-entropy alert at the first log interval, once."""
    logged = fake_wandb(monkeypatch)
    out = tmp_path / "run"
    cfg = tiny_config(out, *NSA, "--train.steps=4", "--runtime.gate_entropy_alert=1.0", "--nsa.gate_init=equal",
                      "--runtime.wandb=true")
    from train.trainer.runner import run_training

    assert run_training(cfg) == 0
    beats = read_jsonl(out / "heartbeat_rank0.jsonl")
    (alert,) = [b for b in beats if b["kind"] == "alert"]
    assert alert["step"] == 2 and alert["alert"] == "gate_entropy_low" and alert["threshold"] == 1.0
    assert math.isfinite(alert["gate_entropy_mean"]) and "gate_entropy_mean" in alert["message"]
    train = next(b for b in beats if b["kind"] == "train")
    assert "gate_collapse_frac" in train and "sel_free_frac" in train  # gate statistics unprefixed, as before
    assert "step      2 | alert gate_entropy_low: gate_entropy_mean " in capsys.readouterr().out
    assert [step for step, values in logged if "alerts/gate_entropy_low" in values] == [2]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tb"), size_guidance={"scalars": 0, "tensors": 0}).Reload()
    assert [e.step for e in events.Scalars("alerts/gate_entropy_low")] == [2]
    assert "alerts/gate_entropy_low/text_summary" in events.Tags()["tensors"]
    assert "gates/gate_entropy_mean" in events.Tags()["scalars"] and "train/loss" in events.Tags()["scalars"]


def test_rows_moved_aside_keep_a_header_over_many_resumes(tmp_path):
    """Rows a resume moves to training.csv.superseded are read back by csv.DictReader like the live file's: one
    header line however many resumes moved rows there, and a headerless file of an older version gets one."""
    from train.observe.telemetry import CsvLog

    path = tmp_path / "training.csv"
    moved = path.with_name("training.csv.superseded")

    def log_steps(steps, resume_step):
        log = CsvLog(path, TRAIN_FIELDS, resume_step)
        for step in steps:
            log.write({"step": step, "loss": 10.0 - step})
        log.close()

    log_steps(range(1, 7), None)
    log_steps(range(5, 9), 4)  # a crash after step 6, resumed from 4: 5, 6 move aside
    log_steps(range(3, 5), 2)  # resumed from 2: 3..8 move aside
    assert [int(r["step"]) for r in read_csv(path)] == [1, 2, 3, 4]
    assert [(int(r["step"]), float(r["loss"])) for r in read_csv(moved)] == [(s, 10.0 - s) for s in (5, 6, 3, 4, 5, 6, 7, 8)]
    assert moved.read_text().count("step,loss") == 1

    moved.write_text("9,1.5\n10,0.5\n")  # as an older version wrote it: rows, no header
    log_steps([], 2)
    assert [int(r["step"]) for r in read_csv(moved)] == [9, 10, 3, 4]
    assert list(read_csv(moved)[0]) == TRAIN_FIELDS
