"""Data mixtures (data.mixture, data.stages; train/core/mixture.py, train/data/mixture.py): the realised share of each
source, the world-size-free order, a mixture of one equal to data.source, stages, exact resume, per-source
validation, and every bad input refused in one line before anything is written."""
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

from train.core.config import data_mixture, load_config
from train.core.errors import ConfigError, DataError
from train.data.build import build_data
from train.data.meta import FORMAT, FORMAT_VERSION

REPO = Path(__file__).resolve().parents[2]
T = 16
BASES = {"web": 0, "code": 30_000, "math": 60_000}  # each source's ids: base + position, so a row names its source
SPAN = 20_000


def index_dir(path: Path, base: int, n_train: int = SPAN, n_val: int = 3000, tokenizer: str = "byte") -> Path:
    """A bin: directory whose train token at position i is base + i (val: base + SPAN // 2 + i... kept in range)."""
    path.mkdir(parents=True)
    (base + np.arange(n_train, dtype=np.uint32)).tofile(path / "train.bin")
    (base + np.arange(n_val, dtype=np.uint32)).tofile(path / "val.bin")
    splits = {"train": {"file": "train.bin", "tokens": n_train},
              "val": {"file": "val.bin", "tokens": n_val, "text_bytes": 2 * n_val}}
    (path / "meta.json").write_text(json.dumps({"format": FORMAT, "version": FORMAT_VERSION, "tokenizer": tokenizer,
                                                "eos_id": None, "vocab_size": 100_000, "dtype": "uint32",
                                                "max_token_id": 99_999, "splits": splits}))
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mix")
    return {name: index_dir(root / name, base) for name, base in BASES.items()}


def mixture_args(dirs, weights: dict[str, float], stages: str | None = None, steps: int = 1000) -> list[str]:
    entries = ", ".join(f"{{name: {n}, source: 'bin:{dirs[n]}', weight: {w}}}" for n, w in weights.items())
    args = ["--data.tokenizer=byte", "--model.vocab_size=100032", f"--train.steps={steps}", f"--data.mixture=[{entries}]"]
    return args + ([f"--data.stages={stages}"] if stages else [])


def bundle(cfg, batch_size=8, world_size=1, rank=0, accumulate=1, seed=5):
    return build_data(cfg.data, seq_len=T, batch_size=batch_size, vocab_size=cfg.model.vocab_size, seed=seed,
                      rank=rank, world_size=world_size, accumulate=accumulate, mixture=data_mixture(cfg))


def source_of_rows(x: torch.Tensor) -> list[str]:
    """Which source each row came from, read from its tokens (each source's ids lie in [base, base + SPAN))."""
    names = []
    for first in x[:, 0].tolist():
        names.append(next(n for n, b in BASES.items() if b <= first < b + SPAN))
    return names


def test_the_realised_share_after_1000_steps_is_within_three_standard_errors_of_each_weight(dirs):
    weights = {"web": 0.6, "code": 0.3, "math": 0.1}
    data = bundle(load_config(None, mixture_args(dirs, weights)))
    seen = {n: 0 for n in weights}
    for step in range(1000):
        x, y = data.train.next_batch()
        rows = source_of_rows(x)
        if step < 20:  # the mechanism: the rows really come from the source the sampler chose for them
            chosen = data.train.sources_of(step, np.arange(8, dtype=np.uint64))
            assert rows == [data.mixture.names[j] for j in chosen]
            assert torch.equal(x[:, 1:], y[:, :-1])
        for name in rows:
            seen[name] += 1
    n = 8 * 1000
    for name, w in weights.items():
        assert abs(seen[name] / n - w) < 3 * math.sqrt(w * (1 - w) / n), (name, seen[name] / n)
    assert data.rows_per_source() == seen  # the rows counted from the order are the rows the batches held


def test_a_mixture_of_one_gives_exactly_the_batches_of_data_source(dirs):
    alone = load_config(None, ["--data.tokenizer=byte", "--model.vocab_size=100032", f"--data.source=bin:{dirs['web']}"])
    one = load_config(None, mixture_args(dirs, {"web": 1.0}))
    a, b = bundle(alone), bundle(one)
    for _ in range(5):
        xa, ya = a.train.next_batch()
        xb, yb = b.train.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert all(torch.equal(p, q) for (p, _), (q, _) in zip(a.val_batches(3), b.val_batches(3)))
    assert b.val_names == ("data",) and b.rows_per_source() == {}
    assert a.train.state_dict() == b.train.state_dict()


