"""scripts/monitor_frame.py (the analysis) on hand-made out_dirs and on a real NSA run, and
scripts/monitor_run.sh / monitor_production_50k.sh --once: progress, ETA, every gate and selection
statistic the trainer writes, checkpoints, flags, the trainer's alerts (shown, never recomputed),
and what only the monitor can tell (stale heartbeat, NaN, watchdog)."""
from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import pytest

from train.core.artifacts import (
    GATE_STATS, SELECTION_HEALTH, SELECTION_STATS, TRAIN_FIELDS, heartbeat_name, nsa_layer_statistics, nsa_statistics,
    read_heartbeat,
)
from tests.scripts.helpers import A100_80, REPO, run_script

spec = importlib.util.spec_from_file_location("monitor_frame", REPO / "scripts" / "monitor_frame.py")
monitor_frame = importlib.util.module_from_spec(spec)
spec.loader.exec_module(monitor_frame)

FIELDS = TRAIN_FIELDS
NOW = 1_800_000_000.0
# the trainer's own key names (nsa/attention/gate_stats.py; train/core/artifacts.py lists them)
HEALTHY_GATES = {"gate_entropy_mean": 0.62, "gate_entropy_min": 0.2, "gate_collapse_frac": 0.0,
                 "gate_share_cmp": 0.3, "gate_share_sel": 0.35, "gate_share_win": 0.35,
                 "sel_free_frac": 0.7, "sel_distance_mean": 5.5}


def make_out(root: Path, *, n=10, steps=1000, every=10, loss=lambda i: 6.0 - 0.1 * i, tps=lambda i: 1000.0,
             gates=None, status="running", age=5.0, skipped=lambda i: 0, spiked=lambda i: 0) -> Path:
    out = root / "out"
    out.mkdir(parents=True)
    with open(out / "training.csv", "w", newline="") as f:
        w = csv.DictWriter(f, FIELDS)
        w.writeheader()
        for i in range(1, n + 1):
            w.writerow({"step": i * every, "loss": loss(i), "lr": 1e-4, "toks_per_s": tps(i), "grad_norm": 1.0,
                        "dt_step_s": 0.5, "dt_fetch_s": 0.01, "tokens_seen": i * 1000, "skipped_steps": skipped(i),
                        "spike_skipped_steps": spiked(i),
                        "mfu": 0.4, "toks_per_s_per_gpu": tps(i) / 2, "mem_reserved_mib": 30000})
    (out / "val.csv").write_text("step,val_loss,ppl\n50,4.0,54.6\n100,3.5,33.1\n")
    t0 = NOW - age - n * 5
    recs = [{"ts": t0 - 1, "rank": 0, "step": 0, "kind": "start", "resumed_from": None}]
    for i in range(1, n + 1):
        r = {"ts": t0 + 5 * i, "rank": 0, "step": i * every, "kind": "train", "loss": loss(i)}
        r.update(gates or {})
        recs.append(r)
    recs[-1]["ts"] = NOW - age
    (out / "heartbeat_rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (out / "heartbeat_rank1.jsonl").write_text(json.dumps({"ts": NOW - age, "rank": 1, "step": n * every,
                                                           "kind": "train"}) + "\n")
    (out / "metrics.json").write_text(json.dumps({"status": status, "step": n * every, "steps": steps}))
    (out / f"checkpoint_step{n * every}.pt").write_bytes(b"x" * 2000)
    return out


def frame(target, **kw):
    kw.setdefault("nvidia_smi", None)
    kw.setdefault("now", NOW)
    return monitor_frame.build_frame(target, **kw)


