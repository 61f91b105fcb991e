"""Mixture sampler throughput against one source, in the same process (one core; prints and writes one JSON object).

    PYTHONPATH=. python bench/bench_mixture.py [--seconds 3] [--out bench/results/mixture_sampler.json]

Three 32M-token bin: directories (uint16). Each measurement times next_batch() for --seconds at each batch shape
(rows x seq_len: 16 x 1024, the data benchmark's; 16 x 2048 and 16 x 4096), alternating the arms in rounds so drift in the
machine's speed falls on all alike:
- one_source: data.source=bin:A (the path every run without a mixture takes)
- mixture_2: A and B at 0.5 / 0.5;  mixture_3: A, B, C at 0.6 / 0.3 / 0.1 with a stage at step 1,000
The ratio mixture / one source is the number the data-mixture issue asks for (at least 0.9).
"""
from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from train.core.config import data_mixture, load_config
from train.data.build import build_data
from train.data.meta import FORMAT, FORMAT_VERSION

TOKENS = 32 << 20
SHAPES = ((16, 1024), (16, 2048), (16, 4096))  # rows per micro-batch x seq_len (2048: the M7C pre-training length)


def write_dir(path: Path, seed: int) -> Path:
    path.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    rng.integers(0, 50257, TOKENS, dtype=np.uint16).tofile(path / "train.bin")
    rng.integers(0, 50257, 1 << 20, dtype=np.uint16).tofile(path / "val.bin")
    splits = {"train": {"file": "train.bin", "tokens": TOKENS}, "val": {"file": "val.bin", "tokens": 1 << 20}}
    (path / "meta.json").write_text(json.dumps({"format": FORMAT, "version": FORMAT_VERSION, "tokenizer": "gpt2",
                                                "eos_id": 50256, "vocab_size": 50257, "dtype": "uint16",
                                                "max_token_id": 50256, "splits": splits}))
    return path


def arm(args: list[str], batch: int, seq: int):
    cfg = load_config(None, ["--data.tokenizer=gpt2", "--train.steps=100000", *args])
    return build_data(cfg.data, seq_len=seq, batch_size=batch, vocab_size=50304, seed=0, mixture=data_mixture(cfg))


def timed(bundle, seconds: float) -> float:
    bundle.train.next_batch()
    x, _ = bundle.train.next_batch()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        bundle.train.next_batch()
        count += x.numel()
    return count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="bench/results/mixture_sampler.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    shapes = {}
    with tempfile.TemporaryDirectory() as tmp:
        a, b, c = (write_dir(Path(tmp) / name, i) for i, name in enumerate("abc"))
        arms = {
            "one_source": [f"--data.source=bin:{a}"],
            "mixture_2": [f"--data.mixture=[{{name: a, source: 'bin:{a}', weight: 1}}, "
                          f"{{name: b, source: 'bin:{b}', weight: 1}}]"],
            "mixture_3": [f"--data.mixture=[{{name: a, source: 'bin:{a}', weight: 0.6}}, "
                          f"{{name: b, source: 'bin:{b}', weight: 0.3}}, {{name: c, source: 'bin:{c}', weight: 0.1}}]",
                          "--data.stages=[{at: 1000, weights: {a: 0.2, b: 0.2, c: 0.6}}]"],
        }
        for batch, seq in SHAPES:
            bundles = {name: arm(arm_args, batch, seq) for name, arm_args in arms.items()}
            runs = {name: [] for name in arms}
            for _ in range(args.rounds):
                for name, bundle in bundles.items():
                    runs[name].append(timed(bundle, args.seconds))
            median = {name: float(np.median(v)) for name, v in runs.items()}
            shapes[f"{batch}x{seq}"] = {
                "tokens_per_s": runs, "median_tokens_per_s": median,
                "ratio_vs_one_source": {n: median[n] / median["one_source"] for n in arms if n != "one_source"}}
    result = {
        "bench": "mixture_sampler", "date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
        "threads": 1, "file_tokens": TOKENS, "seconds_per_measurement": args.seconds, "rounds": args.rounds,
        "shapes": shapes,
    }
    text = json.dumps(result, indent=2)
    print(text)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
