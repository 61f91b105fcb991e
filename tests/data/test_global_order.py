"""World-size-free data order (bin: and synthetic): batches are a function of (step, global row) only."""
import io
import json

import numpy as np
import pytest
import torch

from train.data import DataConfig, build_data
from train.data.build import stream_resume_refusal
from train.data.memmap import MemmapStream
from train.data.meta import FORMAT, FORMAT_VERSION
from train.data.stream import StreamBatches
from train.data.synthetic import SyntheticStream
from train.core.errors import DataError

T, N_TRAIN, N_VAL, VAL_BASE, VOCAB = 16, 20000, 3000, 50000, 100_032


def _index_dir(path, n_train=N_TRAIN, n_val=N_VAL):
    """A bin: directory whose token at position i is i (val: VAL_BASE + i): a row's first id is its window start."""
    path.mkdir(parents=True)
    np.arange(n_train, dtype=np.uint32).tofile(path / "train.bin")
    (VAL_BASE + np.arange(n_val, dtype=np.uint32)).tofile(path / "val.bin")
    splits = {"train": {"file": "train.bin", "tokens": n_train}, "val": {"file": "val.bin", "tokens": n_val}}
    (path / "meta.json").write_text(json.dumps({"format": FORMAT, "version": FORMAT_VERSION, "tokenizer": "byte",
                                                "eos_id": 0, "vocab_size": 100_000, "dtype": "uint32",
                                                "max_token_id": 99_999, "splits": splits}))
    return path


@pytest.fixture(scope="module")
def index_bin(tmp_path_factory):
    return _index_dir(tmp_path_factory.mktemp("order") / "idx")


@pytest.fixture(params=["bin", "synthetic"])
def make(request, index_bin):
    source = f"bin:{index_bin}" if request.param == "bin" else "synthetic"

    def build(batch_size, world_size=1, rank=0, accumulate=1, seed=3):
        return build_data(DataConfig(source=source, tokenizer="byte"), seq_len=T, batch_size=batch_size,
                          vocab_size=VOCAB, seed=seed, rank=rank, world_size=world_size, accumulate=accumulate)
    build.kind = request.param
    return build


def _ranks(make, world_size, batch_size, accumulate=1):
    return [make(batch_size, world_size, r, accumulate) for r in range(world_size)]


def _union(bundles) -> torch.Tensor:
    """One micro-batch from every rank, rank 0 rows first."""
    parts = [b.train.next_batch() for b in bundles]
    x = torch.cat([p[0] for p in parts])
    y = torch.cat([p[1] for p in parts])
    assert torch.equal(x[:, 1:], y[:, :-1])
    return x


@pytest.mark.parametrize("world_size,batch_size", [(2, 4), (4, 2)])
def test_ranks_together_read_the_one_rank_global_batch(make, world_size, batch_size):
    one = make(8)
    ranks = _ranks(make, world_size, batch_size)
    for _ in range(4):
        assert torch.equal(_union(ranks), one.train.next_batch()[0])


@pytest.mark.parametrize("world_size,batch_size", [(1, 8), (2, 4), (4, 2)])
def test_accumulation_micro_batches_follow_the_global_rows(make, world_size, batch_size):
    """A=2: step s, micro m of rank r holds rows (m*W + r)*B ..; all of them == 1 rank x B=16 x A=1."""
    ref_a2 = make(8, accumulate=2)  # 1 rank, B doubled, same accumulation
    ref_a1 = make(16)  # 1 rank, the whole global batch in one micro-batch
    ranks = _ranks(make, world_size, batch_size, accumulate=2)
    for _ in range(3):
        micro = [_union(ranks) for _ in range(2)]
        for m in range(2):
            assert torch.equal(micro[m], ref_a2.train.next_batch()[0])
        assert torch.equal(torch.cat(micro), ref_a1.train.next_batch()[0])


@pytest.mark.parametrize("world_size,batch_size,accumulate", [(2, 4, 1), (4, 2, 1), (2, 4, 3)])
def test_validation_batches_split_the_same_way(make, world_size, batch_size, accumulate):
    ref = make(8).val_batches(3)
    ranks = [b.val_batches(3) for b in _ranks(make, world_size, batch_size, accumulate)]  # val ignores accumulate
    for i in range(3):
        assert torch.equal(torch.cat([r[i][0] for r in ranks]), ref[i][0])
        assert torch.equal(torch.cat([r[i][1] for r in ranks]), ref[i][1])
    assert not torch.equal(ref[0][0], ref[1][0])


