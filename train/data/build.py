"""build_data: DataConfig -> DataBundle (train BatchStream + fixed validation batches + description).

Everything a user can get wrong is checked here, before the first training step: source syntax,
metadata, file sizes, tokenizer, ids that would not fit the model's vocabulary, and (stream
sources) that a first batch arrives within data.first_batch_timeout_s.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import zlib
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from train.core.data_config import DataConfig, resolve_document_mask
from train.core.mixture import SINGLE, WORLD_SIZE_FREE, Mixture, MixtureSource
from train.core.errors import DataError
from train.data.memmap import MemmapStream
from train.data.meta import dtype_for_vocab, read_meta, split_tokens
from train.data.state import (  # noqa: F401 (VAL_STREAM re-exported)
    TRAIN_STREAM,
    VAL_STREAM,
    global_state_refusal,
    identity_refusal,
    stream_resume_refusal,
)
from train.data.synthetic import SyntheticStream
from train.data.tensors import windows_to_xy

log = logging.getLogger("train.data")


class BatchStream(Protocol):
    """What DataBundle.train is (SyntheticStream, MemmapStream, StreamBatches)."""

    # True: batches depend only on (optimizer step, global row), so a state saved by any world size and
    # batch split with the same global batch resumes exactly (MemmapStream, SyntheticStream).
    # False: the state is per rank and per worker and resumes only with the same world size and
    # data.num_workers (StreamBatches; see stream_resume_refusal for the message).
    any_world_size: bool

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]: ...  # int64 [B, T] each, y = x shifted by one

    def state_dict(self) -> dict: ...  # plain Python data; loads under torch.load(weights_only=True)

    def load_state_dict(self, state: dict) -> None: ...

    def close(self) -> None: ...


class DataBundle:
    """train: BatchStream; val_batches(n, name): the same n held-out batches of validation source `name` on every call
    (val_names: one per mixture source, in the mixture's order; a run without a mixture has the one name "data")."""

    def __init__(self, train, val, info: dict, *, pin: bool = False, mixture: Mixture | None = None):
        """mixture: the run's, when train draws from several sources (val then maps each name to its stream)."""
        self.train, self.info, self._pin, self.mixture = train, info, pin, mixture
        self._val = val if isinstance(val, dict) else {SINGLE: val}  # name -> stream
        self._val_windows: dict[str, list[np.ndarray]] = {name: [] for name in self._val}

    @property
    def val_names(self) -> tuple[str, ...]:
        return tuple(self._val)

    def val_stream(self, name: str = SINGLE):
        """The validation stream of `name` itself (a mixture builds each source as alone and takes its stream)."""
        return self._val[name]

    def val_batches(self, n: int, name: str = SINGLE) -> list[tuple[torch.Tensor, torch.Tensor]]:
        val, kept = self._val[name], self._val_windows[name]
        if hasattr(val, "batch_at"):  # stateless sources: recompute, nothing cached
            return [val.batch_at(i) for i in range(n)]
        while len(kept) < n:  # streams: read once, keep compact windows
            x, y = val.next_batch()
            kept.append(torch.cat([x, y[:, -1:]], dim=1).numpy().astype(np.int32))
        return [windows_to_xy(w, self._pin) for w in kept[:n]]

    def rows_per_source(self) -> dict[str, int]:
        """{source: training rows so far} of a mixture (empty without one)."""
        return self.train.rows() if self.mixture is not None else {}

    def reading_ahead(self, micro_batches: int) -> "DataBundle":
        """This bundle with its training stream read one optimizer step ahead (train/data/lookahead.py): what a stream
        source needs for its ranks to stop together when the data is unreachable."""
        from train.data.lookahead import Lookahead

        self.train = Lookahead(self.train, micro_batches)
        return self

    @property
    def reads_ahead(self) -> bool:
        """Whether the training stream is read one step ahead (a stream source is in it)."""
        return hasattr(self.train, "read_ahead")

    def read_ahead(self) -> str | None:
        """Read the next step's micro-batches now (streams; nothing to do for bin: and synthetic sources): the one line
        of a data outage, or None."""
        return self.train.read_ahead() if hasattr(self.train, "read_ahead") else None

    def retry_counts(self) -> dict | None:
        """This rank's read retries of its stream sources, training and validation together (None when it reads no
        stream): retries, stalls, wait_s, last_error."""
        from train.data.remote import total_counts

        return total_counts([c for c in (getattr(s, "retry_counts", lambda: None)() for s in (self.train, *self._val.values()))
                             if c is not None])

    def val_bytes_per_token(self, name: str) -> float | None:
        """UTF-8 bytes per token of a mixture source's validation split (its meta.json), None where unknown, and None
        for a source with a loss mask: its loss is per target token, and the split's bytes are not its targets' bytes
        (bits per byte do not apply, as train.evaluate says of a masked split)."""
        part = self.info.get("sources", {}).get(name, {})
        if part.get("loss_mask"):
            return None
        tokens, text_bytes = part.get("val_tokens"), part.get("val_text_bytes")
        return text_bytes / tokens if tokens and text_bytes else None

    def describe(self) -> dict:
        return dict(self.info)

    def close(self) -> None:
        for stream in (self.train, *self._val.values()):
            if stream is not None:
                stream.close()


def build_data(cfg: DataConfig, *, seq_len: int, batch_size: int, vocab_size: int, seed: int,
               rank: int = 0, world_size: int = 1, accumulate: int = 1, pin: bool = False,
               mixture: Mixture | None = None) -> DataBundle:
    """batch_size is per rank and micro-batch; the global batch of one optimizer step is
    batch_size x accumulate x world_size rows (accumulate = train.accumulate_grad_batches). mixture: the run's
    (train/core/config.py `data_mixture`), needed when the config has data.mixture."""
    cfg.validate()
    if seq_len < 1 or batch_size < 1 or vocab_size < 1 or accumulate < 1:
        raise DataError(f"seq_len, batch_size, vocab_size and accumulate must be >= 1, "
                        f"got {seq_len}, {batch_size}, {vocab_size}, {accumulate}")
    if not 0 <= rank < world_size:
        raise DataError(f"rank {rank} is outside world_size {world_size}")
    pin = bool(pin and cfg.pin_memory and torch.cuda.is_available())
    shape = dict(seq_len=seq_len, batch_size=batch_size, vocab_size=vocab_size, seed=seed, rank=rank,
                 world_size=world_size, accumulate=accumulate, pin=pin)
    if (alone := _alone(cfg, mixture)) is None:
        bundle = _mixture(cfg, mixture, **shape)
        return bundle.reading_ahead(accumulate) if not mixture.any_world_size else bundle
    cfg = alone
    kind = cfg.source_kind
    if kind == "synthetic":
        return _synthetic(**shape)
    if kind == "bin":
        return _bin(cfg, Path(cfg.source[4:]), **shape)
    from train.data.sources import StreamUnavailable

    try:
        return _stream(cfg, **shape).reading_ahead(accumulate)
    except StreamUnavailable as e:
        if not cfg.synthetic_on_fail:
            raise
        log.warning("data: %s -- falling back to synthetic data (data.synthetic_on_fail=true)", e)
        bundle = _synthetic(**shape)
        bundle.info.update(fallback_from=cfg.source, fallback_reason=str(e))
        return bundle


def _source_config(cfg: DataConfig, source: MixtureSource) -> DataConfig:
    """The data config of one mixture source read alone."""
    return dataclasses.replace(cfg, source=source.source, val_source=source.val_source, window_start=source.window_start,
                               mixture=None, stages=None)


def _alone(cfg: DataConfig, mixture: Mixture | None) -> DataConfig | None:
    """The config of the one source this data reads (data.source, or a mixture of one: batches exactly as alone); None
    for a mixture of several. mixture: the run's (train/core/config.py `data_mixture`), needed with data.mixture."""
    if cfg.mixture is None:
        return cfg
    if mixture is None:
        raise ValueError("a config with data.mixture needs its parsed mixture (train/core/config.py data_mixture)")
    return _source_config(cfg, mixture.sources[0]) if mixture.single else None


def source_seed(seed: int, name: str) -> int:
    """A mixture source's own seed (its windows), from its name: two sources never share windows by accident, and
    reordering the list keeps each source's windows."""
    return seed ^ (zlib.crc32(name.encode()) << 16)


def _mixture(cfg: DataConfig, mixture: Mixture, *, seq_len, batch_size, vocab_size, seed, rank, world_size, accumulate,
             pin) -> DataBundle:
    """Each source built as alone (its own seed, unpinned), drawn from per row by MixtureStream; validation per source."""
    from train.data.mixture import MixtureStream

    plan = mixture_plan(cfg, mixture, seq_len=seq_len, global_batch=batch_size * accumulate * world_size,
                        vocab_size=vocab_size)
    if refusal := mixture.epochs_refusal(plan):
        raise DataError(refusal)
    parts, vals, infos = [], {}, {}
    try:
        for source in mixture.sources:
            part_cfg = _source_config(cfg, source)
            part_shape = dict(seq_len=seq_len, batch_size=batch_size, vocab_size=vocab_size,
                              seed=source_seed(seed, source.name), rank=rank, world_size=world_size,
                              accumulate=accumulate, pin=False)
            if source.kind == "synthetic":
                part = _synthetic(**part_shape)
            elif source.kind == "bin":
                part = _bin(part_cfg, Path(source.source[4:]), **part_shape)
            else:  # a stream: one row per next_batch(), read as the mixture picks its rows
                part = _stream(part_cfg, **{**part_shape, "batch_size": 1})
            parts.append(part.train)
            vals[source.name] = part.val_stream()
            infos[source.name] = part.info
        train = MixtureStream(mixture, parts, seq_len=seq_len, batch_size=batch_size, seed=seed, rank=rank,
                              world_size=world_size, accumulate=accumulate, stream=TRAIN_STREAM, pin=pin)
    except BaseException:
        for stream in [*parts, *vals.values()]:
            stream.close()
        raise
    first = infos[mixture.sources[0].name]
    info = {"source": "mixture", "kind": "mixture", "tokenizer": first.get("tokenizer"), "eos_id": first.get("eos_id"),
            "vocab_size": vocab_size, "seq_len": seq_len, "sources": infos,
            "weights": {n: w for n, w in zip(mixture.names, mixture.stages[0].weights)},
            **_order_info(batch_size, rank, world_size, accumulate, True)}
    return DataBundle(train, vals, info, pin=pin, mixture=mixture)


def _order_info(batch_size, rank, world_size, accumulate, any_world_size: bool) -> dict:
    return {"batch_size": batch_size, "accumulate": accumulate, "rank": rank, "world_size": world_size,
            "global_batch": batch_size * accumulate * world_size, "any_world_size": any_world_size}


def _synthetic(*, seq_len, batch_size, vocab_size, seed, rank, world_size, accumulate, pin) -> DataBundle:
    common = dict(seq_len=seq_len, batch_size=batch_size, vocab_size=vocab_size, seed=seed, rank=rank,
                  world_size=world_size, pin=pin)
    train = SyntheticStream(stream=TRAIN_STREAM, accumulate=accumulate, **common)
    val = SyntheticStream(stream=VAL_STREAM, **common)  # validation: one micro-batch per batch
    info = {"source": "synthetic", "kind": "synthetic", "tokenizer": None, "token_dtype": "int64", "vocab_size": vocab_size,
            "seq_len": seq_len, **_order_info(batch_size, rank, world_size, accumulate, True),
            "phrases": int(train.book.shape[0]), "phrase_len": train.phrase_len}
    return DataBundle(train, val, info, pin=pin)


def check_data_source(cfg: DataConfig, *, vocab_size: int, mixture: Mixture | None = None, seq_len: int | None = None,
                      global_batch: int | None = None) -> str:
    """The checks build_data makes before it reads a batch (files, metadata, tokenizer, vocabulary; a mixture's every
    source and its epochs when seq_len and global_batch are given), reading nothing else: the launch's start checks
    (train/trainer/start_checks.py) and preflight. One line describing the source."""
    cfg.validate()
    if (alone := _alone(cfg, mixture)) is None:
        return _check_mixture(cfg, mixture, vocab_size=vocab_size, seq_len=seq_len, global_batch=global_batch)
    cfg = alone
    kind = cfg.source_kind
    if kind == "synthetic":
        resolve_document_mask(cfg.document_mask, None, None)  # synthetic tokens have no EOS
        return "synthetic tokens"
    if kind == "bin":
        data_dir = Path(cfg.source[4:])
        meta, counts = _checked_bin(cfg, data_dir, vocab_size)
        resolve_document_mask(cfg.document_mask, meta.eos_id, None)
        return f"{data_dir}: train {counts['train']:,} tokens, val {counts['val']:,} tokens ({meta.tokenizer})"
    where = "remote, not checked before the launch"
    if kind in ("text", "jsonl", "parquet"):
        where = f"{len(_stream_files(cfg, cfg.source))} file(s)"
        if cfg.val_source and cfg.val_source.partition(":")[0] in ("text", "jsonl", "parquet"):
            _stream_files(cfg, cfg.val_source)
    tokenizer = _checked_tokenizer(cfg, vocab_size)
    resolve_document_mask(cfg.document_mask, tokenizer.eos_id, None)
    return f"{cfg.source}: {where}, tokenizer {tokenizer.name}"


def _stream_files(cfg: DataConfig, source: str) -> list[str]:
    """The files of a text:/jsonl:/parquet: source: a local glob's matches, or its URLs each looked up once (a
    malformed URL, an unknown protocol, a missing package, a missing file: one line)."""
    from train.data.remote import expand_urls, is_remote, split_urls
    from train.data.sources import local_files

    kind, _, arg = source.partition(":")
    if is_remote(arg):
        return expand_urls(split_urls(source), retry_policy(cfg), f"{kind}:")
    return local_files(source)


def retry_policy(cfg: DataConfig):
    from train.data.remote import RetryPolicy

    return RetryPolicy(retry_max=cfg.retry_max, retry_max_s=cfg.retry_max_s, read_timeout_s=cfg.read_timeout_s,
                       backoff_base_s=cfg.retry_backoff_s)


def mixture_plan(cfg: DataConfig, mixture: Mixture, *, seq_len: int, global_batch: int, vocab_size: int) -> list[dict]:
    """Tokens and epochs per source per stage (train/core/mixture.py `Mixture.plan`), each bin: source's size read from
    its meta.json: train.plan and preflight print it."""
    sizes = {s.name: _checked_bin(cfg, Path(s.source[4:]), vocab_size)[1]["train"]
             for s in mixture.sources if s.kind == "bin"}
    return mixture.plan(seq_len=seq_len, global_batch=global_batch, source_tokens=sizes)


def _check_mixture(cfg: DataConfig, mixture: Mixture, *, vocab_size: int, seq_len: int | None,
                   global_batch: int | None) -> str:
    parts = [f"{source.name} ({check_data_source(_source_config(cfg, source), vocab_size=vocab_size)})"
             for source in mixture.sources]
    if seq_len and global_batch:
        plan = mixture_plan(cfg, mixture, seq_len=seq_len, global_batch=global_batch, vocab_size=vocab_size)
        if refusal := mixture.epochs_refusal(plan):
            raise DataError(refusal)
    return f"mixture of {len(mixture.sources)}: " + "; ".join(parts)


def train_state_refusal(cfg: DataConfig, states: list, *, seq_len: int, batch_size: int, vocab_size: int, seed: int,
                        world_size: int, saved_num_workers: int, checkpoint: str,
                        mixture: Mixture | None = None) -> str | None:
    """Why the training stream this config builds on world_size ranks cannot continue from `states` (the data states,
    one per rank, of `checkpoint`, written with data.num_workers=saved_num_workers), in the words its load_state_dict
    would raise; None when it can. The launch's start checks decide with it before anything is built
    (train/trainer/start_checks.py)."""
    if (alone := _alone(cfg, mixture)) is None:
        from train.data.mixture import MixtureStream

        refusal = global_state_refusal(states[0], kind=MixtureStream.kind, seed=seed, stream=TRAIN_STREAM,
                                       mixture=mixture.identity())
        if refusal or mixture.any_world_size:
            return refusal
        streams = {s.name: _source_config(cfg, s) for s in mixture.sources if s.kind not in WORLD_SIZE_FREE}
        return _streams_refusal(cfg, states, streams, seq_len=seq_len, batch_size=1, vocab_size=vocab_size,
                                world_size=world_size, saved_num_workers=saved_num_workers, checkpoint=checkpoint)
    cfg = alone
    kind = cfg.source_kind
    if kind in WORLD_SIZE_FREE:  # rank 0's state speaks for all
        stream_kind = SyntheticStream.kind if kind == "synthetic" else MemmapStream.kind
        return global_state_refusal(states[0], kind=stream_kind, seed=seed, stream=TRAIN_STREAM)
    return _streams_refusal(cfg, states, {None: cfg}, seq_len=seq_len, batch_size=batch_size, vocab_size=vocab_size,
                            world_size=world_size, saved_num_workers=saved_num_workers, checkpoint=checkpoint)


def _streams_refusal(cfg: DataConfig, states: list, streams: dict[str | None, DataConfig], *, seq_len: int,
                     batch_size: int, vocab_size: int, world_size: int, saved_num_workers: int,
                     checkpoint: str) -> str | None:
    """Whether stream sources (name -> its config; None: the run's one source, whose state is the rank's whole
    state) continue from the ranks' `states`: the same world size and readers, and each stream's identity."""
    from train.data.stream import stream_identity

    if refusal := stream_resume_refusal(len(states), world_size, saved_num_workers, cfg.num_workers, checkpoint=checkpoint):
        return refusal
    for name, stream_cfg in streams.items():
        tokenizer_name = _checked_tokenizer(stream_cfg, vocab_size).name
        for rank, state in enumerate(states):
            expected = stream_identity(source=stream_cfg.source, role=_train_role(stream_cfg),
                                       tokenizer_name=tokenizer_name, seq_len=seq_len, batch_size=batch_size, rank=rank,
                                       world_size=world_size, num_workers=stream_cfg.num_workers,
                                       split_seed=stream_cfg.split_seed, val_fraction=stream_cfg.val_fraction)
            saved = state if name is None else ((state or {}).get("streams") or {}).get(name)
            if refusal := identity_refusal(saved, expected):
                return refusal
    return None


def _train_role(cfg: DataConfig) -> str:
    """A stream's training reader takes every document when validation has its own source, else the unheld ones."""
    return "all" if cfg.val_source else "train"


def _checked_bin(cfg: DataConfig, data_dir: Path, vocab_size: int):
    """(metadata, token counts per split) of a prepared directory that fits this config and model."""
    meta = read_meta(data_dir)
    check_prepared_tokenizer(data_dir, meta.tokenizer, cfg.tokenizer, "data.tokenizer",
                             f"set data.tokenizer={meta.tokenizer}")
    if meta.id_bound >= vocab_size:
        raise DataError(f"{data_dir} holds token ids up to {meta.id_bound} (tokenizer vocabulary {meta.vocab_size}) "
                        f"but the model's vocab_size is {vocab_size}; set model.vocab_size >= {meta.vocab_size} (e.g. a multiple of 64)")
    return meta, {split: split_tokens(data_dir, meta, split) for split in ("train", "val")}


def _checked_tokenizer(cfg: DataConfig, vocab_size: int):
    from train.data.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(cfg.tokenizer)
    if tokenizer.n_vocab > vocab_size:
        raise DataError(f"tokenizer {tokenizer.name} has {tokenizer.n_vocab} ids but the model's vocab_size is {vocab_size}; "
                        f"set model.vocab_size >= {tokenizer.n_vocab} (e.g. padded_vocab = {-(-tokenizer.n_vocab // 64) * 64})")
    return tokenizer


def _bin(cfg: DataConfig, data_dir: Path, *, seq_len, batch_size, vocab_size, seed, rank, world_size, accumulate,
         pin) -> DataBundle:
    meta, counts = _checked_bin(cfg, data_dir, vocab_size)
    if cfg.window_start == "document" and meta.eos_id is None:
        raise DataError(f"data.window_start=document needs documents separated by EOS; {data_dir} records no EOS id")
    starts_eos = meta.eos_id if cfg.window_start == "document" else None
    common = dict(dtype=meta.np_dtype, seq_len=seq_len, batch_size=batch_size, seed=seed, rank=rank, world_size=world_size,
                  pin=pin, document_starts_eos=starts_eos)
    masks = {split: data_dir / info.loss_mask if info.loss_mask else None for split, info in meta.splits.items()}
    train = MemmapStream(data_dir / meta.splits["train"].file, n_tokens=counts["train"], stream=TRAIN_STREAM,
                         accumulate=accumulate, loss_mask=masks["train"], **common)
    val = MemmapStream(data_dir / meta.splits["val"].file, n_tokens=counts["val"], stream=VAL_STREAM,
                       loss_mask=masks["val"], **common)
    info = {"source": cfg.source, "kind": "bin", "dir": str(data_dir), "tokenizer": meta.tokenizer, "eos_id": meta.eos_id,
            "token_dtype": meta.dtype, "tokenizer_vocab": meta.vocab_size, "max_token_id": meta.max_token_id,
            "vocab_size": vocab_size, "train_tokens": counts["train"], "val_tokens": counts["val"],
            "legacy_meta": meta.legacy, "seq_len": seq_len, "loss_mask": bool(masks["train"]),
            "val_text_bytes": (meta.raw.get("splits", {}).get("val") or {}).get("text_bytes"),
            "window_start": cfg.window_start, **({"train_window_starts": len(train.starts), "val_window_starts": len(val.starts)}
                                                 if starts_eos is not None else {}), **_order_info(batch_size, rank, world_size, accumulate, True)}
    return DataBundle(train, val, info, pin=pin)


def tokenizers_agree(prepared_with: str | None, wanted: str) -> str:
    """'same', 'assumed' (two hf: paths: they may differ by machine only) or 'different'; a legacy
    directory (None) names no tokenizer and agrees."""
    if not prepared_with or prepared_with == wanted:
        return "same"
    return "assumed" if prepared_with.startswith("hf:") and wanted.startswith("hf:") else "different"


def check_prepared_tokenizer(data_dir: Path, prepared_with: str | None, wanted: str, wanted_by: str, fix: str) -> None:
    """A prepared directory's ids must come from the tokenizer `wanted_by` names (the config's data.tokenizer,
    a checkpoint's); hf: paths may differ by machine (a warning); a legacy directory names none."""
    agree = tokenizers_agree(prepared_with, wanted)
    if agree == "same":
        return
    if agree == "assumed":
        log.warning("data: %s was prepared with %s; %s names %s (assumed to be the same tokenizer)",
                    data_dir, prepared_with, wanted_by, wanted)
        return
    raise DataError(f"{data_dir} was prepared with tokenizer {prepared_with} but {wanted_by} names {wanted}; {fix}")


def _stream(cfg: DataConfig, *, seq_len, batch_size, vocab_size, seed, rank, world_size, accumulate, pin) -> DataBundle:
    from train.data.sources import StreamUnavailable, open_documents
    from train.data.stream import StreamBatches

    tokenizer = _checked_tokenizer(cfg, vocab_size)
    policy = retry_policy(cfg)
    open_args = dict(subset=cfg.subset, split=cfg.split, text_field=cfg.text_field, text_sample_by=cfg.text_sample_by,
                     policy=policy, spool_dir=cfg.spool_dir)
    stream_args = dict(tokenizer_name=tokenizer.name, text_field=cfg.text_field, split_seed=cfg.split_seed,
                       val_fraction=cfg.val_fraction, seq_len=seq_len, batch_size=batch_size,
                       tokenize_batch_docs=cfg.tokenize_batch_docs, world_size=world_size, pin=pin,
                       persistent_workers=cfg.persistent_workers, prefetch_factor=cfg.prefetch_factor, retry=policy)

    def open_train():
        ds = open_documents(cfg.source, **open_args)
        train = StreamBatches(ds, source=cfg.source, role=_train_role(cfg), rank=rank,
                              num_workers=cfg.num_workers, **stream_args)
        train.prime()
        return ds, train

    ds, train = _within(cfg.first_batch_timeout_s, open_train,
                        f"no first batch from {cfg.source} within data.first_batch_timeout_s={cfg.first_batch_timeout_s:g}s "
                        f"(stalled download or too slow a source)", StreamUnavailable)
    if cfg.val_source:
        val_ds, val_role = open_documents(cfg.val_source, **open_args), "all"
    else:
        val_ds, val_role = ds, "val"
    val = StreamBatches(val_ds, source=cfg.val_source or cfg.source, role=val_role, rank=rank, num_workers=0, **stream_args)
    info = {"source": cfg.source, "kind": cfg.source_kind, "tokenizer": tokenizer.name, "eos_id": tokenizer.eos_id,
            "tokenizer_vocab": tokenizer.n_vocab, "vocab_size": vocab_size,
            "token_dtype": dtype_for_vocab(tokenizer.n_vocab), "shards": int(ds.n_shards),
            "readers_per_rank": train.readers_per_rank, "num_workers": cfg.num_workers,
            "validation": cfg.val_source or f"documents hashed into the held-out {cfg.val_fraction:.2%} (split_seed={cfg.split_seed})",
            "seq_len": seq_len, **_order_info(batch_size, rank, world_size, accumulate, False)}
    return DataBundle(train, val, info, pin=pin)


def _within(timeout_s: float, fn, message: str, error_type):
    """Run fn() in a helper thread; raise error_type(message) if it has not finished in timeout_s."""
    result: dict = {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as e:  # re-raised in the caller's thread
            result["error"] = e

    thread = threading.Thread(target=target, name="data-first-batch", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise error_type(message)
    if "error" in result:
        raise result["error"]
    return result["value"]
