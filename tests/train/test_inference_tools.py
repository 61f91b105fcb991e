"""Inference tools on trained checkpoints: needle-in-a-haystack, A/B profiler comparison."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from train.data.tokenizers import load_tokenizer
from train.trainer.runner import run_training

from .helpers import tiny_config

REPO = Path(__file__).resolve().parents[2]


def load_script(name: str):
    """scripts/NAME.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


needle = load_script("needle")


@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_needle_is_planted_at_its_depth(depth):
    tok = load_tokenizer("byte")
    ids, at = needle.build_prompt(tok, 600, depth, "4821937")
    assert len(ids) == 600
    text = tok.decode(ids)
    planted = text.index("The special magic number is 4821937.")
    assert abs(planted - at) <= 0  # byte tokenizer: token index == character index
    budget = 600 - len(needle.NEEDLE.format(number="4821937")) - len(needle.QUESTION)
    assert at == round(depth * budget)
    assert text.endswith(needle.QUESTION)


@pytest.mark.parametrize("attention", ["dense", "nsa"])
def test_needle_runs_on_a_checkpoint(tmp_path, attention):
    extra = ["--model.attention=nsa", "--nsa.l=8", "--nsa.d=4", "--nsa.l_sel=16", "--nsa.n_sel=3", "--nsa.w=32"] \
        if attention == "nsa" else []
    out = tmp_path / "run"
    assert run_training(tiny_config(out, "--data.tokenizer=byte", "--train.steps=2", *extra)) == 0
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "needle.py"), str(out / "latest.pt"), "--S", "300",
                           "--depths", "0,0.5,1", "--trials", "2", "--prefill_tile", "64", "--rope_scale", "2.0"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert [r["depth"] for r in result["results"]] == [0.0, 0.5, 1.0]
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["trials"] == 2 for r in result["results"])
    assert result["attention"] == attention and result["rope_scale"] == 2.0


def test_needle_runs_a_distance_capped_model(tmp_path):
    """nsa.sel_distance_cap decodes with its caches (refused before): the probe runs its trials on such a model."""
    out = tmp_path / "run"
    assert run_training(tiny_config(out, "--data.tokenizer=byte", "--train.steps=1", "--model.attention=nsa",
                                    "--nsa.l=8", "--nsa.d=4", "--nsa.l_sel=16", "--nsa.n_sel=3", "--nsa.w=32",
                                    "--nsa.sel_distance_cap=16")) == 0
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "needle.py"), str(out / "latest.pt"), "--S", "300",
                           "--depths", "0,1", "--trials", "1", "--prefill_tile", "64"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    assert [r["trials"] for r in json.loads(proc.stdout)["results"]] == [1, 1]


def test_needle_missing_checkpoint_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "needle.py"), str(tmp_path / "none.pt")],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "not found" in proc.stderr


def test_profiler_comparison_prints_both_variants():
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "profiler_comparison.py"), "--steps", "4",
                           "--warmup", "1", "--json",
                           "--common-args=--model.vocab_size=256 --model.dim=32 --model.n_layers=1 --train.seq_len=32 "
                           "--train.batch_size=2 --runtime.device=cpu", "--b-args=--runtime.gradient_checkpointing=1",
                           "--b", "configs/train_showcase.yaml", "--a", "configs/train_showcase.yaml"],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["A"]["toks_per_s"] > 0 and result["B"]["toks_per_s"] > 0
    assert result["B"]["args"][-1] == "--runtime.gradient_checkpointing=1"
    assert result["A_over_B"]["toks_per_s"] == pytest.approx(result["A"]["toks_per_s"] / result["B"]["toks_per_s"])


def test_profiler_comparison_rates_are_totals_over_time():
    """Unequal intervals: tokens/s is total tokens / total time, so for the same tokens per step the
    step-time ratio and the tokens/s ratio are exact reciprocals (per-interval averages are not)."""
    pc = load_script("profiler_comparison")

    rows = [  # step, tokens_seen, dt_step_s: 10 warm-up steps, then intervals of 10 and 1 steps
        {"step": "10", "tokens_seen": "1000", "dt_step_s": "9.0", "dt_fetch_s": "0"},
        {"step": "20", "tokens_seen": "2000", "dt_step_s": "1.0", "dt_fetch_s": "0.1"},
        {"step": "21", "tokens_seen": "2100", "dt_step_s": "4.0", "dt_fetch_s": "0.0"},
    ]
    got = pc.interval_totals(rows, warmup=10)
    assert got["steps"] == 11 and got["tokens"] == 1100 and got["seconds"] == pytest.approx(14.0)
    assert got["toks_per_s"] == pytest.approx(1100 / 14.0) and got["step_s"] == pytest.approx(14.0 / 11)
    assert got["fetch_s"] == pytest.approx(1.0 / 11)
    with pytest.raises(SystemExit):
        pc.interval_totals(rows, warmup=21)
