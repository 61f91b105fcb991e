"""Remote stream sources: training batches per second from a local HTTP server with the retry layer, against the same
files on disk and against `datasets` streaming the URLs itself; then the time each kind of injected fault costs.

    PYTHONPATH=. python bench/bench_remote.py [--out bench/results/remote_sources.json]

Sixteen parquet shards of about 0.5 MB of English text (the KJV, repeated), read as a training stream (byte tokenizer,
8 x 1024 windows, one process, one reader) until --tokens tokens (about 12 shards, one request each). Arms, alternated in --rounds rounds (medians):
- disk: parquet:DIR/*.parquet (no network)
- datasets_http: `datasets` streaming the URLs itself (hf:-style reading; its own retries, none of ours)
- ours: parquet:URL,URL,... (each shard spooled by 8 MiB ranges through the retry layer, then read from disk)
- ours_without_retries: the same ranged copy with the retry layer taken out (what retry support costs unfaulted)
Faults: the same read with --faults faults of one kind, one every other request (tests/fault_http.py), read timeout
1 s, stalls of 2 s, refusals of 2 s; the time lost per fault is (faulty - clean) / faults.
"""
from __future__ import annotations

import argparse
import io
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

from tests.fault_http import FaultServer
from train.core.config import load_config
from train.data import remote
from train.data.build import build_data

REPO = Path(__file__).resolve().parents[1]

CORPUS = REPO.parent / "shared" / "corpus" / "kjv.txt"
SEQ, ROWS = 1024, 8


def shards(n: int = 16, mb: float = 0.5) -> dict[str, bytes]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    paragraphs = [p for p in CORPUS.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    files, k = {}, 0
    for i in range(n):
        docs, size = [], 0
        while size < mb * 1e6:
            docs.append(paragraphs[k % len(paragraphs)])
            size, k = size + len(docs[-1]), k + 1
        buf = io.BytesIO()
        pq.write_table(pa.table({"text": docs}), buf)
        files[f"shard{i:02d}.parquet"] = buf.getvalue()
    return files


def read_tokens(source: str, tokens: int, extra: list[str] = ()) -> float:
    """Seconds to build the stream and read `tokens` training tokens from it."""
    cfg = load_config(None, [f"--data.source={source}", "--data.tokenizer=byte", "--data.val_fraction=0",
                             "--data.read_timeout_s=1", "--data.retry_max=50", "--train.steps=100000", *extra])
    started = time.perf_counter()
    bundle = build_data(cfg.data, seq_len=SEQ, batch_size=ROWS, vocab_size=320, seed=0)
    read = 0
    while read < tokens:
        x, _ = bundle.train.next_batch()
        read += x.numel()
    seconds = time.perf_counter() - started
    bundle.train.close()
    return seconds


def spool_without_retries(url: str, directory: Path, retrier) -> Path:
    """remote.spool's ranged copy with the retry layer taken out (no try / except, no retrier): the baseline that
    isolates what retry support costs when nothing fails."""
    from train.data import remote

    fs, path = remote.open_filesystem(url, retrier.policy.read_timeout_s)
    size = fs.size(path)
    dest = directory / Path(path).name
    with open(dest, "wb") as out:
        for offset in range(0, size, remote.CHUNK_BYTES):
            out.write(fs.cat_file(path, start=offset, end=min(offset + remote.CHUNK_BYTES, size)))
    return dest


def datasets_http(urls: list[str], tokens: int) -> float:
    """`datasets` streaming the URLs itself, tokenized and packed by the same reader (sources.iter_documents)."""
    import datasets

    from train.data.sources import ReaderPlan
    from train.data.stream import read_windows

    started = time.perf_counter()
    ds = datasets.load_dataset("parquet", data_files=urls, split="train", streaming=True).select_columns(["text"])
    windows = read_windows(ds, plan=ReaderPlan.make(ds.n_shards, 1, 0), text_field="text", keep=lambda t: True,
                           tokenizer_name="byte", seq_len=SEQ, batch_size=ROWS, tokenize_batch_docs=64,
                           start={"epoch": 0, "shard": 0, "doc": 0, "offset": 0})
    read = 0
    while read < tokens:
        batch, _ = next(windows)
        read += batch.shape[0] * SEQ
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=6_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--faults", type=int, default=4)
    parser.add_argument("--out", default="bench/results/remote_sources.json")
    args = parser.parse_args()
    files = shards()
    runs: dict[str, list[float]] = {"disk": [], "datasets_http": [], "ours": [], "ours_without_retries": []}
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in files.items():
            (Path(tmp) / name).write_bytes(data)
        with FaultServer(files, lifetime_s=3600) as server:
            urls = [server.url(n) for n in sorted(files)]
            for _ in range(args.rounds):
                runs["disk"].append(read_tokens(f"parquet:{tmp}/*.parquet", args.tokens))
                runs["datasets_http"].append(datasets_http(urls, args.tokens))
                runs["ours"].append(read_tokens("parquet:" + ",".join(urls), args.tokens))
                kept, remote.spool = remote.spool, spool_without_retries
                try:
                    runs["ours_without_retries"].append(read_tokens("parquet:" + ",".join(urls), args.tokens))
                finally:
                    remote.spool = kept
        clean = statistics.median(runs["ours"])
        faults = {}
        for kind in ("drop", "truncate", "503", "429", "stall", "refuse"):
            with FaultServer(files, faults=[kind] * args.faults, every=2, stall_s=2.0, refuse_s=2.0,
                             lifetime_s=3600) as server:
                seconds = read_tokens("parquet:" + ",".join(server.url(n) for n in sorted(files)), args.tokens)
                injected = len(server.injected)
            faults[kind] = {"seconds": seconds, "injected": injected,
                            "seconds_lost_per_fault": (seconds - clean) / max(1, injected)}
    median = {arm: statistics.median(v) for arm, v in runs.items()}
    result = {"bench": "remote_sources", "date": time.strftime("%Y-%m-%d"), "machine": platform.machine(),
              "tokens": args.tokens, "shards": len(files), "shard_bytes": [len(v) for v in files.values()],
              "seconds": runs, "median_seconds": median,
              "tokens_per_s": {arm: args.tokens / s for arm, s in median.items()},
              "ours_over_disk": median["disk"] / median["ours"],
              "ours_over_ours_without_retries": median["ours_without_retries"] / median["ours"],
              "ours_over_datasets_http": median["datasets_http"] / median["ours"],
              "faults": faults, "settings": {"read_timeout_s": 1, "stall_s": 2, "refuse_s": 2,
                                             "retry_backoff_s": 0.5, "every": 2}}
    text = json.dumps(result, indent=2)
    print(text)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
