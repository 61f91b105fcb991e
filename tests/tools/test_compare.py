"""python -m train.compare end to end on a tiny config: both arms train for real, train.evaluate scores the
whole validation split, and every number of the report is checked against the two out_dirs."""
from __future__ import annotations

import json
import subprocess
import sys
import tarfile

import pytest
import yaml

from tests.conftest import REPO
from train.core.artifacts import read_csv, read_heartbeat

TINY = ["--model.dim=32", "--model.n_layers=1", "--model.n_heads=2", "--model.n_kv_heads=1", "--model.head_dim=16",
        "--model.ffn_dim=64", "--train.steps=4", "--train.seq_len=64", "--train.batch_size=2", "--train.log_every=1",
        "--train.eval_every=2", "--train.eval_steps=2", "--train.save_every=2", "--train.warmup_steps=1",
        "--runtime.threads=1"]


def compare(*args: str, check: bool = True, config: str = "configs/nsa_twin_kjv.yaml") -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-m", "train.compare", config, *args], cwd=REPO,
                         capture_output=True, text=True, timeout=240)
    if check:
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    return res


def compare_in_process(*args: str, config: str = "configs/nsa_twin_kjv.yaml") -> tuple[int, str]:
    """(exit code, stderr) of train.compare's main for refusals, which stop before any arm starts."""
    import contextlib
    import io
    import os

    from train.compare import main

    err, cwd = io.StringIO(), os.getcwd()
    try:
        os.chdir(REPO)
        with contextlib.redirect_stderr(err):
            code = main([config, *args])
    finally:
        os.chdir(cwd)
    return code, err.getvalue()


@pytest.fixture(scope="module")
def compared(tmp_path_factory, kjv_bin):
    out = tmp_path_factory.mktemp("compare") / "twin"
    data = f"--data.source=bin:{kjv_bin}"
    res = compare("--out", str(out), data, *TINY, "--eval_max_tokens", "3000")
    return out, data, res


def test_report_numbers_come_from_the_two_out_dirs(compared):
    out, _, res = compared
    report = json.loads((out / "report.json").read_text())
    for arm in ("nsa", "dense"):
        out_dir = out / arm
        cfg = yaml.safe_load((out_dir / "config.yaml").read_text())
        assert cfg["model"]["attention"] == arm and (("nsa" in cfg) == (arm == "nsa"))
        metrics = json.loads((out_dir / "metrics.json").read_text())
        summary = report["arms"][arm]
        assert (summary["params"], summary["step"], summary["tokens_seen"]) == \
            (metrics["params"], metrics["step"], metrics["tokens_seen"]) and metrics["status"] == "finished"
        val = [[int(r["step"]), float(r["val_loss"])] for r in read_csv(out_dir / "val.csv")]
        assert summary["val_loss"] == val and [s for s, _ in val] == [2, 4]
        assert [s for s, _ in summary["train_loss"]] == [1, 2, 3, 4]
        (scored,) = out_dir.glob("eval_*_val_step4.json")
        score = json.loads(scored.read_text())
        assert summary["eval"]["loss"] == score["loss"] and score["tokens"] == 2999 and score["split"] == "val"
    n, d = (report["arms"][a]["eval"]["loss"] for a in ("nsa", "dense"))
    assert report["arms"]["nsa"]["params"] > report["arms"]["dense"]["params"]
    assert report["gap_pct"] == pytest.approx(100 * (n - d) / d)
    gates = [r for r in read_heartbeat(out / "nsa" / "heartbeat_rank0.jsonl") if r.get("kind") == "train"]
    assert [r["step"] for r in report["nsa"]["over_time"]] == [r["step"] for r in gates]
    assert report["nsa"]["over_time"][-1]["gate_share_win"] == gates[-1]["gate_share_win"]
    for key in ("sel_recall", "sel_outside_window", "gate_mean_sel", "sel_recall_layers", "gate_mean_win_layers"):
        assert report["nsa"]["over_time"][-1][key] == gates[-1][key], key  # selection health, per logged step
    md = (out / "report.md").read_text()
    assert "sel_recall" in md and "sel_recall by layer at step 4: " in md
    assert report["verdict"] in md and f"{report['gap_pct']:+.2f}%" in md and (out / "report.png").stat().st_size > 0
    assert f"compare: {report['verdict']}" in res.stdout
    assert "first 3,000 validation tokens" in report["verdict"]


def test_the_same_command_resumes_and_reuses_and_another_config_is_refused(compared):
    out, data, _ = compared
    before = json.loads((out / "report.json").read_text())
    nsa_yaml = out / "nsa.yaml"  # as written before nsa.gate_init existed: a key at its default is no change
    nsa_yaml.write_text("".join(line for line in nsa_yaml.read_text().splitlines(True) if "gate_init" not in line))
    again = compare("--out", str(out), data, *TINY, "--eval_max_tokens", "3000")
    assert again.stdout.count("compare: reusing") == 2 and "done: step 4 (finished)" in again.stdout
    assert json.loads((out / "report.json").read_text())["gap_pct"] == before["gap_pct"]
    code, err = compare_in_process("--out", str(out), data, *TINY, "--nsa.w=64")
    assert code == 2 and err.strip().splitlines() == [
        f"error: {out} compares another config (nsa.w: 128 there, 64 now); use another --out"]


def test_dense_from_reuses_the_twin_and_handoff_carries_the_report(compared, tmp_path):
    out, data, _ = compared
    ablation = tmp_path / "gate_equal"
    compare("--out", str(ablation), data, *TINY, "--nsa.gate_init=equal", "--eval_max_tokens", "3000",
            "--dense_from", str(out))
    report = json.loads((ablation / "report.json").read_text())
    assert not (ablation / "dense").exists() and report["arms"]["dense"]["out_dir"] == str(out / "dense")
    assert report["arms"]["nsa"]["eval"]["loss"] != json.loads((out / "report.json").read_text())["arms"]["nsa"]["eval"]["loss"]
    code, err = compare_in_process("--out", str(tmp_path / "x"), data, *TINY, "--train.lr=1e-3", "--dense_from", str(out))
    assert code == 2 and "train.lr" in err and len(err.strip().splitlines()) == 1
    handoff = subprocess.run([sys.executable, "scripts/handoff.py", str(ablation / "nsa"), "--out-dir", str(tmp_path / "ho")],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
    assert handoff.returncode == 0, handoff.stderr
    (tar,) = (tmp_path / "ho").glob("*.tar.gz")
    names = {n.split("/", 1)[1] for n in tarfile.open(tar).getnames()}
    assert {"compare/report.json", "compare/report.md", "compare/report.png"} <= names


@pytest.mark.parametrize("config, args, message", [
    ("configs/train_showcase.yaml", [], "train.compare takes an NSA config"),
    ("configs/nsa_twin_kjv.yaml", ["--data.source=synthetic"], "--data.source=bin:DIR"),
    ("configs/nsa_twin_kjv.yaml", ["--side_by_side"], "--side_by_side needs 2 GPUs"),
    ("configs/nsa_twin_kjv.yaml", ["--eval_max_tokens", "1"], "--eval_max_tokens must be >= 2"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, config, args, message):
    code, err = compare_in_process("--out", str(tmp_path / "c"), *args, config=config)
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err
    assert not (tmp_path / "c").exists()
