"""train.plan reproduces the B200 MFU guide's arithmetic from the config (and corrects its Phase 2/3 rows)."""
from __future__ import annotations

import json
import math

import pytest

from nsa.flops import flops_per_token
from tests.tools.test_presets import CONFIGS
from train.core.config import load_config
from train.core.errors import ConfigError
from train.plan import main
from train.planning.plan import make_plan

B200 = CONFIGS / "full_qwen3_1.8b_b200_optimal.yaml"


@pytest.fixture(scope="module")
def phase1():
    return load_config(B200)


def test_seed_002_tokens_per_iteration_and_iterations(phase1):
    plan = make_plan(phase1, tokens=82e9, gpus=8)
    assert plan["tokens_per_iter"] == 64 * 4 * 8 * 2048 == 4_194_304
    assert plan["iterations_exact"] == pytest.approx(19_550.32, abs=0.01)
    assert plan["iterations"] == 19_551  # ceil: enough iterations to reach 82e9 tokens
    assert plan["iterations_rounded"] == 19_550  # the guide's "≈ 19,550" (nearest)
    assert plan["tokens_trained"] >= 82e9 > plan["iterations_rounded"] * plan["tokens_per_iter"]
    # the guide's other rows use the same rounding: 6e9 -> 1,431 (1,430.5), 1e9 -> 238 (238.4)
    assert make_plan(phase1, tokens=6e9, gpus=8)["iterations_rounded"] == 1_431
    assert make_plan(phase1, tokens=1e9, gpus=8)["iterations_rounded"] == 238


def test_phase_2_and_3_tokens_per_iteration(phase1):
    """The B200 MFU guide's table says 3.9M / 5.2M; batch x accum x 8 x 2048 gives 3.1M / 4.2M."""
    phase2 = load_config(B200, ["--batch_size=96", "--gradient_accumulation_steps=2"])
    phase3 = load_config(B200, ["--batch_size=128", "--gradient_accumulation_steps=2", "--use_cuda_graphs=true"])
    assert make_plan(phase2, tokens=82e9, gpus=8)["tokens_per_iter"] == 3_145_728
    assert make_plan(phase2, tokens=82e9, gpus=8)["iterations"] == 26_068
    assert make_plan(phase3, tokens=82e9, gpus=8)["tokens_per_iter"] == 4_194_304


def test_flops_and_wall_time_from_mfu(phase1):
    plan = make_plan(phase1, tokens=82e9, gpus=8, mfu=0.4, peak_device="NVIDIA B200")
    report = flops_per_token(phase1.model, 2048, "v3")
    assert plan["calculation_method"] == "component_summation_v2025"
    assert plan["flops_per_token"] == report.flops_per_token
    toks = 0.4 * 2250e12 * 8 / report.flops_per_token
    assert plan["toks_per_s"] == pytest.approx(toks)
    assert plan["wall_hours"] == pytest.approx(19_551 * 4_194_304 / toks / 3600)


def test_wall_time_from_measured_throughput(phase1):
    plan = make_plan(phase1, tokens=82e9, gpus=8, toks_per_s=456_000, peak_device="NVIDIA B200", hours=50)
    assert plan["wall_hours"] == pytest.approx(19_551 * 4_194_304 / 456_000 / 3600)
    assert plan["mfu"] == pytest.approx(456_000 * plan["flops_per_token"] / (2250e12 * 8))
    assert plan["iterations_in_hours"] == math.floor(50 * 3600 * 456_000 / 4_194_304)
    assert "wall_hours" not in make_plan(phase1, tokens=82e9, gpus=8)


def test_presets_steps_follow_the_arithmetic():
    fifty = load_config(CONFIGS / "full_qwen3_1.8b_b200_50h.yaml")
    assert fifty.train.steps == make_plan(fifty, tokens=82e9, gpus=8)["iterations"]
    optimal = load_config(B200)
    assert optimal.train.steps == make_plan(optimal, tokens=6e9, gpus=8)["iterations"]


def test_errors(phase1):
    with pytest.raises(ConfigError, match="needs --peak-device"):
        make_plan(phase1, tokens=1e9, mfu=0.4)
    with pytest.raises(ConfigError, match="no dense peak known"):
        make_plan(phase1, tokens=1e9, mfu=0.4, peak_device="Voodoo 3")
    with pytest.raises(ConfigError, match="not both"):
        make_plan(phase1, tokens=1e9, mfu=0.4, toks_per_s=1.0, peak_device="NVIDIA B200")
    with pytest.raises(ConfigError, match="--hours needs a throughput"):
        make_plan(phase1, tokens=1e9, hours=5)


def test_cli(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert main([str(B200), "--tokens", "82e9", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["gpus"] == 8 and plan["iterations"] == 19_551
    assert main([str(B200), "--tokens", "82e9", "--gpus", "8", "--max_iters", "10", "--toks-per-s", "300000"]) == 0
    text = capsys.readouterr().out
    assert "4,194,304" in text and "≈ 19,550" in text and "19,551" in text and "wall time" in text
    assert main([str(B200), "--tokens", "1e9", "--mfu", "0.4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
