"""Spike skipping (train.spike_skip_*, train/trainer/spikes.py): the detector alone, then real runs on a bin: dataset
whose file holds a region of random tokens inside an easily learned cycle, so the steps that draw a window from it
are real loss / gradient-norm spikes; which steps those are follows from the data order (MemmapStream.window_starts)."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from train.core.config import load_config
from train.data.memmap import MemmapStream
from train.data.meta import FORMAT, FORMAT_VERSION
from train.trainer.runner import EXIT_ANOMALY, run_training
from train.trainer.spikes import SpikeDetector

from .helpers import REPO, TINY_MODEL, cli, read_csv, read_jsonl, spawn, wait_for

N_TOKENS, GARBAGE = 20000, (8000, 9000)  # train.bin tokens; the random region [start, end)
SEQ, BATCH, STEPS, WINDOW = 16, 4, 80, 8


# ---- the detector alone ------------------------------------------------------------------------------

def feed(det: SpikeDetector, losses, norms, found_inf=None) -> list[int]:
    found_inf = found_inf or [0.0] * len(losses)
    return [int(det.observe(torch.tensor(l), torch.tensor(n), torch.tensor(f)))
            for l, n, f in zip(losses, norms, found_inf)]


def noisy(n: int, base: float) -> list[float]:
    return [base + 0.01 * math.sin(1.7 * i) for i in range(n)]


def test_a_spike_is_flagged_exactly_where_it_is_and_never_before_the_window_fills():
    losses, norms = noisy(30, 3.0), noisy(30, 1.0)
    losses[3] = losses[20] = 9.0  # step 3: the window (8) is not full yet
    det = SpikeDetector(WINDOW, z_loss=6.0, z_norm=None, device=torch.device("cpu"))
    flags = feed(det, losses[:WINDOW], norms[:WINDOW])
    assert 9.0 in det.ring[0].tolist()  # step 3 was accepted: the window was not full
    flags += feed(det, losses[WINDOW:], norms[WINDOW:])
    assert [i for i, f in enumerate(flags) if f] == [20]
    assert int(det.count) == 29  # step 20 was not accepted: 30 steps, 1 skipped
    later = SpikeDetector(WINDOW, z_loss=6.0, z_norm=None, device=torch.device("cpu"))
    losses[3] = 3.0
    feed(later, losses[:21], norms[:21])
    assert 9.0 not in later.ring[0].tolist() and int(later.count) == 20  # a skipped value never enters the window


def test_only_upward_outliers_of_the_checked_quantities_count():
    losses, norms = noisy(20, 3.0), noisy(20, 1.0)
    losses[12], norms[15] = 0.1, 50.0  # a loss far below the mean; a norm spike
    cpu = torch.device("cpu")
    assert sum(feed(SpikeDetector(WINDOW, 6.0, None, cpu), losses, norms)) == 0  # norms not checked
    assert [i for i, f in enumerate(feed(SpikeDetector(WINDOW, None, 6.0, cpu), losses, norms)) if f] == [15]


def test_nonfinite_steps_are_not_spikes_and_stay_out_of_the_window():
    losses, norms = noisy(14, 3.0), noisy(14, 1.0)
    norms[10] = float("nan")
    det = SpikeDetector(WINDOW, 6.0, 6.0, torch.device("cpu"))
    assert sum(feed(det, losses, norms, [1.0 if i == 10 else 0.0 for i in range(14)])) == 0
    assert torch.isfinite(det.ring).all() and int(det.count) == 13


def test_the_streak_counts_spikes_in_a_row_and_its_peak_survives_a_recovery():
    losses = noisy(20, 3.0) + [9.0, 9.5, 9.7, 3.0, 9.0]
    det = SpikeDetector(WINDOW, 6.0, None, torch.device("cpu"))
    flags = feed(det, losses[:23], noisy(23, 1.0))
    assert flags[20:] == [1, 1, 1] and int(det.streak) == 3
    feed(det, losses[23:], noisy(2, 1.0))  # accepted (streak 0), then one more spike
    assert int(det.streak) == 1 and int(det.take_peak()) == 3 and int(det.take_peak()) == 0
    feed(det, [9.0], [1.0])  # the running streak goes on counting after a read
    assert int(det.take_peak()) == 2


def test_state_round_trips_and_a_new_window_keeps_the_newest_steps():
    cpu = torch.device("cpu")
    det = SpikeDetector(WINDOW, 6.0, None, cpu)
    feed(det, [float(i) for i in range(11)], [1.0] * 11)  # a rising loss: never an upward spike past 6 sigma
    state = det.state_dict()
    same = SpikeDetector(WINDOW, 1.0, 2.0, cpu)
    assert same.load_state_dict(state) is None
    assert torch.equal(same.ring, det.ring) and int(same.count) == int(det.count)
    small = SpikeDetector(4, 6.0, None, cpu)
    assert "newest 4 accepted steps" in small.load_state_dict(state)
    assert small.ring[0].tolist() == [7.0, 8.0, 9.0, 10.0] and int(small.count) == 4


def test_a_skipped_step_leaves_parameters_and_adam_state_untouched():
    """The fused AdamW's found_inf path (what a spike skip uses): no update, no weight decay, no step count."""
    from train.trainer.optim import step_unless_nonfinite

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1, fused=True)
    for flag in (0.0, 1.0):
        model(torch.randn(5, 4)).square().sum().backward()
        before = ([p.detach().clone() for p in model.parameters()],
                  {(i, k): v.clone() for i, p in enumerate(model.parameters())
                       for k, v in opt.state.get(p, {}).items()})
        step_unless_nonfinite(opt, torch.tensor(flag))
        opt.zero_grad()
        changed = any(not torch.equal(a, p) for a, p in zip(before[0], model.parameters()))
        assert changed == (flag == 0.0)
    after = {(i, k): v for i, p in enumerate(model.parameters()) for k, v in opt.state[p].items()}
    assert after.keys() == before[1].keys() and {float(after[i, "step"]) for i in (0, 1)} == {1.0}  # not counted
    assert all(torch.equal(before[1][key], v) for key, v in after.items())  # moments as they were


