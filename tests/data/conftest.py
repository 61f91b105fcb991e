"""Data-test fixtures: real English documents (KJV chapters, each starting with a unique heading)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from train.data.tokenizers import load_tokenizer


@pytest.fixture(scope="session")
def chapters(corpus_path) -> list[str]:
    """Every chapter as one document: 'Book N\\n<verses>'; the heading line is unique."""
    parts = corpus_path.read_text(encoding="utf-8").split("\n\n")
    return [f"{heading}\n{body}" for heading, body in zip(parts[0::2], parts[1::2])]


@pytest.fixture(scope="session")
def docs(chapters) -> list[str]:
    """A small slice (Genesis) to keep tests fast."""
    return chapters[:40]


@pytest.fixture(scope="session")
def gpt2():
    return load_tokenizer("gpt2")


def heading(doc: str) -> str:
    return doc.split("\n", 1)[0]


def write_jsonl(dir_: Path, docs: list[str], n_files: int) -> str:
    """Docs dealt round-robin into n_files jsonl files; returns the jsonl: source string."""
    dir_.mkdir(parents=True, exist_ok=True)
    for f in range(n_files):
        with open(dir_ / f"part{f:02d}.jsonl", "w", encoding="utf-8") as out:
            for doc in docs[f::n_files]:
                out.write(json.dumps({"text": doc, "n": len(doc)}) + "\n")
    return f"jsonl:{dir_}/*.jsonl"


def write_texts(dir_: Path, docs: list[str]) -> str:
    """One document per file; returns the text: source string."""
    dir_.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(docs):
        (dir_ / f"doc{i:03d}.txt").write_text(doc, encoding="utf-8")
    return f"text:{dir_}/*.txt"


def write_parquet(dir_: Path, docs: list[str], n_files: int) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    dir_.mkdir(parents=True, exist_ok=True)
    for f in range(n_files):
        pq.write_table(pa.table({"text": docs[f::n_files]}), dir_ / f"part{f:02d}.parquet")
    return f"parquet:{dir_}/*.parquet"
