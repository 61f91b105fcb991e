"""Shared fixtures. Tests may read ../shared (corpus, GPT-2 BPE files); the product never does."""
from __future__ import annotations

import os
import random
import re
from pathlib import Path

import pytest

# torch.compile in the tests (inductor's C++ backend on CPU), set before torch is imported (inductor reads both when
# its config module loads) and so for every process the tests start:
# - one compile thread: with two cores already running two test workers, inductor's default (a pool of compile
#   worker processes, one per core) adds fresh interpreters that import torch and contend for the same cores (the
#   compiled-loss test: 90 s of CPU with the pool, 66 s without);
# - inductor's scalar C++ kernels: its vectorised ones (ATen's Vectorized<T> templates) take g++ twice as long to
#   build (the same test: 66 s -> 39 s). The product compiles on GPUs, where inductor writes Triton, not C++; what the
#   tests check (graph capture, fullgraph, parameter names, compiled == eager within tolerance) does not depend on
#   the C++ vector width. `make test-isa ISA=avx2` turns the vector kernels back on and holds them to AVX2.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

import torch  # noqa: E402

from tests import forkserver  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

# Without CUDA the Triton kernels run in Triton's interpreter: in this process, and in every process the tests start.
# The switch is read when a kernel is defined and when triton itself is imported (its own @jit functions), so it is
# set here, before anything imports triton, and before the fork server starts (it imports triton; a child whose
# switch differs runs in a fresh interpreter: tests/forkserver.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser):
    parser.addoption("--file-order", default="forward",
                     help="the order test files run in: forward (default; LONG_FIRST's files first), reverse, or "
                          "random:SEED (a seeded shuffle, reproducible: the same seed gives the same order); tests "
                          "keep their order within a file")


FORKSERVER: forkserver.Handle | None = None


def pytest_configure(config):
    """The process that runs tests (an xdist worker, or pytest without workers) starts its fork server (tests/forkserver.py:
    the product's processes forked from an interpreter that imported torch once)."""
    global FORKSERVER
    config.addinivalue_line("markers", "fresh_python: the processes this test starts run in fresh interpreters, not "
                                       "forked from the suite's fork server (tests/forkserver.py says when)")
    controller = not hasattr(config, "workerinput") and getattr(config.option, "numprocesses", None)
    if not controller and FORKSERVER is None:
        FORKSERVER = forkserver.start()


def pytest_unconfigure(config):
    global FORKSERVER
    forkserver.stop(FORKSERVER)
    FORKSERVER = None


# the files that take longest, longest first (a cold run's --durations, seventeenth session: the ahead-of-time
# compile ~740 s with an empty Triton cache, 10 s warm; the others 40-70 s): the forward order starts them, so the two
# workers end on short files together (`make test` passes --no-loadscope-reorder: xdist would start the files with
# the most tests first)
LONG_FIRST = ("tests/tools/test_compile_kernels.py", "tests/nsa/test_indexer_kl_op.py",
              "tests/tools/test_gpu_acceptance.py", "tests/train/test_remote_training.py",
              "tests/nsa/test_nsa_compile.py", "tests/tools/test_gpu_nsa_speed.py", "tests/nsa/test_kernel_documents.py",
              "tests/nsa/test_indexer_picks_kernel.py", "tests/nsa/test_launch_count_triton.py",
              "tests/nsa/test_decode_step_kernel.py", "tests/nsa/test_select_two_pass.py",
              "tests/nsa/test_activation_checkpointing.py", "tests/train/test_compiled_run.py", "tests/nsa/test_loss.py")


def pytest_collection_modifyitems(config, items):
    order = config.getoption("--file-order")
    if order == "forward":
        rank = {path: i for i, path in enumerate(LONG_FIRST)}
        where = {item: rank.get(item.path.relative_to(REPO).as_posix(), len(LONG_FIRST)) for item in items}
        items.sort(key=where.__getitem__)  # stable: the other files keep their order, tests theirs
        return
    files = list(dict.fromkeys(item.path for item in items))
    if order == "reverse":
        files.reverse()
    elif order.startswith("random:") and order[7:].isdigit():
        random.Random(int(order[7:])).shuffle(files)
    else:
        raise pytest.UsageError(f"--file-order={order!r}: expected forward, reverse or random:SEED")
    rank = {path: i for i, path in enumerate(files)}
    items.sort(key=lambda item: rank[item.path])  # stable: a file's tests keep their order


MISSING_PACKAGE = re.compile(r"([A-Za-z0-9_.-]+) is not installed: (.+?) needs it")  # train/core/optional.py's line


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that failed because the product said an optional package is missing, and it is missing here (a stack
    without `datasets`, say), is skipped with that line: it cannot run on this machine, and nothing else is hidden
    (where the package is installed the product never says so)."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed or call.excinfo is None:
        return
    from train.core.optional import installed

    said = (str(call.excinfo.value), str(report.longrepr), report.capstderr, report.capstdout)  # a command's `error:`
    found = next((m for text in said if (m := MISSING_PACKAGE.search(text))), None)
    if found and not installed(found.group(1)):
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {found.group(0)} (not installed here)")


def pytest_report_header(config):
    return f"file order: {config.getoption('--file-order')}"


