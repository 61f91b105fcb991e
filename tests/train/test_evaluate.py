"""python -m train.evaluate: every target of a split scored once, bits per byte from the text's UTF-8 size."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from train.checkpoint.io import model_from_checkpoint
from train.data.preparation import prepare
from train.data.sources import is_held_out
import train.evaluation.evaluate
from train.evaluation.eval_batch import TARGET_TOKENS, choose_batch_size, forward_bytes
from train.evaluate import main
from train.trainer.runner import run_training
from train.evaluation.scoring import count_windows, plan_windows

from .helpers import tiny_config

REPO = Path(__file__).resolve().parents[2]
EOS = 256  # the byte tokenizer's
SEQ_LEN, STRIDE = 16, 4
# multi-byte characters: the UTF-8 byte count differs from the character count
UNICODE_DOC = "Naïve café — ünïcödé façade, déjà vu; 日本語 text ✓.\nSecond line of the same document."


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A tiny RoPE model trained 2 steps on the byte tokenizer."""
    out = tmp_path_factory.mktemp("eval") / "run"
    assert run_training(tiny_config(out, "--data.tokenizer=byte", "--train.steps=2")) == 0
    return out


@pytest.fixture(scope="module")
def docs(corpus_path) -> list[str]:
    paragraphs = corpus_path.read_text(encoding="utf-8").split("\n\n")
    return [paragraphs[1][:700], UNICODE_DOC, paragraphs[3][:500]]


@pytest.fixture(scope="module")
def text_source(tmp_path_factory, docs) -> str:
    """A text: source (read through `datasets`: where it is missing, the tests that read one skip)."""
    from train.core.optional import OPTIONAL, installed

    if not installed("datasets"):
        pytest.skip(f"datasets is not installed: {OPTIONAL['datasets'][1]} needs it")
    root = tmp_path_factory.mktemp("texts")
    for i, doc in enumerate(docs):
        (root / f"doc{i}.txt").write_text(doc, encoding="utf-8")
    return f"text:{root}/doc*.txt"


def stream_of(docs: list[str]) -> list[int]:
    """The byte tokenizer's stream of the documents: each document's UTF-8 bytes, then EOS."""
    return [t for doc in docs for t in (*doc.encode("utf-8"), EOS)]


def evaluate(capsys, *args) -> tuple[int, dict | None, str]:
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, json.loads(captured.out) if code == 0 else None, captured.err


def hand_nll(model, tokens: list[int], windows: list[tuple[int, int, list[int]]]) -> tuple[float, list[int]]:
    """Sum of per-token cross-entropy from full logits: window (start, end, targets j): the model reads
    tokens[start:end] and target j (start < j <= end) is predicted at position j - 1 - start."""
    total, scored = 0.0, []
    for start, end, targets in windows:
        with torch.no_grad():
            logits = model(torch.tensor([tokens[start:end]]))[0]  # [T, V]
        log_probs = F.log_softmax(logits.double(), dim=-1)
        for j in targets:
            total -= float(log_probs[j - 1 - start, tokens[j]])
            scored.append(j)
    return total, scored


def test_windows_cover_every_target_once():
    for n_tokens in (2, 16, 17, 18, 100, 101):
        for seq_len, stride in ((16, 16), (16, 4), (16, 1), (5, 3)):
            windows = list(plan_windows(n_tokens, seq_len, stride))
            assert count_windows(n_tokens, seq_len, stride) == len(windows)
            scored = [t for w in windows for t in range(w.end - w.scored + 1, w.end + 1)]
            assert scored == list(range(1, n_tokens)), (n_tokens, seq_len, stride)
            assert all(0 <= w.start < w.end and w.end - w.start <= seq_len for w in windows)
            first_scored = [w.end - w.scored + 1 for w in windows[1:]]
            if stride < seq_len:  # context before each scored target: at least seq_len - stride tokens
                assert all(j - 1 - w.start >= seq_len - stride for w, j in zip(windows[1:], first_scored))
            else:  # non-overlapping: windows [kL, kL + L], the last one partial
                assert [w.start for w in windows] == list(range(0, n_tokens - 1, seq_len))


