"""Stream sources (text/jsonl/parquet/hf-local) on real English: packing, sharding, resume, held-out validation."""
import io

import pytest
import torch

from tests.data.conftest import heading, write_jsonl, write_parquet, write_texts
from train.data import DataConfig, build_data
from train.data.sources import ReaderPlan, is_held_out, iter_documents, open_documents
from train.core.errors import DataError

V = 50304


def _bundle(source, seq_len=32, batch_size=2, rank=0, world_size=1, **cfg):
    cfg.setdefault("val_fraction", 0.15)
    return build_data(DataConfig(source=source, **cfg), seq_len=seq_len, batch_size=batch_size, vocab_size=V,
                      seed=0, rank=rank, world_size=world_size)


def _reader_streams(bundle, n_batches, until_every_reader_wrapped=False):
    """Each reader's token stream (its windows stitched, dropping the one-token overlaps)."""
    streams = {}
    for _ in range(n_batches):
        if until_every_reader_wrapped and all(p["epoch"] >= 1 for p in bundle.train.state_dict()["readers"]):
            break
        reader = bundle.train.next_reader
        x, y = bundle.train.next_batch()
        for row in torch.cat([x, y[:, -1:]], 1).tolist():
            streams[reader] = streams.get(reader, []) + (row if reader not in streams else row[1:])
    return streams


def _train_docs(docs, frac=0.15):
    return [d for d in docs if not is_held_out(d, 0, frac)]


def test_documents_are_separated_by_eos_and_never_truncated(tmp_path, docs, gpt2):
    source = write_texts(tmp_path / "txt", docs)
    expected = _train_docs(docs)
    total = sum(len(t) + 1 for t in gpt2.encode_batch(expected))
    seq_len, batch = 64, 2
    bundle = _bundle(source, seq_len=seq_len, batch_size=batch)
    stream = _reader_streams(bundle, total // (seq_len * batch) + 2)[0]
    bundle.close()
    assert len(stream) > total  # wrapped into the second epoch
    pieces = gpt2.decode(stream).split("<|endoftext|>")
    assert pieces[:len(expected)] == expected  # every document whole, in order, EOS between
    assert stream[total - 1] == gpt2.eos_id and stream.count(gpt2.eos_id) >= len(expected)


@pytest.mark.parametrize("n_files", [6, 1])  # shards split by file, or documents striped inside files
def test_rank_and_worker_readers_are_disjoint_and_complete(tmp_path, docs, n_files):
    docs = docs[:16]
    source = write_jsonl(tmp_path / "j", docs, n_files)
    world_size, workers = 2, 2
    owners = {}
    for rank in range(world_size):
        bundle = _bundle(source, seq_len=256, batch_size=4, rank=rank, world_size=world_size, num_workers=workers)
        streams = _reader_streams(bundle, 200, until_every_reader_wrapped=True)
        assert all(p["epoch"] >= 1 for p in bundle.train.state_dict()["readers"])  # each reader did a full pass
        bundle.close()
        from train.data.tokenizers import load_tokenizer
        for reader, tokens in streams.items():
            for doc in load_tokenizer("gpt2").decode(tokens).split("<|endoftext|>"):
                if doc.count("\n") >= 1 and doc.split("\n", 1)[0].startswith("Genesis"):
                    owners.setdefault(heading(doc), set()).add((rank, reader))
    assert all(len(o) == 1 for o in owners.values()), {h: o for h, o in owners.items() if len(o) > 1}
    assert set(owners) == {heading(d) for d in _train_docs(docs)}
    assert len({o for s in owners.values() for o in s}) == world_size * workers


def test_reader_plans_partition_documents(tmp_path, docs):
    for n_files, n_readers in [(6, 4), (3, 4), (1, 3), (4, 4)]:
        ds = open_documents(write_jsonl(tmp_path / f"p{n_files}", docs, n_files), subset=None, split="train",
                            text_field="text", text_sample_by="document")
        seen = []
        for reader in range(n_readers):
            plan = ReaderPlan.make(ds.n_shards, n_readers, reader)
            seen += [text for _, text in iter_documents(ds, plan, "text", keep=lambda t: True, once=True)]
        assert sorted(seen) == sorted(docs)


@pytest.mark.parametrize("kind,workers", [("text", 0), ("jsonl", 2), ("parquet", 0), ("parquet", 2), ("hf", 0)])
def test_resume_continues_at_the_same_token(tmp_path, docs, kind, workers):
    if kind == "text":
        source = write_texts(tmp_path / "t", docs)
    elif kind == "jsonl":
        source = write_jsonl(tmp_path / "j", docs, 3)
    elif kind == "parquet":
        source = write_parquet(tmp_path / "p", docs, 3)
    else:  # hf:NAME on a local dataset directory: the same load_dataset(name, streaming=True) path as the hub
        source = "hf:" + write_jsonl(tmp_path / "hfdir", docs, 2).split(":", 1)[1].rsplit("/", 1)[0]
    args = dict(seq_len=48, batch_size=3, num_workers=workers)
    steady = _bundle(source, **args)
    first = [steady.train.next_batch() for _ in range(7)]
    buf = io.BytesIO()
    torch.save(steady.train.state_dict(), buf)
    later = [steady.train.next_batch() for _ in range(6)]
    steady.close()
    state = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert any(r["offset"] > 0 for r in state["readers"])  # resumes inside a document
    resumed = _bundle(source, **args)
    resumed.train.load_state_dict(state)
    again = [resumed.train.next_batch() for _ in range(6)]
    resumed.close()
    assert first[0][0].shape == (3, 48) and first[0][0].dtype == torch.int64
    for (x, y), (x2, y2) in zip(later, again):
        assert torch.equal(x, x2) and torch.equal(y, y2)
        assert torch.equal(x[:, 1:], y[:, :-1])


def test_resume_refuses_a_state_from_different_settings(tmp_path, docs):
    source = write_texts(tmp_path / "t", docs[:5])
    state = _bundle(source).train.state_dict()
    other = _bundle(source, seq_len=16)
    with pytest.raises(DataError, match="seq_len"):
        other.train.load_state_dict(state)


def test_validation_is_held_out_fixed_and_never_trained_on(tmp_path, docs, gpt2):
    source = write_jsonl(tmp_path / "j", docs, 2)
    bundle = _bundle(source, seq_len=256, batch_size=4)
    val = bundle.val_batches(4)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(val, bundle.val_batches(4)))
    val_text = gpt2.decode(torch.cat([x for x, _ in val]).flatten().tolist())
    train_text = gpt2.decode(_reader_streams(bundle, 2000, until_every_reader_wrapped=True)[0])
    bundle.close()
    held_out = [d for d in docs if is_held_out(d, 0, 0.15)]
    assert held_out and len(held_out) < len(docs) // 2
    assert any(heading(d) in val_text for d in held_out)
    assert not any(heading(d) + "\n" in train_text for d in held_out)
    assert all(heading(d) + "\n" in train_text for d in _train_docs(docs))


