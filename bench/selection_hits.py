"""Does NSA's selection pick the block that holds the fact? Measured on the recall probe, at multiples of the training
length (issue 43: which part fails when recall does not extrapolate).

    PYTHONPATH=. python bench/selection_hits.py CKPT_OR_RUN [--lengths 1 2 4 8] [--documents 64] [--n_sel K] [--out FILE.json]

For every query of the probe documents (train/data/recall.py, the checkpoint's recall corpus, RecallSpec.at_length),
the token that predicts the answer's first token selects n_sel blocks of l_sel keys per KV head (nsa/attention: block
numbers counted from the document's first token). A hit: the block of the fact's value token is among them, for at
least one KV head (any_head) or for each KV head (per_head: the share of heads). Reported per distance bucket and layer,
with the blocks the selection always takes (block 0, the query's own block and the one before) counted apart: a
fact in one of those is no test of the free picks.

--n_sel K: select K blocks per query at inference instead of the trained n_sel (K - 3 free picks instead of n_sel - 3):
the free-hit rate is then the share of facts whose block the selector ranks among its top K - 3 candidates (how far
from the one free pick a miss is); the model is otherwise unchanged.
"""
from __future__ import annotations

import argparse
import json
import random
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from nsa.gate_health import selected_blocks
from train.checkpoint.io import load_checkpoint, model_from_checkpoint, resolve_checkpoint
from train.data.recall import RecallEncoder, bucket_name, probe_document
from train.data.tokenizers import load_tokenizer
from train.evaluation.recall import PROBE_SEED, corpus_spec


def capture_selection(model) -> list[list]:
    """Each NSA layer's forward returns its selected blocks too; returns the per-layer lists they are appended to."""
    captured = []
    for blk in model.blocks:
        layer = blk.attn
        if not hasattr(layer, "branches") or layer.cfg.window_only:
            continue
        store: list = []
        captured.append(store)
        original = layer.forward

        def forward(x, rope=None, cache=None, return_indices=False, documents=None, _orig=original, _store=store):
            y, idx = _orig(x, rope, cache, True, documents)
            _store.append(idx)  # [B, H_kv, T, n]
            return (y, idx) if return_indices else y

        layer.forward = forward
    return captured


@torch.inference_mode()
def hits_at(checkpoint: Path, multiple: int, documents: int, seed: int, n_sel: int | None = None) -> dict:
    spec = corpus_spec(checkpoint).at_length(multiple)
    stored = load_checkpoint(checkpoint)["config"]
    model, cfg = model_from_checkpoint(checkpoint, "cpu", max_seq_len=max(stored["model"]["max_seq_len"],
                                                                          spec.doc_tokens + 1))
    l_sel = model.cfg.nsa.l_sel
    layers = capture_selection(model)
    tok = load_tokenizer(cfg["data"]["tokenizer"])
    rng = random.Random(seed)
    docs = [probe_document(rng, spec, RecallEncoder(tok, spec.format)) for _ in range(documents)]
    buckets = spec.buckets()
    edges = np.asarray([lo for lo, _ in buckets[1:]])
    names = [bucket_name(lo, hi, spec.window) for lo, hi in buckets]
    # (layer, bucket) -> [any-head hits, items, head-share sum, forced, any-head hits among the free, free items]
    tally = defaultdict(lambda: [0, 0, 0.0, 0, 0, 0])
    with selected_blocks(model, n_sel):  # an inference-time change of the picks' count (module docstring)
        for doc in docs:
            x = torch.full((1, len(doc.ids) + 1), tok.eos_id, dtype=torch.long)
            x[0, 1:] = torch.from_numpy(doc.ids)
            for store in layers:
                store.clear()
            model(x)
            answer = doc.answer_start + 1  # x positions of each answer's first token
            query = answer - 1  # the position whose output predicts it
            fact_block = (answer - doc.distance - 1) // l_sel  # the fact's value token, in document blocks
            query_block = (query - 1) // l_sel
            which = np.searchsorted(edges, doc.distance, side="right")
            for layer, store in enumerate(layers):
                picks = store[0][0][:, torch.from_numpy(query)]  # [H_kv, q, n]
                hit = (picks == torch.from_numpy(fact_block)[None, :, None]).any(-1)  # [H_kv, q]
                forced = (fact_block == 0) | (fact_block >= query_block - 1)  # [q]
                for i, b in enumerate(which):
                    t = tally[(layer, names[b])]
                    t[0] += int(hit[:, i].any())
                    t[1] += 1
                    t[2] += float(hit[:, i].float().mean())
                    t[3] += int(forced[i])
                    if not forced[i]:
                        t[4] += int(hit[:, i].any())
                        t[5] += 1
    out = {}
    for (layer, name), (any_hits, items, share, forced, free_hits, free) in sorted(tally.items()):
        out.setdefault(f"layer{layer}", {})[name] = {
            "items": items, "any_head": any_hits / items, "per_head": share / items, "forced_share": forced / items,
            "free_items": free, "free_any_head": free_hits / free if free else None}
    return {"length_multiple": multiple, "doc_tokens": spec.doc_tokens, "n_sel": n_sel or model.cfg.nsa.n_sel,
            "n_sel_trained": model.cfg.nsa.n_sel, "l_sel": l_sel,
            "by_layer": out}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--lengths", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--documents", type=int, default=64)
    p.add_argument("--seed", type=int, default=PROBE_SEED)
    p.add_argument("--n_sel", type=int, default=None, help="blocks selected per query at inference (default: trained)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    path = resolve_checkpoint(args.checkpoint).resolve()
    result = {"checkpoint": str(path), "documents": args.documents, "seed": args.seed,
              "lengths": {str(m): hits_at(path, m, args.documents, args.seed, args.n_sel) for m in args.lengths}}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
