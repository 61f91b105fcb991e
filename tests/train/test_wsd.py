"""Warmup-stable-decay (train.lr_schedule=wsd): the schedule's values, its config refusals, exact resume under a
real .HALT and a real kill -9, a longer flat phase on resume, the refusal to undo a decay, and the cooldown
branch from a flat-phase checkpoint into its own out_dir (docs/USE.md "Learning-rate schedules and cooldowns")."""
from __future__ import annotations

import hashlib
import math
import shutil
from pathlib import Path

import pytest
import torch

from train.core.config import TrainConfig, dump_config, load_config
from train.core.errors import ConfigError
from train.trainer.lr_schedule import lr_at
from train.trainer.runner import run_training

from .helpers import (TINY_CLI, halt_while_step_runs, kill9_after, read_csv, run_reference_and_resume,
                      tiny_config)

ROW_KEYS = ("step", "loss", "grad_norm", "lr")


def rows(out: Path, after: int = 0) -> list[tuple]:
    return [tuple(r[k] for k in ROW_KEYS) for r in read_csv(out / "training.csv") if int(r["step"]) > after]


def tree_hashes(out: Path, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """relative path -> sha256 of every file under out (a symlink: its target), the names in skip left out."""
    found = {}
    for path in sorted(out.rglob("*")):
        if path.name in skip:
            continue
        if path.is_symlink():
            found[str(path.relative_to(out))] = "-> " + str(path.readlink())
        elif path.is_file():
            found[str(path.relative_to(out))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def same_weights_and_moments(a: Path, b: Path) -> bool:
    ca, cb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    same_model = ca["model"].keys() == cb["model"].keys() and all(torch.equal(ca["model"][k], cb["model"][k])
                                                                  for k in ca["model"])
    sa, sb = ca["optimizer"]["state"], cb["optimizer"]["state"]
    same_moments = sa.keys() == sb.keys() and all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])
    return same_model and same_moments


# ---- the schedule ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_the_schedules_before_wsd_keep_their_formulas(schedule):
    """Every step of cosine / linear / constant equals the formula they had before wsd (written out here)."""
    cfg = TrainConfig(steps=37, warmup_steps=5, lr=2e-3, min_lr_ratio=0.07, lr_schedule=schedule)
    floor = cfg.lr * cfg.min_lr_ratio
    for step in range(45):
        if step < 5:
            want = cfg.lr * (step + 1) / 5
        elif schedule == "constant":
            want = cfg.lr
        else:
            progress = min(1.0, (step - 5) / 32)
            want = (cfg.lr - (cfg.lr - floor) * progress if schedule == "linear"
                    else floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress)))
        assert lr_at(step, cfg) == want, step


SHAPES = {"linear": lambda p: 1 - p, "1-sqrt": lambda p: 1 - math.sqrt(p), "cosine": lambda p: 0.5 * (1 + math.cos(math.pi * p))}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_wsd_warms_up_holds_then_decays_to_the_floor_at_the_last_step(shape):
    cfg = TrainConfig(steps=50, warmup_steps=4, lr=1.0, min_lr_ratio=0.1, lr_schedule="wsd", decay_steps=10,
                      decay_shape=shape)
    lrs = [lr_at(step, cfg) for step in range(50)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4:40] == [1.0] * 36  # flat until the decay's window, the last 10 steps
    assert lrs[40] < 1.0 and lrs[49] == pytest.approx(0.1, abs=1e-12)
    assert all(a > b for a, b in zip(lrs[39:], lrs[40:])), "the decay falls at every step"
    for k in range(10):  # step 40 + k has taken k + 1 of the 10 decay steps
        assert lrs[40 + k] == pytest.approx(0.1 + 0.9 * SHAPES[shape]((k + 1) / 10), rel=1e-12)
    assert lr_at(80, cfg) == pytest.approx(0.1)  # past the horizon: the floor


def test_1_sqrt_drops_faster_than_linear_early_and_cosine_slowest():
    lr = {shape: lr_at(42, TrainConfig(steps=50, warmup_steps=4, lr=1.0, min_lr_ratio=0.0, lr_schedule="wsd",
                                       decay_steps=10, decay_shape=shape)) for shape in SHAPES}
    assert lr["1-sqrt"] < lr["linear"] < lr["cosine"]


def test_decay_fraction_is_a_share_of_train_steps_and_decay_steps_a_fixed_length():
    frac = TrainConfig(steps=1000, warmup_steps=10, lr_schedule="wsd", decay_fraction=0.2)
    fixed = TrainConfig(steps=1000, warmup_steps=10, lr_schedule="wsd", decay_steps=200)
    assert frac.wsd_decay() == fixed.wsd_decay() == (800, 200)
    frac.steps = fixed.steps = 1500
    assert frac.wsd_decay() == (1200, 300) and fixed.wsd_decay() == (1300, 200)
    short = TrainConfig(steps=1000, warmup_steps=10, lr_schedule="wsd", decay_steps=200)
    assert [lr_at(s, fixed) for s in range(1300)] == [lr_at(s, short) for s in range(800)] + [short.lr] * 500


