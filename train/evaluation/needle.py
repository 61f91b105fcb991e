"""Needle in a haystack: can a checkpoint retrieve a fact planted at a given depth of a long context?

A haystack of filler sentences holds one needle ("The special magic number is 4821937.") at each depth; the
prompt ends with "... The special magic number is" and the model decodes greedily. A trial passes when the
decoded continuation is the number's tokens. Prefill runs in tiles with the model's decode caches (NSA or
dense). For word-level tokenizers (a byte model spells the number digit by digit and rarely starts there).
The command: scripts/needle.py; the twin comparison (train.compare --needle 1,2,4) runs `needle_checkpoint` on
every arm at those multiples of its training length, each result written beside the checkpoint.
"""
from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch

from train.checkpoint.io import load_checkpoint, model_from_checkpoint, resolve_checkpoint
from train.core.errors import UserError
from train.data.tokenizers import load_tokenizer
from train.evaluation.evaluate import pick_device
from train.observe.telemetry import write_json_atomic

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
          "A river runs to the sea, and the sea does not fill. ")
NEEDLE = "The special magic number is {number}. "
QUESTION = "What is the special magic number? The special magic number is"
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
TRIALS = 5  # per depth
BYTE_TOKENIZER = "byte"  # the test means nothing for it (see the module docstring)


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


def run_needle(model, tok, *, S: int, depths=DEPTHS, trials: int = TRIALS, seed: int = 0, prefill_tile: int = 2048,
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


def result_name(step: int, S: int) -> str:
    return f"needle_step{step}_S{S}.json"


def refuse_byte_tokenizer(tokenizer: str, where: str) -> None:
    if tokenizer == BYTE_TOKENIZER:
        raise UserError(f"{where}: the needle test needs a word-level tokenizer; data.tokenizer is {tokenizer!r} "
                        "(a byte model spells the number digit by digit)")


def needle_checkpoint(checkpoint, *, S: int, trials: int = TRIALS, depths=DEPTHS, seed: int = 0, device: str = "auto",
                      prefill_tile: int = 2048) -> dict:
    """run_needle on a checkpoint (file or run directory) at context length S; the result (with checkpoint, step,
    attention, trials, depths, seed) is written to needle_step<N>_S<S>.json beside the checkpoint. An earlier
    file of the same checkpoint and settings is returned instead of decoding again."""
    if trials < 1:
        raise UserError(f"needle: trials must be >= 1, got {trials}")
    path = resolve_checkpoint(Path(checkpoint)).resolve()
    step = load_checkpoint(path)["step"]
    done = path.parent / result_name(step, S)
    settings = {"checkpoint": str(path), "S": S, "trials": trials, "depths": [float(d) for d in depths], "seed": seed}
    if done.exists():
        try:
            prior = json.loads(done.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            prior = {}
        if {k: prior.get(k) for k in settings} == settings:
            return prior
    dev = pick_device(device)
    model, cfg = model_from_checkpoint(path, str(dev))
    refuse_byte_tokenizer(cfg["data"]["tokenizer"], str(checkpoint))
    if S > model.cfg.max_seq_len and model.cfg.pos_emb != "rope":
        raise UserError(f"needle at S={S}: the model's learned positions end at max_seq_len {model.cfg.max_seq_len}")
    result = run_needle(model, load_tokenizer(cfg["data"]["tokenizer"]), S=S, depths=settings["depths"],
                        trials=trials, seed=seed, prefill_tile=prefill_tile, device=str(dev))
    result.update(settings, tool="needle", step=step, attention=cfg["model"]["attention"],
                  train_seq_len=cfg["train"]["seq_len"], file=str(done))
    write_json_atomic(done, result)
    return result
