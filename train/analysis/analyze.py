"""Summarise a run from its run_YYYYMMDD_HHMMSS.json and plot it (the quick-start guide's analysis snippet, as a tool).

The command line, usage and details: train/analyze.py (its docstring).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from train.core.artifacts import RUN_SUMMARY_GLOB
from train.core.errors import ConfigError

DEFAULT_SKIP_STEPS = 50


def find_run_json(run: Path) -> Path:
    """RUN (an out_dir or a run_*.json) -> the run JSON to read (the newest in a directory)."""
    if run.is_file():
        return run
    if not run.is_dir():
        raise ConfigError(f"{run} does not exist (expected a trainer out_dir or a run_*.json)")
    found = sorted(run.glob(RUN_SUMMARY_GLOB))
    if not found:
        raise ConfigError(f"{run} holds no run_*.json (the trainer writes one at each checkpoint and at the end)")
    return found[-1]


def load_run(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not a readable run JSON ({exc})") from None
    if not isinstance(data, dict) or "training_iterations" not in data:
        raise ConfigError(f"{path}: no training_iterations (not a run_*.json written by the trainer)")
    return data


def _num(value) -> float | None:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _series(rows: list[dict], key: str) -> list[float]:
    return [v for v in (_num(r.get(key)) for r in rows) if v is not None]


def tokens_per_iter(run: dict) -> int:
    t = run["config"]["train"]
    world = int((run.get("hardware") or {}).get("world_size") or 1)
    return t["batch_size"] * t["accumulate_grad_batches"] * world * t["seq_len"]


def summarize(run: dict, *, skip_steps: int = DEFAULT_SKIP_STEPS, target_tokens: float | None = None) -> dict:
    """Averages after warm-up, peaks, and the extrapolation to target_tokens, as a JSON-able dict."""
    rows = run["training_iterations"]
    warm = [r for r in rows if (r.get("iter") or 0) > skip_steps]
    note = None
    if not warm:
        warm = rows[1:] if len(rows) > 1 else rows
        note = f"run shorter than --skip-steps {skip_steps}: left out only the first log interval"
    tps, mfu, dt = _series(warm, "toks_per_s"), _series(warm, "mfu"), _series(warm, "dt_step_s")
    mem, reserved, tflops = _series(rows, "mem_alloc_mib"), _series(rows, "mem_reserved_mib"), _series(warm, "tflops")
    hw = run.get("hardware") or {}
    world = int(hw.get("world_size") or 1)
    tpi = tokens_per_iter(run)
    evals = [e for e in run.get("eval_steps") or [] if _num(e.get("val_loss")) is not None]
    out = {
        "device": hw.get("device_name"), "world_size": world,
        "calculation_method": run.get("calculation_method"), "flops_per_token": run.get("flops_per_token"),
        "intervals": len(rows), "intervals_averaged": len(warm), "skip_steps": skip_steps, "note": note,
        "steps": rows[-1]["iter"] if rows else 0, "tokens_per_iter": tpi,
        "avg_mfu": _mean(mfu), "peak_mfu": max(mfu) if mfu else None,
        "avg_toks_per_s": _mean(tps), "peak_toks_per_s": max(tps) if tps else None,
        "avg_toks_per_s_per_gpu": _mean(tps) / world if tps else None,
        "avg_tflops_per_gpu": _mean(tflops),
        "peak_mem_alloc_gib": max(mem) / 1024 if mem else None,
        "peak_mem_reserved_gib": max(reserved) / 1024 if reserved else None,
        "avg_s_per_iter": _mean(dt),
        "final_loss": _num(rows[-1].get("loss")) if rows else None,
        "best_val_loss": min(_num(e["val_loss"]) for e in evals) if evals else None,
    }
    if target_tokens is not None:
        if target_tokens <= 0:
            raise ConfigError(f"--target-tokens must be positive, got {target_tokens:g}")
        iterations = math.ceil(target_tokens / tpi)
        out["target_tokens"] = target_tokens
        out["target_iterations"] = iterations
        rate = out["avg_toks_per_s"]
        out["target_hours"] = iterations * tpi / rate / 3600 if rate else None
    return out


def _fmt(value, spec: str, unit: str = "", none: str = "n/a") -> str:
    return none if value is None else format(value, spec) + unit


def render(summary: dict, path: Path) -> str:
    s = summary
    no_mfu = "n/a (no MFU: CPU or a GPU without a known peak)"
    lines = [
        f"analysis: {path}",
        f"  device            {s['device']} x {s['world_size']} | FLOPs/token {_fmt(s['flops_per_token'], '.3e')} "
        f"({s['calculation_method']})",
        f"  steps             {s['steps']:,} | {s['tokens_per_iter']:,} tokens/iteration | "
        f"{s['intervals_averaged']} of {s['intervals']} log intervals averaged (after step {s['skip_steps']})",
        f"  MFU               avg {_fmt(s['avg_mfu'], '.1%', none=no_mfu)}"
        + (f" | peak {_fmt(s['peak_mfu'], '.1%')}" if s["avg_mfu"] is not None else ""),
        f"  tokens/s          avg {_fmt(s['avg_toks_per_s'], ',.0f')} | peak {_fmt(s['peak_toks_per_s'], ',.0f')} | "
        f"per GPU {_fmt(s['avg_toks_per_s_per_gpu'], ',.0f')}",
        f"  TFLOP/s per GPU   {_fmt(s['avg_tflops_per_gpu'], '.1f')}",
        f"  memory            peak allocated {_fmt(s['peak_mem_alloc_gib'], '.1f', ' GiB')} | "
        f"reserved {_fmt(s['peak_mem_reserved_gib'], '.1f', ' GiB')}",
        f"  time/iteration    {_fmt(s['avg_s_per_iter'], '.3f', ' s')}",
        f"  loss              final {_fmt(s['final_loss'], '.4f')} | best val {_fmt(s['best_val_loss'], '.4f')}",
    ]
    if s.get("note"):
        lines.append(f"  note              {s['note']}")
    if "target_tokens" in s:
        hours = s["target_hours"]
        when = f"{hours:.1f} h ({hours / 24:.2f} days)" if hours is not None else "n/a (no tokens/s)"
        lines.append(f"  {s['target_tokens']:.4g} tokens    {s['target_iterations']:,} iterations, {when} at the average rate")
    return "\n".join(lines)


def write_plots(run: dict, dest: Path) -> list[Path]:
    """loss.png (train + val), throughput.png, mfu.png (when measured) under dest; returns the files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = run["training_iterations"]
    evals = run.get("eval_steps") or []

    def points(items, key):
        pts = [(i["iter"], _num(i.get(key))) for i in items]
        return [p[0] for p in pts if p[1] is not None], [p[1] for p in pts if p[1] is not None]

    plots = {
        "loss.png": ("loss", [(*points(rows, "loss"), "train", "-"), (*points(evals, "val_loss"), "val", "o-")]),
        "throughput.png": ("tokens/s (all GPUs)", [(*points(rows, "toks_per_s"), "toks_per_s", "-")]),
        "mfu.png": ("MFU", [(*points(rows, "mfu"), "mfu", "-")]),
    }
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (ylabel, lines) in plots.items():
        if not any(xs for xs, *_ in lines):
            continue
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
        for xs, ys, label, style in lines:
            if xs:
                ax.plot(xs, ys, style, label=label, linewidth=1.2, markersize=3)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(dest / name)
        plt.close(fig)
        written.append(dest / name)
    return written


def analyze(run_path: Path, *, skip_steps: int = DEFAULT_SKIP_STEPS, target_tokens: float | None = None,
            plots: bool = True) -> tuple[dict, Path, list[Path]]:
    """-> (summary, run JSON path, plot files). Writes analysis/summary.json beside the run JSON."""
    path = find_run_json(run_path)
    run = load_run(path)
    summary = summarize(run, skip_steps=skip_steps, target_tokens=target_tokens)
    dest = path.parent / "analysis"
    files = write_plots(run, dest) if plots else []
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "summary.json").write_text(json.dumps({"run_json": path.name, **summary}, indent=2) + "\n")
    return summary, path, files
