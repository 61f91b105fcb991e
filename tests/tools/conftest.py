"""Fixtures of the production-path tool tests: one real tiny run on the prepared KJV bin."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.train.helpers import tiny_config


def bin_args(data_dir: Path) -> list[str]:
    return [f"--data.source=bin:{data_dir}", "--data.tokenizer=byte"]


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, kjv_bin) -> Path:
    """8 CPU steps on the KJV bin, evaluated and checkpointed at steps 4 and 8; returns the out_dir."""
    from train.trainer.runner import run_training

    out = tmp_path_factory.mktemp("tiny_run") / "out"
    cfg = tiny_config(out, "--train.eval_every=4", "--train.save_every=4", *bin_args(kjv_bin))
    assert run_training(cfg) == 0
    return out
