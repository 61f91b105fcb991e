"""Output-head cross-entropy on CPU: full logits vs the chunked loss (nsa/loss.py), peak memory and time.

    python bench/bench_loss.py [--tokens 8192 --dim 2048 --vocab 151680 --chunks 0,1024,2048,4096 --precision bf16]

One micro-batch of the Qwen3-1.8B head by default: hidden [tokens, dim] (fp32, as the final norm
returns it), head weight [vocab, dim] (fp32 master weight), loss + backward under bf16 autocast as
the trainer runs it. chunk 0 is the old path, `F.cross_entropy(F.linear(h, W).float(), targets)`.
Each mode runs in its own process (peak RSS is per process). `loss_path_mib`: peak RSS minus the RSS
once the inputs exist. `logits_path_mib`: that minus what both paths hold whatever the chunking, the
weight's gradient (vocab x dim x 4 bytes) and, under bf16, autocast's bf16 copy of the weight
(vocab x dim x 2). Prints one JSON object.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import resource
import subprocess
import sys
import time

MIB = 2**20


def child(args) -> None:
    import torch
    import torch.nn.functional as F

    from nsa.loss import linear_cross_entropy

    torch.manual_seed(0)
    hidden = torch.randn(args.tokens, args.dim, requires_grad=True)  # [N, D]
    weight = torch.nn.Parameter(torch.empty(args.vocab, args.dim).normal_(std=0.02))  # [V, D]
    targets = torch.randint(0, args.vocab, (args.tokens,))  # [N]
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if args.precision == "bf16" else contextlib.nullcontext()

    def loss_fn():
        if args.mode == 0:
            return F.cross_entropy(F.linear(hidden, weight).float(), targets)
        return linear_cross_entropy(hidden, weight, targets, args.mode)

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    times = []
    for _ in range(args.repeats):
        hidden.grad = weight.grad = None
        t0 = time.perf_counter()
        with amp:
            loss = loss_fn()
        loss.backward()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"chunk": args.mode, "loss": loss.item(), "peak_rss_mib": peak / 1024,
                      "rss_before_mib": base / 1024, "loss_path_mib": (peak - base) / 1024,
                      "step_s": min(times), "step_s_all": times}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=151680)
    p.add_argument("--chunks", default="0,1024,2048,4096", help="rows per chunk; 0 = full logits")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--mode", type=int, default=-1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode >= 0:
        child(args)
        return
    weight_bytes = args.vocab * args.dim * (4 + (2 if args.precision == "bf16" else 0))  # grad + bf16 copy
    runs = {}
    for chunk in (int(c) for c in args.chunks.split(",")):
        cmd = [sys.executable, __file__, *sys.argv[1:], "--mode", str(chunk)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        run = json.loads(out.strip().splitlines()[-1])
        run["logits_path_mib"] = run["loss_path_mib"] - weight_bytes / MIB
        runs["full" if chunk == 0 else f"chunk{chunk}"] = run
    result = {
        "benchmark": "chunked_cross_entropy_cpu", "tokens": args.tokens, "dim": args.dim, "vocab": args.vocab,
        "precision": args.precision, "runs": runs,
        "fp32_logits_mib": {name: min(r["chunk"] or args.tokens, args.tokens) * args.vocab * 4 / MIB
                            for name, r in runs.items()},
        "weight_grad_and_copy_mib": weight_bytes / MIB,
    }
    if "full" in runs:
        full = runs["full"]
        result["vs_full"] = {name: {"logits_path_ratio": full["logits_path_mib"] / r["logits_path_mib"],
                                    "loss_path_ratio": full["loss_path_mib"] / r["loss_path_mib"],
                                    "time_ratio": r["step_s"] / full["step_s"],
                                    "loss_diff": r["loss"] - full["loss"]}
                             for name, r in runs.items() if name != "full"}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
