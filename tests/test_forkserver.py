"""The suite's fork server (tests/forkserver.py) runs a command as a fresh interpreter would: the same arguments,
sys.path, working directory, environment, descriptors, limits and exit status, signals passed on, and its process
gone when the shim is killed. Each probe runs twice, forked and in a fresh interpreter (the same shim with the
server's variable unset), and the two reports are compared; `preloaded` (torch imported before the program's first
line) tells which way it ran, so a server that quietly stopped forking fails here too."""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import conftest, forkserver

PROBE = r'''
import json, os, resource, signal, sys
preloaded = "torch" in sys.modules
extra = int(os.environ.get("PROBE_FD", "-1"))
report = {
    "preloaded": preloaded, "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(),
    "env": os.environ.get("PROBE_VALUE"), "stdin": sys.stdin.read() if os.environ.get("PROBE_STDIN") else None,
    "fsize": resource.getrlimit(resource.RLIMIT_FSIZE), "umask": os.umask(0o22),
    "fd": os.read(extra, 100).decode() if extra >= 0 else None, "main": __name__,
    "executable_runs_python": os.path.basename(sys.executable).startswith("python"),
    "pythonpath_first": [p for p in sys.path[1:3]], "hup_ignored": signal.getsignal(signal.SIGHUP) == signal.SIG_IGN,
    "stdio": [[type(s.buffer).__name__, s.line_buffering, s.write_through] for s in (sys.stdout, sys.stderr)],
}
print(json.dumps(report))
sys.stderr.write("to stderr\n")
code = os.environ.get("PROBE_EXIT")
if code == "exception":
    raise ValueError("probe failed")
sys.exit(int(code) if code else 0)
'''


@pytest.fixture
def server():
    handle = conftest.FORKSERVER
    if handle is None:
        pytest.skip("the fork server is off (NSA_TEST_FORKSERVER=0)")
    deadline = time.time() + 120
    while not os.path.exists(handle.socket):  # it imports torch first
        assert time.time() < deadline and handle.proc.poll() is None, "the fork server did not start"
        time.sleep(0.1)
    return handle


def run_probe(server, tmp_path: Path, forked: bool, *, args=(), env=None, **kw) -> tuple[subprocess.CompletedProcess, dict]:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    environment = {**os.environ, "PYTHONPATH": str(tmp_path / "lib"), **(env or {})}
    if not forked:
        environment.pop(forkserver.ENV_VAR, None)
    proc = subprocess.run([server.python, *args, str(script)], capture_output=True, text=True, env=environment,
                          timeout=120, **kw)
    report = json.loads(proc.stdout.splitlines()[0]) if proc.stdout.strip() else {}
    return proc, report


def test_a_forked_command_sees_what_a_fresh_interpreter_sees(server, tmp_path):
    (tmp_path / "lib").mkdir()
    limit = 1 << 30

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        os.umask(0o027)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    results = {}
    for forked in (True, False):
        read, write = os.pipe()  # a descriptor passed on by number (as torchrun passes its own)
        os.write(write, b"through fd")
        os.close(write)
        proc, report = run_probe(server, tmp_path, forked, args=["-u"], cwd=tmp_path, input="on stdin",
                                 env={"PROBE_VALUE": "v", "PROBE_STDIN": "1", "PROBE_FD": str(read), "PROBE_EXIT": "3"},
                                 pass_fds=(read,), preexec_fn=limited)
        os.close(read)
        results[forked] = (proc.returncode, proc.stderr, report)
    (code_f, err_f, forked_report), (code_n, err_n, fresh_report) = results[True], results[False]
    assert forked_report.pop("preloaded") is True and fresh_report.pop("preloaded") is False
    assert forked_report == fresh_report
    assert (code_f, err_f) == (code_n, err_n) == (3, "to stderr\n")
    assert fresh_report["fd"] == "through fd" and fresh_report["stdin"] == "on stdin" and fresh_report["env"] == "v"
    assert fresh_report["fsize"] == [limit, limit] and fresh_report["umask"] == 0o027 and fresh_report["hup_ignored"]
    assert fresh_report["pythonpath_first"][0] == str(tmp_path / "lib") and fresh_report["main"] == "__main__"


def test_module_and_code_commands_order_sys_path_as_the_interpreter_does(server, tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "probe_mod.py").write_text(PROBE)
    reports = {}
    for forked in (True, False):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
        env["PYTHONPATH"] = str(tmp_path / "lib")
        if not forked:
            env.pop(forkserver.ENV_VAR, None)
        for how in (["-m", "probe_mod", "x"], ["-c", PROBE, "y"]):  # -c unbuffered by PYTHONUNBUFFERED
            unbuffered = {"PYTHONUNBUFFERED": "1"} if how[0] == "-c" else {}
            proc = subprocess.run([server.python, *how], cwd=tmp_path, env={**env, **unbuffered}, capture_output=True,
                                  text=True, timeout=120)
            report = json.loads(proc.stdout.splitlines()[0])
            assert report.pop("preloaded") is forked, how[0]
            reports[forked, how[0]] = (proc.returncode, report)
    for how in ("-m", "-c"):
        assert reports[True, how] == reports[False, how], how
    assert reports[True, "-m"][1]["path0"] == str(tmp_path) and reports[True, "-c"][1]["path0"] == ""
    assert reports[True, "-m"][1]["argv"] == [str(tmp_path / "probe_mod.py"), "x"]
    # stdout / stderr buffered (stderr by line) as the interpreter makes them, and unbuffered under PYTHONUNBUFFERED
    assert reports[True, "-m"][1]["stdio"] == [["BufferedWriter", False, False], ["BufferedWriter", True, False]]
    assert reports[True, "-c"][1]["stdio"] == [["FileIO", False, True]] * 2


