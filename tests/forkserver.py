"""The suite's fork server: the trainer processes tests start, forked from one interpreter that imported torch once.

Why: a test that runs the product starts a Python process, and each paid about 2.3 s of CPU in imports before it
did anything (`import torch` 1.1 s, `torch._dynamo` 1.1 s, which any `torch.optim` optimizer imports): 280-odd
processes, about 11 of the suite's 18 CPU-minutes (docs/BENCHMARKS.md "The test suite's time"). Forked from a
server holding those modules, the same tiny training run costs 0.3 s.

How: each pytest process (each xdist worker) starts one server (`start`), which imports torch, torch._dynamo and the
other heavy third-party modules, never the project's own, and listens on a unix socket. `start` writes a `python`
shim (tests/forkserver_shim.py) into a bin directory beside it and makes it `sys.executable`, the interpreter of
scripts/'s runbooks (VENV) and of every process those start (a forked process's sys.executable is the shim too, so
torchrun's ranks are forked as well). The shim sends its command, descriptors, working directory, environment,
limits, umask and ignored signals; the server forks; the child sets all of that up and runs the command as
`python` would (tests/forkserver.py's `Program`), then exits through the interpreter's own shutdown (threads
joined, atexit, buffers flushed), and the server sends the exit status back to the shim, which exits alike.

What a forked process does not have: a fresh interpreter's start-up. The server refuses (the shim runs the real
interpreter instead) where the difference could show: an environment variable read at start-up (by Python, the
math libraries or torch's import) that differs from the server's, an interpreter option other than -u / -B, a
script that is not a plain file. Tests of start-up itself, and tests that kill a process with SIGKILL and at once
read what it left (the forked process dies a moment after its shim), carry `@pytest.mark.fresh_python`.
`NSA_TEST_FORKSERVER=0 make test` runs the whole suite with fresh interpreters.
"""
from __future__ import annotations

import atexit
import builtins
import ctypes
import fcntl
import gc
import importlib
import io
import json
import os
import resource
import runpy
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import types
from pathlib import Path

# preloaded by the server: third-party modules only (the project's modules are imported by each child, as they
# would be in a fresh process, so an environment variable read when they are imported is read then)
PRELOAD = ("numpy", "yaml", "torch", "torch._dynamo", "torch.optim", "torch.distributed", "torch.distributed.fsdp",
           "torch.distributed.tensor", "torch.distributed.checkpoint", "torch.utils.tensorboard",
           "torch.nn.attention.flex_attention")
# modules site.py imports at start-up from the path (a PYTHONPATH entry holding one: a fresh interpreter)
CUSTOMIZE = ("sitecustomize.py", "sitecustomize", "usercustomize.py", "usercustomize")
# environment variables read when the interpreter starts or those modules are imported: a child whose value differs
# from the server's runs in a fresh interpreter (prefixes; LAZY lists the ones read later, at use)
STARTUP_PREFIXES = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS", "ATEN_", "NPY_", "ONEDNN_", "DNNL_", "LD_",
                    "MALLOC_", "TORCH", "PYTORCH_", "TRITON", "_TORCH", "LANG", "LC_")
# (not TRITON_INTERPRET: the preloaded modules import triton, whose own @jit library functions are built for the
# interpreter or not at that moment; a kernel interpreted over compiled ones fails, "Cannot call @triton.jit'd outside
# of the scope of a kernel")
LAZY = ("PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "TORCHELASTIC_", "TORCH_NCCL_",
        "TORCHINDUCTOR_CACHE_DIR", "_TORCHINDUCTOR_", "TRITON_CACHE_DIR", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
PR_SET_PDEATHSIG = 1
ENV_VAR = "NSA_TEST_FORKSERVER"  # the server's socket; "0" turns the fork server off for a run


def startup_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(STARTUP_PREFIXES) and not k.startswith(LAZY)}


def die_with_parent(sig: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)


