"""Training on a data mixture: per-source validation in val.csv, the realised shares in training.csv, and exact resume
(bitwise losses and weights) across .HALT, kill -9 and a stage boundary (kill -9: the mixture with a stream source,
which also has the most state to lose); a resume whose mixture changed is refused."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from train.core.errors import DataError
from train.data.mixture import MixtureStream
from train.trainer.runner import run_training

from .helpers import REPO, TINY_CLI, byte_dir, kill9_after, one_rank_then_two, read_csv, run_reference_and_resume, tiny_config

MIX = ["--data.mixture=[{name: easy, source: synthetic, weight: 3}, {name: hard, source: synthetic, weight: 1}]",
       "--data.stages=[{at: 6, weights: {easy: 1, hard: 3}}]"]
ROW_KEYS = ("step", "loss", "grad_norm", "lr", "share_easy", "share_hard")


def rows(out: Path) -> list[tuple]:
    return [tuple(r[k] for k in ROW_KEYS) for r in read_csv(out / "training.csv")]


def same_weights(a: Path, b: Path) -> bool:
    ca, cb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return all(torch.equal(ca["model"][k], cb["model"][k]) for k in ca["model"]) and ca["data"] == cb["data"]


def test_val_csv_has_each_sources_loss_and_the_weighted_total(tmp_path):
    out = tmp_path / "run"
    assert run_training(tiny_config(out, *MIX, "--train.steps=8", "--train.eval_every=4")) == 0
    val = read_csv(out / "val.csv")
    assert [int(r["step"]) for r in val] == [4, 8]
    for row, weights in zip(val, ((0.75, 0.25), (0.25, 0.75))):  # step 4: the first stage; step 8: the second
        easy, hard = float(row["val_loss_easy"]), float(row["val_loss_hard"])
        assert easy != hard
        assert float(row["val_loss"]) == pytest.approx(weights[0] * easy + weights[1] * hard, rel=1e-12)
        assert math.isnan(float(row["bpb_easy"]))  # synthetic tokens have no text bytes
    train = read_csv(out / "training.csv")
    shares = [(float(r["share_easy"]), float(r["share_hard"])) for r in train]
    assert all(abs(a + b - 1) < 1e-12 for a, b in shares)
    rows = [(int(r["rows_easy"]), int(r["rows_hard"])) for r in train]  # so far: every step's 4 rows, cumulative
    assert [a + b for a, b in rows] == [4 * int(r["step"]) for r in train]
    # the run summary's evaluations carry each source's loss too
    import json

    summary = json.loads(next(out.glob("run_*.json")).read_text())
    assert [e["val_loss_hard"] for e in summary["eval_steps"]] == pytest.approx([float(r["val_loss_hard"]) for r in val],
                                                                             rel=1e-5)
    # the monitor shows each source: its share of the rows and its latest validation loss
    frame = subprocess.run([sys.executable, "scripts/monitor_frame.py", str(out), "--stale-s", "100000"], cwd=REPO,
                           capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    line = next(line for line in frame.stdout.splitlines() if line.startswith("sources"))
    assert (f"easy {shares[-1][0]:.1%} of the interval's rows ({rows[-1][0]:,} so far), val loss "
            f"{float(val[-1]['val_loss_easy']):.4f}") in line, line
    assert f"hard {shares[-1][1]:.1%} of the interval's rows ({rows[-1][1]:,} so far)" in line


def test_share_is_the_logged_intervals_and_a_stage_shows_from_its_first_interval(tmp_path):
    """48 steps, a stage at 24 moving a source from 0.8 to 0.25: share_NAME of each row is that interval's rows alone
    (the acceptance run's cumulative column still read 0.54 at the end), rows_NAME the running count; both match the
    rows the mixture's order assigned, counted step by step from a fresh stream."""
    from train.core.config import data_mixture
    from train.data.build import build_data

    args = ["--data.mixture=[{name: easy, source: synthetic, weight: 0.8}, {name: hard, source: synthetic, weight: 0.2}]",
            "--data.stages=[{at: 24, weights: {easy: 0.25, hard: 0.75}}]", "--train.steps=48", "--train.log_every=8",
            "--train.eval_every=0", "--train.batch_size=8", "--model.n_layers=1"]
    out = tmp_path / "run"
    cfg = tiny_config(out, *args)
    assert run_training(cfg) == 0
    data = build_data(cfg.data, seq_len=cfg.train.seq_len, batch_size=cfg.train.batch_size,
                      vocab_size=cfg.model.vocab_size, seed=cfg.train.seed, mixture=data_mixture(cfg))
    every = np.arange(8, dtype=np.uint64)
    easy_by_step = [int((data.train.sources_of(step, every) == 0).sum()) for step in range(48)]
    train = read_csv(out / "training.csv")
    assert [int(r["step"]) for r in train] == [8, 16, 24, 32, 40, 48]
    for r in train:
        end = int(r["step"])
        assert float(r["share_easy"]) == pytest.approx(sum(easy_by_step[end - 8:end]) / 64, abs=1e-6)
        assert int(r["rows_easy"]) == sum(easy_by_step[:end]) and int(r["rows_hard"]) == 8 * end - sum(easy_by_step[:end])
    first, second = [float(r["share_easy"]) for r in train[:3]], [float(r["share_easy"]) for r in train[3:]]
    assert min(first) > 0.55 and max(second) < 0.5  # each stage's own weights, from the stage's first interval on


def test_halt_then_resume_across_a_stage_boundary_is_bit_for_bit(tmp_path, monkeypatch):
    args = (*MIX, "--train.steps=10", "--train.log_every=1", "--train.eval_every=5")
    full, split = tmp_path / "full", tmp_path / "split"
    assert run_training(tiny_config(full, *args)) == 0
    original, calls = MixtureStream.next_batch, {"n": 0}

    def next_batch(self):
        calls["n"] += 1
        if calls["n"] == 4:
            (split / ".HALT").touch()
        return original(self)

    monkeypatch.setattr(MixtureStream, "next_batch", next_batch)
    assert run_training(tiny_config(split, *args)) == 0
    monkeypatch.setattr(MixtureStream, "next_batch", original)
    assert [int(r["step"]) for r in read_csv(split / "training.csv")] == [1, 2, 3, 4]
    (split / ".HALT").unlink()
    assert run_training(tiny_config(split, *args)) == 0  # steps 5-10: over the stage boundary at step 6
    assert rows(split) == rows(full)
    assert read_csv(split / "val.csv") == read_csv(full / "val.csv")
    assert same_weights(full / "checkpoint_step10.pt", split / "checkpoint_step10.pt")


def test_a_resume_whose_mixture_changed_is_refused_before_anything_is_written(tmp_path):
    out = tmp_path / "run"
    assert run_training(tiny_config(out, *MIX, "--train.steps=8", "--train.stop_after=4")) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != ".lock"}
    changed = ["--data.mixture=[{name: easy, source: synthetic, weight: 1}, {name: hard, source: synthetic, weight: 1}]",
               "--data.stages=[{at: 6, weights: {easy: 1, hard: 3}}]"]
    with pytest.raises(DataError, match="another data mixture"):
        run_training(tiny_config(out, *changed, "--train.steps=8"))
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != ".lock"} == before


