"""python -m train.compare end to end on a tiny config: the three arms (nsa, dense, window) train for real,
train.evaluate scores the whole validation split, and every number of the report is checked against the out_dirs
and the evaluation files; --arms, a DIR made before the window arm existed, reuse of earlier arms, refusals."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tarfile

import pytest
import torch
import yaml

from tests.conftest import REPO
from train.analysis.compare_report import build_report, markdown
from train.core.artifacts import read_csv, read_heartbeat
from train.analysis.paired import paired_test
from train.core.artifacts import read_items

TINY = ["--model.dim=32", "--model.n_layers=1", "--model.n_heads=2", "--model.n_kv_heads=1", "--model.head_dim=16",
        "--model.ffn_dim=64", "--train.steps=4", "--train.seq_len=64", "--train.batch_size=2", "--train.log_every=1",
        "--train.eval_every=2", "--train.eval_steps=2", "--train.save_every=2", "--train.warmup_steps=1",
        "--runtime.threads=1", "--nsa.w=32"]  # a window shorter than seq_len: the window arm is no dense model


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
    """A comparison run first with --arms nsa,dense (a DIR as train.compare made it before the window arm existed,
    its nsa.yaml also without nsa.gates), then again with the default arms: the window arm is trained."""
    out = tmp_path_factory.mktemp("compare") / "twin"
    data = f"--data.source=bin:{kjv_bin}"
    first = compare("--out", str(out), data, *TINY, "--eval_max_tokens", "3000", "--arms", "nsa,dense")
    before = {"report": json.loads((out / "report.json").read_text()), "yamls": sorted(p.name for p in out.glob("*.yaml")),
              "stdout": first.stdout}
    nsa_yaml = out / "nsa.yaml"
    nsa_yaml.write_text("".join(line for line in nsa_yaml.read_text().splitlines(True) if "gates:" not in line))
    res = compare("--out", str(out), data, *TINY, "--eval_max_tokens", "3000")
    return out, data, res, before


def _eval_file(out_dir):
    (scored,) = out_dir.glob("eval_*_val_step4.json")
    return json.loads(scored.read_text())


def test_report_numbers_come_from_the_three_out_dirs(compared):
    out, _, res, _ = compared
    report = json.loads((out / "report.json").read_text())
    assert list(report["arms"]) == ["nsa", "dense", "window"]
    for arm in ("nsa", "dense", "window"):
        out_dir = out / arm
        cfg = yaml.safe_load((out_dir / "config.yaml").read_text())
        assert cfg["model"]["attention"] == ("dense" if arm == "dense" else "nsa") and ("nsa" in cfg) == (arm != "dense")
        metrics = json.loads((out_dir / "metrics.json").read_text())
        summary = report["arms"][arm]
        assert (summary["params"], summary["step"], summary["tokens_seen"]) == \
            (metrics["params"], metrics["step"], metrics["tokens_seen"]) and metrics["status"] == "finished"
        val = [[int(r["step"]), float(r["val_loss"])] for r in read_csv(out_dir / "val.csv")]
        assert summary["val_loss"] == val and [s for s, _ in val] == [2, 4]
        train = read_csv(out_dir / "training.csv")
        assert summary["train_loss"] == [[int(r["step"]), float(r["loss"])] for r in train]
        assert [s for s, _ in summary["train_loss"]] == [1, 2, 3, 4]
        assert summary["tokens_per_s_median"] == statistics.median(float(r["toks_per_s"]) for r in train)
        score = _eval_file(out_dir)
        assert {k: summary["eval"][k] for k in ("loss", "bits_per_byte", "tokens", "split")} == \
            {k: score[k] for k in ("loss", "bits_per_byte", "tokens", "split")}
        assert score["tokens"] == 2999 and score["split"] == "val"
    nsa_cfg, window_cfg = (yaml.safe_load((out / arm / "config.yaml").read_text())["nsa"] for arm in ("nsa", "window"))
    assert nsa_cfg["gates"] == "learned" and window_cfg == {"w": nsa_cfg["w"], "win_block": nsa_cfg["win_block"],
                                                              "kernel": nsa_cfg["kernel"], "gates": "window"}
    loss = {arm: report["arms"][arm]["eval"]["loss"] for arm in report["arms"]}
    assert len(set(loss.values())) == 3  # three different models (w = 32 < seq_len 64: the window is not dense)
    params = {arm: report["arms"][arm]["params"] for arm in report["arms"]}
    assert params["window"] == params["dense"] < params["nsa"]  # the window layer: q, its k and v, o (dense's count)
    bpb = {arm: report["arms"][arm]["eval"]["bits_per_byte"] for arm in report["arms"]}
    assert set(bpb.values()) == {None}  # a split cut by --eval_max_tokens has no byte count: no bits/byte gap
    for control, key in (("dense", "gap"), ("window", "gap_window")):
        assert report[f"{key}_pct"] == pytest.approx(100 * (loss["nsa"] - loss[control]) / loss[control])
        assert report[f"{key}_bits_per_byte_pct"] is None
    # the bits/byte gaps, from scores that have them (the whole split's)
    scores = {arm: {**_eval_file(out / arm), "bits_per_byte": 2.0 + i / 10} for i, arm in enumerate(report["arms"])}
    rebuilt = build_report(out, {arm: out / arm for arm in report["arms"]}, scores)
    assert rebuilt["gap_bits_per_byte_pct"] == pytest.approx(100 * (2.0 - 2.1) / 2.1)
    assert rebuilt["gap_window_bits_per_byte_pct"] == pytest.approx(100 * (2.0 - 2.2) / 2.2)
    assert "gap vs window: " + f"{rebuilt['gap_window_pct']:+.2f}% loss, -9.09% bits/byte" in markdown(rebuilt)
    gates = [r for r in read_heartbeat(out / "nsa" / "heartbeat_rank0.jsonl") if r.get("kind") == "train"]
    assert [r["step"] for r in report["nsa"]["over_time"]] == [r["step"] for r in gates]
    assert report["nsa"]["over_time"][-1]["gate_share_win"] == gates[-1]["gate_share_win"]
    for key in ("sel_recall", "sel_outside_window", "gate_mean_sel", "sel_recall_layers", "gate_mean_win_layers"):
        assert report["nsa"]["over_time"][-1][key] == gates[-1][key], key  # selection health, per logged step
    window_beat = [r for r in read_heartbeat(out / "window" / "heartbeat_rank0.jsonl") if r.get("kind") == "train"]
    assert window_beat[-1]["gate_mean_win"] == 1.0 and window_beat[-1]["sel_recall"] == "nan"  # pinned, no selection
    md = (out / "report.md").read_text()
    assert "| | nsa | dense | window |" in md and "| step | val nsa | val dense | val window |" in md
    assert f"gap vs dense: {report['gap_pct']:+.2f}% loss" in md and f"gap vs window: {report['gap_window_pct']:+.2f}% loss" in md
    assert f"| whole-split loss | {loss['nsa']:.4f} | {loss['dense']:.4f} | {loss['window']:.4f} |" in md
    assert "sel_recall" in md and "sel_recall by layer at step 4: " in md
    assert report["verdict"] in md and (out / "report.png").stat().st_size > 0
    assert f"compare: {report['verdict']}" in res.stdout
    assert "first 3,000 validation tokens" in report["verdict"] and " dense " in report["verdict"] \
        and "window-only control" in report["verdict"]


def test_a_dir_made_before_the_window_arm_gets_it_on_the_next_run(compared):
    """--arms nsa,dense wrote what an older train.compare wrote (nsa.yaml, dense.yaml, a two-arm report); the
    default command then trains only the window arm and reuses the other two arms' evaluations."""
    out, _, res, before = compared
    assert before["yamls"] == ["dense.yaml", "nsa.yaml"] and list(before["report"]["arms"]) == ["nsa", "dense"]
    assert before["report"]["gap_window_pct"] is None and before["report"]["gap_pct"] is not None
    assert "training the window arm" not in before["stdout"]
    assert "training the window arm" in res.stdout and res.stdout.count("compare: reusing") == 2
    assert res.stdout.count("compare: training the") == 1 and res.stdout.count("finished at step 4") == 2
    report = json.loads((out / "report.json").read_text())
    assert report["gap_pct"] == before["report"]["gap_pct"]  # nsa and dense untouched
    assert sorted(p.name for p in out.glob("*.yaml")) == ["dense.yaml", "nsa.yaml", "window.yaml"]


