"""The recall task: documents of key-value facts, each later asked for at a controlled distance.

A document is lines of two kinds, in one of FORMATS (RecallSpec.format):

    kv (five characters a line with the byte tokenizer)
      qx=M                                   a fact: key "qx" (two lowercase letters, unique in the document)
                                             holds value "M" (A-Z)
      qx?M                                   a query: the same key asked again; its value is the answer
    prose (sentences, for models trained on natural text)
      The code of qx is M.                   a fact
      What is the code of qx? It is M.       a query

Every query's fact lies `distance` tokens before it (answer token to the fact's value token). Distances are
drawn bucket first: the buckets are [1, w) (inside the sliding window) and [w, 2w), [2w, 4w), ... up to
`max_windows` windows (w = the model's window, nsa.w), then uniformly inside the bucket, so far items are as
common as near ones. Lines that no query uses are facts never asked for (distractors). Keys are unique in a
document, so every answer is determined by the document alone and chance is 1 / len(VALUES).

Any tokenizer: each line is encoded as three segments (the format's fact or query prefix with its key, the
value, the line's end) encoded separately and concatenated, so the answer's tokens are known exactly (with the
byte tokenizer a kv line is 5 tokens).

Training documents (`corpus_document`) have a length drawn log-uniformly from 2 lines to the longest that
fits `doc_tokens`: short documents teach the lookup where it is easy, long ones stretch it (a curriculum by
mixture, no schedule). Scoring documents (`probe_document`) are always the longest. Scoring itself lives in
train/evaluation/recall.py; the corpus is written by `python -m train.recall make`.
"""
from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from train.core.errors import DataError
from train.data.meta import dtype_for_vocab
from train.data.preparation import EncodedDocuments, SplitWriter, build_meta

LETTERS = "abcdefghijklmnopqrstuvwxyz"
KEYS = tuple(a + b for a in LETTERS for b in LETTERS)  # 676
VALUES = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
FACT, QUERY = "=", "?"  # the marks of document_lines' (key, mark, value) lines; kv's own spelling too


@dataclass(frozen=True)
class LineFormat:
    """How a line is spelled: prefix (by mark, with the key), the value, the line's end."""

    fact: str  # with {key}
    query: str  # with {key}
    value: str  # with {value}
    end: str

    def prefix(self, key: str, mark: str) -> str:
        return (self.fact if mark == FACT else self.query).format(key=key)


DEFAULT_FORMAT = "kv"
FORMATS = {
    "kv": LineFormat(fact="{key}=", query="{key}?", value="{value}", end="\n"),
    "prose": LineFormat(fact="The code of {key} is", query="What is the code of {key}? It is", value=" {value}",
                        end=".\n"),
}
META_KEY = "recall"  # meta.json of a recall corpus: its RecallSpec under this key


