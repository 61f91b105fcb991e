"""prepare -> train.bin/val.bin/meta.json -> verify -> bin: loader (memmap, random offsets)."""
import io
import json
import pickle

import numpy as np
import pytest
import torch

from tests.data.conftest import write_texts
from train.data import DataConfig, build_data
from train.data.meta import dtype_for_vocab, load_plain_pickle, read_meta
from train.data.preparation import prepare
from train.data.sources import is_held_out
from train.data.verify import main as verify_main
from train.data.verification import verify
from train.core.errors import DataError


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, request):
    docs = request.getfixturevalue("docs")
    root = tmp_path_factory.mktemp("prep")
    source = write_texts(root / "src", docs)
    out = root / "gpt2"
    prepare(source, "gpt2", out, val_fraction=0.2, split_seed=7, workers=1)
    return out, docs, source


def _build(out, **kw):
    args = dict(seq_len=32, batch_size=4, vocab_size=50304, seed=3)
    args.update(kw)
    return build_data(DataConfig(source=f"bin:{out}", tokenizer="gpt2"), **args)


def test_prepare_writes_documents_with_eos_and_complete_metadata(prepared, gpt2):
    out, docs, source = prepared
    meta = json.loads((out / "meta.json").read_text())
    val_docs = [d for d in docs if is_held_out(d, 7, 0.2)]
    train_docs = [d for d in docs if not is_held_out(d, 7, 0.2)]
    assert val_docs and train_docs
    for split, chosen in (("train", train_docs), ("val", val_docs)):
        expected = np.concatenate([ids + [gpt2.eos_id] for ids in gpt2.encode_batch(chosen)]).astype(np.uint16)
        np.testing.assert_array_equal(np.fromfile(out / f"{split}.bin", dtype=np.uint16), expected)
        assert meta["splits"][split]["tokens"] == len(expected) and meta["splits"][split]["documents"] == len(chosen)
    assert (meta["tokenizer"], meta["eos_id"], meta["vocab_size"], meta["dtype"]) == ("gpt2", 50256, 50257, "uint16")
    assert meta["split_seed"] == 7 and meta["source"] == source and meta["max_token_id"] <= 50256
    assert verify(out) == []


def test_prepare_with_workers_is_identical_and_max_docs_stops(prepared, tmp_path):
    out, docs, source = prepared
    prepare(source, "gpt2", tmp_path / "w2", val_fraction=0.2, split_seed=7, workers=2)
    for split in ("train", "val"):
        assert (tmp_path / "w2" / f"{split}.bin").read_bytes() == (out / f"{split}.bin").read_bytes()
    meta = prepare(source, "gpt2", tmp_path / "few", val_fraction=0.0, workers=1, max_docs=3)
    assert meta["splits"]["train"]["documents"] == 3 and meta["splits"]["val"]["tokens"] == 0
    with pytest.raises(DataError, match="already holds"):
        prepare(source, "gpt2", tmp_path / "few", workers=1)


def test_dtype_follows_the_vocabulary(tmp_path, docs):
    assert dtype_for_vocab(50257) == "uint16" and dtype_for_vocab(65536) == "uint16"
    assert dtype_for_vocab(65537) == "uint32" and dtype_for_vocab(128256) == "uint32"
    from tests.data.test_tokenizers import _save_tiny_hf_tokenizer

    tok_dir = _save_tiny_hf_tokenizer(tmp_path / "big_tok", n_words=70000)
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("w1 w69999 w65536 w3")
    meta = prepare(f"text:{src}/*.txt", f"hf:{tok_dir}", tmp_path / "big", val_fraction=0.0, workers=1)
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70002
    ids = np.fromfile(tmp_path / "big" / "train.bin", dtype=np.uint32)
    np.testing.assert_array_equal(ids, [1, 69999, 65536, 3, 70001])
    assert verify(tmp_path / "big") == []


