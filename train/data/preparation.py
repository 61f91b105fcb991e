"""Tokenize a source once into train.bin / val.bin / meta.json (see docs/DATA.md).

The command line, usage and details: train/data/prepare.py (its docstring).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import multiprocessing
import os
import sys
import time
from collections import deque
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from train.core.errors import DataError
from train.data.meta import FORMAT, FORMAT_VERSION, dtype_for_vocab
from train.data.remote import Retrier, RetryPolicy
from train.data.sources import ReaderPlan, is_held_out, iter_documents, open_documents
from train.data.tokenizers import load_tokenizer

CHUNK_DOCS = 256
TAIL_MIN_TOKENS = 4096  # a single document's held-out tail takes at least this many tokens ...
TAIL_MAX_SHARE = 0.1  # ... or this share of the document when that is fewer


@dataclass
class EncodedDocuments:
    """Documents tokenized as prepare writes them: each followed by EOS."""

    tokens: np.ndarray  # [n] ids in the dtype of the token files
    documents: int
    text_bytes: int  # UTF-8 bytes of the documents' text (EOS excluded)
    blank_documents: int = 0  # documents of nothing but whitespace


def encode_documents(tokenizer, texts: list[str]) -> EncodedDocuments:
    """texts -> their ids, each document followed by EOS (the layout of train.bin / val.bin)."""
    dtype = np.dtype(dtype_for_vocab(tokenizer.n_vocab))
    eos = np.array([tokenizer.eos_id], dtype=dtype)
    encoded = tokenizer.encode_batch(texts) if texts else []  # some tokenizers refuse an empty batch
    parts = [piece for ids in encoded for piece in (np.asarray(ids, dtype=dtype), eos)]
    return EncodedDocuments(tokens=np.concatenate(parts) if parts else np.zeros(0, dtype), documents=len(texts),
                            text_bytes=sum(len(t.encode("utf-8")) for t in texts),
                            blank_documents=sum(1 for t in texts if not t or t.isspace()))


class SplitWriter:
    """Appends token arrays to NAME.bin.partial, tracking count, documents, text bytes, max id and sha256."""

    def __init__(self, out: Path, name: str, dtype):
        self.path, self.final = out / f"{name}.bin.partial", out / f"{name}.bin"
        self.file, self.dtype = open(self.path, "wb"), dtype
        self.sha, self.tokens, self.documents, self.text_bytes, self.max_id = hashlib.sha256(), 0, 0, 0, -1
        self.blank_documents = 0

    def write(self, part: EncodedDocuments) -> None:
        self.documents += part.documents
        self.text_bytes += part.text_bytes
        self.blank_documents += part.blank_documents
        if not len(part.tokens):
            return
        data = part.tokens.astype(self.dtype, copy=False).tobytes()
        self.file.write(data)
        self.sha.update(data)
        self.tokens += len(part.tokens)
        self.max_id = max(self.max_id, int(part.tokens.max()))

    def move_tail(self, other: "SplitWriter", n_tokens: int, text_bytes_of=None) -> None:
        """Move this split's last n_tokens to `other` (one document: its contiguous tail becomes held out);
        text_bytes_of(tokens) -> the UTF-8 bytes they decode to, so bits per byte stay known for both splits."""
        self.file.flush()
        itemsize = np.dtype(self.dtype).itemsize
        keep = self.tokens - n_tokens
        tail = np.fromfile(self.path, dtype=self.dtype, offset=keep * itemsize)
        self.file.truncate(keep * itemsize)
        self.file.seek(keep * itemsize)
        self.tokens = keep
        self.sha, self.max_id = hashlib.sha256(), -1
        with open(self.path, "rb") as f:  # the kept head, hashed again in bounded blocks
            for block in iter(lambda: f.read(1 << 24), b""):
                self.sha.update(block)
                self.max_id = max(self.max_id, int(np.frombuffer(block, dtype=self.dtype).max()))
        moved = min(self.text_bytes, text_bytes_of(tail)) if text_bytes_of is not None else 0
        self.text_bytes -= moved
        other.write(EncodedDocuments(tokens=tail, documents=0, text_bytes=moved))

    def abort(self) -> None:
        self.file.close()
        self.path.unlink(missing_ok=True)

    def finish(self) -> dict:
        self.file.close()
        os.replace(self.path, self.final)
        return {"file": self.final.name, "tokens": self.tokens, "documents": self.documents,
                "text_bytes": self.text_bytes, "bytes": self.final.stat().st_size, "sha256": self.sha.hexdigest()}


_worker_job: dict = {}


def _init_worker(tokenizer_name: str, split_seed: int, val_fraction: float) -> None:
    _worker_job.update(tokenizer=load_tokenizer(tokenizer_name), split_seed=split_seed, val_fraction=val_fraction)


def _tokenize_chunk(texts: list[str]) -> dict[str, EncodedDocuments]:
    """-> {"train": ..., "val": ...}: the chunk's documents of each split, each followed by EOS."""
    tok = _worker_job["tokenizer"]
    held_out = [is_held_out(t, _worker_job["split_seed"], _worker_job["val_fraction"]) for t in texts]
    return {"train": encode_documents(tok, [t for t, val in zip(texts, held_out) if not val]),
            "val": encode_documents(tok, [t for t, val in zip(texts, held_out) if val])}


