"""Document sources: every stream source is a `datasets` streaming dataset, read shard by shard.

    fineweb_edu   -> load_dataset("HuggingFaceFW/fineweb-edu", name=subset or "sample-10BT", split, streaming=True)
    hf:NAME       -> load_dataset(NAME, name=subset, split, streaming=True)
    text:GLOB     -> load_dataset("text", data_files=..., sample_by=document|paragraph|line, streaming=True)
    jsonl:GLOB    -> load_dataset("json", data_files=..., streaming=True)      (field data.text_field)
    parquet:GLOB  -> load_dataset("parquet", data_files=..., streaming=True)   (column data.text_field)
    text:/jsonl:/parquet:URL[,URL...] -> remote.RemoteFiles: each file spooled when read, then the same builder

A shard is one data file (ds.shard(n_shards, i)); a position is (shard, document index in it). With a Retrier,
a transient read failure reopens the shard at the document it stopped before (remote.py: the budget, the counts);
nothing is read twice or skipped.
Readers (rank x DataLoader worker) split the shards, or the documents when there are fewer
shards than readers, so they are disjoint and together complete. Validation documents are
those whose keyed hash falls below val_fraction; training skips exactly those.
"""
from __future__ import annotations

import glob
import hashlib
from dataclasses import dataclass
from typing import Iterator

from train.core.errors import DataError
from train.core.optional import require
from train.data.remote import (RemoteFiles, Retrier, RetryPolicy, configure_hub_retries, expand_urls, is_remote,
                               remove_stale_spools, split_urls, spool_root)

FINEWEB_EDU = "HuggingFaceFW/fineweb-edu"
FINEWEB_EDU_DEFAULT_SUBSET = "sample-10BT"
LOCAL_BUILDERS = {"text": "text", "jsonl": "json", "parquet": "parquet"}


class StreamUnavailable(DataError):
    """The stream could not be opened or produced no data in time (network, hub, stall)."""


def local_files(source: str) -> list[str]:
    """The files a local stream source (text:/jsonl:/parquet:GLOB) names, sorted; DataError when none."""
    files = sorted(glob.glob(source.partition(":")[2], recursive=True))
    if not files:
        raise DataError(f"{source}: the pattern matched no files")
    return files


def open_documents(source: str, *, subset: str | None, split: str, text_field: str, text_sample_by: str,
                   policy: RetryPolicy | None = None, spool_dir: str | None = None):
    """Open a stream source as a `datasets.IterableDataset`, or remote.RemoteFiles for URLs (nothing is downloaded
    yet; remote files are looked up once, with `policy`'s retries)."""
    datasets = require("datasets")

    kind, _, arg = source.partition(":")
    if kind in LOCAL_BUILDERS and is_remote(arg):
        urls = expand_urls(split_urls(source), policy or RetryPolicy(), f"{kind}:")
        remove_stale_spools(spool_root(spool_dir))  # copies left by processes killed while reading
        extra = {"sample_by": text_sample_by} if kind == "text" else {}
        return RemoteFiles(urls, LOCAL_BUILDERS[kind], extra, text_field, policy or RetryPolicy(), spool_dir)
    if kind in LOCAL_BUILDERS:
        files = local_files(source)
        extra = {"sample_by": text_sample_by} if kind == "text" else {}
        try:
            ds = datasets.load_dataset(LOCAL_BUILDERS[kind], data_files=files, split="train", streaming=True, **extra)
        except Exception as e:
            raise DataError(f"{source}: cannot read as {kind} ({_first_line(e)})") from None
        return ds if kind == "text" else _check_text_field(ds, source, text_field)
    name, config = (FINEWEB_EDU, subset or FINEWEB_EDU_DEFAULT_SUBSET) if kind == "fineweb_edu" else (arg, subset)
    configure_hub_retries(policy or RetryPolicy())
    try:
        ds = datasets.load_dataset(name, name=config, split=split, streaming=True)
    except Exception as e:
        raise StreamUnavailable(f"{source}: cannot open Hugging Face dataset {name} (subset={config}, split={split}): "
                                f"{_first_line(e)}; check the network/HF cache, or use a local text:/jsonl:/parquet: source") from None
    return _check_text_field(ds, source, text_field)


