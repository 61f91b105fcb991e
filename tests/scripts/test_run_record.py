"""What the runners record in run.info about a launch (scripts/lib/common.sh run_logged_training), for a real trainer:
where data.restart_on_change started the data afresh, and a full disk (a file-size limit set with `ulimit -f` and
SIGXFSZ ignored, so writes fail with EFBIG) as exit 4 and status write_failed."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.scripts.helpers import REPO, kv_file
from tests.train.helpers import TINY_MODEL

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
