"""bench/gpu_acceptance.py's plumbing on CPU: the training configs it writes load, the dense twin is
the same model without NSA, and the summary shows each number beside its goal."""
from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

from train.core.config import load_config

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpu_acceptance", REPO / "bench" / "gpu_acceptance.py")
ga = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ga)


def test_m7c_configs_and_the_dense_twin(tmp_path):
    nsa = load_config(ga._train_config(tmp_path, "nsa", 8192, tiny=False))
    dense = load_config(ga._train_config(tmp_path, "dense", 8192, tiny=False))
    assert nsa.model.attention == "nsa" and dense.model.attention == "dense"
    same = {k: v for k, v in dataclasses.asdict(nsa.model).items() if k not in ("attention", "nsa")}
    assert same == {k: v for k, v in dataclasses.asdict(dense.model).items() if k not in ("attention", "nsa")}
    assert nsa.train.seq_len == 8192 and nsa.train.batch_size * 8192 == 16 * 2048  # M7C's tokens per step
    assert nsa.data.source == "synthetic" and nsa.train.save_every == 0


def test_summary_puts_goals_beside_numbers():
    report = {"date": "d", "device_name": "NVIDIA H100", "torch": "t", "items": {
        "attention": {"ok": True, "seconds": 3, "goal": "NSA >= 4x faster than SDPA at 64k: 5.1x at 65536 (met)",
                      "nsa_speedup_over_sdpa": {65536: 5.1}},
        "branches": {"ok": True, "seconds": 2, "goal": "branches: keep FlexAttention",
                     "sdpa_over_flex": {"window_sdpa_over_flex_65536": 2.5}},
        "m7c_training": {"ok": False, "seconds": 9, "goals": ["NSA / dense twin at 2048: 0.70 (goal >= 0.60)"],
                         "runs": {"nsa_2048_eager": {"toks_per_s": 160000.0}, "dense_2048_eager": {"exit": 124}}}}}
    text = ga.summary_markdown(report)
    assert "## attention: ok" in text and "(met)" in text and "65536: 5.1x" in text
    assert "## branches: ok" in text and "window @65536: 2.5x" in text
    assert "## m7c_training: FAILED" in text and "nsa_2048_eager: 160,000 tokens/s" in text
    assert "dense_2048_eager: failed (exit 124)" in text


def test_launch_item_reports_counts_beside_the_budget(tmp_path):
    """The launches item runs anywhere (meta device): every T's count is printed beside its goal."""
    import argparse

    item = ga.launches(argparse.Namespace(out=tmp_path))
    assert item["ok"], item
    assert [r["T"] for r in item["rows"]] == [2048, 8192, 32768, 65536]
    assert all(r["nsa"] <= ga.LAUNCH_BUDGET for r in item["rows"])
    text = ga.summary_markdown({"date": "d", "device_name": "cpu", "torch": "t", "items": {"launches": {**item, "seconds": 1}}})
    assert f"(goal <= {ga.LAUNCH_BUDGET} at every T)" in text and "65536: " in text and "(goal <= 1.25x)" in text
