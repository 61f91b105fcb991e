"""Training on parquet shards served over HTTP by tests/fault_http.py (127.0.0.1), two ranks on gloo. Faults are
caused for real: connections dropped mid-body, 503 and 429, stalls of twice the read timeout, truncated bodies and 10
s of refused connections. Each run is compared with the same run over a server without faults: the tokens every rank
trained on (each heartbeat's batch_digest, one per step) and every logged loss are identical. The same after a kill -9
while a rank is retrying. A server that goes down makes every rank stop after the same step with a checkpoint (exit
75), and the runbooks' runner resumes the run once the server is back."""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fault_http import FaultServer

from .helpers import REPO, read_csv, wait_for

SHARDS = 16
STEPS = 40
ARGS = ["--model.vocab_size=320", "--model.dim=32", "--model.n_layers=1", "--model.n_heads=2", "--model.ffn_dim=32",
        "--train.seq_len=16", "--train.batch_size=2", "--train.log_every=1", "--runtime.device=cpu",
        "--runtime.threads=1", "--data.tokenizer=byte", "--data.val_fraction=0.2", "--data.tokenize_batch_docs=2",
        f"--train.steps={STEPS}", "--train.warmup_steps=2", "--train.eval_every=20", "--train.eval_steps=2",
        "--train.save_every=5", "--train.batch_digest=true", "--data.read_timeout_s=1", "--data.retry_max=100",
        "--data.retry_max_s=60", "--data.retry_backoff_s=0.05"]
EVERY_FAULT = ["drop", "503", "stall", "truncate", "429", "refuse"]