@pytest.fixture(scope="session")
def repo_dir() -> Path:
    return REPO


@pytest.fixture(scope="session")
def corpus_path() -> Path:
    path = SHARED / "corpus" / "kjv.txt"
    if not path.exists():
        pytest.fail(f"test corpus missing: {path} (../shared must sit beside the repo)")
    return path


# environment variables that are not a test's to keep: pytest's own, and those torch's inductor writes for itself the
# first time it runs (its cache directory, its own bookkeeping: TORCHINDUCTOR_CACHE_DIR, _TORCHINDUCTOR_...; on CUDA
# also Triton's cache directory and the ptxas it ships, first seen on an H200 with torch 2.11)
INDUCTOR_SETS = ("TRITON_CACHE_DIR", "TRITON_PTXAS_PATH")


def not_process_state(name: str) -> bool:
    return (name == "PYTEST_CURRENT_TEST" or name in INDUCTOR_SETS
            or name.startswith(("TORCHINDUCTOR_", "_TORCHINDUCTOR_")))


def process_state() -> dict:
    """What a test or an in-process library call must leave as it found it: torch's threads, default dtype,
    deterministic-algorithm and matmul-precision settings, the environment, the working directory and Triton's
    interpreter switch (a kernel module imported after a change would be built for the other mode)."""
    state = {
        "torch threads": torch.get_num_threads(),
        "torch interop threads": torch.get_num_interop_threads(),
        "torch default dtype": torch.get_default_dtype(),
        "torch deterministic algorithms": (torch.are_deterministic_algorithms_enabled(),
                                           torch.is_deterministic_algorithms_warn_only_enabled()),
        "torch float32 matmul precision": torch.get_float32_matmul_precision(),
        "torch grad mode": torch.is_grad_enabled(),
        "environment": {k: v for k, v in os.environ.items() if not not_process_state(k)},
        "working directory": os.getcwd(),
    }
    try:
        from triton import knobs
    except ImportError:
        return state
    return state | {"triton interpreter": bool(knobs.runtime.interpret)}


def state_changes(before: dict, after: dict) -> list[str]:
    """One line per setting that differs (environment variables named one by one)."""
    lines = []
    for name in before:
        if before[name] == after[name]:
            continue
        if name == "environment":
            keys = sorted(k for k in before[name].keys() | after[name].keys() if before[name].get(k) != after[name].get(k))
            lines += [f"environment variable {k}: {before[name].get(k)!r} -> {after[name].get(k)!r}" for k in keys]
        else:
            lines.append(f"{name}: {before[name]!r} -> {after[name]!r}")
    return lines


def restore_process_state(state: dict) -> None:
    torch.set_num_threads(state["torch threads"])
    torch.set_default_dtype(state["torch default dtype"])
    torch.use_deterministic_algorithms(state["torch deterministic algorithms"][0],
                                       warn_only=state["torch deterministic algorithms"][1])
    torch.set_float32_matmul_precision(state["torch float32 matmul precision"])
    torch.set_grad_enabled(state["torch grad mode"])
    kept = {k: v for k, v in os.environ.items() if not_process_state(k)}
    os.environ.clear()
    os.environ.update(state["environment"] | kept)
    os.chdir(state["working directory"])
    if "triton interpreter" in state:
        from triton import knobs

        knobs.runtime.interpret = state["triton interpreter"]


@pytest.fixture(autouse=True)
def _process_state_unchanged(request):
    """Fails the test that leaves process-global state changed (and puts it back, so the next test is not hit): a test
    that passes only after another file changed such state (torch threads, say) cannot land. A test marked fresh_python
    runs with the fork server out of the way (its processes run in fresh interpreters)."""
    bypassed = forkserver.bypass(FORKSERVER) if request.node.get_closest_marker("fresh_python") else None
    before = process_state()
    yield
    changes = state_changes(before, process_state())
    forkserver.restore(bypassed)
    if changes:
        restore_process_state(before)
        pytest.fail(f"{request.node.nodeid} left process state changed: " + "; ".join(changes), pytrace=False)


@pytest.fixture(autouse=True)
def _deterministic_torch():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def kjv_bin(tmp_path_factory, corpus_path) -> Path:
    """The corpus as a prepared bin: dataset (byte tokenizer, vocab 257), paragraphs as documents,
    5% held out by hash into val.bin. Built once per session through the product's own prepare."""
    from train.data.preparation import prepare

    out = tmp_path_factory.mktemp("kjv_bin") / "kjv_byte"
    prepare(f"text:{corpus_path}", "byte", out, val_fraction=0.05, workers=1, text_sample_by="paragraph")
    return out


@pytest.fixture(scope="session")
def kjv_gpt2(tmp_path_factory, corpus_path) -> Path:
    """The first 400 paragraphs of the corpus in GPT-2 tokens (a word-level tokenizer, for the needle test)."""
    from train.data.preparation import prepare

    out = tmp_path_factory.mktemp("kjv_gpt2") / "kjv_gpt2"
    prepare(f"text:{corpus_path}", "gpt2", out, val_fraction=0.05, workers=1, text_sample_by="paragraph", max_docs=400)
    return out