def test_healthy_run(tmp_path):
    out = make_out(tmp_path, gates=HEALTHY_GATES)
    text, alerts = frame(out)
    assert alerts == []
    assert "alerts      none" in text
    assert "progress    step 100 / 1,000 (10.0%) | ETA" in text
    assert "(0.500 s/step)" in text                         # 5 s per 10 steps from heartbeat timestamps
    assert "loss        last 5.0000 | mean of last 10 5.4500" in text
    assert "tokens/s    last 1,000 | mean of last 10 1,000 | per GPU 500 | MFU 40.0%" in text
    assert "val         step 100 loss 3.5000 ppl 33.10 | best 3.5000" in text
    assert "rank0: 5s ago (train, step 100) | rank1: 5s ago" in text
    assert "gates       step 100: entropy_mean 0.620 | entropy_min 0.200 | collapse_frac 0.000 | share_cmp 0.300" in text
    assert "selection   step 100: free_frac 0.700 | distance_mean 5.500" in text
    assert "checkpoint  checkpoint_step100.pt (2.0 KB" in text
    assert "flags       none" in text
    assert "tasks " not in text  # a run without train.eval_tasks has no tasks line


def test_downstream_tasks_line(tmp_path):
    """tasks.csv (train.eval_tasks): each task's latest primary metric with its stderr and its first evaluation's;
    a task missing from the newest evaluation says its own step."""
    out = make_out(tmp_path)
    rows = [(0, "hellaswag:rc_0shot", 0.25, 0.019), (0, "/data/mine.jsonl", 0.2, 0.18),
            (50, "hellaswag:rc_0shot", 0.262, 0.0197), (50, "/data/mine.jsonl", 0.6, 0.219),
            (100, "hellaswag:rc_0shot", 0.281, 0.0201)]
    (out / "tasks.csv").write_text("step,tokens_seen,task,primary_metric,primary,primary_stderr\n" + "".join(
        f"{s},{s * 100},{t},{'acc' if 'mine' in t else 'acc_per_char'},{p},{e}\n" for s, t, p, e in rows))
    text, alerts = frame(out)
    assert alerts == []
    assert ("tasks       step 100: hellaswag:rc_0shot acc_per_char 0.281 ± 0.020 (0.250 at step 0) | "
            "mine acc 0.600 ± 0.219 at step 50 (0.200 at step 0)") in text


def test_selection_health_is_one_compact_line(tmp_path):
    health = {"sel_recall": 0.812, "sel_outside_window": 0.25, "gate_mean_cmp": 0.02, "gate_mean_sel": 0.03,
              "gate_mean_win": 0.95, "sel_recall_layers": [0.804, 0.82], "sel_outside_window_layers": [0.2, 0.3]}
    text, _ = frame(make_out(tmp_path / "new", gates={**HEALTHY_GATES, **health}))
    assert ("sel health  step 100: recall 0.812 | outside_window 0.250 | mean_cmp 0.020 | mean_sel 0.030 | "
            "mean_win 0.950 | recall by layer 0.80 0.82") in text.splitlines()
    text, _ = frame(make_out(tmp_path / "old", gates=HEALTHY_GATES))  # a run from before selection health
    assert "sel health" not in text and "selection   step 100: free_frac 0.700" in text


def trainer_alert(out: Path, **record) -> None:
    with open(out / "heartbeat_rank0.jsonl", "a") as f:
        f.write(json.dumps({"ts": NOW - 2, "rank": 0, "step": 100, "kind": "alert", **record}) + "\n")


@pytest.mark.parametrize("rows, record, expect", [
    (dict(tps=lambda i: 500.0 if i == 10 else 1000.0),
     {"alert": "throughput_drop", "message": "capturing a profiler trace"},
     "trainer: throughput_drop at step 100: capturing a profiler trace"),
    (dict(loss=lambda i: 1.2, steps=10_000), {"alert": "loss_below_floor", "message": "suspect data leakage"},
     "trainer: loss_below_floor at step 100: suspect data leakage"),
    (dict(gates={**HEALTHY_GATES, "gate_collapse_frac": 0.3}), {"alert": "gate_collapse", "message": "one branch took over"},
     "trainer: gate_collapse at step 100: one branch took over"),
])
def test_alerts_are_the_trainers_not_recomputed(tmp_path, rows, record, expect):
    """A throughput dip, an early low loss or collapsed gates in the files raise nothing by themselves: the
    monitor shows the trainer's alert records (train/observe/alerts.py decides, with the run's thresholds)."""
    out = make_out(tmp_path, **rows)
    assert frame(out)[1] == []
    trainer_alert(out, **record)
    assert frame(out)[1] == [expect]


