"""Activation checkpointing on CPU: peak memory and step time with and without, for a mid-size model.

    python bench/bench_checkpointing.py [--dim 768 --layers 12 --seq 1024 --batch 4]

Each mode runs in its own process (peak RSS is per process): forward + backward of a LLaMA-style
model, fp32. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time



def child(args) -> None:
    import torch

    from nsa.config import ModelConfig
    from nsa.model import Transformer

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.dim // 64,
                      n_kv_heads=max(1, args.dim // 256), ffn_dim=int(args.dim * 8 / 3) // 64 * 64,
                      max_seq_len=args.seq, attention=args.attention)
    model = Transformer(cfg)
    model.checkpoint_every = args.every
    idx = torch.randint(0, args.vocab, (args.batch, args.seq))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        model(idx, idx).backward()
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    print(json.dumps({"every": args.every, "peak_rss_mib": peak / 1024, "rss_before_mib": base / 1024,
                      "step_s": min(times)}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--attention", default="dense")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--every", type=int, default=-1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.every >= 0:
        child(args)
        return
    runs = {}
    for every in (0, 1):
        cmd = [sys.executable, __file__, *sys.argv[1:], "--every", str(every)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        runs["off" if every == 0 else "every_block"] = json.loads(out.strip().splitlines()[-1])
    off, on = runs["off"], runs["every_block"]
    print(json.dumps({
        "benchmark": "activation_checkpointing_cpu", "model": f"{args.attention} {args.layers}L-{args.dim}D seq{args.seq} "
        f"batch{args.batch} vocab{args.vocab}", "off": off, "every_block": on,
        "peak_rss_drop_mib": off["peak_rss_mib"] - on["peak_rss_mib"],
        "activation_mib_off": off["peak_rss_mib"] - off["rss_before_mib"],
        "activation_mib_on": on["peak_rss_mib"] - on["rss_before_mib"],
        "step_time_ratio": on["step_s"] / off["step_s"],
    }))


if __name__ == "__main__":
    main()
