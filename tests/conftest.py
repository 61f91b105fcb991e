"""Shared fixtures. Tests may read ../shared (corpus, GPT-2 BPE files); the product never does."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


@pytest.fixture(scope="session")
def repo_dir() -> Path:
    return REPO


@pytest.fixture(scope="session")
def corpus_path() -> Path:
    path = SHARED / "corpus" / "kjv.txt"
    if not path.exists():
        pytest.fail(f"test corpus missing: {path} (../shared must sit beside the repo)")
    return path


@pytest.fixture(autouse=True)
def _deterministic_torch():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def kjv_bin(tmp_path_factory, corpus_path) -> Path:
    """The corpus as a prepared bin: dataset (byte tokenizer, vocab 257), paragraphs as documents,
    5% held out by hash into val.bin. Built once per session through the product's own prepare."""
    from train.data.preparation import prepare

    out = tmp_path_factory.mktemp("kjv_bin") / "kjv_byte"
    prepare(f"text:{corpus_path}", "byte", out, val_fraction=0.05, workers=1, text_sample_by="paragraph")
    return out


@pytest.fixture(scope="session")
def kjv_gpt2(tmp_path_factory, corpus_path) -> Path:
    """The first 400 paragraphs of the corpus in GPT-2 tokens (a word-level tokenizer, for the needle test)."""
    from train.data.preparation import prepare

    out = tmp_path_factory.mktemp("kjv_gpt2") / "kjv_gpt2"
    prepare(f"text:{corpus_path}", "gpt2", out, val_fraction=0.05, workers=1, text_sample_by="paragraph", max_docs=400)
    return out
