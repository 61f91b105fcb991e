"""A/B-compare two training configurations: step time, tokens/s and peak memory.

    python scripts/profiler_comparison.py --steps 100 --warmup 10                       # NSA vs dense (showcase)
    python scripts/profiler_comparison.py --a configs/m7c_125m_40g.yaml --b configs/m7c_125m_40g.yaml \\
        --b-args "--runtime.gradient_checkpointing=1" --common-args "--data.source=synthetic"
    torchrun --nproc_per_node=2 scripts/profiler_comparison.py ... --a-args "--runtime.ddp_compress=bf16"

Each variant trains for --steps steps (the first --warmup excluded from the averages) in a fresh
temporary out_dir through the normal trainer, so every optimisation is measured as it runs in
production. Prints a table and, with --json, one JSON object.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
import tempfile
from pathlib import Path


from train.core.artifacts import TRAIN_CSV, read_csv
from train.core.config import load_config
from train.core.env import launch_ranks
from train.trainer.runner import run_training


def interval_totals(rows: list[dict], warmup: int) -> dict:
    """training.csv rows -> totals over the intervals that end after `warmup` steps.

    Each row covers the steps since the previous row: dt_step_s x steps seconds, and the tokens_seen
    difference in tokens. Rates are total tokens / total time (averaging per-interval rates would
    weight short and long intervals alike, so step time and tokens/s would disagree).
    """
    prev_step, prev_tokens = 0, 0
    steps = seconds = tokens = fetch = 0.0
    for r in rows:
        step, seen = int(r["step"]), int(float(r["tokens_seen"]))
        n = step - prev_step
        if step > warmup and n > 0:
            steps += n
            seconds += float(r["dt_step_s"]) * n
            fetch += float(r["dt_fetch_s"]) * n
            tokens += seen - prev_tokens
        prev_step, prev_tokens = step, seen
    if not steps:
        raise SystemExit(f"error: no log interval after --warmup={warmup}")
    return {"steps": int(steps), "seconds": seconds, "tokens": int(tokens), "step_s": seconds / steps,
            "toks_per_s": tokens / seconds, "fetch_s": fetch / steps}


def measure(config: str, args: list[str], steps: int, warmup: int, out: Path) -> dict:
    log_every = max(1, min(10, warmup or 1))
    cfg = load_config(config, args + [f"--train.steps={steps}", f"--train.log_every={log_every}",
                                      f"--train.out_dir={out}", "--train.eval_every=0", "--train.save_every=0",
                                      "--train.resume=none", "--runtime.watchdog_s=0"])
    with contextlib.redirect_stdout(sys.stderr):
        run_training(cfg)
    rows = read_csv(out / TRAIN_CSV)
    totals = interval_totals(rows, warmup)
    mem = [float(r["mem_alloc_mib"]) for r in rows if int(r["step"]) > warmup and r.get("mem_alloc_mib")]
    return {"config": config, "args": args, **totals, "peak_mem_alloc_mib": max(mem) if mem else None,
            "final_loss": float(rows[-1]["loss"])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", default="configs/train_showcase_nsa.yaml", help="config of variant A")
    p.add_argument("--b", default="configs/train_showcase.yaml", help="config of variant B")
    p.add_argument("--a-args", default="", help="overrides for A (one quoted string)")
    p.add_argument("--b-args", default="", help="overrides for B")
    p.add_argument("--common-args", default="", help="overrides for both")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    common = shlex.split(args.common_args)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, config, extra in (("A", args.a, args.a_args), ("B", args.b, args.b_args)):
            results[name] = measure(config, common + shlex.split(extra), args.steps, args.warmup, Path(tmp) / name)
    if launch_ranks()[1] != 0:
        return 0
    a, b = results["A"], results["B"]
    results["A_over_B"] = {"step_time": a["step_s"] / b["step_s"], "toks_per_s": a["toks_per_s"] / b["toks_per_s"]}
    if args.json:
        print(json.dumps(results))
        return 0
    print(f"{'variant':<8} {'step ms':>10} {'tokens/s':>12} {'fetch ms':>9} {'peak MiB':>9} {'loss':>8}  config")
    for name in ("A", "B"):
        r = results[name]
        mem = f"{r['peak_mem_alloc_mib']:.0f}" if r["peak_mem_alloc_mib"] is not None else "-"
        print(f"{name:<8} {r['step_s'] * 1e3:>10.1f} {r['toks_per_s']:>12,.0f} {r['fetch_s'] * 1e3:>9.2f} "
              f"{mem:>9} {r['final_loss']:>8.4f}  {r['config']} {' '.join(r['args'])}")
    print(f"A/B: step time x{results['A_over_B']['step_time']:.2f}, tokens/s x{results['A_over_B']['toks_per_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
