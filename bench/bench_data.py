"""Data pipeline throughput on CPU; prints one JSON object.

    PYTHONPATH=. python bench/bench_data.py [--corpus ../shared/corpus/kjv.txt] [--seconds 2]

- tokenize_tokens_per_s: gpt2 encode_batch over the corpus split into documents (one process)
- prepare_mb_per_s: python -m train.data.prepare end to end (read, tokenize, hash split, write, sha256), per worker count
- stream_tokens_per_s: a text: source through build_data -> next_batch (tokenize + pack, in-process)
- sample_tokens_per_s: bin: random-offset batches from np.memmap (one core, batch 16 x 1024, 64M-token file)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


from train.data import DataConfig, build_data
from train.data.meta import FORMAT, FORMAT_VERSION
from train.data.preparation import prepare
from train.data.sources import open_documents
from train.data.tokenizers import load_tokenizer


def _timed(fn, seconds: float) -> tuple[int, float]:
    """Call fn() (returning a count) repeatedly for about `seconds`; -> (total count, elapsed)."""
    fn()  # warm up
    total, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        total += fn()
    return total, elapsed


def bench_tokenize(docs: list[str], seconds: float) -> float:
    tok = load_tokenizer("gpt2")
    count, elapsed = _timed(lambda: sum(len(ids) for ids in tok.encode_batch(docs)), seconds)
    return count / elapsed


def bench_prepare(corpus: Path, work: Path, workers: int) -> float:
    open_documents(f"text:{corpus}", subset=None, split="train", text_field="text", text_sample_by="paragraph")  # warm
    started = time.perf_counter()
    meta = prepare(f"text:{corpus}", "gpt2", work / f"prep{workers}", val_fraction=0.01, workers=workers,
                   text_sample_by="paragraph", overwrite=True)
    return meta["text_bytes"] / 1e6 / (time.perf_counter() - started)


def bench_stream(corpus: Path, seconds: float) -> float:
    cfg = DataConfig(source=f"text:{corpus}", text_sample_by="paragraph", val_fraction=0.01)
    bundle = build_data(cfg, seq_len=1024, batch_size=8, vocab_size=50304, seed=0)
    count, elapsed = _timed(lambda: bundle.train.next_batch()[0].numel(), seconds)
    bundle.close()
    return count / elapsed


def bench_sample(work: Path, seconds: float, n_tokens: int = 64 << 20) -> float:
    d = work / "bin"
    d.mkdir()
    rng = np.random.default_rng(0)
    with open(d / "train.bin", "wb") as f:
        for _ in range(n_tokens // (8 << 20)):
            f.write(rng.integers(0, 50257, 8 << 20, dtype=np.uint16).tobytes())
    rng.integers(0, 50257, 1 << 20, dtype=np.uint16).tofile(d / "val.bin")
    splits = {"train": {"file": "train.bin", "tokens": n_tokens}, "val": {"file": "val.bin", "tokens": 1 << 20}}
    (d / "meta.json").write_text(json.dumps({"format": FORMAT, "version": FORMAT_VERSION, "tokenizer": "gpt2", "eos_id": 50256,
                                             "vocab_size": 50257, "dtype": "uint16", "max_token_id": 50256, "splits": splits}))
    bundle = build_data(DataConfig(source=f"bin:{d}"), seq_len=1024, batch_size=16, vocab_size=50304, seed=0)
    count, elapsed = _timed(lambda: bundle.train.next_batch()[0].numel(), seconds)
    bundle.close()
    return count / elapsed


def main() -> None:
    default_corpus = Path(__file__).resolve().parents[2] / "shared" / "corpus" / "kjv.txt"
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, default=default_corpus, help="an English text file")
    parser.add_argument("--seconds", type=float, default=2.0, help="time per throughput measurement")
    args = parser.parse_args()
    if not args.corpus.is_file():
        sys.exit(f"error: corpus {args.corpus} not found; pass --corpus FILE (any large English text)")
    docs = args.corpus.read_text(encoding="utf-8").split("\n\n")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        result = {
            "corpus_mb": round(args.corpus.stat().st_size / 1e6, 2),
            "cpu_count": os.cpu_count(),
            "tokenize_tokens_per_s": round(bench_tokenize(docs, args.seconds)),
            "prepare_mb_per_s": {f"workers={w}": round(bench_prepare(args.corpus, work, w), 2) for w in (1, 2)},
            "stream_tokens_per_s": round(bench_stream(args.corpus, args.seconds)),
            "sample_tokens_per_s": round(bench_sample(work, args.seconds)),
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