def test_the_window_arms_checkpoint_loads_as_a_window_only_model(compared):
    from train.checkpoint.io import model_from_checkpoint

    out = compared[0]
    model, run_config = model_from_checkpoint(out / "window")
    assert run_config["nsa"]["gates"] == "window" and all(blk.attn.cfg.window_only for blk in model.blocks)
    assert model.num_params() == json.loads((out / "report.json").read_text())["arms"]["window"]["params"]
    assert not hasattr(model.blocks[0].attn, "gate_mlp") and torch.isfinite(model(torch.ones(1, 8, dtype=torch.long))).all()


def test_the_same_command_resumes_and_reuses_and_another_config_is_refused(compared):
    out, data, _, _ = compared
    before = json.loads((out / "report.json").read_text())
    nsa_yaml = out / "nsa.yaml"  # as written before nsa.gate_init existed: a key at its default is no change
    nsa_yaml.write_text("".join(line for line in nsa_yaml.read_text().splitlines(True) if "gate_init" not in line))
    again = compare("--out", str(out), data, *TINY, "--eval_max_tokens", "3000")
    assert again.stdout.count("compare: reusing") == 3 and again.stdout.count("finished at step 4") == 3
    assert "compare: training the" not in again.stdout  # nothing left to train: no trainer launched
    after = json.loads((out / "report.json").read_text())
    assert (after["gap_pct"], after["gap_window_pct"]) == (before["gap_pct"], before["gap_window_pct"])
    code, err = compare_in_process("--out", str(out), data, *TINY, "--nsa.w=64")
    assert code == 2 and err.strip().splitlines() == [
        f"error: {out} compares another config (nsa.w: 32 there, 64 now); use another --out"]