def _roundtrip(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    return torch.load(io.BytesIO(buf.getvalue()), weights_only=True)


@pytest.mark.parametrize("saved_split", [(2, 4, 1), (2, 2, 2)])  # (world, batch, accumulate), global batch 8
def test_state_resumes_on_another_world_size(make, saved_split):
    world, batch, accumulate = saved_split
    uninterrupted = make(8)
    expected = [uninterrupted.train.next_batch()[0] for _ in range(6)][3:]
    saved = _ranks(make, world, batch, accumulate)
    for _ in range(3 * accumulate):
        _union(saved)
    states = [_roundtrip(b.train.state_dict()) for b in saved]
    assert all(s == states[0] for s in states)  # every rank saves the same state
    assert states[0]["step"] == 3 and states[0]["global_batch"] == 8 and "rank" not in states[0]
    for new_world, new_batch, new_acc in [(1, 8, 1), (4, 2, 1), (1, 4, 2), (2, 4, 1)]:
        resumed = _ranks(make, new_world, new_batch, new_acc)
        for rank, b in enumerate(resumed):
            b.train.load_state_dict(states[rank % world])
        for want in expected:
            got = torch.cat([_union(resumed) for _ in range(new_acc)])
            assert torch.equal(got, want), (new_world, new_batch, new_acc)


def test_a_different_global_batch_is_refused_in_one_sentence(make):
    state = _ranks(make, 2, 4)[1].train.state_dict()
    other = make(4, world_size=2, rank=0, accumulate=2)
    with pytest.raises(DataError) as e:
        other.train.load_state_dict(state)
    msg = str(e.value)
    assert "global batch 8 (train.batch_size 4 x accumulate_grad_batches 1 x world_size 2)" in msg
    assert "global batch 16 (train.batch_size 4 x accumulate_grad_batches 2 x world_size 2)" in msg
    assert "start a new out_dir" in msg and "\n" not in msg and ". " not in msg
    with pytest.raises(DataError, match="seed"):
        make(8, seed=4).train.load_state_dict(make(8).train.state_dict())


def test_a_per_rank_state_from_before_is_refused_in_one_sentence(make):
    kind = "memmap" if make.kind == "bin" else "synthetic"
    old = {"kind": kind, "step": 5, "seed": 3, "rank": 1, "stream": 0}
    if kind == "memmap":
        old["world_size"] = 2
    bundle = make(4, world_size=2, rank=1)
    with pytest.raises(DataError) as e:
        bundle.train.load_state_dict(old)
    msg = str(e.value)
    assert "written before world-size-free data order" in msg and "same world size on an older version" in msg
    assert "start a new out_dir" in msg and "\n" not in msg and ". " not in msg
    with pytest.raises(DataError, match="kind"):  # a stream source's state is refused by kind, not as old format
        bundle.train.load_state_dict({"kind": "stream", "rank": 0, "world_size": 2, "step": 0})


def test_rows_differ_across_steps_and_rows_and_stay_in_range(make):
    bundle = make(8, world_size=2, rank=1, accumulate=2)
    batches = [bundle.train.next_batch() for _ in range(40)]
    rows = [tuple(r) for x, _ in batches for r in x.tolist()]
    assert len(set(rows)) >= 0.97 * len(rows)  # bin: a few birthday collisions among 20k starts are fine
    assert all(not torch.equal(a[0], b[0]) for a, b in zip(batches, batches[1:]))
    for x, y in batches:
        assert x.shape == (8, T) and 0 <= int(x.min()) and int(y.max()) < VOCAB
    val = [tuple(r) for x, _ in bundle.val_batches(5) for r in x.tolist()]
    assert len(set(val) & set(rows)) <= 2  # synthetic at T=16 has 64*64*16 windows: rare chance matches only
    if make.kind == "bin":
        starts = torch.cat([x[:, 0] for x, _ in batches])
        for x, y in batches:  # every row is a contiguous window of train.bin (token i == i)
            assert torch.equal(x, x[:, :1] + torch.arange(T)) and torch.equal(y, x + 1)
        assert int(starts.min()) >= 0 and int(starts.max()) + T < N_TRAIN
        assert int(starts.min()) < N_TRAIN // 10 and int(starts.max()) > N_TRAIN * 9 // 10  # whole file, not a slice
        assert all(VAL_BASE <= r[0] and r[-1] < VAL_BASE + N_VAL for r in val)
    else:
        assert int(torch.cat([x for x, _ in batches]).max()) < VOCAB


def test_windows_reach_both_ends_of_a_file_and_never_past_it(tmp_path):
    n = T + 3  # exactly three window starts: 0, 1, 2
    stream = MemmapStream(_index_dir(tmp_path / "tiny", n_train=n, n_val=n) / "train.bin", dtype=np.uint32,
                          n_tokens=n, seq_len=T, batch_size=8, seed=0, world_size=3, rank=2, accumulate=2)
    starts = np.concatenate([stream.offsets_at(k) for k in range(50)])
    assert set(starts.tolist()) == {0, 1, 2}
    batches = [stream.next_batch() for _ in range(50)]
    assert min(int(x.min()) for x, _ in batches) == 0 and max(int(y.max()) for _, y in batches) == n - 1


def test_a_file_too_small_for_one_window_is_a_data_error(tmp_path):
    d = _index_dir(tmp_path / "small", n_train=T, n_val=100)
    with pytest.raises(DataError, match=rf"holds {T} tokens, fewer than one window of seq_len\+1={T + 1} tokens"):
        build_data(DataConfig(source=f"bin:{d}", tokenizer="byte"), seq_len=T, batch_size=2, vocab_size=VOCAB, seed=0)


def test_describe_and_any_world_size(make):
    bundle = make(4, world_size=2, rank=1, accumulate=3)
    info = bundle.describe()
    assert info["global_batch"] == 24 and info["accumulate"] == 3 and info["any_world_size"] is True
    assert "rank_train_tokens" not in info
    json.dumps(info)
    assert MemmapStream.any_world_size and SyntheticStream.any_world_size and not StreamBatches.any_world_size
    assert bundle.train.any_world_size


def test_stream_resume_refusal_says_what_to_do():
    assert stream_resume_refusal(2, 2, 2, 2) is None
    assert stream_resume_refusal(1, 1, 0, 1) is None  # one reader either way: the same positions
    msg = stream_resume_refusal(2, 4, 2, 2, checkpoint="out/checkpoint_step8.pt")
    assert msg.startswith("checkpoint out/checkpoint_step8.pt was written by 2 rank(s)")
    assert "torchrun --nproc_per_node=2" in msg and "--data.num_workers=2" in msg and "--data.restart_on_change=true" in msg
    assert "\n" not in msg and ". " not in msg
    assert "data.num_workers=0" in stream_resume_refusal(2, 2, 0, 2)