# ---- config ---------------------------------------------------------------------------------------------

BAD = [
    (["--train.decay_steps=40"], "train.decay_steps has no effect with train.lr_schedule='cosine'"),
    (["--train.decay_shape=linear"], "train.decay_shape has no effect with train.lr_schedule='cosine'"),
    (["--train.lr_schedule=wsd"], "needs exactly one of train.decay_fraction"),
    (["--train.lr_schedule=wsd", "--train.decay_steps=7", "--train.decay_fraction=0.1"], "needs exactly one"),
    (["--train.lr_schedule=wsd", "--train.decay_steps=7"], "warmup (2) + decay (7) steps exceed train.steps=8"),
    (["--train.lr_schedule=wsd", "--train.decay_steps=0"], "train.decay_steps must be positive, got 0"),
    (["--train.lr_schedule=wsd", "--train.decay_fraction=-0.2"], "train.decay_fraction must be in (0, 1], got -0.2"),
    (["--train.lr_schedule=wsd", "--train.decay_fraction=1.5"], "train.decay_fraction must be in (0, 1], got 1.5"),
    (["--train.lr_schedule=wsd", "--train.decay_steps=2", "--train.decay_shape=exp"],
     "train.decay_shape='exp'; valid: linear, 1-sqrt, cosine"),
    (["--train.lr_schedule=wsdd"], "train.lr_schedule='wsdd'; valid: cosine, linear, constant, wsd"),
]