def test_full_split_loss_equals_a_hand_loop(run_dir, docs, text_source, capsys):
    tokens = stream_of(docs)
    n = len(tokens)
    assert (n - 1) % SEQ_LEN  # the last window is partial
    model, _ = model_from_checkpoint(run_dir, "cpu")

    code, flat, err = evaluate(capsys, run_dir, "--data", text_source, "--seq_len", SEQ_LEN, "--batch_size", 3)
    assert code == 0, err
    nll, scored = hand_nll(model, tokens, [(s, min(s + SEQ_LEN, n - 1), range(s + 1, min(s + SEQ_LEN, n - 1) + 1))
                                           for s in range(0, n - 1, SEQ_LEN)])
    assert sorted(scored) == list(range(1, n)) and flat["tokens"] == n - 1
    assert flat["loss"] == pytest.approx(nll / (n - 1), rel=1e-5)
    assert flat["windows"] == math.ceil((n - 1) / SEQ_LEN) and flat["stride"] == SEQ_LEN
    assert flat["perplexity"] == pytest.approx(math.exp(flat["loss"]))
    assert flat["bits_per_token"] == pytest.approx(flat["loss"] / math.log(2))

    code, strided, err = evaluate(capsys, run_dir, "--data", text_source, "--seq_len", SEQ_LEN, "--stride", STRIDE,
                                  "--batch_size", 5, "--name", "strided")
    assert code == 0, err
    # target j: the first window (tokens 0..L-1) for j <= L; else the window of L tokens ending at the
    # first multiple of STRIDE past L that reaches j (or at the stream's end)
    by_window: dict[tuple[int, int], list[int]] = {}
    for j in range(1, n):
        end = SEQ_LEN if j <= SEQ_LEN else min(SEQ_LEN + math.ceil((j - SEQ_LEN) / STRIDE) * STRIDE, n - 1)
        by_window.setdefault((max(0, end - SEQ_LEN), end), []).append(j)
    nll, scored = hand_nll(model, tokens, [(s, e, js) for (s, e), js in by_window.items()])
    assert sorted(scored) == list(range(1, n)) and strided["tokens"] == n - 1
    assert strided["loss"] == pytest.approx(nll / (n - 1), rel=1e-5)
    assert abs(strided["loss"] - flat["loss"]) > 1e-4  # more context per target: a different score


def test_bits_per_byte_uses_the_texts_utf8_bytes(run_dir, docs, text_source, capsys):
    code, result, err = evaluate(capsys, run_dir, "--data", text_source, "--seq_len", SEQ_LEN)
    assert code == 0, err
    utf8 = sum(len(doc.encode("utf-8")) for doc in docs)
    assert utf8 > sum(len(doc) for doc in docs)  # the check below can tell bytes from characters
    assert result["bytes"] == utf8 and result["bytes_from"] == "documents"
    assert result["tokens"] == utf8 + len(docs) - 1  # byte tokens + one EOS per document, minus the first
    assert result["bits_per_byte"] == pytest.approx(result["loss"] * result["tokens"] / (utf8 * math.log(2)))


