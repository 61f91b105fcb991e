"""The recall task (train/data/recall.py, train/evaluation/recall.py, python -m train.recall): documents whose
every answer is determined by its fact at the stated distance, exact scoring per bucket (an oracle scores 1, an
oracle that cannot see past the window scores 0 beyond it), and the command end to end on a tiny run."""
from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import re

from train.data.recall import FACT, QUERY, VALUES, RecallEncoder, RecallSpec, corpus_document, probe_document
from train.data.tokenizers import load_tokenizer
from train.evaluation.recall import score_recall
from train.recall import main as recall_main

from .helpers import REPO, tiny_config

SPEC = RecallSpec(window=16, doc_tokens=255, max_windows=8)  # buckets 1-16, 16-32, 32-64, 64-128 tokens


@pytest.mark.parametrize("tokenizer", ["byte", "gpt2"])
def test_every_answer_is_its_facts_value_at_the_stated_distance(tokenizer):
    tok = load_tokenizer(tokenizer)
    enc = RecallEncoder(tok)
    rng = random.Random(3)
    for doc in [probe_document(rng, SPEC, enc) for _ in range(5)] + [corpus_document(rng, SPEC, enc) for _ in range(20)]:
        assert len(doc.ids) <= SPEC.doc_tokens
        text = tok.decode(doc.ids.tolist())
        lines = text.splitlines()
        keys = [line[:2] for line in lines if line[2] == FACT]
        assert len(keys) == len(set(keys))  # a key is stated once: the answer is determined
        facts = {line[:2]: line[3] for line in lines if line[2] == FACT}
        queries = [line for line in lines if line[2] == QUERY]
        assert len(queries) == len(doc.answer_start)
        for line, start, n, distance in zip(queries, doc.answer_start, doc.answer_len, doc.distance):
            answer = tok.decode(doc.ids[start:start + n].tolist())
            assert answer == line[3] == facts[line[:2]] and answer in VALUES
            fact_value = doc.ids[start - distance:start - distance + n]
            assert tok.decode(fact_value.tolist()) == answer  # the distance points at the fact's value
            assert 0 < distance < SPEC.max_windows * SPEC.window + enc.line_tokens


PROSE_FACT = re.compile(r"^The code of ([a-z]{2}) is ([A-Z])\.$")
PROSE_QUERY = re.compile(r"^What is the code of ([a-z]{2})\? It is ([A-Z])\.$")


@pytest.mark.parametrize("tokenizer", ["byte", "gpt2"])
def test_prose_lines_answer_from_their_fact_at_the_stated_distance(tokenizer):
    """format prose: every line is a fact or a query sentence; each answer (" M", its own tokens) is its fact's
    value, and the distance points at the fact's value tokens."""
    tok = load_tokenizer(tokenizer)
    spec = RecallSpec(window=40, doc_tokens=511, max_windows=8, format="prose")
    enc = RecallEncoder(tok, "prose")
    rng = random.Random(5)
    for doc in [probe_document(rng, spec, enc) for _ in range(3)] + [corpus_document(rng, spec, enc) for _ in range(10)]:
        assert len(doc.ids) <= spec.doc_tokens
        lines = tok.decode(doc.ids.tolist()).splitlines()
        facts = dict(m.groups() for m in map(PROSE_FACT.match, lines) if m)
        queries = [m.groups() for m in map(PROSE_QUERY.match, lines) if m]
        assert len(facts) + len(queries) == len(lines) and len(queries) == len(doc.answer_start)
        for (key, value), start, n, distance in zip(queries, doc.answer_start, doc.answer_len, doc.distance):
            answer = tok.decode(doc.ids[start:start + n].tolist())
            assert answer == " " + value == " " + facts[key]
            assert tok.decode(doc.ids[start - distance:start - distance + n].tolist()) == answer


def test_probe_documents_fill_every_bucket():
    enc = RecallEncoder(load_tokenizer("byte"))
    rng = random.Random(0)
    distances = np.concatenate([probe_document(rng, SPEC, enc).distance for _ in range(20)])
    counts = np.bincount(np.searchsorted([lo for lo, _ in SPEC.buckets()[1:]], distances, side="right"), minlength=4)
    assert (counts > 0.15 * counts.sum()).all(), counts  # near and far alike, no bucket starved


