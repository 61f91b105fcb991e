"""An HTTP server on 127.0.0.1 that serves files and breaks on a fixed schedule, for tests and bench/bench_remote.py.

    with FaultServer({"a.parquet": data}, faults=["drop", "503", "stall", "truncate", "refuse"], every=2) as server:
        server.url("a.parquet")

GET requests are numbered in the order they arrive (1, 2, ...); request n with n % every == 0 meets the next fault of
`faults` until the list is used up, then every request is served. HEAD requests are always answered (while the server
accepts connections). Ranges (bytes=a-b, bytes=a-) are served as 206. Faults:
- drop: the headers and half the body, then the connection is reset (RST)
- truncate: the headers (the full Content-Length) and half the body, then the connection is closed
- 503, 429: that status
- stall: nothing for stall_s seconds, then the connection is closed
- refuse: the connection is closed unanswered and the server accepts nothing for refuse_s seconds (connection refused)
down() stops accepting until up(); arm() (with armed=False) starts the schedule at a moment the test picks. Bounded:
the server stops by itself after lifetime_s.
"""
from __future__ import annotations

import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

FAULTS = ("drop", "truncate", "503", "429", "stall", "refuse")


class FaultServer:
    def __init__(self, files: dict[str, bytes], faults: list[str] = (), every: int = 1, stall_s: float = 1.0,
                 refuse_s: float = 10.0, lifetime_s: float = 300.0, first: int | None = None, armed: bool = True):
        assert all(f in FAULTS for f in faults), faults
        self.files, self.faults, self.every = dict(files), list(faults), max(1, every)
        self.first = every if first is None else first  # the GET number of the first fault
        self.stall_s, self.refuse_s, self.lifetime_s = stall_s, refuse_s, lifetime_s
        self.gets = 0
        self.armed = armed  # faults count GETs from arm() on (a test arms the server at a moment of the run)
        self.injected: list[tuple[int, str]] = []  # (GET number, fault)
        self.bytes_sent = 0
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._down = threading.Event()
        self._closed = threading.Event()
        self.port = 0

    # ---- lifecycle ----
    def __enter__(self) -> "FaultServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self._listen()
        self.port = self._server.server_address[1]
        timer = threading.Timer(self.lifetime_s, self.stop)
        timer.daemon = True
        timer.start()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        self._closed.set()
        self._close_listener()

    def down(self) -> None:
        """Accept nothing from now on (every connection is refused), until up()."""
        self._down.set()
        self._close_listener()

    def up(self) -> None:
        """Accept connections again, on the same port."""
        self._down.clear()
        if self._server is None and not self._closed.is_set():
            self._listen()

    def arm(self) -> None:
        """Start the fault schedule now: the next GET is number 1."""
        with self._lock:
            self.gets, self.armed = 0, True

    def _listen(self) -> None:
        handler = type("Handler", (_Handler,), {"owner": self})
        server = _QuietServer(("127.0.0.1", self.port), handler)
        server.daemon_threads = True
        self._server = server
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def _close_listener(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()

    def _refuse_for(self, seconds: float) -> None:
        def cycle():
            self._close_listener()
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline and not self._closed.is_set():
                time.sleep(0.05)
            if not self._closed.is_set() and not self._down.is_set():
                self._listen()

        threading.Thread(target=cycle, daemon=True).start()

    def _next_fault(self) -> tuple[int, str | None]:
        with self._lock:
            if not self.armed:
                return 0, None
            self.gets += 1
            n = self.gets
            k = (n - self.first) // self.every if n >= self.first and (n - self.first) % self.every == 0 else -1
            fault = self.faults[k] if 0 <= k < len(self.faults) else None
            if fault:
                self.injected.append((n, fault))
            return n, fault


class _QuietServer(ThreadingHTTPServer):
    allow_reuse_address = True

    def handle_error(self, request, client_address) -> None:  # the faults break connections on purpose
        pass


class _Handler(BaseHTTPRequestHandler):
    owner: FaultServer
    protocol_version = "HTTP/1.0"

    def log_message(self, *args) -> None:  # quiet
        pass

    def _body(self) -> tuple[bytes, int, int, int] | None:
        data = self.owner.files.get(self.path.lstrip("/").split("?", 1)[0])
        if data is None:
            self.send_error(404)
            return None
        start, end = 0, len(data)
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes="):
            a, _, b = rng[6:].partition("-")
            start, end = int(a or 0), min(len(data), int(b) + 1 if b else len(data))
        return data, start, end, len(data)

    def _headers(self, start: int, end: int, total: int, ranged: bool) -> None:
        self.send_response(206 if ranged else 200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start))
        self.send_header("Accept-Ranges", "bytes")
        if ranged:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{total}")
        self.end_headers()

    def do_HEAD(self) -> None:
        found = self._body()
        if found is not None:
            _, start, end, total = found
            self._headers(0, total, total, False)

    def do_GET(self) -> None:
        owner = self.owner
        _, fault = owner._next_fault()
        found = self._body()
        if found is None:
            return
        data, start, end, total = found
        ranged = "Range" in self.headers
        if fault in ("503", "429"):
            self.send_response(int(fault))
            self.send_header("Retry-After", "0")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if fault == "stall":
            time.sleep(owner.stall_s)
            self._abort(reset=False)
            return
        if fault == "refuse":
            owner._refuse_for(owner.refuse_s)
            self._abort(reset=True)
            return
        self._headers(start, end, total, ranged)
        body = data[start:end]
        if fault in ("drop", "truncate"):
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self._abort(reset=fault == "drop")
            return
        self.wfile.write(body)
        with owner._lock:
            owner.bytes_sent += len(body)

    def _abort(self, reset: bool) -> None:
        try:
            if reset:  # SO_LINGER 0: close sends RST instead of FIN
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
        except OSError:
            pass
        self.close_connection = True
