"""Remote data files and reads that survive network faults: URLs checked at start, shards spooled to local disk by
byte range with retries, and the retry budget every stream reader shares (docs/DATA.md "Remote sources").

URLs. parquet:, jsonl: and text: take, instead of a local glob, one URL or a comma-separated list of URLs of any
protocol fsspec serves whose package is installed (https://, s3://, gs://, hf://, ...). A URL with a glob pattern
(s3://bucket/dir/*.parquet) is expanded by its filesystem at start. Each file is one shard, as a local file is.
At start every file is looked up once: a malformed URL, an unknown protocol, a protocol whose package is missing and
a file that is not there (404) are each one line (DataError) before anything is written.

Spooling. The reader about to read a shard copies it into data.spool_dir (default: the system's temp directory) by
byte ranges of CHUNK_BYTES, then reads the local copy with the same `datasets` builder as a local file (documents
exactly those of the same file on disk) and deletes it when done. A range that fails transiently is read again from
the same byte: the copy is byte for byte the file, and a position (shard, document) means what it meant.

Retries. Transient: refused or reset connections, timeouts (a read that stalls longer than data.read_timeout_s),
HTTP 408 / 429 / 5xx, a truncated body. Each is retried after an exponential backoff with full jitter
(BACKOFF_BASE_S doubling to BACKOFF_CAP_S). The budget of one outage: data.retry_max failures in a row without a
byte or document of progress, or data.retry_max_s seconds since the outage's first failure; then DataOutage, on which
the trainer stops every rank together with a checkpoint and exits EXIT_DATA_OUTAGE (train/trainer/runner.py).
Permanent (not retried): 404, 401 / 403 and other 4xx, a malformed file, a full disk: one line naming the URL.

Credentials never appear in a URL: user:password@ and credential query parameters are refused at start. Each
protocol reads its usual environment (~/.netrc and proxy variables for https, AWS_* for s3://,
GOOGLE_APPLICATION_CREDENTIALS for gs://, HF_TOKEN for hf://). Messages show URLs without their query string.
"""
from __future__ import annotations

import asyncio
import errno
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from train.core.errors import DataError, UserError
from train.core.optional import require

HTTP_PROTOCOLS = ("http", "https")  # fsspec's HTTP filesystem (aiohttp)

CHUNK_BYTES = 8 << 20  # one ranged read; a failure costs at most this much again
BACKOFF_BASE_S = 0.5
BACKOFF_CAP_S = 30.0
GLOB_CHARS = "*?["
# query parameters that carry credentials: refused in a data URL (put them in the protocol's environment)
CREDENTIAL_PARAMS = frozenset({"token", "access_token", "api_key", "apikey", "key", "password", "sig", "signature",
                               "x-amz-signature", "x-amz-credential", "x-amz-security-token", "x-goog-signature",
                               "x-goog-credential"})
TRANSIENT_STATUS = frozenset({408, 425, 429})  # and every 5xx
TRANSIENT_ERRNO = frozenset({errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.ETIMEDOUT, errno.EPIPE,
                             errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ENETDOWN, errno.EHOSTDOWN})


class DataOutage(DataError):
    """A transient failure outlasted the retry budget (data.retry_max / data.retry_max_s): the data is unreachable
    for now, not wrong. The trainer stops all ranks with a checkpoint and exits EXIT_DATA_OUTAGE."""


class TruncatedRead(ConnectionError):
    """A ranged read returned fewer bytes than it asked for (the body ended early)."""


# ---- URLs ---------------------------------------------------------------------------------------------------------
def is_remote(arg: str) -> bool:
    """Whether a stream source's argument names URLs (protocol://...) rather than a local glob."""
    return "://" in arg.split(",", 1)[0]