def test_bin_sources_get_bits_per_byte_and_train_evaluate_scores_the_mixture(tmp_path, corpus_path):
    text = corpus_path.read_text(encoding="utf-8")
    genesis, psalms = text[:200_000], text[len(text) // 2:len(text) // 2 + 200_000]
    a, b = byte_dir(tmp_path / "genesis", genesis), byte_dir(tmp_path / "psalms", psalms)
    out = tmp_path / "run"
    mix = (f"--data.mixture=[{{name: genesis, source: 'bin:{a}', weight: 0.75}}, "
           f"{{name: psalms, source: 'bin:{b}', weight: 0.25}}]")
    staged = "--data.stages=[{at: 3, weights: {genesis: 0.1, psalms: 0.9}}]"  # in force at the evaluated step 6
    assert run_training(tiny_config(out, "--data.tokenizer=byte", mix, staged, "--train.steps=6",
                                    "--train.eval_every=3")) == 0
    row = read_csv(out / "val.csv")[-1]
    for name in ("genesis", "psalms"):  # one byte per token: bits per byte = loss / ln 2 (val.csv keeps 6 digits)
        assert float(row[f"bpb_{name}"]) == pytest.approx(float(row[f"val_loss_{name}"]) / math.log(2), rel=1e-5)
    cmd = [sys.executable, "-m", "train.evaluate", str(out), "--data", "mixture",
           "--device", "cpu"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    result = json.loads(proc.stdout)
    assert set(result["sources"]) == {"genesis", "psalms"}
    parts = result["sources"]  # weighted as the stage in force at the checkpoint's step (6), as val.csv weighs it
    assert result["weights"] == {"genesis": 0.1, "psalms": 0.9} and result["stage"] == "3"
    assert result["loss"] == pytest.approx(0.1 * parts["genesis"]["loss"] + 0.9 * parts["psalms"]["loss"], rel=1e-12)
    assert result["bits_per_byte"] == pytest.approx(0.1 * parts["genesis"]["bits_per_byte"]
                                                    + 0.9 * parts["psalms"]["bits_per_byte"], rel=1e-12)
    assert float(row["val_loss"]) == pytest.approx(0.1 * float(row["val_loss_genesis"])
                                                   + 0.9 * float(row["val_loss_psalms"]), rel=1e-5)
    assert parts["genesis"]["loss"] != parts["psalms"]["loss"]
    # train.compare's total for this arm: the same stage's weights, and the stage named in its report
    from train.analysis.compare_report import arm_summary
    from train.core.config import data_mixture
    from train.workflows.compare import evaluate_sources

    cfg = tiny_config(out, "--data.tokenizer=byte", mix, staged, "--train.steps=6")
    scored = evaluate_sources(out, data_mixture(cfg), None)
    assert scored["loss"] == pytest.approx(result["loss"], rel=1e-12) and scored["stage"] == "3"
    summary = arm_summary(out, scored)
    assert summary["eval_weights"] == {"genesis": 0.1, "psalms": 0.9} and summary["eval_stage"] == "3"
    # a run on one source: --data mixture is one line, exit 2
    single = tmp_path / "single"
    assert run_training(tiny_config(single, "--data.tokenizer=byte", f"--data.source=bin:{a}", "--train.steps=2")) == 0
    proc = subprocess.run([*cmd[:3], str(single), *cmd[4:]], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and "not a data.mixture" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def test_a_bin_mixture_resumed_on_two_ranks_trains_like_one_rank(tmp_path, corpus_path):
    """Global batch 8: one rank x 8 for 16 steps, against one rank for steps 1-8 resumed on two gloo ranks x 4 for
    9-16 over a stage boundary at 10. The same global batches give the one-rank losses to the 1-vs-2-rank tolerance of
    tests/train/test_distributed.py, and the data states agree."""
    text = corpus_path.read_text(encoding="utf-8")
    a, b = byte_dir(tmp_path / "a", text[:150_000]), byte_dir(tmp_path / "b", text[-150_000:])
    args = ["--model.vocab_size=320", "--model.dim=32", "--model.n_layers=1", "--model.n_heads=2", "--model.ffn_dim=64",
            "--train.seq_len=16", "--train.steps=16", "--train.log_every=1", "--train.warmup_steps=2",
            "--train.eval_every=0", "--runtime.device=cpu", "--runtime.threads=1", "--data.tokenizer=byte",
            f"--data.mixture=[{{name: a, source: 'bin:{a}', weight: 0.5}}, {{name: b, source: 'bin:{b}', weight: 0.5}}]",
            "--data.stages=[{at: 10, weights: {a: 0.1, b: 0.9}}]"]
    one, moved = tmp_path / "one", tmp_path / "moved"
    x, y = one_rank_then_two(args, one, moved, stop_after=8)
    assert [r["step"] for r in x] == [r["step"] for r in y] == [str(s) for s in range(1, 17)]
    assert max(abs(float(p["loss"]) - float(q["loss"])) for p, q in zip(x, y)) < 1e-5
    assert [r["share_a"] for r in x] == [r["share_a"] for r in y]  # the same rows from each source, step by step
    ca, cb = (torch.load(out / "checkpoint_step16.pt", weights_only=True) for out in (one, moved))
    assert ca["data"][0]["step"] == cb["data"][0]["step"] == 16 and ca["data"][0]["mixture"] == cb["data"][0]["mixture"]


def test_a_mixture_with_a_stream_source_resumes_bit_for_bit_after_kill9(tmp_path, corpus_path):
    """A jsonl stream beside a bin: directory: killed with SIGKILL after its step-60 checkpoint and resumed with the
    same command, every logged loss and the final weights and data state (the stream's reader position too) are those
    of the uninterrupted run."""
    from tests.data.conftest import write_jsonl

    text = corpus_path.read_text(encoding="utf-8")
    chapters = text.split("\n\n")
    write_jsonl(tmp_path / "kjv", [f"{h}\n{b}" for h, b in zip(chapters[0::2], chapters[1::2])][:300], n_files=3)
    psalms = byte_dir(tmp_path / "psalms", text[len(text) // 2:len(text) // 2 + 100_000])
    args = [*TINY_CLI, "--data.tokenizer=byte", "--data.val_fraction=0.05", "--data.tokenize_batch_docs=4",
            f"--data.mixture=[{{name: kjv, source: 'jsonl:{tmp_path / 'kjv'}/*.jsonl', weight: 1}}, "
            f"{{name: psalms, source: 'bin:{psalms}', weight: 1}}]", "--data.stages=[{at: 100, weights: {kjv: 1}}]",
            "--train.steps=150", "--train.warmup_steps=5", "--train.save_every=10", "--train.eval_every=50"]
    reference, out = tmp_path / "reference", tmp_path / "killed"
    assert 60 <= kill9_after(args, out, "checkpoint_step60.pt") < 150
    run_reference_and_resume(args, reference, out)
    keys = ("step", "loss", "grad_norm", "lr", "share_kjv", "share_psalms")
    assert [tuple(r[k] for k in keys) for r in read_csv(out / "training.csv")] == \
        [tuple(r[k] for k in keys) for r in read_csv(reference / "training.csv")]
    assert read_csv(out / "val.csv") == read_csv(reference / "val.csv")
    assert same_weights(reference / "checkpoint_step150.pt", out / "checkpoint_step150.pt")  # data states included
    state = torch.load(out / "checkpoint_step150.pt", weights_only=True)["data"][0]
    assert state["streams"]["kjv"]["batches"] > 0


def test_the_pilots_mixture_of_prose_and_a_recall_corpus_scored_on_answers_trains(tmp_path, corpus_path):
    """The M7C pilot's shape at toy scale: prose mixed with a recall corpus whose loss mask keeps only the answers
    (a masked bin: source in a mixture; its excluded targets once wrapped to 65436 in the file's dtype)."""
    prose = byte_dir(tmp_path / "prose", corpus_path.read_text(encoding="utf-8")[:100_000])
    recall = tmp_path / "recall"
    make = [sys.executable, "-m", "train.recall", "make", "--out", str(recall), "--window", "64", "--seq_len", "512",
            "--max_windows", "4", "--tokenizer", "byte", "--format", "prose", "--train_tokens", "20000",
            "--val_tokens", "4000"]
    proc = subprocess.run(make, cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    mix = (f"--data.mixture=[{{name: web, source: 'bin:{prose}', weight: 0.5}}, "
           f"{{name: recall, source: 'bin:{recall}', weight: 0.5}}]")
    out = tmp_path / "run"
    assert run_training(tiny_config(out, "--data.tokenizer=byte", mix, "--train.steps=4", "--train.eval_every=4")) == 0
    assert all(math.isfinite(float(r["loss"])) for r in read_csv(out / "training.csv"))
    row = read_csv(out / "val.csv")[-1]
    assert math.isfinite(float(row["val_loss_recall"])) and math.isfinite(float(row["val_loss_web"]))
    # bits per byte: the prose's over its bytes (one per token); none for the answers-only source, whose loss is per
    # answer token and whose split's bytes are not the answers' (the recall split records its text bytes)
    assert float(row["bpb_web"]) == pytest.approx(float(row["val_loss_web"]) / math.log(2), rel=1e-5)
    assert json.loads((recall / "meta.json").read_text())["splits"]["val"]["text_bytes"] > 0
    assert math.isnan(float(row["bpb_recall"]))
    assert float(row["val_loss"]) == pytest.approx(0.5 * float(row["val_loss_recall"]) + 0.5 * float(row["val_loss_web"]),
                                                   rel=1e-5)
    # the recall source's val loss is per answer token over the eval batches (batches differ in their answer counts)
    from train.checkpoint.io import model_from_checkpoint
    from train.core.config import data_mixture, load_config
    from train.data.build import build_data

    model, saved = model_from_checkpoint(out)
    cfg = tiny_config(out, "--data.tokenizer=byte", mix, "--train.steps=4")
    data = build_data(cfg.data, seq_len=cfg.train.seq_len, batch_size=cfg.train.batch_size, vocab_size=cfg.model.vocab_size,
                      seed=cfg.train.seed, mixture=data_mixture(cfg))
    nll, targets, per_batch = 0.0, 0, []
    with torch.no_grad():
        for x, y in data.val_batches(cfg.train.eval_steps, "recall"):
            logits = model(x)  # [B, T, V]
            losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=-100,
                                                       reduction="none")
            nll, targets = nll + float(losses.sum()), targets + int((y != -100).sum())
            per_batch.append(int((y != -100).sum()))
    assert len(set(per_batch)) > 1  # the weighting matters here
    assert float(row["val_loss_recall"]) == pytest.approx(nll / targets, rel=1e-5)
