"""One decode step of an NSA attention layer vs a dense attention layer with a KV cache, at long contexts.

    .venv/bin/python bench/bench_decode.py                   # contexts 4096, 16384, 32768
    .venv/bin/python bench/bench_decode.py --S 2048 --quick

For each context t the layer's cache is filled by a chunked prefill of t tokens (no grad), then
`--steps` single-token decode steps are timed (min and median; quote the min on a shared machine). Prints one JSON object per (S, impl) and a
final summary JSON line with the dense / NSA speed-up and the reads per step (keys read by the query).
Dense uses the product's KVCache (amortised O(1) appends into a growing buffer) and SDPA.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


from nsa.attention.dense import DenseAttention, KVCache
from nsa.attention.nsa import NativeSparseAttention
from nsa.config import ModelConfig
from nsa.layers import RotaryEmbedding


@torch.inference_mode()
def bench_one(kind: str, S: int, args) -> dict:
    cfg = ModelConfig(dim=args.dim, n_heads=args.heads, n_kv_heads=args.kv_heads, head_dim=args.head_dim,
                      attention=kind, max_seq_len=S + args.steps + 1)
    torch.manual_seed(0)
    dev, dtype = torch.device(args.device), torch.bfloat16 if args.dtype == "bf16" else torch.float32
    layer = (NativeSparseAttention(cfg) if kind == "nsa" else DenseAttention(cfg)).eval().to(dev, dtype)
    rope_mod = RotaryEmbedding(args.head_dim, 10000.0).to(dev)
    cache = layer.new_cache() if kind == "nsa" else KVCache()
    x = torch.randn(1, S + args.steps + 1, args.dim, device=dev, dtype=dtype)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    for a in range(0, S, args.prefill_tile):
        b = min(a + args.prefill_tile, S)
        layer(x[:, a:b], rope_mod(torch.arange(a, b, device=dev)), cache)
    sync()
    prefill_s = time.perf_counter() - t0
    times = []
    for i in range(args.steps + 1):  # the first step is a warm-up
        pos = S + i
        t = time.perf_counter()
        layer(x[:, pos : pos + 1], rope_mod(torch.arange(pos, pos + 1, device=dev)), cache)
        sync()
        times.append((time.perf_counter() - t) * 1e3)
    row = {"impl": kind, "S": S, "decode_ms": round(min(times[1:]), 3),
           "decode_ms_median": round(statistics.median(times[1:]), 3), "prefill_s": round(prefill_s, 2)}
    row["reads_per_step"] = cache.reads_per_step() if kind == "nsa" else cache.length
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--S", type=int, nargs="+", default=[4096, 16384, 32768], help="context lengths")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv_heads", type=int, default=2)
    ap.add_argument("--head_dim", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps")
    ap.add_argument("--prefill_tile", type=int, default=4096)
    ap.add_argument("--quick", action="store_true", help="5 decode steps")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="layer and activations in this dtype")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.steps = 5
    results = []
    for S in args.S:
        for kind in ("dense", "nsa"):
            row = bench_one(kind, S, args)
            print(json.dumps(row), flush=True)
            results.append(row)
    by = {(r["impl"], r["S"]): r for r in results}
    summary = {"threads": torch.get_num_threads(), "torch": torch.__version__, "device": args.device,
               "dtype": args.dtype}
    for S in args.S:
        summary[f"speedup_{S}"] = round(by[("dense", S)]["decode_ms"] / by[("nsa", S)]["decode_ms"], 2)
        summary[f"read_ratio_{S}"] = round(by[("dense", S)]["reads_per_step"] / by[("nsa", S)]["reads_per_step"], 2)
    print(json.dumps({"summary": summary, "results": results}))


if __name__ == "__main__":
    main()
