"""Ops dispatched by one attention layer, forward + backward, per sequence length (on CUDA each is at least
one kernel launch), counted on the meta device (nsa/launch_count.py): NSA vs the dense layer, M7C-125M
shapes (dim 768, 12 heads, 2 KV heads, head dim 64; NSA l=32 d=16 l'=64 n=16 w=512), batch 1.

    .venv/bin/python bench/bench_launches.py [--T 2048 8192 32768 65536] [--json FILE]

Prints a markdown table (docs/BENCHMARKS.md) and one JSON line.
"""
from __future__ import annotations

import argparse
import json

from nsa.config import ModelConfig, NSAConfig
from nsa.launch_count import attention_layer_launches

M7C = dict(dim=768, n_heads=12, n_kv_heads=2, head_dim=64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, nargs="+", default=[2048, 8192, 32768, 65536])
    ap.add_argument("--json", help="also write the JSON here")
    args = ap.parse_args()
    nsa = ModelConfig(**M7C, attention="nsa", nsa=NSAConfig(l=32, d=16, l_sel=64, n_sel=16, w=512))
    dense = ModelConfig(**M7C)
    rows = [{"T": T, "nsa": attention_layer_launches(nsa, T).total, "dense": attention_layer_launches(dense, T).total}
            for T in args.T]
    print("| T | NSA layer ops (fwd+bwd) | dense layer ops | NSA / dense |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['T']:,} | {r['nsa']} | {r['dense']} | {r['nsa'] / r['dense']:.2f} |")
    result = {"bench": "launches", "rows": rows}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
