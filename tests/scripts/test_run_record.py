"""What the runners record in run.info about a launch (scripts/lib/common.sh run_logged_training), for a real trainer:
where data.restart_on_change started the data afresh, and a full disk (a file-size limit set with `ulimit -f` and
SIGXFSZ ignored, so writes fail with EFBIG) as exit 4 and status write_failed."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.scripts.helpers import REPO, kv_file
from tests.train.helpers import TINY_MODEL
from train.core.artifacts import read_csv

BASE = TINY_MODEL + ["--train.seq_len=32", "--train.batch_size=2", "--train.log_every=1", "--runtime.device=cpu",
                     "--runtime.threads=1", "--data.source=synthetic", "--train.warmup_steps=1", "--train.eval_every=0"]
RUN = ('set -o pipefail; SCRIPT_TAG=t; source scripts/lib/common.sh; {limit} TRAIN_CMD=("$@"); '  # as the runners
       'run_logged_training "$RUN_DIR" "$OUT_DIR" "$RUN_DIR/run.info"; echo "rc=$TRAIN_RC"')


def run_logged(script_env, run_dir, out, *args: str, limit: str = "") -> tuple[str, dict]:
    run_dir.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "train", *BASE, f"--train.out_dir={out}", *args]
    res = subprocess.run(["bash", "-c", RUN.format(limit=limit), "_", *cmd], cwd=REPO, capture_output=True, text=True,
                         env=script_env(RUN_DIR=str(run_dir), OUT_DIR=str(out)), timeout=240)
    return res.stdout.strip().splitlines()[-1], kv_file(run_dir / "run.info")


def test_run_info_records_a_data_restart_and_a_full_disk(tmp_path, script_env):
    out = tmp_path / "out"
    rc, info = run_logged(script_env, tmp_path / "first", out, "--train.steps=4", "--train.save_every=4")
    assert rc == "rc=0" and info["final_status"] == "finished" and "data_restarts" not in info

    rc, info = run_logged(script_env, tmp_path / "restart", out, "--train.steps=6", "--train.save_every=6",
                          "--train.seed=7", "--data.restart_on_change=true")
    assert rc == "rc=0", (tmp_path / "restart" / "train.log").read_text()[-2000:]
    assert json.loads(info["data_restarts"]) == [
        {"step": 4, "reason": "data state was saved with seed=1337 but this run has seed=7"}]

    checkpoint_kib = (out / "checkpoint_step6.pt").stat().st_size // 1024
    rc, info = run_logged(script_env, tmp_path / "full", out, "--train.steps=8", "--train.save_every=8",
                          "--train.seed=7", limit=f"trap '' XFSZ; ulimit -f {checkpoint_kib // 2};")
    assert rc == "rc=4", (tmp_path / "full" / "train.log").read_text()[-2000:]
    assert info["final_status"] == "write_failed" and info["last_checkpoint"].endswith("checkpoint_step6.pt")
    log = (tmp_path / "full" / "train.log").read_text()
    said = f"checkpoint {out / 'checkpoint_step8.pt'} could not be written: [Errno 27] File too large"
    assert f"error: {said}" in log
    frame = subprocess.run(["bash", "scripts/monitor_run.sh", "--once", str(out)], cwd=REPO, env=script_env(),
                           capture_output=True, text=True, timeout=60).stdout
    assert "status      write_failed" in frame and f"! stopped: {said}" in frame, frame


RUN_TORCHRUN = ('set -o pipefail; SCRIPT_TAG=t; source scripts/lib/common.sh; require_venv; torchrun_launch 2; '
                'TRAIN_CMD=("${{LAUNCH[@]}}" "$@"); {limit} '
                'run_logged_training "$RUN_DIR" "$OUT_DIR" "$RUN_DIR/run.info"; echo "rc=$TRAIN_RC"')


@contextlib.contextmanager
def small_disk(path: Path):
    """A 2 MiB tmpfs at path (root: a real ENOSPC once fill() has taken the rest) -> True, or, where mounting is not
    allowed (or NSA_TEST_NO_MOUNT is set, to run that path here), a plain directory -> False: the caller then limits
    the size of the trainer's files (EFBIG: the same failed write)."""
    path.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(path)]
    mounted = ("NSA_TEST_NO_MOUNT" not in os.environ and shutil.which("mount") is not None
               and subprocess.run(mount, capture_output=True).returncode == 0)
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], check=False)