@pytest.fixture(scope="module")
def shards(corpus_path) -> dict[str, bytes]:
    """16 parquet files of 4 verses each: a rank moves to a new shard about every 20 steps."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    verses = [line for line in corpus_path.read_text(encoding="utf-8").splitlines() if len(line) > 60][:SHARDS * 4]
    files = {}
    for i in range(SHARDS):
        buf = io.BytesIO()
        pq.write_table(pa.table({"text": verses[i::SHARDS]}), buf)
        files[f"shard{i:02d}.parquet"] = buf.getvalue()
    return files


def command(server: FaultServer, shards: dict, out: Path, *extra: str) -> list[str]:
    source = "parquet:" + ",".join(server.url(name) for name in sorted(shards))
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "train", *ARGS,
            f"--data.source={source}", f"--train.out_dir={out}", *extra]


ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def train(cmd: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout)


def trained(out: Path) -> dict:
    """Per step: the loss and grad norm logged, and each rank's batch digest (the last record of a step wins: a resumed
    run logs the steps after its checkpoint again)."""
    losses = {int(r["step"]): (r["loss"], r["grad_norm"]) for r in read_csv(out / "training.csv")}
    digests = {}
    for rank in (0, 1):
        for line in (out / f"heartbeat_rank{rank}.jsonl").read_text().splitlines():
            record = json.loads(line)
            if record.get("kind") == "train":
                digests[(rank, record["step"])] = record["batch_digest"]
    return {"losses": losses, "digests": digests}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, shards) -> dict:
    out = tmp_path_factory.mktemp("remote") / "reference"
    with FaultServer(shards) as server:
        done = train(command(server, shards, out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = trained(out)
    assert sorted(result["losses"]) == list(range(1, STEPS + 1)) and len(result["digests"]) == 2 * STEPS
    return result


def kill9_tree(pid: int) -> None:
    """SIGKILL to pid and every process descended from it, children first found (from /proc), no handler runs."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += parents.get(p, [])
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_two_ranks_over_a_faulty_server_train_exactly_as_over_a_clean_one(tmp_path, shards, reference):
    out = tmp_path / "faulty"
    with FaultServer(shards, faults=EVERY_FAULT, every=1, stall_s=2.0, refuse_s=10.0, armed=False) as server:
        proc = subprocess.Popen(command(server, shards, out), cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        wait_for(lambda: (out / "checkpoint_step5.pt").exists() or proc.poll() is not None, what="step 5")
        server.arm()  # the next shard read, by either rank, meets every fault in a row
        _, stderr = proc.communicate(timeout=240)
        injected = [fault for _, fault in server.injected]
    assert proc.returncode == 0, stderr[-3000:]
    assert injected == EVERY_FAULT
    assert trained(out) == reference
    last = read_csv(out / "training.csv")[-1]
    assert int(last["data_retries"]) >= len(EVERY_FAULT) and int(last["data_stalls"]) >= 1
    assert float(last["data_wait_s"]) >= 10.0  # the refusal lasted 10 s
    # the monitor shows the retries: every rank's together, then each rank's
    frame = subprocess.run([sys.executable, "scripts/monitor_frame.py", str(out), "--stale-s", "100000"], cwd=REPO,
                           capture_output=True, text=True, timeout=60, env=ENV)
    line = next(line for line in frame.stdout.splitlines() if line.startswith("data "))
    assert line.startswith(f"data        retries {last['data_retries']} (stalls {last['data_stalls']}, waited "), line
    assert " | rank0 " in line and " | rank1 " in line, line


@pytest.mark.fresh_python  # kills torchrun's process tree with SIGKILL
def test_a_kill9_while_a_rank_retries_resumes_to_the_same_run(tmp_path, shards, reference):
    out = tmp_path / "killed"
    with FaultServer(shards, faults=["refuse"], every=1, refuse_s=4.0, armed=False) as server:
        proc = subprocess.Popen(command(server, shards, out), cwd=REPO, env=ENV, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            wait_for(lambda: (out / "checkpoint_step5.pt").exists() or proc.poll() is not None, what="step 5")
            server.arm()
            wait_for(lambda: server.injected or proc.poll() is not None, what="the refusal")
            time.sleep(1.0)  # a rank is now backing off between refused connections
            assert proc.poll() is None, "the run ended before the kill"
        finally:
            kill9_tree(proc.pid)  # torchrun and both ranks (each rank leads its own process group)
            proc.wait(timeout=30)
        done = train(command(server, shards, out))  # the same command resumes from the newest checkpoint
    assert done.returncode == 0, done.stderr[-3000:]
    assert trained(out) == reference


def test_a_server_down_stops_every_rank_together_and_the_runner_resumes_it(tmp_path, shards, reference):
    out, run_dir = tmp_path / "outage", tmp_path / "run_dir"
    run_dir.mkdir()
    with FaultServer(shards) as server:
        cmd = command(server, shards, out, "--data.retry_max_s=3")
        script = (f"set -euo pipefail; source scripts/lib/common.sh; PY={sys.executable}; "
                  f"TRAIN_CMD=({' '.join(repr(c) for c in cmd)}); "
                  f"run_training_through_outages {run_dir} {out} {run_dir}/run.info; echo TRAIN_RC=$TRAIN_RC")
        runner = subprocess.Popen(["bash", "-c", script], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, env={**ENV, "DATA_OUTAGE_WAIT_S": "1", "DATA_OUTAGE_RESUMES": "2"})
        wait_for(lambda: (out / "checkpoint_step5.pt").exists() or runner.poll() is not None, what="step 5")
        server.down()
        info = run_dir / "run.info"
        wait_for(lambda: "data_outage" in (info.read_text() if info.exists() else "") or runner.poll() is not None,
                 timeout=120, what="the outage stop")
        stopped = json.loads((out / "metrics.json").read_text())
        server.up()
        output, _ = runner.communicate(timeout=240)
    assert "TRAIN_RC=0" in output, output[-3000:]
    assert stopped["stop_reason"] == "data outage" and stopped["status"] == "stopped"
    step = stopped["step"]
    assert (out / f"checkpoint_step{step}.pt").exists()  # the stop's own checkpoint
    ends = [json.loads(line) for rank in (0, 1) for line in (out / f"heartbeat_rank{rank}.jsonl").read_text().splitlines()]
    assert {(r["rank"], r["step"]) for r in ends if r.get("kind") == "end" and r.get("reason") == "data outage"} == \
        {(0, step), (1, step)}  # both ranks stopped after the same step
    assert "data_outage" in info.read_text() and "resume 1 of 2" in info.read_text()
    assert trained(out) == reference  # and the resumed run is the run without the outage


def test_a_url_that_answers_404_at_start_is_one_line_and_exit_2_with_nothing_written(tmp_path, shards):
    out = tmp_path / "never"
    with FaultServer(shards) as server:
        source = f"parquet:{server.url('shard00.parquet')},{server.url('gone.parquet')}"
        done = subprocess.run([sys.executable, "-m", "train", *ARGS, f"--data.source={source}",
                               f"--train.out_dir={out}"], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert lines == [f"error: parquet:{server.url('gone.parquet')}: HTTP 404 Not Found (not retried: the file is "
                     f"missing, refused or malformed)"], done.stderr[-2000:]
    assert not out.exists()


def test_one_process_stops_on_an_outage_with_its_checkpoint_and_exit_75(tmp_path, shards):
    out = tmp_path / "alone"
    with FaultServer(shards) as server:
        source = "parquet:" + ",".join(server.url(name) for name in sorted(shards))
        proc = subprocess.Popen([sys.executable, "-m", "train", *ARGS, f"--data.source={source}", f"--train.out_dir={out}",
                                 "--data.retry_max_s=1"], cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        wait_for(lambda: (out / "checkpoint_step5.pt").exists() or proc.poll() is not None, what="step 5")
        server.down()
        _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 75, stderr[-2000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["stop_reason"] == "data outage" and (out / f"checkpoint_step{metrics['step']}.pt").exists()
    line = next(line for line in stderr.splitlines() if line.startswith("data outage on rank 0: "))
    assert "still failing after" in line and "data.retry_max_s=1" in line
    # the monitor says what happened and what comes next
    frame = subprocess.run([sys.executable, "scripts/monitor_frame.py", str(out), "--stale-s", "100000"], cwd=REPO,
                           capture_output=True, text=True, timeout=60, env=ENV)
    assert f"data outage at step {metrics['step']}: " in frame.stdout and "(exit 75)" in frame.stdout, frame.stdout