class _Oracle(torch.nn.Module):
    """Predicts each query's answer by reading its fact, but only when the fact lies at most `reach` tokens back:
    beyond that it predicts token 0 (never a value). A stand-in for a perfect model and a window-only one."""

    def __init__(self, tok, reach: int):
        super().__init__()
        self.tok, self.reach = tok, reach

    def forward(self, x):  # x [B, L] -> logits [B, L, V]
        logits = torch.zeros(*x.shape, 320)
        logits[..., 0] = 1.0
        for b in range(x.shape[0]):
            text = self.tok.decode(x[b, 1:].tolist())  # byte tokenizer: position i + 1 holds text[i]
            seen = {}
            for i in range(0, len(text) - 4, 5):
                key, mark, value = text[i:i + 2], text[i + 2], text[i + 3]
                if mark == FACT:
                    seen[key] = i + 3
                elif i + 3 - seen[key] <= self.reach:
                    logits[b, i + 3, :] = 0  # position i + 3 (input) predicts text[i + 3] (target at i + 4)
                    logits[b, i + 3, ord(value)] = 1.0
        return logits


def test_scoring_is_exact_per_bucket():
    tok = load_tokenizer("byte")
    perfect = score_recall(_Oracle(tok, reach=10**9), tok, SPEC, documents=6, batch_size=4)
    assert perfect["far_accuracy"] == 1.0 and perfect["near_accuracy"] == 1.0
    assert all(b["accuracy"] == 1.0 for b in perfect["buckets"].values())
    window_only = score_recall(_Oracle(tok, reach=SPEC.window - 1), tok, SPEC, documents=6, batch_size=4)
    assert window_only["near_accuracy"] == 1.0  # every <1w item is within reach ...
    assert window_only["far_accuracy"] == 0.0 < window_only["chance"]  # ... and none beyond: the probe can fail
    assert window_only["far_items"] == perfect["far_items"] > 50
    assert window_only["far_answer_loss"] > perfect["far_answer_loss"]


@pytest.mark.parametrize("multiple", [2, 4])
def test_scoring_beyond_the_training_length_is_exact_per_bucket(multiple):
    """Documents `multiple` times the training length, buckets extended to them: a full-reach oracle still scores 1
    in every bucket, one that sees only the window scores 0 in every far bucket, the new far ones included."""
    tok = load_tokenizer("byte")
    spec = SPEC.at_length(multiple)
    assert spec.doc_tokens == multiple * 256 - 1 and spec.buckets()[-1][1] >= spec.doc_tokens // 2
    perfect = score_recall(_Oracle(tok, reach=10**9), tok, spec, documents=4, batch_size=4)
    window_only = score_recall(_Oracle(tok, reach=SPEC.window - 1), tok, spec, documents=4, batch_size=4)
    new = [name for name in perfect["buckets"] if name not in score_recall(_Oracle(tok, 10**9), tok, SPEC,
                                                                            documents=1)["buckets"]]
    assert new and all(perfect["buckets"][name]["items"] > 0 for name in new)  # the longer distances are probed
    assert all(b["accuracy"] == 1.0 for b in perfect["buckets"].values())
    assert window_only["near_accuracy"] == 1.0 and window_only["far_accuracy"] == 0.0
    assert all(window_only["buckets"][name]["accuracy"] == 0.0 for name in new)