def test_bin_and_text_give_the_same_result(run_dir, docs, tmp_path, capsys):
    seed = next(s for s in range(100) if 0 < sum(is_held_out(d, s, 0.5) for d in docs) < len(docs))
    held_out = [d for d in docs if is_held_out(d, seed, 0.5)]
    kept = [d for d in docs if not is_held_out(d, seed, 0.5)]
    sources = {}
    for name, chosen in (("all", docs), ("held_out", held_out)):
        (tmp_path / name).mkdir()
        for i, doc in enumerate(chosen):  # file names keep the corpus order
            (tmp_path / name / f"doc{i}.txt").write_text(doc, encoding="utf-8")
        sources[name] = f"text:{tmp_path / name}/doc*.txt"
    prepared = tmp_path / "prepared"
    meta = prepare(sources["all"], "byte", prepared, val_fraction=0.5, split_seed=seed, workers=1)
    utf8 = {split: sum(len(d.encode("utf-8")) for d in chosen) for split, chosen in (("train", kept), ("val", held_out))}
    assert {split: meta["splits"][split]["text_bytes"] for split in utf8} == utf8
    assert meta["text_bytes"] == sum(utf8.values())

    _, from_text, _ = evaluate(capsys, run_dir, "--data", sources["held_out"], "--seq_len", SEQ_LEN)
    code, from_bin, err = evaluate(capsys, run_dir, "--data", f"bin:{prepared}", "--seq_len", SEQ_LEN)
    assert code == 0, err
    assert from_bin["split"] == "val" and from_bin["bytes_from"] == "meta.json" and from_bin["bytes"] == utf8["val"]
    assert from_text["tokens"] == len(stream_of(held_out)) - 1
    for key in ("tokens", "windows", "bytes", "loss", "bits_per_byte"):
        assert from_bin[key] == pytest.approx(from_text[key], rel=1e-9), key

    # a directory prepared before splits recorded text_bytes: no bits per byte, and a note why
    raw = json.loads((prepared / "meta.json").read_text())
    for split in raw["splits"].values():
        del split["text_bytes"]
    (prepared / "meta.json").write_text(json.dumps(raw))
    code, old, err = evaluate(capsys, run_dir, "--data", f"bin:{prepared}", "--seq_len", SEQ_LEN, "--name", "old_dir")
    assert code == 0, err
    assert old["bits_per_byte"] is None and old["bytes"] is None and "text_bytes" in old["note"]
    assert old["loss"] == pytest.approx(from_bin["loss"], rel=1e-9)

    # --max_tokens cuts the stream: fewer targets, and the byte count of the prefix is not claimed
    code, cut, err = evaluate(capsys, run_dir, "--data", f"bin:{prepared}", "--seq_len", SEQ_LEN, "--max_tokens", 50,
                              "--name", "cut")
    assert code == 0, err
    assert cut["tokens"] == 49 and cut["bits_per_byte"] is None and "--max_tokens" in cut["note"]


def test_result_file_beside_the_checkpoint_never_replaces_another(run_dir, text_source, capsys):
    code, result, err = evaluate(capsys, run_dir / "latest.pt", "--data", text_source, "--seq_len", SEQ_LEN,
                                 "--name", "mine")
    assert code == 0, err
    path = run_dir / "eval_mine.json"
    assert result["file"] == str(path) and json.loads(path.read_text()) == result
    assert Path(result["checkpoint"]) == run_dir / "checkpoint_step2.pt" and result["step"] == 2
    assert evaluate(capsys, run_dir, "--data", text_source, "--seq_len", SEQ_LEN, "--name", "mine")[0] == 0

    foreign = {"tool": "train.evaluate", "checkpoint": str(run_dir / "checkpoint_step1.pt"), "loss": 1.0}
    not_ours = {"checkpoint": str(run_dir / "checkpoint_step2.pt"), "val_loss": 1.0}  # e.g. eval_only's file
    for name, prior in (("other_ckpt", foreign), ("other_tool", not_ours)):
        (run_dir / f"eval_{name}.json").write_text(json.dumps(prior))
        code, _, err = evaluate(capsys, run_dir, "--data", text_source, "--name", name)
        assert code == 2 and err.count("\n") == 1 and "--name" in err
        assert json.loads((run_dir / f"eval_{name}.json").read_text()) == prior