def test_val_source_supplies_validation(tmp_path, docs):
    train_src = write_texts(tmp_path / "train", docs[:10])
    val_src = write_texts(tmp_path / "val", docs[30:33])
    bundle = _bundle(train_src, val_source=val_src, seq_len=32)
    from train.data.tokenizers import load_tokenizer
    text = load_tokenizer("gpt2").decode(bundle.val_batches(1)[0][0][0].tolist())
    bundle.close()
    assert text in "<|endoftext|>".join(docs[30:33] * 2)


def test_first_batch_timeout_is_an_error_unless_synthetic_fallback_is_asked(tmp_path, docs, caplog):
    source = write_texts(tmp_path / "t", docs[:3])
    with pytest.raises(DataError, match="no first batch .* within data.first_batch_timeout_s"):
        _bundle(source, first_batch_timeout_s=0.001)
    bundle = _bundle(source, first_batch_timeout_s=0.001, synthetic_on_fail=True)
    info = bundle.describe()
    assert info["kind"] == "synthetic" and info["fallback_from"] == source
    assert "falling back to synthetic" in caplog.text
    x, y = bundle.train.next_batch()
    assert x.shape == (2, 32) and int(x.max()) < V


def test_source_errors_are_one_line(tmp_path, docs):
    with pytest.raises(DataError, match="matched no files"):
        _bundle(f"text:{tmp_path}/nothing/*.txt")
    write_jsonl(tmp_path / "j", docs[:3], 1)
    with pytest.raises(DataError, match="no field 'body'"):
        _bundle(f"jsonl:{tmp_path}/j/*.jsonl", text_field="body")
    with pytest.raises(DataError, match="no documents in a full pass"):
        _bundle(f"jsonl:{tmp_path}/j/*.jsonl", val_fraction=0.999999)