def fill(disk: Path) -> None:
    """Write to disk until it is full (ENOSPC)."""
    with open(disk / "filler", "wb", buffering=0) as f:  # unbuffered: nothing left to fail at close
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc


def test_a_full_disk_under_torchrun_stops_every_rank_with_exit_4_and_the_runner_says_write_failed(tmp_path, script_env):
    """Two gloo ranks under the runners' launcher, the out_dir on a disk that fills while they train: the failed
    write on one rank reaches the other at the next stop vote, both print the project's one line and exit 4 (no
    traceback: not a rank's, not gloo's, not torchrun's), the launcher exits 4, and run.info says write_failed although
    metrics.json could not take it. Long before any process-group timeout."""
    run_dir, disk = tmp_path / "run", tmp_path / "disk"
    run_dir.mkdir()
    with small_disk(disk) as mounted:
        out = disk / "out"
        cmd = [*BASE, f"--train.out_dir={out}", "--train.steps=100000", "--train.save_every=0"]
        limit = "" if mounted else "trap '' XFSZ; ulimit -f 24;"  # 24 KiB a file: a heartbeat fills it in ~60 steps
        t0 = time.monotonic()
        proc = subprocess.Popen(["bash", "-c", RUN_TORCHRUN.format(limit=limit), "_", *cmd], cwd=REPO, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=script_env(RUN_DIR=str(run_dir), OUT_DIR=str(out)), start_new_session=True)
        try:
            if mounted:  # a few steps logged, then the disk is full
                deadline = time.monotonic() + 120
                while len(read_csv(out / "training.csv")) < 3:
                    assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
                    time.sleep(0.2)
                filled_at = time.monotonic()
                fill(disk)
            stdout, _ = proc.communicate(timeout=180)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        took = time.monotonic() - (filled_at if mounted else t0)
        log = (run_dir / "train.log").read_text()
        assert stdout.strip().splitlines()[-1] == "rc=4", log[-4000:]
        errno_text = "[Errno 28] No space left on device" if mounted else "[Errno 27] File too large"
        lines = [line for line in log.splitlines() if line.startswith("error: ")]
        assert len(lines) == 2, log[-4000:]  # one per rank, the same line: the first failing rank's file
        assert lines[0] == lines[1] and " could not be written: " + errno_text in lines[0], lines
        assert re.search(r"\(rank [01]; every rank stopped after step \d+\); no checkpoint; free space under ", lines[0])
        assert "Traceback" not in log and "Exception in thread" not in log, log[-4000:]
        # the launcher's line lists the ranks torchrun saw fail before it stopped the group (a rank still exiting is
        # not listed): each listed one exited 4, and so does the launcher
        said = re.search(r"launch: workers failed \((.*)\): exit 4\n", log)
        assert said and re.fullmatch(r"rank [01] exit 4(, rank [01] exit 4)?", said[1]), log[-4000:]
        assert took < 60, took  # the vote, not a gloo timeout (30 min by default), ended the run
        info = kv_file(run_dir / "run.info")
        assert info["final_status"] == "write_failed", info
        if mounted:  # the disk took no status: the trainer's word stays 'running', the runner's is write_failed
            status = json.loads((out / "metrics.json").read_text())["status"]
            assert status in ("running", "write_failed"), status
        # what was written is whole: every heartbeat line parses, training.csv rows in order
        for rank in (0, 1):
            for line in (out / f"heartbeat_rank{rank}.jsonl").read_text().splitlines():
                json.loads(line)
        steps = [int(r["step"]) for r in read_csv(out / "training.csv")]
        assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 3
