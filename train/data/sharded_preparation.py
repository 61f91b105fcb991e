"""Prepare a very large corpus in resumable shards, then join them into one prepared directory.

The command line, usage and details: train/data/prepare_sharded.py (its docstring).
"""
from __future__ import annotations

import glob
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from train.core.errors import DataError
from train.data.meta import dtype_for_vocab
from train.data.preparation import (
    EncodedDocuments,
    _chunks,
    _init_worker,
    SplitWriter,
    _tokenize_chunk,
    build_meta,
    hold_out_tail,
    no_text_error,
)
from train.data.remote import Retrier, RetryPolicy
from train.data.sources import ReaderPlan, iter_documents, open_documents
from train.data.tokenizers import load_tokenizer

MANIFEST_FORMAT = "nsa-tokens-shards"
SPLIT_NAMES = ("train", "val")
JOIN_TOKENS = 8 << 20  # tokens copied per step while joining


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def shard_ranges(n_files: int, n_shards: int) -> list[tuple[int, int]]:
    """Contiguous file ranges [lo, hi), as even as possible, in source order."""
    return [(i * n_files // n_shards, (i + 1) * n_files // n_shards) for i in range(n_shards)]


def _marker(shards: Path, i: int) -> Path:
    return shards / f"shard_{i}.done.json"


def _shard_file(shards: Path, i: int, split: str) -> Path:
    return shards / f"shard_{i}.{split}.bin"


def completed_shard(shards: Path, i: int, itemsize: int) -> dict | None:
    """The shard's marker when it and the sizes of its files are intact, else None (redo it). A marker
    written before splits recorded their text_bytes counts as not done."""
    try:
        record = json.loads(_marker(shards, i).read_text())
        for split in SPLIT_NAMES:
            path = _shard_file(shards, i, split)
            info = record["splits"][split]
            if path.stat().st_size != info["tokens"] * itemsize or not isinstance(info["text_bytes"], int):
                return None
        return record
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _tokenize_shard(job: dict) -> dict:
    """One shard, in a worker process: its files -> shard_{i}.{train,val}.bin + the done-marker."""
    started = time.monotonic()
    i, (lo, hi), shards = job["index"], job["files"], Path(job["shards"])
    p = job["params"]
    _init_worker(p["tokenizer"], p["split_seed"], p["val_fraction"])
    ds = open_documents(p["source"], subset=p["subset"], split=p["split"], text_field=p["text_field"],
                        text_sample_by=p["text_sample_by"])
    documents = iter_documents(ds, ReaderPlan(tuple(range(lo, hi)), 1, 0), p["text_field"],
                               keep=lambda text: True, once=True, retrier=Retrier(RetryPolicy(), seed=i))
    writers = {s: SplitWriter(shards, f"shard_{i}.{s}", np.dtype(p["dtype"])) for s in SPLIT_NAMES}
    for chunk in _chunks(documents, None):
        for split, part in _tokenize_chunk(chunk).items():
            writers[split].write(part)
    splits = {s: {**w.finish(), "max_id": w.max_id} for s, w in writers.items()}
    record = {"shard": i, "data_files": [lo, hi], "splits": splits,
              "text_bytes": sum(info["text_bytes"] for info in splits.values()),
              "blank_documents": sum(w.blank_documents for w in writers.values()),
              "seconds": round(time.monotonic() - started, 3)}
    _write_json(_marker(shards, i), record)
    return record


def _run_shards(jobs: list[dict], workers: int):
    if workers <= 1 or len(jobs) <= 1:
        yield from map(_tokenize_shard, jobs)
        return
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    with context.Pool(min(workers, len(jobs))) as pool:
        yield from pool.imap_unordered(_tokenize_shard, jobs)


def _join(out: Path, shards: Path, records: list[dict], dtype_name: str,
          val_fraction: float, tokenizer) -> tuple[dict, int, str | None]:
    """Concatenate the shard files in order into out/{train,val}.bin (prepare's writer: sha256, counts; a single
    document's tail held out as prepare holds it). -> (splits, max id, prepare's note on the tail or None)."""
    dtype = np.dtype(dtype_name)
    writers = {s: SplitWriter(out, s, dtype) for s in SPLIT_NAMES}
    for record in records:
        i = record["shard"]
        for split in SPLIT_NAMES:
            info, sha = record["splits"][split], hashlib.sha256()
            n = info["tokens"]
            tokens = np.memmap(_shard_file(shards, i, split), dtype=dtype, mode="r", shape=(n,)) if n else np.zeros(0, dtype)
            writers[split].write(EncodedDocuments(np.zeros(0, dtype), info["documents"], info["text_bytes"]))
            for start in range(0, n, JOIN_TOKENS):
                part = np.asarray(tokens[start:start + JOIN_TOKENS])
                sha.update(part.tobytes())
                writers[split].write(EncodedDocuments(part, documents=0, text_bytes=0))
            del tokens
            if sha.hexdigest() != info["sha256"]:
                for w in writers.values():
                    w.file.close()
                    w.path.unlink(missing_ok=True)
                raise DataError(f"{_shard_file(shards, i, split)} changed after it was written (sha256 mismatch); "
                                f"delete {_marker(shards, i).name} and rerun")
    tail_note = hold_out_tail(writers, val_fraction, tokenizer)
    splits = {s: w.finish() for s, w in writers.items()}
    return splits, max((w.max_id for w in writers.values()), default=-1), tail_note


def prepare_sharded(source: str, tokenizer_name: str, out: Path, *, n_shards: int, workers: int = 1,
                    max_shards: int | None = None, val_fraction: float = 0.005, split_seed: int = 0,
                    subset: str | None = None, split: str = "train", text_field: str = "text",
                    text_sample_by: str = "document", keep_shards: bool = False, overwrite: bool = False) -> dict | None:
    """Tokenize the missing shards (at most max_shards this call); join them when all are done.

    Returns the metadata (as prepare does) once the directory is complete, None while shards remain.
    """
    if source.split(":", 1)[0] in ("synthetic", "bin"):
        raise DataError(f"--source {source}: prepare reads a document source (text:/jsonl:/parquet:/hf:/fineweb_edu)")
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if n_shards < 1 or (max_shards is not None and max_shards < 0):
        raise DataError(f"--shards must be >= 1 and --max-shards >= 0, got {n_shards} and {max_shards}")
    out, started = Path(out), time.monotonic()
    if (out / "meta.json").exists() and not overwrite:
        raise DataError(f"{out} already holds a prepared dataset; pass --overwrite to replace it")
    tokenizer = load_tokenizer(tokenizer_name)
    dtype_name = dtype_for_vocab(tokenizer.n_vocab)
    n_files = open_documents(source, subset=subset, split=split, text_field=text_field,
                             text_sample_by=text_sample_by).n_shards
    if n_shards > n_files:
        raise DataError(f"--shards {n_shards} exceeds the source's {n_files} data file(s); shards are ranges of "
                        f"files: use --shards <= {n_files} or split the corpus into more files")
    shards = out / "shards"
    if overwrite:
        shutil.rmtree(shards, ignore_errors=True)
        for name in ("meta.json", "manifest.json"):
            (out / name).unlink(missing_ok=True)
    params = {"source": source, "tokenizer": tokenizer.name, "dtype": dtype_name, "n_shards": n_shards,
              "n_files": n_files, "val_fraction": val_fraction, "split_seed": split_seed, "subset": subset,
              "split": split, "text_field": text_field, "text_sample_by": text_sample_by}
    plan_path = shards / "plan.json"
    if plan_path.is_file() and json.loads(plan_path.read_text()) != params:
        raise DataError(f"{shards} was started with other settings ({plan_path}); rerun with those or pass --overwrite")
    shards.mkdir(parents=True, exist_ok=True)
    _write_json(plan_path, params)

    ranges, itemsize = shard_ranges(n_files, n_shards), np.dtype(dtype_name).itemsize
    done = {i: r for i in range(n_shards) if (r := completed_shard(shards, i, itemsize)) is not None}
    todo = [i for i in range(n_shards) if i not in done][:max_shards]
    if done:
        print(f"prepare_sharded: {len(done)} of {n_shards} shards already done; skipping them", file=sys.stderr)
    jobs = [{"index": i, "files": ranges[i], "shards": str(shards), "params": params} for i in todo]
    for record in _run_shards(jobs, workers):
        done[record["shard"]] = record
        s = record["splits"]
        print(f"prepare_sharded: shard {record['shard']} done ({len(done)}/{n_shards}): "
              f"{s['train']['tokens'] + s['val']['tokens']:,} tokens, {record['seconds']:.1f} s", file=sys.stderr)
    if len(done) < n_shards:
        print(f"prepare_sharded: {len(done)} of {n_shards} shards done; rerun the same command to continue",
              file=sys.stderr)
        return None
    return _finish(out, shards, [done[i] for i in range(n_shards)], params, tokenizer, keep_shards, started)


def _finish(out: Path, shards: Path, records: list[dict], params: dict, tokenizer, keep_shards: bool,
            started: float) -> dict:
    documents = sum(r["splits"][s]["documents"] for r in records for s in SPLIT_NAMES)
    if error := no_text_error(params["source"], documents, sum(r.get("blank_documents", 0) for r in records)):
        raise error
    splits, max_id, tail_note = _join(out, shards, records, params["dtype"], params["val_fraction"], tokenizer)
    kind, _, arg = params["source"].partition(":")
    files = sorted(glob.glob(arg, recursive=True)) if kind in ("text", "jsonl", "parquet") else None
    manifest = {"format": MANIFEST_FORMAT, "version": 1, **params, "shards": [
        {"index": r["shard"], "data_files": r["data_files"],
         "files": files[r["data_files"][0]:r["data_files"][1]] if files else None,
         "train": r["splits"]["train"], "val": r["splits"]["val"], "text_bytes": r["text_bytes"],
         "marker": _marker(shards, r["shard"]).name} for r in records]}
    _write_json(out / "manifest.json", manifest)
    p = params
    meta = build_meta(tokenizer, p["dtype"], max_id, splits, source=p["source"], subset=p["subset"],
                      split=p["split"], text_field=p["text_field"], text_sample_by=p["text_sample_by"],
                      split_seed=p["split_seed"], val_fraction=p["val_fraction"], max_docs=None,
                      seconds=time.monotonic() - started)
    if tail_note:
        meta["val_split"] = tail_note
    _write_json(out / "meta.json", meta)
    if not keep_shards:
        for r in records:
            for split in SPLIT_NAMES:
                _shard_file(shards, r["shard"], split).unlink(missing_ok=True)
    return meta
