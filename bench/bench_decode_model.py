"""Whole-model decode steps over static caches (nsa/static_decode.py): M7C-125M's NSA model against its dense twin,
eager and replayed as CUDA graphs, at long contexts and batch sizes.

    PYTHONPATH=. python3 bench/bench_decode_model.py --S 32768 65536 --B 1 16            # one GPU (bf16)
    PYTHONPATH=. python3 bench/bench_decode_model.py --tiny --device cpu                 # the plumbing (eager only)

Per model (configs/m7c_125m_long.yaml's M7C-125M and its dense twin: the same model with attention dense):
  check   a short prompt prefilled and decoded over static caches, every step's logits against a full forward's
          (relative RMS, bf16 tolerance), on the eager step and, on CUDA, the graph replay; the replay against the
          eager step too. A failed check skips that model's timing.
  timing  for each (S, B): static caches of S + steps positions filled with random keys and values (what a prefill of
          S tokens leaves, for timing: a step's work depends on the shapes, not the values; the picks are whatever the
          random keys score), position S; the step's median time over --steps (CUDA events), eager and graphed, and
          at the --compile_at points compiled + graphed (NSA also with its three branches as torch ops instead of
          the decode kernels, kernels/decode_step.py: "unfused"); the
          bytes a step must read (the weights once, every cache slot it reads: the buffers whole) and the time that
          takes at the copy bandwidth measured here (a 1 GiB device copy); on CUDA each arm's device operations per
          step (`kernels_<arm>`, torch.profiler).
Prints one JSON line per row and a last line {"summary": ..., "rows": ...}; summary keys
decode_nsa_over_dense_<S>_b<B> (graphed when CUDA, else eager: dense's ms / NSA's, > 1 when NSA is faster).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import statistics
import time
from pathlib import Path

import torch

from nsa.model import Transformer
from nsa.static_decode import StaticDecoder

REPO = Path(__file__).resolve().parents[1]
M7C_CONFIG = REPO / "configs" / "m7c_125m_long.yaml"
TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128, vocab_size=512)
TINY_NSA = dict(l=8, d=4, l_sel=16, n_sel=4, w=32)
CHECK_TOLERANCE = 2e-2  # relative RMS of logits in bf16 (float32 on CPU: far below)


def length_tag(T: int) -> str:
    return f"{T // 1024}k" if T >= 1024 and T % 1024 == 0 else str(T)


def model_configs(tiny: bool, max_len: int):
    """(NSA config, its dense twin) of M7C-125M (or a tiny stand-in), max_seq_len = max_len."""
    from train.core.config import load_config

    cfg = load_config(str(M7C_CONFIG), ["--runtime.device=cpu"]).model
    if tiny:
        cfg = dataclasses.replace(cfg, **TINY, nsa=dataclasses.replace(cfg.nsa, **TINY_NSA))
    cfg = dataclasses.replace(cfg, max_seq_len=max_len, dropout=0.0)
    return {"nsa": cfg, "dense": dataclasses.replace(cfg, attention="dense")}


def build(cfg, device: str, dtype) -> Transformer:
    torch.manual_seed(0)
    return Transformer(cfg).to(device=device, dtype=dtype).eval()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


@torch.no_grad()
def check(model: Transformer, device: str, length: int, steps: int, batch: int, max_len: int, arms: dict) -> dict:
    """Static decode (each arm: {name: (graphs, compile)}) against one full forward over `steps` tokens after a prompt
    of `length`, in caches of max_len positions (the timing's shape: a compiled arm compiles once for both)."""
    ids = torch.randint(0, model.cfg.vocab_size, (batch, length + steps), device=device,
                        generator=torch.Generator(device).manual_seed(1))
    full = model(ids)[:, length - 1:]  # [B, steps + 1, V]
    out, logits = {}, {}
    for name, (graphs, compile_) in arms.items():
        decoder = StaticDecoder(model, batch, max_len, graphs=graphs, compile=compile_)
        got = [decoder.prefill(ids[:, :length], chunk=256)]
        got += [decoder.step(ids[:, t]).clone() for t in range(length, length + steps)]
        logits[name] = torch.stack(got, dim=1)
        release(decoder)
        out[f"{name}_vs_full"] = float(f"{rel_rms(logits[name], full):.3g}")
        if name != "eager":
            out[f"{name}_vs_eager"] = float(f"{rel_rms(logits[name], logits['eager']):.3g}")
    out["ok"] = all(v <= CHECK_TOLERANCE for v in out.values())
    return out


def release(decoder: StaticDecoder) -> None:
    """Free a decoder's caches and graph now: its compiled steps hold it in a reference cycle, which only the cyclic
    garbage collector breaks (at 64k, batch 16 the caches are ~6.6 GB a model)."""
    decoder.caches, decoder.graph, decoder.logits = [], None, None
    gc.collect()
    if decoder.device.type == "cuda":
        torch.cuda.empty_cache()


def fill_random(decoder: StaticDecoder, t: int, seed: int) -> None:
    """Every cache buffer random (unit normal, as keys after QK-norm-free projections are of order 1), position t."""
    g = torch.Generator(decoder.device).manual_seed(seed)
    for cache in decoder.caches:
        for buf in vars(cache).values():
            if isinstance(buf, torch.Tensor) and buf.is_floating_point():
                buf.copy_(torch.randn(buf.shape, generator=g, device=buf.device, dtype=torch.float32))
    decoder.pos.fill_(t)
    decoder.t = t
    decoder.graph = None


def step_bytes(model: Transformer, decoder: StaticDecoder) -> int:
    """Bytes one step must read: the weights (the embedding table but its B rows excluded, unless tied to the head)
    and every cache slot the step reads (the static buffers whole)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.cfg.tie_embeddings:
        weights -= model.tok_emb.weight.numel() * model.tok_emb.weight.element_size()
    cache = 0
    for c in decoder.caches:
        for buf in vars(c).values():
            if isinstance(buf, torch.Tensor) and buf.is_floating_point():
                cache += buf.numel() * buf.element_size()
    if hasattr(decoder.caches[0], "sel_k"):  # NSA reads n * l' selection positions of its buffer, not all of it
        c0, nsa = decoder.caches[0], model.cfg.nsa
        sel_all = 2 * c0.sel_k.numel() * c0.sel_k.element_size() * len(decoder.caches)
        sel_read = sel_all * min(nsa.n_sel * nsa.l_sel, c0.sel_k.shape[2]) // c0.sel_k.shape[2]
        cache += sel_read - sel_all
    return weights + cache


def time_steps(decoder: StaticDecoder, device: str, steps: int) -> float:
    """Median ms of one step over `steps`, from position decoder.t on (put back after each)."""
    token = torch.zeros(decoder.batch, dtype=torch.long, device=device)
    at, t = decoder.pos.clone(), decoder.t
    decoder.step(token)  # a graph is captured here (and its warm-up run)
    times = []
    for _ in range(steps):
        decoder.pos.copy_(at)
        decoder.t = t
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            decoder.step(token)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            decoder.step(token)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def kernels_per_step(decoder: StaticDecoder, device: str) -> int | None:
    """Device operations (kernels, copies, fills) of one step, a graph replay's included, counted by torch.profiler
    (CUPTI), the position put back after it; None off CUDA. bench/bench_launches.py --compiled predicts the compiled
    step's from inductor's generated code on a CPU."""
    if device != "cuda":
        return None
    token = torch.zeros(decoder.batch, dtype=torch.long, device=device)
    at, t = decoder.pos.clone(), decoder.t
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        decoder.step(token)
        torch.cuda.synchronize()
    decoder.pos.copy_(at)
    decoder.t = t
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def copy_bandwidth(device: str) -> float | None:
    """Bytes per second of a 1 GiB device copy (read + write), or None on CPU."""
    if device != "cuda":
        return None
    a = torch.empty(1 << 29, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    for _ in range(2):
        b.copy_(a)
    sync(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    end.synchronize()
    return 10 * 2 * a.numel() * a.element_size() / (start.elapsed_time(end) / 1e3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--S", type=int, nargs="+", default=[32768, 65536], help="context lengths")
    ap.add_argument("--B", type=int, nargs="+", default=[1, 16], help="batch sizes")
    ap.add_argument("--compile_at", nargs="*", default=["32768:1", "65536:16"],
                    help="S:B points that also time the compiled step (CUDA: compiled + graphed; each shape compiles "
                         "anew); 'all' for every point, none for no compiled arm")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per arm")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny model and contexts: the plumbing")
    ap.add_argument("--check_len", type=int, default=200, help="prompt length of the check (0: no check)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no CUDA device (use --device cpu --tiny)", flush=True)
        return 2
    # every compiled shape is a new entry of the same code objects (the block step, the embedding, the head)
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), 64))
    if args.tiny:
        args.S, args.B, args.steps, args.check_len = [96, 160], [1, 2], 3, min(args.check_len, 40)
        args.compile_at = [p for p in args.compile_at if p == "all"]
    points = [(S, B) for S in args.S for B in args.B]
    compiled_points = set(points) if "all" in args.compile_at else {
        tuple(int(v) for v in p.split(":")) for p in args.compile_at if p != "none"} & set(points)
    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    steps_after = 8
    configs = model_configs(args.tiny, max(max(args.S) + 2, args.check_len + steps_after + 1))
    bandwidth = copy_bandwidth(args.device)
    rows, checks = [], {}
    for kind, cfg in configs.items():
        model = build(cfg, args.device, dtype)
        if args.check_len:  # at the first compiled point's shape (or the first point's), so compiling serves both
            S, B = min(compiled_points) if compiled_points else points[0]
            arms = {"eager": (False, False), **({"graphed": (True, False)} if cuda else {}),
                    **({"compiled" + ("_graphed" if cuda else ""): (cuda, True)} if compiled_points else {})}
            checks[kind] = check(model, args.device, args.check_len, steps_after, B, S + 2, arms)
            print(json.dumps({"check": kind, **checks[kind]}), flush=True)
            if not checks[kind]["ok"]:
                continue
        for S, B in points:
            row = {"model": kind, "S": S, "B": B}
            arms = {"eager_ms": (False, False), **({"graphed_ms": (True, False)} if cuda else {})}
            if (S, B) in compiled_points:
                arms["compiled_graphed_ms" if cuda else "compiled_ms"] = (cuda, True)
                if cuda and kind == "nsa":  # the three branches as torch ops instead of the decode kernels
                    arms["compiled_graphed_unfused_ms"] = (True, True)
            for name, (graphs, compile_) in arms.items():
                decoder = StaticDecoder(model, B, S + 2, graphs=graphs, compile=compile_, fused="unfused" not in name)
                fill_random(decoder, S, seed=S + B)
                row[name] = round(time_steps(decoder, args.device, args.steps), 4)
                if (kernels := kernels_per_step(decoder, args.device)) is not None:
                    row["kernels_" + name[:-3]] = kernels  # a launch-bound step's cost is its count
                row["bytes_per_step"] = step_bytes(model, decoder)
                release(decoder)
            if bandwidth:
                row["ideal_ms"] = round(row["bytes_per_step"] / bandwidth * 1e3, 4)
                best = min(v for k, v in row.items() if k.endswith("_ms") and k != "ideal_ms")
                row["fraction_of_copy_bandwidth"] = round(row["ideal_ms"] / best, 3)
            print(json.dumps(row), flush=True)
            rows.append(row)
        del model
        if cuda:
            torch.cuda.empty_cache()
    summary = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "dtype": str(dtype),
               "copy_bytes_per_s": bandwidth, "checks_ok": all(c["ok"] for c in checks.values())}
    by = {(r["model"], r["S"], r["B"]): r for r in rows}
    for S, B in points:
        nsa, dense = by.get(("nsa", S, B)), by.get(("dense", S, B))
        if not (nsa and dense):
            continue
        tag = f"decode_nsa_over_dense_{length_tag(S)}_b{B}"
        for arm in ("eager_ms", "graphed_ms", "compiled_graphed_ms", "compiled_ms"):
            if arm in nsa and arm in dense:
                summary[f"{tag}_{arm[:-3]}"] = round(dense[arm] / nsa[arm], 3)
        if "compiled_graphed_unfused_ms" in nsa and "compiled_graphed_ms" in dense:  # without the decode kernels
            summary[f"{tag}_compiled_graphed_unfused"] = round(
                dense["compiled_graphed_ms"] / nsa["compiled_graphed_unfused_ms"], 3)
        # the goal's number: CUDA graphs both, each model at its fastest graphed arm
        graphed = [a for a in ("graphed_ms", "compiled_graphed_ms", "compiled_graphed_unfused_ms") if a in nsa]
        dense_graphed = [dense[a] for a in ("graphed_ms", "compiled_graphed_ms") if a in dense]
        if graphed and dense_graphed:
            summary[tag] = round(min(dense_graphed) / min(nsa[a] for a in graphed), 3)
    print(json.dumps({"summary": summary, "checks": checks, "rows": rows}))
    return 0 if summary["checks_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
