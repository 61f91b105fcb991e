"""A full disk, caused for real: the trainer runs in a child process whose file-size limit (RLIMIT_FSIZE) is lowered,
with SIGXFSZ ignored, so a write past the limit fails with EFBIG as a write on a full disk fails with ENOSPC. The run
stops with exit 4 and one line naming the file; what was written before stays whole and loads."""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from train.checkpoint import io as ckpt_io
from train.core.artifacts import read_csv

from .helpers import TINY_MODEL

REPO = Path(__file__).resolve().parents[2]
BASE = TINY_MODEL + ["--train.seq_len=32", "--train.batch_size=2", "--train.log_every=1", "--runtime.device=cpu",
                     "--runtime.threads=1", "--data.source=synthetic", "--train.warmup_steps=1", "--train.eval_every=0"]
EXIT_STORAGE = 4


def train(out: Path, *args: str, file_limit: int | None = None) -> subprocess.CompletedProcess:
    def limit_file_size():  # in the child only: the test process keeps its own limits
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, file_limit))

    cmd = [sys.executable, "-m", "train", *BASE, f"--train.out_dir={out}", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
                          preexec_fn=limit_file_size if file_limit else None)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, int]:
    """A run with a checkpoint at step 4, and that checkpoint's size."""
    out = tmp_path_factory.mktemp("disk") / "template"
    proc = train(out, "--train.steps=4", "--train.save_every=4")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out, (out / "checkpoint_step4.pt").stat().st_size


def copy_run(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for path in src.iterdir():
        if path.is_file() and not path.is_symlink():
            (dst / path.name).write_bytes(path.read_bytes())
    (dst / "latest.pt").symlink_to("checkpoint_step4.pt")
    return dst


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_checkpoint_that_does_not_fit_stops_the_run_with_the_old_one_intact(tmp_path, trained, mode):
    template, size = trained
    out = copy_run(template, tmp_path / "out")
    before = (out / "checkpoint_step4.pt").read_bytes()
    proc = train(out, "--train.steps=8", "--train.save_every=2", f"--train.async_checkpoint={mode == 'async'}",
                 file_limit=size // 2)
    assert proc.returncode == EXIT_STORAGE, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    failed_step = 6  # the first save after the resume (async: found when the next save waits for it)
    assert last.startswith(f"error: {'the asynchronous write of ' if mode == 'async' else 'checkpoint '}"
                           f"{out / f'checkpoint_step{failed_step}.pt'}"), last
    assert "[Errno 27] File too large" in last or "file write failed" in last, last
    assert f"the newest checkpoint {out / 'checkpoint_step4.pt'} is untouched; free space under {out}" in last
    assert "Traceback" not in proc.stderr
    # the previous checkpoint and latest.pt: untouched, still load; nothing partial under a checkpoint's name
    assert (out / "checkpoint_step4.pt").read_bytes() == before
    assert os.readlink(out / "latest.pt") == "checkpoint_step4.pt"
    assert ckpt_io.load_checkpoint(out / "latest.pt")["step"] == 4
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == ["checkpoint_step4.pt"]
    assert not [p for p in out.iterdir() if ".tmp" in p.name]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["status"] == "write_failed"
    # space freed: the same command resumes from step 4 and finishes
    again = train(out, "--train.steps=8", "--train.save_every=2", f"--train.async_checkpoint={mode == 'async'}")
    assert again.returncode == 0, again.stderr[-2000:]
    assert [int(r["step"]) for r in read_csv(out / "training.csv")] == list(range(1, 9))


def test_a_log_that_does_not_fit_stops_the_run_with_one_line(tmp_path, trained):
    template, _ = trained
    out = copy_run(template, tmp_path / "out")
    logs = [p.stat().st_size for p in out.iterdir() if p.suffix != ".pt"]
    proc = train(out, "--train.steps=400", "--train.save_every=0", file_limit=max(logs) + 4000)  # a few rows fit
    assert proc.returncode == EXIT_STORAGE, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and " could not be written: [Errno 27] File too large" in last, last
    assert "Traceback" not in proc.stderr and "Exception in thread" not in proc.stderr, proc.stderr  # one line only
    assert json.loads((out / "metrics.json").read_text())["status"] == "write_failed"  # small: it still fits
    rows = read_csv(out / "training.csv")  # whole rows only, in order
    assert [int(r["step"]) for r in rows] == list(range(1, len(rows) + 1)) and len(rows) > 4
    assert ckpt_io.load_checkpoint(out / "latest.pt")["step"] == 4


TENSORBOARD_FILLS = """
import sys, threading
from pathlib import Path
from train.core.errors import StorageError
from train.observe.telemetry import TensorBoard

tb = TensorBoard(Path(sys.argv[1]))
try:
    for step in range(100000):
        tb.scalars(step, {"train/loss": 1.0 / (step + 1), "train/lr": 3e-4})
except StorageError as exc:
    print(f"error: {exc}", file=sys.stderr, flush=True)
tb.close()
worker = threading.Thread(target=lambda: 1 / 0, name="another")  # another thread's error is still printed
worker.start()
worker.join()
"""


def test_tensorboard_on_a_full_disk_prints_only_our_line(tmp_path):
    """TensorBoard's writer thread re-raises a failed write; Python's thread hook used to print it as a traceback
    before the trainer's one line. Only that thread's OSError is quieted: another thread's error still prints."""
    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))

    proc = subprocess.run([sys.executable, "-c", TENSORBOARD_FILLS, str(tmp_path / "tb")], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
                          preexec_fn=limit_file_size)
    lines = proc.stderr.strip().splitlines()
    ours = [line for line in lines if line.startswith("error: ")]
    assert len(ours) == 1 and "(TensorBoard events) could not be written: [Errno 27] File too large" in ours[0], lines
    before = proc.stderr.split(ours[0])[0]
    assert "Traceback" not in before and "_AsyncWriterThread" not in before, proc.stderr
    assert "Exception in thread another" in proc.stderr and "ZeroDivisionError" in proc.stderr, proc.stderr


def test_the_error_line_is_one_write_when_stderr_is_unbuffered():
    """Ranks under torchrun run `python -u`: print() would write the text and its newline separately, and two ranks
    stopping at the same vote printed `error: A error: B` on one line (seen in CI). The line goes out in one write."""
    import io

    from train.core.errors import StorageError, print_error

    class Recorded(io.RawIOBase):
        def __init__(self):
            super().__init__()
            self.writes: list[bytes] = []

        def writable(self) -> bool:
            return True

        def write(self, data) -> int:
            self.writes.append(bytes(data))
            return len(data)

    raw = Recorded()
    stderr = io.TextIOWrapper(raw, encoding="utf-8", write_through=True)  # what `python -u` makes of fd 2
    print_error(StorageError.of("out/training.csv", OSError(28, "No space left on device")), file=stderr)
    assert raw.writes == [b"error: out/training.csv could not be written: [Errno 28] No space left on device\n"]
