"""One text file (the nanoGPT habit) gets a usable held-out split by default: its contiguous tail; many
documents stay whole. An empty source writes nothing final, and verify flags an empty val split."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from train.data.preparation import prepare
from train.data.sharded_preparation import prepare_sharded

REPO = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def tokens(out: Path, split: str) -> np.ndarray:
    meta = json.loads((out / "meta.json").read_text())
    return np.fromfile(out / meta["splits"][split]["file"], dtype=meta["dtype"])


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_one_text_file_holds_out_its_tail_by_default(tmp_path, corpus_path):
    out = tmp_path / "kjv"
    res = run("train.data.prepare", "--source", f"text:{corpus_path}", "--out", str(out), "--tokenizer", "byte",
              "--workers", "1")
    assert res.returncode == 0, res.stderr
    train, val = tokens(out, "train"), tokens(out, "val")
    n = len(train) + len(val)
    assert len(val) == -(-n * 5 // 1000)  # ceil(0.5%) of the document's tokens, the default val_fraction
    whole = np.frombuffer(corpus_path.read_bytes(), dtype=np.uint8)  # byte tokenizer: id = byte, then EOS
    assert np.array_equal(np.concatenate([train, val])[:-1], whole)  # head + tail = the file, in order
    meta = json.loads((out / "meta.json").read_text())
    assert meta["splits"]["val"]["text_bytes"] == len(val) - 1  # the tail's bytes (bits per byte), EOS excluded
    assert meta["splits"]["train"]["text_bytes"] == len(train)
    assert meta["val_split"] == f"one document: its last 0.50% ({len(val):,} tokens) held out as val.bin (a contiguous tail)"
    assert f"note: {meta['val_split']}" in res.stdout and "warning" not in res.stderr
    assert run("train.data.verify", str(out)).returncode == 0


def test_a_small_file_still_holds_out_a_few_windows(tmp_path, corpus_path):
    """0.5% of 20,000 tokens would be 100 tokens, less than one window of most configs: the tail takes 10%."""
    text = tmp_path / "small.txt"
    text.write_bytes(corpus_path.read_bytes()[:19_999])  # ASCII: 19,999 byte tokens + EOS
    meta = prepare(f"text:{text}", "byte", tmp_path / "out", workers=1)
    assert meta["splits"]["val"]["tokens"] == 2_000 and meta["splits"]["train"]["tokens"] == 18_000
    assert meta["val_split"].startswith("one document: its last 10.00% (2,000 tokens)")


def test_many_documents_stay_whole(tmp_path):
    texts = tmp_path / "docs"
    texts.mkdir()
    for i in range(400):
        (texts / f"d{i:03d}.txt").write_text(f"document {i:03d} " * 20)
    meta = prepare(f"text:{texts}/*.txt", "byte", tmp_path / "out", val_fraction=0.05, workers=1)
    assert "val_split" not in meta and meta["splits"]["val"]["documents"] > 0
    assert meta["splits"]["val"]["tokens"] == meta["splits"]["val"]["documents"] * (len("document 000 ") * 20 + 1)


def test_sharded_prepare_of_one_file_holds_out_the_same_tail(tmp_path, corpus_path):
    text = tmp_path / "book.txt"
    text.write_bytes(corpus_path.read_bytes()[:30_000])
    one_shot = prepare(f"text:{text}", "byte", tmp_path / "one", workers=1)
    sharded = prepare_sharded(f"text:{text}", "byte", tmp_path / "sharded", n_shards=1)
    for name in ("train.bin", "val.bin"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "sharded" / name).read_bytes(), name
    assert sharded["splits"] == one_shot["splits"] and sharded["val_split"] == one_shot["val_split"]


def test_an_empty_source_is_one_line_and_leaves_no_final_files(tmp_path):
    for name, content in (("empty.txt", ""), ("blank.txt", "  \n\n \t\n")):
        (tmp_path / name).write_text(content)
        source, out = f"text:{tmp_path / name}", tmp_path / f"out_{name}"
        for tool in ("train.data.prepare", "train.data.prepare_sharded"):
            res = run(tool, "--source", source, "--out", str(out), "--tokenizer", "gpt2", "--workers", "1",
                      *(["--shards", "1"] if tool.endswith("sharded") else []))
            assert not (out / "train.bin").exists() and not (out / "val.bin").exists(), (tool, name)
            assert res.returncode == 2, (tool, name, res.stdout, res.stderr)
            assert res.stderr.strip().splitlines()[-1] == (f"error: {source}: no text was read (empty or whitespace-only "
                                                          f"files); nothing to train on, nothing written")
        assert not (out / "meta.json").exists()


def test_an_empty_source_keeps_what_the_directory_held(tmp_path, corpus_path):
    """--overwrite replaces a prepared dataset only once there is data to replace it with."""
    text, empty = tmp_path / "book.txt", tmp_path / "empty.txt"
    text.write_bytes(corpus_path.read_bytes()[:30_000])
    empty.write_text("")
    out = tmp_path / "out"
    prepare(f"text:{text}", "byte", out, workers=1)
    before = snapshot(out)
    res = run("train.data.prepare", "--source", f"text:{empty}", "--out", str(out), "--tokenizer", "byte",
              "--workers", "1", "--overwrite")
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1].startswith("error: ")
    assert snapshot(out) == before  # meta.json, train.bin and val.bin untouched, no *.partial left
    assert run("train.data.verify", str(out)).returncode == 0


def test_verify_flags_an_empty_val_split(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(3):
        (docs / f"d{i}.txt").write_text(f"text {i}")
    out = tmp_path / "out"
    meta = prepare(f"text:{docs}/*.txt", "byte", out, val_fraction=0.001, workers=1)  # 3 documents: none held out
    assert meta["splits"]["val"]["tokens"] == 0
    res = run("train.data.verify", str(out))
    assert res.returncode == 1
    assert res.stdout.strip() == (f"{out / 'val.bin'}: the val split is empty (0 tokens): evaluation would have "
                                  f"nothing to score; prepare again (one file: its tail is held out)")