def test_memmap_batches_are_windows_of_the_file(prepared):
    out, _, _ = prepared
    bundle = _build(out)
    tokens = np.fromfile(out / "train.bin", dtype=np.uint16).astype(np.int64)
    stream = bundle.train
    for step in range(3):
        offsets = stream.offsets_at(step)
        x, y = stream.next_batch()
        assert x.dtype == torch.int64 and x.shape == (4, 32)
        for row, o in enumerate(offsets):
            np.testing.assert_array_equal(x[row].numpy(), tokens[o:o + 32])
            np.testing.assert_array_equal(y[row].numpy(), tokens[o + 1:o + 33])
    info = bundle.describe()
    json.dumps(info)
    assert info["token_dtype"] == "uint16" and info["train_tokens"] == len(tokens)


def test_memmap_is_deterministic_resumable_and_every_rank_samples_the_whole_file(prepared):
    out, _, _ = prepared
    a, b = _build(out), _build(out)
    batches = [a.train.next_batch() for _ in range(5)]
    buf = io.BytesIO()
    torch.save(a.train.state_dict(), buf)
    b.train.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    for _ in range(3):
        assert torch.equal(a.train.next_batch()[0], b.train.next_batch()[0])
    assert not torch.equal(batches[0][0], batches[1][0])  # random offsets, not a sliding window
    assert not torch.equal(_build(out, seed=4).train.next_batch()[0], batches[0][0])
    n = a.describe()["train_tokens"]
    for rank in range(3):  # no per-rank slices any more: each rank draws from the whole file
        s = _build(out, rank=rank, world_size=3).train
        starts = np.concatenate([s.offsets_at(i) for i in range(200)])
        assert starts.min() >= 0 and starts.max() + 32 < n
        assert starts.min() < n // 10 and starts.max() > n - n // 10


def test_val_batches_are_fixed_and_from_val_bin(prepared):
    out, _, _ = prepared
    bundle = _build(out)
    v1, v2 = bundle.val_batches(3), bundle.val_batches(3)
    assert all(torch.equal(p[0], q[0]) for p, q in zip(v1, v2))
    val = np.fromfile(out / "val.bin", dtype=np.uint16)
    row = v1[0][0][0].numpy()
    assert any(np.array_equal(val[o:o + 32], row) for o in range(len(val) - 32))


def _copy(prepared, tmp_path):
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(prepared[0], out)
    return out


def test_truncated_or_altered_bin_fails(prepared, tmp_path, capsys):
    out = _copy(prepared, tmp_path)
    with open(out / "train.bin", "r+b") as f:
        f.truncate(f.seek(0, 2) - 2)
    with pytest.raises(DataError, match="truncated or altered"):
        _build(out)
    assert verify_main([str(out)]) == 1
    assert "train.bin" in capsys.readouterr().out
    out2 = tmp_path / "alt"
    out2.mkdir()
    for f in prepared[0].iterdir():
        (out2 / f.name).write_bytes(f.read_bytes())
    data = bytearray((out2 / "val.bin").read_bytes())
    data[10] ^= 1
    (out2 / "val.bin").write_bytes(bytes(data))
    problems = verify(out2)
    assert len(problems) == 1 and "sha256" in problems[0]
    assert verify_main([str(prepared[0])]) == 0


def test_ids_beyond_the_vocabulary_are_errors(prepared, tmp_path):
    with pytest.raises(DataError, match="vocab_size is 50000"):
        _build(prepared[0], vocab_size=50000)
    out = _copy(prepared, tmp_path)
    meta = json.loads((out / "meta.json").read_text())
    meta["vocab_size"] = 1000  # as if written with a smaller tokenizer: the files now hold ids >= vocab
    (out / "meta.json").write_text(json.dumps(meta))
    assert any("token id" in p and ">= tokenizer vocabulary 1000" in p for p in verify(out))
    assert verify_main([str(prepared[0]), "--vocab-size", "40000"]) == 1


