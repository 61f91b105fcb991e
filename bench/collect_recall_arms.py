"""Collect the recall probes and gate health of finished runs into one JSON (docs/NSA.md, "Measured 2026-11-27").

    PYTHONPATH=. .venv/bin/python bench/collect_recall_arms.py --arm dense=RUN_DIR --arm nsa=RUN_DIR ... \
        [--gate_steps 100 500 1000 2000 5000] [--what "..."] [--json bench/results/recall_w8_arms.json]

Per arm: every `recall_step<N>[_without_<branches>][_x<M>][_<rope>][_nsel<K>][_cap<D>].json` in its run directory
(train.recall score, with or without --knockout, at --lengths M, with a RoPE option, with --n_sel K, with
--distance_cap D), as step, tokens (step x the run's tokens per step), knockout, length multiple, RoPE option
(scalelength, thetantk, scaleyarn or none), n_sel (picks at scoring time; None: as trained), distance_cap (None: as
trained), near / far accuracy, far
stderr and accuracy per bucket; and, for NSA runs, the gate health of the heartbeat's train records at --gate_steps
(mean gate per branch and layer, sel_outside_window, sel_recall per layer, and for nsa.selector=indexer the indexer's
KL). Nothing is computed here that the
runs did not record. Prints the JSON; --json also writes it.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import yaml

from train.core.artifacts import CONFIG_YAML, heartbeat_name, read_heartbeat

RECALL_FILE = re.compile(
    r"recall_step(\d+)(?:_without_([a-z_]+?))?(?:_x(\d+))?(?:_((?:scale|theta)[a-z]+))?(?:_nsel(\d+))?(?:_cap(\d+))?"
    r"\.json$")
GATE_KEYS = ("gate_mean_cmp_layers", "gate_mean_sel_layers", "gate_mean_win_layers", "sel_outside_window",
             "sel_recall_layers", "indexer_kl")


def probes(run: Path, tokens_per_step: int) -> list[dict]:
    out = []
    for path in run.glob("recall_step*.json"):
        match = RECALL_FILE.match(path.name)
        if not match:
            continue
        r = json.loads(path.read_text(encoding="utf-8"))
        out.append({"step": r["step"], "tokens": r["step"] * tokens_per_step, "knockout": r.get("knockout", []),
                    "length_multiple": r.get("length_multiple", 1), "rope": match.group(4),
                    "n_sel": r.get("n_sel"),  # picks per query at scoring time (None: as trained)
                    "distance_cap": r.get("distance_cap"),  # the selected branch's distance cap (None: none)
                    "near_accuracy": r["near_accuracy"], "far_accuracy": r["far_accuracy"],
                    "far_stderr": r["far_stderr"], "far_items": r["far_items"], "documents": r["documents"],
                    "probe_seed": r.get("seed"),
                    "buckets": {name: b["accuracy"] for name, b in r["buckets"].items()}})
    return sorted(out, key=lambda p: (p["step"], len(p["knockout"]), p["knockout"], p["rope"] or "", p["n_sel"] or 0,
                                      p["distance_cap"] or 0, p["length_multiple"]))


def gates(run: Path, steps: set[int]) -> list[dict]:
    records = [r for r in read_heartbeat(run / heartbeat_name(0)) if r.get("kind") == "train" and r["step"] in steps]
    return [{"step": r["step"], "loss": r.get("loss"), **{k: r[k] for k in GATE_KEYS if k in r}} for r in records]


def collect(arms: dict[str, Path], gate_steps: set[int]) -> dict:
    out = {}
    for name, run in arms.items():
        cfg = yaml.safe_load((run / CONFIG_YAML).read_text(encoding="utf-8"))
        per_step = cfg["train"]["batch_size"] * cfg["train"]["seq_len"] * cfg["train"]["accumulate_grad_batches"]
        nsa = (cfg.get("nsa") or {}) if cfg["model"]["attention"] == "nsa" else None
        arm = {"run": str(run), "seed": cfg["train"]["seed"], "attention": cfg["model"]["attention"],
               "gates": (cfg.get("nsa") or {}).get("gates"), "selector": nsa.get("selector", "pooled") if nsa else None,
               "probes": probes(run, per_step)}
        if cfg["model"]["attention"] == "nsa":
            arm["gate_health"] = gates(run, gate_steps)
        out[name] = arm
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arm", action="append", required=True, help="NAME=RUN_DIR (repeatable)")
    ap.add_argument("--gate_steps", type=int, nargs="+", default=[100, 500, 1000, 2000, 5000])
    ap.add_argument("--what", default="")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    arms = dict((name, Path(path)) for name, _, path in (a.partition("=") for a in args.arm))
    result = {"what": args.what, "arms": collect(arms, set(args.gate_steps))}
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
