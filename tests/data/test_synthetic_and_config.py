import dataclasses
import io
import math

import pytest
import torch

from train.data import DataConfig, build_data
from train.core.errors import DataError


def _synthetic(**kw):
    args = dict(seq_len=64, batch_size=8, vocab_size=512, seed=0)
    args.update(kw)
    return build_data(DataConfig(), **args)


def test_synthetic_batches_are_deterministic_per_seed_row_and_step():
    a, b = _synthetic(), _synthetic()
    xa, ya = a.train.next_batch()
    assert xa.shape == (8, 64) and xa.dtype == torch.int64 and torch.equal(xa[:, 1:], ya[:, :-1])
    assert torch.equal(xa, b.train.next_batch()[0])
    assert not torch.equal(xa, a.train.next_batch()[0])
    assert not torch.equal(xa, _synthetic(seed=1).train.next_batch()[0])
    assert not torch.equal(xa, _synthetic(rank=1, world_size=2).train.next_batch()[0])  # other global rows
    assert int(_synthetic(vocab_size=100).train.next_batch()[0].max()) < 100


def test_synthetic_resume_and_val_stream():
    a = _synthetic()
    for _ in range(3):
        a.train.next_batch()
    buf = io.BytesIO()
    torch.save(a.train.state_dict(), buf)
    b = _synthetic()
    b.train.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    assert torch.equal(a.train.next_batch()[0], b.train.next_batch()[0])
    val = a.val_batches(3)
    assert all(torch.equal(p[0], q[0]) for p, q in zip(val, b.val_batches(3)))
    train_rows = {tuple(r) for _ in range(20) for r in _synthetic().train.next_batch()[0].tolist()}
    assert not any(tuple(r) in train_rows for x, _ in val for r in x.tolist())
    with pytest.raises(DataError, match="seed"):
        _synthetic(seed=5).train.load_state_dict(a.train.state_dict())


def test_synthetic_is_learnable_by_a_small_model():
    """A bigram table trained 50 steps gets far below ln(vocab); uniform random data would not."""
    vocab = 512
    bundle = _synthetic(vocab_size=vocab, batch_size=8, seq_len=64)
    table = torch.nn.Embedding(vocab, vocab)
    opt = torch.optim.Adam(table.parameters(), lr=0.5)
    for _ in range(50):
        x, y = bundle.train.next_batch()
        loss = torch.nn.functional.cross_entropy(table(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        val = sum(torch.nn.functional.cross_entropy(table(x).flatten(0, 1), y.flatten()) for x, y in bundle.val_batches(4)) / 4
    assert val < 0.5 * math.log(vocab)


def test_config_fields_are_simple_types():
    simple = {"str", "int", "float", "bool", "str | None", "int | None", "float | None", "bool | None",
              "list[dict] | None"}  # data.mixture / data.stages: YAML lists of mappings (train/core/mixture.py)
    for f in dataclasses.fields(DataConfig):
        assert str(f.type) in simple, f.name
        assert f.default is not dataclasses.MISSING
    names = {f.name for f in dataclasses.fields(DataConfig)}
    assert {"source", "tokenizer", "num_workers", "pin_memory", "persistent_workers", "synthetic_on_fail",
            "first_batch_timeout_s", "val_fraction", "val_source"} <= names
    DataConfig().validate()


@pytest.mark.parametrize("change,message", [
    ({"source": "s3:bucket"}, "unknown source kind"),
    ({"source": "bin"}, "bin needs an argument"),
    ({"source": "synthetic:x"}, "takes no argument"),
    ({"tokenizer": "llama"}, "data.tokenizer must be"),
    ({"val_fraction": 1.0}, "val_fraction"),
    ({"num_workers": -1}, "num_workers"),
    ({"first_batch_timeout_s": 0.0}, "first_batch_timeout_s"),
    ({"text_sample_by": "sentence"}, "text_sample_by"),
    ({"val_source": "bin:data/x"}, "val_source"),
])
def test_config_validation_messages(change, message):
    with pytest.raises(DataError, match=message):
        DataConfig(**change).validate()


def test_build_data_rejects_bad_shapes():
    with pytest.raises(DataError, match="rank 2 is outside world_size 2"):
        _synthetic(rank=2, world_size=2)
    with pytest.raises(DataError, match="accumulate"):
        _synthetic(accumulate=0)
    with pytest.raises(DataError, match="seq_len"):
        _synthetic(seq_len=0)
