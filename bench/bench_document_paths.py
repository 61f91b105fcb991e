"""NSA's two torch-path implementations for packed documents, one training step of a whole model each:
impl/masked.py (every document at once through explicit masks) against impl/segments.py (one document at a
time), at the recall task's shape (configs/recall_dense_w8.yaml with NSA l=8 d=4 l'=8 n=4 w=8: batch 128 of
64 tokens, ~2 documents a window).

    .venv/bin/python bench/bench_document_paths.py [--batch 128] [--seq 64] [--doc 29] [--repeats 5] [--json FILE]

The paths alternate step by step in one process, so load from other jobs falls on both alike; the JSON
holds each path's median step time, tokens/s and the ratio.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from nsa.attention.impl import masked
from nsa.config import NSAConfig
from nsa.model import ModelConfig, Transformer

EOS = 256


def build(seq: int) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=320, dim=128, n_layers=2, n_heads=4, head_dim=32, ffn_dim=384, max_seq_len=seq,
                      norm="rmsnorm", mlp="swiglu", pos_emb="rope", qk_norm=True, tie_embeddings=True,
                      attention="nsa", nsa=NSAConfig(l=8, d=4, l_sel=8, n_sel=4, w=8))
    model = Transformer(cfg)
    model.document_eos_id = EOS
    return model


def packed_batch(batch: int, seq: int, mean_doc: int) -> torch.Tensor:
    """[batch, seq] tokens with an EOS opening a new document every ~mean_doc tokens (uneven lengths)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, EOS, (batch, seq), generator=g)
    x[torch.rand(batch, seq, generator=g) < 1.0 / mean_doc] = EOS
    return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--doc", type=int, default=29, help="mean document length in tokens (the recall corpus: 28.8)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model = build(args.seq)
    x = packed_batch(args.batch, args.seq, args.doc)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # (MAX_KEYS, MAX_ELEMENTS) forcing each path whatever the shape; the product picks by masked.fits
    limits = {"masked": (1 << 62, 1 << 62), "segments": (0, 0)}
    default = (masked.MAX_KEYS, masked.MAX_ELEMENTS)

    def step(path: str) -> float:
        masked.MAX_KEYS, masked.MAX_ELEMENTS = limits[path]
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    try:
        for path in limits:  # warm-up
            step(path)
        times = {path: [] for path in limits}
        for _ in range(args.repeats):
            for path in limits:
                times[path].append(step(path))
    finally:
        masked.MAX_KEYS, masked.MAX_ELEMENTS = default
    tokens = args.batch * args.seq
    docs = int((x == EOS).sum()) + args.batch
    result = {"batch": args.batch, "seq": args.seq, "documents": docs, "threads": torch.get_num_threads(),
              "torch": torch.__version__, "product_picks": "masked" if args.seq <= masked.MAX_KEYS else "segments"}
    for path, ts in times.items():
        med = statistics.median(ts)
        result[path] = {"median_s": round(med, 4), "tokens_per_s": round(tokens / med)}
    result["speedup"] = round(result["segments"]["median_s"] / result["masked"]["median_s"], 2)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
