"""NSA's compressed and sliding-window branches: FlexAttention vs the portable SDPA path, per sequence length.

    python bench/bench_branches.py --device cuda --dtype bf16 --S 8192 16384 32768 65536
    python bench/bench_branches.py --device cpu --S 1024 2048        # forward only (no flex backward on CPU)

The layer runs FlexAttention for these branches on CUDA (nsa/attention/impl/flex.py); this measures whether
that is the faster choice. M7C-125M head layout (12 query heads, 2 KV heads, head dim 64), batch 1, paper
defaults l=32, d=16, w=512. Prints one JSON line per (S, branch, backend) and a summary line last.
"""
from __future__ import annotations

import argparse
import json

import torch


from bench_nsa import time_ms  # the sibling benchmark (bench/ is this script's sys.path[0])
from nsa.attention.impl import flex
from nsa.attention.impl.compression import num_compressed
from nsa.attention.ops import compressed_attention, window_attention

L, D, W, Q_CHUNK, WIN_BLOCK = 32, 16, 512, 256, 128


def branch_fns(q, ck, cv, k, v):
    """{(branch, backend): fn() -> out} over the same inputs."""
    return {
        ("compressed", "sdpa"): lambda: compressed_attention(q, ck, cv, 0, L, D, Q_CHUNK),
        ("compressed", "flex"): lambda: flex.flex_compressed_attention(q, ck, cv, 0, L, D),
        ("window", "sdpa"): lambda: window_attention(q, k, v, 0, 0, W, WIN_BLOCK),
        ("window", "flex"): lambda: flex.flex_window_attention(q, k, v, 0, 0, W),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--S", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv_heads", type=int, default=2)
    ap.add_argument("--head_dim", type=int, default=64)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    backward = args.device.startswith("cuda")  # FlexAttention has no CPU backward
    torch.manual_seed(0)
    results = []
    for S in args.S:
        def make(*shape):
            return torch.randn(*shape, device=args.device, dtype=dtype).requires_grad_(backward)

        q = make(1, args.heads, S, args.head_dim)
        n_c = num_compressed(S, L, D)
        ck, cv = make(1, args.kv_heads, n_c, args.head_dim), make(1, args.kv_heads, n_c, args.head_dim)
        k, v = make(1, args.kv_heads, S, args.head_dim), make(1, args.kv_heads, S, args.head_dim)
        for (branch, backend), fn in branch_fns(q, ck, cv, k, v).items():
            def run():
                out = fn()
                if backward:
                    out.float().sum().backward()
                    for t in (q, ck, cv, k, v):
                        t.grad = None

            if not backward:
                run = torch.no_grad()(run)
            best, median = time_ms(run, args.repeats, args.device)
            row = {"S": S, "branch": branch, "backend": backend, "pass": "fwd_bwd" if backward else "fwd",
                   "ms": best, "ms_median": median}
            print(json.dumps(row), flush=True)
            results.append(row)
    by = {(r["S"], r["branch"], r["backend"]): r["ms"] for r in results}
    summary = {"device": args.device, "dtype": args.dtype, "torch": torch.__version__}
    for S in args.S:
        for branch in ("compressed", "window"):
            flex_ms, sdpa_ms = by[(S, branch, "flex")], by[(S, branch, "sdpa")]
            summary[f"{branch}_sdpa_over_flex_{S}"] = round(sdpa_ms / max(flex_ms, 1e-3), 2)
    faster = [v >= 1.0 for k, v in summary.items() if "_over_flex_" in k]
    summary["flex_faster_everywhere"] = all(faster)
    print(json.dumps({"summary": summary, "results": results}))


if __name__ == "__main__":
    main()