@pytest.mark.parametrize("split", [(4, 2, 1), (2, 2, 2), (1, 4, 2)])  # batch_size, ranks, accumulate: global batch 8
def test_the_global_batches_are_the_same_on_any_world_size_and_split_across_a_stage(dirs, split):
    args = mixture_args(dirs, {"web": 0.5, "code": 0.3, "math": 0.2}, "[{at: 3, weights: {math: 1}}]", steps=10)
    cfg = load_config(None, args)
    reference = bundle(cfg)
    batch_size, ranks, accumulate = split
    parts = [bundle(cfg, batch_size, ranks, r, accumulate) for r in range(ranks)]
    for step in range(6):
        want = reference.train.next_batch()[0]
        got = [[p.train.next_batch()[0] for p in parts] for _ in range(accumulate)]
        assert torch.equal(torch.cat([x for micro in got for x in micro]), want), step
        if step >= 3:
            assert set(source_of_rows(want)) == {"math"}


def test_a_stage_changes_the_weights_from_its_first_step_and_resume_across_it_is_exact(dirs):
    cfg = load_config(None, mixture_args(dirs, {"web": 1, "code": 1}, "[{at: 50, weights: {code: 1}}]", steps=100))
    data = bundle(cfg)
    before = [source_of_rows(data.train.next_batch()[0]) for _ in range(50)]
    assert {n for rows in before for n in rows} == {"web", "code"}
    state = data.train.state_dict()  # at step 50, the stage's first
    after = [data.train.next_batch()[0] for _ in range(10)]
    assert all(set(source_of_rows(x)) == {"code"} for x in after)
    resumed = bundle(cfg)
    resumed.train.load_state_dict(state)
    assert all(torch.equal(resumed.train.next_batch()[0], x) for x in after)
    assert resumed.rows_per_source() == data.rows_per_source()  # counted again from the order itself: the same


def test_a_state_saved_under_another_mixture_is_refused_in_one_line(dirs):
    cfg = load_config(None, mixture_args(dirs, {"web": 1, "code": 1}))
    data = bundle(cfg)
    data.train.next_batch()
    state = data.train.state_dict()
    for changed in (mixture_args(dirs, {"web": 2, "code": 1}), mixture_args(dirs, {"web": 1, "math": 1})):
        other = bundle(load_config(None, changed))
        with pytest.raises(DataError) as err:
            other.train.load_state_dict(state)
        assert "\n" not in str(err.value) and "another data mixture" in str(err.value)
        assert "data.restart_on_change=true" in str(err.value)


def test_validation_is_per_source_with_bits_per_byte(dirs):
    data = bundle(load_config(None, mixture_args(dirs, {"web": 1, "code": 1})))
    assert data.val_names == ("web", "code")
    x, _ = data.val_batches(1, "code")[0]
    assert set(source_of_rows(x)) == {"code"}
    assert data.val_bytes_per_token("code") == 2.0  # meta.json: text_bytes 2 per token


EOS = 99_999


