"""NSA attention layer vs a dense SDPA attention layer (same projections), forward and forward+backward.

    .venv/bin/python bench/bench_nsa.py                      # S = 512 .. 16384
    .venv/bin/python bench/bench_nsa.py --S 1024 4096 --quick
    .venv/bin/python bench/bench_nsa.py --S 8192 --documents 0 1 8 64   # packed documents (masking)

Prints one JSON object per (S, impl) with min and median times and a final summary JSON line. Defaults: dim 256, 4 query heads,
2 KV heads, head dim 64, float32, batch 1, NSA paper defaults (l=32, d=16, l'=64, n=16, w=512).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


from nsa.attention.dense import DenseAttention
from nsa.attention.documents import Documents
from nsa.attention.nsa import NativeSparseAttention
from nsa.config import ModelConfig
from nsa.launch_count import packed_starts
from nsa.layers import RotaryEmbedding


def make_layer(kind: str, args) -> torch.nn.Module:
    cfg = ModelConfig(
        dim=args.dim, n_heads=args.heads, n_kv_heads=args.kv_heads, head_dim=args.head_dim,
        attention="nsa" if kind == "nsa" else "dense", max_seq_len=max(args.S),
    )
    layer = NativeSparseAttention(cfg) if kind == "nsa" else DenseAttention(cfg)
    return layer.to(args.device)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_ms(fn, repeats: int, device: str = "cpu") -> tuple[float, float]:
    """(min, median) wall time in ms over `repeats` runs after one warm-up (the device synchronised
    around each run). The minimum is the number to quote on a shared machine: interference only
    ever adds time."""
    fn()  # warm-up
    sync(device)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t) * 1e3)
    return round(min(times), 1), round(statistics.median(times), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--S", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv_heads", type=int, default=2)
    ap.add_argument("--head_dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs after one warm-up (median)")
    ap.add_argument("--quick", action="store_true", help="one timed run, forward+backward only")
    ap.add_argument("--impl", nargs="+", default=["dense", "nsa"], choices=["dense", "nsa"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="bf16: autocast, as the trainer runs")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--documents", type=int, nargs="+", default=[0],
                    help="documents per window (0: no masking; n: n packed documents of uneven lengths, masked; "
                         "the per-batch document layout is timed with the layer)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = 1 if args.quick else args.repeats
    torch.manual_seed(0)
    rope_mod = RotaryEmbedding(args.head_dim, 10000.0).to(args.device)
    results = []
    for S, n_docs, kind in ((S, n, k) for S in args.S for n in args.documents for k in args.impl):
        x = torch.randn(1, S, args.dim, device=args.device)
        starts = packed_starts(1, S, n_docs).to(args.device) if n_docs else None
        layer = make_layer(kind, args)
        row = {"impl": kind, "S": S, "documents": n_docs}

        def call(inp):
            if starts is None:
                return layer(inp, rope_mod(torch.arange(S, device=args.device)))
            docs = Documents(starts)  # built per batch, as the model does
            return layer(inp, rope_mod(docs.positions), documents=docs)

        autocast = torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16,
                                  enabled=args.dtype == "bf16")
        if not args.quick:
            def fwd():
                with torch.no_grad(), autocast:
                    call(x)

            row["fwd_ms"], row["fwd_ms_median"] = time_ms(fwd, repeats, args.device)
        xg = x.clone().requires_grad_(True)

        def fwd_bwd():
            layer.zero_grad(set_to_none=True)
            with autocast:
                out = call(xg)
            out.float().sum().backward()

        row["fwd_bwd_ms"], row["fwd_bwd_ms_median"] = time_ms(fwd_bwd, repeats, args.device)
        print(json.dumps(row), flush=True)
        results.append(row)
    by = {(r["impl"], r["S"]): r for r in results if r["documents"] == args.documents[0]}
    summary = {"threads": torch.get_num_threads(), "torch": torch.__version__, "device": args.device,
               "dtype": args.dtype}
    base = {(r["impl"], r["S"]): r["fwd_bwd_ms"] for r in results if r["documents"] == 0}
    for r in results:
        if r["documents"] and (r["impl"], r["S"]) in base:
            summary[f"{r['impl']}_{r['S']}_docs{r['documents']}_over_unmasked"] = round(r["fwd_bwd_ms"] / base[(r["impl"], r["S"])], 3)
    for S in args.S:
        if ("nsa", S) in by and ("dense", S) in by:
            summary[f"nsa_over_dense_fwd_bwd_{S}"] = round(by[("nsa", S)]["fwd_bwd_ms"] / by[("dense", S)]["fwd_bwd_ms"], 3)
    if ("nsa", 8192) in by and ("nsa", 16384) in by:
        summary["nsa_growth_16k_over_8k"] = round(by[("nsa", 16384)]["fwd_bwd_ms"] / by[("nsa", 8192)]["fwd_bwd_ms"], 3)
    print(json.dumps({"summary": summary, "results": results}))


if __name__ == "__main__":
    main()