def test_metadata_missing_or_mismatched(prepared, tmp_path):
    out = _copy(prepared, tmp_path)
    (out / "meta.json").unlink()
    with pytest.raises(DataError, match="metadata missing"):
        _build(out)
    with pytest.raises(DataError, match="prepared with tokenizer gpt2 but data.tokenizer names byte"):
        build_data(DataConfig(source=f"bin:{prepared[0]}", tokenizer="byte"), seq_len=8, batch_size=1, vocab_size=50304, seed=0)
    out = _copy(prepared, tmp_path / "b")
    (out / "val.bin").unlink()
    with pytest.raises(DataError, match="val.bin is missing"):
        _build(out)


def test_legacy_meta_pkl_loads_plain_data(tmp_path):
    d = tmp_path / "legacy"
    d.mkdir()
    chars = sorted(set("hello world"))
    with open(d / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": {c: i for i, c in enumerate(chars)}}, f)
    rng = np.random.default_rng(0)
    rng.integers(0, len(chars), 500).astype(np.uint16).tofile(d / "train.bin")
    rng.integers(0, len(chars), 100).astype(np.uint16).tofile(d / "val.bin")
    meta = read_meta(d)
    assert meta.legacy and meta.dtype == "uint16" and meta.vocab_size == len(chars)
    bundle = build_data(DataConfig(source=f"bin:{d}", tokenizer="byte"), seq_len=16, batch_size=2, vocab_size=64, seed=0)
    assert int(bundle.train.next_batch()[0].max()) < len(chars)
    with pytest.raises(DataError, match="token ids up to 7"):
        build_data(DataConfig(source=f"bin:{d}"), seq_len=16, batch_size=2, vocab_size=4, seed=0)


class _Exploit:
    def __reduce__(self):
        import os

        return (os.system, ("touch pwned_by_pickle",))


def test_malicious_meta_pkl_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    d = tmp_path / "evil"
    d.mkdir()
    (d / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 10, "x": _Exploit()}))
    np.zeros(100, np.uint16).tofile(d / "train.bin")
    np.zeros(100, np.uint16).tofile(d / "val.bin")
    with pytest.raises(DataError, match="refused to unpickle.*(posix|os).system"):
        build_data(DataConfig(source=f"bin:{d}"), seq_len=8, batch_size=1, vocab_size=64, seed=0)
    assert not (tmp_path / "pwned_by_pickle").exists()
    for payload in (pickle.dumps({"a": {1, 2}}), pickle.dumps({"a": np.int64(3)}), b"not a pickle"):
        (d / "meta.pkl").write_bytes(payload)
        with pytest.raises(DataError, match="refused to unpickle"):
            load_plain_pickle(d / "meta.pkl")


def test_single_document_file_warns_at_prepare_time_and_underscore_spellings_work(tmp_path):
    """One text file read as one document holds out its tail (tests/data/test_single_document.py); by
    paragraph, paragraphs are held out whole. The options also take the config's underscore spellings."""
    import subprocess
    import sys

    text = tmp_path / "book.txt"
    text.write_text("".join(f"Paragraph {i} of a single file, with its own words.\n\n" for i in range(100)))
    run = lambda *args: subprocess.run([sys.executable, "-m", "train.data.prepare", f"--source=text:{text}",
                                        "--tokenizer=byte", "--workers=1", *args], capture_output=True, text=True,
                                       timeout=120)
    one_doc = run(f"--out={tmp_path / 'one'}")
    assert one_doc.returncode == 0, one_doc.stderr
    assert "val 519 tokens" in one_doc.stdout and "warning" not in one_doc.stderr
    paragraphs = run(f"--out={tmp_path / 'para'}", "--text_sample_by=paragraph", "--val_fraction=0.5")
    assert paragraphs.returncode == 0 and "warning" not in paragraphs.stderr, paragraphs.stderr
    meta = read_meta(tmp_path / "para")
    assert meta.splits["val"].tokens > 0 and meta.raw["text_sample_by"] == "paragraph" and meta.raw["val_fraction"] == 0.5
