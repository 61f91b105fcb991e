"""NSA against its dense twin: ablations run through python -m train.compare, collected into one table.

    .venv/bin/python bench/bench_nsa_twin.py [--config configs/nsa_twin_kjv.yaml] [--root artifacts/ablations]
        [--only NAME ...] [--collect] [--json FILE]

Each ablation is a name and config overrides. `baseline` trains both arms; an ablation that changes only
nsa.* keys reuses the baseline's dense arm (--dense_from), one that changes anything else trains its own
twin. Every number comes from the comparisons' report.json (train/compare_report.py); --collect only
reads the directories already there. Prints a markdown table (docs/NSA.md) and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from train.compare_report import SHARES

REPO = Path(__file__).resolve().parents[1]
ABLATIONS: dict[str, list[str]] = {
    "baseline": [],
    "gate_window": ["--nsa.gate_init=window"],
    "w256": ["--nsa.w=256"],
    "n16": ["--nsa.n_sel=16"],
    "no_aux_decay": ["--nsa.aux_decay=false"],
    "gate_window_w256": ["--nsa.gate_init=window", "--nsa.w=256"],
}


def run(config: str, root: Path, name: str, overrides: list[str]) -> int:
    out = root / name
    reuse = [] if name == "baseline" or any(not o.startswith("--nsa.") for o in overrides) else \
        ["--dense_from", str(root / "baseline")]
    cmd = [sys.executable, "-m", "train.compare", config, "--out", str(out), *overrides, *reuse]
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
        for name in (["baseline"] if "baseline" not in names else []) + names:
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
