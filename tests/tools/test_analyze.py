"""train.analyze on a real tiny run, and its arithmetic on a run JSON with known numbers."""
from __future__ import annotations

import json
import math

import pytest

from train.analysis.analyze import analyze, find_run_json, summarize
from train.analyze import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _rows(n: int, every: int = 10) -> list[dict]:
    """Log intervals at steps 10..n*10 with toks/s = 1000*step, MFU = step/1000, 2 s per step."""
    return [{"iter": s, "loss": 10.0 - s / 100, "toks_per_s": 1000.0 * s, "mfu": s / 1000, "dt_step_s": 2.0,
             "mem_alloc_mib": 1024.0 * s, "mem_reserved_mib": 2048.0 * s, "tflops": float(s)}
            for s in range(every, n * every + 1, every)]


def _run_json(rows, evals=()) -> dict:
    return {"config": {"train": {"batch_size": 4, "accumulate_grad_batches": 2, "seq_len": 128}},
            "hardware": {"device_name": "NVIDIA B200", "world_size": 8},
            "calculation_method": "component_summation_v2025", "flops_per_token": 1e9,
            "training_iterations": rows, "eval_steps": list(evals)}


def test_real_run_summary_and_plots(tiny_run):
    summary, path, files = analyze(tiny_run, target_tokens=1e6)
    assert path == find_run_json(tiny_run) and path.name.startswith("run_")
    assert summary["steps"] == 8 and summary["intervals"] == 4 and summary["intervals_averaged"] == 3
    assert summary["note"]  # shorter than the 50-step warm-up: only the first interval is dropped
    assert summary["avg_toks_per_s"] > 0 and summary["avg_s_per_iter"] > 0
    assert summary["avg_mfu"] is None  # CPU: no peak, no MFU
    assert math.isfinite(summary["best_val_loss"])
    assert summary["tokens_per_iter"] == 4 * 32
    assert summary["target_iterations"] == math.ceil(1e6 / 128)
    names = sorted(f.name for f in files)
    assert names == ["loss.png", "throughput.png"]  # no mfu.png without MFU
    for f in files:
        assert f.parent == tiny_run / "analysis" and f.read_bytes()[:8] == PNG_MAGIC
    saved = json.loads((tiny_run / "analysis" / "summary.json").read_text())
    assert saved["run_json"] == path.name and saved["steps"] == 8


def test_averages_after_warmup_peaks_and_extrapolation(tmp_path):
    rows = _rows(10)  # steps 10..100
    run = _run_json(rows, evals=[{"iter": 50, "val_loss": 4.0}, {"iter": 100, "val_loss": 3.5}])
    s = summarize(run, skip_steps=50, target_tokens=82e9)
    kept = [r for r in rows if r["iter"] > 50]  # 60..100
    assert s["intervals_averaged"] == 5 and s["note"] is None
    assert s["avg_mfu"] == pytest.approx(sum(r["mfu"] for r in kept) / 5)
    assert s["peak_mfu"] == pytest.approx(0.1)
    assert s["avg_toks_per_s"] == pytest.approx(80_000.0)
    assert s["avg_toks_per_s_per_gpu"] == pytest.approx(10_000.0)
    assert s["peak_mem_alloc_gib"] == pytest.approx(100.0) and s["peak_mem_reserved_gib"] == pytest.approx(200.0)
    assert s["best_val_loss"] == 3.5 and s["avg_s_per_iter"] == 2.0
    tpi = 4 * 2 * 8 * 128
    assert s["tokens_per_iter"] == tpi
    assert s["target_iterations"] == math.ceil(82e9 / tpi)
    assert s["target_hours"] == pytest.approx(s["target_iterations"] * tpi / 80_000 / 3600)


def test_mfu_plot_and_json_path(tmp_path, capsys):
    path = tmp_path / "run_20250101_000000.json"
    path.write_text(json.dumps(_run_json(_rows(10))))
    assert main([str(path), "--target-tokens", "1e9"]) == 0
    out = capsys.readouterr().out
    assert "MFU               avg 8.0% | peak 10.0%" in out and "component_summation_v2025" in out
    assert (tmp_path / "analysis" / "mfu.png").read_bytes()[:8] == PNG_MAGIC


def test_errors(tmp_path, capsys):
    assert main([str(tmp_path / "missing")]) == 2
    assert main([str(tmp_path)]) == 2  # a directory without run_*.json
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") for line in err)
    bad = tmp_path / "run_x.json"
    bad.write_text("{}")
    assert main([str(bad)]) == 2
