"""Where a CUDA GPU spends the time of an NSA / dense attention layer: kernel tables from torch.profiler.

    PYTHONPATH=. python bench/profile_cuda.py --out DIR          # fwd+bwd at 8k and 32k, decode at 32k
    PYTHONPATH=. python bench/profile_cuda.py --out DIR --train 32768 --decode  # a subset

Layer layout: M7C-125M (dim 768, 12 query heads, 2 KV heads, head dim 64), bf16 autocast (as the trainer runs),
batch 1. Each case runs twice unprofiled (Triton autotuning, compilation) and then once under the profiler.
Writes DIR/profile.txt (one kernel table per case, the most device time first) and DIR/profile.json (per case:
wall ms, the NSA ranges' device time, the top kernels; for decode also each prefill chunk's wall time, which
shows recompilation). The NSA branches are named by their ranges (nsa.compressed / select / selected / window;
backward kernels by their own names). CUDA only.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from nsa.attention.dense import DenseAttention, KVCache
from nsa.attention.nsa import NativeSparseAttention
from nsa.config import ModelConfig
from nsa.layers import RotaryEmbedding
from nsa.profiling import set_nvtx

LAYOUT = dict(dim=768, n_heads=12, n_kv_heads=2, head_dim=64)  # M7C-125M
TOP = 30


def make_layer(kind: str, max_seq_len: int) -> torch.nn.Module:
    cfg = ModelConfig(**LAYOUT, attention=kind, max_seq_len=max_seq_len)
    layer = NativeSparseAttention(cfg) if kind == "nsa" else DenseAttention(cfg)
    return layer.cuda()


def profiled(fn, warmup: int = 2) -> tuple[float, profile]:
    """fn run `warmup` times, then once under the profiler: (wall ms of the profiled run, the profile)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t) * 1e3
    return wall_ms, prof


def summarise(name: str, wall_ms: float, prof: profile, table_file) -> dict:
    events = prof.key_averages()
    table_file.write(f"\n=== {name}: wall {wall_ms:.2f} ms ===\n")
    table_file.write(events.table(sort_by="self_device_time_total", row_limit=TOP, max_name_column_width=90))
    table_file.flush()

    def device_us(e, attr):
        return getattr(e, attr, None) or getattr(e, attr.replace("device", "cuda"), 0)

    kernels = sorted(events, key=lambda e: -device_us(e, "self_device_time_total"))
    ranges = {e.key: round(device_us(e, "device_time_total") / 1e3, 3) for e in events if e.key.startswith("nsa.")}
    return {"case": name, "wall_ms": round(wall_ms, 3), "ranges_device_ms": ranges,
            "device_ms_total": round(sum(device_us(e, "self_device_time_total") for e in events) / 1e3, 3),
            "top": [{"name": e.key[:120], "calls": e.count, "self_device_ms": round(device_us(e, "self_device_time_total") / 1e3, 3)}
                    for e in kernels[:TOP] if device_us(e, "self_device_time_total") > 0]}


def train_case(kind: str, S: int, table_file) -> dict:
    torch.manual_seed(0)
    layer = make_layer(kind, S)
    rope = RotaryEmbedding(LAYOUT["head_dim"], 10000.0).cuda()(torch.arange(S, device="cuda"))
    x = torch.randn(1, S, LAYOUT["dim"], device="cuda", requires_grad=True)

    def fwd_bwd():
        layer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = layer(x, rope)
        out.float().sum().backward()

    wall_ms, prof = profiled(fwd_bwd)
    return summarise(f"{kind} fwd+bwd S={S}", wall_ms, prof, table_file)


@torch.inference_mode()
def decode_case(kind: str, S: int, tile: int, table_file) -> dict:
    torch.manual_seed(0)
    layer = make_layer(kind, S + 8).eval().to(torch.bfloat16)
    rope_mod = RotaryEmbedding(LAYOUT["head_dim"], 10000.0).cuda()
    cache = layer.new_cache() if kind == "nsa" else KVCache()
    x = torch.randn(1, S + 8, LAYOUT["dim"], device="cuda", dtype=torch.bfloat16)
    chunk_s = []
    for a in range(0, S, tile):
        b = min(a + tile, S)
        t = time.perf_counter()
        layer(x[:, a:b], rope_mod(torch.arange(a, b, device="cuda")), cache)
        torch.cuda.synchronize()
        chunk_s.append(round(time.perf_counter() - t, 3))
    pos = [S]

    def step():
        p = pos[0]
        layer(x[:, p : p + 1], rope_mod(torch.arange(p, p + 1, device="cuda")), cache)
        pos[0] += 1

    wall_ms, prof = profiled(step)
    row = summarise(f"{kind} decode step at S={S}", wall_ms, prof, table_file)
    row["prefill_chunk_s"] = chunk_s
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--train", type=int, nargs="*", default=[8192, 32768], help="fwd+bwd at these lengths")
    ap.add_argument("--decode", type=int, nargs="*", default=[32768], help="one decode step after these lengths")
    ap.add_argument("--prefill_tile", type=int, default=4096)
    ap.add_argument("--impl", nargs="+", default=["nsa", "dense"], choices=["nsa", "dense"])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("profile_cuda: needs a CUDA device", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    set_nvtx(True, to_profiler=True)
    rows = []
    with open(args.out / "profile.txt", "w") as table_file:
        cases = [(train_case, k, S) for S in args.train for k in args.impl]
        cases += [(decode_case, k, S) for S in args.decode for k in args.impl]
        for fn, kind, S in cases:
            try:
                row = fn(kind, S, table_file) if fn is train_case else fn(kind, S, args.prefill_tile, table_file)
            except Exception as exc:  # one failing case is recorded; the others still run
                row = {"case": f"{fn.__name__} {kind} S={S}", "error": f"{type(exc).__name__}: {exc}"[:2000]}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "top"}), flush=True)
            (args.out / "profile.json").write_text(json.dumps({"torch": torch.__version__,
                                                               "gpu": torch.cuda.get_device_name(0), "cases": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
