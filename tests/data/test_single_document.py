"""One text file (the nanoGPT habit) gets a usable held-out split by default: its contiguous tail; many
documents stay whole. An empty source writes nothing final, and verify flags an empty val split."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from train.data.prepare import prepare

REPO = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def tokens(out: Path, split: str) -> np.ndarray:
    meta = json.loads((out / "meta.json").read_text())
    return np.fromfile(out / meta["splits"][split]["file"], dtype=meta["dtype"])


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
    assert meta["val_split"] == f"one document: its last 0.50% ({len(val):,} tokens) held out as val.bin (a contiguous tail)"
    assert f"note: {meta['val_split']}" in res.stdout and "warning" not in res.stderr
    assert run("train.data.verify", str(out)).returncode == 0


def test_many_documents_stay_whole(tmp_path):
    texts = tmp_path / "docs"
    texts.mkdir()
    for i in range(400):
        (texts / f"d{i:03d}.txt").write_text(f"document {i:03d} " * 20)
    meta = prepare(f"text:{texts}/*.txt", "byte", tmp_path / "out", val_fraction=0.05, workers=1)
    assert "val_split" not in meta and meta["splits"]["val"]["documents"] > 0
    assert meta["splits"]["val"]["tokens"] == meta["splits"]["val"]["documents"] * (len("document 000 ") * 20 + 1)


def test_an_empty_source_is_one_line_and_leaves_no_final_files(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    out = tmp_path / "out"
    res = run("train.data.prepare", "--source", f"text:{tmp_path / 'empty.txt'}", "--out", str(out), "--tokenizer", "byte",
              "--workers", "1")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1] == (f"error: text:{tmp_path / 'empty.txt'}: no text was read (empty "
                                                  f"files?); nothing to train on, nothing written")
    assert not out.exists() or not list(out.iterdir())


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