def test_bad_input_is_one_line(run_dir, text_source, tmp_path, capsys):
    learned = tmp_path / "learned"
    assert run_training(tiny_config(learned, "--data.tokenizer=byte", "--train.steps=1",
                                    "--model.pos_emb=learned")) == 0
    code, _, err = evaluate(capsys, learned, "--data", text_source, "--stride", 8)
    assert code == 2 and err.count("\n") == 1 and "learned positions" in err

    byte_dir, gpt2_dir = tmp_path / "byte_dir", tmp_path / "gpt2_dir"
    prepare(text_source, "byte", byte_dir, val_fraction=0.0, workers=1)
    shutil.copytree(byte_dir, gpt2_dir)
    meta = json.loads((gpt2_dir / "meta.json").read_text())
    (gpt2_dir / "meta.json").write_text(json.dumps({**meta, "tokenizer": "gpt2"}))
    capsys.readouterr()  # prepare's progress bar
    cases = [
        (["--data", f"bin:{gpt2_dir}", "--split", "train"], "prepared with tokenizer gpt2 but the checkpoint names byte"),
        (["--data", f"bin:{byte_dir}"], "split val holds 0 token(s)"),  # val_fraction=0: an empty val split
        (["--data", text_source, "--split", "val"], "--split applies to bin:"),
        (["--data", f"bin:{byte_dir}", "--text_sample_by", "line"], "apply to text:"),
        (["--data", f"bin:{tmp_path / 'nowhere'}"], "does not exist"),
        (["--data", "hf:some/dataset"], "expected bin:DIR"),
        (["--data", text_source, "--seq_len", 16, "--stride", 17], "--stride must be in"),
    ]
    for args, message in cases:
        code, _, err = evaluate(capsys, run_dir, *args)
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and message in err, (args, err)


