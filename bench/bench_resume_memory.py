"""Memory of resuming a ~300M-parameter model with 2 ranks (torchrun, gloo, CPU), before and after
memory-mapped checkpoint loading.

    python bench/bench_resume_memory.py [--before REV] [--dim 1024 --layers 22]

For each code version (this checkout, and REV checked out into a temporary git worktree): write a
checkpoint with 2 ranks (one step), then resume it with 2 ranks for one more step while sampling
every worker's /proc/<pid>/status (VmHWM, RssAnon, RssFile) and the machine's MemAvailable every
20 ms. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def status_kib(pid: int) -> dict:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0])
    except OSError:
        pass
    return out


def mem_available_kib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1])
    return 0


def workers(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def torchrun(code: Path, config: Path, out: Path, *args: str, sample: bool = False) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "train",
           str(config), f"--train.out_dir={out}", *args]
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1"}
    baseline = mem_available_kib()
    proc = subprocess.Popen(cmd, cwd=code, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peaks: dict[int, dict] = {}
    low = [baseline]
    done = threading.Event()

    def sampler():
        while not done.is_set():
            for w in workers(proc.pid):
                s = status_kib(w)
                p = peaks.setdefault(w, {})
                for k, v in s.items():
                    p[k] = max(p.get(k, 0), v)
            low[0] = min(low[0], mem_available_kib())
            time.sleep(0.02)

    thread = threading.Thread(target=sampler, daemon=True)
    if sample:
        thread.start()
    _, err = proc.communicate()
    done.set()
    if proc.returncode != 0:
        raise SystemExit(f"torchrun failed in {code}:\n{err[-3000:]}")
    gib = lambda kib: round(kib / 2**20, 2)  # noqa: E731
    ranks = [{k: gib(v) for k, v in p.items()} for p in peaks.values()]
    return {"per_rank_gib": ranks, "machine_used_gib": gib(baseline - low[0])} if sample else {}


def measure(code: Path, config: Path, work: Path) -> dict:
    out = work / "run"
    torchrun(code, config, out, "--train.steps=1")
    ckpt = out / "checkpoint_step1.pt"
    result = torchrun(code, config, out, "--train.steps=2", "--train.resume=auto", sample=True)
    result["checkpoint_gib"] = round(ckpt.stat().st_size / 2**30, 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", default="fa7418d", help="git revision with the eager torch.load")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    from nsa.config import ModelConfig
    from nsa.model import Transformer

    import torch

    model_cfg = dict(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.dim // 64,
                     n_kv_heads=args.dim // 128, ffn_dim=int(args.dim * 8 / 3) // 64 * 64, max_seq_len=64)
    with torch.device("meta"):
        params = Transformer(ModelConfig(**model_cfg)).num_params()
    with tempfile.TemporaryDirectory(prefix="bench_resume_") as tmp:
        tmp = Path(tmp)
        config = tmp / "model.yaml"
        config.write_text(json.dumps({
            "model": model_cfg, "data": {"source": "synthetic"},
            "train": {"seq_len": 16, "batch_size": 1, "log_every": 1, "eval_every": 0, "warmup_steps": 1},
            "runtime": {"device": "cpu"},
        }))
        old = tmp / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(old), args.before], cwd=REPO, check=True,
                       capture_output=True)
        try:
            results = {"after": measure(REPO, config, tmp / "after_run"), "before": measure(old, config, tmp / "before_run")}
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=REPO, capture_output=True)
    print(json.dumps({"bench": "resume_memory", "params": params, "ranks": 2, "before_rev": args.before,
                      "date": time.strftime("%Y-%m-%d"), **results}, indent=1))


if __name__ == "__main__":
    main()
