"""NSA's speed on a GPU in one call: correctness first, then NSA beside SDPA, FlexAttention and fla's NSA.

    PYTHONPATH=. python3 bench/gpu_nsa_speed.py --out bench/results                # every section (~8 min, one H100/H200)
    PYTHONPATH=. python3 bench/gpu_nsa_speed.py --out bench/results --only attention --S 8192 32768
    TRITON_INTERPRET=1 PYTHONPATH=. python3 bench/gpu_nsa_speed.py --out DIR --device cpu --tiny  # the plumbing (CPU)

Sections, in this order (`--only` picks some; each is recorded as it ends, attention also after its first step and
each row, so a call cut short keeps what it had):
  environment  torch, Triton, CUDA, the GPU, whether fla's `parallel_nsa` imports
  correctness  before any timing. (a) the NSA layer on the Triton kernels in bf16 against the float64 per-token
               reference (nsa/attention/reference.py) at small T, forward; (b) the same layer on the Triton kernels in
               bf16 against the torch path in float64 at a longer T, outputs and every gradient (x and parameters).
               Both layouts, fresh random inputs (the seed is recorded), and on CUDA the caching allocator's free
               memory poisoned with NaN first, so an element a kernel never writes shows.
  ceilings     a device-to-device copy (bytes read + written per second) and a bf16 matmul (8192^3), measured here
  attention    per layout and length, forward and forward+backward (on CPU: the torch path, FlexAttention forward
               only; the numbers only check the plumbing): NSA's core (`NativeSparseAttention.
               sparse_attention` + the gated sum: compression, scoring, top-n, the three branches, gates given)
               against SDPA (the backend torch picked, named), FlexAttention causal (compiled) and, at the paper's
               layout, fla's `parallel_nsa`; at M7C's layout NSA with the learned block indexer (issue 51: its two
               configurations, their KL term differentiated too; `m7c_indexer*_extra_fwd_bwd_<T>` in the summary is
               their time over pooled NSA's, a fraction of it); each NSA stage alone with its counted FLOPs and bytes
               and the fraction
               of the measured ceilings it reaches (the selected branch also against the bytes its own kernel order
               moves: `m7c_selected_fwd_roofline_fraction_as_built_<T>`); the whole NSA layer (projections included) fwd+bwd at 8k under
               the profiler: device-busy fraction, host time and kernel launches
  train        M7C-125M compiled, NSA and its dense twin, tokens/s at each --train_S, with the ideal ratio from
               counted FLOPs (nsa/flops.py v3); --train_graphs also runs both with CUDA graphs (runtime.cuda_graphs:
               torch.compile's reduce-overhead mode), which take the host's launch work off the step
  decode       the whole M7C model's decode step at each --decode_S, batch 1 and 16, NSA vs its dense twin over
               static caches, eager / CUDA graphs / compiled + graphs, checked against a full forward first
               (bench/bench_decode_model.py); then one attention layer's step over the growing caches
               (bench/bench_decode.py, batch 1, the second GPU session's measurement)

Layouts: m7c (12 query heads, 2 KV heads, head dim 64: G = 6, the block-centric selection kernels) and paper (64 / 4,
head dim 128: G = 16, the query-centric ones, the group fla requires), both with the paper's NSA geometry l=32 d=16
l'=64 n=16 w=512. fla's arm, like for like: its compression is a mean pool with l = d = l' = 64 and its three branches
share one K/V; fla's window branch needs flash-attn, so the arm is parallel_nsa(window_size=0) plus this project's
window op, and NSA is also timed at fla's geometry (`paper_fla_geometry`: l = d = l' = 64).

Writes OUT/gpu_nsa_speed_<card>_<date>.json, merged with what earlier calls that day wrote (sections replaced,
summary keys updated), with `device`, `sections` and `summary` (the ratios docs/BENCHMARKS.md quotes: *_over_* is
NSA's speed over the other's, > 1 when NSA is faster).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

NSA_GEOMETRY = dict(l=32, d=16, l_sel=64, n_sel=16, w=512)  # the paper's and M7C's
FLA_GEOMETRY = dict(l=64, d=64, l_sel=64, n_sel=16, w=512)  # fla's mean pool: l = d = l' = block_size
TINY_GEOMETRY = dict(l=8, d=4, l_sel=16, n_sel=4, w=32)
LAYOUTS = {"m7c": dict(n_heads=12, n_kv_heads=2, head_dim=64), "paper": dict(n_heads=64, n_kv_heads=4, head_dim=128)}
TINY_LAYOUTS = {"m7c": dict(n_heads=12, n_kv_heads=2, head_dim=16), "paper": dict(n_heads=32, n_kv_heads=2, head_dim=32)}
# issue 51: NSA with the learned block indexer (nsa.selector=indexer), timed beside pooled NSA at M7C's layout
INDEXER_ARMS = {"indexer": dict(selector="indexer"),  # the defaults: one key per block, the compressed target
                "indexer_scores": dict(selector="indexer", indexer_pool="scores", indexer_target="dense")}
UNFOLDED_AT = (8192, 32768)  # M7C lengths where the compressed branch is also timed without folding its queries
SECTIONS = ("environment", "correctness", "ceilings", "attention", "train", "decode", "mfu")
# relative RMS error in bf16, and the share of rows whose picks may differ (see correctness())
TOLERANCE = {"reference_out": 1e-2, "out": 1e-2, "grad": 2e-2, "selection_disagreement": 0.02}
INTERPRETER_SLACK = 2.5  # Triton's interpreter truncates float32 -> bf16 casts (correctness' docstring)


# ---------------------------------------------------------------- timing
def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, device: str, repeats: int, warmup: int | None = None) -> float:
    """Median milliseconds of fn over `repeats` runs after `warmup` (CUDA events on the GPU, the wall clock on CPU).
    Warm-up calls (compilation, autotuning, the allocator's first blocks) only on the GPU by default: a CPU run is the
    plumbing at tiny sizes, where the interpreter has nothing to warm and each call costs the same."""
    import torch

    warmup = (2 if device == "cuda" else 0) if warmup is None else warmup
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return round(statistics.median(times), 4)


# ---------------------------------------------------------------- building blocks
def model_config(layout: dict, geometry: dict, kernel: str, T: int):
    from nsa.config import ModelConfig, NSAConfig

    dim = layout["n_heads"] * layout["head_dim"]
    return ModelConfig(dim=dim, **layout, attention="nsa", max_seq_len=T,
                       nsa=NSAConfig(**geometry, kernel=kernel, gate_init="equal"))


def nsa_layer(layout: dict, geometry: dict, kernel: str, T: int, device: str, dtype, seed: int):
    import torch

    from nsa.attention.nsa import NativeSparseAttention

    torch.manual_seed(seed)
    layer = NativeSparseAttention(model_config(layout, geometry, kernel, T))  # the seed fixes every weight
    with torch.no_grad():  # gates ~0.5 each and phi's output layer not ~0: every branch carries signal
        for p in layer.parameters():
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]) if p.dim() > 1 else 0.1)
    return layer.to(device=device, dtype=dtype)


def rope_for(head_dim: int, T: int, device: str):
    import torch

    from nsa.layers import RotaryEmbedding

    return RotaryEmbedding(head_dim, 10000.0).to(device)(torch.arange(T, device=device))


def poison(device: str) -> None:
    """Fill the caching allocator's free memory with NaN: a later tensor that reuses it and is not fully written
    by a kernel reads NaN, not zeros or stale numbers."""
    import torch

    if device != "cuda":
        return
    free, _ = torch.cuda.mem_get_info()
    try:
        blob = torch.full((int(free * 0.5) // 2,), float("nan"), dtype=torch.bfloat16, device="cuda")
        del blob
    except torch.OutOfMemoryError:
        pass


def rel_rms(got, want) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    if not bool(got.isfinite().all()):
        return float("inf")
    return ((got - want).square().mean().sqrt() / want.square().mean().sqrt().clamp_min(1e-30)).item()


# ---------------------------------------------------------------- sections
def environment(args) -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if args.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                      "capability": f"{props.major}.{props.minor}", "sms": props.multi_processor_count}
    env["fla"] = fla_version()
    return env


def fla_version() -> str | None:
    try:
        from importlib import metadata

        import fla.ops.nsa  # noqa: F401

        return metadata.version("fla-core")
    except Exception as exc:  # not installed, or it fails to import here: the arm is skipped, with why
        return f"unavailable ({type(exc).__name__}: {exc})"[:200]


def correctness(args) -> dict:
    """(a) Triton bf16 vs the float64 per-token reference, forward, small T; (b) Triton bf16 vs the torch path in
    float64, outputs and every gradient, longer T, the float64 run given the bf16 run's selected blocks (selection
    has no gradient; replaying it compares the attention, not the picks), and separately the share of (query, KV
    head) rows whose blocks the two runs pick differently; the compressed branch's queries folded into 4 batch rows
    on CUDA (impl/flex.py fold_count: what FlexAttention runs from 4k on; `compressed_folds`). Tolerances (relative RMS): the reference sees the same bf16
    parameters and inputs, so what differs is the kernels' bf16 roundings (q·k, P, P·V, and in (b) phi's and the
    gates' bf16 matmuls and the backward's dS, dP: ~2^-8 each, averaged; seen on CPU: outputs 0.005-0.006, most
    gradients 0.005-0.013). A gradient with much cancellation has a larger relative error in any bf16 run (phi's
    position encoding: 0.006-0.023), so each tensor's bound is its floor or twice the error of the torch path in
    bf16 against the same float64 run, whichever is larger. On CPU (--tiny) the kernels run in Triton's interpreter,
    whose float32 -> bf16 casts truncate (a GPU rounds to nearest: half the values differ, twice the mean error), so
    every bound there is INTERPRETER_SLACK times wider. Picks differ where two blocks' scores are
    within that rounding (phi's bf16 compressed keys): a few rows in 10^3 on random inputs; more than 2% would be a
    scoring bug."""
    import torch

    from nsa.attention import ops
    from nsa.attention.impl import flex
    from nsa.attention.reference import reference_forward

    fold_queries = flex.FOLD_QUERIES
    seed = int(time.time()) % 100_000
    slack = INTERPRETER_SLACK if args.device == "cpu" else 1.0
    layouts, geometry = (TINY_LAYOUTS, TINY_GEOMETRY) if args.tiny else (LAYOUTS, NSA_GEOMETRY)
    small_T, long_T = (48, 96) if args.tiny else (96, 2048)
    cases, ok = {}, True
    for name, layout in layouts.items():
        if not args.tiny:  # the per-token reference walks every head in Python: fewer heads, the same group size
            ref_layout = dict(layout, n_heads=layout["n_heads"] // layout["n_kv_heads"], n_kv_heads=1)
        else:
            ref_layout = layout
        layer = nsa_layer(ref_layout, geometry, "triton", small_T, args.device, torch.bfloat16, seed)
        x = torch.randn(1, small_T, layer.q_proj.in_features, generator=torch.Generator().manual_seed(seed))
        x = x.to(torch.bfloat16)
        rope = rope_for(ref_layout["head_dim"], small_T, "cpu")
        poison(args.device)
        with torch.no_grad():
            y = layer(x.to(args.device), tuple(r.to(args.device) for r in rope))
            ref, _ = reference_forward(layer.cpu(), x, rope)
        case = {"T": small_T, "layout": ref_layout, "reference_out": rel_rms(y, ref)}

        fast = nsa_layer(layout, geometry, "triton", long_T, args.device, torch.bfloat16, seed + 1)
        portable = nsa_layer(layout, geometry, "torch", long_T, args.device, torch.bfloat16, seed + 1)
        exact = nsa_layer(layout, geometry, "torch", long_T, args.device, torch.float64, seed + 1)
        portable.load_state_dict(fast.state_dict())
        exact.load_state_dict({k: v.double() for k, v in fast.state_dict().items()})  # the same bf16 values
        x = torch.randn(1, long_T, fast.q_proj.in_features, device=args.device).to(torch.bfloat16)
        rope = rope_for(layout["head_dim"], long_T, args.device)
        d_out = torch.randn(1, long_T, fast.q_proj.in_features, generator=torch.Generator().manual_seed(seed + 2))
        grads, picks = {}, {}
        real_select = ops.select_blocks
        runs = (("fast", fast, torch.bfloat16), ("portable", portable, torch.bfloat16), ("exact", exact, torch.float64))
        for kind, module, dtype in runs:

            def select(*a, kind=kind, **k):  # records each run's own picks; the others attend to the bf16 kernels'
                picks[kind] = real_select(*a, **k)
                return picks["fast"]

            poison(args.device)
            xi = x.detach().to(dtype).clone().requires_grad_(True)
            ops.select_blocks = select
            flex.FOLD_QUERIES = long_T // 4  # on CUDA the compressed branch folds its queries as from 4k on
            try:
                out = module(xi, tuple(r.to(dtype) for r in rope))
                out.backward(d_out.to(out))
            finally:
                ops.select_blocks = real_select
                flex.FOLD_QUERIES = fold_queries
            grads[kind] = {"out": out.detach(), "x": xi.grad, **{n: p.grad for n, p in module.named_parameters()}}
        # each tensor's bound: its floor, or twice the error of the torch path in bf16 (the same roundings, other
        # kernels) where that is larger (a gradient with much cancellation, e.g. phi's position encoding)
        errors = {n: (rel_rms(g, grads["exact"][n]), rel_rms(grads["portable"][n], grads["exact"][n]))
                  for n, g in grads["fast"].items()}
        bounds = {n: slack * max(TOLERANCE["out" if n == "out" else "grad"], 2 * torch_err)
                  for n, (_, torch_err) in errors.items()}
        case.update(T_long=long_T, out=errors["out"][0], out_torch_bf16=errors["out"][1], compressed_folds=4)
        case["grad"] = {n: {"triton_bf16": e, "torch_bf16": t, "bound": bounds[n]}
                        for n, (e, t) in errors.items() if n != "out"}
        case["worst"] = max(((n, e / bounds[n]) for n, (e, _) in errors.items()), key=lambda kv: kv[1])
        differ = (picks["fast"].sort(-1).values != picks["exact"].sort(-1).values).any(-1)  # [B, H_kv, T]
        case["selection_disagreement"] = differ.double().mean().item()
        case["ok"] = (case["reference_out"] < slack * TOLERANCE["reference_out"] and case["worst"][1] <= 1.0
                      and case["selection_disagreement"] <= TOLERANCE["selection_disagreement"])
        ok = ok and case["ok"]
        cases[name] = case
    return {"ok": ok, "seed": seed, "tolerance": TOLERANCE, "slack": slack, "cases": cases}


def ceilings(args) -> dict:
    import torch

    n = (1 << 20) if args.tiny else (1 << 30)  # bytes per buffer
    src = torch.empty(n, dtype=torch.uint8, device=args.device).random_()
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src), args.device, 5 if args.tiny else 20)
    m = 256 if args.tiny else 8192
    a = torch.randn(m, m, device=args.device, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=args.device, dtype=torch.bfloat16)
    mm_ms = time_ms(lambda: a @ b, args.device, 3 if args.tiny else 20)
    return {"ok": True, "copy_bytes_per_s": 2 * n / (copy_ms / 1e3), "bf16_matmul_flops_per_s": 2 * m**3 / (mm_ms / 1e3),
            "copy_buffer_bytes": n, "matmul_n": m}


def sdpa_backend(q, k, v) -> str:
    """Which kernel torch's SDPA ran for causal attention with these inputs (from the profiler's kernel names)."""
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    if not q.is_cuda:
        return "cpu"
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.cuda.synchronize()
    names = " ".join(e.name.lower() for e in prof.events())
    for needle, backend in (("cudnn", "cudnn"), ("flash", "flash"), ("fmha", "efficient"), ("efficient", "efficient")):
        if needle in names:
            return backend
    return "math"


def stage_costs(layout: dict, geometry: dict, T: int, elem: int = 2) -> dict:
    """Counted forward FLOPs and bytes of each NSA stage and of causal SDPA, batch 1. FLOPs are model FLOPs (the keys
    each query may see; causal SDPA the lower triangle, as a flash kernel computes it). `bytes` is each tensor read or
    written once (the roofline's floor); `bytes_query_order` (selected) is what a query-centric kernel moves when each
    (query, KV head) loads its n*l' keys and values itself: their reuse across queries then lives in L2, and the
    branch's arithmetic intensity is G FLOPs per byte (FLOPs 4*G*hd, bytes 2*hd*elem per key and query group);
    `bytes_block_order` what the block-centric kernels (G < 16) move: q read once per slot, and each (row, slot)
    partial (output in the inputs' dtype, fp32 log-sum-exp) written and read back by the merge, keys and values read once per tile
    (about once)."""
    from nsa.flops import mean_capped_keys, mean_compressed_keys, n_compressed_blocks

    H, H_kv, hd = layout["n_heads"], layout["n_kv_heads"], layout["head_dim"]
    l, d, l_sel, n, w = (geometry[k] for k in ("l", "d", "l_sel", "n_sel", "w"))
    C = n_compressed_blocks(l, d, T)
    q_bytes, kv_bytes, idx_bytes = T * H * hd * elem, T * H_kv * hd * elem, T * H_kv * n * 8
    per_key = 4 * H * hd * T  # q·k and p·v for every query head, per key each query sees
    phi_weights = (l * hd * hd + hd * hd + l * hd) * 4  # float32 master weights of one phi
    return {
        "compress": {"flops": 2 * C * H_kv * 2 * (l * hd * hd + hd * hd),  # phi_K and phi_V: W1 then W2 per token
                     "bytes": 2 * kv_bytes + 2 * C * H_kv * hd * (elem + 4) + 2 * phi_weights},  # + the fp32 a
        "compressed": {"flops": per_key * mean_compressed_keys(l, d, T),
                       "bytes": 2 * q_bytes + 2 * C * H_kv * hd * elem + T * H * 4},
        "select": {"flops": per_key / 2 * mean_compressed_keys(l, d, T),
                   "bytes": q_bytes + C * H_kv * hd * elem + idx_bytes},
        "selected": {"flops": per_key * mean_capped_keys(n * l_sel, T),
                     "bytes": 2 * q_bytes + 2 * kv_bytes + idx_bytes + T * H * 4,
                     "bytes_query_order": 2 * q_bytes + T * H_kv * min(n * l_sel, T) * 2 * hd * elem + idx_bytes,
                     "bytes_block_order": (n + 1) * q_bytes + 2 * kv_bytes + idx_bytes + 2 * T * H * n * (hd * elem + 4)},
        "window": {"flops": per_key * mean_capped_keys(w, T), "bytes": 2 * q_bytes + 2 * kv_bytes},
        "sdpa": {"flops": per_key * (T + 1) / 2, "bytes": 2 * q_bytes + 2 * kv_bytes},
    }


def roofline_fraction(cost: dict, ms: float, ceil: dict | None, bytes_key: str = "bytes") -> float | None:
    """The least time the stage's counted FLOPs and bytes (`bytes_key`: the floor, or what one design moves) take at
    the measured ceilings, over the time measured."""
    if not ceil or not ms:
        return None
    ideal_s = max(cost["flops"] / ceil["bf16_matmul_flops_per_s"], cost[bytes_key] / ceil["copy_bytes_per_s"])
    return float(f"{ideal_s * 1e3 / ms:.3g}")


def selected_order(G: int) -> str:
    """The bytes key of the order the selected-attention kernels run for a group of G query heads per KV head."""
    from nsa.attention.kernels.selected_attention import use_block_centric

    return "bytes_block_order" if use_block_centric(G) else "bytes_query_order"


def attention(args, ceil: dict | None, record=lambda partial: None) -> dict:
    """record(section so far) after the busy-fraction step and after each row: a call killed at the device's time
    limit keeps the rows it finished (`partial: true` until the section ends)."""
    import torch
    import torch.nn.functional as F

    from nsa.attention import ops

    layouts, geometry = (TINY_LAYOUTS, TINY_GEOMETRY) if args.tiny else (LAYOUTS, NSA_GEOMETRY)
    Ss = args.S or ([96, 160] if args.tiny else [8192, 16384, 32768, 65536])
    repeats = 1 if args.tiny else 10  # tiny: the plumbing, one timed call each
    # first the whole layer at the shortest length (the busy-fraction goal: cheap, and kept if a later row is cut)
    busy = layer_busy(args, layouts["m7c"], geometry, Ss[0])
    rows = []
    record({"ok": True, "partial": True, "rows": rows, "busy": busy})
    dtype = torch.bfloat16
    flex = flex_causal(args.device)
    fla = fla_arm()
    variants = [(name, layout, geometry) for name, layout in layouts.items()]
    if not args.tiny:
        variants.append(("paper_fla_geometry", LAYOUTS["paper"], FLA_GEOMETRY))
    for (name, layout, geo), T in ((v, T) for v in variants for T in Ss):
        B, H, H_kv, hd = 1, layout["n_heads"], layout["n_kv_heads"], layout["head_dim"]
        row = {"layout": name, "T": T, **layout, **geo}
        layer = nsa_layer(layout, geo, "auto", T, args.device, dtype, 0)  # the Triton kernels on CUDA, torch on CPU
        g = torch.Generator(device=args.device).manual_seed(T)
        rnd = lambda *shape: torch.randn(*shape, device=args.device, dtype=dtype, generator=g)  # noqa: E731
        q = rnd(B, H, T, hd)
        br = {b: (rnd(B, H_kv, T, hd), rnd(B, H_kv, T, hd)) for b in ("cmp", "sel", "win")}
        gates = torch.rand(B, T, H, 3, device=args.device, dtype=dtype, generator=g)
        rope = rope_for(hd, T, args.device)
        leaves = [q, gates, *[t for pair in br.values() for t in pair]]

        def nsa_fwd():
            return ops.gated_combine(gates, *layer.sparse_attention(q, br, rope)[:3], layer.cfg.kernel)

        def sdpa_fwd():
            return F.scaled_dot_product_attention(q, br["sel"][0], br["sel"][1], is_causal=True, enable_gqa=True)

        arms = {"nsa": nsa_fwd, "sdpa": sdpa_fwd}
        aux = {}  # arm -> its extra loss terms (the indexer's KL), differentiated with the output
        if name == "m7c" and "indexer" in args.arms:  # issue 51: the learned indexer's share of the layer's time
            x = rnd(B, T, layout["n_heads"] * hd)
            for arm, extra in INDEXER_ARMS.items():
                indexed = nsa_layer(layout, {**geo, **extra}, "auto", T, args.device, dtype, 0)
                indexed.train()
                arms[arm] = (lambda m: lambda: ops.gated_combine(
                    gates, *m.sparse_attention(q, br, rope, x)[:3], m.cfg.kernel))(indexed)
                aux[arm] = (lambda m: lambda: m.indexer_loss)(indexed)
        if flex is not None and "flex" in args.arms:
            arms["flex"] = lambda: flex(q, br["sel"][0], br["sel"][1])
        if fla is not None and "fla" in args.arms and name.startswith("paper") and (H // H_kv) >= 16:
            arms["fla"] = lambda: fla(q, br["sel"][0], br["sel"][1], gates, layer, T)
        for arm, fwd in arms.items():
            try:
                row[f"{arm}_fwd_ms"] = time_ms(lambda: fwd(), args.device, repeats)  # noqa: B023
                if arm == "flex" and args.device != "cuda":
                    continue  # FlexAttention has no backward on CPU
                row[f"{arm}_fwd_bwd_ms"] = time_ms(lambda: fwd_bwd(fwd, leaves, aux.get(arm)), args.device,  # noqa: B023
                                                   repeats)
            except Exception as exc:  # one arm's failure (memory at 64k, a missing kernel) must not lose the rest
                row[f"{arm}_error"] = f"{type(exc).__name__}: {exc}"[:300]
                torch.cuda.empty_cache() if args.device == "cuda" else None
        if args.device == "cuda":
            row["sdpa_backend"] = sdpa_backend(q, br["sel"][0], br["sel"][1])
        row["stages"] = stages(layer, q, br, rope, layout, geo, T, args.device, repeats, ceil, ops)
        for arm in ("sdpa", "flex", "fla"):
            for what in ("fwd", "fwd_bwd"):
                if f"{arm}_{what}_ms" in row and f"nsa_{what}_ms" in row:
                    row[f"nsa_over_{arm}_{what}"] = round(row[f"{arm}_{what}_ms"] / row[f"nsa_{what}_ms"], 3)
        for arm in INDEXER_ARMS:  # the indexer's time over pooled NSA's, as a share of pooled NSA's (its KL included)
            if f"{arm}_fwd_bwd_ms" in row and "nsa_fwd_bwd_ms" in row:
                row[f"{arm}_extra_fwd_bwd"] = round(row[f"{arm}_fwd_bwd_ms"] / row["nsa_fwd_bwd_ms"] - 1, 3)
        print(json.dumps({k: v for k, v in row.items() if k != "stages"}), flush=True)
        rows.append(row)
        record({"ok": True, "partial": True, "rows": rows, "busy": busy})
        del layer, q, br, gates, leaves
    if "device_ms" in busy:  # CUDA: the busy step replayed as a graph, after the rows
        busy.update(layer_graphed(args, layouts["m7c"], geometry, busy))
    return {"ok": True, "rows": rows, "busy": busy}


def fwd_bwd(fwd, leaves, aux=None) -> None:
    """One forward and backward of fwd's output (aux: a function returning the forward's extra loss terms, e.g. the
    indexer's KL terms, differentiated with it as the model's sum of them would be)."""
    import torch

    for t in leaves:
        t.requires_grad_(True)
        t.grad = None
    out = fwd()
    if aux is None:
        out.backward(out.detach())  # a fixed, nonzero output gradient without another launch
    else:
        terms = aux()
        torch.autograd.backward([out, terms], [out.detach(), torch.ones_like(terms)])
    for t in leaves:
        t.requires_grad_(False)


def stages(layer, q, br, rope, layout, geo, T, device, repeats, ceil, ops) -> dict:
    """Each stage of the NSA core alone, forward (selection has no backward), on the inputs the layer gives it."""
    import torch

    from nsa.attention.impl.compression import num_compressed
    from nsa.attention.kernels.select_topk import fused_select_blocks

    c = layer.cfg
    B, H_kv, G, hd = q.shape[0], layer.n_kv_heads, layer.n_groups, layer.head_dim
    phis = (layer.compress_k.weights(), layer.compress_v.weights())
    with torch.no_grad():
        count = num_compressed(T, c.l, c.d)
        ck, cv = ops.compress_blocks(*br["cmp"], *phis, 0, count, c.l, c.d, c.kernel)
        qg = q.view(B, H_kv, G, T, hd)
        # as the layer calls them: the compressed branch returns its log-sum-exps, selection reuses them (Eq. 8)
        lse = ops.compressed_attention(q, ck, cv, 0, c.l, c.d, c.q_chunk, c.kernel, return_lse=True)[1].view(
            B, H_kv, G, T)
        idx = ops.select_blocks(qg, ck, 0, c.l, c.d, c.l_sel, c.n_sel, c.q_chunk, c.kernel, lse=lse)
    calls = {
        "compress": lambda: ops.compress_blocks(*br["cmp"], *phis, 0, count, c.l, c.d, c.kernel),  # phi_K and phi_V
        "compressed": lambda: ops.compressed_attention(q, ck, cv, 0, c.l, c.d, c.q_chunk, c.kernel, return_lse=True),
        "select": lambda: ops.select_blocks(qg, ck, 0, c.l, c.d, c.l_sel, c.n_sel, c.q_chunk, c.kernel, lse=lse),
        # the one-launch kernel the layer used before the two-launch selection (kernels/select_two_pass.py), timed
        # beside it: which design is faster on this GPU (docs/BENCHMARKS.md predicts the two launches)
        "select_fused": lambda: fused_select_blocks(qg, ck, 0, c.l, c.d, c.l_sel, c.n_sel, lse=lse),
        "selected": lambda: ops.selected_attention(qg, *br["sel"], idx, 0, c.l_sel, c.sel_tile, kernel=c.kernel,
                                                   chunk=c.sel_chunk),
        "window": lambda: ops.window_attention(q, *br["win"], 0, 0, c.w, c.win_block, c.kernel),
    }
    costs = stage_costs(layout, geo, T)
    costs["select_fused"] = costs["select"]
    out = {}
    with torch.no_grad():
        for name, call in calls.items():
            ms = time_ms(call, device, repeats)
            out[name] = {"fwd_ms": ms}
            if name in costs:
                out[name].update(**costs[name], roofline_fraction=roofline_fraction(costs[name], ms, ceil))
        # the selected branch against the bytes its own order moves too (block order: each (row, slot) partial
        # written and read back; query order: each query's n*l' keys loaded): no G = 6 kernel in block order can
        # beat that floor, which is 4.6x the ideal at M7C's 64k (docs/BENCHMARKS.md "Pick coherence")
        order = selected_order(G)
        out["selected"].update(order=order, roofline_fraction_as_built=roofline_fraction(
            costs["selected"], out["selected"]["fwd_ms"], ceil, order))
        # the share of (query, KV head) rows whose picks differ between the two designs (bf16 near ties only)
        out["select_fused"]["rows_differing"] = (calls["select_fused"]() != idx).any(-1).double().mean().item()
    unfolded = layout == LAYOUTS["m7c"] and T in UNFOLDED_AT or layout == TINY_LAYOUTS["m7c"]
    out.update(stage_backward(q, br, phis, count, ck, cv, idx, c, T, device, repeats, ops, unfolded))
    return out


def stage_backward(q, br, phis, count: int, ck, cv, idx, c, T: int, device: str, repeats: int, ops,
                   unfolded: bool) -> dict:
    """Each differentiable stage forward + backward on fresh leaves: phi (both compressors, its weights' gradients
    too), the compressed branch, selected attention (the picks given) and the window (FlexAttention's backward on
    CUDA for the two dense branches, the torch path's on a CPU). The compressed branch also with its queries not
    folded into batch rows where `unfolded` (impl/flex.py fold_count; M7C's layout at UNFOLDED_AT, each a compile of
    its own): the second GPU session's profile put 6.2 ms of a 32k layer in those two backwards, 8.6x their
    forwards."""
    from nsa.attention.impl import flex

    B, H_kv, G, hd = q.shape[0], br["sel"][0].shape[1], q.shape[1] // br["sel"][0].shape[1], q.shape[-1]
    qq, *kv = (t.detach().clone() for t in (q, *br["cmp"], ck, cv, *br["sel"], *br["win"]))
    raw_k, raw_v, ck, cv, sel_k, sel_v, win_k, win_v = kv  # fresh leaves (the stages' compressed keys and values too)
    calls = {  # stage -> (forward, its leaves)
        "compress": (lambda: sum(ops.compress_blocks(raw_k, raw_v, *phis, 0, count, c.l, c.d, c.kernel)),
                     [raw_k, raw_v]),
        # with its log-sum-exps, as the layer calls it: the layer's compiled FlexAttention graph serves (no compile)
        "compressed": (lambda: ops.compressed_attention(qq, ck, cv, 0, c.l, c.d, c.q_chunk, c.kernel,
                                                        return_lse=True)[0], [qq, ck, cv]),
        "selected": (lambda: ops.selected_attention(qq.view(B, H_kv, G, T, hd), sel_k, sel_v, idx, 0, c.l_sel,
                                                    c.sel_tile, kernel=c.kernel, chunk=c.sel_chunk), [qq, sel_k, sel_v]),
        "window": (lambda: ops.window_attention(qq, win_k, win_v, 0, 0, c.w, c.win_block, c.kernel), [qq, win_k, win_v]),
    }
    out, saved = {}, flex.FOLD_QUERIES
    arms = [(name, saved) for name in calls] + ([("compressed_unfolded", 0)] if unfolded else [])
    for name, fold in arms:
        fwd, leaves = calls[name.split("_")[0]]
        flex.FOLD_QUERIES = fold
        try:
            out[f"{name}_fwd_bwd"] = {"fwd_bwd_ms": time_ms(lambda: fwd_bwd(fwd, leaves), device, repeats)}  # noqa: B023
            if name.startswith("compressed"):
                out[f"{name}_fwd_bwd"]["folds"] = flex.fold_count(T)
        except Exception as exc:  # one stage's failure must not lose the stages timed before it
            out[f"{name}_fwd_bwd"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        finally:
            flex.FOLD_QUERIES = saved
    return out


def flex_causal(device: str):
    """FlexAttention causal with GQA, compiled on CUDA (eager elsewhere: it runs, unfused), or None."""
    try:
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    masks = {}
    compiled = torch.compile(flex_attention, dynamic=False) if device == "cuda" else flex_attention

    def call(q, k, v):
        T = q.shape[2]
        if T not in masks:
            masks[T] = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, T, T, device=q.device)
        return compiled(q, k, v, block_mask=masks[T], enable_gqa=True)

    return call


def fla_arm():
    """fla's parallel_nsa (compressed + selected, mean-pooled, l = d = l' = 64) plus this project's window op (fla's
    own window branch needs flash-attn), or None when fla does not import."""
    try:
        from fla.ops.nsa import parallel_nsa
    except Exception:
        return None
    from nsa.attention import ops

    def call(q, k, v, gates, layer, T):
        c = layer.cfg
        o = parallel_nsa(*(t.transpose(1, 2).contiguous() for t in (q, k, v)),  # fla's [B, T, H, hd]
                         g_cmp=gates[..., 0].contiguous(), g_slc=gates[..., 1].contiguous(), g_swa=None, block_counts=c.n_sel,
                         block_size=64, window_size=0).transpose(1, 2)  # [B, H, T, hd]
        o_win = ops.window_attention(q, k, v, 0, 0, c.w, c.win_block, c.kernel)
        return o + gates[..., 2].transpose(1, 2).unsqueeze(-1) * o_win

    return call


def layer_step(args, layout: dict, geometry: dict, T: int):
    """The whole NSA layer (projections included) forward+backward at T, bf16 autocast as the trainer runs it:
    step(cache_casts=True). Autocast's cast cache must be off inside a graph capture (PyTorch's docs)."""
    import torch

    layer = nsa_layer(layout, geometry, "auto", T, args.device, torch.float32, 0)
    x = torch.randn(1, T, layer.q_proj.in_features, device=args.device, requires_grad=True)
    rope = rope_for(layout["head_dim"], T, args.device)

    def step(cache_casts: bool = True):
        with torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16, cache_enabled=cache_casts):
            y = layer(x, rope)
        y.float().square().mean().backward()

    return step


def layer_busy(args, layout: dict, geometry: dict, T: int) -> dict:
    """The layer step (layer_step): wall per step (10 steps, one sync), host time to issue a step, and under the
    profiler the device-busy time and the number of kernels. busy_fraction = device time / wall: < 1 where the GPU
    waits for the host."""
    import torch

    from nsa.custom_op import through_dispatcher

    step = layer_step(args, layout, geometry, T)
    for _ in range(0 if args.tiny else 2):  # warm-up on the GPU only (time_ms)
        step()
    n = 1 if args.tiny else 10
    host_ms, wall_ms = issue_and_wall_ms(step, n, args.device)
    out = {"T": T, "wall_ms": round(wall_ms, 3), "host_issue_ms": round(host_ms, 3)}
    with through_dispatcher():  # the same steps with every nsa:: op call as before nsa/custom_op.py's direct path
        host_d, wall_d = issue_and_wall_ms(step, n, args.device)
    out.update(wall_ms_dispatched=round(wall_d, 3), host_issue_ms_dispatched=round(host_d, 3))
    # what a CPU counts for the same layer (nsa/launch_count.py, the meta device: each op one launch, a custom op
    # one), beside the kernels the profiler sees below (autocast's weight casts and the loss's ops included there)
    from nsa.launch_count import attention_layer_launches

    out["ops_counted_on_cpu"] = attention_layer_launches(model_config(layout, geometry, "auto", T), T).total
    if args.device == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        device_ms = sum(e.device_time for e in kernels) / 1e3
        out.update(device_ms=round(device_ms, 3), kernels=len(kernels), busy_fraction=round(device_ms / wall_ms, 3))
    return out


def issue_and_wall_ms(step, n: int, device: str) -> tuple[float, float]:
    """(ms to issue a step, wall ms per step) over n steps after a sync: issuing has no sync inside."""
    sync(device)
    t = time.perf_counter()
    for _ in range(n):
        step()
    host_ms = (time.perf_counter() - t) * 1e3 / n
    sync(device)
    return host_ms, (time.perf_counter() - t) * 1e3 / n


def layer_graphed(args, layout: dict, geometry: dict, busy: dict) -> dict:
    """The layer step of `busy` (layer_busy's, CUDA) captured once as a CUDA graph and replayed: what is left when
    the host issues nothing (busy_fraction_graphed: the eager step's kernel time over the replay's wall). Run last in
    the attention section, so that a capture that fails cannot touch the rows measured before it."""
    step = layer_step(args, layout, geometry, busy["T"])
    try:
        graphed_ms = graphed_step_ms(lambda: step(cache_casts=False), 10)
    except Exception as exc:  # a capture failure must not lose the eager numbers
        return {"graphed_error": f"{type(exc).__name__}: {exc}"[:300]}
    return {"graphed_wall_ms": round(graphed_ms, 3),
            "busy_fraction_graphed": round(min(1.0, busy["device_ms"] / graphed_ms), 3)}


def graphed_step_ms(step, n: int) -> float:
    """Wall ms per replay of `step` (a forward + backward) captured as one CUDA graph, as PyTorch's whole-network
    capture does it: warm-up on a side stream (compiles, caches, the allocator's blocks), the gradients then
    allocated inside the capture (replays overwrite them), n replays timed after one."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3 / n


def _acceptance():
    """bench/gpu_acceptance.py as a module: its M7C and Qwen3 training runs, heartbeat parsing."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_acceptance", REPO / "bench" / "gpu_acceptance.py")
    acceptance = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(acceptance)
    return acceptance


def mfu(args) -> dict:
    """The dense ~1B Qwen3-style model's MFU, compiled on CUDA (bench/gpu_acceptance.py's dense_1b_mfu run: 12 layers,
    seq 2048, batch 4, 12 steps on synthetic tokens; the trainer's own MFU from the GPU's bf16 peak). Eager on a CPU
    (--tiny: the plumbing). Summary key dense_1b_mfu_compiled (a fraction: 0.45 = 45%, the seeds' plan)."""
    compiled = args.device == "cuda"
    run_args = argparse.Namespace(tiny=args.tiny, device=args.device, full=compiled, limit=args.section_limit)
    return {**_acceptance().dense_1b_mfu(run_args), "compiled": compiled}


def train(args) -> dict:
    import tempfile

    acceptance = _acceptance()

    from nsa.flops import flops_per_token
    from train.core.config import load_config

    seqs = args.train_S or ([128] if args.tiny else [2048, 8192, 32768])  # issue 50's three lengths
    compile_ = args.device == "cuda"
    graphs = [False, True] if args.train_graphs and compile_ else [False]  # CUDA graphs need CUDA and compile
    runs = {}
    with tempfile.TemporaryDirectory(prefix="gpu_nsa_speed_") as tmp:
        tmp = Path(tmp)
        for seq in seqs:
            flops = {}
            for graphed in graphs:
                for kind in ("nsa", "dense"):
                    cfg_path = acceptance._train_config(tmp, kind, seq, args.tiny, steps=12)
                    flops[kind] = flops_per_token(load_config(cfg_path).model, seq).flops_per_token
                    name = f"{kind}_{seq}" + ("_graphs" if graphed else "")
                    code, text = acceptance.run(
                        [sys.executable, "-m", "train", str(cfg_path), f"--train.out_dir={tmp / name}",
                         f"--runtime.device={args.device}", f"--runtime.compile={str(compile_).lower()}",
                         f"--runtime.cuda_graphs={str(graphed).lower()}", "--runtime.precision=bf16"],
                        args.section_limit)
                    runs[name] = ({**acceptance._tokens_per_s(tmp / name), "flops_per_token": flops[kind]}
                                  if code == 0 else {"exit": code, "output": text[-800:]})
            runs[f"ideal_{seq}"] = round(flops["dense"] / flops["nsa"], 3)
    ok = all("toks_per_s" in r for k, r in runs.items() if not k.startswith("ideal"))
    return {"ok": ok, "compiled": compile_, "cuda_graphs": len(graphs) > 1, "runs": runs}


def decode(args) -> dict:
    """The whole M7C model's decode step over static caches (bench/bench_decode_model.py: NSA and its dense twin,
    eager, CUDA graphs, compiled + graphs; checked against a full forward first), then one attention layer's step over
    the growing caches (bench/bench_decode.py, batch 1: the second GPU session's measurement, for comparison)."""
    Ss = args.decode_S or ([96, 160] if args.tiny else [32768, 65536])
    env = _acceptance().child_env()
    out = {"ok": True}
    model_cmd = [sys.executable, "bench/bench_decode_model.py", "--S", *map(str, Ss), "--device", args.device]
    model_cmd += ["--tiny"] if args.tiny else []
    layer_cmd = [sys.executable, "bench/bench_decode.py", "--S", *map(str, Ss), "--dim", "768", "--heads", "12",
                 "--kv_heads", "2", "--head_dim", "64", "--device", args.device, "--dtype", "bf16"]
    layer_cmd += ["--quick", "--prefill_tile", "128"] if args.tiny else []
    for part, cmd, limit in (("model", model_cmd, args.decode_limit), ("layer", layer_cmd, args.section_limit)):
        try:
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=limit, env=env)
        except subprocess.TimeoutExpired as exc:
            out[part] = {"ok": False, "error": f"timed out after {limit} s",
                         "output": (exc.stdout or b"")[-1500:].decode(errors="replace")
                         if isinstance(exc.stdout, bytes) else (exc.stdout or "")[-1500:]}
            out["ok"] = False
            continue
        if proc.returncode:
            out[part] = {"ok": False, "exit": proc.returncode, "output": (proc.stdout + proc.stderr)[-1500:]}
            out["ok"] = False
            continue
        out[part] = {"ok": True, **json.loads(proc.stdout.strip().splitlines()[-1])}
    out["scope"] = ("model: the whole M7C-125M step over static caches (nsa/static_decode.py), random caches of S "
                    "positions, batch 1 and 16; layer: one attention layer, batch 1, growing caches, no CUDA graphs")
    return out


# ---------------------------------------------------------------- summary and the results file
def length_tag(T: int) -> str:
    return f"{T // 1024}k" if T >= 1024 and T % 1024 == 0 else str(T)


def summarise(sections: dict) -> dict:
    """The ratios docs/BENCHMARKS.md quotes (NSA's speed over the other's: > 1 is NSA faster; the indexer arms'
    extra time over pooled NSA's, a fraction of it: issue 51's goal is <= 0.15 at 32k)."""
    s = {}
    for row in sections.get("attention", {}).get("rows", []):
        tag = length_tag(row["T"])
        for arm in INDEXER_ARMS:
            if f"{arm}_extra_fwd_bwd" in row:
                s[f"{row['layout']}_{arm}_extra_fwd_bwd_{tag}"] = row[f"{arm}_extra_fwd_bwd"]
        for arm in ("sdpa", "flex", "fla"):
            for what in ("fwd_bwd", "fwd"):
                if f"nsa_over_{arm}_{what}" in row:
                    s[f"{row['layout']}_nsa_over_{arm}_{what}_{tag}"] = row[f"nsa_over_{arm}_{what}"]
        selected = row.get("stages", {}).get("selected", {})  # issue 50's goal: >= 0.4 at 64k (M7C)
        for key in ("roofline_fraction", "roofline_fraction_as_built"):
            if selected.get(key) is not None:
                s[f"{row['layout']}_selected_fwd_{key}_{tag}"] = selected[key]
    fla = [v for k, v in s.items() if k.startswith("paper_nsa_over_fla_fwd_bwd_")]
    if fla:
        s["paper_nsa_over_fla_fwd_bwd_min"] = min(fla)
    busy = sections.get("attention", {}).get("busy", {})
    if "busy_fraction" in busy:
        s[f"gpu_busy_fraction_{length_tag(busy['T'])}"] = busy["busy_fraction"]
    if "busy_fraction_graphed" in busy:  # the layer's step replayed as a CUDA graph (no host work between kernels)
        s[f"gpu_busy_fraction_{length_tag(busy['T'])}_graphed"] = busy["busy_fraction_graphed"]
    runs = sections.get("train", {}).get("runs", {})
    for key, r in runs.items():  # nsa_<seq> and nsa_<seq>_graphs against dense's run of the same kind
        if key.startswith("nsa_") and "toks_per_s" in r and "toks_per_s" in runs.get("dense_" + key[4:], {}):
            seq, _, graphed = key[4:].partition("_")
            s[f"train_nsa_over_dense_{length_tag(int(seq))}" + (f"_{graphed}" if graphed else "")] = round(
                r["toks_per_s"] / runs["dense_" + key[4:]]["toks_per_s"], 3)
    decode_ = sections.get("decode", {})
    for key, v in decode_.get("layer", {}).get("summary", {}).items():  # one layer, growing caches, eager
        if key.startswith("speedup_"):
            s[f"decode_layer_nsa_over_dense_{length_tag(int(key[8:]))}_b1"] = v
    for key, v in decode_.get("model", {}).get("summary", {}).items():  # the goal's: the whole model, CUDA graphs
        if key.startswith("decode_nsa_over_dense_"):
            s[key] = v
    if sections.get("mfu", {}).get("compiled") and sections["mfu"].get("mfu") is not None:
        s["dense_1b_mfu_compiled"] = sections["mfu"]["mfu"]
    return s


def results_path(out: Path, device_name: str) -> Path:
    from nsa.flops import match_device

    card = (match_device(device_name) or device_name or "cpu").lower().replace(" ", "_")
    return out / f"gpu_nsa_speed_{card}_{datetime.date.today().isoformat()}.json"


def save(path: Path, report: dict) -> None:
    """Merge into what an earlier call wrote to the same file (its other sections kept), atomically."""
    old = json.loads(path.read_text()) if path.exists() else {}
    sections = {**old.get("sections", {}), **report["sections"]}
    merged = {**old, **report, "sections": sections, "summary": {**old.get("summary", {}), **summarise(sections)}}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(merged, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def triton_interpreter_active() -> bool:
    try:
        from nsa.attention.kernels.interpreter import interpreter_active
    except ImportError:
        return False
    return interpreter_active()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="directory of the results JSON")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: the plumbing on CPU")
    ap.add_argument("--only", nargs="+", choices=SECTIONS, help="these sections (default: all)")
    ap.add_argument("--S", type=int, nargs="+", help="attention lengths (default 8k 16k 32k 64k)")
    ap.add_argument("--train_S", type=int, nargs="+", help="training sequence lengths (default 2048 8192 32768)")
    ap.add_argument("--decode_S", type=int, nargs="+", help="decode context lengths (default 32k 64k)")
    ap.add_argument("--train_graphs", action="store_true",
                    help="train: also run NSA and dense with CUDA graphs (runtime.cuda_graphs; CUDA only)")
    ap.add_argument("--arms", nargs="+", default=["flex", "fla", "indexer"], choices=["flex", "fla", "indexer"],
                    help="beside NSA and SDPA in the attention section (default all): FlexAttention, fla's NSA, and "
                         "NSA with the learned indexer (issue 51; M7C's layout)")
    ap.add_argument("--section_limit", type=float, default=300, help="seconds for one training or decode run")
    ap.add_argument("--decode_limit", type=float, default=420,
                    help="seconds for the whole-model decode run (it compiles each model at two shapes)")
    args = ap.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no CUDA device (use --device cpu --tiny for the plumbing)",
              file=sys.stderr)
        return 2
    if args.device == "cpu" and not triton_interpreter_active():
        print("error: --device cpu runs the Triton kernels in Triton's interpreter: set TRITON_INTERPRET=1",
              file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    path = results_path(args.out, name)
    header = {"bench": "gpu_nsa_speed", "device": name, "date": datetime.date.today().isoformat(),
              "torch": torch.__version__, "tiny": args.tiny}
    ceil = json.loads(path.read_text())["sections"].get("ceilings") if path.exists() else None
    ok = True
    for section in args.only or SECTIONS:
        t0 = time.time()
        try:
            if section == "attention":
                result = attention(args, ceil, lambda partial: save(path, {**header, "sections": {section: partial}}))
            elif section == "ceilings":
                result = ceil = ceilings(args)
            else:
                result = globals()[section](args)
        except Exception as exc:  # one section's failure must not lose the others' numbers
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:1000]}
        result["seconds"] = round(time.time() - t0, 1)
        ok = ok and result.get("ok", True)
        save(path, {**header, "sections": {section: result}})
        state = "ok" if result.get("ok", True) else f"FAILED {result.get('error', '')}".rstrip()
        print(f"[gpu_nsa_speed] {section}: {state} ({result['seconds']} s)", flush=True)
    print(json.dumps({"results": str(path), "summary": json.loads(path.read_text())["summary"]}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
