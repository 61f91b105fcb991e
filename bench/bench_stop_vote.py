"""Cost of the per-step stop vote (train/trainer/stop.py) against a smoke step, 2 gloo ranks on CPU.

    python bench/bench_stop_vote.py [--calls 2000]

Runs itself under torchrun twice: once timing `StopVote.decide(None)` (the all-reduce every step
pays), once training `configs/train_showcase.yaml` (the `make smoke` model) for 20 steps to read
its step time. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child(calls: int) -> None:
    import torch.distributed as dist

    from train.trainer.stop import StopVote

    dist.init_process_group("gloo")
    vote = StopVote(dist.group.WORLD, enabled=True)
    for _ in range(50):
        vote.decide(None)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        vote.decide(None)
    per_call = (time.perf_counter() - t0) / calls
    if dist.get_rank() == 0:
        print(json.dumps({"vote_us": per_call * 1e6}))
    dist.destroy_process_group()


def torchrun(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args],
                          cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return proc


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--child", action="store_true")
    args = parser.parse_args()
    if args.child:
        child(args.calls)
        return
    vote = json.loads(torchrun(__file__, "--child", f"--calls={args.calls}").stdout.strip().splitlines()[-1])
    with tempfile.TemporaryDirectory() as tmp:
        torchrun("-m", "train", "configs/train_showcase.yaml", f"--train.out_dir={tmp}/smoke", "--train.steps=20",
                 "--train.log_every=10", "--train.eval_every=0", "--train.save_every=0", "--runtime.device=cpu")
        rows = [json.loads(line) for line in Path(tmp, "smoke", "heartbeat_rank0.jsonl").read_text().splitlines()]
        step_s = [r["dt_step_s"] for r in rows if r["kind"] == "train"][-1]  # the second interval: warm
    print(json.dumps({"bench": "stop_vote", "ranks": 2, "backend": "gloo", "date": time.strftime("%Y-%m-%d"),
                      "vote_us": round(vote["vote_us"], 1), "smoke_step_ms": round(step_s * 1e3, 1),
                      "vote_share_of_step": round(vote["vote_us"] / 1e6 / step_s, 5)}))


if __name__ == "__main__":
    main()