def redact(url: str) -> str:
    """The URL as messages show it: no user information, no query string, no fragment."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = host + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def split_urls(source: str) -> list[str]:
    """The URLs of a remote stream source (kind:URL[,URL...]), each checked for syntax and credentials; DataError."""
    kind, _, arg = source.partition(":")
    urls = [u.strip() for u in arg.split(",")]
    for url in urls:
        check_url(f"{kind}:", url)
    return urls


def check_url(prefix: str, url: str) -> None:
    """One line (DataError) for a URL the data cannot take: malformed, credentials in it, an unknown protocol or
    one whose package is missing."""
    parts = urlsplit(url)
    shown = f"{prefix}{redact(url) if parts.scheme else url}"
    if not parts.scheme or "://" not in url or not (parts.netloc or parts.path.strip("/")):
        raise DataError(f"{shown}: not a URL (expected protocol://host/path, e.g. https://host/data/shard-0.parquet)")
    if parts.scheme in ("http", "https") and not parts.hostname:
        raise DataError(f"{shown}: the URL needs a host ({parts.scheme}://HOST/path)")
    if parts.username or parts.password:
        raise DataError(f"{shown}: credentials in the URL are refused (they would reach logs and run.info); put them "
                        f"in the protocol's usual environment (~/.netrc for https, AWS_* for s3, HF_TOKEN for hf)")
    secret = sorted({k for k, _ in parse_qsl(parts.query, keep_blank_values=True) if k.lower() in CREDENTIAL_PARAMS})
    if secret:
        raise DataError(f"{shown}: the query parameter(s) {', '.join(secret)} carry credentials, which would reach logs "
                        f"and run.info; put them in the protocol's usual environment instead")
    filesystem_class(parts.scheme, shown)


def filesystem_class(protocol: str, shown: str):
    """fsspec's filesystem class for `protocol`; one line when fsspec does not know it or its package is missing."""
    fsspec = require("fsspec")
    from fsspec.registry import known_implementations

    if protocol not in known_implementations and protocol not in fsspec.registry:
        raise DataError(f"{shown}: unknown protocol {protocol!r} (fsspec serves: "
                        f"{', '.join(sorted(p for p in known_implementations if p not in ('file', 'local'))[:12])}, ...)")
    if protocol in HTTP_PROTOCOLS:  # open_filesystem's timeouts need aiohttp: its one line here, before any read
        try:
            require("aiohttp")
        except UserError as exc:
            raise DataError(f"{shown}: {exc}") from None
    try:
        return fsspec.get_filesystem_class(protocol)
    except ImportError as e:
        hint = known_implementations.get(protocol, {}).get("err") or str(e)
        raise DataError(f"{shown}: the {protocol}:// protocol needs a package that is not installed ({hint})") from None


def open_filesystem(url: str, read_timeout_s: float):
    """(fsspec filesystem, path) for `url`, with reads that time out after read_timeout_s where the protocol takes it."""
    import fsspec

    protocol = urlsplit(url).scheme
    options: dict = {}
    if protocol in HTTP_PROTOCOLS:
        aiohttp = require("aiohttp")

        timeout = aiohttp.ClientTimeout(total=None, sock_connect=read_timeout_s, sock_read=read_timeout_s)
        options = {"client_kwargs": {"timeout": timeout, "trust_env": True}}
    elif protocol in ("s3", "s3a"):
        options = {"config_kwargs": {"connect_timeout": read_timeout_s, "read_timeout": read_timeout_s,
                                     "retries": {"max_attempts": 1}}}  # the retries are ours
    return fsspec.core.url_to_fs(url, **options)


# ---- retries ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RetryPolicy:
    """data.retry_max / data.retry_max_s / data.read_timeout_s (train/core/data_config.py)."""

    retry_max: int = 8
    retry_max_s: float = 600.0
    read_timeout_s: float = 60.0
    backoff_base_s: float = BACKOFF_BASE_S
    backoff_cap_s: float = BACKOFF_CAP_S

    def backoff_s(self, attempt: int, rng: random.Random) -> float:
        """Full jitter: uniform in [0, min(cap, base * 2**(attempt-1))]."""
        return rng.uniform(0.0, min(self.backoff_cap_s, self.backoff_base_s * 2 ** max(0, attempt - 1)))


