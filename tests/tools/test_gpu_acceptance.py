"""bench/gpu_acceptance.py's plumbing on CPU: the training configs it writes load, the dense twin is the same model
without NSA, the summary shows each number beside its goal, the first pass fits its budget, and the tiny first pass
runs every item (or says why not) into a JSON lines file whose lines stay whole when the run is killed."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

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

    item = ga.launches(argparse.Namespace(out=tmp_path, limit=ga.ITEM_LIMITS["launches"]))
    assert item["ok"], item
    assert [r["T"] for r in item["rows"]] == [2048, 8192, 32768, 65536]
    assert all(r["nsa"] <= ga.LAUNCH_BUDGET for r in item["rows"])
    text = ga.summary_markdown({"date": "d", "device_name": "cpu", "torch": "t", "items": {"launches": {**item, "seconds": 1}}})
    assert f"(goal <= {ga.LAUNCH_BUDGET} at every T)" in text and "65536: " in text and "(goal <= 1.25x)" in text


def test_the_first_pass_fits_its_budget_and_each_item_keeps_its_share():
    names = list(ga.FIRST_PASS)
    limits, left = {}, ga.FIRST_PASS_BUDGET_S
    for i, name in enumerate(names):  # every item using all of its time: the worst case
        limits[name] = ga.first_pass_limits(left, names[i:])
        left -= limits[name]
    assert sum(limits.values()) <= ga.FIRST_PASS_BUDGET_S <= 600 - 30  # a 10-minute window, start-up aside
    assert all(ga.FIRST_PASS[n][0] <= limits[n] <= ga.FIRST_PASS[n][1] for n in names), limits
    assert ga.first_pass_limits(5, names[1:]) == ga.FIRST_PASS[names[1]][0]  # overrun: the floor, never less


def first_pass(out: Path, *only: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "bench/gpu_acceptance.py", "--out", str(out), "--device", "cpu", "--tiny",
                             *(["--only", *only] if only else [])],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]  # every line whole, or this raises


@pytest.mark.fresh_python  # kills a process group with SIGKILL and reads what it left at once
def test_the_tiny_first_pass_runs_every_item_and_a_kill_leaves_whole_lines(tmp_path):
    proc = first_pass(tmp_path / "whole")
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-3000:]
    lines = read_lines(tmp_path / "whole" / "acceptance.jsonl")
    assert [line["item"] for line in lines] == ["start", *ga.FIRST_PASS]
    for line in lines[1:]:
        assert line["ok"] and (line.get("skipped") or line["seconds"] > 0 or line["item"] == "environment"), line
    by_item = {line["item"]: line for line in lines}
    assert by_item["cuda_tests"]["skipped"].startswith("needs CUDA")  # the CUDA tests, on CPU: skipped with the reason
    # the runbook first (issue 50 item 4): bootstrap over this Python offline, smoke, train, .HALT, a refused launch
    # over the stale .HALT, the resume from the stop's checkpoint, the monitor; each checked from run.info, metrics.json
    # and the monitor's frame inside the item, and timed
    book = by_item["runbook"]
    assert book["ok"] and book["checks"] == {"while_training": True, "first_launch": True, "config_by_memory": True,
                                             "stale_halt_refused": True, "resumed": True, "monitor": True}
    assert book["config"] == "configs/m7c_cpu.yaml" and book["resumed_to"] == book["halted_at"] + 2 >= 4
    assert list(book["phase_s"]) == ["bootstrap", "launch_to_training", "halt_to_exit", "refused", "resume", "monitor"]
    assert sum(book["phase_s"].values()) <= book["total_s"] + 0.5 and "(goal < 120 s: " in book["goal"]
    summary = (tmp_path / "whole" / "summary.md").read_text()
    assert all(f"## {name}: " in summary for name in ga.FIRST_PASS)
    assert json.loads((tmp_path / "whole" / "acceptance.json").read_text())["items"].keys() == set(ga.FIRST_PASS)

    seed = random.randrange(2**32)
    moment = random.Random(seed).uniform(1.0, 12.0)  # a random moment of the run (it takes ~20 s here)
    after_runbook = [name for name in ga.FIRST_PASS if name != "runbook"]  # (the runbook alone takes ~40 s)
    killed = first_pass(tmp_path / "killed", *after_runbook)
    started = time.monotonic()  # the moment counts from the run's first line: its start-up (imports) varies with
    while not (tmp_path / "killed" / "acceptance.jsonl").exists() and time.monotonic() - started < 120:  # the load
        time.sleep(0.05)
    time.sleep(moment)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.communicate(timeout=60)
    lines = read_lines(tmp_path / "killed" / "acceptance.jsonl")
    items = [line["item"] for line in lines]
    assert items == ["start", *after_runbook][:len(items)], (seed, moment, items)


def test_a_timed_out_launch_is_killed_with_every_process_below_it():
    """The runbook item's clean-up on a time-out: a shell whose children run on (as train_m7c_prime.sh's trainer
    would) is killed with them, none left behind."""
    proc = subprocess.Popen(["bash", "-c", "sleep 300 & (sleep 300 & wait) & wait"])
    deadline = time.time() + 30
    while len(below := _descendants(proc.pid)) < 3 and time.time() < deadline:  # a sleep, a subshell and its sleep
        time.sleep(0.05)
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    assert len(below) >= 3 and len(children) < len(below), below  # grandchildren too
    ga._kill_tree(proc.pid)
    assert proc.wait(timeout=10) == -signal.SIGKILL
    deadline = time.time() + 10
    while any(_alive(pid) for pid in below) and time.time() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in below if _alive(pid)]


def _descendants(pid: int) -> list[int]:
    out = []
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        out += [int(child), *_descendants(int(child))]
    return out


def _alive(pid: int) -> bool:
    """Running and not a zombie (a killed child of an exited parent is reaped by init)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