def test_stale_heartbeat_only_while_running(tmp_path):
    out = make_out(tmp_path / "a", age=1000)
    _, alerts = frame(out)
    assert sum(a.startswith("stale: heartbeat rank") for a in alerts) == 2
    out = make_out(tmp_path / "b", age=1000, status="finished")
    _, alerts = frame(out)
    assert alerts == []


def test_missing_gate_keys_are_fine(tmp_path):
    text, alerts = frame(make_out(tmp_path))
    assert "gates       n/a" in text and alerts == []


def test_nan_and_anomaly(tmp_path):
    out = make_out(tmp_path, loss=lambda i: float("nan") if i == 10 else 5.0, skipped=lambda i: 2 if i > 8 else 0)
    (out / ".anomaly_type").write_text("nonfinite_loss: 4 skipped steps > limit 3\n")
    text, alerts = frame(out)
    assert "nan: non-finite loss at step 100" in alerts
    assert any(a.startswith("nan: 2 non-finite step(s) skipped") for a in alerts)
    assert any(a.startswith("nan: the run halted on an anomaly: nonfinite_loss") for a in alerts)
    assert "ANOMALY: nonfinite_loss" in text


def test_spike_skips_and_their_halt(tmp_path):
    assert "spikes " not in frame(make_out(tmp_path / "none"))[0]  # none skipped: no line, no alert
    out = make_out(tmp_path, spiked=lambda i: 3 if i >= 9 else 1)
    (out / ".anomaly_type").write_text("loss_spike_skips: 3 spike-skipped steps in a row >= limit 3 at step 100\n")
    text, alerts = frame(out)
    assert "spikes      3 step(s) skipped as loss / grad-norm spikes in the run, 2 in the window" in text
    assert "spike: 2 step(s) skipped as loss / grad-norm spikes in the window (3 in the run)" in alerts
    assert any(a.startswith("spike: the run halted on an anomaly: loss_spike_skips") for a in alerts)
    assert not any(a.startswith("nan:") for a in alerts)


def test_watchdog_trainer_alerts_and_halt_flag(tmp_path):
    out = make_out(tmp_path)
    with open(out / "heartbeat_rank0.jsonl", "a") as f:
        f.write(json.dumps({"ts": NOW - 4, "rank": 0, "step": 100, "kind": "watchdog", "idle_s": 950.0,
                            "path": "stackdump_rank0_4242_watchdog.txt"}) + "\n")
        f.write(json.dumps({"ts": NOW - 3, "rank": 0, "step": 100, "kind": "alert", "alert": "loss_below_floor",
                            "message": "suspect data leakage"}) + "\n")
        f.write('{"ts": 18000')  # a line being written right now
    (out / ".HALT").touch()
    header = "# stack dumps of rank 0 on SIGUSR1 (kill -USR1 4242), newest last; opened ...\n"
    (out / "stackdump_rank0_4242.txt").write_text(
        header + "Current thread 0x00007f0000000001 (most recent call first):\n  File \"x.py\", line 1 in f\n")
    (out / "stackdump_rank0_4242_watchdog.txt").write_text(header)  # opened at start, no dump yet: not counted
    text, alerts = frame(out)
    assert any(a.startswith("watchdog: no step for 15m50s at step 100") for a in alerts)
    assert "trainer: loss_below_floor at step 100: suspect data leakage" in alerts
    assert "HALT requested" in text and "stack dumps in 1 file(s), newest stackdump_rank0_4242.txt" in text


def test_run_dir_and_missing_out_dir(tmp_path):
    run = tmp_path / "train_runs" / "m7c_x"
    run.mkdir(parents=True)
    (run / "run.info").write_text(f"config: configs/m7c_cpu.yaml\ngpu_count: 0\nout_dir: {tmp_path}/out\n")
    text, _ = frame(run)
    assert "does not exist yet" in text
    make_out(tmp_path)
    text, _ = frame(run)
    assert f"== {tmp_path}/out  (run {run})" in text and "config configs/m7c_cpu.yaml | gpus 0" in text