def test_each_source_keeps_its_loss_mask_and_document_starts_in_a_mixture(dirs, tmp_path):
    """Rows of a masked source drop exactly its masked targets; rows of a window_start=document source open at a
    document; synthetic rows are the synthetic source's own; the rest of the batch is untouched by either."""
    masked = index_dir(tmp_path / "masked", BASES["code"])
    keep = (np.arange(SPAN) % 3 != 0).astype(np.uint8)  # every third token is not a target
    keep.tofile(masked / "train.mask")
    meta = json.loads((masked / "meta.json").read_text())
    meta["splits"]["train"]["loss_mask"] = "train.mask"
    (masked / "meta.json").write_text(json.dumps(meta))
    docs = index_dir(tmp_path / "docs", BASES["web"])
    tokens = BASES["web"] + np.arange(SPAN, dtype=np.uint32)
    tokens[np.arange(SPAN) % 97 == 96] = EOS  # a document every 97 tokens
    tokens.tofile(docs / "train.bin")
    meta = json.loads((docs / "meta.json").read_text())
    meta["eos_id"] = EOS
    (docs / "meta.json").write_text(json.dumps(meta))
    entries = (f"[{{name: web, source: 'bin:{docs}', weight: 1, window_start: document}}, "
               f"{{name: code, source: 'bin:{masked}', weight: 1}}, {{name: syn, source: synthetic, weight: 1}}]")
    args = ["--data.tokenizer=byte", "--model.vocab_size=100032", "--train.steps=100", f"--data.mixture={entries}"]
    data = bundle(load_config(None, args))
    seen = set()
    for step in range(40):  # crosses a block of planned steps
        x, y = data.train.next_batch()
        chosen = data.train.sources_of(step, np.arange(8, dtype=np.uint64))
        for row, j in enumerate(chosen):
            name = data.mixture.names[j]
            seen.add(name)
            first = int(x[row, 0])
            if name == "web":
                start = first - BASES["web"]
                assert start % 97 == 0, start  # the file's start or the token after an EOS
                assert torch.equal(x[row], torch.from_numpy(tokens[start:start + T].astype(np.int64)))
                assert torch.equal(y[row], torch.from_numpy(tokens[start + 1:start + T + 1].astype(np.int64)))
            elif name == "code":
                start = first - BASES["code"]
                want = torch.arange(start + 1, start + T + 1) + BASES["code"]
                want[torch.from_numpy(keep[start + 1:start + T + 1] == 0)] = -100  # IGNORE_INDEX
                assert torch.equal(x[row], torch.arange(start, start + T) + BASES["code"])
                assert torch.equal(y[row], want)
            else:
                assert torch.equal(x[row, 1:], y[row, :-1]) and not bool(((x[row, 1:] - x[row, :-1]) == 1).all())
    assert seen == {"web", "code", "syn"}


BAD = [
    ("weights that sum to zero", {"web": 0, "code": 0}, None, "weights sum to 0"),
    ("a negative weight", {"web": 1, "code": -1}, None, "data.mixture[1].weight must be >= 0"),
    ("an unknown source in a stage", {"web": 1, "code": 1}, "[{at: 5, weights: {cod: 1}}]", "unknown source 'cod'"),
    ("a stage past the run", {"web": 1, "code": 1}, "[{at: 1000, weights: {code: 1}}]", "lies outside the run"),
    ("a stage at decay without a decay", {"web": 1, "code": 1}, "[{at: decay, weights: {code: 1}}]",
     "needs train.lr_schedule=wsd"),
]


@pytest.mark.parametrize("what, weights, stages, words", BAD, ids=[b[0] for b in BAD])
def test_bad_mixtures_are_one_line_config_errors(dirs, what, weights, stages, words):
    with pytest.raises(ConfigError) as err:
        load_config(None, mixture_args(dirs, weights, stages, steps=100))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_stage_at_decay_begins_with_the_wsd_decay(dirs):
    cfg = load_config(None, [*mixture_args(dirs, {"web": 1, "code": 1}, "[{at: decay, weights: {code: 1}}]", steps=100),
                             "--train.lr_schedule=wsd", "--train.decay_fraction=0.2", "--train.warmup_steps=5"])
    assert [st.start for st in data_mixture(cfg).stages] == [0, 80]


def launch(out: Path, args: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "train", "--model.n_layers=1", "--model.dim=32", "--model.n_heads=2",
           "--train.seq_len=16", "--train.batch_size=2", "--train.eval_every=0", "--runtime.device=cpu",
           "--runtime.threads=1", f"--train.out_dir={out}", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)


def test_sources_of_two_tokenizers_or_too_many_epochs_are_refused_alike_by_launch_preflight_and_start_checks(
        dirs, tmp_path):
    from train.trainer.start_checks import start_checks
    from train.workflows.preflight import run_preflight

    gpt2_dir = index_dir(tmp_path / "gpt2", 0, tokenizer="gpt2")
    two_tokenizers = ["--data.tokenizer=byte", "--model.vocab_size=100032", "--train.steps=10",
                      f"--data.mixture=[{{name: a, source: 'bin:{dirs['web']}', weight: 1}}, "
                      f"{{name: b, source: 'bin:{gpt2_dir}', weight: 1}}]"]
    small = index_dir(tmp_path / "small", 0, n_train=200)
    too_many_epochs = ["--data.tokenizer=byte", "--model.vocab_size=100032", "--train.steps=10",
                       f"--data.mixture=[{{name: a, source: 'bin:{dirs['web']}', weight: 1}}, "
                       f"{{name: small, source: 'bin:{small}', weight: 1, max_epochs: 0.5}}]"]
    for args, words in ((two_tokenizers, "was prepared with tokenizer gpt2"), (too_many_epochs, "max_epochs=0.5")):
        out = tmp_path / "out"
        proc = launch(out, args)
        assert proc.returncode == 2, proc.stderr[-2000:]
        line = next(line for line in proc.stderr.splitlines() if words in line)
        assert not out.exists()
        cfg = load_config(None, [*args, f"--train.out_dir={out}", "--train.batch_size=2", "--train.seq_len=16"])
        with pytest.raises(Exception) as err:
            start_checks(cfg, 1)
        assert str(err.value) in line
        report = run_preflight(cfg, gpus=1, free_bytes=lambda p: 10**15,
                               env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, cuda=False)
        assert any(f.detail == str(err.value) for f in report.failures), report.render()
        assert not out.exists()


