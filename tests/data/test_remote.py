"""Remote sources read through real network faults (tests/fault_http.py: a server on 127.0.0.1 that drops connections
mid-body, answers 503 / 429, stalls past the read timeout, truncates bodies and refuses connections): the bytes and
documents read equal a fault-free read, prepare from URLs equals prepare from the same files on disk, a server that
stays down ends in DataOutage within the budget, and bad URLs are one line before anything is read."""
from __future__ import annotations

import importlib.util
import io
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fault_http import FaultServer
from tests.scripts.helpers import blocking_site
from train.core.data_config import DataConfig
from train.core.errors import DataError
from train.data import remote
from train.data.build import check_data_source
from train.data.preparation import prepare
from train.data.remote import DataOutage, Retrier, RetryPolicy, RetryStats, spool
from train.data.sources import ReaderPlan, iter_documents, open_documents

from .conftest import write_parquet

FAST = RetryPolicy(retry_max=40, retry_max_s=60, read_timeout_s=0.5, backoff_base_s=0.05, backoff_cap_s=0.3)
EVERY_FAULT = ["drop", "503", "stall", "truncate", "429", "refuse"]


def parquet_files(docs: list[str], n: int) -> dict[str, bytes]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = {}
    for i in range(n):
        buf = io.BytesIO()
        pq.write_table(pa.table({"text": docs[i::n], "n": list(range(len(docs[i::n])))}), buf, row_group_size=4)
        files[f"part{i:02d}.parquet"] = buf.getvalue()
    return files


def url_source(server: FaultServer, files: dict) -> str:
    return "parquet:" + ",".join(server.url(name) for name in sorted(files))


def test_a_spool_gets_every_byte_through_every_kind_of_fault(tmp_path, monkeypatch):
    monkeypatch.setattr(remote, "CHUNK_BYTES", 1 << 18)  # 12 ranged reads of the 3 MB file
    data = os.urandom(3 << 20)
    stats = RetryStats()
    with FaultServer({"blob.bin": data}, faults=EVERY_FAULT, every=2, stall_s=1.0, refuse_s=1.0) as server:
        local = spool(server.url("blob.bin"), tmp_path, Retrier(FAST, stats))
        injected = [fault for _, fault in server.injected]
    assert local.read_bytes() == data
    assert injected == EVERY_FAULT  # each fault met a read
    assert stats.retries >= len(EVERY_FAULT) and stats.stalls >= 1  # refused connections are retried until it is back
    assert stats.wait_s >= 1.0  # the refusal lasted a second


def test_documents_over_faults_are_the_fault_free_documents_and_prepare_equals_disk(tmp_path, docs):
    files = parquet_files(docs, 4)
    for name, data in files.items():
        (tmp_path / "disk").mkdir(exist_ok=True)
        (tmp_path / "disk" / name).write_bytes(data)

    def read(source):
        ds = open_documents(source, subset=None, split="train", text_field="text", text_sample_by="document",
                            policy=FAST, spool_dir=str(tmp_path / "spool"))
        stats = RetryStats()
        got = list(iter_documents(ds, ReaderPlan.make(ds.n_shards, 1, 0), "text", lambda t: True, once=True,
                                  read_batch=8, retrier=Retrier(FAST, stats)))
        return got, stats

    left = tmp_path / "spool" / f"{2**22 + 12345}-spool-left"  # a copy whose process is gone (a kill -9)
    left.mkdir(parents=True)
    (left / "part00.parquet").write_bytes(b"partial")
    local, _ = read(f"parquet:{tmp_path / 'disk'}/*.parquet")
    with FaultServer(files, faults=["drop", "503", "truncate", "stall"], every=1, stall_s=1.0) as server:
        remote_docs, stats = read(url_source(server, files))
        prepared = prepare(url_source(server, files), "byte", tmp_path / "from_urls", val_fraction=0.1)
    assert remote_docs == local and len(local) == len(docs)  # positions (shard, document) and texts
    assert stats.retries >= 4
    assert not any((tmp_path / "spool").iterdir())  # every local copy removed after its shard, the dead one's too
    on_disk = prepare(f"parquet:{tmp_path / 'disk'}/*.parquet", "byte", tmp_path / "from_disk", val_fraction=0.1)
    for split in ("train", "val"):
        assert (tmp_path / "from_urls" / f"{split}.bin").read_bytes() == (tmp_path / "from_disk" / f"{split}.bin").read_bytes()
    assert prepared["splits"] == on_disk["splits"]


def test_datasets_own_remote_reads_resume_at_the_same_document(tmp_path, docs, monkeypatch):
    """hf: and fineweb_edu streams read through `datasets`' own fsspec files: with its retries cut to one, every fault
    reaches sources.iter_documents, which reopens the shard at the next unread document."""
    datasets = pytest.importorskip("datasets", reason="datasets is not installed here (hf: and fineweb_edu need it)")
    http_filesystem_or_skip()  # datasets reads the URLs through fsspec's HTTP filesystem

    files = parquet_files(docs, 3)
    monkeypatch.setattr(datasets.config, "STREAMING_READ_MAX_RETRIES", 1)  # one attempt, then ...
    monkeypatch.setattr(datasets.config, "STREAMING_READ_RETRY_INTERVAL", 0.05)  # ... a short pause, then ours
    with FaultServer(files) as server:
        urls = [server.url(n) for n in sorted(files)]
        ds = datasets.load_dataset("parquet", data_files=urls, split="train", streaming=True).select_columns(["text"])
        opening = server.gets  # the open's own reads (each file's schema)
        reference = list(iter_documents(ds, ReaderPlan.make(3, 1, 0), "text", lambda t: True, once=True, read_batch=4))
    # the faults start after the open's reads, so they meet the document reads
    with FaultServer(files, faults=["drop", "503", "truncate", "503"], every=2, first=opening + 1) as server:
        urls = [server.url(n) for n in sorted(files)]
        ds = datasets.load_dataset("parquet", data_files=urls, split="train", streaming=True).select_columns(["text"])
        stats = RetryStats()
        got = list(iter_documents(ds, ReaderPlan.make(ds.n_shards, 1, 0), "text", lambda t: True, once=True,
                                  read_batch=4, retrier=Retrier(FAST, stats)))
        injected = len(server.injected)
    assert got == reference and len(got) == len(docs)
    assert injected >= 2 and stats.retries >= 1