@dataclass
class RetryStats:
    """One reader's counts (kept for the run: heartbeat, summary, monitor)."""

    retries: int = 0  # failed reads retried
    stalls: int = 0  # of which: reads that timed out (a stall longer than data.read_timeout_s)
    wait_s: float = 0.0  # seconds between the first failure of each outage and its recovery
    last_error: str = ""

    def as_dict(self) -> dict:
        return {"retries": self.retries, "stalls": self.stalls, "wait_s": round(self.wait_s, 3),
                "last_error": self.last_error}


def total_counts(counts: list[dict]) -> dict | None:
    """RetryStats.as_dict() of several readers or sources as one (the last failure named); None for none."""
    if not counts:
        return None
    return {"retries": sum(c["retries"] for c in counts), "stalls": sum(c["stalls"] for c in counts),
            "wait_s": round(sum(c["wait_s"] for c in counts), 3),
            "last_error": next((c["last_error"] for c in reversed(counts) if c["last_error"]), "")}


def is_transient(exc: BaseException) -> bool:
    """Whether a failed read may succeed if tried again (module docstring). Looks through the exception's causes:
    fsspec turns a refused connection during a lookup into FileNotFoundError from the connection error."""
    chain = _chain(exc)
    for e in chain:
        if (status := _status_of(e)) is not None:
            return status in TRANSIENT_STATUS or status >= 500
    for e in chain:
        if isinstance(e, (TimeoutError, asyncio.TimeoutError, ConnectionError, TruncatedRead)):
            return True
        if isinstance(e, OSError) and e.errno in TRANSIENT_ERRNO:
            return True
        if type(e).__module__.startswith("aiohttp") and type(e).__name__ in AIOHTTP_TRANSIENT:
            return True
    return False


AIOHTTP_TRANSIENT = frozenset({"ClientConnectionError", "ClientConnectorError", "ClientOSError", "ServerDisconnectedError",
                               "ClientPayloadError", "ServerTimeoutError", "ConnectionTimeoutError",
                               "SocketTimeoutError", "ClientConnectionResetError", "ServerConnectionError"})


def _chain(exc: BaseException | None) -> list[BaseException]:
    chain = []
    while exc is not None and len(chain) < 8:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    return chain


def is_stall(exc: BaseException) -> bool:
    return any(isinstance(e, (TimeoutError, asyncio.TimeoutError)) or "Timeout" in type(e).__name__ for e in _chain(exc))


def _status_of(exc: BaseException) -> int | None:
    for value in (getattr(exc, "status", None), getattr(getattr(exc, "response", None), "status_code", None)):
        if isinstance(value, int) and 100 <= value < 600:
            return value
    return None