def test_cli_as_a_subprocess(run_dir, text_source, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ok = subprocess.run([sys.executable, "-m", "train.evaluate", str(run_dir), "--data", text_source,
                         "--seq_len", str(SEQ_LEN), "--name", "cli"], capture_output=True, text=True, timeout=120,
                        cwd=tmp_path, env=env)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.count("\n") == 1  # one JSON object on one line
    result = json.loads(ok.stdout)
    assert result["tokens_per_s"] > 0 and result["device"] == "cpu" and result["precision"] == "float32"
    assert json.loads((run_dir / "eval_cli.json").read_text()) == result


def test_the_default_batch_comes_from_the_model_and_memory_and_changes_nothing(run_dir, text_source, capsys):
    """No --batch_size: many windows per forward (not the checkpoint's train.batch_size of 4); any batch scores
    the same targets to the same loss."""
    code, auto, err = evaluate(capsys, run_dir, "--data", text_source, "--seq_len", SEQ_LEN, "--name", "auto")
    assert code == 0, err
    model, cfg = model_from_checkpoint(run_dir, "cpu")
    assert auto["batch_size_from"].startswith("auto: ") and auto["batch_size"] > cfg["train"]["batch_size"]
    assert auto["batch_size"] == min(auto["windows"], TARGET_TOKENS["cpu"] // SEQ_LEN)  # memory is plentiful here
    assert f"{auto['batch_size']} per forward ({auto['batch_size_from']})" in err
    for batch in (1, 7):
        for stride in (SEQ_LEN, STRIDE):
            code, explicit, err = evaluate(capsys, run_dir, "--data", text_source, "--seq_len", SEQ_LEN, "--stride",
                                           stride, "--batch_size", batch, "--name", f"b{batch}_s{stride}")
            assert code == 0, err
            assert explicit["batch_size"] == batch and explicit["batch_size_from"] == "--batch_size"
            if stride == SEQ_LEN:
                assert (explicit["tokens"], explicit["windows"]) == (auto["tokens"], auto["windows"])
                assert explicit["loss"] == pytest.approx(auto["loss"], rel=1e-6, abs=1e-6)
    strided = [json.loads((run_dir / f"eval_b{b}_s{STRIDE}.json").read_text()) for b in (1, 7)]
    assert strided[0]["tokens"] == strided[1]["tokens"]
    assert strided[0]["loss"] == pytest.approx(strided[1]["loss"], rel=1e-6)


def test_the_default_batch_shrinks_to_fit_the_free_memory(run_dir):
    model, _ = model_from_checkpoint(run_dir, "cpu")
    seq_len, cpu = 256, torch.device("cpu")
    plenty = choose_batch_size(model.cfg, seq_len=seq_len, n_windows=10_000, device=cpu, act_bytes=4, free_bytes=2**40)
    assert plenty.size == TARGET_TOKENS["cpu"] // seq_len
    assert choose_batch_size(model.cfg, seq_len=seq_len, n_windows=3, device=cpu, act_bytes=4,
                             free_bytes=2**40).size == 3  # never more windows than the stream has
    need = forward_bytes(model.cfg, plenty.size, seq_len, 4)
    tight = choose_batch_size(model.cfg, seq_len=seq_len, n_windows=10_000, device=cpu, act_bytes=4,
                              free_bytes=int(need))  # a quarter of this is free for a forward
    assert 1 <= tight.size < plenty.size and "GiB free" in tight.why
    assert forward_bytes(model.cfg, tight.size, seq_len, 4) <= need / 4 or tight.size == 1
    assert choose_batch_size(model.cfg, seq_len=seq_len, n_windows=10_000, device=cpu, act_bytes=4,
                             free_bytes=1).size == 1


def test_progress_lines_carry_an_eta_and_do_not_spam(run_dir, text_source, capsys, monkeypatch):
    code, _, err = evaluate(capsys, run_dir, "--data", text_source, "--seq_len", SEQ_LEN, "--batch_size", 1,
                            "--name", "quiet")
    assert code == 0 and err.count("\n") == 1  # a fast run: the one line saying what runs, no per-batch lines
    monkeypatch.setattr(train.evaluation.evaluate, "PROGRESS_EVERY_S", 0.0)  # a line at every chance (each batch)
    code, result, err = evaluate(capsys, run_dir, "--data", text_source, "--seq_len", SEQ_LEN, "--batch_size", 8,
                                 "--name", "progress")
    assert code == 0
    lines = err.splitlines()[1:]
    assert len(lines) == math.ceil(result["windows"] / 8) - 1  # every batch but the last
    first = lines[0]
    assert first.startswith(f"evaluate: {8 * SEQ_LEN:,} / {result['tokens']:,} targets (") and " ETA " in first
    assert all(" tokens/s, ETA " in line for line in lines)


def test_loss_by_position_beyond_the_training_length_equals_a_hand_loop(run_dir, docs, text_source, capsys):
    """--by_position K at a seq_len past the training length (32; the model's max_seq_len is 64, RoPE reads on): each
    slice's loss is the hand loop's over the targets at those window positions, the slices add up to the whole, and
    the slices past the training length are marked."""
    tokens = stream_of(docs)
    n, seq = len(tokens), 128
    model, _ = model_from_checkpoint(run_dir, "cpu")
    code, result, err = evaluate(capsys, run_dir, "--data", text_source, "--seq_len", seq, "--by_position", 4,
                                 "--name", "by_position")
    assert code == 0, err
    assert result["training_length"] == 32 and [r["from"] for r in result["by_position"]] == [1, 33, 65, 97]
    assert [r["beyond_training"] for r in result["by_position"]] == [False, True, True, True]
    windows = [(s, min(s + seq, n - 1)) for s in range(0, n - 1, seq)]
    for row in result["by_position"]:  # targets at window positions from..to (1-based): j - start in that range
        nll, scored = hand_nll(model, tokens, [(s, e, [j for j in range(s + 1, e + 1) if row["from"] <= j - s <= row["to"]])
                                               for s, e in windows])
        assert row["tokens"] == len(scored) and row["loss"] == pytest.approx(nll / len(scored), rel=1e-5)
    total = sum(r["loss"] * r["tokens"] for r in result["by_position"])
    assert result["tokens"] == n - 1 and total == pytest.approx(result["loss"] * result["tokens"], rel=1e-9)
    code, _, err = evaluate(capsys, run_dir, "--data", text_source, "--seq_len", seq, "--stride", 16,
                            "--by_position", 4, "--name", "refused")
    assert code == 2 and "--by_position 4: 1 .. seq_len slices of non-overlapping windows" in err
