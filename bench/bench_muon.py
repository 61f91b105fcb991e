"""Muon against AdamW on the KJV twin setting: tokens to reach AdamW's final loss, and the step-time overhead.

    PYTHONPATH=. .venv/bin/python bench/bench_muon.py [--config configs/nsa_twin_kjv.yaml] [--root artifacts/muon_kjv]
        [--lrs 1e-3 2e-3 4e-3] [--only adamw|muon ...] [--steps N] [--eval-every 25] [--eval-max-tokens N]
        [--seed S] [--collect] [--json bench/results/muon_kjv.json]

Each (optimizer, lr) is one `python -m train.compare CONFIG --arms nsa,dense` under ROOT/<optimizer>_lr<lr>: the NSA
config and its dense twin (model.attention=dense), the same data, seed and token budget (the config's train.steps, or
--steps), train.lr=<lr> and train.eval_every=<E>; Muon runs take train.optimizer=muon with the config's other
settings (muon_adjust_lr=match_rms_adamw: the same lr and weight decay as AdamW, so both sweep the same lrs).
--seed S sets train.seed for every run (another seed: give it its own --root).
train.compare scores each arm on the whole validation split of data/kjv_byte (prepared first if missing: the
command in the config's header). A finished comparison is reused (the same command again resumes or skips it);
--collect only reads what is there.

Per run (optimizer, lr, arm) the JSON holds: the final whole-split loss (report.json), the val.csv curve (step,
tokens, val_loss: train.eval_steps held-out batches, the same batches in every run), the median step time
(training.csv dt_step_s over full log intervals after the first) and, for Muon runs, tokens_to_adamw_best: the
training tokens at which the run's val.csv loss first reaches the best AdamW run's (same arm) last val.csv loss,
linearly interpolated between evaluations (null: never within the budget). The summary per arm gives the best
run of each optimizer, Muon's tokens to AdamW's best as a fraction of the budget, and the step-time ratio
Muon / AdamW (medians over the lrs both optimizers ran at, run under the same conditions; runs back to back on a
shared CPU vary by several percent). Apart from the runs:
the optimizer step alone on the NSA model, one thread (AdamW; Muon as torch steps it; Muon with the trainer's
on-device skip path). Prints one JSON object; --json also writes it.
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OPTIMIZERS = ("adamw", "muon")
ARMS = ("nsa", "dense")
DATA = REPO / "data" / "kjv_byte"
PREPARE = [sys.executable, "-m", "train.data.prepare", "--source", "text:../shared/corpus/kjv.txt", "--tokenizer",
           "byte", "--out", "data/kjv_byte", "--val-fraction", "0.1"]


def run_name(optimizer: str, lr: float) -> str:
    return f"{optimizer}_lr{lr:g}"


def overrides(optimizer: str, lr: float, steps: int | None, eval_every: int, seed: int | None = None) -> list[str]:
    args = [f"--train.optimizer={optimizer}", f"--train.lr={lr:g}", f"--train.eval_every={eval_every}"]
    return args + ([f"--train.steps={steps}"] if steps else []) + ([f"--train.seed={seed}"] if seed is not None else [])


def compare(config: str, out: Path, args: list[str], eval_max_tokens: int | None) -> int:
    if (out / "report.json").is_file():
        print(f"{out.name}: done ({out / 'report.json'})", flush=True)
        return 0
    cmd = [sys.executable, "-m", "train.compare", config, "--out", str(out), "--arms", ",".join(ARMS), *args]
    if eval_max_tokens:
        cmd += ["--eval_max_tokens", str(eval_max_tokens)]
    print("$", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=REPO).returncode


def read_rows(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def curve(out_dir: Path, tokens_per_step: int) -> list[dict]:
    """val.csv as [{step, tokens, val_loss}]."""
    return [{"step": int(r["step"]), "tokens": int(r["step"]) * tokens_per_step, "val_loss": float(r["val_loss"])}
            for r in read_rows(out_dir / "val.csv")]


def step_time(out_dir: Path) -> float | None:
    """Median dt_step_s over full log intervals, the first left out (warm-up) unless it is the only one."""
    rows = [r for r in read_rows(out_dir / "training.csv") if r.get("dt_step_s") and r.get("interval_steps")]
    longest = max((int(r["interval_steps"]) for r in rows), default=0)
    full = [float(r["dt_step_s"]) for r in rows if int(r["interval_steps"]) == longest]
    full = full[1:] if len(full) > 1 else full
    return statistics.median(full) if full else None


def tokens_to_reach(points: list[dict], target: float) -> float | None:
    """Training tokens at which the curve first reaches `target` (linear between evaluations), or None."""
    previous = None
    for point in points:
        if point["val_loss"] <= target:
            if previous is None:
                return float(point["tokens"])
            (t0, l0), (t1, l1) = (previous["tokens"], previous["val_loss"]), (point["tokens"], point["val_loss"])
            return t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
        previous = point
    return None


def collect_run(root: Path, optimizer: str, lr: float) -> list[dict]:
    """One comparison's runs (one per arm), or [] when it has no report yet."""
    path = root / run_name(optimizer, lr) / "report.json"
    if not path.is_file():
        return []
    report = json.loads(path.read_text(encoding="utf-8"))
    runs = []
    for arm in ARMS:
        summary = report["arms"][arm]
        out_dir = Path(summary["out_dir"])
        steps = int(summary["step"])
        per_step = int(summary["tokens_seen"]) // steps
        runs.append({"optimizer": optimizer, "lr": lr, "arm": arm, "out_dir": str(out_dir), "steps": steps,
                     "tokens": summary["tokens_seen"], "params": summary["params"],
                     "final_loss": summary["eval"]["loss"], "eval_tokens": summary["eval"]["tokens"],
                     "curve": curve(out_dir, per_step), "dt_step_s": step_time(out_dir)})
    return runs


