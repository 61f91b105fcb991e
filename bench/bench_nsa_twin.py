"""NSA against its dense twin: ablations run through python -m train.compare, collected into one table.

    .venv/bin/python bench/bench_nsa_twin.py [--config configs/nsa_twin_kjv.yaml] [--root artifacts/ablations]
        [--only NAME ...] [--collect] [--json FILE]

Each ablation is a name and config overrides. Ablations that differ only in nsa.* keys share one dense
twin, and those that differ only in nsa keys a window-only layer does not read share one window-only control:
an ablation passes every finished one under --root with the same non-nsa overrides to train.compare as
--reuse_from, which reuses each control arm (dense, window) that matches key by key and trains the others;
with none finished it trains its own. Every number comes from the comparisons' report.json
(train/analysis/compare_report.py; reports made before the window arm existed have no window numbers);
--collect only reads the directories already there. Prints a markdown table (docs/NSA.md) and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from train.analysis.compare_report import SHARES

REPO = Path(__file__).resolve().parents[1]
ABLATIONS: dict[str, list[str]] = {
    "baseline": ["--nsa.gate_init=equal"],  # the default until 2026-11-24 (now window; docs/NSA.md)
    # gate_bias pinned: the default was 2 until b = 4 was measured at 4x (docs/NSA.md), 4 since
    "gate_window": ["--nsa.gate_init=window", "--nsa.gate_bias=2"],
    "w256": ["--nsa.gate_init=equal", "--nsa.w=256"],
    "n16": ["--nsa.gate_init=equal", "--nsa.n_sel=16"],
    "no_aux_decay": ["--nsa.gate_init=equal", "--nsa.aux_decay=false"],
    "gate_window_w256": ["--nsa.gate_init=window", "--nsa.gate_bias=2", "--nsa.w=256"],
    # the window init with b = 4: cmp and sel start at 0.018, the window at 0.982
    "gate_window_b4": ["--nsa.gate_init=window", "--nsa.gate_bias=4"],
    "gate_window_b4_seed8": ["--nsa.gate_init=window", "--nsa.gate_bias=4", "--train.seed=8"],
    # sliding-window attention alone inside the same model: cmp and sel start at sigmoid(-12) = 6e-6 and their
    # gates barely train (gate MLP and phi at 1e-6 x lr): what NSA at b = 4 owes to its far-reaching branches.
    # History: every comparison now has this control as its window arm (nsa.gates: window, gates pinned)
    "window_only": ["--nsa.gate_init=window", "--nsa.gate_bias=12", "--nsa.aux_lr_scale=1e-6"],
    # 3x the learning rate on the gate MLP and phi (their own schedule, same shape)
    "gate_window_aux_lr3": ["--nsa.gate_init=window", "--nsa.gate_bias=2", "--nsa.aux_lr_scale=3"],
    # the dense limit in training: the window branch sees every earlier key (w >= seq_len)
    "gate_window_w1024": ["--nsa.gate_init=window", "--nsa.gate_bias=2", "--nsa.w=1024"],
    # 4x the token budget (the schedule stretched to 1200 steps)
    "gate_window_4x": ["--nsa.gate_init=window", "--nsa.gate_bias=2", "--train.steps=1200"],
    "baseline_4x": ["--nsa.gate_init=equal", "--train.steps=1200"],
    "gate_window_b4_4x": ["--nsa.gate_init=window", "--nsa.gate_bias=4", "--train.steps=1200"],
    # a second seed: the spread between seeds is the yardstick for a gap
    "gate_window_seed8": ["--nsa.gate_init=window", "--nsa.gate_bias=2", "--train.seed=8"],
    "baseline_seed8": ["--nsa.gate_init=equal", "--train.seed=8"],
}


def twin_overrides(overrides: list[str]) -> list[str]:
    """The overrides the dense twin sees: all but nsa.* ones."""
    return sorted(o for o in overrides if not o.startswith("--nsa."))


def reuse_sources(root: Path, name: str) -> list[str]:
    """--reuse_from every finished ablation sharing this one's dense twin (train.compare reuses the control arms
    that match, the first match per arm), or nothing (train them here)."""
    args = []
    for other, overrides in ABLATIONS.items():
        if other != name and twin_overrides(overrides) == twin_overrides(ABLATIONS[name]) \
                and (root / other / "report.json").is_file():
            args += ["--reuse_from", str(root / other)]
    return args


def run(config: str, root: Path, name: str, overrides: list[str]) -> int:
    out = root / name
    if (out / "report.json").is_file():
        print(f"{name}: done ({out / 'report.json'})", flush=True)
        return 0
    cmd = [sys.executable, "-m", "train.compare", config, "--out", str(out), *overrides, *reuse_sources(root, name)]
    print("$", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=REPO).returncode


def row(name: str, overrides: list[str], report: dict) -> dict:
    arms = report["arms"]
    return {
        "name": name, "overrides": overrides, "tokens": arms["nsa"]["tokens_seen"],
        "nsa_loss": arms["nsa"]["eval"]["loss"], "dense_loss": arms["dense"]["eval"]["loss"],
        "gap_pct": report["gap_pct"], "nsa_bits_per_byte": arms["nsa"]["eval"]["bits_per_byte"],
        "dense_bits_per_byte": arms["dense"]["eval"]["bits_per_byte"], "eval_tokens": arms["nsa"]["eval"]["tokens"],
        "nsa_params": arms["nsa"]["params"], "dense_params": arms["dense"]["params"],
        "gate_shares_end": {k: report["nsa"]["over_time"][-1].get(k) for k in SHARES}
        if report["nsa"]["over_time"] else None,
        "dense_out_dir": arms["dense"]["out_dir"], "verdict": report["verdict"],
        # the window-only control (absent from reports made before it existed)
        "window_loss": arms["window"]["eval"]["loss"] if "window" in arms else None,
        "gap_window_pct": report.get("gap_window_pct"),
        "window_out_dir": arms["window"]["out_dir"] if "window" in arms else None,
    }


def table(rows: list[dict]) -> str:
    lines = ["| ablation | overrides | tokens | NSA loss | dense loss | gap | NSA bits/byte | gates cmp/sel/win at end |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        g = r["gate_shares_end"] or {}
        shares = "/".join(f"{g[k]:.2f}" for k in SHARES if g.get(k) is not None)
        lines.append(f"| {r['name']} | {' '.join(r['overrides']) or '-'} | {r['tokens']:,} | {r['nsa_loss']:.4f} | "
                     f"{r['dense_loss']:.4f} | {r['gap_pct']:+.2f}% | {r['nsa_bits_per_byte']:.4f} | {shares} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/nsa_twin_kjv.yaml")
    ap.add_argument("--root", type=Path, default=Path("artifacts/ablations"))
    ap.add_argument("--only", nargs="+", choices=sorted(ABLATIONS), help="these ablations (default: all)")
    ap.add_argument("--collect", action="store_true", help="only read the reports already under --root")
    ap.add_argument("--json", help="also write the JSON here")
    args = ap.parse_args()
    names = args.only or list(ABLATIONS)
    if not args.collect:
        for name in names:
            if run(args.config, args.root, name, ABLATIONS[name]) != 0:
                sys.exit(f"error: ablation {name} failed (see {args.root / name / 'logs'})")
    rows = []
    for name in names:
        path = args.root / name / "report.json"
        if path.is_file():
            rows.append(row(name, ABLATIONS[name], json.loads(path.read_text(encoding="utf-8"))))
    result = {"config": args.config, "root": str(args.root), "ablations": rows}
    print(table(rows))
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