def _chunks(documents, max_docs: int | None):
    chunk, seen = [], 0
    for _, text in documents:
        chunk.append(text)
        seen += 1
        if len(chunk) == CHUNK_DOCS or seen == max_docs:
            yield chunk
            chunk = []
        if seen == max_docs:
            break
    if chunk:
        yield chunk


def document_chunks(source: str, *, subset: str | None, split: str, text_field: str, text_sample_by: str,
                    max_docs: int | None = None):
    """The source's documents, read once in order, as lists of up to CHUNK_DOCS texts (what prepare tokenizes)."""
    ds = open_documents(source, subset=subset, split=split, text_field=text_field, text_sample_by=text_sample_by)
    documents = iter_documents(ds, ReaderPlan.make(ds.n_shards, 1, 0), text_field, keep=lambda text: True, once=True,
                               retrier=Retrier(RetryPolicy()))  # remote files: read through faults (remote.py)
    return _chunks(documents, max_docs)


def _ordered_map(fn, items, workers: int, init_args: tuple):
    """map(fn, items) over a process pool, in order, holding at most 2 * workers results in flight."""
    if workers <= 1:
        _init_worker(*init_args)
        yield from map(fn, items)
        return
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    with context.Pool(workers, initializer=_init_worker, initargs=init_args) as pool:
        pending: deque = deque()
        for item in items:
            pending.append(pool.apply_async(fn, (item,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


class _Progress:
    def __init__(self):
        try:
            from tqdm import tqdm
            self.bar = tqdm(unit="doc", unit_scale=True, dynamic_ncols=True, file=sys.stderr)
        except ImportError:
            self.bar = None
        self.docs, self.last_print = 0, time.monotonic()

    def update(self, docs: int, tokens: int, mbytes: float) -> None:
        self.docs += docs
        if self.bar is not None:
            self.bar.update(docs)
            self.bar.set_postfix(tokens=f"{tokens:,}", MB=f"{mbytes:.1f}", refresh=False)
        elif time.monotonic() - self.last_print > 5:
            print(f"prepare: {self.docs:,} documents, {tokens:,} tokens, {mbytes:.1f} MB", file=sys.stderr, flush=True)
            self.last_print = time.monotonic()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def build_meta(tokenizer, dtype_name: str, max_token_id: int, splits: dict, *, source: str, subset, split: str,
               text_field: str, text_sample_by: str, split_seed: int, val_fraction: float, max_docs,
               seconds: float) -> dict:
    """meta.json of a prepared dataset (schema: docs/DATA.md); shared by prepare and prepare_sharded.
    `splits`: each split's writer summary, with its text_bytes; the total text_bytes is their sum."""
    return {"format": FORMAT, "version": FORMAT_VERSION, "tokenizer": tokenizer.name, "eos_id": tokenizer.eos_id,
            "vocab_size": tokenizer.n_vocab, "dtype": dtype_name, "max_token_id": max_token_id, "splits": splits,
            "split_seed": split_seed, "val_fraction": val_fraction, "source": source, "subset": subset, "split": split,
            "text_field": text_field, "text_sample_by": text_sample_by, "max_docs": max_docs,
            "text_bytes": sum(info["text_bytes"] for info in splits.values()), "seconds": round(seconds, 3),
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def summary_line(out: Path, meta: dict, tail: str) -> str:
    """The one-line 'ok' report of a finished prepare: split sizes, dtype, then `tail`."""
    s = meta["splits"]
    return (f"ok {out}: train {s['train']['tokens']:,} tokens / {s['train']['documents']:,} docs, "
            f"val {s['val']['tokens']:,} tokens / {s['val']['documents']:,} docs, {meta['dtype']}, {tail}")


def spellings(dashed: str) -> list[str]:
    """'--text-sample-by' -> ['--text-sample-by', '--text_sample_by']: the config and the trainer spell the
    same settings with underscores (data.text_sample_by), so both are accepted."""
    return [dashed] + ([dashed.replace("-", "_").replace("__", "--", 1)] if "-" in dashed[2:] else [])


def add_source_arguments(parser: argparse.ArgumentParser) -> None:
    """Options that name what to read and how to split it (prepare and prepare_sharded)."""
    parser.add_argument("--source", required=True, help="text:GLOB | jsonl:GLOB | parquet:GLOB | hf:NAME | fineweb_edu")
    parser.add_argument("--tokenizer", default="gpt2", help="gpt2 | byte | hf:<local dir>")
    parser.add_argument("--out", required=True, type=Path, help="output directory, e.g. data/NAME")
    parser.add_argument(*spellings("--val-fraction"), type=float, default=0.005, help="share of documents held out into val.bin")
    parser.add_argument(*spellings("--split-seed"), type=int, default=0, help="salt of the held-out hash")
    parser.add_argument("--subset", default=None, help="Hugging Face config name (fineweb_edu: sample-10BT)")
    parser.add_argument("--split", default="train", help="Hugging Face split")
    parser.add_argument(*spellings("--text-field"), default="text", help="column with the document text")
    parser.add_argument(*spellings("--text-sample-by"), default="document", choices=("document", "paragraph", "line"),
                        help="text:GLOB documents: whole files, blank-line paragraphs or lines")


def empty_val_warning(meta: dict) -> str | None:
    """One warning line when documents were held out by fraction but val.bin came out empty (e.g. a single
    text file read as one document), with what to pass instead; None otherwise."""
    splits = meta["splits"]
    if splits["val"]["tokens"] or not meta.get("val_fraction"):
        return None
    docs = splits["train"]["documents"]
    hint = ("pass --text-sample-by paragraph (or line) to read each paragraph of the file as a document"
            if meta.get("source", "").startswith("text:") and meta.get("text_sample_by") == "document"
            else "raise --val-fraction or add documents")
    return (f"warning: val.bin is empty: none of the {docs:,} document(s) was held out (val_fraction "
            f"{meta['val_fraction']} holds out whole documents), so training with evaluation will stop; {hint}")


def tail_tokens(n_tokens: int, val_fraction: float) -> int:
    """Tokens held out from the end of a single document of n_tokens: val_fraction of them, but at least
    min(TAIL_MIN_TOKENS, TAIL_MAX_SHARE of them), so a small file still leaves a few windows to evaluate; train
    keeps at least one token."""
    floor = min(TAIL_MIN_TOKENS, int(n_tokens * TAIL_MAX_SHARE))
    return max(1, min(n_tokens - 1, max(math.ceil(n_tokens * val_fraction), floor)))


def hold_out_tail(writers: dict, val_fraction: float, tokenizer=None) -> str | None:
    """One document and no held-out one (a single text file): its contiguous tail (tail_tokens) becomes val.bin,
    since hashing whole documents cannot split one; tokenizer (optional) splits the text bytes too. Returns the
    line saying what was done, or None."""
    train, val = writers["train"], writers["val"]
    if val.tokens or not val_fraction or train.documents != 1 or train.tokens < 2:
        return None
    n = tail_tokens(train.tokens, val_fraction)
    share = n / train.tokens
    text_bytes_of = None if tokenizer is None else (
        lambda ids: len(tokenizer.decode([int(t) for t in ids if t != tokenizer.eos_id]).encode("utf-8")))
    train.move_tail(val, n, text_bytes_of)
    return f"one document: its last {share:.2%} ({n:,} tokens) held out as val.bin (a contiguous tail)"


def no_text_error(source: str, documents: int, blank_documents: int) -> DataError | None:
    """An error when the source gave no text at all (no documents, or only empty / whitespace ones), else None."""
    if documents > blank_documents:
        return None
    return DataError(f"{source}: no text was read (empty or whitespace-only files); nothing to train on, "
                     f"nothing written")


def prepare(source: str, tokenizer_name: str, out: Path, *, val_fraction: float = 0.005, split_seed: int = 0,
            workers: int = 1, max_docs: int | None = None, subset: str | None = None, split: str = "train",
            text_field: str = "text", text_sample_by: str = "document", overwrite: bool = False) -> dict:
    """Write out/{train,val}.bin and out/meta.json; return the metadata."""
    if source.split(":", 1)[0] in ("synthetic", "bin"):
        raise DataError(f"--source {source}: prepare reads a document source (text:/jsonl:/parquet:/hf:/fineweb_edu)")
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    out = Path(out)
    if (out / "meta.json").exists() and not overwrite:
        raise DataError(f"{out} already holds a prepared dataset; pass --overwrite to replace it")
    tokenizer = load_tokenizer(tokenizer_name)
    dtype_name = dtype_for_vocab(tokenizer.n_vocab)
    chunks = document_chunks(source, subset=subset, split=split, text_field=text_field, text_sample_by=text_sample_by,
                             max_docs=max_docs)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    writers = {name: SplitWriter(out, name, np.dtype(dtype_name)) for name in ("train", "val")}
    progress, started = _Progress(), time.monotonic()
    try:
        results = _ordered_map(_tokenize_chunk, chunks, workers, (tokenizer.name, split_seed, val_fraction))
        for parts in results:
            for name, part in parts.items():
                writers[name].write(part)
            progress.update(sum(p.documents for p in parts.values()), sum(w.tokens for w in writers.values()),
                            sum(w.text_bytes for w in writers.values()) / 1e6)
        if error := no_text_error(source, sum(w.documents for w in writers.values()),
                                  sum(w.blank_documents for w in writers.values())):
            raise error
    except BaseException:  # only this run's *.partial files go; what the directory held before stays
        for w in writers.values():
            w.abort()
        if created and not any(out.iterdir()):
            out.rmdir()
        raise
    finally:
        progress.close()
    tail_note = hold_out_tail(writers, val_fraction, tokenizer)
    (out / "meta.json").unlink(missing_ok=True)  # (--overwrite) the old dataset goes only now, with data to replace it
    splits = {name: w.finish() for name, w in writers.items()}
    seconds = time.monotonic() - started
    meta = build_meta(tokenizer, dtype_name, max(w.max_id for w in writers.values()), splits, source=source,
                      subset=subset, split=split, text_field=text_field, text_sample_by=text_sample_by,
                      split_seed=split_seed, val_fraction=val_fraction, max_docs=max_docs, seconds=seconds)
    if tail_note:
        meta["val_split"] = tail_note
    tmp = out / "meta.json.partial"
    tmp.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, out / "meta.json")
    return meta
