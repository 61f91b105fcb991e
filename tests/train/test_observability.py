"""Alerts, profiler captures, NVTX / SDPA audit switches, environment knobs, the seed entrypoint."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


from nsa import profiling
from train.observe.alerts import Alerts
from train.core.env import env_overrides
from train.trainer.runner import run_training

from .helpers import read_csv, read_jsonl, tiny_config

REPO = Path(__file__).resolve().parents[2]


def row(step, loss=3.0, rate=1000.0):
    return {"step": step, "loss": loss, "toks_per_s": rate}


def test_loss_spike_and_floor_alerts(tmp_path):
    cfg = tiny_config(tmp_path, "--train.loss_floor=1.5", "--train.loss_floor_steps=100")
    alerts = Alerts(cfg)
    quiet = [alerts.observe(row(i, 3.0 + 0.01 * (i % 3))) for i in range(1, 20)]
    assert all(a == [] for a in quiet)
    spike = alerts.observe(row(20, 4.0))
    assert [a["alert"] for a in spike] == ["loss_spike"] and spike[0]["sigma"] > 6
    assert [a["alert"] for a in alerts.observe(row(21, 1.0))] == ["loss_below_floor"]
    assert alerts.observe(row(200, 1.0)) == []  # after the window the floor no longer applies


def test_throughput_drop_must_last_before_profiling(tmp_path):
    clock = {"t": 0.0}
    cfg = tiny_config(tmp_path, "--runtime.throughput_alert_s=300")
    alerts = Alerts(cfg, clock=lambda: clock["t"])
    for i in range(10):
        assert alerts.observe(row(i, rate=1000.0)) == []
    clock["t"] = 100.0
    assert alerts.observe(row(11, rate=700.0)) == []  # degraded, not for long yet
    clock["t"] = 250.0
    assert alerts.observe(row(12, rate=1000.0)) == []  # recovered: the clock restarts
    clock["t"] = 300.0
    assert alerts.observe(row(13, rate=700.0)) == []
    clock["t"] = 700.0
    fired = alerts.observe(row(14, rate=700.0))
    assert [a["alert"] for a in fired] == ["throughput_drop"] and alerts.profile_requested
    clock["t"] = 2000.0
    assert alerts.observe(row(15, rate=700.0)) == []  # profiles once


def test_profile_steps_writes_a_trace(tmp_path):
    out = tmp_path / "run"
    assert run_training(tiny_config(out, "--profile-steps=3:4")) == 0
    traces = list((out / "profile").glob("steps3-4*"))
    assert traces and traces[0].stat().st_size > 0
    beat = [b for b in read_jsonl(out / "heartbeat_rank0.jsonl") if b["kind"] == "profile"]
    assert beat and beat[0]["tag"] == "steps3-4"


def test_sdpa_audit_records_each_call_site_once(tmp_path):
    out = tmp_path / "run"
    try:
        assert run_training(tiny_config(out, "--runtime.sdpa_audit=true")) == 0
    finally:
        profiling.set_sdpa_audit(False)
    beats = [b for b in read_jsonl(out / "heartbeat_rank0.jsonl") if b["kind"] == "sdpa_audit"]
    assert len(beats) == 1
    site = beats[0]["sites"]["dense.causal_attention"]
    assert site["path"] == "sdpa_is_causal" and site["device"] == "cpu"


def test_nvtx_is_a_shared_noop_when_off():
    profiling.set_nvtx(False)
    assert profiling.nvtx_range("a") is profiling.nvtx_range("b")
    profiling.set_nvtx(True)
    try:
        with profiling.nvtx_range("forward"):
            pass
        assert profiling.nvtx_range("a") is not profiling.nvtx_range("b")
    finally:
        profiling.set_nvtx(False)


def test_nvtx_run_trains(tmp_path):
    try:
        assert run_training(tiny_config(tmp_path / "run", "--runtime.nvtx=true")) == 0
    finally:
        profiling.set_nvtx(False)


def test_environment_knobs_map_onto_config():
    overrides, notes = env_overrides({"NSA_DDP_COMPRESS": "BF16", "NSA_DDP_BUCKET_MB": "50", "NSA_NVTX": "1",
                                      "NSA_DDP_DISABLE_GC": "1", "NSA_PREFILL_BATCHED": "1"})
    assert overrides == ["--runtime.ddp_compress=bf16", "--runtime.ddp_bucket_mb=50", "--runtime.disable_gc=true",
                         "--runtime.nvtx=true"]
    assert len(notes) == 1 and "NSA_PREFILL_BATCHED" in notes[0] and "unnecessary" in notes[0]


def _showcase(*args, env=None, timeout=180):
    return subprocess.run([sys.executable, "-u", "scripts/train_showcase.py", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


TINY = ["--model.vocab_size=256", "--model.dim=32", "--model.n_layers=1", "--model.n_heads=2", "--model.n_kv_heads=1",
        "--model.ffn_dim=32", "--train.log_every=1", "--train.save_every=2"]


def test_seed_showcase_commands(tmp_path):
    """The M7C runbook: `CONFIG=... python -u scripts/train_showcase.py --dataset synthetic --steps N`, then
    `--resume artifacts/.../checkpoint_step{N}.pt` continues from that file."""
    out = tmp_path / "run"
    env = {"CONFIG": "configs/train_showcase.yaml", "NSA_SEL_RANGES_V2": "1"}
    first = _showcase("--dataset", "synthetic", "--steps", "4", "--seq-len", "32", "--batch-size", "2",
                      f"--train.out_dir={out}", *TINY, env=env)
    assert first.returncode == 0, first.stderr
    assert "NSA_SEL_RANGES_V2 is accepted but unnecessary" in first.stderr
    second = _showcase("--dataset", "synthetic", "--steps", "6", "--seq-len", "32", "--batch-size", "2",
                       "--resume", str(out / "checkpoint_step2.pt"), f"--train.out_dir={out}", *TINY, env=env)
    assert second.returncode == 0, second.stderr
    assert [int(r["step"]) for r in read_csv(out / "training.csv")] == [1, 2, 3, 4, 5, 6]
    assert (out / "training.csv.superseded").exists()  # steps 3-4 of the first run, kept
    starts = [b for b in read_jsonl(out / "heartbeat_rank0.jsonl") if b["kind"] == "start"]
    assert starts[-1]["resumed_from"].endswith("checkpoint_step2.pt")
    cfg = json.loads(json.dumps(__import__("yaml").safe_load((out / "config.yaml").read_text())))
    assert cfg["train"]["steps"] == 6 and cfg["train"]["seq_len"] == 32 and cfg["data"]["source"] == "synthetic"


def test_seed_showcase_under_torchrun(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "scripts/train_showcase.py", "--dataset", "synthetic", "--steps", "2", "--seq-len", "16",
           "--batch-size", "2", f"--train.out_dir={out}", "--runtime.device=cpu", *TINY]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": str(REPO), "CONFIG": "configs/train_showcase.yaml",
                               "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "heartbeat_rank1.jsonl").exists() and (out / "checkpoint_step2.pt").exists()


def test_sdpa_audit_covers_the_nsa_branches(tmp_path):
    out = tmp_path / "run"
    try:
        assert run_training(tiny_config(out, "--runtime.sdpa_audit=true", "--model.attention=nsa", "--nsa.l=8",
                                        "--nsa.d=4", "--nsa.l_sel=8", "--nsa.n_sel=3", "--nsa.w=8")) == 0
    finally:
        profiling.set_sdpa_audit(False)
    (beat,) = [b for b in read_jsonl(out / "heartbeat_rank0.jsonl") if b["kind"] == "sdpa_audit"]
    assert {"nsa.window", "nsa.compressed", "nsa.selected"} <= set(beat["sites"])
    assert "dense.causal_attention" not in beat["sites"]