def _check_text_field(ds, source: str, text_field: str):
    names = list(ds.features) if ds.features is not None else None
    if names is None:
        return ds
    if text_field not in names:
        raise DataError(f"{source}: no field {text_field!r} (fields: {', '.join(names)}); set data.text_field")
    return ds.select_columns([text_field])


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def is_held_out(text: str, split_seed: int, val_fraction: float) -> bool:
    """Deterministic: the same document is held out on every machine, rank and worker."""
    if val_fraction <= 0.0:
        return False
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, salt=split_seed.to_bytes(16, "little", signed=True)).digest()
    return int.from_bytes(digest, "little") < val_fraction * 2**64


@dataclass(frozen=True)
class ReaderPlan:
    """Which documents reader `reader` of `n_readers` owns: shards[::] and documents with index % stride == phase."""

    shards: tuple[int, ...]
    stride: int
    phase: int

    @classmethod
    def make(cls, n_shards: int, n_readers: int, reader: int) -> "ReaderPlan":
        if n_shards >= n_readers:
            return cls(tuple(range(reader, n_shards, n_readers)), 1, 0)
        return cls(tuple(range(n_shards)), n_readers, reader)


@dataclass(frozen=True)
class Position:
    """A reader's place: epoch, index into its plan's shards, raw document index inside that shard."""

    epoch: int = 0
    shard: int = 0
    doc: int = 0


def iter_documents(ds, plan: ReaderPlan, text_field: str, keep, start: Position = Position(),
                   read_batch: int = 256, once: bool = False, retrier: Retrier | None = None
                   ) -> Iterator[tuple[Position, str]]:
    """Yield (position, text) for the plan's kept documents from `start` on, forever (epochs repeat) or `once`.

    Reads with ds.iter(batch_size): unlike iter(ds) it does not re-shard itself inside a
    DataLoader worker (the plan already decided what this reader owns). retrier: transient read failures reopen the
    shard at the next unread document (None: the first failure is StreamUnavailable).
    """
    epoch, shard_idx, first_doc = start.epoch, start.shard, start.doc
    full_pass = start == Position(epoch, 0, 0)
    while True:
        kept_any = False
        for shard_idx in range(shard_idx, len(plan.shards)):
            doc = first_doc
            while True:  # (re)open the shard at `doc`: after a transient failure, the document it stopped before
                shard = _open_shard(ds, plan.shards[shard_idx], doc, retrier)
                try:
                    for texts in _read_texts(shard, text_field, read_batch, plan.shards[shard_idx], retrier is None):
                        for text in texts:
                            if doc % plan.stride == plan.phase and text and keep(text):
                                kept_any = True
                                yield Position(epoch, shard_idx, doc), text
                            doc += 1
                        if retrier is not None:
                            retrier.progressed()
                    break
                except DataError:
                    raise
                except Exception as e:
                    retrier.failed(e, f"data shard {plan.shards[shard_idx]} at document {doc}")
            first_doc = 0
        if once:
            return
        if full_pass and not kept_any:
            raise DataError(f"a reader found no documents in a full pass over shards {list(plan.shards)} "
                            f"(taking every {plan.stride}. document); use fewer readers (data.num_workers x world size) "
                            f"or a smaller data.val_fraction")
        epoch, shard_idx, full_pass = epoch + 1, 0, True


def _open_shard(ds, shard_id: int, doc: int, retrier: Retrier | None):
    shard = ds.shard(num_shards=ds.n_shards, index=shard_id) if ds.n_shards > 1 else ds
    if isinstance(shard, RemoteFiles) and retrier is not None:
        shard = shard.with_retrier(retrier)  # the spool's retries count against the same budget
    return shard.skip(doc) if doc else shard


def _read_texts(shard, text_field: str, read_batch: int, shard_id: int, wrap: bool) -> Iterator[list[str]]:
    """Batches of texts of one shard. wrap: a read failure (network, corrupt file) becomes StreamUnavailable at once;
    else it reaches the caller's retrier as it is."""
    batches = shard.iter(batch_size=read_batch)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except DataError:
            raise
        except Exception as e:
            if not wrap:
                raise
            raise StreamUnavailable(f"reading data shard {shard_id} failed: {_first_line(e)}") from None
        yield batch[text_field]
