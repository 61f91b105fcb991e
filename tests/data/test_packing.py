import numpy as np

from train.data.packing import WindowPacker


def _docs(rng, n, max_len):
    return [rng.integers(0, 1000, size=int(rng.integers(1, max_len))).astype(np.int64) for _ in range(n)]


def test_windows_cover_the_stream_exactly_with_one_token_overlap():
    rng = np.random.default_rng(0)
    seq_len = 16
    docs = _docs(rng, 50, 40)  # shorter and longer than a window
    packer, windows = WindowPacker(seq_len), []
    for i, doc in enumerate(docs):
        packer.add(("doc", i), doc)
        while (w := packer.pop_window()) is not None:
            windows.append(w)
    stream = np.concatenate(docs)
    assert all(len(w) == seq_len + 1 for w in windows)
    for k, w in enumerate(windows):
        np.testing.assert_array_equal(w, stream[k * seq_len:k * seq_len + seq_len + 1])
    assert packer.available == len(stream) - len(windows) * seq_len


def test_head_points_at_the_next_windows_first_token():
    rng = np.random.default_rng(1)
    seq_len = 8
    docs = _docs(rng, 30, 25)
    starts = np.cumsum([0] + [len(d) for d in docs])
    packer = WindowPacker(seq_len)
    for i, doc in enumerate(docs):
        packer.add(i, doc)
    emitted = 0
    while packer.pop_window() is not None:
        emitted += 1
        head = packer.head()
        if head is None:
            break
        doc, offset = head
        assert starts[doc] + offset == emitted * seq_len
        assert 0 <= offset < len(docs[doc])


def test_resuming_from_head_reproduces_the_following_windows():
    rng = np.random.default_rng(2)
    seq_len, docs = 12, _docs(rng, 40, 30)
    full = WindowPacker(seq_len)
    for i, d in enumerate(docs):
        full.add(i, d)
    first = [full.pop_window() for _ in range(7)]
    doc, offset = full.head()
    rest = [full.pop_window() for _ in range(10)]
    resumed = WindowPacker(seq_len)
    resumed.add(doc, docs[doc], start=offset)
    for i in range(doc + 1, len(docs)):
        resumed.add(i, docs[i])
    assert first and all(np.array_equal(a, resumed.pop_window()) for a in rest)
