"""Data parallelism on CPU with gloo: DDP == one process on the same global batch, ZeRO-1 == DDP,
FSDP2 == DDP, compression hooks, resume on another world size, and a two-"node" rendezvous."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch


from .helpers import read_csv, read_jsonl

REPO = Path(__file__).resolve().parents[2]
STEPS = 20
COMMON = ["--train.steps=20", "--train.log_every=1", "--train.seq_len=16", "--train.warmup_steps=2", "--train.lr=3e-3"]
TINY = ["--model.vocab_size=128", "--model.dim=32", "--model.n_layers=2", "--model.n_heads=4",
        "--model.n_kv_heads=2", "--model.ffn_dim=64", "--model.max_seq_len=64", "--runtime.device=cpu"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(out: Path, *args: str, nproc: int = 2, extra_launch: tuple = ()) -> subprocess.CompletedProcess:
    launch = list(extra_launch) or ["--standalone", f"--nproc_per_node={nproc}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", *launch, "-m", "train", *TINY, *COMMON,
           f"--train.out_dir={out}", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def losses(out: Path) -> list[float]:
    """Per-step losses at full precision (the heartbeat's JSON; training.csv rounds to 6 digits),
    the last record of each step when a resume logged it twice."""
    by_step = {b["step"]: b["loss"] for b in read_jsonl(out / "heartbeat_rank0.jsonl") if b["kind"] == "train"}
    return [by_step[s] for s in sorted(by_step)]


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ddp") / "run"
    torchrun(out, "--train.batch_size=4", "--train.save_every=10")
    return out


def single(out: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "train", *TINY, *COMMON, f"--train.out_dir={out}", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_two_ranks_of_batch_4_train_exactly_like_one_rank_of_batch_8(ddp_run, tmp_path):
    """Batch content is a function of the global step and row, not of the world size."""
    one = tmp_path / "one"
    single(one, "--train.batch_size=8")
    a, b = losses(ddp_run), losses(one)
    assert len(a) == len(b) == STEPS
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5, (a, b)
    assert b[-1] < b[0]


def test_ddp_ranks_write_heartbeats_and_rank0_checkpoints(ddp_run):
    assert (ddp_run / "heartbeat_rank0.jsonl").exists() and (ddp_run / "heartbeat_rank1.jsonl").exists()
    ck = torch.load(ddp_run / "checkpoint_step20.pt", weights_only=True)
    assert ck["world_size"] == 2 and len(ck["data"]) == 2
    assert ck["data"][0] == ck["data"][1] and ck["data"][0]["global_batch"] == 8
    assert ck["tokens_seen"] == STEPS * 4 * 2 * 16


def showcase(out: Path, config: Path, *args: str, nproc: int = 1) -> subprocess.CompletedProcess:
    """The M7C runbook's command as written: `CONFIG=<YAML> [torchrun --nproc_per_node=N] scripts/train_showcase.py
    ...`; the batch comes from the YAML only (no batch flag on the command line)."""
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
              if nproc > 1 else [sys.executable])
    cmd = [*launch, "scripts/train_showcase.py", *args, *TINY, *COMMON, f"--train.out_dir={out}"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "CONFIG": str(config)}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def batch8_yaml(tmp_path_factory) -> Path:
    config = tmp_path_factory.mktemp("cfg") / "tiny.yaml"
    config.write_text("train:\n  batch_size: 8\n")
    return config


def test_one_gpu_start_resumes_on_two_with_the_runbooks_command(batch8_yaml, tmp_path):
    """1 -> 2 ranks with the same YAML (batch_size 8 per rank): the checkpoint's global batch 8 is kept as
    4 per rank on 2 ranks, said in one line, and the losses are those of the uninterrupted one-rank run."""
    whole, out = tmp_path / "whole", tmp_path / "grow"
    assert showcase(whole, batch8_yaml).returncode == 0
    assert showcase(out, batch8_yaml, "--train.stop_after=10", "--train.save_every=10").returncode == 0
    proc = showcase(out, batch8_yaml, "--resume", str(out / "checkpoint_step10.pt"), nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("resume: keeping the checkpoint's global batch 8 on 2 rank(s): train.batch_size 4 x "
            "accumulate_grad_batches 1 (the config says 8 x 1; set both on the command line to override)") in proc.stdout
    a, b = losses(whole), losses(out)
    assert len(b) == STEPS and max(abs(x - y) for x, y in zip(a, b)) < 1e-5, (a, b)
    assert "train:\n" in (out / "config.yaml").read_text() and "batch_size: 4" in (out / "config.yaml").read_text()


def test_two_gpu_start_resumes_on_one_with_the_runbooks_command(batch8_yaml, tmp_path):
    """2 -> 1 rank: global batch 16 is kept as 8 per micro-batch x 2 accumulated (the micro-batch never grows);
    the losses are those of an uninterrupted run of the same global batch."""
    whole, out = tmp_path / "whole", tmp_path / "shrink"
    assert showcase(whole, batch8_yaml, "--train.accumulate_grad_batches=2").returncode == 0
    assert showcase(out, batch8_yaml, "--train.stop_after=10", "--train.save_every=10", nproc=2).returncode == 0
    proc = showcase(out, batch8_yaml, "--resume", str(out / "checkpoint_step10.pt"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "keeping the checkpoint's global batch 16 on 1 rank(s): train.batch_size 8 x accumulate_grad_batches 2" \
        in proc.stdout
    a, b = losses(whole), losses(out)
    assert [int(r["step"]) for r in read_csv(out / "training.csv")][-1] == STEPS
    assert len(b) == STEPS and max(abs(x - y) for x, y in zip(a, b)) < 1e-5, (a, b)


def test_a_global_batch_no_rank_count_splits_is_refused_naming_the_flags(batch8_yaml, tmp_path):
    out = tmp_path / "odd"
    assert showcase(out, batch8_yaml, "--train.batch_size=3", "--train.stop_after=2", "--train.save_every=2").returncode == 0
    proc = showcase(out, batch8_yaml, nproc=2)
    assert proc.returncode != 0  # each rank exits 2; torchrun reports 1
    line = next(ln for ln in proc.stderr.splitlines() if ln.startswith("error: "))
    assert "was trained with global batch 3, which 2 rank(s) cannot split evenly; resume on 1 / 3 rank(s) " \
           "(--nproc_per_node), or set --train.batch_size and --train.accumulate_grad_batches" in line


def test_zero1_matches_ddp_and_resumes(ddp_run, tmp_path):
    out = tmp_path / "zero1"
    torchrun(out, "--train.batch_size=4", "--use_zero1=true", "--train.stop_after=10")
    torchrun(out, "--train.batch_size=4", "--use_zero1=true")  # resumes from step 10
    a, b = losses(ddp_run), losses(out)
    assert len(b) == STEPS
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5, (a, b)
    ck = torch.load(out / "checkpoint_step20.pt", weights_only=True)
    n_params = sum(1 for _ in ck["model"])
    assert len(ck["optimizer"]["state"]) == n_params  # consolidated: every parameter's moments


def test_fsdp2_matches_ddp(ddp_run, tmp_path):
    out = tmp_path / "fsdp"
    torchrun(out, "--train.batch_size=4", "--use_fsdp=true")
    a, b = losses(ddp_run), losses(out)
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4, (a, b)


def test_fp16_compression_hook_trains(ddp_run, tmp_path):
    """PyTorch's bf16 hook needs NCCL; on gloo the fp16 hook exercises the same path."""
    out = tmp_path / "fp16"
    torchrun(out, "--train.batch_size=4", "--runtime.ddp_compress=fp16", "--runtime.ddp_bucket_mb=1")
    a, b = losses(ddp_run), losses(out)
    assert max(abs(x - y) for x, y in zip(a, b)) < 5e-2
    assert a != b  # gradients really went through fp16


def test_two_node_rendezvous_on_localhost(tmp_path):
    out = tmp_path / "nodes"
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = []
    for node_rank in (0, 1):
        launch = ["--nnodes=2", "--nproc_per_node=1", f"--node_rank={node_rank}", "--rdzv_backend=c10d",
                  f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=pytest"]
        cmd = [sys.executable, "-m", "torch.distributed.run", *launch, "-m", "train", *TINY, *COMMON,
               "--train.steps=4", "--train.batch_size=2", f"--train.out_dir={out}"]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode == 0 for p in procs), [r[1][-2000:] for r in results]
    assert (out / "heartbeat_rank1.jsonl").exists() and (out / "checkpoint_step4.pt").exists()


def test_ddp_with_activation_checkpointing_and_a_chunked_loss_matches_ddp(ddp_run, tmp_path):
    """The 50K launch plan had to turn checkpointing off under DDP; non-reentrant checkpointing works with
    it. In the same run the loss is split into three uneven chunks per rank (24 of 64 rows; ddp_run's
    default is one chunk): neither may change a loss (full logits vs chunks: tests/nsa/test_loss.py)."""
    out = tmp_path / "ckpt_chunks"
    torchrun(out, "--train.batch_size=4", "--runtime.gradient_checkpointing=1", "--model.loss_chunk=24")
    a, b = losses(ddp_run), losses(out)
    assert len(b) == STEPS
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5, (a, b)
