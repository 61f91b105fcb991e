"""Needle in a haystack: can a checkpoint retrieve a fact planted at a given depth of a long context?

A haystack of filler sentences holds one needle ("The special magic number is 4821937.") at each depth; the
prompt ends with "... The special magic number is" and the model decodes greedily. A trial passes when the
decoded continuation is the number's tokens. Prefill runs in tiles with the model's decode caches (NSA or
dense). For word-level tokenizers (a byte model spells the number digit by digit and rarely starts there).
The command: scripts/needle.py; the twin comparison runs it with --needle_S.
"""
from __future__ import annotations

import random
import time

import torch

from train.core.errors import UserError

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
          "A river runs to the sea, and the sea does not fill. ")
NEEDLE = "The special magic number is {number}. "
QUESTION = "What is the special magic number? The special magic number is"
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


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


def run_needle(model, tok, *, S: int, depths=DEPTHS, trials: int = 5, seed: int = 0, prefill_tile: int = 2048,
               device: str = "cpu") -> dict:
    """Accuracy by depth at context length S: {"S", "results": [{"depth", "accuracy", "trials"}], "mean_accuracy",
    "seconds"}."""
    rng = random.Random(seed)
    results, started = [], time.perf_counter()
    for depth in depths:
        hits = 0
        for _ in range(trials):
            number = str(rng.randrange(1_000_000, 10_000_000))
            ids, _ = build_prompt(tok, S, depth, number)
            target = tok.encode_batch([" " + number])[0]
            hits += greedy_continue(model, ids, len(target), prefill_tile, device) == target
        results.append({"depth": depth, "accuracy": hits / trials, "trials": trials})
    return {"S": S, "results": results, "mean_accuracy": sum(r["accuracy"] for r in results) / len(results),
            "seconds": round(time.perf_counter() - started, 3)}
