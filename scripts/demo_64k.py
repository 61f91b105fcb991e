"""Long-context NSA inference demo: tiled prefill of S tokens, then cached decode steps.

    .venv/bin/python scripts/demo_64k.py                                  # M7C-125M shape, S = 65536
    .venv/bin/python scripts/demo_64k.py --S 2048 --layers 2 --dim 128    # small, CPU friendly

    .venv/bin/python scripts/demo_64k.py --checkpoint RUN_DIR --S 8192    # a trained model: cost and quality

With --checkpoint, a trained model (file or run directory; its positions extended to S when it uses RoPE) is timed,
and its recall accuracy (its recall corpus's probe at S / training length, train.recall score --lengths) and needle
accuracy (word-level tokenizers, the needle test at S) are reported beside the timing. Without it, random weights
(this measures cost, not quality). Defaults are the M7C-125M shape: dim 768, 12 layers,
12 query heads, 2 KV heads, head_dim 64, vocab 50304, SwiGLU ffn 2048, NSA paper defaults
(l=32, d=16, l'=64, n=16, w=512). Prints per-step time and keys read per step (NSA vs a dense KV
cache at the same context), optionally times a dense model too, and ends with one JSON line.
reads_total = keys read by all decode steps over all layers (one query per step and layer).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


from nsa.config import ModelConfig
from nsa.model import Transformer


def build(args, attention: str) -> Transformer:
    cfg = ModelConfig(
        vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.kv_heads,
        head_dim=args.head_dim, ffn_dim=args.ffn_dim, max_seq_len=args.S + args.decode_steps + 1,
        rope_scale=args.rope_scale, attention=attention, attn_backend="flash" if args.use_fa2 else "sdpa",
    )
    torch.manual_seed(0)
    return Transformer(cfg).to(device=args.device, dtype=args.dtype).eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def run(model: Transformer, ids: torch.Tensor, args, label: str) -> dict:
    caches = model.new_caches()
    S = args.S
    t0 = time.perf_counter()
    for a in range(0, S, args.prefill_tile):
        logits = model(ids[:, a : min(a + args.prefill_tile, S)], start_pos=a, caches=caches)
    sync(args.device)
    prefill_s = time.perf_counter() - t0
    print(f"[{label}] prefill {S} tokens in tiles of {args.prefill_tile}: {prefill_s:.2f} s", flush=True)
    token = logits[:, -1:].argmax(-1)  # greedy
    step_ms, reads, dense_reads = [], 0, 0
    for i in range(args.decode_steps):
        t = time.perf_counter()
        logits = model(token, start_pos=S + i, caches=caches)
        token = logits[:, -1:].argmax(-1)
        sync(args.device)
        step_ms.append((time.perf_counter() - t) * 1e3)
        if hasattr(caches[0], "reads_per_step"):
            r = sum(c.reads_per_step() for c in caches)
            d = sum(c.dense_reads_per_step() for c in caches)
        else:  # dense KV cache: every key so far, per layer
            r = d = sum(c.length for c in caches)
        reads, dense_reads = reads + r, dense_reads + d
        print(f"[{label}] step {i:3d}  context {S + i + 1:7d}  {step_ms[-1]:8.2f} ms  reads/step {r // len(caches):7d} "
              f"(dense {d // len(caches)})", flush=True)
    return {"prefill_s": round(prefill_s, 3), "decode_ms_per_step": round(statistics.median(step_ms), 3),
            "reads_total": reads, "dense_reads_total": dense_reads,
            "reads_per_step": reads // max(1, args.decode_steps * len(caches))}


def trained(args) -> int:
    """--checkpoint: time the trained model at S, then score its recall (a recall corpus) and needle (a word-level
    tokenizer) at S; one JSON line. Bad input: one error line, exit 2."""
    from train.checkpoint.io import load_checkpoint, model_from_checkpoint, resolve_checkpoint
    from train.core.errors import UserError, print_error
    from train.evaluation.needle import BYTE_TOKENIZER, needle_checkpoint
    from train.evaluation.recall import corpus_spec, probe_checkpoint

    try:
        path = resolve_checkpoint(Path(args.checkpoint)).resolve()
        stored = load_checkpoint(path)["config"]
        need = args.S + args.decode_steps + 1
        overrides = {"max_seq_len": need} if stored["model"].get("pos_emb", "rope") == "rope" else {}
        model, cfg = model_from_checkpoint(path, args.device, **overrides)
        if need > model.cfg.max_seq_len:
            raise UserError(f"--S {args.S}: the checkpoint's learned positions end at {model.cfg.max_seq_len}")
        model = model.to(dtype=args.dtype)
        ids = torch.randint(0, model.cfg.vocab_size, (1, args.S), device=args.device)
        result = {"S": args.S, "checkpoint": str(path), "attention": model.cfg.attention, "device": args.device,
                  "training_length": stored["train"]["seq_len"], "timing": run(model, ids, args, model.cfg.attention)}
        try:
            spec = corpus_spec(path)
        except UserError:
            spec = None
        if spec is not None:
            multiple = args.S // (spec.doc_tokens + 1)
            if multiple >= 1:
                probe = probe_checkpoint(path, documents=args.recall_documents, length=multiple, device=args.device)
                result["recall"] = {"length_multiple": multiple, "far_accuracy": probe["far_accuracy"],
                                    "near_accuracy": probe["near_accuracy"],
                                    "buckets": {b: v["accuracy"] for b, v in probe["buckets"].items()},
                                    "file": probe["file"]}
        if cfg["data"]["tokenizer"] != BYTE_TOKENIZER:
            needle = needle_checkpoint(path, S=args.S, trials=args.needle_trials, device=args.device)
            result["needle"] = {"mean_accuracy": needle["mean_accuracy"], "file": needle["file"]}
    except UserError as exc:
        print_error(exc)
        return 2
    print(json.dumps(result))
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--S", type=int, default=65536, help="prompt length (prefilled)")
    ap.add_argument("--prefill_tile", type=int, default=4096)
    ap.add_argument("--rope_scale", type=float, default=1.0, help="RoPE position interpolation factor (>= 1)")
    ap.add_argument("--decode_steps", type=int, default=16)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv_heads", type=int, default=2)
    ap.add_argument("--head_dim", type=int, default=64)
    ap.add_argument("--ffn_dim", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--use_fa2", type=int, nargs="?", const=1, default=0, choices=[0, 1],
                    help="1 (or bare --use_fa2): the dense baseline uses flash-attn when importable on CUDA (the guide's --use_fa2 1)")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda")
    ap.add_argument("--dense_baseline", type=int, default=0, choices=[0, 1], help="also time a dense model")
    ap.add_argument("--checkpoint", default=None, help="a trained checkpoint (file or run directory) instead of random "
                    "weights: its recall and needle accuracy at S are reported beside the timing")
    ap.add_argument("--recall_documents", type=int, default=32, help="with --checkpoint: recall probe documents")
    ap.add_argument("--needle_trials", type=int, default=2, help="with --checkpoint: needle trials per depth")
    args = ap.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    print(f"device {args.device}, dtype {args.dtype}, threads {torch.get_num_threads()}", flush=True)
    if args.use_fa2 and not args.device.startswith("cuda"):
        print("note: --use_fa2 1 has no effect on CPU: flash-attn runs only on CUDA (the dense baseline uses SDPA)",
              flush=True)

    if args.checkpoint is not None:
        sys.exit(trained(args))
    ids = torch.randint(0, args.vocab, (1, args.S), device=args.device)
    result = {"S": args.S, "layers": args.layers, "dim": args.dim, "device": args.device,
              "threads": torch.get_num_threads(), "nsa": run(build(args, "nsa"), ids, args, "nsa")}
    if args.dense_baseline:
        dense = run(build(args, "dense"), ids, args, "dense")
        result["dense"] = dense
        result["decode_speedup"] = round(dense["decode_ms_per_step"] / result["nsa"]["decode_ms_per_step"], 2)
    result["reads_total"] = result["nsa"]["reads_total"]
    result["dense_reads_total"] = result["nsa"]["dense_reads_total"]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