def describe(exc: BaseException) -> str:
    """One short line for a failed read, without any URL in it (the caller names the file, redacted): of the
    exception's causes, the one that decided it (a status, or a network error under fsspec's FileNotFoundError)."""
    chain = _chain(exc)
    exc = next((e for e in chain if _status_of(e) is not None), None) or next(
        (e for e in chain if is_transient(e) and e.__cause__ is None and e.__context__ is None), chain[0])
    status = _status_of(exc)
    if status is not None:
        reason = getattr(exc, "message", None) or getattr(getattr(exc, "response", None), "reason_phrase", None)
        return f"HTTP {status}" + (f" {reason}" if isinstance(reason, str) and reason else "")
    if isinstance(exc, FileNotFoundError):
        return "not found"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = " ".join("<url>" if "://" in w else w for w in text.split())  # an error that quotes a URL: drop it
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class Retrier:
    """One reader's retries: failed(exc) either returns after a backoff (try again) or raises; progressed() ends an
    outage. Shared by the reader's spooling and its document reads, so the budget is per outage, not per file."""

    def __init__(self, policy: RetryPolicy, stats: RetryStats | None = None, seed: int = 0):
        self.policy, self.stats = policy, stats if stats is not None else RetryStats()
        self._rng = random.Random(seed)  # jitter only: what is read never depends on it
        self._streak, self._since = 0, None

    def failed(self, exc: BaseException, what: str) -> None:
        if isinstance(exc, DataError):
            raise exc
        if not is_transient(exc):
            raise DataError(f"{what}: {describe(exc)} (not retried: the file is missing, refused or malformed)") from None
        now = time.monotonic()
        if self._since is None:
            self._since = now
        self._streak += 1
        self.stats.retries += 1
        self.stats.stalls += int(is_stall(exc))
        self.stats.last_error = f"{what}: {describe(exc)}"
        elapsed = now - self._since
        if self._streak > self.policy.retry_max or elapsed >= self.policy.retry_max_s:
            self._close_outage(now)
            raise DataOutage(f"{what}: {describe(exc)}; still failing after {self._streak} attempts in {elapsed:.0f}s "
                             f"(data.retry_max={self.policy.retry_max}, data.retry_max_s={self.policy.retry_max_s:g})")
        time.sleep(min(self.policy.backoff_s(self._streak, self._rng), max(0.0, self.policy.retry_max_s - elapsed)))

    def progressed(self) -> None:
        if self._since is not None:
            self._close_outage(time.monotonic())
        self._streak = 0

    def _close_outage(self, now: float) -> None:
        self.stats.wait_s += now - self._since
        self._since = None


def call_with_retries(fn, retrier: Retrier, what: str):
    while True:
        try:
            result = fn()
        except Exception as e:
            retrier.failed(e, what)
            continue
        retrier.progressed()
        return result


def configure_hub_retries(policy: RetryPolicy) -> dict:
    """`datasets`' own retries of a streamed remote read (hf:, fineweb_edu): as many as ours, at our backoff's base
    interval (its defaults: 20 retries, 5 s apart, uncounted). What they do not cover (an open that fails, a retry
    count spent) reaches sources.iter_documents, which reopens the shard at the next unread document. Returns the
    previous settings (process-wide: the reading process's configuration)."""
    import datasets.config as config

    previous = {"STREAMING_READ_MAX_RETRIES": config.STREAMING_READ_MAX_RETRIES,
                "STREAMING_READ_RETRY_INTERVAL": config.STREAMING_READ_RETRY_INTERVAL}
    config.STREAMING_READ_MAX_RETRIES = max(1, policy.retry_max)  # its attempts: 0 would never read
    config.STREAMING_READ_RETRY_INTERVAL = policy.backoff_base_s
    return previous


# ---- files --------------------------------------------------------------------------------------------------------
def expand_urls(urls: list[str], policy: RetryPolicy, prefix: str) -> list[str]:
    """Every file the URLs name (globs expanded by their filesystem), each looked up once: one line for a file that is
    not there or refused; transient failures are retried within the policy's budget."""
    files: list[str] = []
    retrier = Retrier(policy)
    for url in urls:
        fs, path = open_filesystem(url, policy.read_timeout_s)
        shown = f"{prefix}{redact(url)}"
        if any(c in path for c in GLOB_CHARS):
            found = sorted(call_with_retries(lambda: fs.glob(path), retrier, shown))
            if not found:
                raise DataError(f"{shown}: the pattern matched no files")
            files += [fs.unstrip_protocol(p) for p in found]
            continue
        info = call_with_retries(lambda: fs.info(path), retrier, shown)
        if info.get("type") == "directory":
            raise DataError(f"{shown}: a directory; name its files, or a pattern such as {redact(url).rstrip('/')}/*")
        files.append(url)
    return files