def test_reused_arms_and_handoff_carries_the_report(compared, tmp_path):
    """--dense_from and --reuse_from: an nsa.* ablation trains only its NSA arm."""
    from train.workflows.compare import arm_configs, reuse_controls

    out, data, _, _ = compared
    ablation = tmp_path / "gate_equal"
    res = compare("--out", str(ablation), data, *TINY, "--nsa.gate_init=equal", "--eval_max_tokens", "3000",
                  "--dense_from", str(out), "--reuse_from", str(out))
    report = json.loads((ablation / "report.json").read_text())
    assert not (ablation / "dense").exists() and not (ablation / "window").exists()
    assert [report["arms"][arm]["out_dir"] for arm in ("dense", "window")] == [str(out / "dense"), str(out / "window")]
    assert f"taking the window-only control from {out}" in res.stdout and "training the nsa arm" in res.stdout
    assert res.stdout.count("compare: training the") == 1
    assert report["arms"]["nsa"]["eval"]["loss"] != json.loads((out / "report.json").read_text())["arms"]["nsa"]["eval"]["loss"]
    # --reuse_from alone takes every control that matches key by key, and leaves the others to train here
    config = REPO / "configs/nsa_twin_kjv.yaml"
    docs = arm_configs(config, [data, *TINY, "--nsa.gate_bias=2"], tmp_path / "b2")
    assert reuse_controls(docs, ("dense", "window"), [tmp_path / "nowhere", out]) == {"dense": out / "dense",
                                                                                      "window": out / "window"}
    docs = arm_configs(config, [data, *TINY, "--nsa.w=64"], tmp_path / "w64")
    assert reuse_controls(docs, ("dense", "window"), [out]) == {"dense": out / "dense"}
    assert docs["window"]["train"]["out_dir"] == str(tmp_path / "w64" / "window")
    for flag in ("--dense_from", "--reuse_from"):
        code, err = compare_in_process("--out", str(tmp_path / "x"), data, *TINY, "--train.lr=1e-3", flag, str(out))
        assert code == 2 and "train.lr" in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "x").exists()
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
    ("configs/nsa_twin_kjv.yaml", ["--arms", "nsa,sparse"], "error: --arms: unknown arm 'sparse'; valid: nsa, dense, window"),
    ("configs/nsa_twin_kjv.yaml", ["--arms", "nsa"], "names no control arm (dense, window)"),
    ("configs/nsa_twin_kjv.yaml", ["--arms", "window", "--dense_from", "x"], "--dense_from reuses the dense arm"),
    ("configs/nsa_twin_kjv.yaml", ["--nsa.gates=window"], "derives the window-only control from it"),
    ("configs/nsa_twin_kjv.yaml", ["--tasks", "no_such_task"], "no_such_task"),
    ("configs/nsa_twin_kjv.yaml", ["--tasks_limit", "5"], "--tasks_limit 5: a positive number of docs per task, with --tasks"),
    ("configs/nsa_twin_kjv.yaml", ["--needle", "1,2"], "--needle: the needle test needs a word-level tokenizer"),
    ("configs/nsa_twin_kjv.yaml", ["--needle", "1,x", "--data.tokenizer=gpt2"], "positive multiples of train.seq_len"),
    ("configs/nsa_twin_kjv.yaml", ["--needle", "0", "--data.tokenizer=gpt2"], "positive multiples of train.seq_len"),
    ("configs/nsa_twin_kjv.yaml", ["--needle", "2", "--data.tokenizer=gpt2", "--model.pos_emb=learned"],
     "S=2048 is beyond the learned positions"),
    ("configs/nsa_twin_kjv.yaml", ["--needle_trials", "3"], "--needle_trials 3: a positive number of trials per depth, with --needle"),
    ("configs/nsa_twin_kjv.yaml", ["--recall_probe", "--nsa.w=512"], "--recall_probe: nsa.w=512 leaves no distance beyond"),
    ("configs/nsa_twin_kjv.yaml", ["--recall_probe", "--recall_format", "yaml"], "--recall_format 'yaml': one of kv, prose"),
    ("configs/nsa_twin_kjv.yaml", ["--recall_lengths", "1,2"], "--recall_lengths probes with the recall task"),
    ("configs/nsa_twin_kjv.yaml", ["--recall_probe", "--recall_lengths", "1,0"], "comma-separated whole numbers >= 1"),
    ("configs/nsa_twin_kjv.yaml", ["--positions", "4"], "--positions '4': M,K"),
    ("configs/nsa_twin_kjv.yaml", ["--recall_format", "prose"], "--recall_format spells the recall probe's lines"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, config, args, message):
    code, err = compare_in_process("--out", str(tmp_path / "c"), *args, config=config)
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err
    assert not (tmp_path / "c").exists()


