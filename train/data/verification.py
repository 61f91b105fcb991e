"""Check a prepared token directory against its metadata.

The command line, usage and details: train/data/verify.py (its docstring).
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from train.core.errors import DataError
from train.data.meta import SPLITS, dtype_for_vocab, read_meta

READ_BYTES = 64 << 20


def scan(path: Path, dtype) -> tuple[str, int]:
    """(sha256, max id) of a token file, read in bounded chunks."""
    sha, max_id, itemsize = hashlib.sha256(), -1, np.dtype(dtype).itemsize
    with open(path, "rb") as f:
        while chunk := f.read(READ_BYTES - READ_BYTES % itemsize):
            sha.update(chunk)
            usable = len(chunk) - len(chunk) % itemsize
            if usable:
                max_id = max(max_id, int(np.frombuffer(chunk[:usable], dtype=dtype).max()))
    return sha.hexdigest(), max_id


def verify(data_dir: Path, model_vocab: int | None = None) -> list[str]:
    """Problems found, one line each; empty when the directory is consistent."""
    try:
        meta = read_meta(data_dir)
    except DataError as e:
        return [str(e)]
    problems = []
    if meta.vocab_size > 2**16 and meta.dtype == "uint16":
        problems.append(f"dtype uint16 cannot hold a vocabulary of {meta.vocab_size} (needs {dtype_for_vocab(meta.vocab_size)})")
    if model_vocab is not None and meta.vocab_size > model_vocab:
        problems.append(f"tokenizer vocabulary {meta.vocab_size} exceeds the model's vocab_size {model_vocab}")
    itemsize = np.dtype(meta.np_dtype).itemsize
    seen_max = -1
    for split in SPLITS:
        info = meta.splits[split]
        path = Path(data_dir) / info.file
        if not path.is_file():
            problems.append(f"{path}: missing")
            continue
        size = path.stat().st_size
        if info.tokens is not None and size != info.tokens * itemsize:
            problems.append(f"{path}: {size} B but meta.json says {info.tokens} {meta.dtype} tokens = {info.tokens * itemsize} B")
        elif size % itemsize:
            problems.append(f"{path}: {size} B is not a whole number of {meta.dtype} tokens")
        sha, max_id = scan(path, meta.np_dtype)
        if info.sha256 is not None and sha != info.sha256:
            problems.append(f"{path}: sha256 {sha[:16]}… does not match meta.json {info.sha256[:16]}…")
        if max_id >= meta.vocab_size:
            problems.append(f"{path}: token id {max_id} >= tokenizer vocabulary {meta.vocab_size}")
        if model_vocab is not None and max_id >= model_vocab:
            problems.append(f"{path}: token id {max_id} >= model vocab_size {model_vocab}")
        seen_max = max(seen_max, max_id)
        if size == 0 and (split == "train" or meta.raw.get("val_fraction", 1) != 0):  # val_fraction 0: none wanted
            problems.append(f"{path}: the {split} split is empty (0 tokens): "
                            + ("evaluation would have nothing to score; prepare again (one file: its tail is held out)"
                               if split == "val" else "nothing to train on"))
    if meta.max_token_id is not None and not problems and seen_max != meta.max_token_id:
        problems.append(f"largest id in the files is {seen_max} but meta.json says max_token_id {meta.max_token_id}")
    return problems
