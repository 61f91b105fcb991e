"""Needle in a haystack: can a trained checkpoint retrieve a fact planted at a given depth?

    python scripts/needle.py artifacts/m7c_125m/latest.pt --S 8192 --depths 0,0.25,0.5,0.75,1 --trials 5

A haystack of filler sentences holds one needle ("The special magic number is 4821937.") at each
depth; the prompt ends with "... The special magic number is" and the model decodes greedily.
A trial passes when the decoded continuation starts with the number. Prints one JSON object with
accuracy by depth. Prefill runs in tiles with the model's decode caches (NSA or dense).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch


from train.checkpoint.io import model_from_checkpoint
from train.data.tokenizers import load_tokenizer
from train.core.errors import UserError

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
          "A river runs to the sea, and the sea does not fill. ")
NEEDLE = "The special magic number is {number}. "
QUESTION = "What is the special magic number? The special magic number is"


def build_prompt(tok, S: int, depth: float, number: str, filler: str = FILLER) -> tuple[list[int], int]:
    """-> (token ids of length <= S, index of the needle's first token)."""
    needle = tok.encode_batch([NEEDLE.format(number=number)])[0]
    question = tok.encode_batch([QUESTION])[0]
    filler_ids = tok.encode_batch([filler])[0]
    budget = S - len(needle) - len(question)
    if budget < 0:
        raise UserError(f"--S {S} is too short for the needle and the question")
    hay = (filler_ids * (budget // len(filler_ids) + 1))[:budget]
    at = int(round(depth * budget))
    return hay[:at] + needle + hay[at:] + question, at


@torch.inference_mode()
def greedy_continue(model, ids: list[int], n_new: int, tile: int, device: str) -> list[int]:
    caches = model.new_caches()
    x = torch.tensor([ids], device=device)
    logits = None
    for start in range(0, x.shape[1], tile):
        logits = model(x[:, start:start + tile], start_pos=start, caches=caches)
    out, pos = [], x.shape[1]
    for _ in range(n_new):
        nxt = int(logits[0, -1].argmax())
        out.append(nxt)
        logits = model(torch.tensor([[nxt]], device=device), start_pos=pos, caches=caches)
        pos += 1
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ckpt", type=Path)
    p.add_argument("--S", type=int, default=8192, help="context length in tokens")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1.0")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--prefill_tile", type=int, default=2048)
    p.add_argument("--rope_scale", type=float, default=None, help="override the checkpoint's model.rope_scale")
    p.add_argument("--tokenizer", default=None, help="default: the checkpoint's data.tokenizer")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        overrides = {"rope_scale": args.rope_scale} if args.rope_scale else {}
        model, cfg = model_from_checkpoint(args.ckpt, args.device, **overrides)
        tok = load_tokenizer(args.tokenizer or cfg["data"]["tokenizer"])
        depths = [float(d) for d in args.depths.split(",")]
        rng = random.Random(args.seed)
        results, t0 = [], time.perf_counter()
        for depth in depths:
            hits = 0
            for _ in range(args.trials):
                number = str(rng.randrange(1_000_000, 10_000_000))
                ids, _ = build_prompt(tok, args.S, depth, number)
                target = tok.encode_batch([" " + number])[0]
                got = greedy_continue(model, ids, len(target), args.prefill_tile, args.device)
                hits += got == target
            results.append({"depth": depth, "accuracy": hits / args.trials, "trials": args.trials})
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(json.dumps({"checkpoint": str(args.ckpt), "S": args.S, "attention": cfg["model"]["attention"],
                      "rope_scale": model.cfg.rope_scale, "results": results,
                      "mean_accuracy": sum(r["accuracy"] for r in results) / len(results),
                      "seconds": round(time.perf_counter() - t0, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