def test_make_train_and_score_end_to_end(tmp_path, capsys):
    data = tmp_path / "recall"
    assert recall_main(["make", "--out", str(data), "--window", "8", "--seq_len", "32", "--max_windows", "3",
                        "--train_tokens", "20000", "--val_tokens", "2000"]) == 0
    meta = json.loads((data / "meta.json").read_text())
    assert meta["recall"]["doc_tokens"] == 31 and meta["eos_id"] == 256
    before = (data / "train.bin").read_bytes()
    assert recall_main(["make", "--out", str(data), "--window", "8", "--seq_len", "32"]) == 2  # never overwritten
    assert (data / "train.bin").read_bytes() == before
    out = tmp_path / "run"
    from train.trainer.runner import run_training

    assert run_training(tiny_config(out, f"--data.source=bin:{data}", "--data.tokenizer=byte", "--train.steps=4",
                                    "--data.window_start=document")) == 0
    capsys.readouterr()
    data_info = json.loads((out / "metrics.json").read_text())["data"]
    assert data_info["window_start"] == "document" and 0 < data_info["train_window_starts"] <= meta["splits"]["train"]["documents"]
    assert recall_main(["score", str(out), "--documents", "4", "--device", "cpu"]) == 0
    result = json.loads(capsys.readouterr().out)
    written = json.loads((out / f"recall_step{result['step']}.json").read_text())
    assert written == result and result["step"] == 4
    assert set(result["buckets"]) == {"<1w", "1-2w", "2-4w"}
    assert sum(b["items"] for b in result["buckets"].values()) == result["far_items"] + result["buckets"]["<1w"]["items"]
    # prose lines are 33 byte tokens: a 31-token document holds none, so no query; refused as make refuses it (it
    # once reported items 0), nothing written
    assert recall_main(["score", str(out), "--documents", "4", "--device", "cpu", "--format", "prose"]) == 2
    assert "too few for a query" in capsys.readouterr().err and not (out / "recall_step4_prose.json").exists()
    # beyond the training length (32): documents 2x and 4x as long (4x passes the model's max_seq_len of 64, which
    # RoPE does not need), the distance buckets extended to them; each length its own file
    assert recall_main(["score", str(out), "--documents", "4", "--device", "cpu", "--lengths", "1", "2", "4"]) == 0
    by_length = json.loads(capsys.readouterr().out)
    assert by_length["training_length"] == 32 and set(by_length["lengths"]) == {"1", "2", "4"}
    assert by_length["lengths"]["1"]["buckets"] == written["buckets"]  # length 1 is the probe above (its file reused)
    x4 = json.loads((out / "recall_step4_x4.json").read_text())
    assert x4["spec"]["doc_tokens"] == 127 and x4["length_multiple"] == 4
    assert recall_main(["score", str(out), "--documents", "4", "--device", "cpu", "--format", "prose",
                        "--lengths", "4"]) == 0
    prose = json.loads(capsys.readouterr().out)  # the corpus's spec, its lines spelled in prose: a file of its own
    assert prose["format"] == "prose" and prose["spec"] == {**x4["spec"], "format": "prose"} and prose["far_items"] > 0
    assert json.loads(Path(prose["file"]).read_text()) == prose and prose["file"] != x4["file"]
    assert json.loads((out / "recall_step4_x4.json").read_text()) == x4 and result["format"] == "kv"  # untouched
    assert json.loads((out / "recall_step4.json").read_text()) == written
    assert set(x4["buckets"]) == {"<1w", "1-2w", "2-4w", "4-8w", "8-16w"}
    assert sum(b["items"] for b in x4["buckets"].values()) > sum(b["items"] for b in written["buckets"].values())
    # a RoPE change for scoring only: positions interpolated by the length multiple, in a file of its own
    assert recall_main(["score", str(out), "--documents", "4", "--device", "cpu", "--lengths", "4",
                        "--rope_scale", "length"]) == 0
    scaled = json.loads(capsys.readouterr().out)
    assert scaled["rope_overrides"] == {"rope_scale": 4.0} and scaled["file"].endswith("recall_step4_x4_scalelength.json")
    assert [b["answer_loss"] for b in scaled["buckets"].values()] != [b["answer_loss"] for b in x4["buckets"].values()]
    assert recall_main(["score", str(out), "--documents", "4", "--device", "cpu", "--lengths", "4",
                        "--rope_scale", "yarn"]) == 0  # YaRN by the multiple, its own file again
    yarn = json.loads(capsys.readouterr().out)
    assert yarn["rope_overrides"] == {"rope_scale": 4.0, "rope_scaling": "yarn"}
    assert yarn["file"].endswith("recall_step4_x4_scaleyarn.json")
    assert [b["answer_loss"] for b in yarn["buckets"].values()] != [b["answer_loss"] for b in scaled["buckets"].values()]
    # learned positions end at max_seq_len: one line, nothing written
    learned = tmp_path / "learned"
    assert run_training(tiny_config(learned, f"--data.source=bin:{data}", "--data.tokenizer=byte", "--train.steps=2",
                                    "--model.pos_emb=learned", "--data.window_start=document")) == 0
    capsys.readouterr()
    assert recall_main(["score", str(learned), "--documents", "2", "--device", "cpu", "--lengths", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert "learned positions end there" in err and "\n" not in err and not list(learned.glob("recall_*.json"))


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    out = tmp_path / "run"
    from train.trainer.runner import run_training

    assert run_training(tiny_config(out, "--train.steps=2")) == 0  # synthetic data: not a recall corpus
    capsys.readouterr()
    assert recall_main(["score", str(out), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "not a recall corpus" in err and "\n" not in err
    assert recall_main(["score", str(out), "--window", "8"]) == 2
    assert recall_main(["make", "--out", str(tmp_path / "x"), "--window", "0", "--seq_len", "32"]) == 2
    assert not (tmp_path / "x").exists()
    capsys.readouterr()
    # prose lines in bytes are 33 tokens: a 32-token document holds no line, so no query (it once wrote a corpus
    # without a single target)
    assert recall_main(["make", "--out", str(tmp_path / "x"), "--window", "8", "--seq_len", "32", "--format", "prose",
                        "--train_tokens", "2000", "--val_tokens", "200"]) == 2
    err = capsys.readouterr().err.strip()
    assert "too few for a query" in err and "\n" not in err and not (tmp_path / "x").exists()
    # score refuses the same geometry with the same line (it once reported `items 0`), and writes nothing
    byte_run = tmp_path / "byte_run"
    assert run_training(tiny_config(byte_run, "--train.steps=1", "--data.tokenizer=byte")) == 0
    capsys.readouterr()
    assert recall_main(["score", str(byte_run), "--window", "8", "--doc_tokens", "31", "--format", "prose",
                        "--device", "cpu"]) == 2
    assert capsys.readouterr().err.strip() == err and not list(byte_run.glob("recall_*.json"))
    for bad in ("sel", "selected"):  # a dense model has no branch to knock out; an unknown branch name
        assert recall_main(["score", str(out), "--window", "8", "--doc_tokens", "31", "--device", "cpu",
                            "--knockout", bad]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: --knockout") and "\n" not in err
    assert not list(out.glob("recall_*.json"))


def test_knockout_scores_an_nsa_checkpoint_apart(tmp_path, capsys):
    """--knockout writes its own file beside the full probe's and names the branches; knocking out both sparse
    branches of an NSA model changes its scores (the same documents, a different model)."""
    data = tmp_path / "recall"
    assert recall_main(["make", "--out", str(data), "--window", "8", "--seq_len", "32", "--max_windows", "3",
                        "--train_tokens", "20000", "--val_tokens", "2000"]) == 0
    out = tmp_path / "run"
    from train.trainer.runner import run_training

    nsa = ["--model.attention=nsa", "--nsa.l=8", "--nsa.d=4", "--nsa.l_sel=8", "--nsa.n_sel=3", "--nsa.w=8",
           "--nsa.gate_init=equal"]
    assert run_training(tiny_config(out, f"--data.source=bin:{data}", "--data.tokenizer=byte", "--train.steps=2",
                                    "--data.window_start=document", *nsa)) == 0
    capsys.readouterr()
    assert recall_main(["score", str(out), "--documents", "4", "--device", "cpu"]) == 0
    full = json.loads(capsys.readouterr().out)
    assert recall_main(["score", str(out), "--documents", "4", "--device", "cpu", "--knockout", "sel,cmp"]) == 0
    knocked = json.loads(capsys.readouterr().out)
    step = full["step"]
    assert knocked["knockout"] == ["cmp", "sel"] and "knockout" not in full
    assert json.loads((out / f"recall_step{step}_without_cmp_sel.json").read_text()) == knocked
    assert json.loads((out / f"recall_step{step}.json").read_text()) == full  # untouched
    loss = lambda r: [b["answer_loss"] for b in r["buckets"].values()]  # noqa: E731
    assert loss(knocked) != loss(full)
    # --n_sel: more picks than trained (3: all forced) at twice the length (8 blocks: free picks exist), its own file
    assert recall_main(["score", str(out), "--documents", "4", "--device", "cpu", "--lengths", "2"]) == 0
    trained = json.loads(capsys.readouterr().out)
    assert recall_main(["score", str(out), "--documents", "4", "--device", "cpu", "--lengths", "2", "--n_sel", "5"]) == 0
    more = json.loads(capsys.readouterr().out)
    assert more["n_sel"] == 5 and "n_sel" not in trained and loss(more) != loss(trained)
    assert json.loads((out / f"recall_step{step}_x2_nsel5.json").read_text()) == more
    assert recall_main(["score", str(out), "--documents", "4", "--device", "cpu", "--n_sel", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --n_sel: nsa.n_sel=2 must be >= 3") and "\n" not in err
    # --distance_cap: the selected branch's far keys at one trained distance; beyond every distance in the documents
    # it is the model as trained (to rounding), below them a different model; its own file; 0 refused in one line
    assert recall_main(["score", str(out), "--documents", "4", "--device", "cpu", "--lengths", "2",
                        "--distance_cap", "200"]) == 0
    uncapped = json.loads(capsys.readouterr().out)
    assert uncapped["distance_cap"] == 200
    for got, want in zip(loss(uncapped), loss(trained)):
        assert abs(got - want) <= 1e-4 * max(1.0, abs(want))
    assert recall_main(["score", str(out), "--documents", "4", "--device", "cpu", "--lengths", "2",
                        "--distance_cap", "8"]) == 0
    capped = json.loads(capsys.readouterr().out)
    assert loss(capped) != loss(trained)
    assert json.loads((out / f"recall_step{step}_x2_cap8.json").read_text()) == capped
    assert recall_main(["score", str(out), "--documents", "4", "--device", "cpu", "--distance_cap", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --distance_cap: the distance cap must be >= 1") and "\n" not in err


def test_answers_only_loss_mask_reaches_the_batches(tmp_path, capsys):
    """--loss_on answers (the default: no --loss_on here): each split's mask marks exactly the answers' tokens,
    the sampler turns every other target into IGNORE_INDEX, a run trains on it; a mask of the wrong size is
    refused in one line."""
    from nsa.loss import IGNORE_INDEX
    from train.data.memmap import MemmapStream
    from train.trainer.runner import run_training

    data = tmp_path / "recall"
    assert recall_main(["make", "--out", str(data), "--window", "8", "--seq_len", "32", "--max_windows", "3",
                        "--train_tokens", "20000", "--val_tokens", "2000"]) == 0
    meta = json.loads((data / "meta.json").read_text())
    info = meta["splits"]["train"]
    tokens = np.fromfile(data / "train.bin", dtype=np.uint16)
    mask = np.fromfile(data / info["loss_mask"], dtype=np.uint8)
    assert len(mask) == len(tokens) and int(mask.sum()) == info["loss_targets"] > 0
    marked = np.flatnonzero(mask)
    assert all(chr(tokens[i]) in VALUES and chr(tokens[i - 1]) == QUERY for i in marked)  # answers, nothing else
    queries = np.flatnonzero(tokens == ord(QUERY))
    assert len(queries) == len(marked)  # ... and every answer

    stream = MemmapStream(data / "train.bin", dtype=np.uint16, n_tokens=len(tokens), seq_len=31, batch_size=8, seed=3,
                          loss_mask=data / info["loss_mask"])
    x, y = stream.rows_batch(0, np.arange(8, dtype=np.uint64))
    kept = y != IGNORE_INDEX
    assert kept.any() and (x[kept] == ord(QUERY)).all()  # every kept target is predicted from a query's mark ...
    assert all(chr(v) in VALUES for v in y[kept].tolist())  # ... and is its answer
    assert kept.sum() == (x == ord(QUERY)).sum()  # every answer in the batch is kept

    out = tmp_path / "run"
    assert run_training(tiny_config(out, f"--data.source=bin:{data}", "--data.tokenizer=byte", "--train.steps=2")) == 0
    np.ones(10, np.uint8).tofile(data / info["loss_mask"])  # truncated: a mask that no longer fits its tokens
    capsys.readouterr()
    from train.__main__ import main as train_main

    run2 = tmp_path / "run2"
    code = train_main([f"--train.out_dir={run2}", f"--data.source=bin:{data}", "--data.tokenizer=byte",
                       "--runtime.device=cpu", "--model.dim=32", "--model.n_layers=1", "--model.n_heads=2",
                       "--model.n_kv_heads=1", "--model.vocab_size=320", "--train.seq_len=32"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "a loss mask of 10 bytes for" in err[0]
    assert not (run2 / "training.csv").exists()


def test_evaluate_scores_only_the_masked_targets(tmp_path, capsys):
    """train.evaluate on a split with a loss mask scores exactly the answers: its summed loss equals the model's
    own cross-entropy summed over those targets, computed here with explicit indices."""
    from train.checkpoint.io import model_from_checkpoint
    from train.evaluation.evaluate import EvalRequest, evaluate
    from train.trainer.runner import run_training

    data = tmp_path / "recall"
    assert recall_main(["make", "--out", str(data), "--window", "8", "--seq_len", "32", "--max_windows", "3",
                        "--train_tokens", "20000", "--val_tokens", "600", "--loss_on", "answers"]) == 0
    out = tmp_path / "run"
    assert run_training(tiny_config(out, f"--data.source=bin:{data}", "--data.tokenizer=byte", "--train.steps=2")) == 0
    result = evaluate(EvalRequest(checkpoint=out, data=f"bin:{data}", split="val", device="cpu"))
    tokens = torch.from_numpy(np.fromfile(data / "val.bin", dtype=np.uint16).astype(np.int64))
    mask = np.fromfile(data / "val.mask.bin", dtype=np.uint8)
    assert result["loss_mask"] is True and result["tokens"] == int(mask[1:].sum()) and result["bits_per_byte"] is None
    model, _ = model_from_checkpoint(out, "cpu")
    nll, n = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(tokens) - 1, 32):  # the same non-overlapping windows of seq_len 32
            x, y = tokens[start:start + 32], tokens[start + 1:start + 33]
            keep = torch.from_numpy(mask[start + 1:start + 1 + len(y)] == 1)
            logp = torch.log_softmax(model(x[None, :len(y)]).double(), -1)[0]
            nll -= logp[keep, y[keep]].sum().item()
            n += int(keep.sum())
    assert n == result["tokens"] and result["loss"] == pytest.approx(nll / n, rel=1e-5)


@pytest.fixture(scope="module")
def nsa_recall_run(tmp_path_factory) -> Path:
    """A tiny NSA model trained 2 steps on a recall corpus (window 8, seq_len 32), for the tools that read one."""
    from train.trainer.runner import run_training

    root = tmp_path_factory.mktemp("nsa_recall")
    data, out = root / "recall", root / "run"
    assert recall_main(["make", "--out", str(data), "--window", "8", "--seq_len", "32", "--max_windows", "3",
                        "--train_tokens", "20000", "--val_tokens", "2000"]) == 0
    nsa = ["--model.attention=nsa", "--nsa.l=8", "--nsa.d=4", "--nsa.l_sel=8", "--nsa.n_sel=3", "--nsa.w=8"]
    assert run_training(tiny_config(out, f"--data.source=bin:{data}", "--data.tokenizer=byte", "--train.steps=2",
                                    "--data.window_start=document", *nsa)) == 0
    return out


def test_the_long_context_demo_loads_a_trained_checkpoint_and_scores_it_at_its_length(nsa_recall_run):
    """scripts/demo_64k.py --checkpoint: the trained NSA model timed at S = 2x its training length, beside its recall
    probe at that length (the same file train.recall score --lengths 2 writes); a byte model takes no needle test."""
    out = nsa_recall_run
    proc = subprocess.run([sys.executable, "scripts/demo_64k.py", "--checkpoint", str(out), "--S", "64",
                           "--decode_steps", "2", "--prefill_tile", "32", "--device", "cpu", "--recall_documents", "4"],
                          cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["attention"] == "nsa" and result["training_length"] == 32 and "needle" not in result
    assert result["timing"]["decode_ms_per_step"] > 0 and result["recall"]["length_multiple"] == 2
    written = json.loads((out / "recall_step2_x2.json").read_text())
    assert result["recall"]["far_accuracy"] == written["far_accuracy"] and result["recall"]["file"] == written["file"]


def test_selection_hits_count_the_facts_block_among_the_picks(nsa_recall_run):
    """bench/selection_hits.py on a tiny NSA run: a fact inside the window lies in the query's own block or the one
    before, both always selected, so every layer hits it; far facts are counted per bucket at 1x and 2x."""
    out = nsa_recall_run
    proc = subprocess.run([sys.executable, "bench/selection_hits.py", str(out), "--lengths", "1", "2", "--documents", "4"],
                          cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    for multiple, doc_tokens in (("1", 31), ("2", 63)):
        at = result["lengths"][multiple]
        assert at["doc_tokens"] == doc_tokens and set(at["by_layer"]) == {"layer0", "layer1"}
        for buckets in at["by_layer"].values():
            assert buckets["<1w"]["any_head"] == 1.0 and buckets["<1w"]["forced_share"] == 1.0
            assert all(0.0 <= b["any_head"] <= 1.0 and b["items"] > 0 for b in buckets.values())
    assert "4-8w" in result["lengths"]["2"]["by_layer"]["layer1"]  # the longer document's new bucket


def test_pick_coherence_reads_a_run_and_counts_unions_that_grow_with_the_tile(nsa_recall_run, tmp_path):
    """bench/pick_coherence.py on a tiny NSA run (l' = 8, n = 3): per layer and length, one query's union is its own
    picks, a tile's union grows with the tile and never exceeds Q times the picks; the trained and initial models both."""
    out, report = nsa_recall_run, tmp_path / "coherence.json"
    proc = subprocess.run([sys.executable, "bench/pick_coherence.py", str(out), "--T", "32", "64", "--tiles", "1", "2", "4",
                           "--windows", "2", "--out", str(report)],
                          cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(report.read_text())
    assert result["train_seq_len"] == 32 and result["config"]["nsa"]["n_sel"] == 3
    for kind in ("trained", "initial"):
        rows = result[kind]["rows"]
        assert {(r["T"], r["layer"], r["Q"]) for r in rows} == {(T, layer, Q) for T in (32, 64) for layer in (0, 1)
                                                               for Q in (1, 2, 4)}
        for r in rows:  # picks <= n: a query early in its document (the recall corpus packs documents) has fewer
            assert 0 < r["picks"] <= 3 and r["picks"] <= r["union"] <= r["Q"] * r["picks"]
            assert r["union"] == r["picks"] or r["Q"] > 1
        for T in (32, 64):
            for layer in (0, 1):
                unions = [r["union"] for r in rows if r["T"] == T and r["layer"] == layer]
                assert unions == sorted(unions)


def test_indexer_target_position_reads_an_indexer_run_and_refuses_one_without(nsa_recall_run, tmp_path):
    """bench/indexer_target_position.py: per layer, KL(target || .) of the run's indexer, of a position-only predictor
    and of uniform scores (each >= 0; a KL to uniform is at most log of the candidates); a run without an indexer is
    refused in one line."""
    from train.trainer.runner import run_training

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "bench/indexer_target_position.py"]
    proc = subprocess.run([*cmd, str(nsa_recall_run), "--documents", "4"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode != 0 and proc.stderr.strip().splitlines()[-1] == (
        "error: the checkpoint has no NSA layer with an indexer (nsa.selector=indexer)")
    data = nsa_recall_run.parent / "recall"
    out = tmp_path / "indexer_run"
    nsa = ["--model.attention=nsa", "--nsa.l=8", "--nsa.d=4", "--nsa.l_sel=8", "--nsa.n_sel=3", "--nsa.w=8",
           "--nsa.selector=indexer", "--nsa.indexer_pool=scores"]
    assert run_training(tiny_config(out, f"--data.source=bin:{data}", "--data.tokenizer=byte", "--train.steps=2",
                                    "--data.window_start=document", *nsa)) == 0
    proc = subprocess.run([*cmd, str(out), "--documents", "4", "--out", str(tmp_path / "kl.json")], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "kl.json").read_text())
    assert set(result["layers"]) == {"layer0", "layer1"} and result["documents"] == 4
    for kl in result["layers"].values():
        assert set(kl) == {"indexer", "position", "uniform"}
        assert all(0.0 <= v < math.log(64) for v in kl.values()), kl