def test_a_server_that_stays_down_is_a_data_outage_within_the_budget(tmp_path):
    policy = RetryPolicy(retry_max=100, retry_max_s=1.5, read_timeout_s=0.5, backoff_base_s=0.05, backoff_cap_s=0.2)
    with FaultServer({"blob.bin": b"x" * 1000}) as server:
        server.down()
        started = time.monotonic()
        with pytest.raises(DataOutage, match=r"still failing after \d+ attempts in \d+s \(data.retry_max=100, "
                                             r"data.retry_max_s=1.5\)"):
            spool(server.url("blob.bin"), tmp_path, Retrier(policy, RetryStats()))
    assert 1.5 <= time.monotonic() - started < 5


def http_filesystem_or_skip() -> None:
    """Skip where fsspec's HTTP filesystem cannot be imported (it needs aiohttp and requests; the GPU image lacks
    aiohttp): there an http:// URL gets the missing-package line, which the MISSING case checks, not the server's 404."""
    import fsspec

    try:
        fsspec.get_filesystem_class("http")
    except ImportError as exc:
        pytest.skip(f"fsspec's HTTP filesystem cannot be imported here: {exc}")


def missing_protocol() -> str | None:
    """A protocol fsspec knows whose package is not installed here (None when all of them are)."""
    for protocol, package in (("s3", "s3fs"), ("gs", "gcsfs"), ("abfs", "adlfs"), ("oci", "ocifs")):
        if importlib.util.find_spec(package) is None:
            return protocol
    return None


@pytest.mark.parametrize("url, message", [
    ("://host/a.parquet", "not a URL"),
    ("https:///a.parquet", "the URL needs a host"),
    ("nosuch://host/a.parquet", "unknown protocol 'nosuch'"),
    ("https://user:secret@host/a.parquet", "credentials in the URL are refused"),
    ("https://host/a.parquet?token=abc", "the query parameter(s) token carry credentials"),
    ("MISSING://bucket/a.parquet", "protocol needs a package that is not installed"),
    ("404", "HTTP 404 Not Found (not retried"),
])
def test_bad_urls_are_one_line_at_the_launch_check(url, message):
    with FaultServer({"a.parquet": b"PAR1"}) as server:
        if url == "404":
            http_filesystem_or_skip()
            url = server.url("missing.parquet")
        if url.startswith("MISSING"):
            protocol = missing_protocol()
            if protocol is None:
                pytest.skip("every fsspec protocol package tried is installed")
            url = url.replace("MISSING", protocol)
        cfg = DataConfig(source=f"parquet:{url}", tokenizer="byte", read_timeout_s=1, retry_max=2)
        with pytest.raises(DataError, match=re.escape(message)) as caught:
            check_data_source(cfg, vocab_size=320)
    line = str(caught.value)
    assert "\n" not in line and "secret" not in line and "abc" not in line


CHECK_HTTP_SOURCE = """from train.core.data_config import DataConfig
from train.core.errors import DataError
from train.data.build import check_data_source
try:
    check_data_source(DataConfig(source="parquet:http://127.0.0.1:9/a.parquet", tokenizer="byte"), vocab_size=320)
except DataError as exc:
    print(exc)
"""


def test_an_http_url_without_aiohttp_is_the_missing_package_line_at_the_launch_check(tmp_path):
    """Where aiohttp cannot be imported (the GPU image lacks it; here its import is made to fail in a fresh
    interpreter), the launch check says what open_filesystem would: the optional-package line naming aiohttp, with the
    URL, before anything is read (tests/conftest.py then skips the remote tests on such a machine with that line)."""
    site = blocking_site(tmp_path / "site", ["aiohttp"], "is blocked in this test")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(Path(__file__).resolve().parents[2])])}
    proc = subprocess.run([sys.executable, "-c", CHECK_HTTP_SOURCE], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == ("parquet:http://127.0.0.1:9/a.parquet: aiohttp is not installed: https:// and http:// "
                                   "stream sources (fsspec's HTTP filesystem) needs it (pip install aiohttp)"), proc.stdout


def test_a_shard_that_is_not_parquet_is_one_line_naming_the_url(tmp_path):
    with FaultServer({"a.parquet": b"this is not a parquet file"}) as server:
        ds = open_documents(f"parquet:{server.url('a.parquet')}", subset=None, split="train", text_field="text",
                            text_sample_by="document", policy=FAST)
        with pytest.raises(DataError, match=r"^http://127\.0\.0\.1:\d+/a\.parquet: cannot read as parquet"):
            list(iter_documents(ds, ReaderPlan.make(1, 1, 0), "text", lambda t: True, once=True,
                                retrier=Retrier(FAST)))


def test_local_parquet_still_reads_as_before(tmp_path, docs):
    source = write_parquet(tmp_path / "p", docs, 2)
    ds = open_documents(source, subset=None, split="train", text_field="text", text_sample_by="document")
    texts = [t for _, t in iter_documents(ds, ReaderPlan.make(ds.n_shards, 1, 0), "text", lambda t: True, once=True)]
    assert sorted(texts) == sorted(docs)
