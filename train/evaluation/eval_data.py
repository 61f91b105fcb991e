"""The token stream an evaluation scores, and the UTF-8 size of the text it was made from.

    bin:DIR                    -> DIR/<split>.bin through meta.json; bytes: the split's text_bytes
    text:GLOB | jsonl:GLOB | parquet:GLOB
                               -> every document of the matched files, tokenized as prepare writes
                                  them (train.data.prepare.encode_documents: each followed by EOS);
                                  bytes: counted from the documents

A byte count is reported only when it is the count of exactly the tokens scored: not for a stream
cut by max_tokens, nor for a directory whose meta.json predates per-split text_bytes.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from train.core.errors import DataError
from train.data.build import check_prepared_tokenizer
from train.data.meta import SPLITS, read_meta, split_tokens
from train.data.preparation import document_chunks, encode_documents
from train.data.tokenizers import load_tokenizer

DOCUMENT_KINDS = ("text", "jsonl", "parquet")
KINDS = ("bin", *DOCUMENT_KINDS)


@dataclass
class EvalTokens:
    tokens: np.ndarray  # [N] token ids (the token files' dtype; a memmap for bin:)
    id_bound: int  # no id exceeds this
    text_bytes: int | None  # UTF-8 bytes of the text of `tokens`, EOS excluded; None when unknown
    bytes_from: str | None  # where text_bytes comes from: "meta.json" | "documents" | None
    note: str | None  # why text_bytes is unknown
    mask: np.ndarray | None = None  # [N] uint8: the split's loss mask (only targets marked 1 are scored)


def data_kind(spec: str) -> str:
    kind, sep, arg = spec.partition(":")
    if not sep or not arg or kind not in KINDS:
        raise DataError(f"--data {spec!r}: expected bin:DIR, text:GLOB, jsonl:GLOB or parquet:GLOB")
    return kind


def load_eval_tokens(spec: str, *, tokenizer_name: str, split: str | None, text_field: str, text_sample_by: str,
                     max_tokens: int | None) -> EvalTokens:
    """The stream named by `spec` (see the module doc), its first max_tokens tokens when given."""
    kind, _, arg = spec.partition(":")
    if kind == "bin":
        return _bin_tokens(Path(arg), tokenizer_name, split, max_tokens)
    return _document_tokens(spec, tokenizer_name, text_field, text_sample_by, max_tokens)


def _bin_tokens(data_dir: Path, tokenizer_name: str, split: str, max_tokens: int | None) -> EvalTokens:
    if split not in SPLITS:
        raise DataError(f"--split {split!r}: a prepared directory has the splits {', '.join(SPLITS)}")
    meta = read_meta(data_dir)
    check_prepared_tokenizer(data_dir, meta.tokenizer, tokenizer_name, "the checkpoint",
                             f"prepare the text with --tokenizer {tokenizer_name}")
    n = split_tokens(data_dir, meta, split)
    tokens = np.memmap(data_dir / meta.splits[split].file, dtype=meta.np_dtype, mode="r", shape=(n,)) if n \
        else np.zeros(0, meta.np_dtype)
    split_bytes = (meta.raw.get("splits", {}).get(split) or {}).get("text_bytes")
    mask = None
    if meta.splits[split].loss_mask and n:
        path = data_dir / meta.splits[split].loss_mask
        if not path.is_file() or path.stat().st_size != n:
            raise DataError(f"{path}: a loss mask must hold one byte per token of {meta.splits[split].file} ({n})")
        mask = np.memmap(path, dtype=np.uint8, mode="r", shape=(n,))
        mask = mask[:max_tokens] if max_tokens is not None else mask
    if mask is not None:
        tokens = tokens[:max_tokens] if max_tokens is not None else tokens
        split_bytes = None
        note = f"{data_dir} split {split} has a loss mask: only its targets are scored, bits per byte do not apply"
    elif max_tokens is not None and max_tokens < n:
        tokens, split_bytes = tokens[:max_tokens], None
        note = f"--max_tokens {max_tokens} cut the split; the text size of a prefix is not recorded"
    elif split_bytes is None:
        note = (f"{data_dir} records no text_bytes for split {split} (prepared before per-split byte counts, "
                f"or a legacy meta.pkl); prepare it again for bits per byte")
    else:
        note = None
    return EvalTokens(tokens=tokens, id_bound=meta.id_bound, text_bytes=split_bytes,
                      bytes_from="meta.json" if split_bytes is not None else None, note=note, mask=mask)


def _document_tokens(spec: str, tokenizer_name: str, text_field: str, text_sample_by: str,
                     max_tokens: int | None) -> EvalTokens:
    tokenizer = load_tokenizer(tokenizer_name)
    parts, n_tokens, text_bytes = [], 0, 0
    n_kept = max_tokens if max_tokens is not None else np.iinfo(np.int64).max
    for texts in document_chunks(spec, subset=None, split="train", text_field=text_field,
                                 text_sample_by=text_sample_by):
        encoded = encode_documents(tokenizer, texts)
        parts.append(encoded.tokens)
        n_tokens, text_bytes = n_tokens + len(encoded.tokens), text_bytes + encoded.text_bytes
        if n_tokens >= n_kept:
            break
    tokens = np.concatenate(parts) if parts else np.zeros(0, np.int64)  # [N]
    if len(tokens) > n_kept:
        tokens = tokens[:n_kept]  # byte counts are per chunk of documents: the kept part's is not known
        return EvalTokens(tokens=tokens, id_bound=int(tokens.max()), text_bytes=None, bytes_from=None,
                          note=f"--max_tokens {max_tokens} cut the documents' tokens; the text size of the part "
                               f"kept is not known")
    return EvalTokens(tokens=tokens, id_bound=int(tokens.max()) if len(tokens) else -1, text_bytes=text_bytes,
                      bytes_from="documents", note=None)
