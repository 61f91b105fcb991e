"""Do consecutive queries pick the same blocks? The design question of a query-tile selected-attention kernel (issue 50).

    PYTHONPATH=. python bench/pick_coherence.py RUN_OR_CKPT [--T 2048 8192] [--tiles 1 4 8 16 32] [--windows 4]
        [--out FILE.json]

The block-centric kernels (nsa/attention/kernels/block_centric.py, groups below 16) write one partial per (query
head, slot) and merge them: at M7C's 64k that is ~3.3 GB forward and ~6.4 GB for dQ (docs/BENCHMARKS.md). A kernel
whose program takes a tile of Q consecutive queries (Q x G rows) and loads the union of their picks once writes no
partial, but computes every row against every block of the union: it pays U(Q) / n times the useful work, where U(Q)
is the union's size. This measures U(Q) on a trained model's real picks (and on the same model at initialisation,
the baseline), per layer, over windows of the run's validation tokens, at lengths up to and beyond the training one.

Per (layer, T, Q): `union` (mean blocks in a tile's union, per KV head), `picks` (mean valid picks per query),
`sharing` = Q * picks / union (how many queries use each loaded block: Q when all pick alike, 1 when none share),
`work_ratio` = union / picks (the tile kernel's score work over the useful one), counted over tiles whose queries all
have n blocks to pick from (position >= n * l_sel), so the early, causally short rows do not flatter the numbers.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from train.checkpoint.io import load_checkpoint, model_from_checkpoint, resolve_checkpoint

REPO = Path(__file__).resolve().parents[1]


def union_sizes(idx: torch.Tensor, Q: int, first: int) -> tuple[float, float]:
    """idx [B, H_kv, T, n] (-1 = empty): mean union size of the picks of Q consecutive queries (tiles aligned to Q,
    from query `first` on) and mean valid picks per query over the same queries."""
    B, H, T, n = idx.shape
    start = -(-first // Q) * Q
    tiles = (T - start) // Q
    if tiles <= 0:
        return float("nan"), float("nan")
    part = idx[:, :, start:start + tiles * Q].reshape(B, H, tiles, Q * n)
    blocks = int(idx.max()) + 2  # column 0 collects the empty slots (-1 + 1)
    hit = torch.zeros(B, H, tiles, blocks, dtype=torch.bool)
    hit.scatter_(-1, part + 1, True)
    union = hit[..., 1:].sum(-1).double()  # [B, H, tiles]
    picks = (part >= 0).sum(-1).double() / Q
    return union.mean().item(), picks.mean().item()


@torch.inference_mode()
def measure(model, tokens: np.ndarray, Ts: list[int], tiles: list[int], windows: int, seed: int) -> dict:
    from selection_hits import capture_selection  # the sibling tool (bench/ is this script's sys.path[0])

    captured = capture_selection(model)
    attn = next(blk.attn for blk in model.blocks if hasattr(blk.attn, "branches"))
    c = attn.cfg
    rng = np.random.default_rng(seed)
    rows = []
    for T in Ts:
        starts = rng.integers(0, len(tokens) - T - 1, size=windows)
        x = torch.from_numpy(np.stack([tokens[s:s + T].astype(np.int64) for s in starts]))
        for store in captured:
            store.clear()
        model(x)
        for layer, store in enumerate(captured):
            idx = store[-1].cpu()  # [B, H_kv, T, n]
            for Q in tiles:
                union, picks = union_sizes(idx, Q, c.n_sel * c.l_sel)
                rows.append({"T": T, "windows": windows, "layer": layer, "Q": Q, "union": round(union, 2),
                             "picks": round(picks, 2),
                             "sharing": round(Q * picks / union, 2), "work_ratio": round(union / picks, 2)})
    return {"geometry": {"l_sel": c.l_sel, "n_sel": c.n_sel, "G": attn.n_groups}, "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", type=Path, help="a run directory or checkpoint of an NSA model")
    ap.add_argument("--T", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--tiles", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--windows", type=int, default=4, help="windows of the validation tokens per length")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    path = resolve_checkpoint(args.run)
    ckpt = load_checkpoint(path)
    stored, step = ckpt["config"], ckpt["step"]
    del ckpt
    source = stored["data"]["source"]
    if not source.startswith("bin:"):
        print(f"error: {path}: data.source {source!r} is not a prepared bin: directory", file=sys.stderr)
        return 2
    data_dir = Path(source[4:])
    data_dir = data_dir if data_dir.is_absolute() else REPO / data_dir
    dtype = json.loads((data_dir / "meta.json").read_text()).get("dtype", "uint16")
    tokens = np.memmap(data_dir / "val.bin", dtype=dtype, mode="r")
    longest = max(args.T)
    trained, cfg = model_from_checkpoint(path, "cpu", max_seq_len=max(stored["model"]["max_seq_len"], longest))
    torch.manual_seed(stored["train"].get("seed", 0))
    fresh = type(trained)(trained.cfg).eval()  # the same architecture at initialisation: the baseline
    report = {"checkpoint": str(path), "train_seq_len": stored["train"]["seq_len"], "step": step,
              "config": {k: stored[k] for k in ("model", "nsa", "train", "data") if k in stored},
              "trained": measure(trained, tokens, args.T, args.tiles, args.windows, args.seed),
              "initial": measure(fresh, tokens, args.T, args.tiles, args.windows, args.seed)}
    for kind in ("trained", "initial"):
        for r in report[kind]["rows"]:
            print(kind, json.dumps(r))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