# ---- real runs: a data file with a region of random tokens ------------------------------------------

@pytest.fixture(scope="module")
def garbage_bin(tmp_path_factory) -> Path:
    """A bin: dataset: a 16-token cycle (learned within ~25 steps) with random tokens in GARBAGE."""
    path = tmp_path_factory.mktemp("spiky") / "data"
    path.mkdir()
    tokens = (10 + np.arange(N_TOKENS) % 16).astype(np.uint16)
    tokens[GARBAGE[0]:GARBAGE[1]] = np.random.default_rng(0).integers(0, 256, GARBAGE[1] - GARBAGE[0])
    tokens.tofile(path / "train.bin")
    tokens[:3000].tofile(path / "val.bin")
    splits = {"train": {"file": "train.bin", "tokens": N_TOKENS}, "val": {"file": "val.bin", "tokens": 3000}}
    (path / "meta.json").write_text(json.dumps({"format": FORMAT, "version": FORMAT_VERSION, "tokenizer": "byte",
                                                "eos_id": 256, "vocab_size": 257, "dtype": "uint16",
                                                "max_token_id": 255, "splits": splits}))
    return path


def spike_args(data: Path, out: Path, *extra: str) -> list[str]:
    return [*TINY_MODEL, f"--train.out_dir={out}", f"--train.steps={STEPS}", f"--train.seq_len={SEQ}",
            f"--train.batch_size={BATCH}", "--train.lr=1e-2", "--train.warmup_steps=2", "--train.log_every=1",
            f"--data.source=bin:{data}", "--data.tokenizer=byte", "--runtime.device=cpu", "--runtime.threads=1",
            "--train.spike_skip_z_loss=4", f"--train.spike_skip_window={WINDOW}", *extra]


