"""Launches of one attention layer, forward + backward, per sequence length (nsa/launch_count.py): NSA vs the dense
layer, M7C-125M shapes (dim 768, 12 heads, 2 KV heads, head dim 64; NSA l=32 d=16 l'=64 n=16 w=512), batch 1.

    TRITON_INTERPRET=1 .venv/bin/python bench/bench_launches.py [--T 2048 8192 32768 65536] [--triton-T 256] [--json FILE]

Two counts per NSA layer:
  ops       ATen ops and custom ops dispatched, counted on the meta device (a custom op counts once);
  triton    the Triton path a CUDA run takes, counted on CPU in Triton's interpreter: the selection, RoPE and gated-sum
            ops opened, their index-building ATen ops and every Triton kernel they launch counted (the compressed and
            window branches stay one op per direction: FlexAttention on CUDA, whose backward has no CPU path). The
            interpreter is slow, so this count runs at --triton-T tokens (constant in T:
            tests/nsa/test_launch_count_triton.py). It needs TRITON_INTERPRET=1 in the environment (Triton reads it
            when the kernels are defined); without it the count is reported as skipped. Also taken with 4 packed
            documents, and under bf16 autocast (how the trainer runs a GPU: the weights' casts are launches too),
            beside the dense layer's count under autocast.
Also the layer with nsa.selector=indexer (issue 51; its KL term's backward counted: nsa/launch_count.py), and one
whole-model decode step over static caches (nsa/static_decode.py; per layer and per step, NSA fused / unfused, dense).
Prints a markdown table (docs/BENCHMARKS.md) and one JSON line.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json

import torch

from nsa.config import ModelConfig, NSAConfig
from nsa.launch_count import TRITON, attention_layer_launches

M7C = dict(dim=768, n_heads=12, n_kv_heads=2, head_dim=64)


def triton_path(nsa: ModelConfig, T: int, documents: int = 0, autocast: bool = False) -> dict:
    """The Triton path's count (module docstring), or why it could not be taken. documents > 0: a packed window of
    that many documents; autocast: under bf16 autocast, as the trainer runs a GPU (its weight casts counted too)."""
    try:
        from nsa.attention.kernels.selected_attention import interpreter_active
    except ImportError as exc:
        return {"skipped": f"triton is not importable ({exc})"}
    if not interpreter_active():
        return {"skipped": "Triton's interpreter is off: run with TRITON_INTERPRET=1"}
    cfg = dataclasses.replace(nsa, nsa=dataclasses.replace(nsa.nsa, kernel="triton"))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        count = attention_layer_launches(cfg, T, documents=documents, device="cpu", open_custom_ops=True)
    return {"T": T, "documents": documents, "autocast_bf16": autocast, "total": count.total,
            "triton_kernels": count.triton, "aten": count.total - count.triton,
            "by_op": dict(count.by_op.most_common()), "kernels": sorted(n[len(TRITON):] for n in count.by_op
                                                                        if n.startswith(TRITON))}


def decode_step_launches(max_len: int = 1024, at: int = 1000) -> dict:
    """Launches of one whole-model decode step over static caches (nsa/static_decode.py, eager, batch 1) on the Triton
    path (interpreter, custom ops opened): NSA with its branches as one kernel (fused) and as torch ops, and the dense
    twin; per layer (a 2-layer model's count minus a 1-layer model's) and per step besides (embedding, the position's
    slots and masks, head). A CUDA graph replays exactly these kernels."""
    from nsa.attention.kernels.selected_attention import interpreter_active
    from nsa.launch_count import LaunchCounter
    from nsa.model import Transformer
    from nsa.static_decode import StaticDecoder

    if not interpreter_active():
        return {"skipped": "Triton's interpreter is off: run with TRITON_INTERPRET=1"}
    out = {"max_len": max_len, "position": at}
    nsa = NSAConfig(l=32, d=16, l_sel=64, n_sel=16, w=512, kernel="triton")
    for arm, attention, fused in (("nsa_fused", "nsa", True), ("nsa_unfused", "nsa", False), ("dense", "dense", True)):
        totals = []
        for n_layers in (1, 2):
            torch.manual_seed(0)
            model = Transformer(ModelConfig(**M7C, vocab_size=512, n_layers=n_layers, max_seq_len=max_len,
                                            attention=attention, nsa=nsa)).eval()
            decoder = StaticDecoder(model, 1, max_len, graphs=False, fused=fused)
            decoder.pos.fill_(at)
            decoder.t = at
            with torch.no_grad(), LaunchCounter(open_custom_ops=True) as count:
                decoder.step(torch.zeros(1, dtype=torch.long))
            totals.append(count.total)
        out[arm] = {"per_layer": totals[1] - totals[0], "per_step_besides": 2 * totals[0] - totals[1]}
    return out


def decode_step_compiled(max_len: int = 1024, at: int = 1000) -> dict:
    """Kernels of one whole-model decode step compiled as the harness's `compiled_graphed` arm runs it
    (StaticDecoder(compile=True): the embedding, one block's graph for every block, the head), read from the wrapper
    code inductor generates for each graph (nsa.launch_count.wrapper_launches): its Triton kernels, library calls and
    custom ops, each custom op counted as what its body launches in the eager step at the same position. Inductor is
    told to write Triton for this CPU's tensors (`cpu_backend="triton"`), so its scheduler fuses as it does for a
    GPU; the kernels are generated, never run (`_triton_codegen_only`): the count is the code's, the values are not
    read. Per layer: the block graph's launches; per step besides: the embedding's and the head's."""
    import torch._dynamo
    from torch._inductor.utils import run_and_get_code

    from nsa.attention.kernels.selected_attention import interpreter_active
    from nsa.launch_count import LaunchCounter, wrapper_launches
    from nsa.model import Transformer
    from nsa.static_decode import StaticDecoder

    if not interpreter_active():
        return {"skipped": "Triton's interpreter is off: run with TRITON_INTERPRET=1"}
    out = {"max_len": max_len, "position": at, "scheduled_as": "triton (inductor's GPU code generation)"}
    nsa = NSAConfig(l=32, d=16, l_sel=64, n_sel=16, w=512, kernel="triton")
    for arm in ("nsa", "dense"):
        torch.manual_seed(0)
        model = Transformer(ModelConfig(**M7C, vocab_size=512, n_layers=1, max_seq_len=max_len, attention=arm,
                                        nsa=nsa)).eval()
        eager = StaticDecoder(model, 1, max_len, graphs=False)
        eager.pos.fill_(at)
        with torch.no_grad(), LaunchCounter(open_custom_ops=True) as opened:
            eager.step(torch.zeros(1, dtype=torch.long))
        decoder = StaticDecoder(model, 1, max_len, graphs=False, compile=True)
        decoder.pos.fill_(at)
        try:
            with torch.no_grad(), _triton_codegen_only():
                _, codes = run_and_get_code(decoder._step)  # (resets Dynamo: every graph compiles here)
        except Exception as exc:  # an inductor whose internals moved: say so, count nothing
            return {"skipped": f"inductor's Triton code generation for CPU tensors failed: {type(exc).__name__}: "
                               f"{str(exc).splitlines()[0][:200]}"}
        if len(codes) != 3:
            return {"skipped": f"expected 3 compiled graphs (embedding, block, head), got {len(codes)}"}
        embed, block, head = (wrapper_launches(code, opened.per_call()) for code in codes)
        out[arm] = {"per_layer": sum(block.values()), "per_step_besides": sum((embed + head).values()),
                    "per_layer_by_kind": dict(sorted(block.items()))}
    return out


@contextlib.contextmanager
def _triton_codegen_only():
    """Inside the block inductor writes Triton kernels for CPU tensors and never runs them: the scheduler's fusions are
    the GPU's (the C++ backend would write consecutive fused nodes into one function), and a launch returns at once
    (Triton's CPU interpreter cannot run every generated kernel: a 0-dim tensor passed as a scalar). Patched: the
    backend choice, the Triton hash that asks for an active GPU driver, the launcher's run; no cache read or written."""
    import torch._functorch.config
    import torch._inductor.codegen.triton as codegen_triton
    import torch._inductor.config
    import torch.utils._triton as utils_triton
    from torch._inductor.runtime import triton_heuristics

    patched = [(utils_triton, "triton_hash_with_backend", lambda: "cpu-codegen-only"),
               (triton_heuristics.CachingAutotuner, "run", lambda self, *args, **kwargs: None)]
    if hasattr(codegen_triton, "triton_hash_with_backend"):
        patched.append((codegen_triton, "triton_hash_with_backend", lambda: "cpu-codegen-only"))
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patched]
    for owner, name, value in patched:
        setattr(owner, name, value)
    try:
        with torch._inductor.config.patch(cpu_backend="triton", fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
        torch._dynamo.reset()  # no generated code that cannot run survives the block


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, nargs="+", default=[2048, 8192, 32768, 65536])
    ap.add_argument("--triton-T", type=int, default=256, help="tokens for the Triton path's count (0: skip it)")
    ap.add_argument("--json", help="also write the JSON here")
    ap.add_argument("--compiled", action="store_true", help="also the compiled decode step's kernels (inductor's "
                    "Triton code for this CPU's tensors, not run: ~1 minute)")
    args = ap.parse_args()
    nsa = ModelConfig(**M7C, attention="nsa", nsa=NSAConfig(l=32, d=16, l_sel=64, n_sel=16, w=512))
    dense = ModelConfig(**M7C)
    indexer = dataclasses.replace(nsa, nsa=dataclasses.replace(nsa.nsa, selector="indexer"))  # issue 51
    rows = [{"T": T, "nsa": attention_layer_launches(nsa, T).total, "dense": attention_layer_launches(dense, T).total,
             "nsa_indexer": attention_layer_launches(indexer, T).total} for T in args.T]
    print("| T | NSA layer ops (fwd+bwd) | dense layer ops | NSA / dense | NSA with the learned indexer |\n"
          "|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['T']:,} | {r['nsa']} | {r['dense']} | {r['nsa'] / r['dense']:.2f} | {r['nsa_indexer']} |")
    result = {"bench": "launches", "rows": rows}
    if args.triton_T:
        result["triton_path"] = path = triton_path(nsa, args.triton_T)
        if "skipped" in path:
            print(f"Triton path: skipped: {path['skipped']}")
        else:
            print(f"Triton path (T = {path['T']}): {path['total']} launches per layer fwd+bwd = {path['aten']} ATen ops"
                  f" + {path['triton_kernels']} Triton kernels ({', '.join(path['kernels'])})")
            result["triton_path_indexer"] = idx = triton_path(indexer, args.triton_T)
            print(f"  with nsa.selector=indexer (its KL term's backward counted): {idx['total']}")
            result["triton_path_documents"] = packed = triton_path(nsa, args.triton_T, documents=4)
            result["triton_path_indexer_documents"] = idx_packed = triton_path(indexer, args.triton_T, documents=4)
            result["triton_path_indexer_autocast"] = idx_amp = triton_path(indexer, args.triton_T, autocast=True)
            print(f"  with nsa.selector=indexer over 4 packed documents: {idx_packed['total']}; under bf16 autocast: "
                  f"{idx_amp['total']}")
            result["triton_path_autocast"] = amp = triton_path(nsa, args.triton_T, autocast=True)
            result["dense_cpu"] = attention_layer_launches(dense, args.triton_T, device="cpu").total
            with torch.autocast("cpu", dtype=torch.bfloat16):
                result["dense_cpu_autocast"] = attention_layer_launches(dense, args.triton_T, device="cpu").total
            print(f"  with 4 packed documents: {packed['total']}; under bf16 autocast: {amp['total']} (the dense layer "
                  f"on CPU tensors: {result['dense_cpu']}, {result['dense_cpu_autocast']} under autocast)")
    if args.triton_T:
        result["decode_step"] = step = decode_step_launches()
        if "skipped" not in step:
            print("decode step over static caches (eager; a CUDA graph replays these): "
                  + "; ".join(f"{arm} {step[arm]['per_layer']} per layer + {step[arm]['per_step_besides']}"
                              for arm in ("nsa_fused", "nsa_unfused", "dense")))
    if args.triton_T and args.compiled:
        result["decode_step_compiled"] = step = decode_step_compiled()
        if "skipped" not in step:
            print("decode step compiled (the harness's compiled + graphed arm; kernels a graph replays): "
                  + "; ".join(f"{arm} {step[arm]['per_layer']:g} per layer + {step[arm]['per_step_besides']:g}"
                              for arm in ("nsa", "dense")))
        else:
            print(f"decode step compiled: skipped: {step['skipped']}")
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