def summarize(runs: list[dict]) -> dict:
    """Per arm: the best run of each optimizer (final whole-split loss), Muon's tokens to AdamW's best, step times."""
    out = {}
    for arm in ARMS:
        mine = [r for r in runs if r["arm"] == arm]
        adamw = [r for r in mine if r["optimizer"] == "adamw" and r["curve"]]
        muon = [r for r in mine if r["optimizer"] == "muon"]
        if not adamw:
            continue
        best_adamw = min(adamw, key=lambda r: r["curve"][-1]["val_loss"])
        target = best_adamw["curve"][-1]["val_loss"]
        for run in muon:
            reached = tokens_to_reach(run["curve"], target)
            run["tokens_to_adamw_best"] = reached
            run["fraction_of_budget"] = reached / run["tokens"] if reached is not None else None
        paired = {r["lr"] for r in mine if r["optimizer"] == "adamw"} & {r["lr"] for r in mine if r["optimizer"] == "muon"}
        times = {opt: [r["dt_step_s"] for r in mine if r["optimizer"] == opt and r["dt_step_s"] and r["lr"] in paired]
                 for opt in OPTIMIZERS}
        median = {opt: statistics.median(t) if t else None for opt, t in times.items()}
        best = {opt: min((r for r in mine if r["optimizer"] == opt), key=lambda r: r["final_loss"], default=None)
                for opt in OPTIMIZERS}
        out[arm] = {
            "adamw_best_val_csv_loss": target, "adamw_best_val_csv_lr": best_adamw["lr"],
            "best_final_loss": {opt: (r["final_loss"], r["lr"]) if r else None for opt, r in best.items()},
            "muon_tokens_to_adamw_best": {f"{r['lr']:g}": r.get("tokens_to_adamw_best") for r in muon},
            "dt_step_s_median": median, "step_time_lrs": sorted(paired),
            "muon_step_time_ratio": median["muon"] / median["adamw"] if median["muon"] and median["adamw"] else None,
        }
    return out


def optimizer_step_ms(config: str, repeats: int = 20) -> dict:
    """The optimizer step alone on the config's model (1 thread, fixed gradients, median of `repeats`): AdamW,
    MuonAdamW with torch.optim.Muon's own step (no found_inf), and with the skip path's masked step (found_inf 0),
    which the trainer runs. The difference of the last two is what the on-device skip costs."""
    import time

    import torch

    from nsa.model import Transformer
    from train.core.config import load_config
    from train.trainer.optim import build_optimizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {}
        for name, optimizer, found_inf in (("adamw", "adamw", None), ("muon_unmasked", "muon", None),
                                           ("muon_masked", "muon", torch.zeros(()))):
            cfg = load_config(config, ["--runtime.device=cpu", f"--train.optimizer={optimizer}"])
            model = Transformer(cfg.model)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 1e-3
            opt = build_optimizer(model, cfg.train, "cpu")
            inner = getattr(opt, "optim", opt)
            times = []
            for _ in range(repeats + 2):
                inner.found_inf = found_inf
                t0 = time.perf_counter()
                opt.step()
                times.append(time.perf_counter() - t0)
            out[name] = 1e3 * statistics.median(times[2:])
        return out
    finally:
        torch.set_num_threads(threads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/nsa_twin_kjv.yaml")
    ap.add_argument("--root", type=Path, default=Path("artifacts/muon_kjv"))
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 2e-3, 4e-3])
    ap.add_argument("--only", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS), help="these optimizers")
    ap.add_argument("--steps", type=int, default=None, help="train.steps of every run (default: the config's)")
    ap.add_argument("--eval-every", type=int, default=25, help="train.eval_every (capped at the run's steps)")
    ap.add_argument("--eval-max-tokens", type=int, default=None, help="score the first N validation tokens only "
                    "(smoke tests; default: the whole split)")
    ap.add_argument("--seed", type=int, default=None, help="train.seed of every run (default: the config's)")
    ap.add_argument("--collect", action="store_true", help="only read the comparisons already under --root")
    ap.add_argument("--json", help="also write the JSON here (e.g. bench/results/muon_kjv.json)")
    args = ap.parse_args()
    root = args.root if args.root.is_absolute() else REPO / args.root
    if not args.collect:
        if not (DATA / "meta.json").is_file():
            print("$", " ".join(PREPARE), flush=True)
            if subprocess.run(PREPARE, cwd=REPO).returncode != 0:
                sys.exit("error: preparing data/kjv_byte failed")
        eval_every = min(args.eval_every, args.steps) if args.steps else args.eval_every
        for optimizer in args.only:
            for lr in args.lrs:
                out = root / run_name(optimizer, lr)
                if compare(args.config, out, overrides(optimizer, lr, args.steps, eval_every, args.seed),
                           args.eval_max_tokens):
                    sys.exit(f"error: {out.name} failed (see {out / 'logs'})")
    runs = [run for optimizer in args.only for lr in args.lrs for run in collect_run(root, optimizer, lr)]
    result = {"config": args.config, "root": str(root), "lrs": args.lrs, "steps": args.steps, "seed": args.seed,
              "eval_max_tokens": args.eval_max_tokens, "summary": summarize(runs),
              "optimizer_step_ms_1_thread": optimizer_step_ms(args.config), "runs": runs}
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