def garbage_steps(data: Path) -> set[int]:
    """1-based steps (training.csv numbering) whose global batch reads a token of the random region."""
    stream = MemmapStream(data / "train.bin", dtype=np.uint16, n_tokens=N_TOKENS, seq_len=SEQ, batch_size=BATCH,
                          seed=load_config(None, []).train.seed)
    rows = np.arange(BATCH, dtype=np.uint64)
    hit = set()
    for s in range(STEPS):
        starts = stream.window_starts(s, rows)
        if ((starts + SEQ >= GARBAGE[0]) & (starts < GARBAGE[1])).any():
            hit.add(s + 1)
    return hit


def spiked_steps(out: Path) -> list[int]:
    rows = read_csv(out / "training.csv")  # log_every=1: one row per step
    counts = [0] + [int(r["spike_skipped_steps"]) for r in rows]
    return [int(r["step"]) for r, a, b in zip(rows, counts, counts[1:]) if b > a]


def trace(out: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r["grad_norm"], r["skipped_steps"], r["spike_skipped_steps"])
            for r in read_csv(out / "training.csv")]


@pytest.fixture(scope="module")
def whole(garbage_bin, tmp_path_factory) -> Path:
    """The uninterrupted reference run, a checkpoint after every step."""
    out = tmp_path_factory.mktemp("whole") / "run"
    assert run_training(load_config(None, spike_args(garbage_bin, out, "--train.save_every=1",
                                                     "--train.keep_all_checkpoints=true"))) == 0
    return out


def test_spikes_from_bad_data_are_skipped_counted_and_change_nothing(whole, garbage_bin):
    spiked, garbage = spiked_steps(whole), garbage_steps(garbage_bin)
    assert len(spiked) >= 2, spiked
    assert set(spiked) <= garbage and min(spiked) > WINDOW  # only where the random tokens are, never before the window
    metrics = json.loads((whole / "metrics.json").read_text())
    assert metrics["spike_skipped_steps"] == len(spiked) and metrics["skipped_steps"] == 0

    def state(step: int) -> tuple[dict, dict]:
        ck = torch.load(whole / f"checkpoint_step{step}.pt", weights_only=True)
        return ck["model"], ck["optimizer"]["state"]

    def same(a, b) -> bool:
        return a.keys() == b.keys() and all(
            torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else same(a[k], b[k]) for k in a)

    for step in spiked:  # the skipped step left weights and AdamW state (moments, step count) as they were
        (m0, o0), (m1, o1) = state(step - 1), state(step)
        assert same(m0, m1) and same(o0, o1), step
    accepted = next(s for s in range(WINDOW + 1, STEPS) if s not in spiked)
    assert not same(state(accepted - 1)[0], state(accepted)[0])  # an accepted step does change them
    ck = torch.load(whole / f"checkpoint_step{STEPS}.pt", weights_only=True)
    assert ck["spike_skipped_steps"] == len(spiked) and ck["spike_skip"]["ring"].shape == (2, WINDOW)


def test_spike_skipping_on_changes_nothing_while_no_step_is_a_spike(tmp_path):
    """A threshold no step reaches: the same losses, norms and weights as with spike skipping off."""
    from .helpers import tiny_config

    on, off = tmp_path / "on", tmp_path / "off"
    assert run_training(tiny_config(on, "--train.spike_skip_z_loss=1000", "--train.spike_skip_z_norm=1000",
                                    "--train.spike_skip_window=2")) == 0
    assert run_training(tiny_config(off)) == 0
    assert [r["loss"] for r in read_csv(on / "training.csv")] == [r["loss"] for r in read_csv(off / "training.csv")]
    wa = torch.load(on / "checkpoint_step8.pt", weights_only=True)
    wb = torch.load(off / "checkpoint_step8.pt", weights_only=True)
    assert all(torch.equal(wa["model"][k], wb["model"][k]) for k in wa["model"])
    assert wb["spike_skip"] is None and int(wa["spike_skip"]["count"]) == 8