@pytest.mark.parametrize("args, message", BAD)
def test_bad_wsd_settings_are_one_line_exit_2_and_write_nothing(tmp_path, capsys, args, message):
    from train.__main__ import main

    out = tmp_path / "run"
    base = [a for a in TINY_CLI if not a.startswith("--train.log_every")]
    assert main([*base, f"--train.out_dir={out}", "--train.steps=8", "--train.warmup_steps=2", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_a_decay_length_on_the_command_line_replaces_the_files_other_one(tmp_path):
    path = tmp_path / "wsd.yaml"
    path.write_text("train:\n  steps: 100\n  warmup_steps: 5\n  lr_schedule: wsd\n  decay_fraction: 0.2\n")
    assert load_config(path).train.wsd_decay() == (80, 20)
    cfg = load_config(path, ["--train.decay_steps=30"])
    assert (cfg.train.decay_fraction, cfg.train.decay_steps, cfg.train.wsd_decay()) == (None, 30, (70, 30))
    with pytest.raises(ConfigError, match="needs exactly one"):  # both on the command line: no silent choice
        load_config(path, ["--train.decay_steps=30", "--train.decay_fraction=0.1"])


def test_effective_config_round_trips_with_and_without_wsd(tmp_path):
    for extra in ([], ["--train.lr_schedule=wsd", "--train.decay_fraction=0.25", "--train.decay_shape=cosine"]):
        cfg = tiny_config(tmp_path / "x", *extra)
        path = tmp_path / "effective.yaml"
        path.write_text(dump_config(cfg))
        again = load_config(path)
        assert again.to_dict() == cfg.to_dict()
        assert ("decay_shape" in path.read_text()) == bool(extra)


# ---- exact resume -----------------------------------------------------------------------------------------

WSD = ("--train.lr_schedule=wsd", "--train.log_every=1", "--model.dropout=0.1")


def test_halt_in_the_flat_phase_then_more_steps_is_exactly_a_longer_run(tmp_path, monkeypatch):
    """A real .HALT stops a 10-step run (decay_steps=3) in its flat phase; resumed with train.steps=14 it trains
    bit for bit like an uninterrupted 14-step run: the flat phase grew by 4 steps, the decay moved with it."""
    from train.data.synthetic import SyntheticStream

    full, split = tmp_path / "full", tmp_path / "split"
    assert run_training(tiny_config(full, *WSD, "--train.steps=14", "--train.decay_steps=3")) == 0
    original = halt_while_step_runs(monkeypatch, split, 4)
    assert run_training(tiny_config(split, *WSD, "--train.steps=10", "--train.decay_steps=3")) == 0
    monkeypatch.setattr(SyntheticStream, "next_batch", original)
    assert [int(r["step"]) for r in read_csv(split / "training.csv")] == [1, 2, 3, 4]
    (split / ".HALT").unlink()
    assert run_training(tiny_config(split, *WSD, "--train.steps=14", "--train.decay_steps=3")) == 0
    assert rows(split) == rows(full)
    lrs = [float(r[3]) for r in rows(full)]
    assert lrs[2:11] == [3e-3] * 9 and lrs[10] > lrs[11] > lrs[12] > lrs[13] == pytest.approx(3e-4)
    assert same_weights_and_moments(full / "checkpoint_step14.pt", split / "checkpoint_step14.pt")


def test_kill9_inside_the_decay_resumes_exactly(tmp_path):
    """kill -9 during the decay (train.decay_fraction=0.5 of 200 steps), resume=auto with the same command:
    every step once, with the uninterrupted run's loss, gradient norm and lr."""
    args = [*TINY_CLI, "--train.steps=200", "--train.warmup_steps=5", "--train.lr_schedule=wsd",
            "--train.decay_fraction=0.5", "--train.decay_shape=cosine", "--train.save_every=10", "--train.eval_every=0"]
    reference, out = tmp_path / "reference", tmp_path / "killed"
    assert 120 <= kill9_after(args, out, "checkpoint_step120.pt") < 200  # inside the decay
    run_reference_and_resume(args, reference, out)
    assert rows(out) == rows(reference)
    assert same_weights_and_moments(reference / "checkpoint_step200.pt", out / "checkpoint_step200.pt")


def test_a_decay_that_has_begun_cannot_be_undone_and_the_refusal_changes_nothing(tmp_path):
    from train.trainer.start_checks import start_checks

    out = tmp_path / "run"
    assert run_training(tiny_config(out, *WSD, "--train.steps=8", "--train.decay_steps=3",
                                    "--train.save_every=2", "--train.keep_all_checkpoints=true")) == 0
    before = tree_hashes(out, skip=(".lock",))  # .lock records each start's holder
    longer = tiny_config(out, *WSD, "--train.steps=12", "--train.decay_steps=3")
    with pytest.raises(ConfigError, match=r"\(step 8\) is inside its wsd decay \(steps 6\.\.8, 1-sqrt\); "
                                          r"a decay cannot be undone"):
        start_checks(longer, world_size=1)  # python -m train.start_checks: the launch's words, reading only
    with pytest.raises(ConfigError, match="a decay cannot be undone"):
        run_training(longer)
    assert tree_hashes(out, skip=(".lock",)) == before
    # a new decay may not begin before the checkpoint either: step 4 was flat, a 6-step decay would have begun at 2
    with pytest.raises(ConfigError, match=r"would decay steps 3\.\.8, but checkpoint .* is at step 4 already"):
        run_training(tiny_config(out, *WSD, "--train.steps=8", "--train.decay_steps=6",
                                 f"--train.resume={out / 'checkpoint_step4.pt'}"))
    assert tree_hashes(out, skip=(".lock",)) == before


def test_cooldown_branch_from_a_flat_checkpoint_leaves_the_original_untouched_and_equals_its_resume(tmp_path):
    """train.resume=PATH into a new out_dir with a new decay: the original out_dir keeps every byte, and the
    branch trains bit for bit as the original resumed in place with the same decay, and as a run that had
    planned this decay from the start (its first 8 steps were flat too): weights, Adam moments, data position
    and RNG all come from the checkpoint."""
    original, branch, in_place = tmp_path / "original", tmp_path / "branch", tmp_path / "in_place"
    planned = tmp_path / "planned"
    assert run_training(tiny_config(original, *WSD, "--train.steps=40", "--train.decay_steps=8",
                                    "--train.save_every=4", "--train.stop_after=8")) == 0
    shutil.copytree(original, in_place, symlinks=True)
    before = tree_hashes(original)
    cooldown = ("--train.steps=11", "--train.decay_steps=3", "--train.decay_shape=linear")
    assert run_training(tiny_config(branch, *WSD, *cooldown,
                                    f"--train.resume={original / 'checkpoint_step8.pt'}")) == 0
    assert tree_hashes(original) == before
    assert run_training(tiny_config(in_place, *WSD, *cooldown)) == 0  # resume=auto: its checkpoint_step8
    assert [r[0] for r in rows(branch)] == ["9", "10", "11"]
    assert rows(branch) == rows(in_place, after=8)
    assert same_weights_and_moments(branch / "checkpoint_step11.pt", in_place / "checkpoint_step11.pt")
    assert run_training(tiny_config(planned, *WSD, *cooldown)) == 0
    assert rows(original) == rows(planned)[:8] and rows(branch) == rows(planned, after=8)
    assert same_weights_and_moments(branch / "checkpoint_step11.pt", planned / "checkpoint_step11.pt")
    lrs = [float(r[3]) for r in rows(branch)]
    assert lrs == pytest.approx([3e-3 * (0.1 + 0.9 * 2 / 3), 3e-3 * (0.1 + 0.9 / 3), 3e-4], rel=1e-5)
