"""train.async_checkpoint: the state staged to host memory, one background thread writes the file (train/checkpoint/
async_writer.py). Equal checkpoints and bit-identical runs, exact resume from a file the thread wrote while training
went on, a real kill -9 while a write is in flight, .HALT / SIGTERM and an error waiting for the write, a write that fails for real
surfacing as one line with exit 2, and nothing started when it is off."""
from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from train.checkpoint import io as ckpt_io
from train.checkpoint.async_writer import AsyncWriter, stage_to_host
from train.checkpoint.run_dir import OutDirLock
from train.core.artifacts import LATEST
from train.core.errors import CheckpointError
from train.trainer.runner import run_training

from .helpers import read_csv, tiny_config, wait_for

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
# ~2.5M parameters (as tests/train/test_chaos.py): a 30 MB checkpoint whose write lasts long enough to be hit
BIG = ["--model.vocab_size=4096", "--model.dim=128", "--model.n_layers=2", "--model.n_heads=4",
       "--model.ffn_dim=256", "--model.max_seq_len=64", "--train.seq_len=32", "--train.batch_size=4",
       "--train.log_every=1", "--train.eval_every=0", "--runtime.device=cpu", "--runtime.threads=1"]
ASYNC = "--train.async_checkpoint=true"


def writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "async-checkpoint"]


def temp_files(out: Path, pid: int | None = None) -> list[str]:
    """Temporary files of checkpoint writes (of process pid, or any) in out."""
    suffix = f".tmp{pid}" if pid is not None else ".tmp"
    return [n for n in os.listdir(out) if n.startswith(".checkpoint_step") and suffix in n] if out.exists() else []


