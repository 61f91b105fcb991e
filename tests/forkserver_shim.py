"""The `python` that tests start: hands its command to the suite's fork server, or runs the real interpreter.

Standard library only: it runs as `<real python> -IS` (no site, no environment), about 20 ms to start. It is copied
into the shim's bin/python by tests/forkserver.py, which writes the real interpreter's path into REAL_PYTHON.

The process it starts is forked from a server that has imported torch once (tests/forkserver.py); this process stays
its stand-in for the caller: its stdin, stdout, stderr and every other inherited descriptor, its working directory,
environment, resource limits, umask and ignored signals go to that process; the signals it receives are passed on;
it exits as that process exited (the same code, or killed by the same signal); and when it is killed itself
(SIGKILL, a timeout), the server kills that process. Commands it cannot reproduce exactly run the real interpreter:
any interpreter option but -u / -B, no server (NSA_TEST_FORKSERVER unset), or the server saying no (an environment
variable read at start-up that differs from the server's, see tests/forkserver.py).
"""
import json
import os
import signal
import socket
import struct
import sys

REAL_PYTHON = "@REAL_PYTHON@"
FORWARDED = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGALRM, signal.SIGCONT, signal.SIGWINCH]
LIMITS = ("RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_CORE", "RLIMIT_AS", "RLIMIT_DATA", "RLIMIT_CPU", "RLIMIT_NPROC")


def real_interpreter() -> None:
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    os.execv(REAL_PYTHON, [REAL_PYTHON, *sys.argv[1:]])


def parse(args: list[str]):
    """-> (unbuffered, kind, target, rest) for `[-u] [-B] (-m MOD | -c CODE | - | SCRIPT) ARGS...`, else None."""
    unbuffered, i = False, 0
    while i < len(args) and args[i].startswith("-") and args[i] != "-":
        flag = args[i]
        if flag in ("-m", "-c"):
            if i + 1 >= len(args):
                return None
            return unbuffered, flag[1], args[i + 1], args[i + 2:]
        if flag.startswith(("-m", "-c")) and len(flag) > 2:  # -mtrain, -c'code'
            return unbuffered, flag[1], flag[2:], args[i + 1:]
        letters = flag[1:]
        if not letters or any(c not in "uB" for c in letters):
            return None
        unbuffered = unbuffered or "u" in letters
        i += 1
    if i >= len(args):
        return None  # an interactive interpreter
    if args[i] == "-":
        return unbuffered, "-", "-", args[i + 1:]
    return unbuffered, "script", args[i], args[i + 1:]


def inherited_fds() -> list[int]:
    fds = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            os.fstat(fd)
        except OSError:
            continue  # the listing's own descriptor, already closed
        fds.append(fd)
    return sorted(fds)


def exit_like(status: int) -> None:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status))


def main() -> None:
    server = os.environ.get("NSA_TEST_FORKSERVER")
    command = parse(sys.argv[1:])
    if not server or command is None or not os.path.exists(server):
        real_interpreter()
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)  # until the process exists to pass them to
    fds = inherited_fds()
    unbuffered, kind, target, rest = command
    import resource
    umask = os.umask(0)
    os.umask(umask)
    unbuffered = unbuffered or bool(os.environ.get("PYTHONUNBUFFERED"))  # the interpreter reads it at start-up
    request = {
        "unbuffered": unbuffered, "kind": kind, "target": target, "args": rest, "argv": sys.argv[1:],
        "cwd": os.getcwd(), "env": dict(os.environ), "executable": os.path.abspath(sys.argv[0]), "fds": fds,
        "umask": umask,
        "limits": {name: resource.getrlimit(getattr(resource, name)) for name in LIMITS},
        "ignored": [int(s) for s in signal.valid_signals()
                    if s not in (signal.SIGKILL, signal.SIGSTOP) and signal.getsignal(s) == signal.SIG_IGN],
    }
    body = json.dumps(request).encode()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(server)
        socket.send_fds(conn, [struct.pack("!Q", len(body))], fds)
        conn.sendall(body)
        reader = conn.makefile("rb")
        reply = json.loads(reader.readline() or b"{}")
    except OSError:
        reply = {}
    if "pid" not in reply:
        conn.close()
        real_interpreter()
    pid = reply["pid"]

    def forward(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:  # it has ended (torchrun's SIGTERM to a rank that exited): its status follows
            pass

    for sig in FORWARDED:  # ignored ones too: the program may set a handler where it started with SIG_IGN
        signal.signal(sig, forward)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    line = reader.readline()  # the server's `{"status": ...}` when the process ends
    if not line:
        sys.stderr.write(f"forkserver shim: the fork server went away while process {pid} ran\n")
        os._exit(1)
    exit_like(json.loads(line)["status"])


main()