def test_with_spike_skipping_off_the_loop_builds_and_calls_nothing_for_it(tmp_path, monkeypatch):
    from train.trainer import runner

    from .helpers import tiny_config

    def refuse(*_):
        raise AssertionError("the detector ran with spike skipping off")

    monkeypatch.setattr(SpikeDetector, "observe", refuse)
    monkeypatch.setattr(SpikeDetector, "__init__", refuse)
    loops = []
    build = runner.build_loop
    monkeypatch.setattr(runner, "build_loop", lambda run, clock: loops.append(build(run, clock)) or loops[-1])
    assert run_training(tiny_config(tmp_path / "off")) == 0
    assert loops[0].spikes is None and loops[0].i_spiked is None


def test_spikes_in_a_row_stop_the_run_with_a_checkpoint_and_one_line(garbage_bin, tmp_path, monkeypatch):
    """From step 40 every batch is random tokens: with limit 3 and log_every 2 the run stops at the first log
    interval that has seen 3 spike skips in a row, writes a checkpoint there and says why in one line, exit 3."""
    original = MemmapStream.rows_batch

    def random_from_step_40(self, step, rows):
        x, y = original(self, step, rows)
        if step >= 40:
            g = torch.Generator().manual_seed(step)
            x, y = torch.randint(0, 256, x.shape, generator=g), torch.randint(0, 256, y.shape, generator=g)
        return x, y

    monkeypatch.setattr(MemmapStream, "rows_batch", random_from_step_40)
    out = tmp_path / "run"
    cfg = load_config(None, spike_args(garbage_bin, out, "--train.spike_skip_limit=3", "--train.log_every=2"))
    assert run_training(cfg) == EXIT_ANOMALY
    rows = read_csv(out / "training.csv")
    stop = int(rows[-1]["step"])
    assert stop in (44, 46) and stop % 2 == 0  # the 3rd skip is step 43 or later; the check comes at the next interval
    assert int(rows[-1]["spike_skipped_steps"]) - int(rows[-3]["spike_skipped_steps"]) >= 3
    lines = (out / ".anomaly_type").read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith("loss_spike_skips: ") and "limit 3" in lines[0]
    ck = torch.load(out / f"checkpoint_step{stop}.pt", weights_only=True)
    assert ck["spike_skip"]["streak"] >= 3
    beats = read_jsonl(out / "heartbeat_rank0.jsonl")
    assert beats[-1]["kind"] == "anomaly" and beats[-1]["anomaly_type"] == "loss_spike_skips"
    assert json.loads((out / "metrics.json").read_text())["status"] == "anomaly"


def test_exact_resume_across_a_halt_with_spikes_on_either_side(whole, garbage_bin, tmp_path, monkeypatch):
    spiked = spiked_steps(whole)
    halt_at = 45
    assert any(s < halt_at for s in spiked) and any(s > halt_at for s in spiked), spiked
    out = tmp_path / "split"
    original = MemmapStream.next_batch
    calls = {"n": 0}

    def halt_during(self):  # the operator's `touch .HALT` lands while step 45 runs
        calls["n"] += 1
        if calls["n"] == halt_at:
            (out / ".HALT").touch()
        return original(self)

    monkeypatch.setattr(MemmapStream, "next_batch", halt_during)
    assert run_training(load_config(None, spike_args(garbage_bin, out))) == 0
    assert (out / f"checkpoint_step{halt_at}.pt").exists()
    monkeypatch.setattr(MemmapStream, "next_batch", original)
    (out / ".HALT").unlink()
    assert run_training(load_config(None, spike_args(garbage_bin, out))) == 0
    assert trace(out) == trace(whole)
    wa = torch.load(whole / f"checkpoint_step{STEPS}.pt", weights_only=True)
    wb = torch.load(out / f"checkpoint_step{STEPS}.pt", weights_only=True)
    assert all(torch.equal(wa["model"][k], wb["model"][k]) for k in wa["model"])
    assert torch.equal(wa["spike_skip"]["ring"], wb["spike_skip"]["ring"])