# ---- a stream source in the mixture ------------------------------------------------------------------------------

def stream_mixture_args(dirs, jsonl_dir: Path, steps: int = 100) -> list[str]:
    return ["--data.tokenizer=byte", "--model.vocab_size=100032", f"--train.steps={steps}",
            f"--data.mixture=[{{name: kjv, source: 'jsonl:{jsonl_dir}/*.jsonl', weight: 1}}, "
            f"{{name: code, source: 'bin:{dirs['code']}', weight: 1}}]", "--data.tokenize_batch_docs=4",
            "--data.val_fraction=0.2"]  # 40 chapters: a fifth held out for validation


def test_a_stream_source_fills_its_rows_in_reading_order_and_resumes_exactly(dirs, docs, tmp_path):
    from tests.data.conftest import write_jsonl
    from train.data.build import train_state_refusal

    write_jsonl(tmp_path / "kjv", docs, n_files=2)
    cfg = load_config(None, stream_mixture_args(dirs, tmp_path / "kjv"))
    data = bundle(cfg, batch_size=4)
    assert not data.train.any_world_size and data.val_names == ("kjv", "code")
    for step in range(10):
        x, _ = data.train.next_batch()
        chosen = data.train.sources_of(step, np.arange(4, dtype=np.uint64))
        for row, j in zip(x, chosen):  # byte tokens (< 257) from the stream, ids >= 30,000 from the bin: directory
            assert (int(row.max()) < 257) == (data.mixture.names[j] == "kjv")
    state = data.train.state_dict()
    assert set(state["streams"]) == {"kjv"} and state["step"] == 10
    after = [data.train.next_batch() for _ in range(10)]
    resumed = bundle(cfg, batch_size=4)
    resumed.train.load_state_dict(state)
    for (x, y), (rx, ry) in zip(after, (resumed.train.next_batch() for _ in range(10))):
        assert torch.equal(x, rx) and torch.equal(y, ry)
    # its validation: the stream's hashed-out documents
    vx, _ = data.val_batches(1, "kjv")[0]
    assert int(vx.max()) < 257
    # another world size: the stream's one-line refusal, as a stream alone gives
    refusal = train_state_refusal(cfg.data, [state], seq_len=T, batch_size=2, vocab_size=100032, seed=5,
                                  world_size=2, saved_num_workers=0, checkpoint="ck.pt", mixture=data_mixture(cfg))
    assert refusal and "was written by 1 rank(s)" in refusal and "\n" not in refusal
    assert train_state_refusal(cfg.data, [state], seq_len=T, batch_size=4, vocab_size=100032, seed=5, world_size=1,
                               saved_num_workers=0, checkpoint="ck.pt", mixture=data_mixture(cfg)) is None
    for bundle_ in (data, resumed):
        bundle_.close()


def test_stream_sources_refuse_max_epochs_and_bin_sources_refuse_a_val_source(dirs, tmp_path):
    bad = [
        (f"[{{name: a, source: 'jsonl:{tmp_path}/*.jsonl', weight: 1, max_epochs: 2}}]", "max_epochs needs a bin: source"),
        (f"[{{name: a, source: 'bin:{dirs['web']}', weight: 1, val_source: 'jsonl:x.jsonl'}}]",
         "validates on its own val split"),
        (f"[{{name: a, source: 'jsonl:{tmp_path}/*.jsonl', weight: 1, val_source: 'bin:{dirs['web']}'}}]",
         "val_source must be a stream source"),
    ]
    for mixture, words in bad:
        with pytest.raises(ConfigError, match=words):
            load_config(None, ["--data.tokenizer=byte", f"--data.mixture={mixture}"])
