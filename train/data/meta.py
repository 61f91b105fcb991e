"""Metadata of a prepared token directory (train.bin, val.bin + meta.json or a legacy meta.pkl).

meta.json (written by train.data.prepare) is authoritative: token dtype, counts, checksums,
tokenizer. nanoGPT directories with only meta.pkl are read through a restricted unpickler
that admits plain dict/list/str/int/float data and refuses everything else (no code runs).
"""
from __future__ import annotations

import io
import json
import pickle
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from train.core.errors import DataError

FORMAT = "nsa-tokens"
FORMAT_VERSION = 1
SPLITS = ("train", "val")
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def dtype_for_vocab(n_vocab: int) -> str:
    """uint16 when every id fits (n_vocab <= 65536), else uint32."""
    return "uint16" if n_vocab <= 2**16 else "uint32"


@dataclass
class SplitInfo:
    file: str
    tokens: int | None  # None for legacy directories (derived from the file size)
    sha256: str | None = None
    documents: int | None = None
    loss_mask: str | None = None  # a uint8 file beside `file`, one byte per token: 0 = not a training target


@dataclass
class BinMeta:
    dtype: str
    vocab_size: int  # tokenizer size the ids were written with (ids < vocab_size)
    max_token_id: int | None
    tokenizer: str | None
    eos_id: int | None
    splits: dict[str, SplitInfo] = field(default_factory=dict)
    legacy: bool = False
    raw: dict = field(default_factory=dict)

    @property
    def np_dtype(self):
        return DTYPES[self.dtype]

    @property
    def id_bound(self) -> int:
        """Largest id the data may hold, from metadata."""
        return self.max_token_id if self.max_token_id is not None else self.vocab_size - 1


class _PlainDataUnpickler(pickle.Unpickler):
    ALLOWED = {("builtins", name) for name in ("dict", "list", "str", "int", "float")}

    def find_class(self, module, name):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def load_plain_pickle(path: Path):
    """Unpickle data made only of dict/list/str/int/float; anything else raises DataError.

    find_class admits no callable but those five types, so no code can run while loading; the
    loaded tree is then checked too, since sets, tuples, bytes, None arrive by opcode, not by name.
    """
    try:
        data = _PlainDataUnpickler(io.BytesIO(path.read_bytes())).load()
        _check_plain(data)
        return data
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, ImportError, IndexError, KeyError) as e:
        raise DataError(f"{path}: refused to unpickle ({e}); only plain dict/list/str/int/float metadata is accepted") from None


def _check_plain(value) -> None:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif not isinstance(item, (str, int, float)):
            raise pickle.UnpicklingError(f"a {type(item).__name__} value is not plain metadata")


def read_meta(data_dir: Path) -> BinMeta:
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(f"data directory {data_dir} does not exist (prepare it with python -m train.data.prepare --out {data_dir} ...)")
    if (data_dir / "meta.json").is_file():
        return _read_meta_json(data_dir / "meta.json")
    if (data_dir / "meta.pkl").is_file():
        return _read_meta_pkl(data_dir / "meta.pkl")
    raise DataError(f"{data_dir}: metadata missing (no meta.json or meta.pkl); the token dtype and vocabulary cannot be known")


def _read_meta_json(path: Path) -> BinMeta:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not valid JSON ({e})") from None
    try:
        if raw.get("format") != FORMAT:
            raise DataError(f"{path}: format is {raw.get('format')!r}, expected {FORMAT!r}")
        dtype = raw["dtype"]
        if dtype not in DTYPES:
            raise DataError(f"{path}: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        splits = {name: SplitInfo(file=s["file"], tokens=int(s["tokens"]), sha256=s.get("sha256"), documents=s.get("documents"),
                                  loss_mask=s.get("loss_mask"))
                  for name, s in raw["splits"].items()}
        meta = BinMeta(dtype=dtype, vocab_size=int(raw["vocab_size"]), max_token_id=raw.get("max_token_id"),
                       tokenizer=raw.get("tokenizer"), eos_id=raw.get("eos_id"), splits=splits, raw=raw)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise DataError(f"{path}: malformed metadata ({type(e).__name__}: {e})") from None
    for name in SPLITS:
        if name not in meta.splits:
            raise DataError(f"{path}: no entry for split {name!r}")
    return meta


def _read_meta_pkl(path: Path) -> BinMeta:
    raw = load_plain_pickle(path)
    if not isinstance(raw, dict) or not isinstance(raw.get("vocab_size"), int):
        raise DataError(f"{path}: legacy metadata must be a dict with an int vocab_size")
    vocab = raw["vocab_size"]
    # nanoGPT writes uint16 unless told otherwise; a legacy file may name its dtype.
    dtype = raw.get("dtype", "uint16")
    if dtype not in DTYPES:
        raise DataError(f"{path}: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if vocab > 2**16 and dtype == "uint16":
        raise DataError(f"{path}: vocab_size {vocab} does not fit the uint16 token files")
    eos = raw.get("eos_id", raw.get("eos_token_id"))
    return BinMeta(dtype=dtype, vocab_size=vocab, max_token_id=None, tokenizer=raw.get("tokenizer"),
                   eos_id=eos if isinstance(eos, int) else None,
                   splits={name: SplitInfo(file=f"{name}.bin", tokens=None) for name in SPLITS}, legacy=True, raw=raw)


def split_tokens(data_dir: Path, meta: BinMeta, split: str) -> int:
    """Token count of a split, checking the file exists and its size matches the metadata."""
    info = meta.splits[split]
    path = Path(data_dir) / info.file
    if not path.is_file():
        raise DataError(f"{path} is missing")
    itemsize = np.dtype(meta.np_dtype).itemsize
    size = path.stat().st_size
    if info.tokens is None:
        if size % itemsize:
            raise DataError(f"{path}: size {size} B is not a multiple of {itemsize} ({meta.dtype}); the file is truncated")
        return size // itemsize
    if size != info.tokens * itemsize:
        raise DataError(f"{path}: size {size} B but metadata says {info.tokens} {meta.dtype} tokens ({info.tokens * itemsize} B); truncated or altered")
    return info.tokens
