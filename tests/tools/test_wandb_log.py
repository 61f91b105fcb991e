"""WandbLogger against a fake `wandb` module that records calls."""
from __future__ import annotations

import math
import sys
import types

import pytest

from tests.train.helpers import tiny_config
from train.core.errors import ConfigError
from train.observe.wandb_log import RUN_ID_FILE, WandbLogger


class FakeRun:
    def __init__(self):
        self.logged, self.finished = [], 0

    def log(self, values, step=None):
        self.logged.append((step, values))

    def finish(self):
        self.finished += 1


def fake_wandb(fail: Exception | None = None):
    module = types.ModuleType("wandb")
    module.inits, module.runs = [], []

    def init(**kwargs):
        if fail is not None:
            raise fail
        module.inits.append(kwargs)
        module.runs.append(FakeRun())
        return module.runs[-1]

    module.init = init
    return module


@pytest.fixture
def cfg(tmp_path):
    return tiny_config(tmp_path / "out", "--runtime.wandb=true", "--runtime.wandb_project=proj",
                       "--runtime.wandb_run_name=name")


def test_init_log_finish(cfg, tmp_path, monkeypatch):
    wandb = fake_wandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    out = tmp_path / "out"
    logger = WandbLogger(cfg, out)
    (kwargs,) = wandb.inits
    assert kwargs["project"] == "proj" and kwargs["name"] == "name" and kwargs["dir"] == str(out)
    assert kwargs["config"] == cfg.to_dict() and kwargs["resume"] == "allow"
    logger.log(5, {"train/loss": 2.5, "train/mfu": None, "train/grad_norm": "nan"})
    logger.log(6, {"train/mfu": None})  # nothing left: no call
    (step, values), = wandb.runs[0].logged
    assert step == 5 and values["train/loss"] == 2.5 and "train/mfu" not in values
    assert math.isnan(values["train/grad_norm"])
    logger.finish()
    logger.finish()
    assert wandb.runs[0].finished == 1


def test_resumed_run_continues_the_same_wandb_run(cfg, tmp_path, monkeypatch):
    wandb = fake_wandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    first = WandbLogger(cfg, tmp_path / "out")
    second = WandbLogger(cfg, tmp_path / "out")
    assert first.run_id == second.run_id == (tmp_path / "out" / RUN_ID_FILE).read_text().strip()
    assert wandb.inits[0]["id"] == wandb.inits[1]["id"]
    other = WandbLogger(cfg, tmp_path / "other")
    assert other.run_id != first.run_id


def test_missing_package_is_a_config_error(cfg, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(ConfigError, match="pip install wandb") as err:
        WandbLogger(cfg, tmp_path / "out")
    assert "\n" not in str(err.value)


def test_failing_init_is_a_one_line_config_error(cfg, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(RuntimeError("api key not configured\nmore detail")))
    with pytest.raises(ConfigError, match="wandb.init failed \\(api key not configured\\)") as err:
        WandbLogger(cfg, tmp_path / "out")
    assert "\n" not in str(err.value)


def test_trainer_logs_to_wandb_on_rank0(tmp_path, monkeypatch):
    from train.trainer.runner import run_training

    wandb = fake_wandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    cfg = tiny_config(tmp_path / "run", "--runtime.wandb=true", "--train.eval_every=4")
    assert run_training(cfg) == 0
    (run,) = wandb.runs
    keys = {k for _, values in run.logged for k in values}
    assert {"train/loss", "train/toks_per_s", "val/loss", "val/ppl"} <= keys
    assert [step for step, values in run.logged if "val/loss" in values] == [4, 8]
    assert run.finished == 1