def test_monitor_scripts_once(tmp_path, fake_smi, script_env):
    out = make_out(tmp_path, gates=HEALTHY_GATES, age=0)
    env = script_env(fake_smi([A100_80, A100_80]), FAKE_GPU_USED_MIB="30720")
    res = run_script("monitor_run.sh", env, "--once", str(out), timeout=60)
    assert res.returncode == 0, res.stderr
    assert "gpu         gpu0 NVIDIA A100-SXM4-80GB: 30.0/80.0 GiB, util 0%" in res.stdout
    assert "progress    step 100 / 1,000" in res.stdout
    res = run_script("monitor_production_50k.sh", env | {"OUT_DIR": str(out), "WINDOW": "3"}, "--once", timeout=60)
    assert res.returncode == 0 and "mean of last 3" in res.stdout
    res = run_script("monitor_run.sh", env, "--once", str(tmp_path / "nothing"), timeout=60)
    assert res.returncode == 2 and "does not exist" in res.stderr
    res = run_script("monitor_run.sh", env, "--bogus", timeout=60)
    assert res.returncode == 2


def test_monitor_defaults_to_the_newest_run(tmp_path, script_env):
    out = make_out(tmp_path)
    for name in ("m7c_20250101_000000", "m7c_20250102_000000"):
        run = tmp_path / "artifacts" / "train_runs" / name
        run.mkdir(parents=True)
        (run / "run.info").write_text(f"config: c_{name}.yaml\nout_dir: {out}\n")
    res = run_script("monitor_run.sh", script_env(), "--once", timeout=60)
    assert res.returncode == 0 and "config c_m7c_20250102_000000.yaml" in res.stdout


def test_default_run_is_the_one_training_not_a_newer_failed_launch(tmp_path, script_env):
    """A launch that failed before training (its out_dir holds no metrics) is newer by name than the
    run that is training; the monitor and TensorBoard both default to the training one."""
    training_out = make_out(tmp_path)
    runs = tmp_path / "artifacts" / "train_runs"
    for name, out in (("m7c_20250101_000000", training_out), ("m7c_20250102_000000", tmp_path / "failed_out")):
        (runs / name).mkdir(parents=True)
        (runs / name / "run.info").write_text(f"config: c_{name}.yaml\nout_dir: {out}\n")
    res = run_script("monitor_run.sh", script_env(), "--once", timeout=60)
    assert res.returncode == 0 and "config c_m7c_20250101_000000.yaml" in res.stdout, res.stdout + res.stderr
    res = run_script("run_tensorboard.sh", script_env(DRY_RUN="1"), timeout=30)
    assert res.returncode == 0 and f"--logdir {training_out}/tb " in res.stdout, res.stdout + res.stderr


def test_real_nsa_run_shows_every_statistic_the_trainer_wrote(tmp_path):
    """make smoke-nsa's config (a few steps): each gate_* and sel_* value of the last heartbeat 'train'
    record appears in the frame, under the trainer's own names."""
    import subprocess
    import sys

    out = tmp_path / "smoke_nsa"
    proc = subprocess.run([sys.executable, "-m", "train", "configs/train_showcase_nsa.yaml", f"--train.out_dir={out}",
                           "--train.steps=4", "--train.log_every=2", "--train.eval_every=0", "--runtime.threads=1"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = [r for r in read_heartbeat(out / heartbeat_name(0)) if r.get("kind") == "train"][-1]
    written = nsa_statistics(last)
    # the trainer writes every name the schema lists
    assert set(written) == set(GATE_STATS) | set(SELECTION_STATS) | set(SELECTION_HEALTH)
    assert set(nsa_layer_statistics(last)) == set(SELECTION_HEALTH)
    text, _ = monitor_frame.build_frame(out, nvidia_smi=None)
    for key, value in written.items():
        shown = f"{key.removeprefix('gate_').removeprefix('sel_')} {value:.3f}"
        assert shown in text, (shown, text)
    (health,) = [line for line in text.splitlines() if line.startswith("sel health")]  # one compact line
    recall = nsa_layer_statistics(last)["sel_recall"]
    assert "recall by layer " + " ".join(f"{v:.2f}" for v in recall) in health
