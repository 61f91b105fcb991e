"""data.window_start=document: every window of a bin: source opens at a document's first token."""
import json

import numpy as np
import pytest

from train.core.errors import DataError
from train.data import DataConfig, build_data
from train.data.memmap import MemmapStream, document_starts
from train.data.meta import FORMAT, FORMAT_VERSION

T, EOS, VOCAB = 16, 999, 1024


def _packed_dir(path, doc_lengths, seed=0):
    """A bin: directory of random documents (ids 1..500) each followed by EOS; returns (dir, train tokens)."""
    rng = np.random.default_rng(seed)
    tokens = np.concatenate([np.append(rng.integers(1, 500, n), EOS) for n in doc_lengths]).astype(np.uint16)
    path.mkdir(parents=True)
    tokens.tofile(path / "train.bin")
    tokens.tofile(path / "val.bin")
    splits = {name: {"file": f"{name}.bin", "tokens": len(tokens)} for name in ("train", "val")}
    (path / "meta.json").write_text(json.dumps({"format": FORMAT, "version": FORMAT_VERSION, "tokenizer": "byte",
                                                "eos_id": EOS, "vocab_size": 1000, "dtype": "uint16",
                                                "max_token_id": EOS, "splits": splits}))
    return path, tokens


def _build(d, window_start="document", **kw):
    args = dict(seq_len=T, batch_size=8, vocab_size=VOCAB, seed=5)
    return build_data(DataConfig(source=f"bin:{d}", tokenizer="byte", window_start=window_start), **{**args, **kw})


def test_document_starts_is_every_position_after_an_eos_and_zero():
    tokens = np.array([3, EOS, 4, 5, EOS, EOS, 6, 7, 8, EOS, 9], dtype=np.uint16)
    assert document_starts(tokens, EOS, last=10).tolist() == [0, 2, 5, 6, 10]
    assert document_starts(tokens, EOS, last=6).tolist() == [0, 2, 5, 6]  # a start must leave room for a window
    assert document_starts(tokens, EOS, last=10, chunk=3).tolist() == [0, 2, 5, 6, 10]  # chunk edges lose nothing


def test_every_window_opens_a_document_and_every_start_is_drawn(tmp_path):
    lengths = [3, 40, 7, 1, 25, 9, 60, 2, 15, 30] * 3
    d, tokens = _packed_dir(tmp_path / "docs", lengths)
    starts = {0} | {int(p) + 1 for p in np.flatnonzero(tokens == EOS)}
    fits = {s for s in starts if s + T + 1 <= len(tokens)}
    bundle = _build(d)
    seen = set()
    for _ in range(200):
        x, y = bundle.train.next_batch()
        for row in x.numpy():
            hits = [s for s in fits if np.array_equal(tokens[s:s + T], row)]
            assert hits, "a window that does not open a document"
            seen.update(hits)
    assert seen == fits  # every document start is drawn, none beyond the last whole window
    assert bundle.describe()["train_window_starts"] == len(fits)


def test_the_default_still_starts_anywhere(tmp_path):
    d, tokens = _packed_dir(tmp_path / "docs", [50] * 20)
    starts = {0} | {int(p) + 1 for p in np.flatnonzero(tokens == EOS)}
    bundle = _build(d, window_start="any")
    opened = [tuple(row) for _ in range(20) for row in bundle.train.next_batch()[0].numpy()]
    firsts = {tuple(tokens[s:s + T]) for s in starts}
    assert sum(row in firsts for row in opened) < len(opened) // 2  # 1 in 51 by chance


def test_ranks_together_read_the_one_rank_batch(tmp_path):
    d, _ = _packed_dir(tmp_path / "docs", [5, 20, 11, 3, 40] * 10)
    one = _build(d, batch_size=8).train
    two = [_build(d, batch_size=4, world_size=2, rank=r).train for r in range(2)]  # batch_size is per rank
    for _ in range(5):
        x = one.next_batch()[0]
        parts = [s.next_batch()[0] for s in two]
        assert np.array_equal(x.numpy(), np.concatenate([p.numpy() for p in parts]))


def test_refusals_are_data_errors_in_one_line(tmp_path):
    with pytest.raises(DataError, match="applies to bin: sources only"):
        DataConfig(source="synthetic", window_start="document").validate()
    with pytest.raises(DataError, match="must be one of any, document"):
        DataConfig(source="bin:x", window_start="documents").validate()
    d, _ = _packed_dir(tmp_path / "long", [200, 200])  # the second document starts too late for a window
    assert MemmapStream(d / "train.bin", dtype=np.uint16, n_tokens=402, seq_len=300, batch_size=1, seed=0,
                        document_starts_eos=EOS).starts.tolist() == [0]
    d, _ = _packed_dir(tmp_path / "short", [10, 10])
    meta = json.loads((d / "meta.json").read_text())
    meta["eos_id"] = None
    (d / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="needs documents separated by EOS"):
        _build(d)