def spool(url: str, directory: Path, retrier: Retrier) -> Path:
    """Copy the file at `url` into `directory` (keeping its name, so compression is recognised by its suffix), range by
    range with retries (module docstring); the local path. A full disk is one line."""
    fs, path = open_filesystem(url, retrier.policy.read_timeout_s)
    shown = redact(url)
    size = call_with_retries(lambda: fs.size(path), retrier, shown)
    name = Path(urlsplit(url).path).name or "shard"
    dest = directory / name
    free = shutil.disk_usage(directory).free
    if size is not None and size > free:
        raise DataError(f"{shown}: {size:,} bytes do not fit the {free:,} free in {directory} (data.spool_dir)")
    offset = 0
    with open(dest, "wb") as out:
        while size is None or offset < size:
            end = None if size is None else min(offset + CHUNK_BYTES, size)
            try:
                data = fs.cat_file(path, start=offset if size is not None else None, end=end)
                if end is not None and len(data) != end - offset:
                    raise TruncatedRead(f"range {offset}-{end} gave {len(data)} of {end - offset} bytes")
            except Exception as e:
                retrier.failed(e, shown)
                continue
            try:
                out.write(data)
            except OSError as e:
                raise DataError(f"{shown}: cannot write its local copy in {directory} (data.spool_dir): "
                                f"{e.strerror or e}") from None
            offset += len(data)
            retrier.progressed()
            if size is None:
                break
    return dest


def spool_root(configured: str | None) -> Path:
    root = Path(configured) if configured else Path(tempfile.gettempdir()) / "nsa-train-spool"
    root.mkdir(parents=True, exist_ok=True)
    return root


def remove_stale_spools(root: Path) -> None:
    """Spool directories of processes that are gone (a kill -9 leaves its copy behind)."""
    for child in root.glob("*-spool-*"):
        pid = child.name.split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(child, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---- a datasets-like view of remote files --------------------------------------------------------------------------
@dataclass
class RemoteFiles:
    """What sources.iter_documents reads from `datasets` (n_shards, shard, skip, iter), over remote files: the shard
    is spooled when it is read, read with the local builder, and removed after. Picklable (DataLoader workers)."""

    urls: list[str]
    builder: str  # datasets' builder: parquet | json | text
    builder_args: dict
    text_field: str
    policy: RetryPolicy
    spool_dir: str | None = None
    index: int | None = None  # one shard of urls, or all
    skipped: int = 0
    retrier: Retrier | None = field(default=None, repr=False)
    features = None  # known once a file is read (the text field is checked then)

    @property
    def n_shards(self) -> int:
        return len(self.urls) if self.index is None else 1

    def shard(self, num_shards: int, index: int) -> "RemoteFiles":
        assert self.index is None and num_shards == len(self.urls)
        return RemoteFiles(**{**self.__dict__, "index": index, "skipped": 0})

    def skip(self, n: int) -> "RemoteFiles":
        return RemoteFiles(**{**self.__dict__, "skipped": self.skipped + n})

    def with_retrier(self, retrier: Retrier) -> "RemoteFiles":
        return RemoteFiles(**{**self.__dict__, "retrier": retrier})

    def iter(self, batch_size: int):
        import datasets

        if self.index is None and len(self.urls) > 1:
            raise ValueError("iterate one shard of several remote files (RemoteFiles.shard)")
        url = self.urls[self.index or 0]
        retrier = self.retrier or Retrier(self.policy)
        directory = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-spool-", dir=spool_root(self.spool_dir)))
        try:
            local = spool(url, directory, retrier)
            try:
                ds = datasets.load_dataset(self.builder, data_files=[str(local)], split="train", streaming=True,
                                           **self.builder_args)
                if self.builder != "text":
                    names = list(ds.features) if ds.features is not None else None
                    if names is not None and self.text_field not in names:
                        raise DataError(f"{redact(url)}: no field {self.text_field!r} (fields: {', '.join(names)}); "
                                        f"set data.text_field")
                    ds = ds.select_columns([self.text_field])
                if self.skipped:
                    ds = ds.skip(self.skipped)
                yield from ds.iter(batch_size=batch_size)
            except DataError:
                raise
            except Exception as e:  # the local copy is the file: an error reading it is the file's
                raise DataError(f"{redact(url)}: cannot read as {self.builder} ({describe(e)})") from None
        finally:
            shutil.rmtree(directory, ignore_errors=True)