def test_exact_resume_after_kill9_with_spikes_on(whole, garbage_bin, tmp_path):
    out = tmp_path / "killed"
    args = spike_args(garbage_bin, out, "--train.save_every=15")
    proc = spawn(*args)
    try:
        wait_for(lambda: (out / "checkpoint_step30.pt").exists(), what="checkpoint_step30.pt")
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.communicate(timeout=60)
    assert proc.returncode == -9, "the run ended before the kill"
    resumed_at = max(int(p.name[len("checkpoint_step"):-3]) for p in out.glob("checkpoint_step*.pt"))
    # a spike within a window's length after the resume point: only the restored window can flag it
    assert any(resumed_at < s <= resumed_at + WINDOW for s in spiked_steps(whole)), (resumed_at, spiked_steps(whole))
    res = cli(*args)
    assert res.returncode == 0, res.stderr[-2000:]
    assert trace(out) == trace(whole)


@pytest.mark.parametrize("bad, needle", [
    (["--train.spike_skip_z_loss=-1"], "train.spike_skip_z_loss must be a positive number"),
    (["--train.spike_skip_z_norm=0"], "train.spike_skip_z_norm must be a positive number"),
    (["--train.spike_skip_z_loss=6", "--train.spike_skip_window=1"], "train.spike_skip_window must be >= 2"),
    (["--train.spike_skip_z_norm=6", "--train.spike_skip_limit=0"], "train.spike_skip_limit must be >= 1"),
    (["--train.spike_skip_window=50"], "train.spike_skip_window has no effect with spike skipping off"),
])
def test_bad_spike_settings_exit_2_with_one_line_and_write_nothing(tmp_path, bad, needle):
    from .helpers import TINY_CLI

    out = tmp_path / "run"
    proc = cli(*TINY_CLI, "--train.steps=2", f"--train.out_dir={out}", *bad)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], \
        proc.stderr
    assert not out.exists()


def test_two_ranks_decide_like_one_on_the_same_global_batch(whole, garbage_bin, tmp_path):
    """2 ranks x batch 2 read the rows of 1 rank x batch 4: the all-reduced loss gives both ranks the same
    decisions, and those of the one-rank run (the spikes come from rows one rank holds alone)."""
    out = tmp_path / "ddp"
    args = [a for a in spike_args(garbage_bin, out, "--train.batch_size=2") if a != f"--train.batch_size={BATCH}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "train", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert spiked_steps(out) == spiked_steps(whole)
    a = [float(r["loss"]) for r in read_csv(whole / "training.csv")]
    b = [float(r["loss"]) for r in read_csv(out / "training.csv")]
    # 1 x 4 and 2 x 2 rows sum the float32 loss and gradients in other orders (and other vector widths on another
    # CPU), a drift lr=1e-2 amplifies step by step, and training.csv keeps 6 significant digits: measured up to 8.6e-5
    # of the loss with AVX2 kernels (under 1e-5 with AVX-512), so 5e-4; the decisions above are the exact claim
    worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
    assert worst < 5e-4, (worst, list(zip(a, b)))


def test_the_fp16_scaler_sequence_skips_a_spike_without_touching_the_scale():
    """The loop's fp16 order with spike skipping on (Loop._step_unless_spike): unscale_, the norm, the optimizer with
    found_inf + spike, scaler.update(). On CPU with a CPU GradScaler (the loop uses CUDA's; the calls are the same):
    a spike skips the step and keeps the scale; an overflow skips it and halves the scale (the scaler's own check)."""
    from train.trainer.optim import step_unless_nonfinite

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)

    def step(spike: float, overflow: bool = False) -> tuple[bool, float]:
        loss = model(torch.randn(5, 4)).square().sum() * (float("inf") if overflow else 1.0)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
        found_inf = (~torch.isfinite(norm)).float()
        before = [p.detach().clone() for p in model.parameters()]
        step_unless_nonfinite(opt, found_inf + torch.tensor(spike) * (1 - found_inf))
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return any(not torch.equal(a, p) for a, p in zip(before, model.parameters())), scaler.get_scale()

    assert step(0.0) == (True, 1024.0)
    assert step(1.0) == (False, 1024.0)  # a spike: skipped, the scale kept
    assert step(0.0, overflow=True) == (False, 512.0)  # an overflow: skipped, the scale halved
    assert float(opt.state[model.weight]["step"]) == 1.0