class Program:
    """One command, run in a forked child as `python` would run it."""

    def __init__(self, request: dict, fds: list[int], server: "Server"):
        self.request, self.fds, self.server = request, fds, server

    def install(self) -> None:
        r, srv = self.request, self.server
        die_with_parent(signal.SIGKILL)
        if os.getppid() != srv.pid:
            os._exit(70)  # the server died before the line above
        signal.set_wakeup_fd(-1)
        for sig, handler in srv.handlers.items():
            signal.signal(sig, handler)
        if signal.SIGINT not in r["ignored"]:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig in r["ignored"]:
            signal.signal(sig, signal.SIG_IGN)
        # the shim's descriptors at their own numbers, nothing of the server's
        top = 1 + max([*r["fds"], *self.fds, *map(int, os.listdir("/proc/self/fd")), 2])
        high = [fcntl_dup(fd, top) for fd in self.fds]
        os.closerange(0, top)
        for target, fd in zip(r["fds"], high):
            os.dup2(fd, target, inheritable=True)
            os.close(fd)
        for name, (soft, hard) in r["limits"].items():
            which = getattr(resource, name)
            if resource.getrlimit(which) != (soft, hard):
                resource.setrlimit(which, (soft, hard))
        os.umask(r["umask"])
        os.environ.clear()
        os.environ.update(r["env"])
        os.chdir(r["cwd"])
        sys.stdin = sys.__stdin__ = stdio(0, "r", False, srv.encoding, srv.errors)
        sys.stdout = sys.__stdout__ = stdio(1, "w", r["unbuffered"], srv.encoding, srv.errors)
        sys.stderr = sys.__stderr__ = stdio(2, "w", r["unbuffered"], srv.encoding, "backslashreplace")
        sys.executable = r["executable"]
        sys.orig_argv = [r["executable"], *r["argv"]]
        pythonpath = [p for p in r["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        kind, target = r["kind"], r["target"]
        first = r["cwd"] if kind == "m" else os.path.dirname(os.path.realpath(target)) if kind == "script" else ""
        sys.path[:] = [first, *pythonpath, *srv.base_path]  # as the interpreter orders them at start-up
        importlib.invalidate_caches()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()  # a fresh process draws its own global numpy state

    def run(self) -> None:
        """Runs the program and exits as the interpreter would, without tearing the preloaded modules down (that
        would write to every page shared with the server: 0.9 s of copying for `python -c pass`)."""
        self.install()
        signalled = None
        try:
            self.execute()
            code = 0
        except SystemExit as exc:
            code = exit_code(exc.code)
        except BaseException as exc:  # uncaught: the traceback, exit 1 (KeyboardInterrupt: killed by SIGINT)
            sys.excepthook(type(exc), exc, exc.__traceback__)
            code, signalled = 1, signal.SIGINT if isinstance(exc, KeyboardInterrupt) else None
        finish(code, signalled)

    def execute(self) -> None:
        r = self.request
        kind, target, args = r["kind"], r["target"], r["args"]
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = builtins
        sys.modules["__main__"] = main
        if kind == "m":
            sys.argv = ["-m", *args]
            runpy._run_module_as_main(target, alter_argv=True)
            return
        if kind == "script":
            sys.argv = [target, *args]
            try:
                with open(target, "rb") as f:
                    source = f.read()
            except OSError as exc:
                sys.stderr.write(f"{sys.executable}: can't open file {os.path.abspath(target)!r}: "
                                 f"[Errno {exc.errno}] {exc.strerror}\n")
                sys.exit(2)
            main.__file__, main.__cached__, filename = target, None, target
        else:  # -c CODE, or - (the program on stdin)
            sys.argv = ["-c" if kind == "c" else "-", *args]
            source, filename = (target, "<string>") if kind == "c" else (sys.stdin.read(), "<stdin>")
        exec(compile(source, filename, "exec"), main.__dict__)


def exit_code(code) -> int:
    """SystemExit's code as the interpreter turns it into an exit status (a message is printed, status 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        sys.stderr.write(f"{code}\n")
    except Exception:
        pass
    return 1


def finish(code: int, signalled: int | None) -> None:
    """What the interpreter's shutdown does that a program can see: non-daemon threads joined, atexit callbacks
    (logging's flush, weakref finalizers, multiprocessing's clean-up) run, the buffers of files the program left
    open flushed, stdout and stderr flushed (a failed stdout flush is status 120); then the process ends."""
    threading._shutdown()
    atexit._run_exitfuncs()
    for generation in (0, 1, 2):  # the program's objects (the server's own are frozen: gc.freeze)
        for obj in gc.get_objects(generation):
            # type(), not isinstance(): a weak proxy whose referent died raises ReferenceError on __class__
            if issubclass(type(obj), (io.BufferedWriter, io.BufferedRandom, io.TextIOWrapper)) and obj not in (
                    sys.stdout, sys.stderr):
                try:
                    if not obj.closed:
                        obj.flush()
                except Exception:
                    pass
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None and not stream.closed:
                stream.flush()
        except Exception as exc:
            if stream is sys.stdout:
                code = 120
                try:
                    sys.stderr.write(f"Exception ignored on flushing sys.stdout:\n{exc!r}\n")
                except Exception:
                    pass
    if signalled is not None:
        signal.signal(signalled, signal.SIG_DFL)
        os.kill(os.getpid(), signalled)
    os._exit(code)


def fcntl_dup(fd: int, lowest: int) -> int:
    return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, lowest)


def stdio(fd: int, mode: str, unbuffered: bool, encoding: str, errors: str):
    """sys.stdin / stdout / stderr as the interpreter makes them at start-up (None where the descriptor is closed)."""
    try:
        os.fstat(fd)
    except OSError:
        return None
    raw = io.FileIO(fd, mode + "b", closefd=False)
    if mode == "r":
        return io.TextIOWrapper(io.BufferedReader(raw), encoding=encoding, errors=errors)
    tty = raw.isatty()
    if unbuffered:  # -u or PYTHONUNBUFFERED: each write goes straight to the descriptor (so print()'s newline is a
        return io.TextIOWrapper(raw, encoding=encoding, errors=errors, write_through=True)  # write of its own)
    return io.TextIOWrapper(io.BufferedWriter(raw), encoding=encoding, errors=errors, line_buffering=tty or fd == 2)


class Server:
    def __init__(self, path: str):
        self.path, self.pid = path, os.getpid()
        self.handlers = {s: signal.getsignal(s) for s in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP,
                                                          signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM)}
        self.encoding, self.errors = sys.stdout.encoding, sys.stdout.errors
        self.base_path = sys.path[1:]  # started with no PYTHONPATH: sys.path[0] is the server's own
        self.startup = startup_env(os.environ)
        self.children: dict[int, socket.socket | None] = {}  # pid -> the shim's connection (None: the shim is gone)
        self.log = open(path + ".log", "a", buffering=1)

    def refuse(self, request: dict) -> str | None:
        """Why this command must run in a fresh interpreter, or None."""
        wanted = startup_env(request["env"])
        differ = sorted(k for k in set(wanted) | set(self.startup) if wanted.get(k) != self.startup.get(k))
        if differ:
            return f"start-up environment differs: {', '.join(differ)}"
        customizing = [entry for entry in request["env"].get("PYTHONPATH", "").split(os.pathsep) if entry and any(
            os.path.exists(os.path.join(request["cwd"], entry, name)) for name in CUSTOMIZE)]
        if customizing:  # the interpreter imports it at start-up (site.py): a forked child never would
            return f"PYTHONPATH entry {customizing[0]} has a sitecustomize / usercustomize"
        if request["kind"] == "script" and not os.path.isfile(os.path.join(request["cwd"], request["target"])):
            return f"script {request['target']} is not a file"
        if not os.path.isdir(request["cwd"]):
            return f"working directory {request['cwd']} is gone"
        for name, (soft, hard) in request["limits"].items():
            mine = resource.getrlimit(getattr(resource, name))[1]
            if os.geteuid() != 0 and mine != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or hard > mine):
                return f"{name} above the server's"
        return None

    def accept(self, listener: socket.socket):
        conn, _ = listener.accept()
        conn.settimeout(10)
        try:
            head, fds, _, _ = socket.recv_fds(conn, 8, 1024)
            size = struct.unpack("!Q", head)[0]
            body = b""
            while len(body) < size:
                chunk = conn.recv(size - len(body))
                if not chunk:
                    raise OSError("short request")
                body += chunk
            request = json.loads(body)
        except (OSError, ValueError, struct.error) as exc:
            self.log.write(f"bad request: {exc}\n")
            conn.close()
            return None
        why = self.refuse(request)
        if why:
            self.log.write(f"fresh interpreter for {request['kind']} {request['target'][:80]!r}: {why}\n")
            conn.sendall(b'{"fresh": true}\n')
            conn.close()
            for fd in fds:
                os.close(fd)
            return None
        self.log.write(f"forked {request['kind']} {request['target'][:80]!r}\n")
        pid = os.fork()
        if pid == 0:
            listener.close()
            conn.close()
            for other in self.children.values():
                if other is not None:
                    other.close()
            self.log.close()
            return Program(request, fds, self)
        for fd in fds:
            os.close(fd)
        conn.settimeout(None)
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        self.children[pid] = conn
        return None

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(json.dumps({"status": status}).encode() + b"\n")
                except OSError:
                    pass
                conn.close()

    def serve(self) -> Program:
        """Forks a child for each request; returns only in a child, with its program."""
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(wake_w)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.path + ".tmp")
        listener.listen(64)
        os.rename(self.path + ".tmp", self.path)  # the shims use the server once it is listening
        while True:
            live = {conn: pid for pid, conn in self.children.items() if conn is not None}
            ready, _, _ = select.select([listener, wake_r, *live], [], [], 5.0)
            for r in ready:
                if r is listener:
                    program = self.accept(listener)
                    if program is not None:
                        os.close(wake_r)
                        os.close(wake_w)
                        return program
                elif r is wake_r:
                    try:
                        os.read(wake_r, 512)
                    except BlockingIOError:
                        pass
                else:  # a shim's connection: it said nothing, so it is gone (killed): its process goes too
                    pid = live[r]
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    r.close()
                    self.children[pid] = None
            self.reap()


def serve_forever(path: str) -> None:
    """The server process's body (`python tests/forkserver.py SOCKET`): imports, then serves."""
    die_with_parent(signal.SIGTERM)
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    gc.collect()
    gc.freeze()  # the preloaded objects: out of the children's collections (which would copy their pages)
    program = Server(path).serve()
    program.run()


# ---- the pytest side ------------------------------------------------------------------------------------------------
class Handle:
    """A running server and its shim: `real` is the interpreter the shim stands in for."""

    def __init__(self, root: str, real: str, proc):
        self.root, self.real, self.proc = root, real, proc
        self.socket = os.path.join(root, "s")
        self.python = os.path.join(root, "bin", "python")


def start() -> Handle | None:
    """Starts this process's server (returns at once: the shims run the real interpreter until it listens) and makes
    its shim sys.executable, the runbooks' interpreter (VENV) and NSA_TEST_FORKSERVER. None where turned off."""
    if os.environ.get(ENV_VAR) == "0" or sys.platform != "linux":
        return None
    real = os.environ.get("NSA_TEST_REAL_PYTHON", sys.executable)
    short = len(tempfile.gettempdir()) > 80  # a unix socket's path holds 107 bytes
    root = tempfile.mkdtemp(prefix="nsa-fork-", dir="/tmp" if short else None)
    bin_dir = Path(root) / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "python"
    source = (Path(__file__).with_name("forkserver_shim.py")).read_text().replace("@REAL_PYTHON@", real)
    shim.write_text(f"#!{real} -IS\n{source}")
    shim.chmod(0o755)
    for entry in Path(real).parent.iterdir():  # the venv's other commands (pip, torchrun, tensorboard, ...)
        if not entry.name.startswith("python"):
            (bin_dir / entry.name).symlink_to(entry)
    (bin_dir / "python3").symlink_to("python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", ENV_VAR)}
    log = open(os.path.join(root, "server.out"), "wb")
    proc = subprocess.Popen([real, __file__, os.path.join(root, "s")], env=env, stdin=subprocess.DEVNULL,
                            stdout=log, stderr=log, start_new_session=True)
    log.close()
    handle = Handle(root, real, proc)
    os.environ[ENV_VAR] = handle.socket
    os.environ["NSA_TEST_REAL_PYTHON"] = real
    os.environ["VENV"] = root
    sys.executable = handle.python
    return handle


def environment() -> dict[str, str]:
    """The variables `start` set, for a test that builds a subprocess's environment by removing a developer's knobs
    (VENV, NSA_*): with them its processes still go through the server."""
    return {k: os.environ[k] for k in (ENV_VAR, "NSA_TEST_REAL_PYTHON", "VENV")
            if k in os.environ and ENV_VAR in os.environ}


def bypass(handle: Handle | None):
    """Turns the server off for what this process starts until `restore`: fresh interpreters."""
    if handle is None or os.environ.get(ENV_VAR) != handle.socket:
        return None
    del os.environ[ENV_VAR]
    sys.executable = handle.real
    return handle


def restore(handle: Handle | None) -> None:
    if handle is not None:
        os.environ[ENV_VAR] = handle.socket
        sys.executable = handle.python


def stop(handle: Handle | None) -> None:
    if handle is None:
        return
    handle.proc.terminate()
    try:
        handle.proc.wait(timeout=10)
    except Exception:
        handle.proc.kill()
    if not os.environ.get("NSA_TEST_FORKSERVER_KEEP"):  # a developer's look at its log (server.out, s.log)
        shutil.rmtree(handle.root, ignore_errors=True)


if __name__ == "__main__":
    serve_forever(sys.argv[1])
