"""docs/ARTIFACTS.md names everything train/core/artifacts.py defines (file names and patterns, CSV columns,
heartbeat kinds, NSA statistic keys, metrics.json fields, statuses, run-dir files), and the trainer
writes exactly the columns, kinds and statistics the module lists."""
from __future__ import annotations

import re
from pathlib import Path

import torch

from nsa.attention.gate_stats import gate_statistics, selection_statistics
from nsa.attention.selection_health import gate_means, outside_window_share
from nsa.gate_health import LAYER_STATS
from train.core import artifacts

DOC = (Path(__file__).resolve().parents[2] / "docs" / "ARTIFACTS.md").read_text()


def documented(name: str) -> bool:
    """`name` inside a backticked token of the page; {rank}/{step}/{stamp}/{pid}/{suffix} as the page writes them."""
    spelled = name.format(rank="{R}", step="{N}", stamp="YYYYMMDD_HHMMSS", pid="{pid}", suffix="")
    return any(re.search(r"`[^`\n]*" + re.escape(n) + r"[^`\n]*`", DOC) for n in {name, spelled})


def test_every_name_of_the_schema_is_documented():
    names = [v for k, v in vars(artifacts).items() if k.isupper() and isinstance(v, str)]
    groups = [names, artifacts.TRAIN_FIELDS, artifacts.VAL_FIELDS, artifacts.TASKS_FIELDS, artifacts.TASK_SCALARS,
              artifacts.HEARTBEAT_KINDS, artifacts.GATE_STATS,
              artifacts.SELECTION_STATS, artifacts.SELECTION_HEALTH, [artifacts.layer_key(n) for n in artifacts.SELECTION_HEALTH],
              artifacts.METRICS_FIELDS, artifacts.CRASH_FIELDS, artifacts.STATUSES,
              artifacts.RUN_DIR_FILES]
    missing = [name for group in groups for name in group if not documented(name)]
    assert not missing, f"docs/ARTIFACTS.md does not name {missing}"


def test_nsa_statistics_are_the_names_the_model_computes():
    gates = torch.rand(2, 5, 4, 3)  # [B, T, H, 3] sigmoid outputs
    picks = torch.tensor([12.0, 5.0, 30.0, 9.0])  # valid, free, distance, free distance
    assert sorted(gate_statistics(gates)) == sorted(artifacts.GATE_STATS)
    assert sorted(selection_statistics(picks)) == sorted(artifacts.SELECTION_STATS)
    health = ["sel_recall", *outside_window_share(torch.tensor([1.0, 4.0])), *gate_means(gates)]
    assert sorted(health) == sorted(artifacts.SELECTION_HEALTH) and LAYER_STATS == artifacts.SELECTION_HEALTH


def test_checkpoint_names_round_trip(tmp_path):
    for step in (0, 7, 12000):
        (tmp_path / artifacts.checkpoint_name(step)).write_bytes(b"")
    (tmp_path / "checkpoint_step3.pt.tmp1").write_bytes(b"")  # a partial write is not named like one
    assert [s for s, _ in artifacts.checkpoint_files(tmp_path)] == [0, 7, 12000]