def _task_file(path):
    """Four two-choice items in the OLMES requests format (one line per doc and choice)."""
    lines = []
    for doc_id, (context, choices, gold) in enumerate([("The sky is", [" blue.", " loud."], 0),
                                                       ("Water is", [" dry.", " wet."], 1),
                                                       ("Fire is", [" hot.", " cold."], 0),
                                                       ("Snow is", [" black.", " white."], 1)]):
        for idx, choice in enumerate(choices):
            lines.append(json.dumps({"request_type": "loglikelihood", "doc_id": doc_id, "idx": idx, "label": gold,
                                     "doc": {"choices": choices, "gold": gold},
                                     "request": {"context": context, "continuation": choice}}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_on_a_recall_corpus_every_arm_takes_the_probe(tmp_path):
    """Data made by python -m train.recall make: the report carries each arm's recall per distance bucket, read
    back from the recall_step<N>.json beside each arm's checkpoint, and NSA's far accuracy as a share of each control's.
    With --tasks every arm is scored on the task too: the report's scores are those of each arm's tasks_*.json."""
    from train.recall import main as recall_main

    data = tmp_path / "recall"
    assert recall_main(["make", "--out", str(data), "--window", "32", "--seq_len", "64", "--max_windows", "2",
                        "--train_tokens", "20000", "--val_tokens", "3000"]) == 0
    out = tmp_path / "twin"
    task = _task_file(tmp_path / "facts.jsonl")
    compare("--out", str(out), f"--data.source=bin:{data}", *TINY, "--tasks", str(task), "--tasks_limit", "3",
            "--recall_lengths", "1,2", "--positions", "2,4")
    report = json.loads((out / "report.json").read_text())
    tasks = report["tasks"]
    assert list(tasks["arms"]) == ["nsa", "dense", "window"] and tasks["limit"] == 3
    for arm, scores in tasks["arms"].items():
        (written,) = (out / arm).glob("tasks_*.json")
        metrics = json.loads(written.read_text())["tasks"][str(task)]
        assert metrics["items"] == 3 and scores[str(task)]["items"] == 3 and scores[str(task)]["primary"] == metrics["primary"]
        assert scores[str(task)]["primary_stderr"] == metrics["primary_stderr"]
    for control in ("dense", "window"):
        d = tasks["differences"][str(task)][control]
        nsa, other = tasks["arms"]["nsa"][str(task)], tasks["arms"][control][str(task)]
        assert d["difference"] == nsa["primary"] - other["primary"]
        assert d["significant"] == (abs(d["difference"]) > 2 * (nsa["primary_stderr"] ** 2 + other["primary_stderr"] ** 2) ** 0.5)
        items = {arm: read_items(next((out / arm).glob("tasks_*.items.jsonl"))) for arm in ("nsa", control)}
        assert d["mcnemar"] == paired_test(items["nsa"], items[control], str(task), nsa["primary_metric"])
        assert d["mcnemar"]["items"] == 3
    assert "Downstream tasks" in (out / "report.md").read_text() and "McNemar" in (out / "report.md").read_text()
    recall = report["recall"]
    assert list(recall["arms"]) == ["nsa", "dense", "window"]
    for arm, summary in recall["arms"].items():
        written = json.loads((out / arm / "recall_step4.json").read_text())
        assert written["checkpoint"].startswith(str(out / arm))
        assert {k: summary[k] for k in ("near_accuracy", "far_accuracy", "far_items", "buckets")} == \
            {k: written[k] for k in ("near_accuracy", "far_accuracy", "far_items", "buckets")}
        assert set(summary["buckets"]) == {"<1w", "1-2w"} and summary["far_items"] > 0
    for control in ("dense", "window"):
        far = recall["arms"][control]["far_accuracy"]
        assert recall[f"far_vs_{control}"] == (recall["arms"]["nsa"]["far_accuracy"] / far if far else None)
    md = (out / "report.md").read_text()
    assert "Recall probe" in md and "| 1-2w |" in md
    # beyond the training length: every arm at x1 and x2 (buckets extended), the dense arm also with RoPE interpolated
    by_length = report["recall_by_length"]
    assert by_length["training_length"] == 64 and by_length["multiples"] == [1, 2]
    assert list(by_length["arms"]) == ["nsa", "dense", "window", "dense+rope"]
    for arm in ("nsa", "dense", "window"):
        x2 = json.loads((out / arm / "recall_step4_x2.json").read_text())
        assert by_length["arms"][arm]["2"]["far_accuracy"] == x2["far_accuracy"] and "2-4w" in x2["buckets"]
        assert by_length["arms"][arm]["1"]["far_accuracy"] == recall["arms"][arm]["far_accuracy"]
    scaled = json.loads((out / "dense" / "recall_step4_x2_scalelength.json").read_text())
    assert scaled["rope_overrides"] == {"rope_scale": 2.0} and by_length["arms"]["dense+rope"]["2"]["far_accuracy"] == \
        scaled["far_accuracy"]
    positions = report["loss_by_position"]
    assert positions["seq_len"] == 128 and positions["training_length"] == 64
    for arm, rows in positions["arms"].items():
        written = json.loads((out / arm / "eval_positions_x2.json").read_text())["by_position"]
        assert [r["loss"] for r in rows] == [r["loss"] for r in written] and len(rows) == 4
        assert [r["beyond_training"] for r in rows] == [False, False, True, True]
    assert "Recall beyond the training length" in md and "| dense+rope | x2 |" in md
    assert "Validation loss by position in windows of 128 tokens" in md and "| 65-96 * |" in md


def test_needle_and_zero_shot_recall_are_read_back_from_every_arm(tmp_path, kjv_gpt2):
    """--needle 1,2 and --recall_probe on natural text in GPT-2 tokens: each arm's needle_step<N>_S<S>.json (at 1x
    and 2x the training length) and its zero-shot recall_step<N>_prose.json (prose lines, distances in multiples of
    nsa.w, documents of seq_len - 1 tokens) are what the report carries; the same command again reuses them."""
    out = tmp_path / "twin"
    res = compare("--out", str(out), f"--data.source=bin:{kjv_gpt2}", "--data.tokenizer=gpt2",
                  "--model.vocab_size=50304", *TINY, "--train.seq_len=128", "--model.max_seq_len=128",
                  "--eval_max_tokens", "2000", "--needle", "1,2", "--needle_trials", "1", "--recall_probe",
                  "--recall_format", "prose", "--arms", "nsa,dense")
    assert "zero-shot, none trained on it" in res.stdout and "needle test on every arm at S = 128, 256" in res.stdout
    report = json.loads((out / "report.json").read_text())
    needle = report["needle"]
    assert needle["lengths"] == [128, 256] and needle["multiples"] == [1.0, 2.0] and needle["trials"] == 1
    assert list(needle["arms"]) == ["nsa", "dense"] and list(report["recall"]["arms"]) == ["nsa", "dense"]
    for arm, by_length in needle["arms"].items():
        for S in (128, 256):
            written = json.loads((out / arm / f"needle_step4_S{S}.json").read_text())
            assert written["S"] == S and written["trials"] == 1 and written["checkpoint"].startswith(str(out / arm))
            assert by_length[str(S)]["mean_accuracy"] == written["mean_accuracy"]
            assert by_length[str(S)]["by_depth"] == {str(r["depth"]): r["accuracy"] for r in written["results"]}
            assert [r["trials"] for r in written["results"]] == [1] * 5
    recall = report["recall"]
    assert recall["trained_on_task"] is False and recall["format"] == "prose"
    for arm, summary in recall["arms"].items():
        written = json.loads((out / arm / "recall_step4_prose.json").read_text())
        assert written["spec"]["window"] == 32 and written["spec"]["doc_tokens"] == 127 and written["format"] == "prose"
        assert written["spec"]["max_windows"] == 3 and summary["far_accuracy"] == written["far_accuracy"]
        assert set(summary["buckets"]) == {"<1w", "1-2w", "2-4w"} and summary["far_items"] > 0
    md = (out / "report.md").read_text()
    assert "Needle in a haystack" in md and "| 256 | 2 |" in md and "zero-shot: no arm trained on the task; prose" in md
    again = compare("--out", str(out), f"--data.source=bin:{kjv_gpt2}", "--data.tokenizer=gpt2",
                    "--model.vocab_size=50304", *TINY, "--train.seq_len=128", "--model.max_seq_len=128",
                    "--eval_max_tokens", "2000", "--needle", "1,2", "--needle_trials", "1", "--recall_probe",
                    "--recall_format", "prose", "--arms", "nsa,dense")
    assert json.loads((out / "report.json").read_text())["needle"] == needle and "nothing to train" in again.stdout


def test_an_arm_the_recall_probe_refuses_is_reported_not_scorable_and_the_report_survives(tmp_path):
    """A probe geometry whose documents hold no query in an arm's lines (prose lines of 33 byte tokens in 31-token
    documents) is refused as train.recall refuses it; inside a compare report that arm reads 'not scorable' with the
    refusal's line, and the other arms' scores, tables and ratios stay."""
    from train.analysis.compare_report import (recall_length_markdown, recall_length_summary, recall_markdown,
                                               recall_summary)
    from train.data.recall import RecallSpec
    from train.trainer.runner import run_training
    from train.workflows.compare import probe_or_not_scorable
    from tests.train.helpers import tiny_config

    run = tmp_path / "run"
    assert run_training(tiny_config(run, "--train.steps=1", "--data.tokenizer=byte")) == 0
    scored = probe_or_not_scorable(run, spec=RecallSpec(window=8, doc_tokens=63, max_windows=4), documents=4)
    refused = probe_or_not_scorable(run, spec=RecallSpec(window=8, doc_tokens=31, format="prose"), documents=4)
    assert "far_accuracy" in scored and set(refused) == {"not_scorable", "length_multiple"}
    assert "too few for a query" in refused["not_scorable"]
    summary = recall_summary({"nsa": scored, "dense": refused})
    assert summary["arms"]["dense"] == {"not_scorable": refused["not_scorable"]} and summary["far_vs_dense"] is None
    assert summary["arms"]["nsa"]["far_accuracy"] == scored["far_accuracy"]
    md = "\n".join(recall_markdown(summary))
    assert f"- recall probe: dense not scorable: {refused['not_scorable']}" in md and "| distance | nsa |" in md
    by_length = recall_length_summary({"nsa": [scored], "dense": [refused]})
    assert by_length["arms"]["dense"]["1"] == {"not_scorable": refused["not_scorable"]}
    md = "\n".join(recall_length_markdown(by_length))
    assert "| nsa | x1 |" in md and "| dense | x1 |" not in md and "- recall at x1: dense not scorable: " in md