def write_in_flight(out: Path, proc: subprocess.Popen, timeout: float = 120) -> list[str]:
    """Poll (every 0.5 ms) until proc has a checkpoint write's temporary file in out; its names ([] if proc ended)."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if found := temp_files(out, proc.pid):
            return found
        time.sleep(0.0005)
    return []


def same_content(a: dict, b: dict, ignore: tuple[str, ...] = ()) -> bool:
    if a.keys() != b.keys():
        return False
    for key in a:
        if key in ignore:
            continue
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)):
                return False
        elif isinstance(x, dict):
            if not (isinstance(y, dict) and same_content(x, y)):
                return False
        elif isinstance(x, (list, tuple)):
            if not (type(x) is type(y) and len(x) == len(y)
                    and all(same_content({0: u}, {0: v}) for u, v in zip(x, y))):
                return False
        elif x != y:
            return False
    return True


def checkpoint(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def comparable(ck: dict) -> dict:
    """A checkpoint less what two runs differ in by design: the lineage id, out_dir and the async_checkpoint setting."""
    config = {**ck["config"], "train": {k: v for k, v in ck["config"]["train"].items()
                                        if k not in ("async_checkpoint", "out_dir")}}
    config.pop("overrides", None)
    return {**{k: v for k, v in ck.items() if k != "lineage"}, "config": config}


# ---- the pieces ---------------------------------------------------------------------------------------------------
def test_staged_state_serialises_to_the_same_bytes_and_is_independent_of_later_steps():
    w = torch.randn(16, 8)
    state = {"embed": w, "head": w.detach(), "rows": w[3:7], "opt": {"m": [torch.zeros(4), 3, "x"]},
             "rng": (1.5, None), "ids": torch.arange(5)}
    staged = stage_to_host(state)
    a, b = io.BytesIO(), io.BytesIO()
    torch.save(state, a)
    torch.save(staged, b)
    assert a.getvalue() == b.getvalue()  # shared storages stay shared: the same file bytes as the live state
    assert staged["embed"].untyped_storage().data_ptr() == staged["head"].untyped_storage().data_ptr()
    w.add_(1.0)
    state["opt"]["m"][0].add_(1.0)
    state["opt"]["m"].append("later")
    assert not torch.equal(staged["embed"], w) and torch.equal(staged["opt"]["m"][0], torch.zeros(4))
    assert staged["opt"]["m"][1:] == [3, "x"]


def test_at_most_one_write_in_flight_and_a_failed_write_raises_one_line_once():
    writer = AsyncWriter()
    release, order = threading.Event(), []

    def slow():
        release.wait(30)
        order.append("first")

    writer.submit("first", slow)
    second = threading.Thread(target=writer.submit, args=("second", lambda: order.append("second")))
    second.start()
    second.join(0.3)
    assert second.is_alive() and order == []  # the second submit waits for the write in flight
    release.set()
    second.join(30)
    writer.wait()
    assert order == ["first", "second"] and not writer_threads()

    def fails():
        raise OSError(28, "No space left on device\n(while writing)")

    writer.submit("/run/checkpoint_step9.pt", fails)
    with pytest.raises(CheckpointError) as err:
        writer.submit("/run/checkpoint_step12.pt", lambda: order.append("never"))
    message = str(err.value)
    assert "\n" not in message and "checkpoint_step9.pt" in message and "No space left on device" in message
    assert order == ["first", "second"]  # the next write does not start over a failed one
    writer.wait()  # reported once
    assert not writer_threads()


# ---- the trainer --------------------------------------------------------------------------------------------------
def test_async_saves_write_the_same_checkpoints_and_the_run_is_bit_identical(tmp_path):
    common = ("--train.steps=8", "--train.save_every=2", "--train.keep_all_checkpoints=true", "--model.dropout=0.1")
    sync, asyn = tmp_path / "sync", tmp_path / "async"
    assert run_training(tiny_config(sync, *common)) == 0
    assert run_training(tiny_config(asyn, *common, ASYNC)) == 0
    assert not writer_threads()  # the run joined its writer thread
    cols = ("step", "loss", "grad_norm", "lr")
    assert [[r[c] for c in cols] for r in read_csv(sync / "training.csv")] == \
           [[r[c] for c in cols] for r in read_csv(asyn / "training.csv")]
    for step in (2, 4, 6, 8):
        a, b = checkpoint(sync / f"checkpoint_step{step}.pt"), checkpoint(asyn / f"checkpoint_step{step}.pt")
        assert b["config"]["train"]["async_checkpoint"] is True
        assert same_content(comparable(a), comparable(b)), f"step {step}"
    assert os.readlink(asyn / LATEST) == "checkpoint_step8.pt" and not temp_files(asyn)


def test_exact_resume_from_a_checkpoint_written_while_training_went_on(tmp_path):
    common = ("--train.steps=8", "--train.save_every=3", "--train.keep_all_checkpoints=true", "--model.dropout=0.1",
              ASYNC)
    full, split = tmp_path / "full", tmp_path / "split"
    assert run_training(tiny_config(full, *common)) == 0
    assert run_training(tiny_config(split, *common)) == 0
    (split / "checkpoint_step8.pt").unlink()  # back to step 6: a periodic save the thread wrote during steps 7-8
    assert run_training(tiny_config(split, *common)) == 0
    cols = ("step", "loss", "grad_norm", "lr")
    assert [[r[c] for c in cols] for r in read_csv(full / "training.csv")] == \
           [[r[c] for c in cols] for r in read_csv(split / "training.csv")]
    wa, wb = checkpoint(full / "checkpoint_step8.pt"), checkpoint(split / "checkpoint_step8.pt")
    assert same_content(wa["model"], wb["model"]) and same_content(wa["optimizer"], wb["optimizer"])


def test_a_write_that_fails_for_real_is_one_line_and_exit_4(tmp_path, capsys):
    from train.__main__ import main

    out = tmp_path / "run"
    args = ["--model.vocab_size=320", "--model.dim=32", "--model.n_layers=1", "--model.n_heads=2",
            "--model.ffn_dim=32", "--train.seq_len=16", "--train.batch_size=2", "--runtime.device=cpu",
            "--runtime.threads=1", "--train.save_every=3", f"--train.out_dir={out}", ASYNC]
    assert main([*args, "--train.steps=3"]) == 0  # a valid checkpoint to resume from
    # the thread's temporary file for step 6 cannot be created: a directory holds its name (root writes through chmod)
    (out / f".checkpoint_step6.pt.tmp{os.getpid()}" / "x").mkdir(parents=True)
    capsys.readouterr()
    assert main([*args, "--train.steps=12"]) == 4  # the failure surfaces at the save of step 9
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "asynchronous write of" in err[0] and "checkpoint_step6.pt" in err[0], err
    assert "IsADirectoryError" in err[0] and "remove the cause" in err[0]  # not a full disk: no advice to free space
    assert not (out / "checkpoint_step6.pt").exists() and not writer_threads()
    assert os.readlink(out / LATEST) == "checkpoint_step3.pt"  # latest never moved to the failed write
    lock = OutDirLock(out)
    lock.acquire()  # the failed run let the out_dir go
    lock.release()


def test_with_it_off_no_writer_exists(tmp_path, monkeypatch):
    def refuse(self):
        raise AssertionError("AsyncWriter built with train.async_checkpoint off")

    monkeypatch.setattr(AsyncWriter, "__init__", refuse)
    assert run_training(tiny_config(tmp_path / "off", "--train.save_every=2")) == 0
    with pytest.raises(AssertionError, match="AsyncWriter built"):  # the check can fail
        run_training(tiny_config(tmp_path / "on", "--train.save_every=2", ASYNC))


# ---- faults caused for real ---------------------------------------------------------------------------------------
def start(out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "train", *BIG, f"--train.out_dir={out}", *extra], cwd=REPO,
                            env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def run(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "train", *BIG, f"--train.out_dir={out}", *extra], cwd=REPO,
                          env=ENV, capture_output=True, text=True, timeout=300)


@pytest.mark.fresh_python  # temporary files are named by the trainer's pid: the process's own
def test_kill9_while_a_write_is_in_flight_loses_nothing_and_resumes_exactly(tmp_path):
    common = ("--train.steps=24", "--train.save_every=3", "--train.keep_all_checkpoints=true", ASYNC)
    reference = tmp_path / "reference"
    done = run(reference, *common)
    assert done.returncode == 0, done.stderr[-2000:]

    out = tmp_path / "killed"
    proc = start(out, *common)
    try:
        wait_for(lambda: (out / LATEST).is_symlink() or proc.poll() is not None, what="a first checkpoint")
        safe = {p.name for _, p in ckpt_io.valid_checkpoints(out)}
        write_in_flight(out, proc)
        proc.kill()  # SIGKILL while the writer thread writes: no handler, no wait
    finally:
        proc.kill()
        proc.communicate(timeout=30)
    assert proc.returncode == -9, "the trainer finished before a write could be hit"
    partial = temp_files(out, proc.pid)
    assert partial, "the kill did not land inside a write"
    step = int(partial[0].split("checkpoint_step")[1].split(".pt")[0])
    assert not (out / f"checkpoint_step{step}.pt").exists()  # the half-written file never got its name
    valid = ckpt_io.valid_checkpoints(out)
    assert safe <= {p.name for _, p in valid}  # what was safe before the write stays
    assert valid and valid[-1][0] < step and os.readlink(out / LATEST) == valid[-1][1].name

    resumed = run(out, *common)  # resume=auto: the newest valid checkpoint
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    want = [(r["step"], r["loss"], r["grad_norm"]) for r in read_csv(reference / "training.csv")]
    got = [(r["step"], r["loss"], r["grad_norm"]) for r in read_csv(out / "training.csv")]
    assert got == want  # every step once, each with the uninterrupted run's numbers
    a, b = checkpoint(reference / "checkpoint_step24.pt"), checkpoint(out / "checkpoint_step24.pt")
    assert same_content(a["model"], b["model"]) and same_content(a["optimizer"], b["optimizer"])
    assert not (out / "corrupt").exists()


@pytest.mark.fresh_python  # temporary files are named by the trainer's pid: the process's own
@pytest.mark.parametrize("stop", ["HALT", "SIGTERM"])
def test_halt_and_sigterm_wait_for_the_write_in_flight(tmp_path, stop):
    out = tmp_path / "run"
    proc = start(out, "--train.steps=100000", "--train.save_every=2", "--train.keep_all_checkpoints=true", ASYNC)
    try:
        names = write_in_flight(out, proc)
        assert names, "the trainer ended before a write was seen"
        in_flight = int(names[0].split("checkpoint_step")[1].split(".pt")[0])
        if stop == "HALT":
            (out / ".HALT").write_text("test\n")
        else:
            proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr[-2000:]
    assert not temp_files(out)  # nothing left half-written when the process exits
    assert ckpt_io.checkpoint_problem(out / f"checkpoint_step{in_flight}.pt") is None
    final = ckpt_io.valid_checkpoints(out)[-1]
    assert final[0] >= in_flight and os.readlink(out / LATEST) == final[1].name
    assert ckpt_io.load_checkpoint(final[1])["step"] == final[0]


def test_a_bad_setting_is_one_line_and_exit_2(tmp_path, capsys):
    from train.__main__ import main

    assert main([f"--train.out_dir={tmp_path / 'run'}", "--train.async_checkpoint=maybe"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.async_checkpoint" in err[0] and "true/false" in err[0], err
    assert not (tmp_path / "run").exists()


def test_an_error_while_a_write_is_in_flight_waits_for_it_before_the_out_dir_is_freed(tmp_path, monkeypatch):
    from train.trainer.loop import Loop

    out, seen, original = tmp_path / "run", [], Loop.step

    def step(self, *args, **kwargs):
        if self.state.step == 3:  # right after the asynchronous save of step 3, once its thread has opened the file
            wait_for(lambda: temp_files(out, os.getpid()) or (out / "checkpoint_step3.pt").exists(), timeout=30,
                     what="the write to start")
            seen.append(temp_files(out, os.getpid()))
            raise RuntimeError("injected fault")
        return original(self, *args, **kwargs)

    at_release, release = [], OutDirLock.release

    def recording_release(self):
        at_release.append((temp_files(out), len(writer_threads())))  # what is still being written as the lock goes
        release(self)

    monkeypatch.setattr(Loop, "step", step)
    monkeypatch.setattr(OutDirLock, "release", recording_release)
    with pytest.raises(RuntimeError, match="injected fault"):
        run_training(tiny_config(out, *BIG[:6], "--model.vocab_size=32768", "--model.dim=256", "--train.steps=8",
                                 "--train.save_every=3", ASYNC))  # a 120 MB state: a write far longer than the way out
    assert seen and seen[0], "the fault did not land while the write was in flight"
    assert at_release == [([], 0)]  # the out_dir lock went only once the write was done
    assert not temp_files(out) and not writer_threads()
    assert ckpt_io.checkpoint_problem(out / "checkpoint_step3.pt") is None
    assert os.readlink(out / LATEST) == "checkpoint_step3.pt"
    monkeypatch.undo()
    lock = OutDirLock(out)
    lock.acquire()  # and it is free
    lock.release()
