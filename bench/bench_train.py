"""Training throughput of a GPT-2-style model on real text, CPU fp32: this trainer vs a plain
nanoGPT-style loop (same model, same batches' shape, AdamW, clipping) as the baseline.

    python bench/bench_train.py [--steps 30] [--compile] [--corpus ../shared/corpus/kjv.txt]

Model: 6 layers, 384 wide, 6 heads, context 256, batch 8, vocab 50304, GELU, LayerNorm, learned
positions, tied embeddings (nanoGPT's defaults for its small configs). Prints one JSON object.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from nsa.model import Transformer
from train.core.config import load_config
from train.data.preparation import prepare
from train.trainer.runner import run_training

REPO = Path(__file__).resolve().parents[1]

MODEL = ["--model.vocab_size=50304", "--model.dim=384", "--model.n_layers=6", "--model.n_heads=6",
         "--model.ffn_dim=1536", "--model.max_seq_len=256", "--model.norm=layernorm", "--model.mlp=gelu",
         "--model.pos_emb=learned", "--model.tie_embeddings=true", "--model.bias=true"]
SEQ, BATCH = 256, 8


def trainer_throughput(data_dir: Path, out: Path, steps: int, compile_: bool) -> float:
    cfg = load_config(None, MODEL + [
        f"--train.out_dir={out}", f"--train.steps={steps}", f"--train.seq_len={SEQ}", f"--train.batch_size={BATCH}",
        "--train.log_every=5", "--train.warmup_steps=5", f"--data.source=bin:{data_dir}", "--data.tokenizer=gpt2",
        "--runtime.device=cpu", "--runtime.precision=fp32", f"--runtime.compile={str(compile_).lower()}",
        "--runtime.watchdog_s=0",
    ])
    with contextlib.redirect_stdout(sys.stderr):  # keep stdout for the JSON line
        run_training(cfg)
    with open(out / "training.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    warm = rows[2:] if len(rows) > 3 else rows[1:]  # skip start-up (and compilation) intervals
    return sum(float(r["toks_per_s"]) for r in warm) / len(warm)


def baseline_throughput(data_dir: Path, steps: int) -> float:
    """nanoGPT's train.py inner loop, reduced to what runs on CPU fp32: memmap get_batch,
    forward, backward, clip_grad_norm_, AdamW step, zero_grad(set_to_none=True)."""
    meta = json.loads((data_dir / "meta.json").read_text())
    data = np.memmap(data_dir / "train.bin", dtype=meta["dtype"], mode="r")
    cfg = load_config(None, MODEL + [f"--train.seq_len={SEQ}"]).model
    torch.manual_seed(0)
    model = Transformer(cfg)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95))

    def get_batch():
        ix = torch.randint(len(data) - SEQ, (BATCH,))
        x = torch.stack([torch.from_numpy(data[i:i + SEQ].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + SEQ].astype(np.int64)) for i in ix])
        return x, y

    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        x, y = get_batch()
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # nanoGPT reads the loss every log interval; here every step (as with log_interval=1)
        times.append(time.perf_counter() - t0)
    warm = times[len(times) // 3:]
    return BATCH * SEQ * len(warm) / sum(warm)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--compile", action="store_true", help="also measure the trainer with torch.compile")
    parser.add_argument("--corpus", type=Path, default=REPO.parent / "shared" / "corpus" / "kjv.txt")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "data"
        prepare(f"text:{args.corpus}", "gpt2", data_dir, val_fraction=0.01, workers=1, text_sample_by="paragraph")
        result = {
            "benchmark": "train_throughput_cpu_fp32", "model": "gpt2-style 6L-6H-384D ctx256 batch8 vocab50304",
            "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
            "steps": args.steps,
        }
        result["baseline_nanogpt_loop_toks_per_s"] = baseline_throughput(data_dir, args.steps)
        result["trainer_toks_per_s"] = trainer_throughput(data_dir, Path(tmp) / "run", args.steps, False)
        if args.compile:
            result["trainer_compiled_toks_per_s"] = trainer_throughput(data_dir, Path(tmp) / "run_c", args.steps, True)
        result["trainer_vs_baseline"] = result["trainer_toks_per_s"] / result["baseline_nanogpt_loop_toks_per_s"]
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) and math.isfinite(v) else v) for k, v in result.items()}))


if __name__ == "__main__":
    main()
