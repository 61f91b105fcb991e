"""DataConfig: the `data:` section of a run config (YAML / `--data.key=value`).

Fields are simple types only: the trainer's loader coerces CLI strings by annotation.
"""
from __future__ import annotations

from dataclasses import dataclass

from train.core.errors import DataError

# seconds a rank waits in the ranks' host-side agreements (stop votes; train/core/distributed.py's control group)
AGREEMENT_TIMEOUT_S = 1800.0
WINDOW_STARTS = ("any", "document")
SOURCE_KINDS = ("synthetic", "bin", "fineweb_edu", "text", "jsonl", "parquet", "hf")
TEXT_SAMPLE_BY = ("document", "paragraph", "line")


@dataclass
class DataConfig:
    # where documents come from: synthetic | bin:DIR | fineweb_edu | text:GLOB | jsonl:GLOB | parquet:GLOB | hf:NAME
    source: str = "synthetic"
    # gpt2 | byte | hf:<local dir or cached hub name>
    tokenizer: str = "gpt2"
    # Hugging Face dataset config name (fineweb_edu: defaults to sample-10BT)
    subset: str | None = None
    # Hugging Face split read for training (stream sources)
    split: str = "train"
    # column holding the document text (jsonl / parquet / hf)
    text_field: str = "text"
    # text:GLOB documents: a whole file (document), blank-line separated paragraphs, or lines
    text_sample_by: str = "document"
    # stream sources: share of documents held out for validation, chosen by a hash of their text
    val_fraction: float = 0.005
    # optional separate validation source (same syntax as `source`); when set, nothing is hashed out
    val_source: str | None = None
    # salt of the held-out hash; changing it changes which documents are held out
    split_seed: int = 0
    # DataLoader worker processes per rank for stream sources (0 = tokenize in the training process)
    num_workers: int = 0
    # pin batches when the trainer asks for it (build_data(pin=True)) and CUDA is present
    pin_memory: bool = True
    # keep DataLoader workers alive between iterations
    persistent_workers: bool = True
    # batches each worker prepares ahead
    prefetch_factor: int = 2
    # documents tokenized together in one encode_batch call
    tokenize_batch_docs: int = 64
    # on an unreachable / stalled stream, warn and train on synthetic data instead of failing
    synthetic_on_fail: bool = False
    # seconds allowed for the first training batch of a stream source
    first_batch_timeout_s: float = 120.0
    # stream sources, a read that fails transiently (refused / reset connection, timeout, HTTP 429 / 5xx, truncated
    # body) is retried with exponential backoff and jitter: at most this many failures in a row without progress ...
    retry_max: int = 8
    # ... and at most this many seconds since the outage's first failure; then every rank stops together with a
    # checkpoint and exit code 75 (docs/DATA.md "Remote sources"; must stay below the ranks' agreement timeout)
    retry_max_s: float = 600.0
    # a read of a remote file that receives nothing for this many seconds is a stall (retried)
    read_timeout_s: float = 60.0
    # the first retry waits up to this many seconds (full jitter), each further failure in a row twice as long, at most 30
    retry_backoff_s: float = 0.5
    # where remote shards are copied while they are read (removed after); null: the system's temp directory
    spool_dir: str | None = None
    # attend within documents only (EOS opens a document; docs/NSA.md "Documents"): null = on for a new run
    # whose tokenizer has an EOS, and as the checkpoint was trained when resuming; true / false force it
    document_mask: bool | None = None
    # bin: sources: where a training / validation window may start: any token (random offsets, the default) or
    # the first token of a document (after an EOS, or the file's start): every window then opens with a whole
    # document (docs/DATA.md "Window starts"; what the recall task needs: a far fact is never cut off)
    window_start: str = "any"
    # resuming a checkpoint whose data state was saved under other data settings (seed, source, tokenizer, seq_len,
    # world size of a stream, ...): false refuses the launch; true starts the training data afresh under the new
    # settings (the step, weights and optimizer continue; recorded as data_restarts in metrics.json and checkpoints)
    restart_on_change: bool = False
    # weighted sources instead of data.source (docs/DATA.md "Mixtures"): a list of {name, source, weight} with optional
    # window_start and max_epochs per source; all share data.tokenizer. null: data.source alone
    mixture: list[dict] | None = None
    # weights that change during the run: a list of {at: STEP or decay, weights: {name: weight}} (docs/DATA.md "Stages")
    stages: list[dict] | None = None

    @property
    def source_kind(self) -> str:
        return self.source.split(":", 1)[0]

    @property
    def reads_streams(self) -> bool:
        """Whether data.source, or a source of data.mixture, is a stream (the stream-only keys below apply)."""
        kinds = [str(e.get("source", "")).split(":", 1)[0] for e in self.mixture if isinstance(e, dict)] \
            if self.mixture else [self.source_kind]
        return any(kind not in ("bin", "synthetic") for kind in kinds)

    def validate(self) -> None:
        """The checks of the data section alone; a mixture is checked with the run's steps (train/core/mixture.py)."""
        check_source("data.source", self.source)
        if self.val_source is not None:
            check_source("data.val_source", self.val_source)
            if self.val_source.split(":", 1)[0] in ("synthetic", "bin"):
                raise DataError(f"data.val_source must be a stream source (text:/jsonl:/parquet:/hf:/fineweb_edu), got {self.val_source!r}")
        tok = self.tokenizer
        if not (tok in ("gpt2", "byte") or (tok.startswith("hf:") and len(tok) > 3)):
            raise DataError(f"data.tokenizer must be gpt2, byte or hf:<dir>, got {tok!r}")
        if self.text_sample_by not in TEXT_SAMPLE_BY:
            raise DataError(f"data.text_sample_by must be one of {', '.join(TEXT_SAMPLE_BY)}, got {self.text_sample_by!r}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise DataError(f"data.val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.num_workers < 0:
            raise DataError(f"data.num_workers must be >= 0, got {self.num_workers}")
        if self.prefetch_factor < 1:
            raise DataError(f"data.prefetch_factor must be >= 1, got {self.prefetch_factor}")
        if self.tokenize_batch_docs < 1:
            raise DataError(f"data.tokenize_batch_docs must be >= 1, got {self.tokenize_batch_docs}")
        if not self.first_batch_timeout_s > 0:
            raise DataError(f"data.first_batch_timeout_s must be > 0, got {self.first_batch_timeout_s}")
        if self.retry_max < 0:
            raise DataError(f"data.retry_max must be >= 0, got {self.retry_max}")
        if not self.retry_backoff_s >= 0:
            raise DataError(f"data.retry_backoff_s must be >= 0, got {self.retry_backoff_s}")
        if not self.read_timeout_s > 0:
            raise DataError(f"data.read_timeout_s must be > 0, got {self.read_timeout_s}")
        if not 0 <= self.retry_max_s + self.read_timeout_s <= AGREEMENT_TIMEOUT_S * 0.8:
            raise DataError(f"data.retry_max_s + data.read_timeout_s = {self.retry_max_s + self.read_timeout_s:g}s must be "
                            f"within 0 .. {AGREEMENT_TIMEOUT_S * 0.8:g}s: the other ranks wait at most "
                            f"{AGREEMENT_TIMEOUT_S:g}s for a rank whose reads are failing before the run fails instead of "
                            f"stopping with a checkpoint")
        if self.window_start not in WINDOW_STARTS:
            raise DataError(f"data.window_start must be one of {', '.join(WINDOW_STARTS)}, got {self.window_start!r}")
        if self.window_start != "any" and self.source_kind != "bin" and self.mixture is None:
            raise DataError(f"data.window_start={self.window_start} applies to bin: sources only (this one is "
                            f"{self.source_kind}); drop the key")
        if not self.text_field:
            raise DataError("data.text_field must not be empty")


def check_source(key: str, source: str) -> None:
    kind, _, arg = source.partition(":")
    if kind not in SOURCE_KINDS:
        raise DataError(f"{key}={source!r}: unknown source kind {kind!r} (expected one of: synthetic, bin:DIR, fineweb_edu, text:GLOB, jsonl:GLOB, parquet:GLOB, hf:NAME)")
    needs_arg = kind in ("bin", "text", "jsonl", "parquet", "hf")
    if needs_arg and not arg:
        raise DataError(f"{key}={source!r}: {kind} needs an argument, e.g. {kind}:{'DIR' if kind == 'bin' else 'NAME' if kind == 'hf' else 'data/*.' + kind}")
    if not needs_arg and arg:
        raise DataError(f"{key}={source!r}: {kind} takes no argument")


def resolve_document_mask(configured: bool | None, eos_id: int | None, saved: dict | None) -> tuple[bool, str | None]:
    """data.document_mask -> (on, a one-line note or None). saved: the resumed checkpoint's `data` config
    (None for a new run); a checkpoint written before the key existed was trained without masking.
    DataError when masking is asked for but the data has no EOS to find documents by."""
    if configured and eos_id is None:
        raise DataError("data.document_mask=true needs data whose tokenizer has an EOS (this source has none: "
                        "synthetic tokens?); drop the key or set it to false")
    if saved is None:
        return (eos_id is not None) if configured is None else configured, None
    trained = bool(saved.get("document_mask"))
    if configured is None:
        note = None if trained or eos_id is None else (
            "data.document_mask: resuming without document masking, as the checkpoint was trained "
            "(--data.document_mask=true turns it on from here)")
        return trained, note
    if configured != trained:
        return configured, (f"data.document_mask={str(configured).lower()}: the checkpoint was trained "
                            f"{'without' if configured else 'with'} document masking; training continues "
                            f"{'with' if configured else 'without'} it")
    return configured, None