@dataclass(frozen=True)
class RecallSpec:
    """What a recall corpus and its probe are made of (stored in the corpus's meta.json under META_KEY)."""

    window: int  # the model's sliding window in tokens (nsa.w): distance buckets are multiples of it
    doc_tokens: int  # the longest document, in tokens (at most the training seq_len)
    max_windows: int = 8  # the farthest recall, in windows
    query_share: float = 0.5  # the share of a document's lines that try to become queries
    format: str = DEFAULT_FORMAT  # how lines are spelled: a key of FORMATS

    def validate(self) -> None:
        if self.window < 1 or self.doc_tokens < 2 * LINE_TOKENS_MIN:
            raise ValueError(f"recall: window {self.window} and doc_tokens {self.doc_tokens} leave no room for a "
                             f"fact and its query")
        if self.max_windows < 1:
            raise ValueError(f"recall: max_windows must be >= 1, got {self.max_windows}")
        if not 0 < self.query_share <= 0.5:
            raise ValueError(f"recall: query_share must be in (0, 0.5], got {self.query_share}")
        if self.format not in FORMATS:
            raise ValueError(f"recall: format must be one of {', '.join(FORMATS)}, got {self.format!r}")

    def buckets(self) -> list[tuple[int, int]]:
        """[lo, hi) distance ranges in tokens: inside the window, then doubling multiples of it."""
        edges = [1, self.window]
        while edges[-1] < self.max_windows * self.window:
            edges.append(edges[-1] * 2)
        return list(zip(edges[:-1], edges[1:]))

    def to_dict(self) -> dict:
        return asdict(self)

    def at_length(self, multiple: int) -> "RecallSpec":
        """The probe at `multiple` times the training length: documents of multiple x (doc_tokens + 1) - 1 tokens
        (the + 1: the EOS before each), distance buckets doubling on up to the longest document (never fewer than
        this spec's). multiple 1: this spec."""
        if multiple < 1:
            raise ValueError(f"recall: a length multiple must be >= 1, got {multiple}")
        if multiple == 1:
            return self
        doc_tokens = multiple * (self.doc_tokens + 1) - 1
        return replace(self, doc_tokens=doc_tokens, max_windows=max(self.max_windows, doc_tokens // self.window))


LINE_TOKENS_MIN = 3  # key+mark, value, newline: one token each at least


def bucket_name(lo: int, hi: int, window: int) -> str:
    """'<1w' for the window's own bucket, else '1-2w', '2-4w', ..."""
    return "<1w" if lo < window else f"{lo // window}-{hi // window}w"


@dataclass
class EncodedRecall:
    """One document's token ids and its answers (positions are indices into `ids`)."""

    ids: np.ndarray  # [n] int64
    answer_start: np.ndarray  # [q] first token of each query's value
    answer_len: np.ndarray  # [q] tokens of the value
    distance: np.ndarray  # [q] answer_start minus the fact's value start, in tokens


class RecallEncoder:
    """Token ids of lines in one format, cached per segment (prefix with its key, value, end) for one tokenizer."""

    def __init__(self, tokenizer, line_format: str = DEFAULT_FORMAT):
        self.tokenizer = tokenizer
        self.format = FORMATS[line_format]
        f = self.format
        prefixes = [f.prefix(k, m) for k in KEYS for m in (FACT, QUERY)]
        values = [f.value.format(value=v) for v in VALUES]
        segments = prefixes + values + [f.end]
        self._ids = dict(zip(segments, (list(ids) for ids in tokenizer.encode_batch(segments))))
        self.line_tokens = max(len(self._ids[p]) for p in prefixes) + max(len(self._ids[v]) for v in values) \
            + len(self._ids[f.end])  # the longest line

    def encode(self, lines: list[tuple[str, str, str]]) -> EncodedRecall:
        """lines: (key, mark, value) -> ids and each query's answer span and distance."""
        ids: list[int] = []
        value_at: dict[str, int] = {}
        starts, lens, distances = [], [], []
        for key, mark, value in lines:
            ids += self._ids[self.format.prefix(key, mark)]
            value_ids = self._ids[self.format.value.format(value=value)]
            if mark == FACT:
                value_at[key] = len(ids)
            else:
                starts.append(len(ids))
                lens.append(len(value_ids))
                distances.append(len(ids) - value_at[key])
            ids += value_ids + self._ids[self.format.end]
        return EncodedRecall(np.asarray(ids, dtype=np.int64), np.asarray(starts, dtype=np.int64),
                             np.asarray(lens, dtype=np.int64), np.asarray(distances, dtype=np.int64))


def document_lines(rng: random.Random, n_lines: int, spec: RecallSpec, line_tokens: int) -> list[tuple[str, str, str]]:
    """n_lines lines (at most len(KEYS)): queries placed bucket first at distances up to the farthest bucket
    (in lines of `line_tokens` tokens), the rest facts never asked for."""
    n_lines = min(n_lines, len(KEYS))
    slots: list[tuple[str, str, str] | None] = [None] * n_lines
    keys = iter(rng.sample(KEYS, n_lines))
    buckets = line_buckets(spec, line_tokens)
    for _ in range(int(n_lines * spec.query_share * 2)):  # tries; collisions leave a slot a distractor
        lo, hi = rng.choice(buckets)  # in lines
        if lo >= min(hi, n_lines):  # beyond the document, or a bucket narrower than a line
            continue
        back = rng.randrange(lo, min(hi, n_lines))
        at = rng.randrange(back, n_lines)
        if slots[at] is None and slots[at - back] is None:
            key, value = next(keys), rng.choice(VALUES)
            slots[at - back], slots[at] = (key, FACT, value), (key, QUERY, value)
    return [slot if slot is not None else (next(keys), FACT, rng.choice(VALUES)) for slot in slots]


def line_buckets(spec: RecallSpec, line_tokens: int) -> list[tuple[int, int]]:
    """spec.buckets() in lines of `line_tokens` tokens: [lo, hi) query-to-fact distances a document can place."""
    return [(max(1, lo // line_tokens), max(1, -(-hi // line_tokens))) for lo, hi in spec.buckets()]


def max_lines(spec: RecallSpec, encoder: RecallEncoder) -> int:
    return min(len(KEYS), spec.doc_tokens // encoder.line_tokens)


def check_queries_fit(spec: RecallSpec, encoder: RecallEncoder) -> None:
    """A DataError (one line) when the longest document cannot hold a query at any bucket's distance: its lines
    would all be facts, and a corpus of them has no recall target at all."""
    n_lines = max_lines(spec, encoder)
    if not any(lo < min(hi, n_lines) for lo, hi in line_buckets(spec, encoder.line_tokens)):
        raise DataError(f"recall: a document of {spec.doc_tokens} tokens holds {n_lines} line(s) of "
                        f"{encoder.line_tokens} tokens ({spec.format} format), too few for a query at any distance "
                        f"between 1 and {spec.max_windows} windows of {spec.window}; raise --seq_len or --window, or "
                        f"use a format or tokenizer with shorter lines")


def corpus_document(rng: random.Random, spec: RecallSpec, encoder: RecallEncoder) -> EncodedRecall:
    """A training document: 2 .. max_lines lines, log-uniform (short and long documents alike)."""
    longest = max_lines(spec, encoder)
    n = int(round(math.exp(rng.uniform(math.log(2), math.log(max(2, longest))))))
    return encoder.encode(document_lines(rng, n, spec, encoder.line_tokens))


def probe_document(rng: random.Random, spec: RecallSpec, encoder: RecallEncoder) -> EncodedRecall:
    """A scoring document: the longest, so every bucket is represented."""
    return encoder.encode(document_lines(rng, max_lines(spec, encoder), spec, encoder.line_tokens))


LOSS_ON = ("answers", "all")  # the first is the default: the setting the dense twin learns the task with


def write_corpus(out, spec: RecallSpec, tokenizer, *, train_tokens: int, val_tokens: int, seed: int = 0,
                 loss_on: str = LOSS_ON[0]) -> dict:
    """A prepared directory (train.bin, val.bin, meta.json; docs/DATA.md) of recall documents, each followed by
    EOS like prepare's; the splits come from different seeds. loss_on="answers" (the default) also writes each
    split's loss mask (<split>.mask.bin: 1 on the answers' tokens only), so training sees only the recall
    targets; "all" trains on every token (keys and values are random: noise the dense twin did not get past).
    Returns meta. `out` must not hold a meta.json."""
    if loss_on not in LOSS_ON:
        raise DataError(f"recall: loss_on must be one of {', '.join(LOSS_ON)}, got {loss_on!r}")
    spec.validate()
    out = Path(out)
    if (out / "meta.json").exists():
        raise DataError(f"{out} already holds a prepared dataset (meta.json); choose another --out")
    started = time.perf_counter()
    encoder = RecallEncoder(tokenizer, spec.format)
    check_queries_fit(spec, encoder)
    dtype = np.dtype(dtype_for_vocab(tokenizer.n_vocab))
    out.mkdir(parents=True, exist_ok=True)
    splits, max_id = {}, -1
    for offset, (name, budget) in enumerate((("train", train_tokens), ("val", val_tokens))):
        rng, writer = random.Random(seed * 2 + offset), SplitWriter(out, name, dtype)
        mask_path = out / f"{name}.mask.bin"
        mask_partial = mask_path.with_suffix(".bin.partial")
        mask_file = open(mask_partial, "wb") if loss_on == "answers" else None
        targets = 0
        try:
            while writer.tokens < budget:
                docs = [corpus_document(rng, spec, encoder) for _ in range(256)]
                tokens = np.concatenate([piece for d in docs for piece in (d.ids, [tokenizer.eos_id])])
                writer.write(EncodedDocuments(tokens=tokens.astype(dtype), documents=len(docs),
                                              text_bytes=sum(len(tokenizer.decode(d.ids.tolist()).encode()) for d in docs)))
                if mask_file is not None:
                    masks = [_answer_mask(d) for d in docs]
                    mask = np.concatenate([piece for m in masks for piece in (m, np.zeros(1, np.uint8))])
                    mask_file.write(mask.tobytes())
                    targets += int(mask.sum())
        except BaseException:
            writer.abort()
            if mask_file is not None:
                mask_file.close()
                mask_partial.unlink(missing_ok=True)
            raise
        max_id = max(max_id, writer.max_id)
        splits[name] = writer.finish()
        if mask_file is not None:
            mask_file.close()
            os.replace(mask_partial, mask_path)
            splits[name].update(loss_mask=mask_path.name, loss_targets=targets)
    meta = build_meta(tokenizer, dtype.name, max_id, splits, source="recall", subset=None,
                      split="train", text_field="text", text_sample_by="document", split_seed=seed,
                      val_fraction=val_tokens / max(1, train_tokens + val_tokens), max_docs=None,
                      seconds=time.perf_counter() - started)
    meta[META_KEY] = {**spec.to_dict(), "loss_on": loss_on}
    tmp = out / "meta.json.partial"
    tmp.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, out / "meta.json")
    return meta


def _answer_mask(doc: EncodedRecall) -> np.ndarray:
    """[n] uint8: 1 on the tokens of every answer (the loss mask of loss_on="answers")."""
    mask = np.zeros(len(doc.ids), dtype=np.uint8)
    for start, n in zip(doc.answer_start.tolist(), doc.answer_len.tolist()):
        mask[start:start + n] = 1
    return mask