def test_an_uncaught_exception_and_a_start_up_variable(server, tmp_path):
    proc, _ = run_probe(server, tmp_path, True, env={"PROBE_EXIT": "exception"})
    assert proc.returncode == 1 and proc.stderr.rstrip().endswith("ValueError: probe failed")
    # a variable read when the interpreter starts that the server started without: a fresh interpreter runs it
    proc, report = run_probe(server, tmp_path, True, env={"PYTHONHASHSEED": "123"})
    assert proc.returncode == 0 and report["preloaded"] is False
    # and one read when the preloaded modules import triton (its own @jit functions are built for the interpreter or
    # not): a kernel run in Triton's interpreter in a forked child failed ("Cannot call @triton.jit'd outside ...")
    other = "0" if os.environ.get("TRITON_INTERPRET") == "1" else "1"
    proc, report = run_probe(server, tmp_path, True, env={"TRITON_INTERPRET": other})
    assert proc.returncode == 0 and report["preloaded"] is False


def test_a_sitecustomize_on_pythonpath_runs_as_at_start_up(server, tmp_path):
    """site.py imports a sitecustomize found on the path when the interpreter starts (tests use one to make imports
    fail as on another machine); a forked child never starts, so such a command runs in a fresh interpreter."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "sitecustomize.py").write_text("import os\nos.environ['PROBE_VALUE'] = 'customized'\n")
    for forked in (True, False):
        proc, report = run_probe(server, tmp_path, forked)
        assert proc.returncode == 0 and report["env"] == "customized" and report["preloaded"] is False, (forked, report)
    (tmp_path / "lib" / "sitecustomize.py").unlink()  # without it the same command is forked again
    proc, report = run_probe(server, tmp_path, True)
    assert proc.returncode == 0 and report["env"] is None and report["preloaded"] is True


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.01)
    return False


SLEEPER = ("import os, signal, sys, time\n"
           "signal.signal(signal.SIGUSR1, lambda *a: os.write(1, b'usr1\\n'))\n"
           "print(os.getpid(), flush=True)\n"
           "while True: time.sleep(0.05)\n")


def test_signals_reach_the_program_and_killing_the_shim_kills_it(server):
    proc = subprocess.Popen([server.python, "-c", SLEEPER], stdout=subprocess.PIPE, text=True)
    pid = int(proc.stdout.readline())
    assert pid != proc.pid and "torch" in Path(f"/proc/{pid}/maps").read_text()  # forked from the server
    proc.send_signal(signal.SIGUSR1)
    assert proc.stdout.readline().strip() == "usr1"
    proc.terminate()
    assert proc.wait(timeout=30) == -signal.SIGTERM and wait_gone(pid)

    proc = subprocess.Popen([server.python, "-c", SLEEPER], stdout=subprocess.PIPE, text=True)
    pid = int(proc.stdout.readline())
    proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert wait_gone(pid), "the program outlived its killed shim"

    proc = subprocess.Popen([server.python, "-c", SLEEPER], stdout=subprocess.PIPE, text=True)
    pid = int(proc.stdout.readline())
    os.kill(pid, signal.SIGKILL)  # the program itself killed (as a test kills the trainer by its recorded pid)
    assert proc.wait(timeout=30) == -signal.SIGKILL

    # a signal that reaches the shim after its program ended (torchrun's SIGTERM to every rank once one has failed,
    # seen in CI): nothing to pass it to; the shim still exits as the program did, without a traceback
    proc = subprocess.Popen([server.python, "-c", SLEEPER], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pid = int(proc.stdout.readline())
    os.kill(proc.pid, signal.SIGSTOP)  # the shim cannot read its program's status until it continues
    os.kill(pid, signal.SIGKILL)
    assert wait_gone(pid)  # ended and reaped by the server
    os.kill(proc.pid, signal.SIGTERM)  # pending until SIGCONT: both reach the shim's handler with the program gone
    os.kill(proc.pid, signal.SIGCONT)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert proc.stderr.read() == ""


SHUTDOWN = r'''
import atexit, sys, threading, time
left_open = open(sys.argv[1], "w")
left_open.write("written, never closed")  # flushed by the interpreter's shutdown, not by the program
atexit.register(lambda: print("atexit ran", flush=False))
threading.Thread(target=lambda: (time.sleep(0.3), open(sys.argv[2], "w").write("thread joined"))).start()
sys.exit("a message")
'''


def test_shutdown_joins_threads_runs_atexit_and_flushes_what_was_left_open(server, tmp_path):
    outcomes = []
    for forked in (True, False):
        env = dict(os.environ)
        if not forked:
            env.pop(forkserver.ENV_VAR, None)
        files = tmp_path / f"open_{forked}", tmp_path / f"thread_{forked}"
        proc = subprocess.run([server.python, "-c", SHUTDOWN, *map(str, files)], env=env, capture_output=True,
                              text=True, timeout=60)
        outcomes.append((proc.returncode, proc.stdout, proc.stderr, *(f.read_text() for f in files)))
    assert outcomes[0] == outcomes[1] == (1, "atexit ran\n", "a message\n", "written, never closed", "thread joined")


def test_a_signal_ignored_at_start_reaches_a_program_that_handles_it(server):
    """Started with SIGINT ignored (a background job of a non-interactive shell), the program still gets the SIGINT
    sent to it once it set a handler (the trainer's Ctrl-C): the shim passes it on, whatever its own start."""
    program = ("import os, signal, time\n"
               "assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN\n"
               "signal.signal(signal.SIGINT, lambda *a: os._exit(7))\n"
               "print('ready', flush=True)\n"
               "time.sleep(60)\n")
    proc = subprocess.Popen([server.python, "-c", program], stdout=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 7
