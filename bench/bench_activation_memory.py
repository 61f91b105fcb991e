"""Calibration of train/planning/memory.py's activation and loss model against measured peaks on CPU.

    python bench/bench_activation_memory.py

For each small model (a dense LLaMA-style one and an NSA one), in a fresh process: build the model,
allocate its gradients, read VmRSS (the baseline), run one forward + backward in fp32, read VmHWM.
The measured peak (VmHWM - baseline) is compared with the estimate of activations + loss path
(gradients are allocated before the baseline, so both sides leave them out). Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

DENSE = ["--model.vocab_size=8192", "--model.dim=512", "--model.n_layers=6", "--model.n_heads=8",
         "--model.n_kv_heads=2", "--model.ffn_dim=1536", "--model.max_seq_len=4096"]
NSA = ["--model.vocab_size=8192", "--model.dim=512", "--model.n_layers=4", "--model.n_heads=8",
       "--model.n_kv_heads=2", "--model.ffn_dim=1536", "--model.max_seq_len=4096", "--model.attention=nsa"]
MODELS = {  # two models, each at two shapes (the NSA factor is fitted on the first NSA shape only)
    "dense_b4_t2048": [*DENSE, "--train.seq_len=2048", "--train.batch_size=4"],
    "dense_b2_t1024_gelu": [*DENSE, "--train.seq_len=1024", "--train.batch_size=2", "--model.mlp=gelu",
                            "--model.ffn_dim=2048"],
    "nsa_b2_t2048": [*NSA, "--train.seq_len=2048", "--train.batch_size=2"],
    "nsa_b1_t4096": [*NSA, "--train.seq_len=4096", "--train.batch_size=1"],
}


def kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def child(name: str) -> None:
    import torch

    from nsa.model import Transformer
    from train.core.config import load_config
    from train.planning.memory import estimate_memory

    torch.set_num_threads(2)
    cfg = load_config(None, [*MODELS[name], "--runtime.device=cpu", "--runtime.precision=fp32", "--model.loss_chunk=4096"])
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    idx = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len))
    base = kib("VmRSS")
    t0 = time.perf_counter()
    model(idx, idx).backward()
    dt = time.perf_counter() - t0
    measured = (kib("VmHWM") - base) * 1024
    est = estimate_memory(cfg, 1, cuda=False)
    predicted = est.activations + est.loss
    print(json.dumps({"model": name, "measured_bytes": measured, "estimated_bytes": predicted,
                      "activations": est.activations, "loss": est.loss,
                      "error": predicted / measured - 1, "step_s": dt}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", choices=sorted(MODELS))
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    rows = []
    for name in MODELS:
        out = subprocess.run([sys.executable, __file__, "--child", name], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(json.dumps({"bench": "activation_memory", "date": time.strftime("%Y-%m-%d"), "models": rows}, indent=1))


if __name__ == "__main__":
    main()
