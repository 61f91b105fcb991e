"""Sharded prepare: interrupted and resumed, it equals a one-shot prepare byte for byte."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from train.data.preparation import prepare
from train.data.prepare_sharded import main
from train.data.sharded_preparation import prepare_sharded, shard_ranges
from train.data.verification import verify
from train.core.errors import DataError

N_FILES, PARAGRAPHS = 5, 400


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, corpus_path) -> str:
    """The first PARAGRAPHS paragraphs of the KJV corpus spread over N_FILES text files."""
    paragraphs = corpus_path.read_text(encoding="utf-8").split("\n\n")[:PARAGRAPHS]
    root = tmp_path_factory.mktemp("sharded_corpus")
    for i in range(N_FILES):
        part = paragraphs[i * PARAGRAPHS // N_FILES:(i + 1) * PARAGRAPHS // N_FILES]
        (root / f"part{i}.txt").write_text("\n\n".join(part), encoding="utf-8")
    return f"text:{root}/part*.txt"


OPTS = dict(val_fraction=0.1, text_sample_by="paragraph")


@pytest.fixture(scope="module")
def one_shot(tmp_path_factory, corpus) -> Path:
    out = tmp_path_factory.mktemp("one_shot") / "data"
    prepare(corpus, "byte", out, workers=1, **OPTS)
    return out


def assert_same_dataset(a: Path, b: Path) -> None:
    for name in ("train.bin", "val.bin"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    meta_a, meta_b = json.loads((a / "meta.json").read_text()), json.loads((b / "meta.json").read_text())
    assert meta_a.keys() == meta_b.keys()  # the same schema as prepare's meta.json
    assert {k: v for k, v in meta_a.items() if k not in ("seconds", "created")} == \
           {k: v for k, v in meta_b.items() if k not in ("seconds", "created")}
    assert verify(b) == []


def test_shard_ranges_cover_the_files_in_order():
    assert shard_ranges(5, 3) == [(0, 1), (1, 3), (3, 5)]
    assert shard_ranges(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_interrupted_then_resumed_equals_one_shot(tmp_path, corpus, one_shot, capsys):
    out = tmp_path / "sharded"
    assert prepare_sharded(corpus, "byte", out, n_shards=3, max_shards=2, **OPTS) is None  # "interrupted"
    shards = out / "shards"
    assert sorted(p.name for p in shards.glob("*.done.json")) == ["shard_0.done.json", "shard_1.done.json"]
    assert not (out / "meta.json").exists() and not (out / "train.bin").exists()
    (shards / "shard_0.done.json").unlink()  # a lost marker: shard 0 is redone
    kept = (shards / "shard_1.done.json").stat().st_mtime_ns
    meta = prepare_sharded(corpus, "byte", out, n_shards=3, keep_shards=True, **OPTS)
    assert meta is not None
    assert (shards / "shard_1.done.json").stat().st_mtime_ns == kept  # completed shard skipped
    assert "1 of 3 shards already done" in capsys.readouterr().err
    assert_same_dataset(one_shot, out)
    manifest = json.loads((out / "manifest.json").read_text())
    assert [s["data_files"] for s in manifest["shards"]] == [[0, 1], [1, 3], [3, 5]]
    assert [Path(f).name for f in manifest["shards"][1]["files"]] == ["part1.txt", "part2.txt"]
    assert sum(s["train"]["tokens"] for s in manifest["shards"]) == meta["splits"]["train"]["tokens"]
    assert (shards / "shard_2.train.bin").exists()  # --keep-shards


def test_truncated_shard_is_redone_and_parallel_workers(tmp_path, corpus, one_shot):
    out = tmp_path / "sharded"
    assert prepare_sharded(corpus, "byte", out, n_shards=4, workers=2, max_shards=3, **OPTS) is None
    shard = out / "shards" / "shard_1.train.bin"
    shard.write_bytes(shard.read_bytes()[:-2])  # the marker stays, the file no longer matches it
    assert prepare_sharded(corpus, "byte", out, n_shards=4, workers=2, **OPTS) is not None
    assert_same_dataset(one_shot, out)
    assert not shard.exists()  # shard files are removed after the join by default


def test_refusals(tmp_path, corpus):
    out = tmp_path / "sharded"
    with pytest.raises(DataError, match="exceeds the source's 5 data file"):
        prepare_sharded(corpus, "byte", out, n_shards=6, **OPTS)
    prepare_sharded(corpus, "byte", out, n_shards=2, max_shards=1, **OPTS)
    with pytest.raises(DataError, match="started with other settings"):
        prepare_sharded(corpus, "byte", out, n_shards=2, split_seed=1, **OPTS)
    prepare_sharded(corpus, "byte", out, n_shards=2, **OPTS)
    with pytest.raises(DataError, match="already holds a prepared dataset"):
        prepare_sharded(corpus, "byte", out, n_shards=2, **OPTS)


def test_cli(tmp_path, corpus, one_shot, capsys):
    out = tmp_path / "cli"
    args = ["--source", corpus, "--tokenizer", "byte", "--out", str(out), "--shards", "5", "--workers", "1",
            "--val-fraction", "0.1", "--text-sample-by", "paragraph"]
    assert main(args) == 0
    assert capsys.readouterr().out.startswith(f"ok {out}: train ")
    assert_same_dataset(one_shot, out)
    assert main(args) == 2
    assert capsys.readouterr().err.startswith("error: ")
